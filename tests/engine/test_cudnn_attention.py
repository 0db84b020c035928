"""MLX CUDA's cuDNN attention is off in the engine's process unless asked for
(``workers.kernels.backend.configure_attention``): cuDNN builds an attention graph per new prefill shape, which
new prompt lengths pay in time to first token. MLX reads the variable once, at the first attention
call, so the engine sets it before it loads the model; an operator's own setting is kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.engine_thread import EngineThreadRun
from workers.kernels.backend import CUDNN_ATTENTION_ENV, configure_attention
from workers.models.loading import load


def test_unset_it_follows_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUDNN_ATTENTION_ENV, raising=False)
    assert configure_attention(False) is False
    assert (CUDNN_ATTENTION_ENV, "0") in os.environ.items()
    monkeypatch.delenv(CUDNN_ATTENTION_ENV)
    assert configure_attention(True) is True
    assert os.environ[CUDNN_ATTENTION_ENV] == "1"


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("0", False), ("", False), ("abc", False), ("00", False), (" 2x", True)]
)
def test_the_operators_setting_is_kept(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv(CUDNN_ATTENTION_ENV, value)
    assert configure_attention(not on) is on
    assert os.environ[CUDNN_ATTENTION_ENV] == value


@pytest.mark.parametrize("asked", [False, True])
def test_the_engine_sets_it_before_its_first_forward(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, asked: bool
) -> None:
    monkeypatch.delenv(CUDNN_ATTENTION_ENV, raising=False)
    with EngineThreadRun(tiny_model, cudnn_attention=asked):
        pass
    assert os.environ[CUDNN_ATTENTION_ENV] == ("1" if asked else "0")


def test_loading_a_model_turns_it_off_unless_the_environment_said(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process that loads a model (the probe, a benchmark's in-process arms) attends as the engine."""
    monkeypatch.delenv(CUDNN_ATTENTION_ENV, raising=False)
    load(str(tiny_model))
    assert os.environ[CUDNN_ATTENTION_ENV] == "0"
    monkeypatch.setenv(CUDNN_ATTENTION_ENV, "1")
    load(str(tiny_model))
    assert os.environ[CUDNN_ATTENTION_ENV] == "1"
