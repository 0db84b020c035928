#!/usr/bin/env bash
# Device calls, from the repository root after MLX CUDA is staged (benchmarks/stage-mlx-cuda.sh: calls 1
# and 2 carry .mlx-cuda/part1 and .mlx-cuda/part1b), call 3 carries .mlx-cuda/part2 and runs
# `PART=k BUDGET=560 bash benchmarks/h200-session.sh; cd $OUT && tar czf r.tgz r && rm -rf r`; later calls
# on the warm machine run the same with another PART (carrying .mlx-cuda/ptx, MLX's compiled kernels
# from the first, where saved there: spares minutes of JIT).
# PART=g: why a burst left classic decode (the lookahead probe's divergence report: position, verdict),
# the probe's verdict at K = 4, and the one-launch attention with cuDNN off as the engine runs it.
# PART=l: whether the engine's classic B = 1 decode (BatchKVCache) gives the bytes of the burst's chain
# (benchmarks/lone_path_probe.py, 8B synth and demo).
# PART=v: the same on the 8B synth, then B = 1 bursts against classic decode's tokens (lookahead_probe).
# PART=k: the verify block's attention in one launch (benchmarks/sdpa_rows_probe.py: bytes against MLX's
# one-query calls, per key count, and the group width attention measures), the verify's cost in wide
# steps at 1, 2 and 4 outputs per warp (rowkernel_probe --quick --whole-only), B = 1 bursts with the next round built ahead and
# without (lookahead_probe.py, a drafter that knows the continuation).
# PART=a: where a batched step goes with the plans that the chained timings and the whole-forward check
# chose (step_anatomy: its forward_check has each row count's forward milliseconds per candidate).
# Suggested order with 30 device minutes: k, m, a (then p, x, d).
# PART=p: the probe (8B synth, prompt lookup, K = 2, 4, 8) and B = 1 prompt lookup over 512 tokens.
#   (a probe takes ~100 s on the H200 host with the model's load and kernel checks; 90 s was too short.)
# PART=m: the bench matrix, raw up to B = 64 (the B = 64 target read in one run); DARGS: the daemon's extra
#   options (e.g. DARGS="--admit-idle-window-ms 3"); TOKENS (64) per request; BW: the physical reference's GB/s
#   (default: the vendor's peak for the device MLX names, which knows the H200 and the H100 SXM);
# BATCHES (1,4,8,16,32,64,128) and RAW (64) override. Every target of issue 15 in one run within one
# call: TOKENS=192 BATCHES=1,4,8,16,32,64 (about 480 s warm; 256 tokens needs about 600 s); POISSON=4 adds the
# Poisson arrivals' TTFT/ITL to the same run (issue 15 asks for every target in one run: with TOKENS=128
# BATCHES=1,4,8,16,32,64 the matrix took 452 s on the H200, so MT=588 BUDGET=592 on a warm machine).
#   The Poisson requests ask for POISSON_TOKENS (64, issue 15's outputs) each, whatever TOKENS is. MINS (5): each
#   B repeats until every arm has timed that many seconds (at most 12 repeats): B = 1-8's one-second runs
#   get 4-8 repeats (~30 s more in all at TOKENS=128; the full matrix took 508-553 s on the H200 without).
# PART=x: the prefix cache at a 0 % hit rate, B = 16, 7 repeats.
# PART=e: prompt lookup where it drafts: the echo synth (llama-8b-4bit-echo, the 8B shapes with a
# greedy output that repeats itself), B = 1 through the daemon, 512 tokens; the B = 1 table gives the
# rounds' milliseconds, and each run's rounds and round seconds are in b1_bursts.json.
# PART=r: where the daemon's decode steps lose time against the engine alone (engine_gap_probe: the
# engine on the main thread, on a thread, in EngineThread, in EngineProcess, in a daemon), B = 1 and 4,
# 128 tokens; ARMS and BATCHES override.
# PART=ep: part e, one repeat of 256 tokens, with every daemon's engine thread under cProfile
# (MLX_BATCHD_PROFILE_DIR): where a burst round's time goes (on the H200, session 15, rounds of a
# 5-token verify took ~1.46 s each on the echo synth; 2-token rounds in session 14 did not).
# PART=o: the engine's decode step at B = 1, 4, 8, 32 under MLX CUDA's graph limits (ops and megabytes a
# graph, graph cache size, graphs off), each in a fresh process (benchmarks/graph_limits_probe.py).
# PART=w: the whole forward at 1, 4, 5 and 8 rows with the project's kernel at 1, 2 and 4 outputs per warp
#   (the fastest by rows is in the report's per_warp, against workers/kernels/qmv_launch.py's constants).
# PART=q: the verify's cost chained as a burst with its next verify built ahead pays it (rowkernel_probe
#   --chained, 4 outputs per warp), then the bench at B = 1, 4, 8 (192 tokens; raw up to 8) with the
#   kernel plans checked on chained decode steps.
# PART=lc: the host's cost of one mx.fast.cuda_kernel call against one MLX op, by source length
#   (benchmarks/launch_cost_probe.py: is that what a mirrored verify's graph building pays for?).
# PART=h: where a mirrored verify's graph building goes on this host: the kernel-call costs
#   (launch_cost_probe), then the verify chained and synchronous at 4 outputs per warp with cProfile's
#   top functions while building five wide steps and five mirrored 5-token blocks (--profile-build).
# PART=ba: batched decode's attention through the masked one-query kernel (workers/kernels/batch_attention.py):
#   its GPU tests, then BAB (128) sequences' decode steps with MLX_BATCHD_BATCH_ATTENTION 0 and 1, twice each.
# PART=q1: the project kernel's variants at one row (outputs a warp, warps a block, tiles ahead), chained, against
#   MLX's qmv (issue 54 item 2: MLX's qmv held 5.2 of a B = 1 step's 6.8 ms of kernels on the H100).
# PART=qv: the project kernel's variants (benchmarks/qmv_variants_probe.py: outputs per warp and warps a
#   block by rows, each checked against MLX's one-row call), then whole forwards at 1, 4, 5 and 8 rows
#   with the launch settings workers/kernels/qmv_launch.py fixes.
# PART may name several parts ("e d"): they run in that order within one BUDGET.
# PART=dl: the demo pair with its MTP head, bursts forced in-process with and without the next round built
#   ahead (lookahead_probe), then through the daemon with lookahead on and off (--lookahead on|off), 5 repeats each.
# PART=dt: part dl's daemon runs on the demo command's prompts (--prompts demo), what the pair was trained on,
#   with --lookahead auto (the default: rounds timed each way, the faster kept) and off (AHEAD overrides the
#   list, e.g. AHEAD="auto on off"); each run takes ~190 s on the H200 (start, probe, 20 timed runs).
# PART=dp: part dt's bench (2 repeats, --lookahead auto) with every daemon's engine thread under cProfile: where a
#   round's time goes in the daemon (5.2-6.5 ms on the H200) against ~3.8 ms forced in-process (lookahead_probe).
# PART=df: the demo pair's MTP bursts with the drafts computed in the verify's evaluation (the default) against
#   evaluated first (--draft-in-verify off): lookahead_probe in-process (its 4 arms), then the daemon on demo
#   prompts, lookahead off with each, then --lookahead auto, then the first again (the lease's drift).
# PART=dd: `mlx-batchd demo` alone (the four concurrent requests' time to first token after the warm-up).
# PART=da: the demo pair's MTP bursts through the daemon, --lookahead auto and off alternating (AHEAD overrides
#   the list), 15 repeats each: the adaptive gate's exploration against a fixed way, on one lease.
# PART=dk: the demo pair's MTP bursts through the daemon at K = 4, 6, 7 and 8 in one bench (one daemon each,
#   arms alternating with one classic arm; KDRAFTERS overrides), once per --lookahead setting in AHEAD (auto off).
# PART=ek: part e's prompt lookup at K = 4 (its default) and 7 in one bench (KDRAFTERS overrides): whether
#   prompt lookup should draft as many as an MTP head (an 8-row verify of the 8B costs more than a 5-row one).
# PART=dv: the demo pair's MTP bursts through the daemon with the default settings (K = 7 for an MTP head)
#   against K = 4 in the same bench, RUNS (1 2 3) benches of 12 repeats. (10 of 12 repeats took 170 s on the H200.)
# PART=cl: batched decode with the decoder layers compiled around attention against plain, one engine, arms
#   alternating (benchmarks/compiled_layers_probe.py: engine steps, sync forwards and their build, logits bytes).
# PART=tl: where a request's time goes through the daemon at B = 1 and 8 (benchmarks/b1_timeline.py: the engine's
#   timings, stats.engine.loop's hand-over seconds, CPU a token by process), then what one hand-over costs by
#   piece (benchmarks/emit_cost_probe.py: the pipe against a ZeroMQ send), then the timeline again with the OS
#   placing the daemon's processes (--cpu-affinity off) against the default split.
# PART=t128: where a request's time goes through the daemon at B = 1 and 128 (b1_timeline, REPEATS (6) a B, the
#   daemon at --max-batch 128): the engine thread's CPU inside its steps and its preemptions (host- or
#   device-bound steps), the hand-overs, CPU a token of the front end, the client and the engine process, and a
#   request's sent / first token / end / hops; read gpu.csv against each repeat's started_at.
# PART=pl: B = 1 decode steps with the engine thread pinned to each CPU in turn and left to the OS
#   (benchmarks/cpu_placement_probe.py; ROUNDS (3), TOKENS (128), CPUS), with the host's NUMA nodes and the GPU's;
#   PLARMS instead names the arms, e.g. PLARMS=2,2+spin:15,2+write:15,2+spin:9 ROUNDS=8: what another busy
#   CPU, or a pipe write to a reader on another CPU after every step, costs a host-bound B = 1 step.
# PART=d: the demo pair with its MTP head (the dense mirrored kernel's checks and verify cost, building
#   ahead on and off, then the bench), and `mlx-batchd demo`.
# PART=su: start-up (issue 54 item 3): the 8B daemon with prompt lookup started twice on a cache folder of its
#   own, empty at first (benchmarks/start_times.py: spawn to ready, to a first token, to idle; MLX's compiled
#   kernels live in that folder too, so the first start compiles as on a fresh machine), then classic requests
#   during the start-up work of another fresh start against after it (benchmarks/start_load.py).
# PART=ctl: the cost of logits controls at B = 16 (benchmarks/grammar_throughput.py): every sequence under a
#   JSON schema, every sequence with penalties and a logit bias, half of them with those (the plain rows' speed).
# PART=b1: the daemon at B = 1 (128 tokens, 3 repeats, no prefix cache unless DARGS says) from this tree, or with ARM=before from the tree in
#   .mlx-cuda/before/tree.tgz (git archive of an earlier commit's scheduler, workers, clients, pyproject.toml):
#   one arm a call (each calibrates its own kernel plans on a machine's first run: ~140 s on the H100).
# PART=b1t: the same comparison in one run (benchmarks/b1_trees.py): a daemon of each tree, started one after the
#   other, then B = 1 requests of TOKENS (128) alternating between them, REPEATS (10) rounds, each request's
#   wall rate and decode rate. On a fresh machine the two starts (the before tree's plans before ready, this
#   tree's after it) may take the whole call: run it twice, or carry .mlx-cuda/mbc/mbc.tgz (an earlier call's
#   mbc.tgz from the same GPU model: both trees' plans and MLX's compiled kernels) and it takes ~105 s.
# PART=jit: the project kernels in MLX's disk cache (pytest -m gpu tests/gpu/test_jit_cache_gpu.py: MLX loads a module at
#   the name computed for it; a process served from the cache gives the bytes of one that compiled every kernel).
# PART=imp: what a start spends before the engine loads: the front end's imports (with its model check's)
#   and the engine process's
#   (python -X importtime, the 15 slowest), mlx-lm imported without `keep_out` (whether it brings in torch: the cost lean_imports spares), what MLX's first op on
#   the device costs after its import (CUDA's start: 0.08 s on the H100 of 2026-12-07), then the 8B started
#   twice with --prefix-cache-mb 0 (benchmarks/start_times.py: ready phases, spawn to ready) on a cache folder of its
#   own, empty at first (IMPCACHE=$WORK/mbc: the one earlier parts of the call filled, so both starts are later starts);
#   with .mlx-cuda/base/tree.tgz carried (a git archive like ARM=before's), that tree's two starts and this tree's
#   alternate, twice each (IMPARGS: their serve options, default --prefix-cache-mb 0).
# PART=w4s: the w4a16 kernel at few rows (issue 54's B = 32 target): the 8B's 224 projections chained
#   (w4a16_marlin_probe time --chained) at ROWS (16,32,64) for MLX's 4-bit, the native kernel with its plan and with
#   VARIANTS (the K slices added by an MLX sum, one block a warp, fewer or more CTAs an SM, two stages), a bf16 copy.
# PART=w4t: the w4a16 kernel's GPU tests that catch an index or dequantization fault (by default: error against
#   float32 on the 8B's shapes, MLX's dequantize bit for bit, split-K determinism), the dequantize kernel's,
#   and the greedy agreement on SmolLM2 (staged: calls carrying .mlx-cuda/smol1, smol2 and smol3 run
#   `cp .mlx-cuda/smolN/* ~/mlx-stage/`); W4TK overrides the -k filter (every shape and tile took over 200 s).
# PART=w4r: the w4a16 kernel of this tree against the tree in .mlx-cuda/base/tree.tgz (a git archive of the
#   kernel before a change), chained as in part w4s, at ROWS (16,32,128,256): that tree's plan and reduce=0,
#   this tree's plan, VARIANTS (register caps, reduce=0, CTAs an SM) and a bf16 copy (W4RARMS: this tree's arms).
# PART=l2: the transient bf16 weight made and multiplied in output slices small enough to stay in the L2 between
#   the dequantize kernel's write and the product's read (w4a16_marlin_probe --arms dequant-l2, slices of L2MB
#   megabytes), chained 224 projections at ROWS (32,128,256), against the whole-weight transient copy, the native
#   kernel's plan and a bf16 copy.
# PART=w4p: Nsight Compute on the w4a16 kernel alone (benchmarks/w4a16_profile.py, tile 0, one launch after two):
#   SHAPES (NxK words; default q/o 4096x4096 and gate/up 14336x4096) at W4PROWS or ROWS (32,256), with the plan's registers
#   and with each cap in REGS (e.g. REGS=128); speed of light, occupancy, warp states, launch stats, memory
#   workload and the source counters (the instructions where warps stall most), one log each (ncu-N-K-ROWS.log).
# PART=bg: start BGCMD in the background on the warm machine and return at once (default: issue 54's whole bench,
#   B = 1..256 with the kernel and the transient dequantized weights, without both (mlx-kernels) and with the bf16
#   shadow (dense), raw up to 64, Poisson
#   4 req/s, the start times; longer than one call). Its output goes to $WORK/bg. PART=bgwait: wait for it
#   within BUDGET (a call in flight keeps the machine held; call again within 30 s of the last), then bring back
#   $WORK/bg when it has finished ("bg rc=N"); until then the log's tail.
# PART=b1k: the kernels of B = 1 decode steps against the step's wall (benchmarks/b1_kernels.py under
#   Nsight Systems, else Nsight Compute; B1KSTEPS steps, B1KB sequences, B1KCAL=background: no plans timed): whether the device or the host sets
#   a step, and which kernels take the device's time.
# PART=sm: SmolLM2-135M from its GGUF file ($SMOL) through the bench: batched B = 1, 8, 32 and prompt lookup on
#   the rewrite chats at B = 1, 64 tokens.
set -uo pipefail
source benchmarks/h200-steps.sh
for PART in ${PART:-k}; do
if [ "$PART" = g ]; then
  step sdpa 80 python3 benchmarks/sdpa_rows_probe.py --out "$R/sdpa.json"
  step probe-k4 100 python3 -m scheduler probe --model "$M" --draft prompt-lookup -k 4 --no-store
  step lookahead 240 python3 benchmarks/lookahead_probe.py --model "$M" --tokens 128 --out "$R/lookahead.json"
