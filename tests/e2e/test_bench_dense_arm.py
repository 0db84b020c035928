"""``mlx-batchd bench --env-arm dense:--dense-shadow=on``: an env arm given a serve option runs its own
daemon with that option (beside the daemon arm, which runs without it), and the report records the
arm's option and its shadow's bytes; a serve option the daemon would refuse is refused in one line
before anything starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scheduler.bench.env_arms import EnvArm
from scheduler.cli import build_parser, main
from workers.models.synthetic import llama_config, write_model


def test_an_env_arm_with_a_serve_option_runs_its_own_daemon_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduler import spawn

    model = write_model(
        tmp_path / "q4", llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, quant_bits=4), seed=7
    )
    started: list[spawn.DaemonProcess] = []

    class Recorded(spawn.DaemonProcess):
        def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
            health = super().wait_ready(timeout)
            started.append(self)
            return health

    monkeypatch.setattr(spawn, "DaemonProcess", Recorded)
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        [
            *("bench", "--model", str(model), "--batch-sizes", "2", "--tokens", "4", "--prompt-tokens", "4"),
            *("--repeats", "1", "--env-arm", "dense:--dense-shadow=on", "--out", str(out)),
        ]
    )
    assert args.env_arm == [EnvArm("dense", {"--dense-shadow": "on"})]
    assert args.func(args) == 0

    daemon, dense = started
    tail = daemon.cmd[daemon.cmd.index("--listen") + 2 :]
    assert dense.cmd[dense.cmd.index("--listen") + 2 :] == [*tail, "--dense-shadow", "on"]
    assert "--dense-shadow" not in daemon.cmd
    meta = json.loads((out / "daemon_vs_raw.json").read_text())["meta"]
    assert meta["env_arms"] == {"dense": {"--dense-shadow": "on"}}
    assert meta["dense_shadow_bytes"]["daemon"] == 0 and meta["dense_shadow_bytes"]["dense"] > 0
    assert meta["daemon_exit_codes"] == {"daemon": 0, "dense": 0}
    assert "`--dense-shadow=on` (`--env-arm`)" in (out / "daemon_vs_raw.md").read_text()


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("dense:--dense-shadow=maybe", "--dense-shadow='maybe': expected one of 'off', 'auto', 'on'"),
        ("dense:--model=demo", "'--model' is not a serve option that takes a value"),
        ("dense:--no-such=1", "'--no-such' is not a serve option that takes a value"),
        ("dense:--insecure=1", "'--insecure' is not a serve option that takes a value"),
        ("dense:--max-batch=0", "--max-batch='0': must be an integer >= 1, got 0"),
        ("dense:--dense-shadow=on,--dense-shadow=off", "--dense-shadow given twice"),
    ],
)
def test_a_bad_serve_option_in_an_env_arm_is_refused_in_one_line(
    value: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the bench ran with a refused --env-arm")

    monkeypatch.setattr("scheduler.bench.main", started)
    monkeypatch.setattr("scheduler.spawn.DaemonProcess", started)
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--model", "demo", "--env-arm", value])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlx-batchd bench: argument --env-arm"), err
    assert said in err, err
