"""Property: no request field, whatever its type or value, takes the daemon down or gets a server error.

One live daemon (ZeroMQ and ``--http``) takes valid requests with one to three fields replaced by
hostile values (huge and edge integers, NaN and infinities, long strings, wrong types, containers
nested up to 100,000 deep), through both doors. Each answer must be a success or one of the input
error codes (HTTP 400/404 with the OpenAI error shape), never a 5xx or an engine error, and the
daemon process must still be running after every example.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from clients.messages import unbatch
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from tests.conftest import TEST_CONTEXT, Daemon, start_daemon
from tests.e2e.test_http import TEMPLATE_WITH_VARIABLE, http_url

EXAMPLES = 200
PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

#: What a bad input may be answered with: the input error codes, never a server-side one.
INPUT_CODES = {
    "malformed",
    "bad_version",
    "unknown_type",
    "missing_field",
    "bad_field",
    "empty_prompt",
    "token_out_of_range",
    "prompt_too_long",
    "max_tokens_out_of_range",
    "no_chat_template",
    "frame_too_large",
    "unknown_request_id",
}
HTTP_CODES = INPUT_CODES | {"unsupported_parameter", "model_not_found", "request_too_large"}
#: The HTTP status of each non-400 input code.
HTTP_STATUS = {"model_not_found": 404, "request_too_large": 413}
#: The strategies' own repr is long (many literal edge values); hypothesis warns when it prints it.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

WIRE_FIELDS = [
    "v", "type", "id", "prompt", "tokens", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "priority", "group", "group_size", "batch",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "n",
]  # fmt: skip
HTTP_FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "priority", "logprobs", "top_logprobs", "user", "stream", "stream_options",
    "n", "tools", "functions", "tool_choice", "response_format", "presence_penalty", "frequency_penalty",
    "logit_bias", "echo", "best_of", "suffix", "chat_template_kwargs", "repetition_penalty", "min_tokens",
    "ignore_eos",
]  # fmt: skip

EDGE_INTS = [0, 1, -1, 2, 20, 21, 1000, 1001, 4096, 4097, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), 2**64 - 1]
HUGE_INTS = [2**64, -(2**63) - 1, 10**30, -(10**30), 10**400, -(10**400)]
#: Nesting depths: within the HTTP bound, at it, past it, past msgpack's and the parser's recursion.
DEPTHS = [3, 64, 65, 1000, 1100, 50_000, 100_000]


class Deep:
    """A value nested ``depth`` deep, written into the encoded body (no encoder goes that deep)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    @property
    def mark(self) -> str:
        return f"@@deep:{self.depth}@@"


def hostile(http: bool) -> st.SearchStrategy[Any]:
    ints = st.sampled_from(EDGE_INTS + (HUGE_INTS if http else [])) | (
        st.integers() if http else st.integers(-(2**63), 2**64 - 1)
    )
    scalars = (
        st.none()
        | st.booleans()
        | ints
        | st.floats()
        | st.sampled_from([0.0, -0.0, 1.0, 100.0, 100.5, 1e-300, 1e308, float("inf"), float("nan")])
        | st.text(max_size=40)
        | st.sampled_from(["", "submit", "health", "stats", "cancel", "user", "text", "x" * 600])
    )
    if not http:
        scalars = scalars | st.binary(max_size=20)
    keys = st.sampled_from(["role", "content", "type", "text", "include_usage", "prefix", "tokenize"]) | st.text(
        max_size=6
    )
    tree = st.recursive(
        scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys, kids, max_size=4), max_leaves=12
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]) | tree,
            "content": st.text(max_size=20) | tree,
        },
        optional={"name": tree},
    )
    return tree | st.lists(message, min_size=0, max_size=3) | st.builds(Deep, st.sampled_from(DEPTHS))


def _marking(deep: list[Deep]) -> Any:
    """An encoder's ``default`` that writes each ``Deep`` as its mark and keeps it in ``deep``."""

    def default(value: Any) -> Any:
        if isinstance(value, Deep):
            deep.append(value)
            return value.mark
        raise TypeError(type(value).__name__)

    return default


def encode_json(body: dict[str, Any]) -> bytes:
    deep: list[Deep] = []
    text = json.dumps(body, default=_marking(deep))
    for d in deep:
        text = text.replace(json.dumps(d.mark), "[" * d.depth + "1" + "]" * d.depth)
    return text.encode()


