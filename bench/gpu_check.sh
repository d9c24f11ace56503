#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA, most important first, within a time budget (GPU_CHECK_BUDGET_S,
# default 420 s: a step that could pass it is skipped, and says so):
#   1. the GPU tests (tests/engine/test_gpu_paths.py; the CPU-side tests of the same
#      paths run everywhere else, in the suite);
#   2. bench.offline on a random model with the default model's shapes (the embedded
#      94 MB GGUF does not travel to an offline GPU machine), bf16, 64 prompts x 128
#      tokens: CUDA graphs on (async batching on, its default there), graphs on with
#      async batching off, graphs off; one prompt x 128 tokens, graphs on then off;
#      64 prompts with graphs and default_compile_level 1 (compiled layer steps);
#      transformers' generate_batch and static generate on the same weights (peers);
#      256 prompts with graphs on. Each log ends with the engine's counts (graph
#      steps, compiled steps, lookahead steps), so a path that fell back to eager shows.
# The logs and JSON reports go to GPU_CHECK_DIR (default ./gpu-results); with OUT set,
# they are also packed into $OUT/gpu-check.tar.gz after every step, so a run cut short
# still returns what it finished. Installs nothing: it needs python3 with a CUDA torch, transformers, pytest, psutil and
# tqdm. flash-attn is used where it is installed; without it the torch backend serves
# (fixed-width decode tables, CUDA graphs) and the flash tests skip.
#
#     bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_DIR:-gpu-results}"
budget="${GPU_CHECK_BUDGET_S:-420}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

pack() {
  [[ -n "${OUT:-}" ]] && tar czf "$OUT/gpu-check.tar.gz" -C "$out" .
}

# run_step NAME LIMIT_S COMMAND...: the command's output in $out/NAME.log, one line here
# (and in $out/summary.txt)
run_step() {
  local name=$1 limit=$2
  shift 2
  if (( SECONDS + limit > budget )); then
    echo "$name: skipped (${SECONDS} s used of the ${budget} s budget)" | tee -a "$out/summary.txt"
    return
  fi
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local status=$? found
  found=$(grep -E '^kvserve|^=+ .*(passed|failed|error|skipped)' "$out/$name.log")
  (( status == 0 )) || found+=" $(tail -1 "$out/$name.log")"
  echo "$name: exit $status after ${SECONDS} s: $(echo "$found" | tr '\n' ' ' | cut -c1-400)" \
    | tee -a "$out/summary.txt"
  pack
}

{
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  timeout 60 python3 -c "import torch, transformers; print('torch', torch.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
  timeout 30 python3 -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>&1 | tail -1
} > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
pack

run_step gpu-tests 180 python3 -m pytest -v -p no:cacheprovider -rs --durations=10 \
  tests/engine/test_gpu_paths.py
model=/tmp/kvserve-smollm2-shaped
run_step random-model 40 python3 -m bench.random_model "$model"
# offline NAME LIMIT_S OPTIONS...: bench.offline, bf16 on CUDA, 128 tokens a prompt
offline() {
  local name=$1 limit=$2
  shift 2
  run_step "$name" "$limit" python3 -m bench.offline --model "$model" --device cuda \
    --dtype bfloat16 --input-len 64 --output-len 128 --json "$out/$name.json" "$@"
}
offline offline-cuda-p64-graph-on 60 --num-prompts 64 --cuda-graph on
offline offline-cuda-p64-graph-on-async-off 60 --num-prompts 64 --cuda-graph on \
  --async-batching off
offline offline-cuda-p64-graph-off 60 --num-prompts 64 --cuda-graph off
offline offline-cuda-p1-graph-on 40 --num-prompts 1 --cuda-graph on
offline offline-cuda-p1-graph-off 40 --num-prompts 1 --cuda-graph off
offline offline-cuda-p64-graph-on-compile1 120 --num-prompts 64 --cuda-graph on \
  --compile-level 1
offline offline-cuda-p64-peers 90 --num-prompts 64 --cuda-graph on \
  --peers transformers-cb,transformers-static
offline offline-cuda-p256-graph-on 60 --num-prompts 256 --cuda-graph on