elif [ "$PART" = l ]; then
  step lone-8b 150 python3 benchmarks/lone_path_probe.py --model "$M" --tokens 256 --out "$R/lone-8b.json"
  step lone-demo 90 python3 benchmarks/lone_path_probe.py --model demo --tokens 256 --out "$R/lone-demo.json"
elif [ "$PART" = v ]; then
  step lone-8b 150 python3 benchmarks/lone_path_probe.py --model "$M" --tokens 256 --out "$R/lone-8b.json"
  step lookahead 240 python3 benchmarks/lookahead_probe.py --model "$M" --tokens 128 --out "$R/lookahead.json"
elif [ "$PART" = k ]; then
  step sdpa 90 python3 benchmarks/sdpa_rows_probe.py --out "$R/sdpa.json"
  step rowkernel 240 python3 benchmarks/rowkernel_probe.py --model "$M" --quick --whole-only --out "$R/rowkernel.json"
  step lookahead 200 python3 benchmarks/lookahead_probe.py --model "$M" --tokens 128 --out "$R/lookahead.json"
elif [ "$PART" = w ]; then
  step rowkernel 420 python3 benchmarks/rowkernel_probe.py --model "$M" --quick --whole-only --blocks 1,4,5,8 \
    --out "$R/rowkernel.json"
