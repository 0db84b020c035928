"""Extract MLX's embedded CUDA JIT device headers (jit_source_*) from libmlx.so."""

import os
import re
import subprocess
import sys

lib = sys.argv[1] if len(sys.argv) > 1 else "/tmp/mlxcuda/mlx/lib/libmlx.so"
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/nvrtc/jit_headers/mlx/backend/cuda/device"
os.makedirs(out, exist_ok=True)
# section table: map vaddr -> file offset for .rodata
sec = subprocess.run(["readelf", "-SW", lib], capture_output=True, text=True).stdout
m = re.search(r"\.rodata\s+PROGBITS\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", sec)
vaddr, off = int(m.group(1), 16), int(m.group(2), 16)
data = open(lib, "rb").read()
seen = {}
for line in subprocess.run(["nm", "-S", lib], capture_output=True, text=True).stdout.splitlines():
    mm = re.match(r"([0-9a-f]+) ([0-9a-f]+) r _ZN3mlx4coreL\d+jit_source_(\w+)E$", line)
    if not mm:
        continue
    addr, size, name = int(mm.group(1), 16), int(mm.group(2), 16), mm.group(3)
    blob = data[addr - vaddr + off : addr - vaddr + off + size].rstrip(b"\0")
    fname = name + (".h" if name == "config" else ".cuh")
    if fname in seen and seen[fname] != blob:
        print("WARNING: differing duplicates for", fname)
    seen[fname] = blob
for fname, blob in seen.items():
    open(os.path.join(out, fname), "wb").write(blob)
    print(fname, len(blob))
