"""The exactness room: the probe (is a verify block byte-identical to classic decode, and at which
kernel level?), its verdicts and where they are stored, pins (forwards run at a verdict's level)
and their cost, and the verify warm-up."""

from __future__ import annotations

from workers.exact.draws import (
    paced,
    prefill_chunk,
    within_draw,
)
from workers.exact.pin_cost import (
    bucket,
)
from workers.exact.pin_cost import (
    summary as pin_cost_summary,
)
from workers.exact.pins import (
    CountedModel,
    PinLedger,
    pinned,
    unpinned,
)
from workers.exact.probe import (
    drive,
    failed_verdict,
    make_draws,
    probe,
    probe_steps,
    sliding_window,
)
from workers.exact.results import (
    Verdict,
)
from workers.exact.setup import (
    ProbeSetup,
    probe_setup,
)
from workers.exact.verdict_store import (
    VerdictStore,
)
from workers.exact.verdicts import (
    Verdicts,
)
from workers.exact.verify_warmup import (
    block_lengths,
)

__all__ = [
    "CountedModel",
    "PinLedger",
    "ProbeSetup",
    "Verdict",
    "VerdictStore",
    "Verdicts",
    "block_lengths",
    "bucket",
    "drive",
    "failed_verdict",
    "make_draws",
    "paced",
    "pin_cost_summary",
    "pinned",
    "prefill_chunk",
    "probe",
    "probe_setup",
    "probe_steps",
    "sliding_window",
    "unpinned",
    "within_draw",
]
