"""What a measured fact about kernels depends on (the device, its architecture and MLX's version), and
the process-wide choice of MLX's attention kernels, and where MLX CUDA keeps the kernels it compiles.

Probe verdicts and kernel plans are kept on disk and reused only on the backend that measured them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx

from workers.envs import SettingError as SettingError

#: MLX CUDA's switch for its cuDNN attention. MLX reads it once per process, at the first attention
#: call, so it is set before the engine's first forward.
CUDNN_ATTENTION_ENV = "MLX_CUDA_USE_CUDNN_SDPA"
#: Where MLX CUDA keeps the kernels it compiles at run time (NVRTC); its own default is under the
#: system's temporary folder, emptied at a reboot.
KERNEL_CACHE_ENV = "MLX_PTX_CACHE_DIR"


def configure_kernel_cache(root: Path, cuda: bool | None = None) -> Path | None:
    """On MLX CUDA (``cuda``: whether it runs here), keep compiled kernels under ``root`` (the project's
    cache folder), one folder per MLX version and GPU architecture, so a later start, a reboot
    included, compiles none again; the operator's ``MLX_PTX_CACHE_DIR`` wins. MLX reads the variable
    at its first compile, so this runs before the model's first forward. Returns the folder in use."""
    if cuda is None:
        cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    if not cuda:
        return None
    if KERNEL_CACHE_ENV in os.environ:
        return Path(os.environ[KERNEL_CACHE_ENV])
    info = backend_fingerprint()
    arch = re.sub(r"[^A-Za-z0-9._-]+", "_", info["architecture"] or info["device_name"] or "gpu")
    folder = root / "kernels" / re.sub(r"[^A-Za-z0-9._-]+", "_", info["mlx"]) / arch
    os.environ[KERNEL_CACHE_ENV] = str(folder)
    return folder


def configure_attention(cudnn: bool) -> bool:
    """Whether MLX CUDA may run attention through cuDNN in this process: the operator's
    ``MLX_CUDA_USE_CUDNN_SDPA`` where it is set, else ``cudnn`` (off by default, ``cudnn_attention``).

    Why off: cuDNN builds an attention graph for each exact prefill shape (batch and prompt length) in
    each process, so every new prompt length pays for one in its time to first token, while a long
    prefill gains little from it. Without it MLX runs prefill attention as matrix products and decode
    attention in its own vector kernel. Other backends ignore the variable."""
    value = os.environ.get(CUDNN_ATTENTION_ENV)
    if value is None:
        os.environ[CUDNN_ATTENTION_ENV] = "1" if cudnn else "0"
        return cudnn
    # MLX reads the variable with C's atoi: leading digits, anything else 0.
    digits = re.match(r"\s*([+-]?\d+)", value)
    return digits is not None and int(digits.group(1)) != 0


def backend_fingerprint() -> dict[str, str]:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {
        "device": str(mx.default_device()),
        "device_name": str(info.get("device_name", "")),
        "architecture": str(info.get("architecture", "")),
        "mlx": str(getattr(mx, "__version__", "unknown")),
    }
