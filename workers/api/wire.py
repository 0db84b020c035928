"""The one conversion each way between the engine's types and the plain maps (msgpack-able dicts,
lists and scalars) that cross a process boundary: commands and settings from the front end to the
engine process, events and signals back; the same command maps are what a plan carries from rank 0
to the other ranks.

``to_wire`` takes a command, the engine's settings or a batch of signals; ``from_wire`` takes the
kind of map it is given and returns the value. The engine's part of the ``stats`` reply is built as a
plain map already (``workers.api.stats``), so it crosses unchanged and ``from_wire("stats", ...)``
only types it. A ``Ready`` comes back without its tokenizer: the receiving process loads its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any, Literal, overload

from workers.api.events import (
    Cancel,
    Command,
    Dead,
    Finished,
    Job,
    ModelInfo,
    Pause,
    Ready,
    Resume,
    Shutdown,
    Signal,
    StepInfo,
    StepKind,
    Stopped,
    SubmitJob,
    Timings,
    TokenMode,
    Tokens,
)
from workers.api.params import FinishReason, SamplingParams
from workers.api.settings import BurstSettings, EngineSettings, Level, ProbePolicy
from workers.api.stats import EnginePart, read_engine


class WireError(ValueError):
    """A map that is none of the kinds it was read as (the two ends run different versions)."""


#: The fields a job map carries, read once: the map is built field by field, since
#: ``dataclasses.asdict`` deep-copies the prompt a token at a time.
_JOB_FIELDS = tuple(f.name for f in fields(Job))
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


@overload
def to_wire(value: Command | EngineSettings) -> dict[str, Any]: ...
@overload
def to_wire(value: Sequence[Signal]) -> list[dict[str, Any]]: ...
def to_wire(value: Command | EngineSettings | Sequence[Signal]) -> dict[str, Any] | list[dict[str, Any]]:
    """``value`` as plain maps: a command or the settings as one map, a batch of signals as a list."""
    if isinstance(value, EngineSettings):
        return asdict(value)
    if isinstance(value, (SubmitJob, Cancel, Pause, Resume, Shutdown)):
        return _command_to_wire(value)
    return _signals_to_wire(value)


@overload
def from_wire(kind: Literal["command"], data: Mapping[str, Any]) -> Command: ...
@overload
def from_wire(kind: Literal["settings"], data: Mapping[str, Any]) -> EngineSettings: ...
@overload
def from_wire(kind: Literal["signals"], data: Sequence[Mapping[str, Any]]) -> list[Signal]: ...
@overload
def from_wire(kind: Literal["stats"], data: Mapping[str, Any]) -> EnginePart: ...
def from_wire(
    kind: Literal["command", "settings", "signals", "stats"], data: Any
) -> Command | EngineSettings | list[Signal] | EnginePart:
    """``to_wire``'s inverse for a map of ``kind``; ``WireError`` for a command of no known kind."""
    if kind == "command":
        return _command_from_wire(data)
    if kind == "settings":
        return _settings_from_wire(data)
    if kind == "signals":
        return _signals_from_wire(data)
    return read_engine(data)


# ----------------------------------------------------------------------------- commands and settings


def _job_to_wire(job: Job) -> dict[str, Any]:
    """Its lists are copies, so the map shares nothing mutable with ``job``."""
    plain = {name: getattr(job, name) for name in _JOB_FIELDS}
    plain["prompt"] = list(job.prompt)
    plain["sampling"] = {name: getattr(job.sampling, name) for name in _SAMPLING_FIELDS}
    plain["stop_token_ids"] = list(job.stop_token_ids)
    return plain


def _job_from_wire(d: Mapping[str, Any]) -> Job:
    return Job(**{**d, "sampling": SamplingParams(**d["sampling"]), "stop_token_ids": tuple(d["stop_token_ids"])})


def _command_to_wire(cmd: Command) -> dict[str, Any]:
    if isinstance(cmd, SubmitJob):
        return {"c": "submit", "job": _job_to_wire(cmd.job)}
    if isinstance(cmd, Cancel):
        return {"c": "cancel", "seq": cmd.seq, "reason": cmd.reason, "code": cmd.code, "message": cmd.message}
    if isinstance(cmd, Pause):
        return {"c": "pause", "seq": cmd.seq}
    if isinstance(cmd, Resume):
        return {"c": "resume", "seq": cmd.seq}
    return {"c": "shutdown", "reason": cmd.reason, "code": cmd.code, "message": cmd.message}


