"""The physical reference: the decode rate the memory bandwidth allows when every weight byte and
each sequence's KV are read once per step."""

from __future__ import annotations

#: Peak memory bandwidth (GB/s) as each vendor publishes it, by the device name MLX reports
#: (``mx.device_info()["device_name"]``). Only names that fix one figure: a name shared by parts of
#: different bandwidth (an M3 Max has 300 or 400 GB/s) is left out, and ``--bandwidth-gbs`` gives it.
PEAK_GB_S: dict[str, float] = {
    "NVIDIA H200": 4800.0,
    "NVIDIA H200 NVL": 4800.0,
    "NVIDIA H100 80GB HBM3": 3350.0,
    "NVIDIA H100 PCIe": 2000.0,
    "NVIDIA H100 NVL": 3900.0,
    "NVIDIA A100-SXM4-80GB": 2039.0,
    "NVIDIA A100 80GB PCIe": 1935.0,
    "NVIDIA A100-SXM4-40GB": 1555.0,
    "NVIDIA A100-PCIE-40GB": 1555.0,
    "NVIDIA L40S": 864.0,
    "NVIDIA L4": 300.0,
    "NVIDIA GeForce RTX 4090": 1008.0,
    "Apple M1": 68.25,
    "Apple M1 Pro": 200.0,
    "Apple M1 Max": 400.0,
    "Apple M1 Ultra": 800.0,
    "Apple M2": 100.0,
    "Apple M2 Pro": 200.0,
    "Apple M2 Max": 400.0,
    "Apple M2 Ultra": 800.0,
    "Apple M3": 100.0,
    "Apple M3 Pro": 150.0,
    "Apple M3 Ultra": 819.0,
    "Apple M4": 120.0,
    "Apple M4 Pro": 273.0,
}


def known_bandwidth(device_name: str) -> float | None:
    """The vendor's peak memory bandwidth for this device name, where one figure fits it."""
    return PEAK_GB_S.get(device_name.strip())


def reference_tok_s(weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int, gb_per_s: float) -> float:
    """The physical limit of a decode step: every weight byte and each sequence's KV read once per
    step at the memory bandwidth; ``batch`` tokens come out of each step."""
    step_bytes = weight_bytes + batch * kv_bytes_per_token * context
    return batch * gb_per_s * 1e9 / step_bytes


def reference_line(weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int, gb_per_s: float) -> str:
    """The physical reference in words: what one decode step reads and the rate that allows."""
    kv = batch * kv_bytes_per_token * context
    each = "" if batch == 1 else f" for each of {batch} sequences"
    return (
        f"physical limit at B = {batch}: {weight_bytes / 1e9:.3f} GB of weights + {kv / 1e6:.3f} MB of KV "
        f"({context} tokens of context{each}) read per step at {gb_per_s:g} GB/s = "
        f"{reference_tok_s(weight_bytes, kv_bytes_per_token, context, batch, gb_per_s):.1f} tok/s"
    )
