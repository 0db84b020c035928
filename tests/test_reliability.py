"""A client that dies mid-stream loses its requests, and nobody else notices."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from clients import Client
from tests.conftest import Daemon, start_daemon
from tests.reference import greedy_reference

STREAMER = """
import sys
from clients import Client, TokenEvent
with Client(sys.argv[1]) as c:
    for ev in c.stream(tokens=[5, 6, 7], max_tokens=4000):
        if isinstance(ev, TokenEvent):
            print("streaming", flush=True)
"""


def test_kill_9_of_a_client_mid_stream_frees_its_slot(tiny_model: Path, tmp_path: Path) -> None:
    daemon = start_daemon(tiny_model, tmp_path)
    try:
        _kill_a_streaming_client(daemon, tiny_model)
    finally:
        assert daemon.stop() == 0


def _kill_a_streaming_client(daemon: Daemon, tiny_model: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", STREAMER, daemon.address], stdout=subprocess.PIPE, text=True)
    assert victim.stdout is not None and victim.stdout.readline().strip() == "streaming"
    with Client(daemon.address, timeout=120) as c:
        assert c.stats()["requests_in_flight"] >= 1
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        deadline = time.monotonic() + 30
        while c.stats()["requests_in_flight"] or c.stats()["engine"]["active_sequences"]:
            assert time.monotonic() < deadline, c.stats()
            time.sleep(0.05)
        # It ended because its client vanished, long before its 4000 tokens.
        assert c.stats()["engine"]["generated_tokens"] < 3000
        # The daemon carries on, exact as ever.
        assert c.generate(tokens=[9, 9], max_tokens=12).tokens == greedy_reference(tiny_model, [9, 9], 12)[0]
