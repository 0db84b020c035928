"""Keep PyTorch and scikit-learn out of the daemon's processes.

mlx-lm's tokenizer imports transformers, and transformers imports PyTorch (with its distributed and
compiler packages) and scikit-learn whenever they are installed, for model classes and generation
helpers the daemon never calls: seconds of every start, in the front end and in the engine process
alike, on a host that has them. Marked absent before mlx-lm's first import, transformers finds them not
installed, as on a machine without them.
"""

from __future__ import annotations

import sys

#: Installed packages that transformers would import and that no part of the daemon uses.
UNUSED = ("torch", "sklearn")


def keep_out() -> None:
    """Mark ``UNUSED`` absent in this process (``None`` in ``sys.modules``: an import of one raises
    ``ImportError``, ``importlib.util.find_spec`` finds none). Nothing changes once transformers is
    imported (it may have found them already), nor for a package imported already."""
    if "transformers" in sys.modules:
        return
    for name in UNUSED:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