elif [ "$PART" = q ]; then
  step chained 200 python3 benchmarks/rowkernel_probe.py --model "$M" --quick --whole-only --blocks 1,5 --outs "${OUTS:-4}" \
    --chained --out "$R/chained.json"
  step matrix 400 python3 -m scheduler bench --model "$M" --batch-sizes "${BATCHES:-1,4,8}" \
    --tokens "${TOKENS:-192}" --repeats 3 --raw-max-batch "${RAW:-8}" --out "$R/matrix"
elif [ "$PART" = h ]; then
  step launch 120 python3 benchmarks/launch_cost_probe.py --out "$R/launch.json"
  TAIL=${TAIL:-60} step chained 240 python3 benchmarks/rowkernel_probe.py --model "$M" --quick --whole-only \
    --blocks 1,5 --outs 4 --chained --profile-build 45 --out "$R/chained.json"
elif [ "$PART" = ba ]; then
  # Batched decode's attention through the masked one-query kernel: its GPU tests, then decode steps at
  # BAB (128) sequences with it off and on, alternating (no kernel plans: the projections as mlx-lm calls them).
  TAIL=20 step ba-test 200 python3 -m pytest -m gpu -q -rP tests/gpu/test_batch_attention_gpu.py
  for i in 1 2; do for on in 0 1; do
    MLX_BATCHD_BATCH_ATTENTION=$on step "ba-$on-$i" 150 python3 benchmarks/b1_kernels.py --model "$M" --batch "${BAB:-128}" \
      --steps 20 --warm 10 --calibration background --out "$R/ba-$on-$i.json"
  done; done
  grep -h step_ms_median "$R"/ba-*.log | cut -c1-200
