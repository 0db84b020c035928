"""The fast-path tests' fixture (every test leaves the process's fast-path policy unset) and greedy
tokens through an engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from workers.api import Job, Tokens
from workers.engine.engine import Engine
from workers.kernels import fastpath, install


@pytest.fixture()
def policy() -> Iterator[None]:
    yield
    fastpath.set_active(None)


def greedy_tokens(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    """Each prompt's greedy tokens, all submitted at once and stepped until the engine is idle."""
    for i, p in enumerate(prompts):
        engine.submit(Job(seq=i, prompt=p, max_tokens=max_tokens))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_work:
        for e in engine.step():
            if isinstance(e, Tokens):
                out[e.seq] += e.tokens
    return out


def recorded_rows(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str = "project") -> list[int]:
    """Wrap ``module.name`` (a way's ``(m, x) -> out | None``): the rows of each call that it took (returned
    an output) are appended to the list returned; the real function still computes them."""
    seen: list[int] = []
    real: Callable[..., Any] = getattr(module, name)

    def recording(m: Any, x: Any, *args: Any) -> Any:
        out = real(m, x, *args)
        if out is not None:
            seen.append(x.shape[0])
        return out

    monkeypatch.setattr(module, name, recording)
    return seen


#: Topics of the real-model agreement prompts (``topic_prompts``).
TOPICS = (
    "the moon",
    "bread",
    "rivers",
    "chess",
    "volcanoes",
    "the violin",
    "bees",
    "glass",
    "winter",
    "trains",
    "coffee",
    "maps",
    "the ocean",
    "paper",
    "gardens",
    "clocks",
    "salt",
    "bridges",
    "owls",
    "rain",
    "libraries",
    "copper",
    "deserts",
    "kites",
    "honey",
    "lighthouses",
    "tea",
    "mountains",
    "snow",
    "ink",
    "bicycles",
    "the sun",
)


def topic_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` chat prompts of a real instruct model asking for a sentence on one of ``TOPICS`` each."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]}."}],
            add_generation_prompt=True,
        )
        for i in range(n)
    ]


def greedy_agreement(
    model: Any, vocab: int, prompts: list[list[int]], max_tokens: int, to: int, took: list[int]
) -> tuple[int, int]:
    """Greedy tokens of ``prompts`` with decode planned to ``to`` at every row count, against MLX's own
    kernels (every row count as mlx-lm calls it, flattened): (tokens equal before each sequence's first
    difference, tokens in all). A near-tie may flip, and the sequence then continues differently, so
    only tokens before the first difference count. ``took`` (``recorded_rows`` of the way ``to`` names)
    must fill during the second run and stay empty in the first: else the comparison was of MLX with
    itself. The patches are installed as a daemon's load installs them, and the forced plans after each
    engine's constructor (which installs stored ones)."""
    install()
    shapes = {shape for _, shape in fastpath._projections(model)}
    rows = [*range(2, 17), *fastpath.LARGE_ROWS]

    def run(way: int | None) -> dict[int, list[int]]:
        engine = Engine(model, calibration="background", eos_token_ids=(), vocab_size=vocab, max_batch=len(prompts))
        fastpath.install(model, {sh: {r: (way if way is not None else r) for r in rows} for sh in shapes})
        return greedy_tokens(engine, prompts, max_tokens)

    mlx_way = run(None)
    assert not took, "MLX's run reached the way under test"
    other_way = run(to)
    assert took, "the way under test took no call"
    agreed = 0
    for i, want in mlx_way.items():
        got = other_way[i]
        agreed += next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
    return agreed, sum(len(v) for v in mlx_way.values())
