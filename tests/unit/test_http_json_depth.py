"""The HTTP body's nesting bound, read off the bytes before parsing: exact for any JSON text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.http_openai import MAX_JSON_DEPTH, HTTPError, json_depth, load_json

#: Strings full of what the scan must skip: brackets, quotes, backslashes, non-ASCII.
tricky_text = st.text(alphabet=st.sampled_from('[]{}"\\,: aé\u2200\U0001f600\n'), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky_text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(tricky_text, kids, max_size=3),
    max_leaves=40,
)


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=1000, deadline=None)
@given(json_values, st.integers(0, 80), st.booleans())
def test_the_scan_reads_the_depth_the_parser_would_build(value: Any, wrap: int, ascii_only: bool) -> None:
    """Wrapped ``wrap`` more levels deep so the exact (long) path is taken too."""
    for _ in range(wrap):
        value = [value]
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    want = depth_of(value)
    got = json_depth(raw)
    assert got == want if got > MAX_JSON_DEPTH or want > MAX_JSON_DEPTH else got >= want
    if want <= MAX_JSON_DEPTH:
        assert load_json(raw) == value
    else:
        with pytest.raises(HTTPError) as refused:
            load_json(raw)
        assert (refused.value.status, refused.value.code) == (400, "malformed")


@pytest.mark.parametrize(
    "raw", [b"[" * 100_000, b'{"a":' * 100_000, b"\xff\xfe[\x00]\x00", b'{"a": 1' + b"0" * 5000 + b"}"]
)
def test_deep_truncated_foreign_or_oversized_bodies_are_400_malformed(raw: bytes) -> None:
    with pytest.raises(HTTPError) as refused:
        load_json(raw)
    assert (refused.value.status, refused.value.code) == (400, "malformed")
