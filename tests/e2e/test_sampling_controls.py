"""Logits controls through a real daemon and the client library: penalties and a bias equal mlx-lm's
own processors in its ``generate_step``, token for token, the penalties over OpenAI's and vLLM's
spans (presence and frequency: every emitted token, not the prompt; repetition: the prompt and every
emitted token; no 20-token window), through the prefix cache too; ``min_tokens``, ``ignore_eos`` and
``stop_token_ids`` end sequences where they say; ``n`` runs n seeded sequences; a batch mixing plain
and controlled requests keeps the plain ones exact; a lone controlled request keeps its bursts (no
decline counted) and its tokens equal mlx-lm's; bad values end with ``bad_field`` naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import zmq

from clients import Client, RequestError
from clients.protocol import PROTOCOL_VERSION, MsgType, pack, unpack
from tests.conftest import Daemon, start_daemon, wait_for_verdict
from tests.helpers.daemons import served
from tests.reference import greedy_reference, load_reference, penalized_reference

PROMPT = [7, 7, 7, 7, 8, 8, 8, 8]
EOS = 0


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Bursts on (prompt lookup), so a lone controlled request meets the burst decision."""
    yield from served(
        start_daemon(tiny_model, tmp_path_factory.mktemp("controls"), "--draft", "prompt-lookup", "-k", "3")
    )


def reference(model_path: Path, prompt: list[int], max_tokens: int, **controls: Any) -> list[int]:
    """Greedy tokens from mlx-lm's ``generate_step`` with its own processors, the penalties over
    OpenAI's and vLLM's spans (``tests.reference.penalized_reference``), up to EOS."""
    return penalized_reference(model_path, prompt, max_tokens, **controls)


@pytest.mark.parametrize(
    "controls",
    [
        {"repetition_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7},
        {"presence_penalty": -0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2, "logit_bias": {91: 3.0}},
    ],
    ids=["repetition", "presence", "frequency", "all"],
)
def test_penalties_equal_mlx_lm_processors_and_change_the_output(
    client: Client, tiny_model: Path, controls: dict[str, Any]
) -> None:
    got = client.generate(tokens=PROMPT, max_tokens=30, **controls)
    want = reference(tiny_model, PROMPT, 30, **controls)
    assert got.tokens == want
    assert got.tokens != greedy_reference(tiny_model, PROMPT, 30)[0]


def test_a_frequency_penalty_still_applies_to_a_token_emitted_over_20_tokens_ago(
    client: Client, tiny_model: Path
) -> None:
    """On the tiny model, PROMPT's output under this penalty emits 180 in its first steps and never
    again; a 20-token window would let it back in."""
    got = client.generate(tokens=PROMPT, max_tokens=60, frequency_penalty=0.7).tokens
    assert got == reference(tiny_model, PROMPT, 60, frequency_penalty=0.7)
    assert 180 in got[:6] and 180 not in got[20:]
    windowed = penalized_reference(tiny_model, PROMPT, 60, mlx_lm_windows=True, frequency_penalty=0.7)
    assert 180 in windowed[20:], "under a 20-token window 180 comes back: this case tells them apart"


def test_presence_does_not_count_the_prompt(client: Client, tiny_model: Path) -> None:
    """The prompt ends with 113, the greedy first token: presence leaves it alone (it counts only
    emitted tokens), so 113 still comes first, then presence moves the output off it."""
    prompt = [*PROMPT, 113]
    assert greedy_reference(tiny_model, prompt, 2)[0] == [113, 113]
    got = client.generate(tokens=prompt, max_tokens=40, presence_penalty=1.5).tokens
    assert got == reference(tiny_model, prompt, 40, presence_penalty=1.5)
    assert got[0] == 113 and 113 not in got[1:]
    assert penalized_reference(tiny_model, prompt, 40, mlx_lm_windows=True, presence_penalty=1.5)[0] != 113


def test_repetition_counts_the_whole_prompt(client: Client, tiny_model: Path) -> None:
    """49 sits 6 tokens from the prompt's end: by the 15th output token it is over 20 tokens back,
    where a 20-token window would forget it (and the model then emits it); repetition keeps it out."""
    prompt = [113, *range(30, 55)]
    got = client.generate(tokens=prompt, max_tokens=40, repetition_penalty=2.0).tokens
    assert got == reference(tiny_model, prompt, 40, repetition_penalty=2.0)
    assert 49 not in got
    assert 49 in penalized_reference(tiny_model, prompt, 40, mlx_lm_windows=True, repetition_penalty=2.0)


def test_penalties_through_the_prefix_cache_equal_mlx_lm(client: Client, tiny_model: Path) -> None:
    """``n`` siblings take the leader's prompt KV from the prefix cache: what their penalties see is
    still the whole prompt then their own output, as for a fresh prefill."""
    prompt = [60 + i % 37 for i in range(48)]  # not another test's prompt: no entry of it is cached yet
    controls = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.5}
    before = client.stats()["engine"]["prefix_cache"]["hits"]
    results = client.generate_n(tokens=prompt, n=3, max_tokens=40, **controls)
    assert client.stats()["engine"]["prefix_cache"]["hits"] - before == 2
    want = reference(tiny_model, prompt, 40, **controls)
    assert want != greedy_reference(tiny_model, prompt, 40)[0]
    assert want != penalized_reference(tiny_model, prompt, 40, mlx_lm_windows=True, **controls)
    assert [r.tokens for r in results] == [want] * 3


