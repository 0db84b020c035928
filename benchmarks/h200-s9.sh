#!/usr/bin/env bash
# Device calls (docs/benchmarks.md section 14). PART=a: with the kernel plans timed once per machine
# and shared by every process (workers/plan_store.py), the B = 16 daemon gap (issue 15) again: the
# engine alone, its loop on a thread, in its own process and the daemon side by side; the bench at
# B = 16; the prefix cache's B = 16 throughput at a 0 % hit rate (issue 17). PART=c: the host under the
# same gap probe: CPU quota and throttling, NUMA, and which threads use the CPU (top, each second).
# PART=s: the engine alone with its arrivals spread over steps (4 and 1 prompts a step) beside the
# daemon at admission windows of 20 and 100 ms; Poisson arrivals twice (the second is the figure).
# PART=t: one daemon, Poisson arrivals with random prompt lengths, one length, then the random ones again.
# PART=n: part t (its first run also compiles the fresh machine's kernels), then the gap probe at B = 16
# with arrivals spread (main~4) and the daemon with and without a 10 ms idle admission window.
# Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
if [ "${PART:-a}" = a ]; then
  step gap16 280 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16 --repeats 3 \
    --arms main,loop,process,daemon@20 --out "$R/gap16.json"
  cp -r "$MLX_BATCHD_CACHE/kernel-plans" "$R/" 2>/dev/null
  step bench16 140 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 16 --tokens 64 --repeats 3 \
    --raw-max-batch 1 --out "$R/bench16"
  step prefix 140 python3 -m scheduler bench --prefix-scenario --prefix-parts throughput --prefix-allow-inexact \
    --model /tmp/m8b --repeats 3 --out "$R/prefix"
  rm -f "$R"/*/*.png
elif [ "$PART" = c ]; then
  { nproc; cat /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu.stat; lscpu; numactl -H; nvidia-smi topo -m; } > "$R/host.txt" 2>&1
  (top -b -H -d 1 -w 250 | awk '/^top/{n=0} {n++; if (n < 30) print}') > "$R/top.log" 2>&1 &
  (while sleep 1; do date +%T; cat /sys/fs/cgroup/cpu.stat; done) > "$R/cpustat.log" 2>&1 &
  step gap16 200 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16 --repeats 2 \
    --arms main,process,daemon@20 --out "$R/gap16.json"
  kill %1 %2
elif [ "$PART" = s ]; then
  step gap16 250 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16 --repeats 3 \
    --arms main,main~4,main~1,daemon@20,daemon@100 --out "$R/gap16.json"
  for run in warm figure; do
    step poisson-$run 100 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --repeats 1 --tokens 64 \
      --poisson-rate 4 --poisson-requests 32 --out "$R/poisson-$run"
  done
  rm -f "$R"/*/*.png
elif [ "$PART" = t ]; then
  step ttft 170 python3 benchmarks/ttft_probe.py --model /tmp/m8b --out "$R/ttft.json"
elif [ "$PART" = n ]; then
  step ttft 200 python3 benchmarks/ttft_probe.py --model /tmp/m8b --out "$R/ttft.json"
  step gap16 330 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16 --repeats 4 \
    --arms main,main~4,daemon@20,daemon@20/10 --out "$R/gap16.json"
fi
# MLX CUDA's compiled kernels (PTX), to carry to a fresh machine next time (MLX_PTX_CACHE_DIR).
du -sh /tmp/mlx 2>/dev/null && tar czf "$OUT/ptx.tgz" -C /tmp mlx 2>/dev/null