elif [ "$PART" = q1 ]; then
  # Classic B = 1 decode's projections: the project kernel at one row (MLX's one-row arithmetic, bytes
  # checked) by outputs a warp, warps a block and tiles ahead, against MLX's qmv, each call waiting on the last.
  TAIL=${TAIL:-40} step q1 "${Q1S:-300}" python3 benchmarks/qmv_variants_probe.py --rows 1 --chained --out "$R/q1.json"
elif [ "$PART" = qv ]; then
  TAIL=${TAIL:-40} step variants 320 python3 benchmarks/qmv_variants_probe.py --out "$R/variants.json"
  step whole-base 150 python3 benchmarks/rowkernel_probe.py \
    --model "$M" --quick --whole-only --blocks 1,4,5,8 --outs 0 --out "$R/whole-base.json"
elif [ "$PART" = pl ]; then
  step placement 240 python3 benchmarks/cpu_placement_probe.py --model "$M" --tokens "${TOKENS:-128}" \
    --rounds "${ROUNDS:-3}" --cpus "${CPUS:-}" --arms "${PLARMS:-}" --out "$R/placement.json"
elif [ "$PART" = lc ]; then
  step launch 90 python3 benchmarks/launch_cost_probe.py --out "$R/launch.json"
elif [ "$PART" = cl ]; then
  step compiled 300 python3 benchmarks/compiled_layers_probe.py --model "$M" --batches "${BATCHES:-2,4,8,16,32}" \
    --out "$R/compiled.json"
