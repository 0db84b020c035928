"""Bars of ``client_cost_probe.py`` results: CPU a token by process, one group of bars a label.

    python benchmarks/client_cost_plot.py --out docs/bench/cpu-s30/cost/cost.png \\
        before=docs/bench/cpu-s30/cost/before-tokens-1.json,docs/bench/cpu-s30/cost/before-tokens-2.json \\
        after=docs/bench/cpu-s30/cost/after-tokens-1.json

Each label's bar is the median over its files' trials; the whiskers, their min and max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PROCESSES = ("client", "front_end_loop")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("groups", nargs="+", help="LABEL=FILE[,FILE...]")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(a.groups)
    for g, spec in enumerate(a.groups):
        label, _, files = spec.partition("=")
        trials = [r for f in files.split(",") for r in json.loads(Path(f).read_text())["rows"]]
        for x, proc in enumerate(PROCESSES):
            values = [r["us_per_token"][proc] for r in trials]
            mid = statistics.median(values)
            ax.bar(x + g * width, mid, width, color=f"C{g}", label=label if x == 0 else None)
            ax.errorbar(x + g * width, mid, yerr=[[mid - min(values)], [max(values) - mid]], color="k", capsize=3)
    ax.set_xticks([x + width * (len(a.groups) - 1) / 2 for x in range(len(PROCESSES))])
    ax.set_xticklabels(["client", "front end (event loop thread)"])
    ax.set_ylabel("CPU µs a token (median of trials, whiskers min-max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
