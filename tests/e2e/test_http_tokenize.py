"""`/tokenize`, `/detokenize` and `/metrics` on the HTTP door, and `serve --chat-template FILE`, through a
real daemon (the demo model, tenants, both HTTP listeners) and httpx."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TEST_CONTEXT, Daemon
from tests.e2e.test_http import http_url, wait_until
from tests.e2e.test_http_anthropic import tenants_setup
from tests.helpers.daemons import tenants_daemon
from tests.helpers.exposition import strict_problems

#: A template unlike the demo model's own, so what renders with it cannot have come from the model's.
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict[str, str], int]]:
    d = tmp_path_factory.mktemp("tokenize")
    keys = tenants_setup(d)
    (d / "template.jinja").write_text(TEMPLATE)
    port = free_port()
    daemon = tenants_daemon(
        "demo",
        d,
        d,
        "--max-tokens-cap",
        "200",
        "--chat-template",
        str(d / "template.jinja"),
        "--metrics",
        f"127.0.0.1:{port}",
    )
    yield daemon, keys, port
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def url(setup: tuple[Daemon, dict[str, str], int]) -> str:
    return http_url(setup[0])


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from workers.models.loading import load_tokenizer

    return load_tokenizer("demo")


def post(url: str, route: str, body: dict[str, Any], key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/{route}", json=body, headers=headers, timeout=30)


def test_tokenize_and_detokenize_round_trip(
    url: str, setup: tuple[Daemon, dict[str, str], int], tokenizer: Any
) -> None:
    key = setup[1]["bob"]
    prompt = "def fibonacci(n):\n    return n"
    r = post(url, "tokenize", {"model": "demo", "prompt": prompt}, key)
    assert r.status_code == 200, r.text
    want = list(tokenizer.encode(prompt))
    assert r.json() == {"count": len(want), "max_model_len": TEST_CONTEXT, "tokens": want, "token_strs": None}
    plain = post(url, "tokenize", {"prompt": prompt, "add_special_tokens": False}, key).json()
    assert plain["tokens"] == list(tokenizer.encode(prompt, add_special_tokens=False))
    strs = post(url, "tokenize", {"prompt": prompt, "return_token_strs": True}, key).json()["token_strs"]
    assert strs == list(tokenizer.convert_ids_to_tokens(want))

    back = post(url, "detokenize", {"model": "demo", "tokens": want}, key)
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": tokenizer.decode(want)} and tokenizer.decode(want) == prompt


def test_messages_render_with_the_chat_template_override(
    url: str, setup: tuple[Daemon, dict[str, str], int], tokenizer: Any
) -> None:
    """`--chat-template` replaces the model's template for every door: `/tokenize`, chat completions
    and `/v1/messages` all count the prompt it renders."""
    key = setup[1]["bob"]
    override = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, chat_template=TEMPLATE))
    assert tokenizer.decode(override).endswith("[user] def fibonacci(n):\n[assistant] ")
    assert override != list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    r = post(url, "tokenize", {"messages": CHAT}, key)
    assert r.status_code == 200, r.text
    assert (r.json()["tokens"], r.json()["count"]) == (override, len(override))
    bare = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=False, chat_template=TEMPLATE))
    assert post(url, "tokenize", {"messages": CHAT, "add_generation_prompt": False}, key).json()["tokens"] == bare

    chat = post(url, "v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, key)
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(override), chat.text
    body = {"max_tokens": 2, "system": CHAT[0]["content"], "messages": CHAT[1:]}
    message = post(url, "v1/messages", body, key)
    assert message.status_code == 200 and message.json()["usage"]["input_tokens"] == len(override), message.text


@pytest.mark.parametrize(
    ("route", "body", "param", "code"),
    [
        ("tokenize", {"prompt": "a", "messages": CHAT}, None, "bad_field"),
        ("tokenize", {}, None, "bad_field"),
        ("tokenize", {"prompt": 5}, "prompt", "bad_field"),
        ("tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "bad_field"),
        ("tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages", "bad_field"),  # no tool_call_id
        (
            "tokenize",
            {"messages": CHAT, "chat_template_kwargs": {"tokenize": False}},
            "chat_template_kwargs",
            "bad_field",
        ),
        ("detokenize", {"tokens": "abc"}, "tokens", "bad_field"),
        ("detokenize", {"tokens": [1, True]}, "tokens", "bad_field"),
        ("detokenize", {"tokens": [1, 257]}, "tokens", "token_out_of_range"),
        ("detokenize", {"tokens": [-1]}, "tokens", "token_out_of_range"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    url: str, setup: tuple[Daemon, dict[str, str], int], route: str, body: dict[str, Any], param: str | None, code: str
) -> None:
    r = post(url, route, body, setup[1]["bob"])
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
    assert "\n" not in r.json()["error"]["message"]


def test_a_missing_key_and_another_model_are_refused(url: str, setup: tuple[Daemon, dict[str, str], int]) -> None:
    for route, body in (("tokenize", {"prompt": "a"}), ("detokenize", {"tokens": [1]})):
        assert post(url, route, body, None).status_code == 401
        assert post(url, route, body, "mlxb-wrong").json()["error"]["code"] == "invalid_api_key"
        r = post(url, route, {**body, "model": "other"}, setup[1]["bob"])
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_on_the_http_port_for_the_operator_only(url: str, setup: tuple[Daemon, dict[str, str], int]) -> None:
    _, keys, port = setup
    assert post(url, "tokenize", {"prompt": "a"}, keys["bob"]).status_code == 200
    r = post(url, "v1/messages", {"max_tokens": 1, "messages": CHAT[1:]}, keys["bob"])
    assert r.status_code == 200, r.text
    done = ("mlx_batchd_requests_total", (("outcome", "length"), ("tenant", "bob")))

    def scrape() -> str:
        got = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {keys['ops']}"}, timeout=10)
        assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain"), got.text
        return got.text

    wait_until(lambda: samples(scrape()).get(done, 0) >= 1, "bob's request in the exposition")
    text = scrape()
    assert strict_problems(text) == [], text
    listener = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert strict_problems(listener) == []
    assert {name for name, _ in samples(text)} == {name for name, _ in samples(listener)}

    plain = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {keys['bob']}"}, timeout=10)
    assert plain.status_code == 403 and plain.json()["error"]["code"] == "forbidden"
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401


@pytest.mark.parametrize(
    ("content", "said"), [(None, "cannot read"), ("{% for m in messages %}", "is not a Jinja template"), (" ", "empty")]
)
def test_a_bad_chat_template_file_is_one_line_and_exit_2(tmp_path: Path, content: str | None, said: str) -> None:
    path = tmp_path / "template.jinja"
    if content is not None:
        path.write_text(content)
    out = subprocess.run(
        [sys.executable, "-m", "scheduler", "serve", "--chat-template", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "--chat-template" in out.stderr and said in out.stderr