def encode_msgpack(msg: dict[str, Any]) -> bytes:
    deep: list[Deep] = []
    frame: bytes = msgpack.packb(msg, default=_marking(deep), use_bin_type=True)
    for d in deep:
        frame = frame.replace(msgpack.packb(d.mark), b"\x91" * d.depth + b"\x01")
    return frame


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    model = tmp_path_factory.mktemp("models") / "tiny-chat"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE_WITH_VARIABLE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    d = start_daemon(
        model,
        tmp_path_factory.mktemp("properties"),
        "--context-length",
        str(TEST_CONTEXT),
        "--max-tokens-cap",
        "6",
        "--default-max-tokens",
        "2",
        "--http",
        "127.0.0.1:0",
    )
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=http_url(daemon), timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def raw(daemon: Daemon) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.address)
    yield sock
    sock.close()
    ctx.term()


def alive(daemon: Daemon) -> None:
    assert daemon.proc.poll() is None, f"the daemon exited:\n{daemon.log()[-4000:]}"


def check_http(r: httpx.Response, stream: bool) -> None:
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text[:500])
    if r.status_code == 200:
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-500:]
            assert '"error"' not in r.text, r.text[-500:]
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text[:500]
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] in HTTP_CODES, err
    assert r.status_code == HTTP_STATUS.get(err["code"], 400), err


@PROPERTY_SETTINGS
@given(
    chat=st.booleans(),
    fields=st.dictionaries(st.sampled_from(HTTP_FIELDS), hostile(http=True), min_size=1, max_size=3),
)
def test_no_http_field_takes_the_daemon_down(
    daemon: Daemon, http: httpx.Client, chat: bool, fields: dict[str, Any]
) -> None:
    base: dict[str, Any] = {"max_tokens": 2}
    if chat:
        base["messages"] = [{"role": "user", "content": "ab"}]
    else:
        base["prompt"] = "ab"
    body = {**base, **fields}
    r = http.post(
        "/v1/chat/completions" if chat else "/v1/completions",
        content=encode_json(body),
        headers={"Content-Type": "application/json"},
    )
    event(f"HTTP {r.status_code} {r.json()['error']['code'] if r.status_code != 200 else 'ok'}")
    check_http(r, stream=body.get("stream") is True)
    alive(daemon)


_ids = itertools.count()


def answer(sock: zmq.Socket[bytes], daemon: Daemon) -> dict[str, Any]:
    """The terminal reply to the one message just sent (its tokens, if any, come first); fails at
    once when the daemon has exited instead."""
    while True:
        waited = 0
        while not sock.poll(100):
            alive(daemon)
            waited += 1
            assert waited < 600, "no reply within 60 s"
        for msg in unbatch(unpack(sock.recv(), max_bytes=1 << 30)):
            if msg["type"] in ("end", "error", "health", "stats"):
                return msg
            assert msg["type"] == "token", msg


@PROPERTY_SETTINGS
@given(fields=st.dictionaries(st.sampled_from(WIRE_FIELDS), hostile(http=False), min_size=1, max_size=3))
def test_no_zeromq_field_takes_the_daemon_down(daemon: Daemon, raw: zmq.Socket[bytes], fields: dict[str, Any]) -> None:
    msg = {"v": PROTOCOL_VERSION, "type": "submit", "id": f"p{next(_ids)}", "tokens": [5, 6], "max_tokens": 2}
    raw.send(encode_msgpack({**msg, **fields}))
    reply = answer(raw, daemon)
    event(f"ZeroMQ {reply['type']} {reply.get('code') or (reply.get('error') or {}).get('code') or 'ok'}")
    if reply["type"] == "end":
        error = reply.get("error")
        assert (reply["finish_reason"] == "error") == (error is not None), reply
        assert error is None or error["code"] in INPUT_CODES, reply
    elif reply["type"] == "error":
        assert reply["code"] in INPUT_CODES and reply["message"], reply
    alive(daemon)


def test_both_doors_still_serve_after_the_properties(
    daemon: Daemon, http: httpx.Client, raw: zmq.Socket[bytes]
) -> None:
    """Runs after the two properties (file order): a plain request on each door still completes."""
    r = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    raw.send(pack({"v": PROTOCOL_VERSION, "type": "submit", "id": "last", "tokens": [5, 6], "max_tokens": 2}))
    end = answer(raw, daemon)
    assert end["type"] == "end" and end["finish_reason"] in ("stop", "length"), end
    alive(daemon)
