"""A model folder whose greedy answer is a script: it thinks, then calls a tool, the Qwen way.

The tokenizer is the byte tokenizer of ``workers.models.synthetic`` plus Qwen-style added tokens
(``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, so mlx-lm finds thinking markers and
the ``json_tools`` parser its config names) and a few whole phrases, each one token. The chat template
renders tools, tool results and earlier calls, closes the think block when ``enable_thinking`` is
false and opens it (the answer starts inside it, as DeepSeek-R1's does) when ``open_think`` is true. The weights are a real llama whose layers add nothing (their output projections are zero) and
whose embedding is one-hot: the logits depend on the last token alone, a bigram table written into
``lm_head``. Each token has a first successor and a second (half the logit), so a ``logit_bias`` of
-100 on the first takes the second: the native protocol's own control picks among the script's turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from workers.models.synthetic import BYTE_VOCAB, EOS_TOKEN, build_model, llama_config, write_byte_tokenizer

THINK, THINK_END, CALL, CALL_END = "<think>", "</think>", "<tool_call>", "</tool_call>"
REASON = "The user asks for the weather in Paris; the tool knows it."
CALL_A = '\n{"name": "get_weather", '
CALL_B = '"arguments": {"city": "Paris", '
CALL_C = '"unit": "celsius"}}\n'
ANSWER = "It is sunny in Paris."
PHRASES = [THINK, THINK_END, CALL, CALL_END, REASON, CALL_A, CALL_B, CALL_C, ANSWER]
#: The call the script makes, as the OpenAI API shapes its function.
CALL_NAME = "get_weather"
CALL_ARGUMENTS = {"city": "Paris", "unit": "celsius"}

TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}: {{ t.function.description }}"
    " {{ t.function.parameters | tojson }}{% endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}\n"
    "{%- elif m.role == 'assistant' %}<|assistant|>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{%- elif open_think is defined and open_think %}<think>{% endif %}{% endif %}"
)
#: A template without tools: the same model folder with it cannot take ``tools``.
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def script(ids: dict[str, int]) -> dict[str, tuple[str, str | None]]:
    """Each scripted token's first and second successor."""
    return {
        "<|assistant|>": (THINK, ANSWER),
        THINK: (REASON, None),
        REASON: (THINK_END, None),
        THINK_END: (CALL, ANSWER),
        CALL: (CALL_A, None),
        CALL_A: (CALL_B, None),
        CALL_B: (CALL_C, None),
        CALL_C: (CALL_END, None),
        CALL_END: (EOS_TOKEN, None),
        ANSWER: (EOS_TOKEN, None),
    }


def write_agent_model(path: Path, *, template: str = TEMPLATE, tool_parser: str | None = "json_tools") -> Path:
    """Write the scripted model to ``path``; ``template`` and ``tool_parser`` (``None``: none named,
    and none inferred from a template without tool markers) set what its tokenizer can do."""
    from tokenizers import AddedToken, Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path, BYTE_VOCAB, 4096)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|tool|>", special=True)])
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in PHRASES])
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    ids = tok.get_vocab()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    if tool_parser is not None:
        config["tool_parser_type"] = tool_parser
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    hidden = 4 * ((vocab + 3) // 4 + 4)
    cfg = llama_config(hidden=hidden, layers=1, ffn=32, heads=4, kv_heads=2, vocab=vocab, dtype="float32")
    cfg["tie_word_embeddings"] = False
    model = build_model(cfg)
    head = [[0.0] * hidden for _ in range(vocab)]
    for t in range(vocab):
        head[ids[EOS_TOKEN]][t] = 3.0  # anything off the script ends the answer
    for token, (first, second) in script(ids).items():
        t = ids[token]
        head[ids[EOS_TOKEN]][t] = 0.0
        head[ids[first]][t] = 3.0
        if second is not None:
            head[ids[second]][t] = 1.5
    updates = [("model.embed_tokens.weight", mx.eye(vocab, hidden)), ("lm_head.weight", mx.array(head))]
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            updates.append((name, mx.zeros_like(value)))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())

    from mlx_lm.utils import save_config, save_model

    save_model(path, model)
    save_config(dict(cfg), path / "config.json")
    return path
