"""Every ``MLX_BATCHD_*`` environment variable the client side reads, declared once: name, default, purpose.

Read them only through this module (the engine's are in ``workers.envs``).
"""

from __future__ import annotations

import os

#: The daemon's address for clients and ``serve --listen`` when none is given; empty: the per-user
#: ipc socket (``clients.address.default_address``).
ADDR = "MLX_BATCHD_ADDR"


def addr() -> str:
    """``$MLX_BATCHD_ADDR``, or the empty string where it is unset."""
    return os.environ.get(ADDR, "")
