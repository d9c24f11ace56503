#!/usr/bin/env bash
# What a CUDA machine without network lacks for bench/gpu_check.sh's server run and
# bench/gpu_profile.sh's samples, gathered here into gpu-carry/ (git-ignored):
#   gpu-carry/wheels/     wheels of fastapi, starlette, pydantic, pydantic-core, uvicorn,
#                         annotated-types, typing-inspection (the versions this checkout's
#                         .venv holds) and py-spy, for CPython 3.12 on manylinux x86-64
#                         (PYTHON_VERSION to change it); not their other needs
#                         (anyio, h11, click, typing-extensions, annotated-doc),
#                         which a machine with transformers has through
#                         huggingface-hub and httpx;
#   gpu-carry/tokenizer/  the default model's tokenizer and chat template (a few MB;
#                         the model itself stays: bench.random_model makes one there).
# Then, on that machine, from the repository's root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site gpu-carry/wheels/*.whl
#   PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH GPU_CHECK_TOKENIZER=gpu-carry/tokenizer \
#     bash bench/gpu_check.sh
#
#     bash bench/gpu_carry.sh        (after make install)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
target=gpu-carry
server_packages='fastapi|starlette|pydantic|pydantic[-_]core|uvicorn'
server_packages+='|annotated[-_]types|typing[-_]inspection'

pins=$("$python" -m pip freeze | grep -iE "^($server_packages)==" || true)
if [[ -z "$pins" ]]; then
  echo "no server packages in $python's environment: run make install first" >&2
  exit 1
fi
mkdir -p "$target/wheels"
# shellcheck disable=SC2086  # one argument per pin
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$target/wheels" \
  --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  $pins py-spy
"$python" -m bench.random_model "$target/tokenizer" --tokenizer smollm2-135m-instruct \
  --tokenizer-only > /dev/null
du -sh "$target"/*
ls "$target/wheels"
