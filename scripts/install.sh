#!/usr/bin/env bash
# Create .venv with Python 3.12 and the pinned, tested dependencies (idempotent), installed by uv
# (scripts/python.sh's find_uv; VIRTUAL_ENV names the venv it installs into).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/python.sh
export VIRTUAL_ENV="$PWD/.venv"
UV="$(find_uv)"

# mbridge with Qwen3-VL (mbridge/models/qwen3_vl, the Megatron Qwen3VLModel the Qwen3-VL tests build):
# only in mbridge's git history after 0.15.1, so it is carried here as a wheel (see wheels/README.md).
MBRIDGE_WHEEL=wheels/mbridge-0.15.1+git.10cb17f-py3-none-any.whl
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c '
import importlib.metadata as m, mconv, megatron.core, transformers, peft, hypothesis, einops, omegaconf, isal
assert m.version("mbridge") == "0.15.1+git.10cb17f" and m.version("megatron-bridge") == "0.6.2"' 2>/dev/null; then
    if [ ! -x .venv/bin/python ]; then
        PYTHON="$(find_python)"
        "$UV" venv --quiet --allow-existing --python "$PYTHON" .venv
    fi
    "$UV" pip install --quiet -c constraints.txt -e '.[live,test,mbridge]'
    "$UV" pip install --quiet --no-deps --reinstall "$MBRIDGE_WHEEL"
    # Megatron-Bridge without its dependency set (Transformer Engine, modelopt, ...): the tests build
    # local-spec models with its conversion modules only (tests/test_bridges.py says how); omegaconf
    # is the one dependency those modules import.
    "$UV" pip install --quiet -c constraints.txt omegaconf
    "$UV" pip install --quiet -c constraints.txt --no-deps megatron-bridge
fi

# An older megatron-core beside ours, for the test that it loads mconv's torch_dist checkpoints
# (run with PYTHONPATH pointing here; 0.14.0 is the oldest release with a wheel for Python 3.12).
if [ ! -d .venv/mcore-0.14/megatron ]; then
    "$UV" pip install --quiet --no-deps --only-binary=:all: --target .venv/mcore-0.14 megatron-core==0.14.0
fi
install_transformers_4 .venv
# compressed-tensors beside ours (pure torch; loguru is the one dependency it needs that the venv lacks),
# the oracle of the FP8 block quantization's bytes (tests/test_fp8.py puts this dir on sys.path).
if [ ! -d .venv/compressed-tensors/compressed_tensors ]; then
    "$UV" pip install --quiet --no-deps --only-binary=:all: --target .venv/compressed-tensors \
        compressed-tensors==0.20.0 loguru==0.7.3
fi
