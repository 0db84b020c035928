"""The daemon's cap on ZeroMQ connections (``zmq_max_connections``): a handshake past it is refused
through ZAP, and the client library says so in one error with a stable code instead of waiting."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from clients import Client, RequestError
from tests.conftest import start_daemon
from tests.reference import greedy_reference

CAP = 3


def test_a_client_past_the_cap_is_refused_at_once_and_served_once_one_closes(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(f"zmq_max_connections = {CAP}\n")
    d = start_daemon(tiny_model, tmp_path, "--config", str(config))
    prompt = [5, 6, 7]
    reference = greedy_reference(tiny_model, prompt, 8)[0]
    try:
        with ExitStack() as held:
            clients = [held.enter_context(Client(d.address, timeout=60)) for _ in range(CAP)]
            for c in clients:
                assert c.generate(tokens=prompt, max_tokens=8, temperature=0.0).tokens == reference
            with Client(d.address, timeout=60) as fourth:
                with pytest.raises(RequestError) as refused:
                    fourth.health()  # its own 10 s call timeout would raise TimeoutError instead
                assert refused.value.code == "too_many_connections", refused.value
                assert "zmq_max_connections" in str(refused.value) and "\n" not in str(refused.value)
                with pytest.raises(RequestError) as again:  # a later call fails at once, never waits
                    fourth.generate(tokens=prompt, max_tokens=8)
                assert again.value.code == "too_many_connections"
            for c in clients:  # the refusal took nothing from the clients held
                assert c.generate(tokens=prompt, max_tokens=8, temperature=0.0).tokens == reference
            clients.pop().close()
            with Client(d.address, timeout=60) as newcomer:  # the closed one's place is free again
                assert newcomer.generate(tokens=prompt, max_tokens=8, temperature=0.0).tokens == reference
        assert d.proc.poll() is None, d.log()
    finally:
        assert d.stop() == 0, d.log()
