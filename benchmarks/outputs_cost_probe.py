"""What the front end spends turning one engine token event into its wire message (``Outputs.tokens``),
per event, for one request's stream of one-token events (a decode step's share of a request).

    python benchmarks/outputs_cost_probe.py                 # the demo model's tokenizer
    python benchmarks/outputs_cost_probe.py --model /tmp/m8b

The request has no stop strings and asks for no logprobs (the common case); its detokenizer is the
model's streaming one, as the daemon makes it. Best of ``--repeats`` runs of ``--tokens`` events.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.protocol import Submit  # noqa: E402
from scheduler.outputs import Outputs  # noqa: E402
from scheduler.requests import Tracked  # noqa: E402
from workers.jobs import Tokens  # noqa: E402
from workers.models import load_tokenizer  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    tokenizer = load_tokenizer(a.model)
    ids = [32 + i % 90 for i in range(a.tokens)]  # printable bytes on the demo; some id elsewhere
    best = float("inf")
    for _ in range(a.repeats):
        outputs = Outputs()
        t = Tracked(b"c", "local", "r" * 32, 1, 0.0, Submit(id="r", tokens=[1]))
        t.detok = tokenizer.detokenizer
        t.detok.reset()
        events = [Tokens(1, [tok]) for tok in ids]
        tic = time.perf_counter()
        for ev in events:
            outputs.tokens(t, ev)
        best = min(best, (time.perf_counter() - tic) / a.tokens)
    print(f"Outputs.tokens: {best * 1e6:.2f} us a one-token event (best of {a.repeats} x {a.tokens})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
