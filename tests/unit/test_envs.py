"""The environment registries (``workers.envs``, ``clients.envs``): every ``MLX_BATCHD_*`` variable
is declared there once and read only through them, and a value that is not one of a variable's own
is refused in one line naming it."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

from workers import envs

ROOT = Path(__file__).resolve().parents[2]
REGISTRIES = {ROOT / "workers" / "envs.py", ROOT / "clients" / "envs.py"}


def _names_in_code(path: Path) -> list[str]:
    """String literals of ``path`` that are exactly a variable's name (docstrings and comments that
    mention one are prose, not a read)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [
        t.string
        for t in tokens
        if t.type == tokenize.STRING and t.string.strip("\"'").startswith("MLX_BATCHD_") and " " not in t.string
    ]


def test_only_the_registries_name_a_variable() -> None:
    readers = {
        str(path.relative_to(ROOT)): names
        for package in ("clients", "scheduler", "workers")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in REGISTRIES and (names := _names_in_code(path))
    }
    assert readers == {}


def test_each_variable_is_declared_once_with_a_comment() -> None:
    names = [v.name for v in envs.ALL]
    assert len(names) == len(set(names)) and all(n.startswith("MLX_BATCHD_") for n in names)
    source = (ROOT / "workers" / "envs.py").read_text().splitlines()
    for var in envs.ALL:
        (line,) = [i for i, text in enumerate(source) if f'EnvVar("{var.name}"' in text]
        assert source[line - 1].startswith("#: "), var.name


def test_unset_is_the_default_and_a_value_not_its_own_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in (envs.ROWKERNEL, envs.BENCH_PROCESS_PIN, envs.CACHE):
        monkeypatch.delenv(var.name, raising=False)
    assert envs.read(envs.ROWKERNEL) == "" and envs.switch(envs.BENCH_PROCESS_PIN) is None
    assert envs.read(envs.CACHE) == str(Path.home() / ".cache" / "mlx-batchd")
    monkeypatch.setenv(envs.CACHE.name, str(tmp_path))
    assert envs.read(envs.CACHE) == str(tmp_path)
    monkeypatch.setenv(envs.BENCH_PROCESS_PIN.name, "1")
    assert envs.switch(envs.BENCH_PROCESS_PIN) is True
    monkeypatch.setenv(envs.ROWKERNEL.name, "gpu")
    with pytest.raises(envs.SettingError, match=r"^MLX_BATCHD_ROWKERNEL='gpu': expected off, reference or cuda$"):
        envs.check()
