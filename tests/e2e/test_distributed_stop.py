"""SIGTERM to every process of a 2-rank daemon at once (what ``kill -- -PGID`` or systemd's
control-group stop does) is a clean stop: the stream in flight ends ``shutdown``, every rank exits 0,
and no engine process is left. Ranks started by hand on a ring over loopback, so each exit status is
the rank's own."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.helpers.distributed import DEATH_TIMEOUT, RankDaemon, _children, _ends, _gone, _stream_in_flight, linux_only
from tests.helpers.distributed import models as models


@linux_only
def test_sigterm_to_every_rank_at_once_is_a_clean_stop(models: dict[str, str], tmp_path: Path) -> None:
    daemon = RankDaemon(tmp_path, [models["a"]] * 2)
    try:
        daemon.wait_ready()
        (engine_process,) = _children(daemon.procs[0].pid)
        events, thread = _stream_in_flight(daemon.address)
        for pid in (daemon.procs[1].pid, engine_process, daemon.procs[0].pid):
            os.kill(pid, signal.SIGTERM)
        assert daemon.wait(0, DEATH_TIMEOUT) == 0, daemon.output()
        assert daemon.wait(1, DEATH_TIMEOUT) == 0, daemon.output()
        thread.join(DEATH_TIMEOUT)
        (end,) = _ends(events)
        assert end.finish_reason == "error" and end.error is not None and end.error.code == "shutdown", end
        assert _gone([engine_process]) == [], "the engine process outlived its daemon"
        assert "Traceback" not in daemon.output(), daemon.output()
    finally:
        daemon.close()


@linux_only
def test_a_follower_signalled_alone_exits_once_no_stop_comes(models: dict[str, str], tmp_path: Path) -> None:
    """SIGTERM to a follower alone: it follows on for ``--drain-timeout`` + ``--rank-timeout``, then,
    no stop plan having come, exits 1 saying so; rank 0 loses its peer and exits 1 too."""
    daemon = RankDaemon(tmp_path, [models["a"]] * 2, "--rank-timeout", "3")
    try:
        daemon.wait_ready()
        (engine_process,) = _children(daemon.procs[0].pid)
        daemon.procs[1].send_signal(signal.SIGTERM)
        assert daemon.wait(1, DEATH_TIMEOUT) == 1, daemon.output()
        assert "rank 0 did not stop the ranks within 3 s" in daemon.output(), daemon.output()
        assert daemon.wait(0, DEATH_TIMEOUT) == 1, daemon.output()
        assert _gone([engine_process]) == [], "the engine process outlived its daemon"
    finally:
        daemon.close()