def _command_from_wire(d: Mapping[str, Any]) -> Command:
    kind = d["c"]
    if kind == "submit":
        return SubmitJob(_job_from_wire(d["job"]))
    if kind == "cancel":
        return Cancel(d["seq"], d["reason"], d["code"], d["message"])
    if kind == "pause":
        return Pause(d["seq"])
    if kind == "resume":
        return Resume(d["seq"])
    if kind == "shutdown":
        return Shutdown(d["reason"], d["code"], d["message"])
    raise WireError(f"an unknown command {kind!r}; the two ends run different versions")


def _settings_from_wire(d: Mapping[str, Any]) -> EngineSettings:
    policy = dict(d["probe_policy"])
    if policy.get("pinned_level") is not None:
        policy["pinned_level"] = Level(policy["pinned_level"])
    return EngineSettings(**{**d, "probe_policy": ProbePolicy(**policy), "bursts": BurstSettings(**d["bursts"])})


# ----------------------------------------------------------------------------- signals


def _signal_to_wire(sig: Signal) -> dict[str, Any]:
    # The kinds every step or request sends are spelled out: ``asdict`` (a recursive deep copy)
    # costs many times as much.
    if isinstance(sig, Tokens):
        return {
            "t": "tokens",
            "seq": sig.seq,
            "tokens": sig.tokens,
            "logprobs": sig.logprobs,
            "mode": sig.mode,
            "top_logprobs": sig.top_logprobs,
        }
    if isinstance(sig, StepInfo):
        return {"t": "step", "kind": sig.kind, "seconds": sig.seconds, "batch_size": sig.batch_size}
    if isinstance(sig, Finished):
        return {
            "t": "finished",
            "seq": sig.seq,
            "reason": str(sig.reason),
            "prompt_tokens": sig.prompt_tokens,
            "completion_tokens": sig.completion_tokens,
            "timings": sig.timings.as_dict(),
            "error_code": sig.error_code,
            "error_message": sig.error_message,
        }
    if isinstance(sig, Ready):
        return {"t": "ready", "info": {**asdict(sig.info), "eos_token_ids": list(sig.info.eos_token_ids)}}
    if isinstance(sig, Stopped):
        return {"t": "stopped"}
    return {"t": "dead", "error": sig.error}


def _signals_to_wire(signals: Sequence[Signal]) -> list[dict[str, Any]]:
    """A step's events as maps, each run of two or more plain tokens (one batched token, no top
    logprobs: what a decode step gives each of its sequences) as one map of columns, which packs and
    unpacks in a fraction of the time and bytes. Runs keep the events' order, so a sequence's end
    still follows its tokens."""
    wire: list[dict[str, Any]] = []
    run: list[Tokens] = []
    batched = TokenMode.BATCHED

    def close_run() -> None:
        if len(run) == 1:
            wire.append(_signal_to_wire(run[0]))
        elif run:
            logprobs = [None if t.logprobs is None else t.logprobs[0] for t in run]
            wire.append(
                {
                    "t": "tokens_run",
                    "seq": [t.seq for t in run],
                    "token": [t.tokens[0] for t in run],
                    "logprob": None if logprobs.count(None) == len(logprobs) else logprobs,
                }
            )
        run.clear()

    for sig in signals:
        if type(sig) is Tokens and sig.mode is batched and sig.top_logprobs is None and len(sig.tokens) == 1:
            run.append(sig)
        else:
            close_run()
            wire.append(_signal_to_wire(sig))
    close_run()
    return wire


def _signals_from_wire(items: Sequence[Mapping[str, Any]]) -> list[Signal]:
    """Runs back to one ``Tokens`` a sequence, in order."""
    signals: list[Signal] = []
    for d in items:
        if d.get("t") != "tokens_run":
            signals.append(_signal_from_wire(d))
            continue
        logprobs = d["logprob"] or [None] * len(d["seq"])
        signals += [
            Tokens(seq, [token], None if lp is None else [lp], TokenMode.BATCHED)
            for seq, token, lp in zip(d["seq"], d["token"], logprobs, strict=True)
        ]
    return signals


def _signal_from_wire(m: Mapping[str, Any]) -> Signal:
    d = dict(m)
    kind = d.pop("t")
    if kind == "tokens":
        tops = d.pop("top_logprobs", None)  # msgpack gives its pairs back as lists
        mode = TokenMode(d.pop("mode"))
        return Tokens(
            **d, mode=mode, top_logprobs=None if tops is None else [[(t, lp) for t, lp in row] for row in tops]
        )
    if kind == "step":
        return StepInfo(**{**d, "kind": StepKind(d["kind"])})
    if kind == "finished":
        return Finished(**{**d, "reason": FinishReason(d["reason"]), "timings": Timings(**d["timings"])})
    if kind == "ready":
        return Ready(ModelInfo(**{**d["info"], "eos_token_ids": tuple(d["info"]["eos_token_ids"])}), None)
    if kind == "stopped":
        return Stopped()
    return Dead(d["error"])
