# Sourced by benchmarks/h200-session.sh on the device machine, from the repository root: MLX CUDA in
# $SITE (installed by an earlier call on the same warm machine, or from the staged pieces), the
# environment, the 8B synth at $M, and `step`, which runs a command within what is left of BUDGET.
# Every file goes under $WORK (default: $TMPDIR, else /tmp), which later calls on the same warm machine
# find again; results go to $OUT/r, which the device tool brings back.
TMP=${TMPDIR:-/tmp}
WORK=${WORK:-$TMP}
export SITE=$WORK/site
M=${M:-$WORK/m8b}   # the 8B synth (llama-8b-4bit)
E=${E:-$WORK/m8e}   # the echo synth (llama-8b-4bit-echo), made by the parts that use it
# MLX's compiled kernels from an earlier machine, where carried (.mlx-cuda/ptx): spares minutes of JIT.
# MLX keeps them under the system's temporary directory ($TMP/mlx/<version>/ptx).
[ -f .mlx-cuda/ptx/ptx.tgz ] && [ ! -d "$TMP/mlx" ] && tar xzf .mlx-cuda/ptx/ptx.tgz -C "$TMP"
# The daemons' kernel plans and compiled kernels from an earlier machine, where carried (.mlx-cuda/mbc,
# what `finish` brought back as mbc.tgz): a fresh machine of the same GPU skips minutes of calibration.
[ -f .mlx-cuda/mbc/mbc.tgz ] && [ ! -d "$WORK/mbc" ] && tar xzf .mlx-cuda/mbc/mbc.tgz -C "$WORK"
[ -d "$SITE/mlx" ] || bash .mlx-cuda/part2/install-on-device.sh || exit 3
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 MLX_BATCHD_CACHE=$WORK/mbc
# SmolLM2's GGUF where staged (calls carrying .mlx-cuda/smol1, smol2 and smol3 copied s.a, s.b and s.c to
# ~/mlx-stage): the tests' fixture finds it in MLX_BATCHD_TEST_DATA (it cannot fetch it here), PART=sm in SMOL.
export MLX_BATCHD_TEST_DATA=$WORK/testdata
SMOLFILE=$MLX_BATCHD_TEST_DATA/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f ~/mlx-stage/s.a ] && [ -f ~/mlx-stage/s.b ] && [ -f ~/mlx-stage/s.c ] && [ ! -f "$SMOLFILE" ]; then
  mkdir -p "$MLX_BATCHD_TEST_DATA" && cat ~/mlx-stage/s.a ~/mlx-stage/s.b ~/mlx-stage/s.c > "$SMOLFILE"
fi
SMOL=${SMOL:-$SMOLFILE}
R=$OUT/r && mkdir -p "$R"
START=$SECONDS
step() { # NAME SECONDS COMMAND...: run with what is left of BUDGET at most; print rc and the log's tail
  local name=$1 t=$2; shift 2
  local left=$(( ${BUDGET:-560} - (SECONDS - START) ))
  if [ $left -lt 25 ]; then echo "$name: skipped (budget)"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  timeout "$t" "$@" > "$R/$name.log" 2>&1
  echo "== $name rc=$? at $((SECONDS - START)) s"; tail -"${TAIL:-6}" "$R/$name.log"
}
# The 8B synth, unless every part of the call works without it (the kernel parts make their own weights).
needs_m=0
for p in ${PART:-k}; do case $p in w4t|w4r|w4s|w4p|jit|q1|l2) ;; *) needs_m=1 ;; esac; done
[ "$needs_m" = 0 ] || [ -f "$M/config.json" ] || python3 -m scheduler synth --preset llama-8b-4bit --out "$M" >/dev/null || exit 4
# The GPU's clocks, power and load every 0.5 s for the whole call (gpu.csv): whether a step that moves
# between runs (on the H200 a B = 1 step ran at 4.4 ms in one run, 7.5 in the next) moves with the clocks.
GPULOG_PID=
if [ "${GPULOG:-1}" = 1 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv,nounits -lms 500 > "$R/gpu.csv" 2>/dev/null &
  GPULOG_PID=$!
  trap '[ -n "$GPULOG_PID" ] && kill "$GPULOG_PID" 2>/dev/null' EXIT  # also when a script ends without finish
fi
finish() { # what every call brings back besides its steps' output: the kernel plans and MLX's compiled kernels
  [ -n "$GPULOG_PID" ] && kill "$GPULOG_PID" 2>/dev/null
  rm -f "$R"/*/*.png
  find "$WORK/mbc" -name '*.json' -path '*kernel-plans*' -exec cp {} "$R/" \; 2>/dev/null
  tar czf "$OUT/ptx.tgz" -C "$TMP" mlx 2>/dev/null
  (cd "$WORK" && tar czf "$OUT/mbc.tgz" $(ls -d mbc/kernel-plans mbc/ptx 2>/dev/null)) 2>/dev/null
}
