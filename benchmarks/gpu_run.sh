#!/usr/bin/env bash
# The GPU measurements of docs/results.md#cuda-nvidia-h200, in one command on a lent device (at most 10 minutes):
#
#   bash benchmarks/gpu_run.sh "$OUT"
#
# 1. benchmarks/gpu_scale.py at LayerSkip-Llama2-7B's shape in bfloat16 (random weights): our step against the
#    weight-read floor, passes over 1..64 positions and batched steps, at fixed shapes (the default on CUDA), at
#    each pass's own shapes, replayed from CUDA graphs, compiled and replayed, and with the attention in Triton
#    kernels (op by op and replayed); a step's kernels by kind; whether
#    a verify pass is its steps bit for bit in each;
#    the int8/int4 copies de-quantized and reading their codes; torch's weight-only kernels alone; HF generate
#    eager and compiled;
# 2. `hsd profile --costs-only` of a pool at that shape (exits, int8/int4 copies, token drafters), timed;
# 3. a plan for this device from the Qwen2.5-Coder family's acceptance rates measured on a CPU
#    (benchmarks/results/family_rates_cpu.json) and the costs of the same pool measured here:
#    `hsd profile --costs-only` (the shipped configurations, random weights), `merge-costs`, `hsd solve`; once as
#    the engine runs by default, once with HSD_CUDA_GRAPHS=1 HSD_WEIGHT_ONLY=1.
#
# Every step writes into a work folder (WORK, default: a new temporary one), with its log and seconds; a step that
# fails is logged and the next one runs. After each step the folder given (default: benchmarks/results/gpu_run)
# gets three files: gpu_run.tar.gz (the whole work folder so far), steps.tsv and gpu_scale.json (a lent device
# gives back at most 8 files, and a call stopped by its time limit keeps what the last step left). A dry run on a
# CPU (minutes):
#   DEVICE=cpu CONFIG=tiny LAYERS=1,2 BUDGET=20 SCALE=4 SCALE_FLAGS=--no-compile \
#   EXTRA="--cost-contexts 64 --batch-sizes 1,2" bash benchmarks/gpu_run.sh /tmp/dry
set -u
OUT_DIR=${1:-benchmarks/results/gpu_run}
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.." || exit 2        # the repository's root: the module paths and the rates file below
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK" || exit 2
DEVICE=${DEVICE:-cuda}
CONFIG=${CONFIG:-layerskip-llama2-7b}
LAYERS=${LAYERS:-8,16,24}      # the exits of CONFIG's pool
BUDGET=${BUDGET:-60}           # --cost-budget of the costs-only profile at CONFIG, seconds (2/3 for the family)
SCALE=${SCALE:-1}              # a factor on every step's time limit
EXTRA=${EXTRA:-}               # more flags for both costs-only profiles
SCALE_FLAGS=${SCALE_FLAGS:-}   # more flags for benchmarks/gpu_scale.py
PY=${PY:-python3}            # the Python that holds torch (a lent GPU's image: python3)
HSD="$PY -m hsd_opt"

bundle() {  # the work folder so far into OUT_DIR, each file replaced whole
  tar -czf "$OUT_DIR/.gpu_run.tar.gz" -C "$WORK" . && mv "$OUT_DIR/.gpu_run.tar.gz" "$OUT_DIR/gpu_run.tar.gz"
  cp "$WORK/steps.tsv" "$OUT_DIR/.steps.tsv" && mv "$OUT_DIR/.steps.tsv" "$OUT_DIR/steps.tsv"
  if [ -f "$WORK/gpu_scale.json" ]; then
    cp "$WORK/gpu_scale.json" "$OUT_DIR/.gpu_scale.json" && mv "$OUT_DIR/.gpu_scale.json" "$OUT_DIR/gpu_scale.json"
  fi
  return 0
}

step() {  # step NAME LIMIT COMMAND...: run COMMAND with a time limit, its output in NAME.log, its seconds in steps.tsv
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # SIGTERM at the limit (hsd keeps what it finished), SIGKILL 3 s later: a step that lingers after the signal
  # (a long call that does not return to the interpreter) cannot eat the later steps' time
  timeout -k 3 "$((limit * SCALE))" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$WORK/steps.tsv"
  echo "$name: exit $rc, $((SECONDS - t0)) s"; tail -n 3 "$WORK/$name.log"
  bundle
}

# time limits, seconds: 30 + 240 + 120 + 2 * (70 + 10 + 10) = 570, and 3 s each to die after SIGTERM: 597, within a
# 600 s call
printf 'step\texit\tseconds\n' >"$WORK/steps.tsv"
step doctor 30 $PY -m hsd_opt doctor
step gpu_scale 240 $PY -m benchmarks.gpu_scale --config "$CONFIG" --device "$DEVICE" $SCALE_FLAGS \
  --out "$WORK/gpu_scale.json"
step costs_7b 120 $HSD profile --costs-only --model "$CONFIG" --device "$DEVICE" --layers "$LAYERS" \
  --quantized int8,int4 --token-drafters lookup,ngram --cost-budget "$BUDGET" --quiet $EXTRA \
  --out "$WORK/costs_7b.json"
FAMILY_POOL=(--model qwen2.5-coder-1.5b --device "$DEVICE" --layers 14,21,25 --draft-model qwen2.5-coder-0.5b
  --draft-layers 12,18 --quantized int8,int4,qwen2.5-coder-0.5b:int8,qwen2.5-coder-0.5b:int4)
# the family's pool as the engine runs by default, then replaying CUDA graphs with the copies reading their codes
for v in default replayed; do
  flags=(); [ "$v" = replayed ] && flags=(env HSD_CUDA_GRAPHS=1 HSD_WEIGHT_ONLY=1)
  step "costs_family_$v" 70 ${flags[@]+"${flags[@]}"} $HSD profile --costs-only "${FAMILY_POOL[@]}" \
    --cost-budget "$((BUDGET * 2 / 3))" --quiet $EXTRA --out "$WORK/costs_family_$v.json"
  step "merge_$v" 10 $HSD profile merge-costs --rates benchmarks/results/family_rates_cpu.json \
    --costs "$WORK/costs_family_$v.json" -o "$WORK/family_merged_$v.json"
  step "solve_$v" 10 $HSD solve --profile "$WORK/family_merged_$v.json" --tmax 15 \
    --out "$WORK/family_plan_$v.json"
done
echo "work folder: $WORK; bundled in $OUT_DIR/gpu_run.tar.gz"
