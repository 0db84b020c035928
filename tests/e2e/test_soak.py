"""Soak: a client that floods the daemon and never reads, and a client library whose event loop stalls
while its streams run. Neither process may abort (libzmq's heartbeat assertions, zeromq/libzmq#3937),
and the well-behaved clients get every token, byte-exact."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from clients import Client
from scheduler.spawn import DaemonProcess
from tests.conftest import Daemon, start_daemon
from tests.reference import greedy_reference
from workers.demo import demo_path

FLOOD_S = 8.0
#: Long enough for the stalled client's receive queue to pass libzmq's default 1,000 messages and its
#: 3 s heartbeat timeout to run out.
STALL_S = 12.0

#: Sends submits as fast as the socket takes them for ``argv[2]`` seconds and never reads, with the
#: heartbeat settings the client library uses (PINGs every second, a 3 s timeout and a 6 s TTL). The
#: flooder's own input is unbounded, so its own libzmq survives its heartbeat timeouts.
FLOODER = """
import sys, time, zmq
from clients.protocol import PROTOCOL_VERSION, pack
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
s.setsockopt(zmq.HEARTBEAT_TTL, 6000)
s.setsockopt(zmq.RCVHWM, 0)
s.setsockopt(zmq.LINGER, 0)
s.connect(sys.argv[1])
stop_at, n = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < stop_at:
    try:
        s.send(pack({"v": PROTOCOL_VERSION, "type": "submit", "id": f"f{n}", "prompt": "x", "max_tokens": 1}), zmq.NOBLOCK)
        n += 1
    except zmq.Again:
        s.poll(50, zmq.POLLOUT)
print(n, flush=True)
"""

#: Streams three greedy requests; once tokens flow, blocks its own event loop for ``argv[3]`` seconds
#: (an application doing blocking work in the loop), then reads on. Prints every stream's tokens.
STALLER = """
import json, sys, time, anyio
from clients import AsyncClient, TokenEvent, EndEvent

async def main():
    max_tokens, stall = int(sys.argv[2]), float(sys.argv[3])
    flowing = anyio.Event()
    out = {}
    async with AsyncClient(sys.argv[1]) as c:
        async def one(i):
            toks, end = [], None
            async for ev in c.stream(tokens=[5 + i, 6, 7], max_tokens=max_tokens, temperature=0.0):
                if isinstance(ev, TokenEvent):
                    toks += ev.tokens
                    flowing.set()
                elif isinstance(ev, EndEvent):
                    end = ev.finish_reason
            out[i] = (toks, end)
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
            await flowing.wait()
            time.sleep(stall)
    print(json.dumps(out), flush=True)

anyio.run(main)
"""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_flood_that_never_reads_does_not_stop_the_daemon_or_its_other_clients(tmp_path: Path) -> None:
    """The flood starts with the daemon: a queue it fills faster than the daemon reads stops the
    connection's input, the flooder's own heartbeats then time out and it hangs up on that stopped input.
    A client served during and after the flood gets byte-exact tokens."""
    model = demo_path()
    address = f"ipc://{tmp_path / 'daemon.sock'}"
    d = Daemon(DaemonProcess(model, address, log=(tmp_path / "daemon.log").open("w")), tmp_path / "daemon.log")
    flood = subprocess.Popen([sys.executable, "-c", FLOODER, address, str(FLOOD_S)], stdout=subprocess.PIPE, text=True)
    prompt = list(b"def main():")
    reference = greedy_reference(model, prompt, 24)[0]
    try:
        d.process.wait_ready(timeout=120)
        out, _ = flood.communicate(timeout=60)
        assert flood.returncode == 0 and int(out) > 10_000  # it did flood
        assert d.proc.poll() is None, d.log()
        assert _rss_mib(d.proc.pid) < 1024, d.log()  # the socket's queue is bounded
        with Client(address, timeout=120) as c:
            assert c.generate(tokens=prompt, max_tokens=24, temperature=0.0).tokens == reference
            assert c.health()["status"] == "ready"
    finally:
        flood.kill()
        flood.wait(timeout=30)
        assert d.stop() == 0, d.log()


def test_a_client_whose_event_loop_stalls_gets_every_token_and_neither_process_aborts(
    tiny_model: Path, tmp_path: Path
) -> None:
    max_tokens = 1200
    d = start_daemon(tiny_model, tmp_path)
    references: dict[str, list[int]] = {}
    ref_thread = threading.Thread(
        target=lambda: references.update(
            {str(i): greedy_reference(tiny_model, [5 + i, 6, 7], max_tokens)[0] for i in range(3)}
        )
    )
    ref_thread.start()
    try:
        run = subprocess.run(
            [sys.executable, "-c", STALLER, d.address, str(max_tokens), str(STALL_S)],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert d.proc.poll() is None, d.log()
        ref_thread.join()
        got = json.loads(run.stdout)
        for i in ("0", "1", "2"):
            tokens, end = got[i]
            assert end == "length" and tokens == references[i], i
    finally:
        ref_thread.join()
        assert d.stop() == 0, d.log()
