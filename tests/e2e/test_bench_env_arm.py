"""``mlx-batchd bench --env-arm ... --restart-times`` on a tiny real model with its real daemons: the env
arm's daemon runs with its variables (in its process environment, and in what the engine reports),
is timed at every B beside the daemon arm and lands in the JSON, the Markdown and the plot with its
ratio to the daemon arm; every daemon's start-up seconds are reported, and the daemon arm's second
start, alone, with the first start's options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scheduler.bench.spreads import ratio_spread
from scheduler.cli import build_parser

ENV = {"MLX_BATCHD_BENCH_PROCESS_PIN": "1", "MLX_BATCHD_W4A16": "0"}


def environ(pid: int) -> dict[str, str]:
    """A process's environment as the kernel holds it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads a daemon's environment from /proc")
def test_env_arm_runs_its_own_daemon_beside_the_daemon_arm_and_restart_times_reports_a_second_start(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from scheduler import spawn

    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    started: list[tuple[spawn.DaemonProcess, dict[str, str]]] = []

    class Recorded(spawn.DaemonProcess):
        """Notes each daemon and its process environment once it answers ready."""

        def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
            health = super().wait_ready(timeout)
            started.append((self, environ(self.proc.pid)))
            return health

    monkeypatch.setattr(spawn, "DaemonProcess", Recorded)
    out = tmp_path / "bench"
    pairs = ",".join(f"{k}={v}" for k, v in ENV.items())
    args = build_parser().parse_args(
        [
            *("bench", "--model", str(tiny_model), "--batch-sizes", "1,2", "--tokens", "4", "--prompt-tokens", "4"),
            *("--repeats", "1", "--env-arm", f"pinned:{pairs}", "--restart-times", "--out", str(out)),
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()

    # Three starts: the daemon arm, the env arm, then the daemon arm again, alone, as first started.
    assert len(started) == 3
    (first, first_env), (pinned, pinned_env), (again, again_env) = started
    assert {k: pinned_env.get(k) for k in ENV} == ENV
    assert {k: first_env.get(k) for k in ENV} == {k: again_env.get(k) for k in ENV} == dict.fromkeys(ENV)
    assert pinned.cmd[pinned.cmd.index("--listen") + 2 :] == first.cmd[first.cmd.index("--listen") + 2 :]
    assert again.cmd[again.cmd.index("--listen") + 2 :] == first.cmd[first.cmd.index("--listen") + 2 :]
    assert again.address != first.address and again.proc.returncode == 0
    assert first.proc.returncode == pinned.proc.returncode == 0  # stopped before the second start began
    assert again.spawned_at > max(p.spawned_at for p, _ in started[:2])

    report = json.loads((out / "daemon_vs_raw.json").read_text())
    meta = report["meta"]
    assert meta["env_arms"] == {"pinned": ENV} and meta["complete"] is True
    assert meta["pin_scope"]["pinned"] == "process" and meta["pin_scope"]["daemon"] == "scoped"  # the engine read it
    assert meta["daemon_exit_codes"] == {"daemon": 0, "pinned": 0}
    runs = report["runs"]
    for r in report["rows"]:
        b = r["batch"]
        mine = [x["tokens"] / x["seconds"] for x in runs if x["arm"] == "pinned" and x["batch"] == b]
        base = [x["tokens"] / x["seconds"] for x in runs if x["arm"] == "daemon" and x["batch"] == b]
        assert len(mine) == len(base) == 1 and mine[0] > 0 and r["pinned_tok_s"] == pytest.approx(mine[0])
        assert r["pinned_vs_daemon"] == pytest.approx(r["pinned_tok_s"] / r["daemon_tok_s"])
        assert r["pinned_vs_daemon_spread"] == pytest.approx(ratio_spread(mine, base))
    # the env arm's runs were driven through its own daemon's engine, one decode step per token after the first
    for x in runs:
        if x["arm"] == "pinned":
            assert x["engine_steps"]["decode_steps"] >= x["tokens"] / x["batch"] - 1 > 0, x
    assert sum(x.startswith("bench [") and x.endswith("tok/s") and ", pinned:" in x for x in printed) == 2

    # Start-up: every daemon's first start, spawn to ready and to idle; the second start's ready and first token.
    starts = meta["startup"]
    assert set(starts) == {"daemon", "pinned"}
    for s in starts.values():
        assert 0 < s["ready_s"] <= s["idle_s"], s
    assert pinned.spawned_at - first.spawned_at >= starts["daemon"]["idle_s"]  # spawned once the first was idle
    assert first.ready_seconds == starts["daemon"]["ready_s"] and pinned.ready_seconds == starts["pinned"]["ready_s"]
    for name, s in starts.items():
        assert f"bench: daemon '{name}' ready {s['ready_s']:.2f} s after its spawn" in printed
    second = meta["restart"]
    assert second["daemon"] == "daemon" and second["exit_code"] == 0
    assert 0 < second["ready_s"] <= second["first_token_s"] <= second["idle_s"], second
    assert second["ready_s"] == again.ready_seconds
    # The second start's seconds by phase came from its own stats: all of them before its ready.
    assert {"set-up", "weights", "warm-up"} <= set(second["ready_phases"]), second
    assert 0 < sum(second["ready_phases"].values()) <= second["ready_s"], second
    assert all(name in meta["ready_phases"]["daemon"] for name in ("weights", "warm-up")), meta["ready_phases"]
    assert any(x.startswith("bench: second start of 'daemon': ready ") for x in printed)
    assert any(x.startswith("start-up (from spawn): daemon: ready ") and "second start" in x for x in printed)

    md = (out / "daemon_vs_raw.md").read_text()
    assert "| pinned tok/s | pinned / daemon |" in md
    assert "`MLX_BATCHD_BENCH_PROCESS_PIN=1` `MLX_BATCHD_W4A16=0` (`--env-arm`)" in md
    assert f"| daemon | first | {starts['daemon']['ready_s']:.2f} | - | {starts['daemon']['idle_s']:.2f} |" in md
    assert f"| pinned | first | {starts['pinned']['ready_s']:.2f} |" in md
    assert f"| daemon | second (`--restart-times`) | {second['ready_s']:.2f} | {second['first_token_s']:.2f} |" in md
    assert len([x for x in md.splitlines() if x.startswith(("| 1 |", "| 2 |"))]) == 2
    assert (out / "daemon_vs_raw.png").stat().st_size > 0
