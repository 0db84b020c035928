"""The group of ranks under ``mlx.distributed``: who this process is, joining, and its collectives.

``World`` is this process's place among the ranks ``mlx.launch`` started (one rank alone when it was
not launched); its collectives run on the model's stream and turn a lost peer into ``PeerLost``. The
facts behind the choices here are in ``workers.dist``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

#: Seconds a rank waits for the others to join the group before it gives up (ranks start together).
JOIN_TIMEOUT_S = 120.0

log = logging.getLogger("mlx_batchd.distributed")


class DistributedError(RuntimeError):
    """A set-up that cannot serve, in one line that says what to change."""


class PeerLost(DistributedError):
    """A collective failed because another rank is gone: this rank must stop too, non-zero."""


class ShardError(DistributedError, ValueError):
    """A model that cannot be split over this world (family, head counts, or different weights)."""


# ----------------------------------------------------------------------------- the group


def _model_stream() -> Any:
    """The stream mlx-lm runs the model on (``generate_step``, ``BatchGenerator``): a per-thread one."""
    from mlx_lm.generate import generation_stream

    return generation_stream


def launched_backend(env: Mapping[str, str]) -> str | None:
    """The backend ``mlx.launch`` (or ``mpirun``) set this process up for, from its environment;
    ``None`` when it was started on its own.

    ``mlx.launch -n 1`` writes an empty ``MLX_HOSTFILE``, on which ``mx.distributed.init`` raises
    even with ``strict=False``; it counts as not launched."""
    if env.get("MLX_JACCL_COORDINATOR") or env.get("MLX_IBV_DEVICES"):
        return "jaccl"
    if env.get("NCCL_HOST_IP") and env.get("MLX_WORLD_SIZE"):
        return "nccl"
    hostfile = env.get("MLX_HOSTFILE")
    if hostfile and env.get("MLX_RANK") is not None:
        try:
            if os.path.getsize(hostfile) == 0:
                return None
        except OSError:
            pass  # let init name the missing file
        return "ring"
    if env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE"):
        return "mpi"
    return None


def launched_rank(env: Mapping[str, str]) -> int | None:
    """This process's rank as the launcher set it, read without joining the group (rank 0 of a
    daemon must not join it: its engine process does); ``None`` when not launched."""
    if launched_backend(env) is None:
        return None
    for key in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = env.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def launched_size(env: Mapping[str, str]) -> int | None:
    """How many ranks the launcher started, read without joining the group; ``None`` when not
    launched or not stated (the hostfile or variable is unreadable: joining then says why)."""
    backend = launched_backend(env)
    if backend is None:
        return None
    for key in ("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = env.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    listing = env.get("MLX_HOSTFILE") if backend == "ring" else env.get("MLX_IBV_DEVICES")
    if listing:
        try:
            hosts = json.loads(Path(listing).read_text())
        except (OSError, ValueError):
            return None
        return len(hosts) if isinstance(hosts, list) else None
    return None


def _join(backend: str, rank: str, timeout_s: float) -> Any:
    """``mx.distributed.init`` with a deadline.

    A ring rank waits for its peers without one, and ``init`` holds the GIL meanwhile, so no Python
    thread or handler can end the wait: where nothing else uses ``SIGALRM`` an alarm ends the
    process (its default action) once ``timeout_s`` passed, rather than a rank whose peer never
    started (having refused its set-up) waiting for good. The line before says what it waits for."""
    log.info("rank %s joining the %s group (the other ranks have %.0f s to join)", rank, backend, timeout_s)
    armed = signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None) and timeout_s > 0
    if armed:
        signal.alarm(max(1, math.ceil(timeout_s)))
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise DistributedError(
            f"cannot join the {backend} group as rank {rank}: {' '.join(str(exc).split())}"
        ) from None
    finally:
        if armed:
            signal.alarm(0)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks serving one model."""

    rank: int
    size: int
    #: ``single`` when not launched, else the ``mx.distributed`` backend (ring, nccl, jaccl, mpi).
    backend: str
    group: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def single(cls) -> World:
        return cls(0, 1, "single", None)

    @classmethod
    def from_env(
        cls, backend: str | None = None, env: Mapping[str, str] | None = None, timeout_s: float = JOIN_TIMEOUT_S
    ) -> World:
        """Join the group ``mlx.launch`` set up (``backend`` overrides the detected one); ``single()``
        when this process was not launched as one of several. A ``DistributedError`` when the other
        ranks have not joined within ``timeout_s``."""
        env = os.environ if env is None else env
        backend = backend or launched_backend(env)
        if backend is None:
            return cls.single()
        group = _join(backend, env.get("MLX_RANK", "?"), timeout_s)
        if group.size() == 1:
            return cls.single()
        return cls(group.rank(), group.size(), backend, group)

    @property
    def leader(self) -> bool:
        """Rank 0: the one that owns the front end and decides every iteration."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def describe(self) -> dict[str, Any]:
        """For ``stats``: which rank answered, of how many, over what."""
        return {"rank": self.rank, "world_size": self.size, "backend": self.backend}

    def all_sum(self, x: mx.array) -> mx.array:
        """``mx.distributed.all_sum`` evaluated now; a lost peer raises ``PeerLost``."""
        return self._collective(mx.distributed.all_sum, x)

    def all_gather(self, x: mx.array) -> mx.array:
        """``mx.distributed.all_gather`` (rank order along axis 0) evaluated now."""
        return self._collective(mx.distributed.all_gather, x)

    def barrier(self) -> None:
        """Return once every rank got here (a one-element sum)."""
        if self.distributed:
            self.all_sum(mx.array([1], dtype=mx.int32))

    def _collective(self, op: Callable[..., mx.array], x: mx.array) -> mx.array:
        """Run ``op`` on the model's stream, behind any forward still in flight there.

        mlx-lm evaluates the next decode step ahead (``async_eval`` on its per-thread generation
        stream), and a sharded forward holds collectives. A collective issued meanwhile on another
        stream runs on another thread over the same ring sockets: the two interleave, and a follower
        received zeros or activation bytes in place of the plan (seen in most runs under
        ``mlx.launch`` after ``generate_step`` returned with its look-ahead step still running)."""
        if not self.distributed:
            return x
        try:
            with mx.stream(_model_stream()):
                out = op(x, group=self.group)
            mx.eval(out)
        except RuntimeError as exc:
            raise PeerLost(f"rank {self.rank}: the {self.backend} group broke ({' '.join(str(exc).split())})") from None
        return out


#: How mlx's backends word a collective whose peer went away, as raised from inside a forward.
_LOST_WORDS = ("connection to a peer was lost", "[ring]", "[nccl]", "[jaccl]", "[mpi]")


def as_peer_lost(world: World, exc: BaseException) -> PeerLost | None:
    """``exc`` as a ``PeerLost`` when it is a collective that failed inside a sharded forward (mlx
    raises a ``RuntimeError`` naming its backend), else ``None``."""
    if isinstance(exc, PeerLost):
        return exc
    text = " ".join(str(exc).split())
    if not world.distributed or not isinstance(exc, RuntimeError) or not any(w in text for w in _LOST_WORDS):
        return None
    return PeerLost(f"rank {world.rank}: the {world.backend} group broke ({text})")


# ----------------------------------------------------------------------------- broadcast


def uint8_array(data: bytes) -> mx.array:
    """``data`` as the ``uint8`` array a collective carries."""
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def array_bytes(x: mx.array) -> bytes:
    """A collective's result back as bytes."""
    return np.asarray(x).tobytes()
