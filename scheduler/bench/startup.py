"""How long the bench's daemons took to start: for each, seconds from its spawn to health answering
``ready`` and to idle (its start-up probe and start-up work done), and with ``--restart-times`` the daemon arm's
second start after every daemon stopped (its caches now warm on this machine): spawn to ready and
to the first token of one short request. Recorded in the report's meta and its Markdown."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from scheduler.bench.arms import wait_idle
from scheduler.bench.output import progress

if TYPE_CHECKING:
    from clients.sync import Client
    from scheduler.spawn import DaemonProcess


def seconds_text(x: float | None) -> str:
    """``12.34 s``, or ``-`` for a time never reached."""
    return "-" if x is None else f"{x:.2f} s"


def ready_line(name: str, proc: DaemonProcess) -> None:
    """The progress line of a daemon that just answered ``ready``."""
    progress(f"bench: daemon '{name}' ready {seconds_text(proc.ready_seconds)} after its spawn")


def wait_idle_timed(name: str, proc: DaemonProcess, client: Client) -> float:
    """``wait_idle`` for one daemon: seconds from its spawn until it was first seen idle (its start-up
    probe and work done), with a progress line."""
    wait_idle({name: client})
    idle = time.monotonic() - proc.spawned_at
    progress(f"bench: daemon '{name}' idle (start-up work done) {idle:.2f} s after its spawn")
    return idle


def startup_meta(procs: dict[str, DaemonProcess], idle: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Each daemon's first start for the meta: spawn to ready and to idle, seconds."""
    return {name: {"ready_s": proc.ready_seconds, "idle_s": idle.get(name)} for name, proc in procs.items()}


def restart(
    model: str, address: str, extra: list[str], env: dict[str, str] | None, prompt: list[int], tokens: int
) -> dict[str, Any]:
    """Start a daemon with ``extra`` and ``env`` again (nothing else of the bench's running), send it
    one short request as soon as it is ready, and stop it: seconds from its spawn to ready, to that
    request's first token and to idle, its exit code, and its seconds by phase (``phases_text``)."""
    from clients.events import TokenEvent
    from clients.sync import Client
    from scheduler.spawn import DaemonProcess

    first_token: float | None = None
    with DaemonProcess(model, address, *extra, env=env) as proc:
        with Client(proc.address, timeout=3600) as client:
            for ev in client.stream(tokens=prompt, max_tokens=tokens):
                if first_token is None and isinstance(ev, TokenEvent) and ev.tokens:
                    first_token = time.monotonic() - proc.spawned_at
            wait_idle({"restart": client})
            idle = time.monotonic() - proc.spawned_at
            engine = client.stats()["engine"]
    return {
        "ready_s": proc.ready_seconds,
        "first_token_s": first_token,
        "idle_s": idle,
        "exit_code": proc.proc.returncode,
        "ready_phases": dict(engine.get("ready_phases", {})),
        "start_up_s": {name: row["seconds"] for name, row in (engine.get("start_up") or {}).items()},
    }


def phases_text(t: dict[str, Any]) -> str:
    """A start's seconds by phase from ``restart``: before ready, then the start-up work after it."""
    before = ", ".join(f"{k} {v:.1f}" for k, v in t.get("ready_phases", {}).items()) or "-"
    after = ", ".join(f"{k} {v:.1f}" for k, v in t.get("start_up_s", {}).items()) or "-"
    return f"before ready (s): {before}; start-up work after it (s): {after}"


def startup_markdown(meta: dict[str, Any]) -> str:
    """The start-up table: every daemon's first start and, with ``--restart-times``, the daemon arm's
    second; empty where the meta has none."""
    starts: dict[str, dict[str, Any]] = meta.get("startup") or {}
    if not starts:
        return ""

    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        "| daemon | start | spawn to ready (s) | spawn to first token (s) | spawn to idle (s) |",
        "|---|---|---|---|---|",
    ]
    for name, s in starts.items():
        lines.append(f"| {name} | first | {cell(s.get('ready_s'))} | - | {cell(s.get('idle_s'))} |")
    again = meta.get("restart")
    if again:
        lines.append(
            f"| {again['daemon']} | second (`--restart-times`) | {cell(again.get('ready_s'))} | "
            f"{cell(again.get('first_token_s'))} | {cell(again.get('idle_s'))} |"
        )
    note = (
        "start-up: seconds from the daemon's spawn; the daemons start one after another, each once the previous "
        "is idle (its start-up probe and work done), beside this process's own copy of the model."
    )
    if again:
        note += (
            " The second start runs alone, after every daemon stopped, with the first start's options; "
            "its first token is one short request's, sent as soon as it answered ready."
        )
    return "\n".join(lines) + "\n\n" + note + "\n"


def second_start_text(again: dict[str, Any]) -> str:
    """The daemon arm's second start, in words."""
    return (
        f"second start of 'daemon': ready {seconds_text(again['ready_s'])}, "
        f"first token {seconds_text(again['first_token_s'])} ({phases_text(again)})"
    )


def startup_line(meta: dict[str, Any]) -> str:
    """Every daemon's start (spawn to ready, to idle) and the second start where measured, one line."""
    starts = ", ".join(
        f"{k}: ready {seconds_text(v['ready_s'])}, idle {seconds_text(v['idle_s'])}" for k, v in meta["startup"].items()
    )
    if "restart" in meta:
        starts += "; " + second_start_text(meta["restart"])
    return f"start-up (from spawn): {starts}"
