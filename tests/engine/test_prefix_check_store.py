"""The prefix cache's start-up check kept on disk (``CheckStore``): a result stored for exactly a
pairing is read back instead of checking again; a damaged or forged one is ignored and checked again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from workers.engine import prefix_cache
from workers.engine.prefix_cache import checked
from workers.engine.prefix_check import (
    CheckStore,
    ReuseVerdict,
    check_fingerprint,
    check_pairing,
    decide,
    make_draws,
)

SERVING = {"model": "abc", "model_type": "llama", "backend": "cpu"}
SHAPE = {"prefill_step": 64, "vocab_size": 256, "window": None, "context": 384}


def _record(store: CheckStore) -> tuple[str, Path]:
    """A stored exact result for ``SERVING`` (as ``checked`` writes it), its fingerprint and file."""
    pairing = check_pairing(SERVING, **SHAPE)
    draws = make_draws(64, None, 384)
    for d in draws:
        d.total_bytes = 4096
    fingerprint = check_fingerprint(pairing)
    store.put(fingerprint, pairing, decide(draws, None, 1.5))
    return fingerprint, store.path(fingerprint)


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_stored_result_reads_back_as_from_cache(tmp_path: Path) -> None:
    store = CheckStore(tmp_path)
    fingerprint, _ = _record(store)
    got = store.get(fingerprint)
    assert got is not None and got.exact and got.from_cache and len(got.draws) == 4
    assert store.get(check_fingerprint(check_pairing({**SERVING, "model": "other"}, **SHAPE))) is None


def _flip_exact_with_a_differing_draw(d: dict[str, Any]) -> None:
    d["verdict"]["draws"][0]["differing_bytes"] = 7  # the draws now say inexact, the verdict exact


FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "an exact verdict over a differing draw": _flip_exact_with_a_differing_draw,
    "a declined verdict relabelled exact": lambda d: d["verdict"].update(exact=False),
    "a draw dropped": lambda d: d["verdict"]["draws"].pop(),
    "a draw of other lengths": lambda d: d["verdict"]["draws"][1].update(prompt=10, cached=5),
    "an extra field": lambda d: d["verdict"].update(trusted=True),
    "a field of the wrong type": lambda d: d["verdict"].update(seconds="fast"),
    "a bool as a count": lambda d: d["verdict"]["draws"][0].update(total_bytes=True),
    "more differing bytes than bytes": lambda d: d["verdict"]["draws"][0].update(differing_bytes=9999),
    "the pairing of another model": lambda d: d["pairing"].update(model="other"),
    "another fingerprint": lambda d: d.update(fingerprint="0" * 64),
    "not an object": lambda d: d.clear(),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_or_damaged_result_is_ignored(tmp_path: Path, forgery: str) -> None:
    store = CheckStore(tmp_path)
    fingerprint, path = _record(store)
    assert store.get(fingerprint) is not None
    _edit(path, FORGERIES[forgery])
    assert store.get(fingerprint) is None


def test_unreadable_json_is_ignored(tmp_path: Path) -> None:
    store = CheckStore(tmp_path)
    fingerprint, path = _record(store)
    path.write_text("{not json")
    assert store.get(fingerprint) is None


def test_checked_uses_a_stored_result_and_checks_again_when_it_is_forged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start checks and stores, the second reads the store (the check is not run), and a
    forged file makes the third check again."""
    runs: list[int] = []

    def fake_check(model: Any, **kw: Any) -> ReuseVerdict:
        runs.append(1)
        draws = make_draws(kw["prefill_step"], kw["window"], kw["context"])
        for d in draws:
            d.total_bytes = 64
        return decide(draws, kw["window"], 0.1)

    monkeypatch.setattr(prefix_cache, "warm_vs_cold", fake_check)
    store = CheckStore(tmp_path)

    def start() -> prefix_cache.PrefixCache:
        return checked(None, 1 << 20, **{k: v for k, v in SHAPE.items()}, store=store, serving=SERVING)

    assert start().serving and runs == [1]
    again = start()
    assert again.serving and again.verdict is not None and again.verdict.from_cache and runs == [1]
    (path,) = tmp_path.glob("*.json")
    _edit(path, lambda d: d["verdict"].update(reason="forged"))
    third = start()
    assert runs == [1, 1] and third.verdict is not None and not third.verdict.from_cache
