#!/usr/bin/env bash
# Where a CUDA decode step's time goes when the device's work is small, on a random
# model with the default model's shapes (bf16, 64-token prompts, one prompt):
#   1. bench.host_ops: what one torch call and a pure-Python loop cost on this host;
#   2. py-spy's samples of bench.offline's run (raw folded stacks, one line per stack
#      with its count; --idle, non-blocking, at most 40 s), where py-spy is installed;
#   3. bench.offline with graphs on, as is and with one intra-op thread
#      (OMP_NUM_THREADS=1), and 256 prompts with graphs on.
# Results in GPU_CHECK_DIR (default ./gpu-results), packed into $OUT/gpu-profile.tar.gz
# after every step when OUT is set. Installs nothing.
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
  echo "$name: exit $? after ${SECONDS} s: $(grep -E -m2 '^kvserve |^\{"device"' \
    "$out/$name.txt" | tr '\n' ' ')"
  if [[ -n "${OUT:-}" ]]; then
    tar czf "$OUT/gpu-profile.tar.gz" -C "$out" .
  fi
}

step host-ops 30 python3 -m bench.host_ops --device cuda
[[ -d "$model" ]] || step random-model 40 python3 -m bench.random_model "$model"
offline=(python3 -m bench.offline --model "$model" --device cuda --dtype bfloat16
         --cuda-graph on --input-len 64)
if command -v py-spy > /dev/null; then
  step pyspy-p1-graph-on 45 py-spy record --idle --threads --nonblocking --rate 250 \
    --duration 40 --format raw --output "$out/pyspy-p1-graph-on.folded" -- \
    "${offline[@]}" --num-prompts 1 --output-len 1024
fi
step offline-p1-graph-on 35 "${offline[@]}" --num-prompts 1 --output-len 128
OMP_NUM_THREADS=1 step offline-p1-graph-on-1-thread 35 "${offline[@]}" --num-prompts 1 \
  --output-len 128
step offline-p256-graph-on 40 "${offline[@]}" --num-prompts 256 --output-len 128
