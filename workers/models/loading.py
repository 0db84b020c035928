"""Loading a target model with mlx-lm, and the facts about it the daemon validates against."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.nn as nn

from workers.api import CUDNN_ATTENTION_DEFAULT, ModelInfo
from workers.kernels import (
    WidthReport,
    configure_attention,
    configure_kernel_cache,
    continuation_bpe_class,
    detokenizer_prototype,
    measure_widths,
    model_classes,
)
from workers.models.demo import cache_dir
from workers.models.width_store import WidthStore

if TYPE_CHECKING:
    from workers.dist import Mode, ShardReport, World

#: Config keys that state a model's trained context, in the order mlx-lm families use them.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")
FALLBACK_CONTEXT = 4096


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict[str, Any]
    info: ModelInfo
    widths: WidthReport
    #: How this rank holds the model when it is one of several (``None``: the whole model, alone).
    shard: ShardReport | None = None
    #: Seconds ``load`` spent finding the files (a GGUF file's conversion), reading the weights and
    #: measuring the widths (``workers.engine.ready_phases``).
    phases: dict[str, float] = field(default_factory=dict)


class ModelError(ValueError):
    """A model spec that cannot be loaded. The message names the problem and what to pass instead,
    so the command line can print it as one line instead of a traceback from deep inside mlx-lm."""


#: What every "not a model" message ends with: the fix.
_MODEL_HINT = (
    "pass a local mlx-lm model directory (e.g. `huggingface-cli download mlx-community/Qwen3-0.6B-bf16 "
    "--local-dir DIR`), a GGUF file, ollama:NAME[:TAG] or 'demo'"
)


def resolve_model_path(spec: str, flag: str = "--model") -> Path:
    """``demo`` names the embedded default; a GGUF file (``*.gguf``, or ``ollama:NAME[:TAG]`` from
    Ollama's store) is converted once into the cache and its folder returned (``workers.models.gguf``:
    the first call converts, with progress on stderr, every later one finds it); anything else must
    be a local model directory (nothing is downloaded at run time). ``flag`` is the option the spec
    came from, for messages."""
    if spec == "demo":
        from workers.models.demo import demo_path

        return demo_path("target")
    path = Path(spec).expanduser()
    if spec.startswith("ollama:") or spec.lower().endswith(".gguf") or path.is_file():
        from workers.models.gguf import gguf_model_dir, is_gguf_spec

        if spec.lower().endswith(".gguf") and not path.exists():
            raise ModelError(f"{flag} {spec!r}: no such file; {_MODEL_HINT}")
        if is_gguf_spec(spec):
            return gguf_model_dir(spec)
    if not path.exists():
        why = "it does not exist"
    elif not path.is_dir():
        why = "it is a file"
    elif not (path / "config.json").is_file():
        why = "no config.json in it"
    else:
        return path
    raise ModelError(f"{flag} {spec!r} is not a model directory ({why}); {_MODEL_HINT}")


def read_config(path: Path, spec: str, flag: str = "--model") -> dict[str, Any]:
    """``config.json`` as a dict, or a ``ModelError`` saying why it is not one."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{flag} {spec!r} is not a model directory (unreadable config.json: {exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelError(f"{flag} {spec!r} is not a model directory (config.json has no model_type); {_MODEL_HINT}")
    return config


def check_model(spec: str, flag: str = "--model") -> Path:
    """What ``load`` would trip over, found without reading weights: a missing or non-model
    directory, an architecture this mlx-lm does not know, no weight files. Cheap enough to run
    before a daemon binds its socket, so a bad ``--model`` is refused before anything says ready."""
    path = resolve_model_path(spec, flag)
    config = read_config(path, spec, flag)
    if "model_file" not in config:  # custom code: mlx-lm refuses it at load, with its own message
        try:
            model_classes(config)
        except ValueError:
            import mlx_lm

            raise ModelError(
                f"{flag} {spec!r}: model_type {config['model_type']!r} is not an architecture mlx-lm "
                f"{mlx_lm.__version__} knows; upgrade it (`pip install -U mlx-lm`) or pick a supported model"
            ) from None
    if not any(path.glob("model*.safetensors")):
        raise ModelError(f"{flag} {spec!r} has no weights (no model*.safetensors); download the whole model directory")
    return path


def _display_name(path: Path) -> str:
    """The folder's name, or for a converted GGUF file the model it came from."""
    if (path / "gguf_source.json").is_file():
        from workers.models.gguf import source_name

        return source_name(path) or path.name
    return path.name


def _vocab_size(model: nn.Module, config: dict[str, Any]) -> int:
    if "vocab_size" in config:
        return int(config["vocab_size"])
    text = config.get("text_config") or {}
    if "vocab_size" in text:
        return int(text["vocab_size"])
    return int(model.model.embed_tokens.weight.shape[0])


def _context_length(config: dict[str, Any], override: int | None) -> int:
    if override is not None:
        return override
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(source.get(key), int):
                return int(source[key])
    return FALLBACK_CONTEXT


