"""Top-k logprobs on the wire: the field's range and type, and a round trip through the protocol and
the client's events."""

from __future__ import annotations

from typing import Any

import pytest

from clients import TokenEvent
from clients.events import event_from_message
from clients.messages import submit_message, token_message
from clients.parse import parse_request
from clients.protocol import ErrorCode, ProtocolError, Submit, pack, unpack


def _submit(**fields: Any) -> dict[str, Any]:
    return {"v": 1, "type": "submit", "id": "r", "tokens": [1, 2], **fields}


@pytest.mark.parametrize("value", [21, -1, "3", 2.5, True, [3]])
def test_top_logprobs_out_of_range_or_not_an_int_is_bad_field(value: Any) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_request(_submit(top_logprobs=value))
    assert err.value.code == ErrorCode.BAD_FIELD and "top_logprobs" in err.value.message
    assert err.value.request_id == "r"


def test_top_logprobs_on_the_wire_round_trip() -> None:
    assert parse_request(_submit()) == Submit(id="r", tokens=[1, 2])
    for k in (0, 1, 20):
        req = parse_request(_submit(top_logprobs=k))
        assert isinstance(req, Submit) and req.top_logprobs == k and req.logprobs == (k > 0)
        assert parse_request(unpack(pack(submit_message(req)))) == req
    assert "top_logprobs" not in submit_message(Submit(id="r", tokens=[1]))

    tops = [[(3, -0.25), (9, -1.5)], [(4, -0.125), (3, -2.0)]]
    msg = unpack(pack(token_message("r", [3, 4], "ab", [-0.25, -0.125], tops)))
    assert msg["top_logprobs"] == [[[3, -0.25], [9, -1.5]], [[4, -0.125], [3, -2.0]]]
    event = event_from_message(msg)
    assert isinstance(event, TokenEvent) and event.top_logprobs == tops
    plain = event_from_message(unpack(pack(token_message("r", [3], "a", None))))
    assert isinstance(plain, TokenEvent) and plain.top_logprobs is None
