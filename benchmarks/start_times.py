"""A daemon's start, twice on one cache folder: seconds from spawn to health answering ``ready``, to the
first token of a one-token request sent then, and to idle (``stats.engine.start_up`` and the probe
done), with each start's seconds by phase before ready and of its start-up work after. Point ``MLX_BATCHD_CACHE`` at an empty folder for a first start as on a fresh machine.

    MLX_BATCHD_CACHE=$(mktemp -d) python benchmarks/start_times.py MODEL [serve options...]
"""

import sys
import tempfile

from scheduler.bench.startup import phases_text, restart

model, extra = sys.argv[1], sys.argv[2:]
for start in ("first", "second"):
    # One token on a short prompt of small ids (in every vocabulary), sent as soon as health says ready.
    t = restart(model, f"ipc://{tempfile.mkdtemp()}/d.sock", extra, None, [1, 2, 3, 4], 1)
    print(
        f"{start} start: ready {t['ready_s']:.1f} s, first token {t['first_token_s']:.1f} s, idle {t['idle_s']:.1f} s"
    )
    print(f"  {phases_text(t)}")
