"""The evaluation tool's speculative decoding equals greedy decoding on the shipped demo set (CPU, seconds).

Why: the acceptance numbers in docs/demo-models.md come from ``tools.demo.evaluate``; they mean
something only if its speculative loop emits exactly the target's greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.engine.test_demo_models import PROMPT, draft, head, target  # noqa: F401  (the shipped set's fixtures)
from tools.demo import evaluate


@pytest.mark.parametrize("kind", ["draft model", "MTP head"])
def test_speculative_decoding_equals_greedy(target, draft, head, kind):  # noqa: F811  (fixtures)
    model, tokenizer = target
    eos = set(tokenizer.eos_token_ids)
    drafter = evaluate.DraftModelDrafter(draft[0]) if kind == "draft model" else evaluate.MTPDrafter(head)
    prompt = tokenizer.encode(PROMPT)
    ref = evaluate.greedy(model, prompt, 12, eos)
    st = evaluate.speculative(model, drafter, prompt, 12, 3, eos)
    assert st.tokens[: len(ref)] == ref
    assert 0 <= st.accepted <= st.drafted
