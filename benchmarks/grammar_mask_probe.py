"""What a grammar engine costs per token on this host's CPU: llguidance against outlines-core.

For one JSON schema and one document that satisfies it, each engine compiles the schema for the
model's tokenizer, then walks the document token by token: before each token it computes the mask of
allowed tokens (a bitmask over the vocabulary), then advances its state by the token. Printed per
engine: the compile time and the mean mask + advance time per token. xgrammar is not measured: it
imports torch (and triton) at import, which an MLX daemon does not carry.

    .venv/bin/python benchmarks/grammar_mask_probe.py workers/models/demo/weights/target [MODEL_DIR ...]
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
DOC = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "ok": true}'
REPEAT = 20


def hf_tokenizer(model_dir: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json")


def llguidance_cost(hf: Any, tokens: list[int], eos: int) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=eos)
    opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=opts)  # type: ignore[arg-type]
    tok_s = time.perf_counter() - t0
    mask = allocate_token_bitmask(1, len(hf))
    compile_s, per = [], []
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in tokens:
            fill_next_token_bitmask(m, mask, 0)
            assert (mask[0, t // 32] >> (t % 32)) & 1, ("token refused", t)
            m.consume_token(t)
        fill_next_token_bitmask(m, mask, 0)
        per.append((time.perf_counter() - t0) / (len(tokens) + 1))
        assert m.is_accepting() and not m.is_error(), m.get_error()
    print(f"  llguidance: tokenizer {tok_s * 1e3:.0f} ms once, compile {np.median(compile_s) * 1e3:.2f} ms")
    return float(np.median(compile_s)), float(np.median(per))


def outlines_cost(hf: Any, tokens: list[int], eos: int) -> tuple[float, float]:
    import llguidance.hf
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=eos)
    vocab: dict[bytes, list[int]] = {}
    for i in range(len(hf)):
        if i != eos and not lltok.is_special_token(i):
            vocab.setdefault(lltok.decode_bytes([i]), []).append(i)
    t0 = time.perf_counter()
    voc = Vocabulary(eos, vocab)  # type: ignore[arg-type]
    regex = build_regex_from_schema(json.dumps(SCHEMA), r" ?")
    index = Index(regex, voc)
    compile_s = time.perf_counter() - t0
    mask = np.zeros((1, (len(hf) + 31) // 32), dtype=np.int32)
    per = []
    for _ in range(REPEAT):
        g = Guide(index)
        t0 = time.perf_counter()
        for t in tokens:
            g.write_mask_into(mask.ctypes.data, mask.size, 4)
            assert (mask[0, t // 32] >> (t % 32)) & 1, ("token refused", t)
            g.advance(t, return_tokens=False)
        g.write_mask_into(mask.ctypes.data, mask.size, 4)
        per.append((time.perf_counter() - t0) / (len(tokens) + 1))
        assert g.is_finished()
    return compile_s, float(np.median(per))


def mx_apply_cost(vocab: int) -> float:
    """Turning one bitmask row into an MLX mask and applying it (the processor's own part)."""
    import mlx.core as mx

    from workers.engine.grammar_mask import apply_bitmask

    logits = mx.random.normal((1, vocab))
    mask = np.full((1, (vocab + 31) // 32), 0x5555_5555, dtype=np.uint32).view(np.int32)
    mx.eval(apply_bitmask(logits, mask[0]))
    t0 = time.perf_counter()
    for _ in range(200):
        mx.eval(apply_bitmask(logits, mask[0]))
    return (time.perf_counter() - t0) / 200


def main(dirs: list[str]) -> None:
    for d in dirs:
        hf = hf_tokenizer(d)
        eos = hf.convert_tokens_to_ids(json.load(open(f"{d}/tokenizer_config.json"))["eos_token"])
        tokens = hf.encode(DOC, add_special_tokens=False)
        print(f"{d}: vocab {len(hf)}, document {len(tokens)} tokens")
        for name, fn in (("llguidance", llguidance_cost), ("outlines-core", outlines_cost)):
            try:
                c, p = fn(hf, tokens, eos)
                print(f"  {name}: compile {c * 1e3:.1f} ms, mask + advance {p * 1e6:.1f} us/token")
            except Exception as exc:
                print(f"  {name}: failed: {type(exc).__name__}: {exc}")
        print(f"  mask to MLX and apply: {mx_apply_cost(len(hf)) * 1e6:.1f} us/row")


if __name__ == "__main__":
    main(sys.argv[1:] or ["workers/models/demo/weights/target"])
