"""Stored verdicts are checked, never trusted: a damaged or forged file means "probe again".

A verdict decides which kernel level serves a burst's verify forward, and it persists across
restarts, so a file that does not hold a valid verdict for exactly this pairing must be ignored
(with a warning) and the pairing re-probed; bursts then work as with no file at all.
"""

from __future__ import annotations

import copy
import json
import logging
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from workers.api import BurstSettings, EngineSettings, Finished, Job, Ready, Signal, Tokens
from workers.engine.loop import EngineThread
from workers.exact.probe import make_draws, probe
from workers.exact.verdict_store import MAX_VERDICT_BYTES, VerdictStore, model_fingerprint
from workers.kernels import measure_widths
from workers.models.loading import load as load_model

VOCAB = 260
K = 2


@pytest.fixture(scope="module")
def genuine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """A real verdict as the store writes it: (fingerprint, its JSON)."""
    model = load(str(tiny_model))[0]
    measure_widths(model)
    store = VerdictStore(tmp_path_factory.mktemp("verdicts"))
    draws = make_draws(K, VOCAB, 4096, None)[:2]
    verdict = probe(model, lambda: make_prompt_cache(model), {"model": "tiny"}, draws, K, store=store)
    assert verdict.level == "wide"
    return verdict.fingerprint, json.loads(store.path(verdict.fingerprint).read_text())


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    """A forgery: set the field at ``path`` (dots; digits index lists) to ``value``."""

    def forge(data: dict[str, Any]) -> Any:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(last) if last.isdigit() else last] = value
        return data

    return forge


def _drop(path: str) -> Callable[[dict[str, Any]], Any]:
    def forge(data: dict[str, Any]) -> Any:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        del node[last]
        return data

    return forge


FORGERIES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "unknown-level": _set("level", "turbo"),
    "level-not-a-string": _set("level", 3),
    "level-list": _set("level", ["wide"]),
    "exact-a-string": _set("exact", "yes"),
    "reason-missing": _drop("reason"),
    "ladder-missing": _drop("ladder"),
    "unknown-field": _set("admin", True),
    "seconds-nan": _set("probe_seconds", float("nan")),
    "seconds-infinite": _set("probe_seconds", float("inf")),
    "seconds-negative": _set("probe_seconds", -1.0),
    "seconds-a-bool": _set("probe_seconds", True),
    "created-nan": _set("created", float("nan")),
    "from-cache-a-string": _set("from_cache", "no"),
    "pairing-a-list": _set("pairing", []),
    "another-pairing": _set("pairing.drafter", "someone-else"),
    "another-fingerprint": _set("fingerprint", "0" * 64),
    "ladder-an-object": _set("ladder", {"level": "wide"}),
    "rung-unknown-level": _set("ladder.0.level", "warp"),
    "rung-draws-missing": _drop("ladder.0.draws"),
    "rung-seconds-nan": _set("ladder.0.seconds", float("nan")),
    "draw-context-a-string": _set("ladder.0.draws.0.context", "12"),
    "draw-context-a-bool": _set("ladder.0.draws.0.context", True),
    "draw-negative-bytes": _set("ladder.0.draws.0.differing_bytes", -5),
    "draw-seconds-nan": _set("ladder.0.draws.0.seconds", float("nan")),
    "draw-unknown-field": _set("ladder.0.draws.0.extra", 1),
    "draw-not-an-object": _set("ladder.0.draws.0", "exact"),
    "a-list": lambda data: [data],
    "null": lambda data: None,
}
RAW_FORGERIES: dict[str, bytes] = {
    "not-json": b"{ damaged",
    "empty": b"",
    "not-utf8": b"\xff\xfe\x00{",
    "deeply-nested": b"[" * 100_000 + b"]" * 100_000,
}


def _store_with(tmp_path: Path, fingerprint: str, content: bytes) -> VerdictStore:
    store = VerdictStore(tmp_path / "verdicts")
    store.root.mkdir(parents=True)
    store.path(fingerprint).write_bytes(content)
    return store