elif [ "$PART" = a ]; then
  step anatomy 300 python3 benchmarks/step_anatomy.py --model "$M" --batches 1,2,4,8,16 --out "$R/anatomy.json"
elif [ "$PART" = p ]; then
  for k in 2 4 8; do
    step "probe-k$k" 150 python3 -m scheduler probe --model "$M" --draft prompt-lookup -k "$k" --no-store
  done
  step bench1 280 python3 -m scheduler bench --model "$M" --batch-sizes 1 --drafters prompt-lookup \
    --tokens 512 --repeats 3 --raw-max-batch 1 --out "$R/bench1"
elif [ "$PART" = m ]; then
  dargs=(); [ -n "${DARGS:-}" ] && dargs=(--daemon-args="$DARGS")
  step matrix "${MT:-560}" python3 -m scheduler bench --model "$M" --batch-sizes "${BATCHES:-1,4,8,16,32,64,128}" \
    --tokens "${TOKENS:-64}" --repeats 3 --min-seconds "${MINS:-5}" --raw-max-batch "${RAW:-64}" --poisson-rate "${POISSON:-0}" \
    --bandwidth-gbs "${BW:-0}" --poisson-tokens "${POISSON_TOKENS:-64}" --out "$R/matrix" \
    "${dargs[@]}"
elif [ "$PART" = x ]; then
  step prefix 540 python3 -m scheduler bench --prefix-scenario --prefix-parts throughput --prefix-allow-inexact \
    --model "$M" --repeats 7 --out "$R/prefix"
elif [ "$PART" = d ]; then
  step gemv 90 python3 benchmarks/gemv_rows_check.py --model demo --out "$R/gemv.json"
  step lookahead-mtp 120 python3 benchmarks/lookahead_probe.py --model demo --drafter mtp:demo --tokens 256 \
    --repeats 5 --out "$R/lookahead-mtp.json"
  step demo-mtp 300 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo,prompt-lookup \
    --tokens 256 --repeats 3 --raw-max-batch 1 --out "$R/demo-mtp"
  step demo 120 python3 -m scheduler demo
elif [ "$PART" = dl ]; then
  step lookahead-mtp 90 python3 benchmarks/lookahead_probe.py --model demo --drafter mtp:demo --tokens 256 \
    --repeats 5 --out "$R/lookahead-mtp.json"
  for ahead in on off; do
    args=(--daemon-args="--lookahead $ahead")
    step "demo-mtp-$ahead" 200 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo \
      --tokens 256 --repeats 5 --raw-max-batch 1 "${args[@]}" --out "$R/demo-mtp-$ahead"
  done
elif [ "$PART" = da ]; then
  for arm in ${AHEAD:-auto off auto off}; do
    n=$((${n:-0} + 1))
    step "demo-$arm-$n" 130 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo \
      --prompts demo --tokens 256 --repeats 15 --raw-max-batch 1 --daemon-args="--lookahead $arm" --out "$R/demo-$arm-$n"
  done
elif [ "$PART" = dk ]; then
  for arm in ${AHEAD:-auto off}; do
    n=$((${n:-0} + 1))
    step "demo-k-$arm-$n" 250 python3 -m scheduler bench --model demo --batch-sizes 1 \
      --drafters ${KDRAFTERS:-mtp:demo,mtp:demo@6,mtp:demo@7,mtp:demo@8} --prompts demo --tokens 256 \
      --repeats ${REPEATS:-12} --raw-max-batch 1 --daemon-args="--lookahead $arm" --out "$R/demo-k-$arm-$n"
  done
elif [ "$PART" = dv ]; then
  for n in ${RUNS:-1 2 3}; do
    step "demo-def-$n" 240 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo,mtp:demo@4 \
      --prompts demo --tokens 256 --repeats 12 --raw-max-batch 1 --out "$R/demo-def-$n"
  done
elif [ "$PART" = dt ]; then
  for ahead in ${AHEAD:-auto off}; do
    args=(--daemon-args="--lookahead $ahead")
    step "demo-text-$ahead" 210 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo \
      --prompts demo --tokens 256 --repeats 5 --raw-max-batch 1 "${args[@]}" --out "$R/demo-text-$ahead"
  done
