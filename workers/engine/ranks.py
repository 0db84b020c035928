"""The engine loop's side across ranks: a follower's loop (rank 0's plans, each checked against this
rank's state before it is applied), the digest of tokens and ends the ranks compare, and the watchdog
that ends a rank stuck inside a collective. ``EngineThread`` inherits it; on one rank none of it runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from workers.api import Dead, EngineSettings, Finished, Signal, Tokens
from workers.dist import DistributedError, Lockstep, Plan, World
from workers.engine.engine import Engine

log = logging.getLogger("mlx_batchd.engine")

#: The code of a shutdown the daemon asked for (SIGTERM, SIGINT); any other code means it is gone.
SHUTDOWN = "shutdown"


class Ranks:
    """``EngineThread``'s part across ranks. The attributes and the methods declared for the type
    checker are ``EngineThread``'s own."""

    world: World
    _emit: Callable[[list[Signal]], None]
    _settings: EngineSettings
    _thread: threading.Thread
    _lockstep: Lockstep
    _digest: bytes
    _busy_since: float | None
    _cache_dirty: bool

    if TYPE_CHECKING:

        def _apply(self, engine: Engine, plan: Plan) -> bool: ...

        def _release_cache(self) -> None: ...

    def _watch(self) -> None:
        """End this process when one iteration runs past ``rank_timeout_s``.

        A ring collective whose peer died mid-transfer can wait for good (its promise is never
        kept), with nothing raised: the engine thread cannot notice, and the daemon would hold
        every request open. The rank says why (``Dead``, and in its log) and exits 1; the others
        then lose their peer in turn."""
        limit = self._settings.rank_timeout_s
        while self._thread.is_alive():
            time.sleep(min(1.0, limit / 4))
            since = self._busy_since
            if since is None or time.monotonic() - since <= limit:
                continue
            why = (
                f"rank {self.world.rank}: one engine iteration ran past {limit:g} s (rank_timeout in the config file); "
                "a peer is gone or stuck inside a collective, so this rank stops"
            )
            log.error("%s", why)
            self._emit([Dead(why)])
            time.sleep(1.0)  # the word leaves with the engine process's socket
            os._exit(1)

    def _follow(self, engine: Engine) -> None:
        """Another rank's loop: rank 0's plans, each checked against this rank's state, then applied."""

        def apply(plan: Plan) -> None:
            want, have = plan.decisions.get("check"), self._state(engine)
            if want != have:
                raise DistributedError(
                    f"rank {self.world.rank} diverged from rank 0 before plan {plan.iteration} "
                    f"(rank 0: {want}, rank {self.world.rank}: {have}); stopping every rank"
                )
            self._apply(engine, plan)
            if self._cache_dirty and not engine.has_work and not engine.probing:
                self._release_cache()

        while True:
            self._busy_since = time.monotonic()
            plan = self._lockstep.receive()
            if not plan.stop:
                apply(plan)
                continue
            code = plan.decisions.get("stop", SHUTDOWN)
            if code != SHUTDOWN:  # rank 0's engine stopped because its daemon is gone, not asked to
                raise DistributedError(f"rank 0 stopped every rank ({code}); its daemon is gone")
            return

    def _note(self, events: list[Signal]) -> None:
        """Fold this iteration's tokens and ends into the digest ``_state`` compares across ranks."""
        h = hashlib.blake2b(self._digest, digest_size=8)
        for e in events:
            if isinstance(e, Tokens):
                h.update(msgpack.packb([e.seq, e.tokens]))
            elif isinstance(e, Finished):
                h.update(msgpack.packb([e.seq, str(e.reason)]))
        self._digest = h.digest()

    def _state(self, engine: Engine) -> list[Any]:
        """What every rank's engine must agree on between plans (lists only: it crosses msgpack)."""
        verdicts = [[name, v.level] for name, v in sorted(engine.verdicts.items())]
        bursting = engine.runner.current is not None
        return [engine.active, engine.batch_size(), bursting, engine.probing, verdicts, self._digest.hex()]
