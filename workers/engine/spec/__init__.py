"""Speculative decoding inside the engine: a proposer (``drafters``: a draft model, prompt lookup or an
MTP head) drafts K tokens, the target verifies them in one forward of K + 1 rows, and the accept rule
(``accept``) keeps the longest prefix classic decode would have produced. ``runner`` runs a burst's
rounds on the lone sequence (``rounds``: one round); ``policy`` decides when bursts pay (the adaptive
gate, the audits); ``lookahead`` builds the next round's verify while this one runs; ``kv_state``
undoes a guess; ``controls`` applies a request's logits processors and grammar mask to the verify's
rows, position by position, so a controlled request bursts with classic decode's output.

It lives inside ``workers.engine`` because a burst is a mode of the engine's step: it works on the
engine's sequences (``workers.engine.sequences``) and samplers (``workers.engine.sampling``).
"""

from __future__ import annotations

from workers.engine.spec.drafters import Drafter, load_drafter, load_mtp_drafter
from workers.engine.spec.policy import Adaptive, BurstCounters, BurstSeq, Gate, emit_in_order
from workers.engine.spec.runner import BurstRunner

__all__ = [
    "Adaptive",
    "BurstCounters",
    "BurstRunner",
    "BurstSeq",
    "Drafter",
    "Gate",
    "emit_in_order",
    "load_drafter",
    "load_mtp_drafter",
]
