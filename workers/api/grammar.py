"""Response formats as llguidance grammars, and the front end's check that one compiles for the model's
tokenizer before admission. llguidance only, no MLX: the front end runs this; the engine masks the
logits with the grammar (``workers.engine.grammar_mask``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance

#: JSON without free whitespace: one space after ',' and ':' (as ``json.dumps`` writes), so a model
#: cannot spend its budget on blanks between tokens of the document.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: The response format kinds a request may name, and what each one's text is.
KINDS = ("json_object", "json_schema", "regex", "grammar")

_TOKENIZERS: dict[tuple[int, int], tuple[Any, llguidance.LLTokenizer]] = {}


def lltokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of an mlx-lm ``TokenizerWrapper`` (or a Hugging Face fast tokenizer),
    built once per tokenizer: it walks the whole vocabulary."""
    key = (id(tokenizer), vocab_size)
    hit = _TOKENIZERS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    import llguidance.hf  # imports transformers: only once a tokenizer is there to convert

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=max(vocab_size, len(hf)), eos_token=eos)
    _TOKENIZERS[key] = (tokenizer, lltok)
    return lltok


@lru_cache(maxsize=256)
def grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar for a response format: ``json_schema`` (``text`` is the schema as
    JSON), ``json_object`` (any JSON object), ``regex`` or ``grammar`` (llguidance's Lark).
    Raises ``ValueError`` for a schema that is not a JSON object."""
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_schema":
        schema = json.loads(text)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise ValueError(f"unknown response format {kind!r}; expected one of {', '.join(KINDS)}")


def compile_error(grammar: str, lltok: llguidance.LLTokenizer) -> str | None:
    """Why the grammar cannot run for this tokenizer (the engine's message), or ``None``."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        return messages[0] if messages else "the grammar does not compile"
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    return matcher.get_error() if matcher.is_error() else None
