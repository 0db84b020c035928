"""The fast-path tests' fixture: every test leaves the process's fast-path policy unset."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from workers import fastpath


@pytest.fixture()
def policy() -> Iterator[None]:
    yield
    fastpath.set_active(None)
