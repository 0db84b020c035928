"""What mlx-lm itself produces for one prompt alone: the yardstick for byte-exact tests."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx


@lru_cache(maxsize=4)
def load_reference(path: str) -> tuple[Any, Any]:
    from mlx_lm import load

    loaded = load(path)
    return loaded[0], loaded[1]


def reference_steps(path: Path, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, mx.array]]:
    """(token, its step's log-probability row) from ``mlx_lm.generate.generate_step``, stopping at EOS
    (which, as in the daemon, is not part of the output)."""
    from mlx_lm.generate import generate_step

    model, tokenizer = load_reference(str(path))
    for token, lps in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        t = int(token)
        if t in tokenizer.eos_token_ids:
            return
        yield t, lps


def greedy_reference(path: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs from ``mlx_lm.generate.generate_step``, stopping at EOS."""
    steps = list(reference_steps(path, prompt, max_tokens))
    return [t for t, _ in steps], [float(row[t].item()) for t, row in steps]  # type: ignore[arg-type]


def load_measured(path: Path) -> Any:
    """A model from ``path`` (mlx-lm's loader) with its row-exact widths measured, as the daemon's
    loader leaves it."""
    from mlx_lm import load

    from workers.kernels import measure_widths

    model = load(str(path))[0]
    measure_widths(model)
    return model


def probed_bursts(
    engine: Any,
    target: Any,
    drafter: Any,
    settings: Any,
    name: str,
    vocab: int,
    draws: int = 3,
    policy: Any = None,
) -> Any:
    """Gate ``drafter`` on ``engine`` as serving does: probe the pairing (its first ``draws`` draws;
    the pin's cost up to the engine's batch size) to the end, then configure bursts under that
    verdict, which is returned."""
    from mlx_lm.models.cache import make_prompt_cache

    from workers.api import ProbePolicy
    from workers.exact.probe import make_draws, probe_steps

    steps = probe_steps(
        engine.counted,
        lambda: make_prompt_cache(target),
        {"t": name},
        make_draws(settings.k, vocab, 4096, None)[:draws],
        settings.k,
        None,
        policy or ProbePolicy(),
        max_batch=engine.max_batch,
    )
    engine.start_probe(name, steps)
    while engine.probing:
        engine.probe_step()
    engine.configure_bursts(drafter, settings, name)
    return engine.verdicts[name]


def perturb(out: mx.array) -> mx.array:
    """Flip the lowest mantissa bit of every element: a divergence of one ulp (what the tests inject
    at ``workers.kernels.seam.divergence_seam``)."""
    bits = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}[out.dtype]
    return (out.view(bits) ^ 1).view(out.dtype)


def penalized_reference(
    path: Path, prompt: list[int], max_tokens: int, *, mlx_lm_windows: bool = False, **controls: Any
) -> list[int]:
    """Greedy tokens from ``generate_step`` with mlx-lm's penalty processors and ``logit_bias``,
    stopping at EOS. The penalties cover what OpenAI and vLLM define them over: presence and
    frequency every token emitted so far, repetition the prompt and those (mlx-lm's context size,
    its ``tokens[-context_size:]``, set each step to exactly that span of the history it is given,
    the prompt then the output). ``mlx_lm_windows``: mlx-lm's own default instead (the last 20
    tokens, the prompt included)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import (
        make_frequency_penalty,
        make_logits_processors,
        make_presence_penalty,
        make_repetition_penalty,
    )

    model, tokenizer = load_reference(str(path))
    if mlx_lm_windows:
        processors = make_logits_processors(**controls)
    else:
        processors = make_logits_processors(logit_bias=controls.get("logit_bias"))
        repetition = controls.get("repetition_penalty")
        if repetition is not None:
            processors.append(lambda toks, logits: make_repetition_penalty(repetition, len(toks))(toks, logits))
        for make, name in ((make_presence_penalty, "presence_penalty"), (make_frequency_penalty, "frequency_penalty")):
            if controls.get(name):

                def over_output(
                    toks: mx.array, logits: mx.array, make: Any = make, penalty: float = controls[name]
                ) -> mx.array:
                    emitted = len(toks) - len(prompt)
                    return make(penalty, emitted)(toks, logits) if emitted > 0 else logits

                processors.append(over_output)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=processors):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out
