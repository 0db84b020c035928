"""The fast-path tests' fixture (every test leaves the process's fast-path policy unset) and greedy
tokens through an engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from workers.api import Job, Tokens
from workers.engine.engine import Engine
from workers.kernels import fastpath


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

    def recording(m: Any, x: Any) -> Any:
        out = real(m, x)
        if out is not None:
            seen.append(x.shape[0])
        return out

    monkeypatch.setattr(module, name, recording)
    return seen
