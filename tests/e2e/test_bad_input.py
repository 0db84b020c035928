"""Hostile and careless input over a raw DEALER socket: every message gets its stable code,
and a good request running alongside completes byte-exact."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from clients import Client
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from tests.conftest import TEST_CONTEXT, Daemon
from tests.reference import greedy_reference

LIMIT = 65536  # the fixture's --max-frame-bytes


class Raw:
    """A bare DEALER socket, for sending what the client library never would."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.connect(address)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self) -> dict[str, Any]:
        return unpack(self.sock.recv(), max_bytes=1 << 30)

    def until_end(self, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        tokens = []
        while True:
            msg = self.recv()
            assert msg["id"] == rid, msg
            if msg["type"] == "end":
                return tokens, msg
            tokens.append(msg)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def submit(rid: Any = "r", **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "submit", "id": rid, **fields}


def deep_frame(field: str, depth: int, **fields: Any) -> bytes:
    """A message whose ``field`` is a list nested ``depth`` deep: past what msgpack's packer
    writes, so the frame is assembled by hand."""
    placeholder = "\x00deep\x00"
    frame = pack({**fields, field: placeholder})
    return frame.replace(msgpack.packb(placeholder), b"\x91" * depth + b"\x01")


U64 = 2**64 - 1  # the largest integer msgpack carries

# (name, frame, reply type, code, reply id)
ERROR_CASES: list[tuple[str, bytes, str, str, str | None]] = [
    ("not msgpack", b"\xc1\xff\x00garbage", "error", "malformed", None),
    ("truncated msgpack", pack(submit(prompt="hello"))[:-3], "error", "malformed", None),
    ("not a map", pack([1, 2, 3]), "error", "malformed", None),
    ("binary map keys", msgpack.packb({b"v": 1}, use_bin_type=True), "error", "malformed", None),
    ("wrong version", pack({"v": 99, "type": "health", "id": "h"}), "error", "bad_version", "h"),
    ("no version", pack({"type": "health", "id": "h"}), "error", "bad_version", "h"),
    ("unknown type", pack({"v": 1, "type": "frobnicate", "id": "u"}), "error", "unknown_type", "u"),
    ("missing type", pack({"v": 1, "id": "u"}), "error", "missing_field", "u"),
    ("missing id", pack({"v": 1, "type": "submit", "prompt": "hi"}), "error", "missing_field", None),
    ("id not a string", pack(submit(rid=12, prompt="hi")), "error", "bad_field", None),
    ("id too long", pack(submit(rid="x" * 500, prompt="hi")), "error", "bad_field", None),
    ("no prompt", pack(submit(max_tokens=4)), "end", "missing_field", "r"),
    ("two prompts", pack(submit(prompt="a", tokens=[5])), "end", "bad_field", "r"),
    ("empty text prompt", pack(submit(prompt="")), "end", "empty_prompt", "r"),
    ("empty token prompt", pack(submit(tokens=[])), "end", "empty_prompt", "r"),
    ("empty chat", pack(submit(messages=[])), "end", "empty_prompt", "r"),
    ("tokens not ints", pack(submit(tokens=[1, "a"])), "end", "bad_field", "r"),
    ("tokens as bools", pack(submit(tokens=[True])), "end", "bad_field", "r"),
    ("max_tokens a string", pack(submit(tokens=[5], max_tokens="ten")), "end", "bad_field", "r"),
    ("max_tokens a float", pack(submit(tokens=[5], max_tokens=2.5)), "end", "bad_field", "r"),
    ("temperature negative", pack(submit(tokens=[5], temperature=-1.0)), "end", "bad_field", "r"),
    ("temperature NaN", pack(submit(tokens=[5], temperature=float("nan"))), "end", "bad_field", "r"),
    ("top_p zero", pack(submit(tokens=[5], top_p=0.0)), "end", "bad_field", "r"),
    ("top_k negative", pack(submit(tokens=[5], top_k=-3)), "end", "bad_field", "r"),
    ("seed negative", pack(submit(tokens=[5], seed=-1)), "end", "bad_field", "r"),
    ("stop not strings", pack(submit(tokens=[5], stop=[1])), "end", "bad_field", "r"),
    ("message without role", pack(submit(messages=[{"content": "x"}])), "end", "bad_field", "r"),
    ("token out of vocab", pack(submit(tokens=[5, 260])), "end", "token_out_of_range", "r"),
    ("negative token", pack(submit(tokens=[-1])), "end", "token_out_of_range", "r"),
    ("stop token out of vocab", pack(submit(tokens=[5], stop_token_ids=[10**6])), "end", "bad_field", "r"),
    ("prompt longer than context", pack(submit(tokens=[5] * (TEST_CONTEXT + 10))), "end", "prompt_too_long", "r"),
    ("text prompt longer than context", pack(submit(prompt="a" * (TEST_CONTEXT + 1))), "end", "prompt_too_long", "r"),
    ("max_tokens zero", pack(submit(tokens=[5], max_tokens=0)), "end", "max_tokens_out_of_range", "r"),
    ("max_tokens negative", pack(submit(tokens=[5], max_tokens=-5)), "end", "max_tokens_out_of_range", "r"),
    ("max_tokens above cap", pack(submit(tokens=[5], max_tokens=201)), "end", "max_tokens_out_of_range", "r"),
    ("max_tokens past context", pack(submit(tokens=[5] * 300, max_tokens=100)), "end", "max_tokens_out_of_range", "r"),
    ("cancel of unknown id", pack({"v": 1, "type": "cancel", "id": "nobody"}), "error", "unknown_request_id", "nobody"),
    ("top_k 2**64-1", pack(submit(tokens=[5], top_k=U64)), "end", "bad_field", "r"),
    ("top_k 2**31", pack(submit(tokens=[5], top_k=2**31)), "end", "bad_field", "r"),
    ("seed 2**64-1", pack(submit(tokens=[5], seed=U64)), "end", "bad_field", "r"),
    ("max_tokens 2**64-1", pack(submit(tokens=[5], max_tokens=U64)), "end", "max_tokens_out_of_range", "r"),
    ("token 2**64-1", pack(submit(tokens=[5, U64])), "end", "token_out_of_range", "r"),
    ("stop token -2**63", pack(submit(tokens=[5], stop_token_ids=[-(2**63)])), "end", "bad_field", "r"),
    ("priority 2**64-1", pack(submit(tokens=[5], priority=U64)), "end", "bad_field", "r"),
    ("top_logprobs 2**64-1", pack(submit(tokens=[5], top_logprobs=U64)), "end", "bad_field", "r"),
    ("group_size 2**64-1", pack(submit(tokens=[5], group="g", group_size=U64)), "end", "bad_field", "r"),
    ("temperature -2**63", pack(submit(tokens=[5], temperature=-(2**63))), "end", "bad_field", "r"),
    ("top_p 2**64-1", pack(submit(tokens=[5], top_p=U64)), "end", "bad_field", "r"),
    ("min_p infinite", pack(submit(tokens=[5], min_p=float("inf"))), "end", "bad_field", "r"),
    ("version nested 1000 deep", deep_frame("v", 1000, type="health", id="h"), "error", "bad_version", "h"),
    ("type nested 1000 deep", deep_frame("type", 1000, v=1, id="u"), "error", "unknown_type", "u"),
    ("top_k nested 1000 deep", deep_frame("top_k", 1000, **submit(tokens=[5])), "end", "bad_field", "r"),
    ("oversize frame", pack(submit(prompt="a" * (LIMIT + 10))), "error", "frame_too_large", None),
]


@pytest.fixture()
def raw(daemon: Daemon) -> Any:
    r = Raw(daemon.address)
    yield r
    r.close()


@pytest.fixture()
def good_request(daemon: Daemon, tiny_model: Path) -> Any:
    """A long, valid request that runs through every bad-input test and must come out exact."""
    prompt = [7, 8, 9, 10, 11]
    result: dict[str, Any] = {}

    def run() -> None:
        with Client(daemon.address, timeout=120) as c:
            result["r"] = c.generate(tokens=prompt, max_tokens=60)

    thread = threading.Thread(target=run)
    thread.start()
    yield
    thread.join(timeout=120)
    assert result["r"].tokens == greedy_reference(tiny_model, prompt, 60)[0]


@pytest.mark.parametrize("name,frame,kind,code,rid", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_message_gets_its_code(
    raw: Raw, good_request: None, name: str, frame: bytes, kind: str, code: str, rid: str | None
) -> None:
    raw.send(frame)
    reply = raw.recv()
    assert reply["type"] == kind, reply
    error = reply["error"] if kind == "end" else reply
    assert error["code"] == code, reply
    assert error["message"]  # says what to fix
    assert reply["id"] == rid
    if kind == "end":
        assert reply["finish_reason"] == "error"


def test_multipart_message_is_refused(raw: Raw, good_request: None) -> None:
    raw.send(pack(submit(tokens=[5])), b"extra")
    reply = raw.recv()
    assert reply["type"] == "error" and reply["code"] == "bad_frames"


def test_duplicate_request_id_leaves_the_first_alone(raw: Raw, good_request: None, tiny_model: Path) -> None:
    raw.send(pack(submit(rid="same", tokens=[3, 4, 5], max_tokens=40)))
    raw.send(pack(submit(rid="same", tokens=[3, 4, 5], max_tokens=40)))
    events, end = [], None
    refusals = []
    while end is None:
        msg = raw.recv()
        if msg["type"] == "error":
            refusals.append(msg)
        elif msg["type"] == "end":
            end = msg
        else:
            events.append(msg)
    assert [r["code"] for r in refusals] == ["duplicate_request_id"]
    assert end["finish_reason"] in ("length", "stop")
    assert [t for e in events for t in e["tokens"]] == greedy_reference(tiny_model, [3, 4, 5], 40)[0]


def test_frame_beyond_hard_cap_drops_only_that_connection(daemon: Daemon, good_request: None) -> None:
    bully = Raw(daemon.address)
    bully.sock.setsockopt(zmq.RCVTIMEO, 1000)
    bully.send(b"\x00" * (LIMIT * 5))
    with pytest.raises(zmq.Again):
        bully.recv()  # ZeroMQ cut the connection; no reply can come
    bully.close()
    with Client(daemon.address, timeout=60) as c:
        assert c.health()["status"] == "ready"
        assert c.generate(tokens=[5, 6], max_tokens=3).usage["completion_tokens"] <= 3


def test_requests_are_scoped_per_connection(daemon: Daemon) -> None:
    """One client cannot cancel another's request even with its id, while that request runs."""
    a, b = Raw(daemon.address), Raw(daemon.address)
    try:
        b.send(pack({"v": 1, "type": "health", "id": "h"}))
        assert b.recv()["type"] == "health"  # b is connected: its cancel reaches the daemon at once
        a.send(pack(submit(rid="mine", tokens=[5, 6], max_tokens=200)))
        first = a.recv()
        assert (first["type"], first["id"]) == ("token", "mine")  # running: its id is in the table
        b.send(pack({"v": 1, "type": "cancel", "id": "mine"}))
        _, end = a.until_end("mine")
        assert end["finish_reason"] in ("length", "stop")  # not "cancelled"
        assert b.recv()["code"] == "unknown_request_id"
    finally:
        a.close()
        b.close()
