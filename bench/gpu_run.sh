#!/usr/bin/env bash
# Everything one lent-GPU call needs, in one script: builds, checks and times, logs under $OUT,
# a short table last.   usage: bash bench/gpu_run.sh PART...   (default: confirm)
#   explore : launch-path probe + megatape variants ($VARIANTS, ';'-separated; each checked, timed
#             and profiled), no baselines
#   bench   : the five-row `megatape bench --profile` (eager, torch.compile, cuBLAS, megatape)
#   checks  : examples/gpu_checks.py (broken tapes, random schedules, repeatability)
#   multi   : the 16-layer 70B stack (with cuBLAS and torch.compile) and the 1B whole-model decoder
#   confirm : bench checks multi
set -o pipefail
OUT=${OUT:-/tmp/megatape-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(confirm)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
run_part() {
  case "$1" in
  explore)
    python3 -m bench.launch_probe 2>&1 | tee "$OUT/launch.txt"
    python3 -m bench.driver --baselines "" --profile-variants --out "$OUT" --tag explore \
      --tiling "${TILING:-}" --variants "${VARIANTS:-policy=fluid}" 2>&1 | tee "$OUT/explore.txt" ;;
  bench)
    python3 -m bench.driver --profile --out "$OUT" --tiling "${TILING:-}" --variants "${VARIANTS:-}" 2>&1 | tee "$OUT/bench.txt" ;;
  checks)
    python3 examples/gpu_checks.py 2>&1 | tee "$OUT/gpu_checks.txt" ;;
  multi)
    python3 -m bench.driver --preset llama70b-16 --baselines cublas,compile --out "$OUT" --tag 16 2>&1 | tee "$OUT/bench16.txt"
    python3 -m bench.decoder_bench --out "$OUT" 2>&1 | tee "$OUT/decoder.txt" ;;
  confirm) run_part bench; run_part checks; run_part multi ;;
  *) echo "unknown part $1 (explore|bench|checks|multi|confirm)" >&2; exit 2 ;;
  esac
}
for p in "${parts[@]}"; do run_part "$p"; done
echo "=== summary"
grep -h "PASS\|FAIL" "$OUT/gpu_checks.txt" 2>/dev/null | cut -c1-150
grep -h "^| " "$OUT"/*.md 2>/dev/null | grep -v "^|---" | awk '!seen[$0]++' | head -40