def test_the_genuine_verdict_loads_from_the_store(genuine: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    fingerprint, data = genuine
    verdict = _store_with(tmp_path, fingerprint, json.dumps(data).encode()).get(fingerprint)
    assert verdict is not None and verdict.from_cache and verdict.level == "wide"


@pytest.mark.parametrize("name", [*FORGERIES, *RAW_FORGERIES])
def test_a_forged_or_damaged_verdict_is_ignored_with_a_warning(
    genuine: tuple[str, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    fingerprint, data = genuine
    if name in FORGERIES:
        content = json.dumps(FORGERIES[name](copy.deepcopy(data))).encode()
    else:
        content = RAW_FORGERIES[name]
    store = _store_with(tmp_path, fingerprint, content)
    with caplog.at_level(logging.WARNING, logger="mlx_batchd.probe"):
        assert store.get(fingerprint) is None
    assert any("ignoring the stored verdict" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- across a restart


class Served:
    """A real ``EngineThread`` serving the tiny model with prompt-lookup bursts."""

    def __init__(self, model: Path) -> None:
        self.out: queue.SimpleQueue[Signal] = queue.SimpleQueue()
        bursts = BurstSettings(k=K, audit_fraction=0.0, profile_steps=0, min_rounds=10**9)
        settings = EngineSettings(draft="prompt-lookup", bursts=bursts)
        self.thread = EngineThread(lambda: load_model(str(model)), self._emit, settings)

    def _emit(self, signals: list[Signal]) -> None:
        for s in signals:
            self.out.put(s)

    def __enter__(self) -> Served:
        self.thread.start()
        assert isinstance(self.out.get(timeout=120), Ready)
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.shutdown()
        self.thread.join(30)

    def verdict(self) -> dict[str, Any]:
        """The pairing's verdict once its probe is done (the probe runs while the engine is idle)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = [v for v in self.thread.snapshot()["verdicts"].values() if "level" in v]
            if done:
                return done[0]
            time.sleep(0.02)
        raise TimeoutError("no verdict")

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], Finished]:
        self.thread.submit(Job(seq=1, prompt=prompt, max_tokens=n))
        tokens: list[int] = []
        while not isinstance(signal := self.out.get(timeout=60), Finished):
            if isinstance(signal, Tokens):
                tokens += signal.tokens
        return tokens, signal


def test_a_forged_verdict_file_is_reprobed_across_a_restart_and_bursts_work(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    with Served(tiny_model) as first:
        assert first.verdict()["level"] == "wide"
        want, end = first.generate(prompt, 40)
        assert end.reason == "length"
    (stored,) = (tmp_path / "verdicts").glob("*.json")
    data = json.loads(stored.read_text())
    stored.write_text(json.dumps({**data, "level": "turbo"}))  # forged: an unknown kernel level

    with caplog.at_level(logging.WARNING, logger="mlx_batchd.probe"), Served(tiny_model) as second:
        verdict = second.verdict()
        assert (verdict["level"], verdict["from_cache"]) == ("wide", False)  # probed again
        tokens, end = second.generate(prompt, 40)
        assert (end.reason, end.error_code) == ("length", None) and tokens == want
        assert second.thread.snapshot()["bursts"]["rounds"] > 0
    assert any("ignoring the stored verdict" in r.getMessage() for r in caplog.records)
    assert json.loads(stored.read_text())["level"] == "wide"  # the store holds a real verdict again


def test_an_oversized_verdict_file_is_not_read(
    genuine: tuple[str, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fingerprint, data = genuine
    padded = json.dumps(data).encode() + b" " * MAX_VERDICT_BYTES
    with caplog.at_level(logging.WARNING, logger="mlx_batchd.probe"):
        assert _store_with(tmp_path, fingerprint, padded).get(fingerprint) is None
    assert "more than" in caplog.text


@pytest.mark.parametrize("memo", [b"{ damaged", b"[1, 2]", b'{"x": 5}'])
def test_a_damaged_file_hash_memo_is_hashed_again(tiny_model: Path, tmp_path: Path, memo: bytes) -> None:
    want = model_fingerprint(tiny_model, tmp_path / "fresh")
    (tmp_path / "memo").mkdir()
    (tmp_path / "memo" / "file-hashes.json").write_bytes(memo)
    assert model_fingerprint(tiny_model, tmp_path / "memo") == want


def test_a_cache_folder_that_cannot_be_used_still_serves_bursts(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's $MLX_BATCHD_CACHE pointing at a file: the pairing is probed and served, and the
    verdict and the file-hash memo are not kept, with a warning each."""
    root = tmp_path / "not-a-folder"
    root.write_text("")
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(root))
    with caplog.at_level(logging.WARNING, logger="mlx_batchd.probe"), Served(tiny_model) as served:
        assert served.verdict()["level"] == "wide"
        _, end = served.generate([5, 6, 7, 5, 6, 7, 5, 6], 30)
        assert (end.reason, end.error_code) == ("length", None)
        assert served.thread.snapshot()["bursts"]["rounds"] > 0
    assert "cannot keep the verdict" in caplog.text and "cannot keep the file-hash memo" in caplog.text
