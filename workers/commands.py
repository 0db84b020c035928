"""What goes into the engine thread and what comes out, and jobs and commands as plain maps.

``Ready``, then events, then ``Stopped`` or ``Dead`` come out (the ``Signal``s); the commands go in
through its inbox. A plain map (msgpack-able dicts, lists and scalars) is how a job travels to an
engine process and how a plan carries rank 0's commands to the other ranks.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, fields, replace
from typing import Any

from workers.engine import Event, Job
from workers.models import ModelInfo
from workers.params import SamplingParams
from workers.sampling import is_greedy
from workers.world import DistributedError


@dataclass
class Ready:
    info: ModelInfo
    tokenizer: Any


@dataclass
class Stopped:
    pass


@dataclass
class Dead:
    error: str


Signal = Event | Ready | Stopped | Dead


@dataclass
class Submit:
    job: Job


@dataclass
class Cancel:
    seq: int
    reason: str
    code: str | None
    message: str | None


@dataclass
class Pause:
    seq: int


@dataclass
class Resume:
    seq: int


@dataclass
class Shutdown:
    reason: str
    code: str
    message: str


Command = Submit | Cancel | Pause | Resume | Shutdown


#: The fields a plain job map carries, read once: the map is built field by field, since
#: ``dataclasses.asdict`` deep-copies the prompt a token at a time (4 ms for an 8,000-token prompt on
#: the development CPU, paid on the front end's loop and again on the engine thread for every submit).
_JOB_FIELDS = tuple(f.name for f in fields(Job))
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def job_to_plain(job: Job) -> dict[str, Any]:
    """A job as a plain (msgpack-able) map (to an engine process, and in a plan to the other ranks).
    Its lists are copies, so the map shares nothing mutable with ``job``."""
    plain = {name: getattr(job, name) for name in _JOB_FIELDS}
    plain["prompt"] = list(job.prompt)
    plain["sampling"] = {name: getattr(job.sampling, name) for name in _SAMPLING_FIELDS}
    plain["stop_token_ids"] = list(job.stop_token_ids)
    return plain


def job_from_plain(d: dict[str, Any]) -> Job:
    return Job(**{**d, "sampling": SamplingParams(**d["sampling"]), "stop_token_ids": tuple(d["stop_token_ids"])})


def command_to_plain(cmd: Command) -> dict[str, Any]:
    """A command as a plan carries it to the other ranks (the engine process's command form)."""
    if isinstance(cmd, Submit):
        return {"c": "submit", "job": job_to_plain(cmd.job)}
    if isinstance(cmd, Cancel):
        return {"c": "cancel", "seq": cmd.seq, "reason": cmd.reason, "code": cmd.code, "message": cmd.message}
    if isinstance(cmd, Pause):
        return {"c": "pause", "seq": cmd.seq}
    if isinstance(cmd, Resume):
        return {"c": "resume", "seq": cmd.seq}
    return {"c": "shutdown", "reason": cmd.reason, "code": cmd.code, "message": cmd.message}


def command_from_plain(d: dict[str, Any]) -> Command:
    kind = d["c"]
    if kind == "submit":
        return Submit(job_from_plain(d["job"]))
    if kind == "cancel":
        return Cancel(d["seq"], d["reason"], d["code"], d["message"])
    if kind == "pause":
        return Pause(d["seq"])
    if kind == "resume":
        return Resume(d["seq"])
    if kind == "shutdown":
        return Shutdown(d["reason"], d["code"], d["message"])
    raise DistributedError(f"a plan carried an unknown command {kind!r}; the ranks run different versions")


def with_seed(job: Job) -> Job:
    """``job`` with a seed drawn now when it samples without one: the draw is made once, by the
    process that decides (rank 0), so every rank samples the same tokens."""
    if is_greedy(job.sampling) or job.sampling.seed is not None:
        return job
    return replace(job, sampling=replace(job.sampling, seed=secrets.randbits(63)))
