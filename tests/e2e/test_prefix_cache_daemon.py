"""The prefix cache through a real daemon: a request sharing a prefix with an earlier one is served
from the cache and stays greedy-exact, the counters reach ``stats`` and the Prometheus exposition,
and tenants reuse only their own prefixes unless both are marked ``share_prefix_cache``."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from clients import Client
from tests.conftest import start_daemon, wait_started
from tests.e2e.test_tenants import creds, curve_daemon, keys  # noqa: F401  (the module's key fixture)
from tests.reference import greedy_reference

PREFIX = [(7 * i + 3) % 250 + 4 for i in range(40)]  # longer than the cache's shortest useful match
NEW = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cache(c: Client) -> dict[str, Any]:
    return dict(c.stats()["engine"]["prefix_cache"])


def _exact(model: Path, c: Client, prompt: list[int]) -> None:
    assert c.generate(tokens=prompt, max_tokens=NEW).tokens == greedy_reference(model, prompt, NEW)[0]


def test_a_shared_prefix_is_served_from_the_cache_exactly(tiny_model: Path, tmp_path: Path) -> None:
    port = _free_port()
    d = start_daemon(tiny_model, tmp_path, "--prefix-cache-mb", "64", "--metrics", f"127.0.0.1:{port}")
    try:
        with Client(d.address, timeout=120) as c:
            wait_started(c)  # the cache serves once its check passed (between steps, unless stored)
            assert _cache(c)["serving"] is True  # the CPU passes the warm-vs-cold check
            _exact(tiny_model, c, [*PREFIX, 11, 12])
            before = _cache(c)
            _exact(tiny_model, c, [*PREFIX, 13, 14, 15])
            after = _cache(c)
            assert after["hits"] == before["hits"] + 1 and after["hit_tokens"] - before["hit_tokens"] >= 16
            time.sleep(0.6)  # the loop publishes a snapshot four times a second
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["mlx_batchd_prefix_cache_hits_total"] == after["hit_tokens"]
        assert samples["mlx_batchd_prefix_cache_bytes"] > 0
    finally:
        assert d.stop() == 0, d.log()


def test_tenants_reuse_only_their_own_prefixes_unless_both_share(
    tiny_model: Path,
    tmp_path: Path,
    keys: Path,  # noqa: F811
) -> None:
    tenants = {
        "alice": {"admin": "true"},
        "bob": {},
        "carol": {"share_prefix_cache": "true"},
        "mallory": {"share_prefix_cache": "true"},
    }
    d = curve_daemon(tiny_model, tmp_path, keys, tenants, "--prefix-cache-mb", "64")
    clients = {name: Client(d.address, timeout=120, **creds(keys, name)) for name in tenants}
    try:
        admin = clients["alice"]
        wait_started(admin)
        _exact(tiny_model, clients["alice"], [*PREFIX, 11])
        before = _cache(admin)
        _exact(tiny_model, clients["bob"], [*PREFIX, 12])  # alice's prefix is not bob's
        assert _cache(admin)["hits"] == before["hits"]
        _exact(tiny_model, clients["alice"], [*PREFIX, 13])  # but it is alice's own
        assert _cache(admin)["hits"] == before["hits"] + 1
        _exact(tiny_model, clients["carol"], [*PREFIX, 14])  # shared salt: a first, cold
        before = _cache(admin)
        _exact(tiny_model, clients["mallory"], [*PREFIX, 15])  # hits what carol shared
        assert _cache(admin)["hits"] == before["hits"] + 1
    finally:
        for c in clients.values():
            c.close()
        assert d.stop() == 0, d.log()
