"""Engine events to wire messages: detokenizing, stop strings, usage, outcomes and latency histograms.

Everything here is a pure step on one request's state (``Tracked``) plus the observations it
records; it sends nothing and tells the engine nothing. The front end asks for the messages, sends
them, and acts on what comes back (a stop string that matched means cancelling the sequence).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from clients.messages import empty_timings, empty_usage, end_message, token_message
from clients.protocol import ErrorCode, FinishReason
from scheduler.observations import Observations
from scheduler.requests import Tracked
from workers.api import Finished, StepInfo, StepKind, Tokens

Error = tuple[ErrorCode, str]


@dataclass
class Outputs:
    """Turns a request's engine events into its ``token`` and ``end`` messages, and keeps the
    per-tenant outcome counts and the latency histograms those events feed."""

    obs: Observations = field(default_factory=Observations)
    #: Per tenant: ``stop`` / ``length`` / ``cancelled``, or the error code (a bounded set).
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    completed: int = 0

    def step(self, sig: StepInfo) -> None:
        self.obs.step.labels(sig.kind).observe(sig.seconds)
        if sig.kind == StepKind.DECODE:
            self.obs.batch.observe(sig.batch_size)

    def tokens(self, t: Tracked, ev: Tokens) -> tuple[dict[str, Any], bool]:
        """The ``token`` message for ``ev`` and whether a stop string matched in it. Text is cut
        before a stop string and tokens after the one that completed it are left out; on a match
        ``t.stopped`` is set, and the caller ends the sequence."""
        n = len(ev.tokens)
        detok = t.detok
        if t.stops is None:  # every token goes out: no stop string can cut them
            out_tokens, out_lps = ev.tokens, ev.logprobs
            out_tops: list[list[tuple[int, float]]] | None = ev.top_logprobs
            text_parts = []
            for tok in out_tokens:
                detok.add_token(tok)
                text_parts.append(detok.last_segment)
            text = "".join(text_parts)
        else:
            out_tokens, text_parts = [], []
            out_lps = [] if ev.logprobs is not None else None
            out_tops = [] if ev.top_logprobs is not None else None
            for i, tok in enumerate(ev.tokens):
                out_tokens.append(tok)
                if out_lps is not None and ev.logprobs is not None:
                    out_lps.append(ev.logprobs[i])
                if out_tops is not None and ev.top_logprobs is not None:
                    out_tops.append(ev.top_logprobs[i])
                detok.add_token(tok)
                segment, hit = t.stops.feed(detok.last_segment)
                text_parts.append(segment)
                if hit:
                    t.stopped = True
                    break
            text = "".join(text_parts)
        t.completion_tokens += len(out_tokens)
        now = time.monotonic()
        counts = self.obs.tokens
        if t.last_token_at is not None and n:
            counts.observe_gap((now - t.last_token_at) / n, n)  # a step's tokens share its gap
        t.last_token_at = now
        counts.generated(ev.mode, n)
        calls = t.calls.feed(text).calls if t.calls is not None else None
        return token_message(t.rid, out_tokens, text, out_lps, out_tops, calls), t.stopped

    def finished(self, t: Tracked, ev: Finished) -> list[dict[str, Any]]:
        """The messages that end ``t`` after the engine's ``Finished``: the text the detokenizer and
        stop strings still held (if any, and if ``t`` may still receive text), then its ``end``.
        Nothing for a request whose connection is gone; its outcome is counted all the same."""
        out: list[dict[str, Any]] = []
        reason = FinishReason.STOP if t.stopped else FinishReason(ev.reason)
        if not (t.stopped or t.muted or t.detached):
            t.detok.finalize()
            tail = t.detok.last_segment
            if t.stops is not None:
                tail, hit = t.stops.feed(tail)
                tail += "" if hit else t.stops.flush()
                reason = FinishReason.STOP if hit else reason
            calls = None
            if t.calls is not None:  # the calls the tail completes, and one its end never closed
                calls = t.calls.feed(tail).calls + t.calls.flush().calls
            if tail or calls:
                out.append(token_message(t.rid, [], tail, [] if t.req.logprobs else None, None, calls))
        error = None
        if ev.error_code is not None:
            error = (ErrorCode(ev.error_code), ev.error_message or ev.error_code)
        usage = {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens}
        self.completed += 1
        self.count_outcome(t.tenant, reason, error)
        for hist, value in (
            (self.obs.ttft, ev.timings.ttft_s),
            (self.obs.e2e, ev.timings.total_s),
            (self.obs.queue, ev.timings.queue_s),
        ):
            if value is not None:
                hist.observe(value)
        if t.detached:
            return []
        out.append(end_message(t.rid, reason, usage, ev.timings.as_dict(), error))
        return out

    def ended_here(
        self, t: Tracked, reason: FinishReason, error: Error | None, retry_after_s: float | None = None
    ) -> dict[str, Any] | None:
        """The ``end`` of a request the engine does not hold (refused, waiting, or after the engine
        stopped), counted; ``None`` when its connection is gone."""
        timings = empty_timings()
        timings["total_s"] = time.monotonic() - t.received_at
        usage = empty_usage(t.prompt_tokens)
        usage["completion_tokens"] = t.completion_tokens
        self.count_outcome(t.tenant, reason, error)
        if t.detached:
            return None
        return end_message(t.rid, reason, usage, timings, error, retry_after_s)

    def count_outcome(self, tenant: str, reason: FinishReason, error: Error | None) -> None:
        outcome = error[0].value if error is not None else reason.value
        per = self.outcomes.setdefault(tenant, {})
        per[outcome] = per.get(outcome, 0) + 1


def refused_submit_end(rid: str, error: Error) -> dict[str, Any]:
    """The one ``end`` answering a submit that never became a request (unreadable fields)."""
    timings = empty_timings()
    timings["total_s"] = 0.0
    return end_message(rid, FinishReason.ERROR, empty_usage(), timings, error)
