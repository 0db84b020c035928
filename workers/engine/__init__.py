"""The engine room: continuous batching over mlx-lm's ``BatchGenerator`` (``engine``), the engine thread
that owns every MLX object and runs the loop (``loop``), its start-up (``startup``) and its part of
the ``stats`` reply (``stats``); what a sequence is inside it (``sequences``), arrival windows
(``arrivals``), prefill waves (``prefill_wave``), the prefix cache (``prefix_cache``,
``shared_prefill``), sampling and logits controls (``sampling``, ``logits_controls``, ``grammar``),
and speculative decoding (``spec``).
"""

from __future__ import annotations

from workers.engine.engine import Engine
from workers.engine.loop import EngineThread, release_thread_streams
from workers.engine.startup import buffer_cache_limit, check_environment
from workers.engine.thread_clock import thread_cpus

__all__ = [
    "Engine",
    "EngineThread",
    "buffer_cache_limit",
    "check_environment",
    "release_thread_streams",
    "thread_cpus",
]
