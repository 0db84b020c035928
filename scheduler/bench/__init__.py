"""The benchmarks: ``mlx-batchd bench`` (``main``) and ``mlx-batchd bench-bursts`` (``bursts.main``).

``matrix`` runs the workload matrix: it measures ``arms`` (raw ``BatchGenerator``, the engine alone,
daemons, the HTTP door) and writes the ``batched`` and ``b1`` tables, ``poisson`` arrivals, and the
``prefix`` scenario with its ``prefix_report`` (``tables`` rewrites the tables so far,
``daemon_meta`` records the daemons' start-up facts); ``spreads``, ``reference`` and ``output`` are
what every table shares (medians' spreads and the arms' rotation, the physical limit, whole-file
writes).
``bursts`` asks the same questions inside one engine, in this process.
"""

from __future__ import annotations

from scheduler.bench.matrix import main

__all__ = ["main"]