elif [ "$PART" = df ]; then
  step lookahead-mtp 80 python3 benchmarks/lookahead_probe.py --model demo --drafter mtp:demo --tokens 256 \
    --repeats 3 --out "$R/lookahead-mtp.json"
  for arm in fused first auto fused2; do
    case $arm in
      fused*) args=(--daemon-args="--lookahead off") ;;
      first) args=(--daemon-args="--lookahead off --draft-in-verify off") ;;
      auto) args=(--daemon-args="--lookahead auto") ;;
    esac
    step "demo-text-$arm" 150 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo \
      --prompts demo --tokens 256 --repeats 5 --raw-max-batch 1 "${args[@]}" --out "$R/demo-text-$arm"
  done
elif [ "$PART" = dp ]; then
  MLX_BATCHD_PROFILE_DIR="$R/demo-prof" step demo-prof 200 python3 -m scheduler bench --model demo --batch-sizes 1 \
    --drafters mtp:demo --prompts demo --tokens 256 --repeats 2 --raw-max-batch 1 --out "$R/demo-prof"
elif [ "$PART" = dd ]; then
  step demo 120 python3 -m scheduler demo
elif [ "$PART" = tl ]; then
  step timeline 240 python3 benchmarks/b1_timeline.py --model "$M" --batches "${BATCHES:-1,8}" --tokens 128 \
    --repeats 3 --out "$R/timeline.json"
  step emit 90 python3 benchmarks/emit_cost_probe.py --model "$M" --out "$R/emit.json"
  step timeline-os 240 python3 benchmarks/b1_timeline.py --model "$M" --batches "${BATCHES:-1,8}" --tokens 128 \
    --repeats 3 --daemon-args="--cpu-affinity off" --out "$R/timeline-os.json"
elif [ "$PART" = t128 ]; then
  step timeline128 300 python3 benchmarks/b1_timeline.py --model "$M" --batches "${BATCHES:-1,128}" --tokens 128 \
    --repeats "${REPEATS:-6}" --daemon-args="--max-batch 128" --out "$R/timeline128.json"
elif [ "$PART" = r ]; then
  step gap 300 python3 benchmarks/engine_gap_probe.py --model "$M" --batches "${BATCHES:-1,4}" --tokens 128 \
    --repeats 5 --arms "${ARMS:-main,thread,loop,process,daemon}" --out "$R/gap.json"
elif [ "$PART" = ep ]; then
  [ -f "$E/config.json" ] || python3 -m scheduler synth --preset llama-8b-4bit-echo --out "$E" >/dev/null
  MLX_BATCHD_PROFILE_DIR="$R/echo-prof" step echo-prof 300 python3 -m scheduler bench --model "$E" \
    --batch-sizes 1 --drafters prompt-lookup --tokens 256 --repeats 1 --raw-max-batch 1 --out "$R/echo-prof"
elif [ "$PART" = o ]; then
  step graph 420 python3 benchmarks/graph_limits_probe.py --model "$M" --out "$R/graph.json"
elif [ "$PART" = e ]; then
  [ -f "$E/config.json" ] || python3 -m scheduler synth --preset llama-8b-4bit-echo --out "$E" >/dev/null
  step echo-b1 300 python3 -m scheduler bench --model "$E" --batch-sizes 1 --drafters prompt-lookup \
    --tokens 512 --repeats 3 --raw-max-batch 1 --out "$R/echo-b1"
elif [ "$PART" = ek ]; then
  [ -f "$E/config.json" ] || python3 -m scheduler synth --preset llama-8b-4bit-echo --out "$E" >/dev/null
  step echo-k 420 python3 -m scheduler bench --model "$E" --batch-sizes 1 \
    --drafters ${KDRAFTERS:-prompt-lookup,prompt-lookup@7} --tokens 512 --repeats ${REPEATS:-3} --raw-max-batch 1 \
    --out "$R/echo-k"
elif [ "$PART" = su ]; then
  MLX_BATCHD_CACHE=$WORK/su-$$ step starts 480 python3 benchmarks/start_times.py "$M" --draft prompt-lookup
  MLX_BATCHD_CACHE=$WORK/sl-$$ step start-load 480 python3 benchmarks/start_load.py "$M" --draft prompt-lookup
elif [ "$PART" = ctl ]; then
  for control in json-schema penalties mixed; do
    step "ctl-$control" 160 python3 benchmarks/grammar_throughput.py --model "$M" --batch 16 --tokens 96 --rounds 3 \
      --control "$control"
  done
elif [ "$PART" = b1 ]; then
  if [ "${ARM:-after}" = before ]; then
    mkdir -p "$WORK/before" && tar xzf .mlx-cuda/before/tree.tgz -C "$WORK/before"
    (cd "$WORK/before" && PYTHONPATH=$SITE:$WORK/before step b1-before 540 python3 -m scheduler bench --model "$M" \
      --batch-sizes 1 --tokens 128 --repeats 3 --raw-max-batch 1 --daemon-args="${DARGS:---prefix-cache-mb 0}" \
      --out "$R/b1-before")
  else
    step b1-after 540 python3 -m scheduler bench --model "$M" --batch-sizes 1 --tokens 128 --repeats 3 --raw-max-batch 1 \
      --daemon-args="${DARGS:---prefix-cache-mb 0}" --out "$R/b1-after"
  fi
