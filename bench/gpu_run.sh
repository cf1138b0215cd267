#!/usr/bin/env bash
# Everything one lent-GPU call needs, in one script: builds, checks and times, logs under $OUT,
# a short table last.   usage: bash bench/gpu_run.sh PART...   (default: confirm)
#   explore : launch-path probe + megatape variants ($VARIANTS, ';'-separated; each checked, timed
#             and profiled), no baselines
#   bench   : the five-row `python3 -m bench layer --profile` (eager, torch.compile, cuBLAS, megatape)
#   variants: megatape ($TILING) and its variants ($VARIANTS), each checked, timed and profiled,
#             beside cuBLAS in the same run (no launch probe, no eager / torch.compile)
#   checks  : pytest -m gpu tests/test_gpu.py (broken tapes, pools, random schedules, repeatability,
#             compile timings, and with MEGATAPE_SLOW=1 the 20,000-step decode soak: ~1 min in all)
#   multi   : the 16-layer 70B stack (with cuBLAS and torch.compile) and the 1B whole-model decoder
#             (its variants: $DVARIANTS)
#   decoder : the 1B whole-model decoder alone (its variants: $DVARIANTS; at positions $PREFILLS,
#             default 1024; NOCOMPILE=1: no torch.compile row)
#   layers16: the 16-layer 70B stack alone, megatape and its variants ($MVARIANTS), no baselines
#   refsens : how far the bf16 reference drifts from itself with chunked GEMVs (16 layers, 70B and 1B)
#   sanitize: compute-sanitizer memcheck and racecheck over examples/sanitize_small.py
#   confirm : bench checks multi
#   ab      : with OLD=DIR, the 70B layer of the tree in DIR and of this one alternated (old, new,
#             old, new; megatape only), then this one beside cuBLAS; and the 1B decoder of each
#   abdec   : with OLD=DIR, the 1B decoder of the tree in DIR and of this one alternated twice
#             (pos 1024, megatape only), then this one with --profile, at pos 128, and
#             bench/generate_bench.py (`megatape generate` against decode_step) and the GPU tests
#   tp      : two GPUs (nvidia-h200-x2): python3 -m bench.tp_bench (smoke, a dead peer, 8 layers
#             against one GPU, the 80-layer model beside the NCCL graph), results under $OUT
#   tpab    : two GPUs: TP tilings ($TPVARIANTS, ';'-separated, '' = default) alternated, $TPLAYERS layers;
#             ends with bench.ab_table's table of every process per variant
#   tpprof  : two GPUs: the records of one TP build ($TPTILING) and a layer's stage table per rank
#   OLD=DIR : also time the tree in DIR (e.g. the previous commit, `git archive`) first, same
#             machine, megatape only: an A/B of two trees in one lease
# $OUT receives at most three files (the device tool returns 8): run.log (everything printed),
# results.tar.gz (every JSON / Markdown / trace / chart written) and summary.md.
set -o pipefail
OUT=${OUT:-/tmp/megatape-out}
RES=$(mktemp -d /tmp/megatape-results.XXXX)
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(confirm)
exec > >(tee "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
# every GPU's clocks, temperature and power every ~20 ms for the whole call (reading only), into
# $RES/smi.csv: `bench.ab_table --clocks` sets each timed window beside them
SMI_FIELDS=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw
nvidia-smi --query-gpu=$SMI_FIELDS --format=csv,noheader,nounits -lms 20 > "$RES/smi.csv" 2>/dev/null &
SMI_PID=$!
trap 'kill $SMI_PID 2>/dev/null' EXIT
if [ -n "${OLD:-}" ]; then
  if [ -f "$OLD/bench/cli.py" ]; then
    old=(python3 -m bench layer); old_dec=(python3 -m bench decoder)
  elif [ -f "$OLD/megatape/cli.py" ]; then      # a tree from before bench/cli.py
    old=(python3 -m megatape.cli bench); old_dec=(python3 -m megatape.cli bench-decoder)
  else
    old=(python3 -m bench.driver); old_dec=(python3 -m bench.decoder_bench)
  fi
  if [[ " ${parts[*]} " != *" ab "* && " ${parts[*]} " != *" abdec "* ]]; then
    echo "=== old tree: $OLD"
    (cd "$OLD" && PYTHONPATH=$PWD "${old[@]}" --baselines "" --out "$RES/old" --tag old)
  fi
fi
run_part() {
  case "$1" in
  explore)
    python3 -m bench.launch_probe
    python3 -m bench layer --baselines "" --profile-variants --out "$RES/explore" --tag explore \
      --tiling "${TILING:-}" --variants "${VARIANTS:-policy=round-robin}" ;;
  variants)
    python3 -m bench layer --baselines cublas --profile --profile-variants --out "$RES/variants" --tag variants \
      --tiling "${TILING:-}" --variants "${VARIANTS:-}" ;;
  bench)
    python3 -m bench layer --profile --profile-variants --out "$RES/bench" --tiling "${TILING:-}" --variants "${VARIANTS:-}" ;;
  ab)
    [ -n "${OLD:-}" ] || { echo "ab needs OLD=DIR" >&2; exit 2; }
    for k in 1 2; do
      echo "=== A/B round $k: old tree $OLD"
      (cd "$OLD" && PYTHONPATH=$PWD "${old[@]}" --baselines "" --out "$RES/ab" --tag old$k)
      echo "=== A/B round $k: this tree"
      python3 -m bench layer --baselines "" --out "$RES/ab" --tag new$k
    done
    python3 -m bench layer --baselines cublas --out "$RES/ab" --tag new-cublas
    echo "=== 1B decoder: old tree $OLD"
    (cd "$OLD" && PYTHONPATH=$PWD "${old_dec[@]}" --no-compile --out "$RES/ab-old")
    echo "=== 1B decoder: this tree"
    python3 -m bench decoder --no-compile --out "$RES/ab-new" ;;
  abdec)
    [ -n "${OLD:-}" ] || { echo "abdec needs OLD=DIR" >&2; exit 2; }
    mkdir -p "$RES/abdec"
    for k in 1 2; do
      echo "=== abdec round $k: 1B decoder, old tree $OLD"
      (cd "$OLD" && PYTHONPATH=$PWD "${old_dec[@]}" --no-compile --out "$RES/abdec/old$k")
      echo "=== abdec round $k: 1B decoder, this tree"
      python3 -m bench decoder --no-compile --out "$RES/abdec/new$k"
    done
    python3 -m bench decoder --no-compile --profile --out "$RES/abdec/profile" --variants "${DVARIANTS:-}"
    python3 -m bench decoder --pos 128 --out "$RES/abdec/pos128"
    python3 -m bench.generate_bench | tee "$RES/abdec/generate_bench.md"
    python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$RES/gpu_checks.txt" ;;
  checks)
    MEGATAPE_SLOW=1 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$RES/gpu_checks.txt" ;;
  multi)
    python3 -m bench layer --preset llama70b-16 --baselines cublas,compile --out "$RES/multi"
    python3 -m bench decoder --out "$RES/multi" --variants "${DVARIANTS:-}" ;;
  decoder)
    # $PREFILLS: positions to time at (default 1024); $NOCOMPILE=1 skips the torch.compile row
    for p in ${PREFILLS:-1024}; do
      python3 -m bench decoder --prefill "$p" --out "$RES/decoder-pos$p" --variants "${DVARIANTS:-}" \
        ${NOCOMPILE:+--no-compile}
    done ;;
  layers16)
    python3 -m bench layer --preset llama70b-16 --baselines "" --out "$RES/layers16" --variants "${MVARIANTS:-}" ;;
  refsens)
    python3 -m bench.ref_sensitivity --preset llama70b-layer --layers 16 | tee "$RES/refsens-70b.md"
    python3 -m bench.ref_sensitivity --preset llama3.2-1b --layers 16 --prefill 1024 | tee "$RES/refsens-1b.md" ;;
  sanitize)
    for tool in memcheck racecheck; do
      echo "=== compute-sanitizer --tool $tool"
      timeout 240 compute-sanitizer --tool $tool python3 examples/sanitize_small.py 2>&1 | tail -5 | tee "$RES/sanitize-$tool.txt"
    done ;;
  confirm) run_part bench; run_part checks; run_part multi ;;
  tp)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -m bench.tp_bench --out "$RES/tp" ;;
  tpab)
    # TP tilings alternated: $TPVARIANTS (';'-separated --tiling specs, '' = the default), round 1 in
    # order, round 2 reversed, $TPLAYERS layers (default 20) of the speed stage, no NCCL baseline
    IFS=';' read -r -a vs <<< "${TPVARIANTS:-}"
    [ ${#vs[@]} -eq 0 ] && vs=("")
    rev=(); for ((i=${#vs[@]}-1; i>=0; i--)); do rev+=("${vs[i]}"); done
    n=0
    for v in "${vs[@]}" "${rev[@]}"; do
      n=$((n+1))
      echo "=== tpab $n: tiling '${v:-default}'"
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -m bench.tp_bench --stages speed --no-baseline \
        --speed-layers "${TPLAYERS:-20}" ${v:+--tiling "$v"} --out "$RES/tpab-$n" 2>&1 \
        | grep -E "floor|megatape TP=2: median|FAIL|rror" | sed "s|^|[${v:-default}] |"
    done
    echo "=== tpab: every process, per variant (python3 -m bench.ab_table)"
    python3 -m bench.ab_table --clocks "$RES/smi.csv" "$RES"/tpab-* ;;
  tpprof)
    # the records of the default TP build ($TPLAYERS layers, $TPTILING), one layer's stage table per rank
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -m bench.tp_bench --stages speed --no-baseline \
      --profile --stage-timeout speed=400 --speed-layers "${TPLAYERS:-20}" ${TPTILING:+--tiling "$TPTILING"} \
      --out "$RES/tpprof" 2>&1 | grep -E "floor|median|profile|FAIL|rror"
    for r in 0 1; do python3 -m bench.records "$RES/tpprof/tp-records-rank$r.json.gz" --tail 2; done ;;
  *) echo "unknown part $1 (explore|variants|bench|ab|abdec|checks|multi|decoder|layers16|refsens|sanitize|confirm|tp|tpab|tpprof)" >&2; exit 2 ;;
  esac
}
for p in "${parts[@]}"; do run_part "$p"; done
kill $SMI_PID 2>/dev/null
tar -czf "$OUT/results.tar.gz" -C "$RES" .
{
  echo "=== summary"
  grep -h "passed\|failed\|FAILED\|ERROR" "$RES/gpu_checks.txt" 2>/dev/null | cut -c1-150
  grep -h "ERROR SUMMARY\|hazard" "$RES"/sanitize-*.txt 2>/dev/null
  for f in $(find "$RES" -name "*.md" ! -name "profile.md" ! -name "measured_vs_plan.md" | sort); do
    echo; echo "$f" | sed "s|$RES/||"; grep -h "^| " "$f" | grep -v "^|---"
  done
} | tee "$OUT/summary.md"
