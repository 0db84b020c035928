"""Daemon / engine alone against B for several ``mlx-batchd bench`` runs, one line each: how a change
to the daemon moved its cost, read from the benches' own JSON (ratio of medians, whiskers the range
the two arms' samples allow).

    python benchmarks/ratio_plot.py r/split=split r/os="OS places" --out daemon_vs_engine.png

(``r/split`` and ``r/os``: two ``mlx-batchd bench --out`` folders.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="FOLDER=LABEL: a bench's --out folder and its line's label")
    p.add_argument("--target", type=float, default=0.97, help="a horizontal line at this ratio (0: none)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for spec in a.runs:
        folder, _, label = spec.partition("=")
        rows = json.loads((Path(folder) / "daemon_vs_raw.json").read_text())["rows"]
        rows = [r for r in rows if r.get("vs_engine") is not None]
        bs = [r["batch"] for r in rows]
        mid = [r["vs_engine"] for r in rows]
        lo = [m - r["vs_engine_spread"][0] for m, r in zip(mid, rows)]
        hi = [r["vs_engine_spread"][1] - m for m, r in zip(mid, rows)]
        ax.errorbar(bs, mid, yerr=[lo, hi], marker="o", capsize=3, label=label or folder)
    if a.target:
        ax.axhline(a.target, color="grey", linestyle=":", label=f"target {a.target:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences (B)")
    ax.set_ylabel("daemon / engine alone (tok/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
