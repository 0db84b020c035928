"""Fixtures of the HTTP door tests: the door's URL and the real SDK clients pointed at the module's
``daemon`` (which each module starts with the door on), and the scripted agent model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Daemon
from tests.e2e.test_http import http_url
from tests.helpers import agent_model as script


@pytest.fixture(scope="module")
def url(daemon: Daemon) -> str:
    return http_url(daemon)


@pytest.fixture(scope="module")
def oai(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scripted model of ``tests.helpers.agent_model``: it thinks, then calls a tool."""
    return script.write_agent_model(tmp_path_factory.mktemp("models") / "agent")


@pytest.fixture(scope="session")
def agent_tokenizer(agent_model: Path) -> Any:
    """``agent_model``'s tokenizer, as the daemon loads it (for prompts rendered on the test's side)."""
    from workers.models.loading import load_tokenizer

    return load_tokenizer(str(agent_model))
