"""Top-k logprobs through a real daemon with the client: a bursting daemon, stop strings that cut
them with their tokens, and a batch of requests, each against mlx-lm's own ``generate_step``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients import Client, TokenEvent
from tests.conftest import Daemon, start_daemon, wait_for_verdict
from tests.helpers.top_logprobs import LOOPING, reference


@pytest.fixture(scope="module")
def bursting_daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tiny_model, tmp_path_factory.mktemp("top-daemon"), "--draft", "prompt-lookup", "-k", "3")
    yield d
    assert d.stop() == 0, d.log()


def test_the_client_gets_top_logprobs_through_a_bursting_daemon(tiny_model: Path, bursting_daemon: Daemon) -> None:
    with Client(bursting_daemon.address, timeout=120) as c:
        wait_for_verdict(c, timeout=60)
        for prompt, k in ((LOOPING, 4), ([5, 6, 7], 20)):
            r = c.generate(tokens=prompt, max_tokens=40, top_logprobs=k)
            assert (r.tokens, r.logprobs, r.top_logprobs) == reference(tiny_model, prompt, 40, k)
        assert c.stats()["engine"]["bursts"]["accepted_tokens"] > 0

        accepted = c.stats()["engine"]["bursts"]["accepted_tokens"]
        events = [e for e in c.stream(tokens=LOOPING, max_tokens=40, top_logprobs=3) if isinstance(e, TokenEvent)]
        assert all(e.top_logprobs is not None and len(e.top_logprobs) == len(e.tokens) for e in events if e.tokens)
        if c.stats()["engine"]["bursts"]["accepted_tokens"] > accepted:
            # The adaptive gate may have paused bursts on a busy machine (it times them); when
            # this stream did burst, its burst events carry several tokens each.
            assert any(len(e.tokens) > 1 for e in events)
        plain = c.generate(tokens=LOOPING, max_tokens=10, logprobs=True)
        assert plain.logprobs is not None and plain.top_logprobs is None


def test_a_stop_string_cuts_top_logprobs_with_their_tokens(tiny_model: Path, bursting_daemon: Daemon) -> None:
    """Stop strings at every place of a bursting request's text: the tokens after the stop are cut
    from ``tokens``, ``logprobs`` and ``top_logprobs`` alike, also inside one multi-token event."""
    with Client(bursting_daemon.address, timeout=120) as c:
        wait_for_verdict(c, timeout=60)
        full = c.generate(tokens=LOOPING, max_tokens=40, top_logprobs=2)
        assert full.top_logprobs is not None and full.logprobs is not None
        cut = 0
        for at in range(2, min(len(full.text), 30), 3):
            stop = full.text[at : at + 2]
            r = c.generate(tokens=LOOPING, max_tokens=40, top_logprobs=2, stop=[stop])
            n = len(r.tokens)
            assert r.finish_reason == "stop" and r.tokens == full.tokens[:n]
            assert r.logprobs == full.logprobs[:n] and r.top_logprobs == full.top_logprobs[:n]
            cut += n < len(full.tokens)
        assert cut > 0


def test_daemon_top_logprobs_match_for_a_batch(tiny_model: Path, bursting_daemon: Daemon) -> None:
    """Several requests at once (decoded together, no bursts) each get their own rows' top k."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[5, 6, 7], [40, 41, 42], [100, 101], [9, 9, 9, 9]]
    with Client(bursting_daemon.address, timeout=120) as c:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(lambda a: c.generate(tokens=a[1], max_tokens=20, top_logprobs=a[0] + 1), enumerate(prompts))
            )
        for i, (prompt, r) in enumerate(zip(prompts, results)):
            assert (r.tokens, r.logprobs, r.top_logprobs) == reference(tiny_model, prompt, 20, i + 1)
