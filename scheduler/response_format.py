"""Structured output at the front end: OpenAI's ``response_format`` to the wire's, and the check that
a request's grammar compiles for the model before it is admitted.

The wire's ``response_format`` (``clients.parse.parse_response_format``) is checked for shape
without the model; here, once the tokenizer is known, it becomes an llguidance grammar
(``workers.api.grammar``) that must compile against the tokenizer, or the request is refused with
``bad_field`` naming ``response_format`` and the engine's reason. The engine builds the same
grammar again from the same text (memoised), so nothing but the text crosses to it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from clients.protocol import ErrorCode, ProtocolError, Submit
from workers.api.grammar import compile_error, grammar_text, lltokenizer


def grammar_of(req: Submit) -> str | None:
    """The llguidance grammar of an accepted request's ``response_format`` (``None``: free text)."""
    rf = req.sampling.response_format
    return None if rf is None else grammar_text(*rf)


@lru_cache(maxsize=256)
def _error(kind: str, text: str, tokenizer: Any, vocab_size: int) -> str | None:
    try:
        return compile_error(grammar_text(kind, text), lltokenizer(tokenizer, vocab_size))
    except BaseException as exc:  # the engine's refusal of a schema it cannot read, whatever its type
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":  # pyo3's is a BaseException
            raise
        return str(exc) or type(exc).__name__


def compile_failure(kind: str, text: str, tokenizer: Any, vocab_size: int) -> str | None:
    """Why a grammar does not compile for this tokenizer (``None``: it does); memoised."""
    return _error(kind, text, tokenizer, vocab_size)


def check(req: Submit, tokenizer: Any, vocab_size: int) -> None:
    """Refuse a ``response_format`` the grammar engine cannot compile for this tokenizer. May take
    milliseconds (a large schema; the tokenizer's first use walks the vocabulary): the caller runs
    it off the event loop."""
    rf = req.sampling.response_format
    if rf is None:
        return
    why = _error(rf[0], rf[1], tokenizer, vocab_size)
    if why is not None:
        what = {"json_schema": "schema", "regex": "pattern", "grammar": "grammar"}.get(rf[0], "type")
        first = why.strip().splitlines()[0] if why.strip() else "it does not compile"
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"field 'response_format' has a {what} the grammar engine cannot compile: {first[:300]}",
            req.id,
        )


def from_openai(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the wire's: ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}`` becomes ``{"type": "json_schema", "schema": ...}``; ``text`` and
    ``json_object`` pass as they are; the native ``regex`` and ``grammar`` kinds pass too. Raises
    ``ProtocolError`` (``bad_field``) for a value of the wrong shape."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_FIELD, "field 'response_format' must be an object", None)
    if value.get("type") != "json_schema" or "schema" in value:
        return value
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            "field 'response_format' needs 'json_schema', an object with a 'schema' object ({name, schema, strict})",
            None,
        )
    # No schema: any JSON object, as OpenAI reads it. ``strict`` is how this daemon always decodes.
    schema = spec.get("schema")
    return {"type": "json_object"} if schema is None else {"type": "json_schema", "schema": schema}
