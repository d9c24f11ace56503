#!/usr/bin/env bash
# Where a CUDA decode step's time goes, on a random model with the default model's
# shapes (bf16, 64-token prompts): bench.profile's host and device tables for one
# prompt with CUDA graphs on and off and for 64 prompts with graphs on, and, where
# py-spy is installed, its samples of the engine thread for one prompt with graphs on
# (raw folded stacks, --idle, one line per stack; sort by count). Results in
# GPU_CHECK_DIR (default ./gpu-results), packed into $OUT/gpu-profile.tar.gz when OUT
# is set. Each run has its own time limit; none installs anything.
#
#     bash bench/gpu_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_DIR:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
model=/tmp/kvserve-smollm2-shaped

step() {   # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name: exit $? after ${SECONDS} s: $(grep -m1 ' a step' "$out/$name.txt")"
  [[ -n "${OUT:-}" ]] && tar czf "$OUT/gpu-profile.tar.gz" -C "$out" .
}

[[ -d "$model" ]] || step random-model 40 python3 -m bench.random_model "$model"
profile=(python3 -m bench.profile --model "$model" --device cuda --input-len 64)
step profile-p1-graph-on 35 "${profile[@]}" --num-prompts 1 --cuda-graph on
step profile-p64-graph-on 35 "${profile[@]}" --num-prompts 64 --cuda-graph on
step profile-p1-graph-off 45 "${profile[@]}" --num-prompts 1 --cuda-graph off
if command -v py-spy > /dev/null; then
  step pyspy-p1-graph-on 45 py-spy record --idle --threads --rate 500 --format raw \
    --output "$out/pyspy-p1-graph-on.folded" -- python3 -m bench.offline --model "$model" \
    --device cuda --dtype bfloat16 --cuda-graph on --num-prompts 1 --input-len 64 \
    --output-len 512
fi
