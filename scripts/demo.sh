#!/usr/bin/env bash
# The light install (what the command line needs, no test stack) in .venv-demo, then convert the
# bundled tiny Qwen3 to Megatron (TP2 PP2 rank files, and torch_dist) and back, and check each round
# trip is exact. tests/test_install.py runs the same mconv commands with megatron-core,
# transformers and peft unimportable.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
VENV=.venv-demo
[ -x "$VENV/bin/python" ] || { PYTHON="$(find_python)"; "$PYTHON" -m venv "$VENV"; }
"$VENV/bin/python" -m pip install --quiet -c constraints.txt .
export PATH="$PWD/$VENV/bin:$PATH"
OUT="${1:-demo-out}"
rm -rf "$OUT"
mconv inspect fixtures/qwen3-tiny
mconv hf2mcore fixtures/qwen3-tiny "$OUT/megatron-tp2-pp2" --tp 2 --pp 2 --format torch
mconv inspect "$OUT/megatron-tp2-pp2"
mconv mcore2hf "$OUT/megatron-tp2-pp2" "$OUT/hf-from-tp2-pp2"
mconv verify fixtures/qwen3-tiny "$OUT/hf-from-tp2-pp2"
mconv hf2mcore fixtures/qwen3-tiny "$OUT/megatron-torch-dist" --tp 2
mconv mcore2hf "$OUT/megatron-torch-dist" "$OUT/hf-from-torch-dist"
mconv verify fixtures/qwen3-tiny "$OUT/hf-from-torch-dist"
