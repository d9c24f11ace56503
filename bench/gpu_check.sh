#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA (results under $OUT, else
# ./gpu-results), most important first, within a time budget (GPU_CHECK_BUDGET_S,
# default 420 s: a step that could pass it is skipped, and says so):
#   1. the GPU tests (tests/engine/test_gpu_paths.py; the CPU-side tests of the same
#      paths run everywhere else, in the suite);
#   2. bench.offline on a random model with the default model's shapes (the embedded
#      94 MB GGUF does not travel to an offline GPU machine): bf16, 64 prompts x 128
#      tokens with CUDA graphs on, then off; one prompt x 128 tokens, on then off; then
#      64 prompts with graphs and default_compile_level 1 (compiled layer steps). Each
#      log ends with the engine's counts (graph steps, compiled steps, lookahead steps),
#      so a path that fell back to eager shows.
# Installs nothing: it needs python3 with a CUDA torch, transformers, pytest, psutil and
# tqdm. flash-attn is used where it is installed; without it the torch backend serves
# (fixed-width decode tables, CUDA graphs) and the flash tests skip.
#
#     bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
budget="${GPU_CHECK_BUDGET_S:-420}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

# run_step NAME LIMIT_S COMMAND...: the command's output in $out/NAME.log, one line here
run_step() {
  local name=$1 limit=$2
  shift 2
  if (( SECONDS + limit > budget )); then
    echo "$name: skipped (${SECONDS} s used of the ${budget} s budget)"
    return
  fi
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status after ${SECONDS} s: $(grep -E '^kvserve|^=+ .*(passed|failed|error|skipped)' \
    "$out/$name.log" | tr '\n' ' ' | cut -c1-400)"
}

{
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  timeout 60 python3 -c "import torch, transformers; print('torch', torch.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
  timeout 30 python3 -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>&1 | tail -1
} > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

run_step gpu-tests 180 python3 -m pytest -v -p no:cacheprovider -rs --durations=10 \
  tests/engine/test_gpu_paths.py
model=/tmp/kvserve-smollm2-shaped
run_step random-model 40 python3 -m bench.random_model "$model"
for prompts in 64 1; do
  for graph in on off; do
    name="offline-cuda-p$prompts-graph-$graph"
    run_step "$name" $((prompts > 1 ? 60 : 40)) python3 -m bench.offline --model "$model" \
      --device cuda --dtype bfloat16 --cuda-graph "$graph" --num-prompts "$prompts" \
      --input-len 64 --output-len 128 --json "$out/$name.json"
  done
done
name="offline-cuda-p64-graph-on-compile1"
run_step "$name" 120 python3 -m bench.offline --model "$model" --device cuda --dtype bfloat16 \
  --cuda-graph on --compile-level 1 --num-prompts 64 --input-len 64 --output-len 128 \
  --json "$out/$name.json"
