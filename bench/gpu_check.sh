#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA, most important first, within a
# time budget (GPU_CHECK_BUDGET_S, default 540 s: a step that could pass it is skipped,
# and says so):
#   1. the GPU tests (tests/engine/test_gpu_paths.py; the CPU-side tests of the same
#      paths run everywhere else, in the suite);
#   2. bench.offline on a random model with the default model's shapes (the embedded
#      94 MB GGUF does not travel to an offline GPU machine), bf16, 64 prompts x 128
#      tokens: CUDA graphs on (async batching on, its default there), graphs on with
#      async batching off, graphs off; one prompt x 128 tokens, graphs on then off;
#      transformers' generate_batch and static generate on the same weights (peers);
#      256 prompts with graphs on. Each log ends with the engine's counts (graph
#      steps, compiled steps, lookahead steps), so a path that fell back to eager shows;
#   3. where a tokenizer is given (GPU_CHECK_TOKENIZER: a folder from `bench.random_model
#      DIR --tokenizer smollm2-135m-instruct --tokenizer-only`) and fastapi and uvicorn
#      import: the server on the GPU (bf16) under bench.serve at concurrency 1 and 32
#      (bench/gpu_carry.sh prepares both for a machine without network);
#   4. last, 64 prompts with graphs and default_compile_level 1 (compiled layer steps;
#      their compilation, in the warm-up, took over 120 s on an H200's host).
# GPU_CHECK_DEVICE (default cuda) rehearses the script elsewhere (cpu: the GPU tests
# skip, the runs take the CPU's paths). GPU_CHECK_STEPS, a regular expression matched
# against step names, runs only those steps; anchor it to pick one exactly
# ('^(random-model|serve-cuda)$' reruns the server).
# The logs and JSON reports go to GPU_CHECK_DIR (default ./gpu-results); with OUT set,
# they are also packed into $OUT/gpu-check.tar.gz after every step, so a run cut short
# still returns what it finished.
# Installs nothing: it needs python3 with a CUDA torch, transformers, pytest, psutil and
# tqdm (the server: fastapi, uvicorn, pydantic, pyyaml, prometheus-client). flash-attn
# is used where it is installed; without it the torch backend serves (fixed-width
# decode tables, CUDA graphs) and the flash tests skip.
#
#     bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_DIR:-gpu-results}"
budget="${GPU_CHECK_BUDGET_S:-540}"
device="${GPU_CHECK_DEVICE:-cuda}"
tokenizer="${GPU_CHECK_TOKENIZER:-}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

pack() {
  if [[ -n "${OUT:-}" ]]; then
    tar czf "$OUT/gpu-check.tar.gz" -C "$out" .
  fi
}

# run_step NAME LIMIT_S COMMAND...: the command's output in $out/NAME.log, one line here
# (and in $out/summary.txt)
run_step() {
  local name=$1 limit=$2
  shift 2
  [[ "$name" =~ ${GPU_CHECK_STEPS:-.} ]] || return 0
  if (( SECONDS + limit > budget )); then
    echo "$name: skipped (${SECONDS} s used of the ${budget} s budget)" \
      | tee -a "$out/summary.txt"
    return
  fi
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local status=$? found
  found=$(grep -E '^kvserve|^c=|^=+ .*(passed|failed|error|skipped)' "$out/$name.log")
  (( status == 0 )) || found+=" $(tail -1 "$out/$name.log")"
  echo "$name: exit $status after ${SECONDS} s: $(echo "$found" | tr '\n' ' ' | cut -c1-400)" \
    | tee -a "$out/summary.txt"
  pack
}

{
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  timeout 60 python3 -c "import torch, transformers; print('torch', torch.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
  timeout 30 python3 -c "import flash_attn; print('flash-attn', flash_attn.__version__)" \
    2>&1 | tail -1
} > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
pack

run_step gpu-tests 180 python3 -m pytest -v -p no:cacheprovider -rs --durations=10 \
  tests/engine/test_gpu_paths.py
model=/tmp/kvserve-smollm2-shaped
run_step random-model 40 python3 -m bench.random_model "$model" \
  ${tokenizer:+--tokenizer "$tokenizer"}
# offline NAME LIMIT_S OPTIONS...: bench.offline, bf16 on CUDA, 128 tokens a prompt
offline() {
  local name=$1 limit=$2
  shift 2
  run_step "$name" "$limit" python3 -m bench.offline --model "$model" --device "$device" \
    --dtype bfloat16 --input-len 64 --output-len 128 --json "$out/$name.json" "$@"
}
offline offline-cuda-p64-graph-on 60 --num-prompts 64 --cuda-graph on
offline offline-cuda-p64-graph-on-async-off 60 --num-prompts 64 --cuda-graph on \
  --async-batching off
offline offline-cuda-p64-graph-off 60 --num-prompts 64 --cuda-graph off
offline offline-cuda-p1-graph-on 40 --num-prompts 1 --cuda-graph on
offline offline-cuda-p1-graph-off 40 --num-prompts 1 --cuda-graph off
offline offline-cuda-p64-peers 90 --num-prompts 64 --cuda-graph on \
  --peers transformers-cb,transformers-static
offline offline-cuda-p256-graph-on 60 --num-prompts 256 --cuda-graph on
# serve LIMIT_S: the server on the GPU under bench.serve (concurrency 1, then 32); the
# server stops when the step ends, and with the script (trap) if that is cut short
server_pid=
stop_server() {
  [[ -n "$server_pid" ]] || return 0
  kill "$server_pid" 2> /dev/null
  timeout 40 tail --pid="$server_pid" -f /dev/null || kill -9 "$server_pid" 2> /dev/null
  server_pid=
}
trap stop_server EXIT
serve() {
  local limit=$1 port=8123
  [[ serve-cuda =~ ${GPU_CHECK_STEPS:-.} ]] || return 0
  if [[ -z "$tokenizer" ]] || ! python3 -c "import fastapi, uvicorn" 2> /dev/null; then
    echo "serve-cuda: skipped (no GPU_CHECK_TOKENIZER, or no fastapi/uvicorn)" \
      | tee -a "$out/summary.txt"
    return
  fi
  if (( SECONDS + limit > budget )); then
    echo "serve-cuda: skipped (${SECONDS} s used of the ${budget} s budget)" \
      | tee -a "$out/summary.txt"
    return
  fi
  python3 -m server --model "$model" --device "$device" --dtype bfloat16 --port "$port" \
    > "$out/server.log" 2>&1 &
  server_pid=$!
  if ! timeout 60 python3 -c "
import sys, time, urllib.request
while True:
    try:
        urllib.request.urlopen('http://127.0.0.1:$port/ready', timeout=2)
        break
    except OSError:
        time.sleep(0.5)" || ! kill -0 "$server_pid" 2> /dev/null; then
    echo "serve-cuda: the server did not become ready: $(tail -1 "$out/server.log")" \
      | tee -a "$out/summary.txt"
    stop_server
    pack
    return
  fi
  run_step serve-cuda "$((limit - 60))" python3 -m bench.serve \
    --base-url "http://127.0.0.1:$port" --model "$model" --concurrency 1,32 \
    --input-len 64 --output-len 128 --json "$out/serve-cuda.json"
  stop_server
  pack
}
serve 150
offline offline-cuda-p64-graph-on-compile1 220 --num-prompts 64 --cuda-graph on \
  --compile-level 1