def test_a_strong_logit_bias_forces_a_token(client: Client) -> None:
    got = client.generate(tokens=PROMPT, max_tokens=12, logit_bias={42: 100.0})
    assert got.tokens == [42] * 12 and got.finish_reason == "length"


def test_min_tokens_holds_off_eos_and_ignore_eos_drops_it(client: Client) -> None:
    eos_first = client.generate(tokens=PROMPT, max_tokens=20, logit_bias={EOS: 100.0})
    assert eos_first.tokens == [] and eos_first.finish_reason == "stop"
    held = client.generate(tokens=PROMPT, max_tokens=20, logit_bias={EOS: 100.0}, min_tokens=5)
    assert len(held.tokens) == 5 and EOS not in held.tokens and held.finish_reason == "stop"
    ignored = client.generate(tokens=PROMPT, max_tokens=6, logit_bias={EOS: 100.0}, ignore_eos=True)
    assert ignored.tokens == [EOS] * 6 and ignored.finish_reason == "length"


def test_stop_token_ids_stop_and_min_tokens_holds_them_off(client: Client, tiny_model: Path) -> None:
    plain = greedy_reference(tiny_model, PROMPT, 30)[0]
    stop = next(t for t in plain if t != plain[0])
    cut = plain.index(stop)
    got = client.generate(tokens=PROMPT, max_tokens=30, stop_token_ids=[stop])
    assert got.tokens == plain[:cut] and got.finish_reason == "stop"
    held = client.generate(tokens=PROMPT, max_tokens=30, stop_token_ids=[stop], min_tokens=cut + 3)
    assert stop not in held.tokens[: cut + 3] and len(held.tokens) >= cut + 3


def test_a_mixed_batch_keeps_plain_requests_exact(client: Client, tiny_model: Path) -> None:
    prompts = [[5, 6, 7], [9, 10, 11, 12], PROMPT, [30, 31, 32, 33]]
    controls: list[dict[str, Any]] = [{}, {"repetition_penalty": 1.5}, {}, {"presence_penalty": 1.5}]
    jobs = [{"tokens": p, "max_tokens": 24, **c} for p, c in zip(prompts, controls)]
    results = client.generate_many(jobs)
    for p, c, r in zip(prompts, controls, results):
        assert r.tokens == reference(tiny_model, p, 24, **c), c


