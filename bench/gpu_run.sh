#!/usr/bin/env bash
# Everything one lent-GPU call needs, in one script: builds, checks and times, logs under $OUT,
# a short table last.   usage: bash bench/gpu_run.sh explore|confirm
#   explore : launch-path probe + megatape variants (each checked, timed and profiled), no baselines
#   confirm : the five-row `megatape bench --profile`, gpu_checks, the 16-layer stack, the 1B decoder
set -o pipefail
OUT=${OUT:-/tmp/megatape-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mode=${1:-confirm}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
case "$mode" in
explore)
  python3 -m bench.launch_probe 2>&1 | tee "$OUT/launch.txt"
  python3 -m bench.driver --baselines "" --profile-variants --out "$OUT" --tag explore \
    --tiling "${TILING:-}" --variants "${VARIANTS:-policy=fluid}" 2>&1 | tee "$OUT/explore.txt"
  ;;
confirm)
  python3 -m bench.driver --profile --out "$OUT" --tiling "${TILING:-}" --variants "${VARIANTS:-}" 2>&1 | tee "$OUT/bench.txt"
  python3 examples/gpu_checks.py 2>&1 | tee "$OUT/gpu_checks.txt"
  if [ -n "${MULTI:-1}" ] && [ "${MULTI:-1}" != 0 ]; then
    python3 -m bench.driver --preset llama70b-16 --baselines cublas,compile --out "$OUT" --tag 16 2>&1 | tee "$OUT/bench16.txt"
    python3 -m bench.decoder_bench --out "$OUT" 2>&1 | tee "$OUT/decoder.txt"
  fi
  ;;
*) echo "usage: bash bench/gpu_run.sh explore|confirm" >&2; exit 2 ;;
esac
echo "=== summary"
grep -h "^| " "$OUT"/*.md 2>/dev/null | grep -v "^|---" | awk '!seen[$0]++' | head -40
