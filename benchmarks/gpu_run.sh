#!/usr/bin/env bash
# The GPU measurements of docs/results.md#cuda, in one command on a lent device (at most 10 minutes):
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
# Every step writes into the folder given (default: benchmarks/results/gpu_run), with its log and seconds; a step
# that fails is logged and the next one runs. A dry run on a CPU (minutes):
#   DEVICE=cpu CONFIG=tiny LAYERS=1,2 BUDGET=20 SCALE=4 SCALE_FLAGS=--no-compile \
#   EXTRA="--cost-contexts 64 --batch-sizes 1,2" bash benchmarks/gpu_run.sh /tmp/dry
set -u
OUT_DIR=${1:-benchmarks/results/gpu_run}
DEVICE=${DEVICE:-cuda}
CONFIG=${CONFIG:-layerskip-llama2-7b}
LAYERS=${LAYERS:-8,16,24}      # the exits of CONFIG's pool
BUDGET=${BUDGET:-60}           # --cost-budget of the costs-only profile at CONFIG, seconds (2/3 for the family)
SCALE=${SCALE:-1}              # a factor on every step's time limit
EXTRA=${EXTRA:-}               # more flags for both costs-only profiles
SCALE_FLAGS=${SCALE_FLAGS:-}   # more flags for benchmarks/gpu_scale.py
PY=${PY:-python3}            # the Python that holds torch (a lent GPU's image: python3)
mkdir -p "$OUT_DIR"
HSD="$PY -m hsd_opt"

step() {  # step NAME LIMIT COMMAND...: run COMMAND with a time limit, its output in NAME.log, its seconds in steps.tsv
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$((limit * SCALE))" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$OUT_DIR/steps.tsv"
  echo "$name: exit $rc, $((SECONDS - t0)) s"; tail -n 3 "$OUT_DIR/$name.log"
}

printf 'step\texit\tseconds\n' >"$OUT_DIR/steps.tsv"
$PY -m hsd_opt doctor >"$OUT_DIR/doctor.txt" 2>&1
step gpu_scale 255 $PY -m benchmarks.gpu_scale --config "$CONFIG" --device "$DEVICE" $SCALE_FLAGS \
  --out "$OUT_DIR/gpu_scale.json"
step costs_7b 90 $HSD profile --costs-only --model "$CONFIG" --device "$DEVICE" --layers "$LAYERS" \
  --quantized int8,int4 --token-drafters lookup,ngram --cost-budget "$BUDGET" --quiet $EXTRA \
  --out "$OUT_DIR/costs_7b.json"
FAMILY_POOL=(--model qwen2.5-coder-1.5b --device "$DEVICE" --layers 14,21,25 --draft-model qwen2.5-coder-0.5b
  --draft-layers 12,18 --quantized int8,int4,qwen2.5-coder-0.5b:int8,qwen2.5-coder-0.5b:int4)
# the family's pool as the engine runs by default, then replaying CUDA graphs with the copies reading their codes
for v in default replayed; do
  flags=(); [ "$v" = replayed ] && flags=(env HSD_CUDA_GRAPHS=1 HSD_WEIGHT_ONLY=1)
  step "costs_family_$v" 80 ${flags[@]+"${flags[@]}"} $HSD profile --costs-only "${FAMILY_POOL[@]}" \
    --cost-budget "$((BUDGET * 2 / 3))" --quiet $EXTRA --out "$OUT_DIR/costs_family_$v.json"
  step "merge_$v" 15 $HSD profile merge-costs --rates benchmarks/results/family_rates_cpu.json \
    --costs "$OUT_DIR/costs_family_$v.json" -o "$OUT_DIR/family_merged_$v.json"
  step "solve_$v" 15 $HSD solve --profile "$OUT_DIR/family_merged_$v.json" --tmax 15 \
    --out "$OUT_DIR/family_plan_$v.json"
done
