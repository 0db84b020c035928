"""Text streamed by a real daemon continues the prompt: when the output starts with a space, the
text equals the decoded tokens, whole and streamed (``workers.models.loading.keep_leading_space``)."""

from __future__ import annotations

from pathlib import Path

from mlx_lm.utils import load_tokenizer

from clients import Client, TokenEvent
from tests.conftest import start_daemon
from tests.helpers.detokenize import DEMO_TARGET


def test_daemon_text_equals_the_decoded_tokens_when_the_output_starts_with_a_space(tmp_path: Path) -> None:
    """The demo model continues a ``def`` header with the body's indentation: spaces first."""
    tokenizer = load_tokenizer(DEMO_TARGET)
    daemon = start_daemon("demo", tmp_path)
    try:
        with Client(daemon.address, timeout=120) as c:
            r = c.generate("def f(x):\n", max_tokens=24)
            assert r.text.startswith(" ") and r.text == tokenizer.decode(r.tokens)
            streamed = "".join(ev.text for ev in c.stream("def f(x):\n", max_tokens=24) if isinstance(ev, TokenEvent))
            assert streamed == r.text
    finally:
        assert daemon.stop() == 0, daemon.log()
