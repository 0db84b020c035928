"""Values that once took the daemon down through its HTTP door, against a live daemon: each is a 400
naming its field (or ``malformed`` for a body nested too deep), and the daemon serves a good request
after every one of them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TEST_CONTEXT, Daemon, start_daemon
from tests.e2e.test_http import http_url

HUGE_INTS = [2**64, 10**30, -(2**64), 10**400]
#: An integer literal of 401 digits: past what a float can hold.
DIGITS_401 = 10**400


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(
        tiny_model,
        tmp_path_factory.mktemp("bad-http"),
        "--context-length",
        str(TEST_CONTEXT),
        "--max-tokens-cap",
        "50",
        "--default-max-tokens",
        "4",
        "--http",
        "127.0.0.1:0",
    )
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def url(daemon: Daemon) -> str:
    return http_url(daemon)


def post(url: str, body: dict[str, Any] | bytes, chat: bool = False) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = "chat/completions" if chat else "completions"
    return httpx.post(f"{url}/v1/{path}", content=content, headers={"Content-Type": "application/json"}, timeout=60)


def still_serves(daemon: Daemon, url: str) -> None:
    assert daemon.proc.poll() is None, daemon.log()
    r = post(url, {"prompt": "a", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def refused(r: httpx.Response, param: str | None, code: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert err["message"] and len(err["message"]) < 400  # one line, never the whole value echoed


@pytest.mark.parametrize("value", HUGE_INTS, ids=["2**64", "10**30", "-2**64", "10**400"])
@pytest.mark.parametrize(
    ("field", "code"),
    [
        ("top_k", "bad_field"),
        ("seed", "bad_field"),
        ("priority", "bad_field"),
        ("max_tokens", "max_tokens_out_of_range"),
        ("temperature", "bad_field"),
        ("top_p", "bad_field"),
        ("min_p", "bad_field"),
    ],
)
def test_a_huge_integer_in_any_numeric_field_is_a_400_naming_it(
    daemon: Daemon, url: str, field: str, code: str, value: int
) -> None:
    refused(post(url, {"prompt": "a", "max_tokens": 2, field: value}), field, code)
    still_serves(daemon, url)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_a_401_digit_literal_for_a_float_field_is_a_400_not_a_500(daemon: Daemon, url: str, field: str) -> None:
    literal = str(DIGITS_401)
    assert len(literal) == 401
    raw = f'{{"prompt": "a", "max_tokens": 2, "{field}": {literal}}}'.encode()
    refused(post(url, raw), field, "bad_field")
    still_serves(daemon, url)


@pytest.mark.parametrize(
    ("body", "chat", "param", "code"),
    [
        ({"prompt": [5, 2**64]}, False, "prompt", "token_out_of_range"),
        ({"prompt": [10**30]}, False, "prompt", "token_out_of_range"),
        ({"prompt": "a", "stop_token_ids": [2**64]}, False, "stop_token_ids", "bad_field"),
        ({"prompt": "a", "logprobs": 10**30}, False, "logprobs", "bad_field"),
        (
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 2**64},
            True,
            "top_logprobs",
            "bad_field",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10**30},
            True,
            "max_completion_tokens",
            "max_tokens_out_of_range",
        ),
    ],
)
def test_huge_integers_in_token_lists_and_counts_are_400s(
    daemon: Daemon, url: str, body: dict[str, Any], chat: bool, param: str, code: str
) -> None:
    refused(post(url, body, chat=chat), param, code)
    still_serves(daemon, url)


@pytest.mark.parametrize("depth", [65, 50_000, 100_000])
@pytest.mark.parametrize("shape", ["array", "object"])
def test_json_nested_deep_is_a_400_malformed(daemon: Daemon, url: str, depth: int, shape: str) -> None:
    opener, closer = (b"[", b"]") if shape == "array" else (b'{"a":', b"}")
    raw = b'{"prompt": "a", "x": ' + opener * depth + b"1" + closer * depth + b"}"
    refused(post(url, raw), None, "malformed")
    still_serves(daemon, url)


def test_nesting_within_the_bound_and_brackets_inside_strings_are_served(daemon: Daemon, url: str) -> None:
    """The depth bound reads structure only: brackets in a string do not count, and 60 levels of an
    ignored field are fine."""
    raw = b'{"prompt": "' + b"[{" * 100 + b'", "max_tokens": 2, "x": ' + b"[" * 60 + b"]" * 60 + b"}"
    r = post(url, raw)
    assert r.status_code == 200, r.text
