#!/usr/bin/env bash
# Optional: SGLang's own Python code (no kernels, no CUDA), the oracle tests/test_weight_sync.py reads
# mconv's flattened-bucket payload back with and receives its broadcasts with (SGLang's WeightUpdater).
# sglang 0.5.23 and the four packages its weight-sync modules import that the vLLM venv lacks,
# installed without dependencies into .sglang (git-ignored), used with the vLLM venv's Python 3.11
# (scripts/install-vllm.sh first). About 75 s and 230 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=.sglang:tests/vllm_site .venv/vllm311/bin/python -c \
    'import sglang.srt.weight_sync.tensor_bucket, sglang.srt.utils, sglang.srt.model_executor.model_runner_components.weight_updater' 2>/dev/null && exit 0
source scripts/python.sh
"$(find_uv)" pip install --quiet --python .venv/vllm311/bin/python --no-deps --upgrade --target .sglang \
    sglang==0.5.23 orjson ipython traitlets gguf==0.19.0
