"""What the bench records of its daemons once they are up, before anything is timed: each start-up
probe's time and verdict, the row-count plans, pin scope and compiled layers of each arm, and the
CPUs the in-process arms run on (those of the daemon arm's engine process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.affinity import allowed_cpus
from scheduler.bench.output import progress

if TYPE_CHECKING:
    from clients.sync import Client
    from workers.engine import Engine


def read_daemons(
    clients: dict[str, Client], engine: Engine, meta: dict[str, Any], verdicts: dict[str, dict[str, Any]]
) -> tuple[dict[str, float], Any]:
    """Record the daemons' start-up facts in ``meta`` and their verdicts in ``verdicts``; returns the
    probe times and the CPUs the raw and engine arms run on (``None``: this process's own)."""
    from workers.kernels import compiled_layers

    probe_seconds: dict[str, float] = {}
    for name, c in clients.items():
        for pairing, v in c.stats()["engine"]["verdicts"].items():
            if "probe_seconds" in v:
                probe_seconds[f"{name} ({pairing})"] = v["probe_seconds"]
            verdicts[name] = v
    meta["probe_seconds"] = probe_seconds
    # The start-up work each daemon ran between its steps after ready (kernel plans, checks, the
    # probe), where its stats report it: what its time to idle went on.
    meta["start_up_work"] = {name: c.stats()["engine"].get("start_up") for name, c in clients.items()}
    # And where each daemon's seconds before ready went (set-up, weights, widths, warm-up, ...).
    meta["ready_phases"] = {name: c.stats()["engine"].get("ready_phases", {}) for name, c in clients.items()}
    # Row-count plans are kept per machine (workers.kernels.plan_store), yet a daemon started with another
    # $MLX_BATCHD_CACHE times its own: one whose plans differ from the engine alone's runs other
    # kernels, which its ratio then includes.
    plans = {"engine": engine.kernel_plans}
    plans.update({name: c.stats()["engine"].get("kernel_plans", {}) for name, c in clients.items()})
    meta["kernel_plans"] = plans
    # How each daemon's pins apply: ``process`` only for the process-wide pin arm.
    meta["pin_scope"] = {name: c.stats()["engine"].get("pin_scope") for name, c in clients.items()}
    # Decoder layers each arm runs compiled around attention (workers.kernels.compiled_layers; 0: none).
    meta["compiled_layers"] = {"engine": compiled_layers.running(engine.model)} | {
        name: c.stats()["engine"].get("compiled_layers", 0) for name, c in clients.items()
    }
    # Bytes of each arm's dequantized shadow (serve --dense-shadow; 0: none): its own arm's memory cost.
    meta["dense_shadow_bytes"] = {name: c.stats()["engine"].get("dense_shadow_bytes", 0) for name, c in clients.items()}
    # The in-process arms run on the CPUs the daemon arm's engine process runs on
    # (scheduler.affinity): like for like, the ratios then hold the daemon's cost alone.
    engine_cpus = clients["daemon"].stats()["engine"]["loop"].get("cpus")
    in_process_cpus = None if engine_cpus is None or tuple(engine_cpus) == allowed_cpus() else engine_cpus
    meta["in_process_cpus"] = in_process_cpus
    if in_process_cpus is not None:
        progress(f"bench: the raw and engine arms run on CPUs {in_process_cpus}, as the daemon's engine process")
    differ = [name for name in clients if plans[name] != engine.kernel_plans]
    if differ:
        progress(f"bench: note: {', '.join(differ)} chose other row-count plans than the engine alone (meta)")
    return probe_seconds, in_process_cpus