elif [ "$PART" = b1t ]; then
  mkdir -p "$WORK/before" && [ -d "$WORK/before/scheduler" ] || tar xzf .mlx-cuda/before/tree.tgz -C "$WORK/before"
  step b1-trees 540 python3 benchmarks/b1_trees.py "$M" --tree before="$WORK/before" --tree after=. --tokens "${TOKENS:-128}" \
    --repeats "${REPEATS:-10}" --daemon-args="${DARGS:---prefix-cache-mb 0}" --out "$R/b1-trees.json"
elif [ "$PART" = jit ]; then
  TAIL=30 step gpu-jit 900 python3 -m pytest -q -m gpu tests/gpu/test_jit_cache_gpu.py -p no:cacheprovider
elif [ "$PART" = imp ]; then
  # What each process imports before the engine loads: the front end, its model check, the engine process.
  FRONT="scheduler.daemon"
  CHECK="scheduler.daemon; from scheduler.lean_imports import keep_out; keep_out(); from workers.models.loading import check_model"
  ENGINE="scheduler.engine_child; from scheduler.lean_imports import keep_out; keep_out(); import workers.engine.loop"
  for i in first again; do
    for m in "$FRONT" "$CHECK" "$ENGINE"; do
      python3 -c "import time; t = time.perf_counter(); import $m; print('$i', '$m', round(time.perf_counter() - t, 2), 's')"
    done
  done
  python3 -X importtime -c "import $FRONT" 2> "$R/imp-front.txt"
  python3 -X importtime -c "import $CHECK" 2> "$R/imp-check.txt"
  python3 -X importtime -c "import $ENGINE" 2> "$R/imp-engine.txt"
  for f in imp-front imp-check imp-engine; do echo "== $f"; sort -t'|' -k2 -n "$R/$f.txt" | tail -15; done
  python3 -c "import sys, time; t = time.perf_counter(); import mlx_lm.generate; print('mlx_lm.generate', round(time.perf_counter() - t, 2), 's; torch imported:', 'torch' in sys.modules)"
  for i in 1 2; do python3 -c "import time; import mlx.core as mx; t = time.perf_counter(); mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))); a = time.perf_counter(); mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)) + 1); print('device start (first op)', round(a - t, 2), 's; a second op', round(time.perf_counter() - a, 3), 's')"; done
  if [ -f .mlx-cuda/base/tree.tgz ]; then  # this tree's starts against the base tree's, alternating, on one cache
    mkdir -p "$WORK/base" && [ -d "$WORK/base/scheduler" ] || tar xzf .mlx-cuda/base/tree.tgz -C "$WORK/base"
    for i in 1 2; do
      (cd "$WORK/base" && PYTHONPATH=$SITE:$WORK/base MLX_BATCHD_CACHE=${IMPCACHE:-$WORK/imp} step starts-base-$i 150 \
        python3 "$OLDPWD/benchmarks/start_times.py" "$M" ${IMPARGS:---prefix-cache-mb 0})
      MLX_BATCHD_CACHE=${IMPCACHE:-$WORK/imp} step starts-here-$i 150 python3 benchmarks/start_times.py "$M" ${IMPARGS:---prefix-cache-mb 0}
    done
  else
    MLX_BATCHD_CACHE=${IMPCACHE:-$WORK/imp} step starts 480 python3 benchmarks/start_times.py "$M" ${IMPARGS:---prefix-cache-mb 0}
  fi
  grep 'start:' "$R"/starts*.log | cut -c1-300
elif [ "$PART" = w4s ]; then
  step w4s 520 python3 benchmarks/w4a16_marlin_probe.py time --chained --arms "${ARMS:-mlx-4bit,native,bf16}" --rows "${ROWS:-16,32,64}" \
    --repeats 5 --variants "${VARIANTS:-reduce=0;nb=1;nb=1,reduce=0;ctas_per_sm=1;ctas_per_sm=3;ctas_per_sm=4;stages=2}" \
    --out "$R/w4s.json"
elif [ "$PART" = w4t ]; then
  step w4t "${W4TS:-300}" python3 -m pytest -m gpu -q -x -rP tests/gpu/test_dequant_gpu.py tests/gpu/test_w4a16_gpu.py \
    -k "${W4TK:-test_dequant_gpu or bit_for_bit or deterministic or (error_against and 8b) or greedy}"
