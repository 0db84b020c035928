"""What the front end's unit tests share: a detokenizer over a fixed vocabulary and an engine's end of
a tracked request, so the messages and the coordinator tests read the same text for the same tokens."""

from __future__ import annotations

from typing import Any

import anyio

from clients.protocol import Submit
from scheduler.control import Control
from scheduler.flight import Flight
from scheduler.intake import Intake
from scheduler.outputs import Outputs
from scheduler.requests import Tracked
from scheduler.settings import FrontEndSettings
from scheduler.stats import Counters
from scheduler.tenants import TenantTable
from scheduler.transport import Transport
from workers.api import Finished, Job, ModelInfo, Timings


class _Detok:
    """A detokenizer over a fixed vocabulary: each token is one piece of text."""

    def __init__(self, vocab: dict[int, str]) -> None:
        self.vocab = vocab
        self.last_segment = ""

    def add_token(self, tok: int) -> None:
        self.last_segment = self.vocab[tok]

    def finalize(self) -> None:
        self.last_segment = ""


VOCAB = {1: "Hel", 2: "lo", 3: " EN", 4: "D more", 5: "!"}


def _finished(t: Tracked, reason: str = "length", **kw: Any) -> Finished:
    return Finished(t.seq, reason, t.prompt_tokens, t.completion_tokens, Timings(0.1, 0.2, 0.3, 0.6), **kw)  # type: ignore[arg-type]


class _Engine:
    """An engine handle that only records what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def snapshot(self) -> dict[str, Any]:
        return {}

    def submit(self, job: Job) -> None:
        self.calls.append(("submit", job.seq))

    def cancel(self, seq: int, reason: str = "cancelled", code: str | None = None, message: str | None = None) -> None:
        self.calls.append(("cancel", seq, reason, code))

    def pause(self, seq: int) -> None:
        self.calls.append(("pause", seq))

    def resume(self, seq: int) -> None:
        self.calls.append(("resume", seq))

    def shutdown(self, reason: str = "error", code: str = "shutdown", message: str = "") -> None:
        self.calls.append(("shutdown",))

    def submitted(self) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "submit"]


class Tokenizer:
    @property
    def detokenizer(self) -> _Detok:
        return _Detok(VOCAB)


INFO = ModelInfo("m", "m", "llama", 100, 1000, (0,), False, kv_bytes_per_token=10)


class Parts:
    """The front end's parts wired as ``FrontEnd`` wires them, around a recording engine, with the
    model already loaded; connections are in-process, so every message sent can be read back."""

    def __init__(self, table: TenantTable | None = None, **settings: Any) -> None:
        self.settings = FrontEndSettings("ipc:///unused", **settings)
        self.counters = Counters()
        self.transport = Transport(
            self.settings.listen,
            max_frame_bytes=self.settings.max_frame_bytes,
            max_unsent_per_client=self.settings.max_unsent_per_client,
            on_gone=lambda client, why: self.control.drop_client(client, why),
            on_pause=lambda client, paused: self.control.set_paused(client, paused),
        )
        self.flight = Flight(self.settings, Outputs(), self.transport.send, self.transport.is_paused)
        self.control = Control(self.settings, self.flight, self.transport, self.counters)
        self.intake = Intake(self.settings, self.flight, self.transport, self.control, self.counters)
        self.engine = _Engine()
        self.flight.engine = self.engine
        self.flight.info, self.flight.tokenizer = INFO, Tokenizer()
        if table is not None:
            self.flight.table = table
        self.inbox: dict[bytes, Any] = {}

    def connect(self, client: bytes) -> None:
        self.inbox[client] = self.transport.open_local(client)

    def submit(self, client: bytes, tenant: str, rid: str, max_tokens: int = 2) -> Tracked:
        self.intake.submit(
            client, self.flight.table.tenants[tenant], Submit(rid, tokens=[1, 2, 3], max_tokens=max_tokens)
        )
        t = self.flight.requests.get((tenant, client, rid))
        assert t is not None
        return t

    def received(self, client: bytes) -> list[dict[str, Any]]:
        out = []
        while True:
            try:
                out.append(self.inbox[client].receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):  # nothing more now, or the connection was forgotten
                return out