def test_a_lone_controlled_request_keeps_its_bursts_and_equals_mlx_lm(client: Client, tiny_model: Path) -> None:
    wait_for_verdict(client, timeout=60)
    before = client.stats()["engine"]["bursts"]["declined"].get("logits_processors", 0)
    got = client.generate(tokens=PROMPT, max_tokens=60, repetition_penalty=1.3)
    assert got.tokens == reference(tiny_model, PROMPT, 60, repetition_penalty=1.3)
    assert client.stats()["engine"]["bursts"]["declined"].get("logits_processors", 0) == before


def test_n_runs_n_seeded_sequences(client: Client) -> None:
    results = client.generate_n(tokens=PROMPT, n=3, max_tokens=12, temperature=1.0, seed=11, request_id="many")
    assert [r.request_id for r in results] == ["many/0", "many/1", "many/2"]
    # The same three seeded requests sent together (a lone sampled request may burst, and a burst's
    # draws are its own: compare batched with batched).
    singles = client.generate_many(
        [{"tokens": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 11 + i} for i in range(3)]
    )
    assert [r.tokens for r in results] == [r.tokens for r in singles]
    assert len({tuple(r.tokens) for r in results}) > 1
    with pytest.raises(ValueError, match="'n' must be in"):
        client.generate_n(tokens=PROMPT, n=17)


def _raw_end(address: str, rid: str, **fields: Any) -> dict[str, Any]:
    """The daemon's answer to a raw submit map (no client-side checks): its ``end``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    try:
        sock.send(pack({"v": PROTOCOL_VERSION, "type": MsgType.SUBMIT.value, "id": rid, "tokens": PROMPT, **fields}))
        assert sock.poll(30_000), "no answer"
        return unpack(sock.recv())
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"-5": 1}}, "logit_bias"),
        ({"logit_bias": {"260": 1.0}}, "logit_bias"),  # outside the tiny model's vocabulary
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"n": 2}, "n"),
    ],
)
def test_bad_values_end_with_bad_field_naming_the_field(daemon: Daemon, fields: dict[str, Any], named: str) -> None:
    end = _raw_end(daemon.address, f"bad-{named}", **fields)
    assert end["type"] == "end" and end["finish_reason"] == "error", end
    assert end["error"]["code"] == "bad_field" and f"'{named}'" in end["error"]["message"], end


def test_an_out_of_vocabulary_bias_is_refused_through_the_client(client: Client) -> None:
    with pytest.raises(RequestError) as info:
        client.generate(tokens=PROMPT, max_tokens=4, logit_bias={100_000: 1.0})
    assert info.value.code == "bad_field" and "'logit_bias'" in str(info.value)


def test_a_lone_ignore_eos_request_still_bursts_exactly(client: Client, tiny_model: Path) -> None:
    """``ignore_eos`` needs no processor (only its stop set changes), so it keeps its bursts."""
    from mlx_lm.generate import generate_step

    wait_for_verdict(client, timeout=60)
    model, _ = load_reference(str(tiny_model))
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=60)]
    # Whether a round runs is the adaptive gate's call (timing); that this request is not declined is not.
    declined = client.stats()["engine"]["bursts"]["declined"].get("logits_processors", 0)
    got = client.generate(tokens=PROMPT, max_tokens=60, ignore_eos=True)
    assert got.tokens == want and got.finish_reason == "length"
    assert client.stats()["engine"]["bursts"]["declined"].get("logits_processors", 0) == declined


def test_n_sequences_share_one_prefill(client: Client, tiny_model: Path) -> None:
    """The leader prefills the prompt; its siblings take its KV from the prefix cache (two hits of
    the whole prompt but its last token) and answer exactly what one prefill each would."""
    prompt = [5 + i % 50 for i in range(48)]
    before = client.stats()["engine"]["prefix_cache"]
    results = client.generate_n(tokens=prompt, n=3, max_tokens=16)
    after = client.stats()["engine"]["prefix_cache"]
    assert after["hits"] - before["hits"] == 2
    assert after["hit_tokens"] - before["hit_tokens"] == 2 * (len(prompt) - 1)
    want = greedy_reference(tiny_model, prompt, 16)[0]
    assert [r.tokens for r in results] == [want] * 3