elif [ "$PART" = w4r ]; then
  mkdir -p "$WORK/base" && { [ -d "$WORK/base/workers" ] || tar xzf .mlx-cuda/base/tree.tgz -C "$WORK/base"; }
  (cd "$WORK/base" && PYTHONPATH=$SITE:$WORK/base step w4r-base "${W4RB:-200}" python3 benchmarks/w4a16_marlin_probe.py time \
    --chained --arms native --rows "${ROWS:-16,32,128,256}" --repeats 5 --variants "reduce=0" --out "$R/w4r-base.json")
  step w4r-here "${W4RH:-400}" python3 benchmarks/w4a16_marlin_probe.py time --chained --arms "${W4RARMS:-native,bf16}" --rows "${ROWS:-16,32,128,256}" \
    --repeats 5 --out "$R/w4r.json" \
    --variants "${VARIANTS:-reduce=0;regs=168;regs=168,reduce=0;regs=128;regs=128,reduce=0;regs=128,ctas_per_sm=4,reduce=0}"
elif [ "$PART" = l2 ]; then
  step l2 "${L2S:-300}" python3 benchmarks/w4a16_marlin_probe.py time --chained --arms "${L2ARMS:-native,dequant,dequant-l2,bf16}" \
    --rows "${ROWS:-32,128,256}" --l2-mb "${L2MB:-4,8,16,32}" --repeats 5 --out "$R/l2.json"
elif [ "$PART" = w4p ]; then
  ROWS=${W4PROWS:-${ROWS:-32,256}}
  for rows in ${ROWS//,/ }; do for nk in ${SHAPES:-4096x4096 14336x4096}; do set -- ${nk/x/ }; for regs in "" ${REGS:-}; do
    step "ncu-$1-$2-$rows${regs:+-r$regs}" 120 ncu --clock-control none -k regex:mlx_batchd_w4n --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis --section SourceCounters \
      python3 benchmarks/w4a16_profile.py --n "$1" --k "$2" --rows "$rows" --tiles 0 --launches 3 ${regs:+--regs $regs}
  done; done; done
elif [ "$PART" = b1k ]; then
  # The kernels of B = 1 decode steps against their wall: Nsight Systems' GPU trace where the machine has
  # it (kernels inside MLX's CUDA graphs, one by one), else Nsight Compute's duration of each kernel.
  if command -v nsys >/dev/null; then
    step b1k-nsys 300 nsys profile -t cuda --cuda-graph-trace=node -o "$WORK/b1k" --force-overwrite true \
      python3 benchmarks/b1_kernels.py --model "$M" --steps "${B1KSTEPS:-5}" --batch "${B1KB:-1}" --calibration "${B1KCAL:-now}" --out "$R/b1k-run-${B1KB:-1}.json"
    step b1k-stats 120 nsys stats -r cuda_gpu_trace -f csv -o "$WORK/b1k" "$WORK/b1k.nsys-rep"
    TAIL=50 step b1k 60 python3 benchmarks/b1_kernels.py --summarize "$WORK/b1k_cuda_gpu_trace.csv" --steps "${B1KSTEPS:-5}" --out "$R/b1k-${B1KB:-1}.json"
  else
    step b1k-ncu 400 ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --log-file "$R/b1k-ncu-${B1KB:-1}.csv" \
      python3 benchmarks/b1_kernels.py --model "$M" --steps "${B1KSTEPS:-2}" --batch "${B1KB:-1}" --calibration "${B1KCAL:-now}" --out "$R/b1k-run-${B1KB:-1}.json"
    TAIL=50 step b1k 60 python3 benchmarks/b1_kernels.py --summarize "$R/b1k-ncu-${B1KB:-1}.csv" --steps "${B1KSTEPS:-2}" --out "$R/b1k-${B1KB:-1}.json"
  fi
elif [ "$PART" = bg ]; then
  mkdir -p "$WORK/bg" && rm -f "$WORK/bg/done"
  BGCMD=${BGCMD:-python3 -m scheduler bench --model "$M" --batch-sizes 1,4,8,16,32,64,128,256 --tokens 128 \
    --repeats 3 --raw-max-batch 64 --poisson-rate 4 --restart-times --daemon-args=\"--max-batch 256\" \
    --env-arm mlx-kernels:MLX_BATCHD_W4A16=0,MLX_BATCHD_DEQUANT=0 --env-arm dense:--dense-shadow=on --out "$WORK/bg/matrix"}
  echo "$BGCMD" > "$WORK/bg/cmd"
  (setsid nohup bash -c "$BGCMD > '$WORK/bg/log' 2>&1; echo \$? > '$WORK/bg/done'" > /dev/null 2>&1 < /dev/null &)
  echo "bg started: $BGCMD"
elif [ "$PART" = bgwait ]; then
  while [ ! -f "$WORK/bg/done" ] && [ $((SECONDS - START)) -lt $((${BUDGET:-560} - 20)) ]; do sleep 5; done
  tail -"${TAIL:-6}" "$WORK/bg/log"
  if [ -f "$WORK/bg/done" ]; then echo "bg rc=$(cat "$WORK/bg/done")"; cp -r "$WORK/bg" "$R/"; else echo "bg running"; fi
elif [ "$PART" = sm ]; then
  step smol 520 python3 -m scheduler bench --model "${SMOL:?the GGUF file}" --batch-sizes 1,8,32 --tokens 64 \
    --repeats 2 --prompts rewrite --drafters prompt-lookup --out "$R/smol"
fi
done
finish
