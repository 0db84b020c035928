"""What a measured fact about kernels depends on: the device, its architecture and MLX's version.

Probe verdicts and kernel plans are kept on disk and reused only on the backend that measured them.
"""

from __future__ import annotations

import mlx.core as mx


def backend_fingerprint() -> dict[str, str]:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {
        "device": str(mx.default_device()),
        "device_name": str(info.get("device_name", "")),
        "architecture": str(info.get("architecture", "")),
        "mlx": str(getattr(mx, "__version__", "unknown")),
    }
