"""The engine process's submit, as defence in depth behind the wire's range checks: a job msgpack
cannot carry ends that one request with ``bad_field``, and never raises into the daemon."""

from __future__ import annotations

import os
from typing import Any

from scheduler.engine_process import EngineProcess
from workers.api import Finished, FinishReason, Job, SamplingParams


def test_a_job_msgpack_cannot_carry_ends_that_request_not_the_daemon() -> None:
    emitted: list[Any] = []
    handle = EngineProcess("unused", None, emitted.extend)  # never started: nothing is loaded
    try:
        handle.submit(Job(seq=7, prompt=[1, 2, 3], max_tokens=4, sampling=SamplingParams(top_k=2**64)))
        handle.submit(Job(seq=8, prompt=[1], max_tokens=4, stop_token_ids=(-(2**63) - 1,)))
        handle.submit(Job(seq=9, prompt=[1], max_tokens=4))  # a good one is sent (to no child yet)
    finally:
        handle._close()
        assert handle._pipe is not None  # never started: this process still holds both ends
        for fd in handle._pipe:
            os.close(fd)
    assert [type(s) for s in emitted] == [Finished, Finished]
    for signal, seq, prompt in zip(emitted, (7, 8), (3, 1)):
        assert (signal.seq, signal.reason, signal.error_code) == (seq, FinishReason.ERROR, "bad_field")
        assert (signal.prompt_tokens, signal.completion_tokens) == (prompt, 0)
        assert "cannot be sent to the engine" in signal.error_message
