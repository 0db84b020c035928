"""TEST SEAMS for fault injection: failures MLX does not produce on demand, named as such.

Set in-process (``faults.request_fault = ...``) or, for a daemon in a child process, through the
environment: ``MLX_BATCHD_TEST_FAULTS="request_token=257,engine_loop_after=40"``.

- ``request_token=T``: processing any sequence whose prompt contains token ``T`` raises (the
  engine must end that request alone and keep serving the others).
- ``engine_loop_after=N``: the engine loop itself raises after ``N`` iterations (the daemon must
  tell every client ``engine_dead`` and exit non-zero).

Never set in production; nothing here does anything unless a test sets it.
"""

from __future__ import annotations

from workers import envs

ENV = envs.TEST_FAULTS.name


class InjectedFault(RuntimeError):
    """Raised by a seam; its message says so."""


def _parse(spec: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        out[key] = int(value)
    return out


_spec = _parse(envs.read(envs.TEST_FAULTS))
request_token: int | None = _spec.get("request_token")
engine_loop_after: int | None = _spec.get("engine_loop_after")


def check_request(prompt: list[int]) -> None:
    if request_token is not None and request_token in prompt:
        raise InjectedFault(f"injected per-request fault (test seam {ENV}: request_token={request_token})")


def check_loop(iteration: int) -> None:
    if engine_loop_after is not None and iteration >= engine_loop_after:
        raise InjectedFault(f"injected engine loop failure (test seam {ENV}: engine_loop_after={engine_loop_after})")