def kv_bytes_per_token(model: nn.Module) -> int:
    """Measured, not derived from a config: one token through a fresh cache, then the bytes each
    cache holds per slot (caches preallocate in steps, so divide by their capacity)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    total = 0.0
    for c in cache:
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array) and keys.ndim >= 3 and keys.shape[2] > 0:
            total += c.nbytes / keys.shape[2]
    return int(total)


def keep_leading_space(tokenizer: Any) -> None:
    """Make ``tokenizer.detokenizer`` stream a continuation: keep a leading space on the first token.

    Why: mlx-lm's BPE and SPM streaming detokenizers drop the first generated token's leading space,
    as if the output started a document. The daemon's text continues the prompt, so ``prompt + text``
    must read as the decoded sequence and ``text`` must equal ``tokenizer.decode(tokens)`` (for a
    byte-level model whose first token is the indentation of a body, the trim ate a real space).
    The detokenizer prototype is built once per model (its token map spans the vocabulary), so this
    adjusts that prototype; every request copies it.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    proto = detokenizer_prototype(tokenizer)
    if type(proto) is BPEStreamingDetokenizer:
        proto.__class__ = continuation_bpe_class()
    elif isinstance(proto, SPMStreamingDetokenizer):
        proto.trim_space = False


def load_tokenizer(spec: str) -> Any:
    """The tokenizer ``load`` gives for ``spec``, without the weights: for a process that serves
    the model's text but runs no MLX (the daemon's front end when the engine has its own process)."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    path = resolve_model_path(spec)
    config = read_config(path, spec)
    tokenizer = mlx_load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    keep_leading_space(tokenizer)
    return tokenizer


def check_sharding(spec: str, world_size: int) -> Mode:
    """The split ``load`` will make of ``spec`` over ``world_size`` ranks, or a one-line
    ``ShardError`` (a family mlx-lm cannot shard, heads that do not divide), found from the config
    and an unevaluated model: no weights are read, no group is joined, so every rank can refuse a
    bad set-up before a socket is bound or a peer waited for."""
    from workers.dist import plan_sharding

    path = check_model(spec)
    config = read_config(path, spec)
    model_class, args_class = model_classes(config)
    skeleton = model_class(args_class.from_dict(config))  # lazy arrays: nothing is computed
    return plan_sharding(skeleton, config, world_size)


def load(spec: str, context_length: int | None = None, world: World | None = None, widths: bool = True) -> LoadedModel:
    """Load ``spec`` (a directory or ``demo``) with mlx-lm. Call it on the engine thread.

    ``widths`` off skips the width measurement (``measure_widths``) for an engine that never pins
    (``EngineSettings.may_pin``); across ranks every rank measures, as every rank makes its forwards.

    With ``world`` of several ranks the weights are loaded lazily, checked to be the same on every
    rank and split (``distributed.prepare``) before anything else touches them, so each rank reads
    only its shard; every later start-up forward (the KV measurement) is one all ranks make.

    MLX CUDA's cuDNN attention is off from here on in this process unless the environment or the
    engine's settings turned it on first (``backend.configure_attention``): every process that loads
    a model (the daemon's engine, the probe, a benchmark's in-process arms) attends alike."""
    from mlx_lm.utils import load as mlx_load

    configure_attention(CUDNN_ATTENTION_DEFAULT)
    configure_kernel_cache(cache_dir())

    tic = time.perf_counter()
    path = check_model(spec)
    phases = {"model files": time.perf_counter() - tic}
    sharded = world is not None and world.distributed
    tic = time.perf_counter()
    try:
        loaded = mlx_load(str(path), lazy=sharded, return_config=True)
    except (ValueError, OSError, RuntimeError) as exc:  # files that do not fit together, or a cut download
        raise ModelError(f"--model {spec!r} cannot be loaded: {' '.join(str(exc).split())}") from exc
    model, tokenizer, config = cast(tuple[nn.Module, Any, dict[str, Any]], loaded)
    shard = None
    if world is not None and sharded:
        from workers.dist import checkpoint_fingerprint, prepare

        shard = prepare(model, world, config, checkpoint_fingerprint(path))
    keep_leading_space(tokenizer)
    phases["weights"] = time.perf_counter() - tic
    tic = time.perf_counter()
    measure = widths or sharded
    stored = WidthStore(cache_dir() / "widths", path) if measure and path.is_dir() else None
    report = measure_widths(model, stored=stored, measure=measure)  # and installs the kernel-level patches
    kv_bytes = kv_bytes_per_token(model)
    phases["widths"] = time.perf_counter() - tic
    info = ModelInfo(
        name=spec if spec == "demo" else _display_name(path),
        path=str(path),
        model_type=str(config.get("model_type", "unknown")),
        vocab_size=_vocab_size(model, config),
        context_length=_context_length(config, context_length),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        has_chat_template=bool(tokenizer.has_chat_template),
        kv_bytes_per_token=kv_bytes,
    )
    return LoadedModel(
        model=model, tokenizer=tokenizer, config=config, info=info, widths=report, shard=shard, phases=phases
    )
