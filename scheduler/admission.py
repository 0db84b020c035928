"""Turning a parsed submit into an engine job: tokenizing, and the checks that need the model.

``clients.parse.parse_request`` checks shapes and types; this module checks what only the
daemon knows: the vocabulary, the context length, the max_tokens cap and the chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clients.protocol import ErrorCode, ProtocolError, Submit
from scheduler import response_format
from scheduler.tenants import Tenant
from workers.api import ModelInfo


@dataclass(frozen=True)
class Limits:
    max_tokens_cap: int = 4096
    default_max_tokens: int = 256


@dataclass(frozen=True)
class Admitted:
    prompt: list[int]
    max_tokens: int


def prompt_ids(req: Submit, tokenizer: Any, info: ModelInfo) -> list[int]:
    """The prompt as token ids. May be slow for long text: the caller runs it off the event loop,
    which is also where a ``response_format`` is checked to compile for the tokenizer."""
    response_format.check(req, tokenizer, info.vocab_size)
    if req.tokens is not None:
        return list(req.tokens)
    if req.messages is not None:
        if not info.has_chat_template:
            raise ProtocolError(
                ErrorCode.NO_CHAT_TEMPLATE,
                f"model {info.name!r} has no chat template; send 'prompt' or 'tokens' instead of 'messages'",
                req.id,
            )
        try:
            return list(tokenizer.apply_chat_template(req.messages, add_generation_prompt=True))
        except Exception as exc:  # jinja errors from a template that rejects these messages
            raise ProtocolError(ErrorCode.BAD_FIELD, f"the chat template rejected 'messages': {exc}", req.id) from None
    assert req.prompt is not None
    return list(tokenizer.encode(req.prompt))


def admit(req: Submit, ids: list[int], info: ModelInfo, limits: Limits, tenant: Tenant | None = None) -> Admitted:
    """Check the tokenized prompt and the budget against the model, the daemon's caps and the
    tenant's limits."""
    if not ids:
        raise ProtocolError(ErrorCode.EMPTY_PROMPT, "the prompt tokenizes to nothing; send at least one token", req.id)
    vocab = info.vocab_size
    for name, values in (("tokens", ids if req.tokens is not None else []), ("stop_token_ids", req.stop_token_ids)):
        for i, t in enumerate(values):
            if not 0 <= t < vocab:
                code = ErrorCode.TOKEN_OUT_OF_RANGE if name == "tokens" else ErrorCode.BAD_FIELD
                raise ProtocolError(code, f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})", req.id)
    for t, _ in req.sampling.logit_bias:
        if t >= vocab:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"field 'logit_bias' names token id {t}, outside the vocabulary [0, {vocab})",
                req.id,
            )
    n, ctx = len(ids), info.context_length
    if n >= ctx:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"the prompt has {n} tokens but the model's context is {ctx}; send at most {ctx - 1}",
            req.id,
        )
    if tenant is not None and n > tenant.max_prompt_tokens:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"the prompt has {n} tokens; tenant {tenant.name!r} may send at most {tenant.max_prompt_tokens}",
            req.id,
        )
    room = ctx - n
    tenant_cap = tenant.max_new_tokens if tenant is not None else limits.max_tokens_cap
    if req.max_tokens is None:
        return Admitted(ids, min(limits.default_max_tokens, limits.max_tokens_cap, tenant_cap, room))
    if tenant is not None and req.max_tokens > tenant_cap:
        raise ProtocolError(
            ErrorCode.MAX_TOKENS_OUT_OF_RANGE,
            f"max_tokens {req.max_tokens} is above tenant {tenant.name!r}'s limit of {tenant_cap}",
            req.id,
        )
    if not 1 <= req.max_tokens <= limits.max_tokens_cap:
        raise ProtocolError(
            ErrorCode.MAX_TOKENS_OUT_OF_RANGE,
            f"max_tokens must be in [1, {limits.max_tokens_cap}], got {req.max_tokens}",
            req.id,
        )
    if req.max_tokens > room:
        raise ProtocolError(
            ErrorCode.MAX_TOKENS_OUT_OF_RANGE,
            f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds the model's context ({ctx}); "
            f"ask for at most {room}",
            req.id,
        )
    return Admitted(ids, req.max_tokens)
