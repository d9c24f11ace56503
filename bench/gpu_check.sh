#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA (results under $OUT, else
# ./gpu-results):
#   1. the GPU tests (tests/engine/test_gpu_paths.py) and the CPU-side tests of the same
#      paths (flash backend on the reference of flash-attn's contract, decode graphs);
#   2. bench.offline on a random model with the default model's shapes (the embedded
#      94 MB GGUF does not travel to an offline GPU machine): bf16, 64 prompts x 128
#      tokens and one prompt x 128 tokens, CUDA graphs off then on, side by side; then
#      64 prompts with graphs and default_compile_level 1 (compiled layer steps).
# Installs nothing: it needs python3 with a CUDA torch, transformers, pytest, psutil and
# tqdm. flash-attn is used where it is installed; without it the torch backend serves
# (fixed-width decode tables, CUDA graphs) and the flash tests skip.
#
#     bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name())"
  python3 -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>&1 | tail -1
} > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
# every step has a timeout, together under 9.5 minutes
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_gpu_paths.py \
  tests/engine/test_decode_graphs.py tests/engine/test_flash_backend.py \
  tests/engine/test_compile_paths.py tests/engine/test_async_steps.py > "$out/gpu-tests.log" 2>&1
echo "tests: exit $?, $(tail -1 "$out/gpu-tests.log")"
model=/tmp/kvserve-smollm2-shaped
timeout 40 python3 -m bench.random_model "$model" > /dev/null 2>&1
for prompts in 64 1; do
  for graph in off on; do
    name="offline-cuda-p$prompts-graph-$graph"
    timeout $((prompts > 1 ? 60 : 40)) python3 -m bench.offline --model "$model" \
      --device cuda --dtype bfloat16 --cuda-graph "$graph" --num-prompts "$prompts" --input-len 64 --output-len 128 \
      --json "$out/$name.json" > "$out/$name.log" 2>&1
    echo "$name: exit $?, $(tail -1 "$out/$name.log")"
  done
done
name="offline-cuda-p64-graph-on-compile1"
timeout 120 python3 -m bench.offline --model "$model" --device cuda --dtype bfloat16 \
  --cuda-graph on --compile-level 1 --num-prompts 64 --input-len 64 --output-len 128 \
  --json "$out/$name.json" > "$out/$name.log" 2>&1
echo "$name: exit $?, $(tail -1 "$out/$name.log")"
