#!/usr/bin/env bash
# Convert the bundled tiny Qwen3 to Megatron (TP2 PP2) and back, and check the round trip is exact.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
OUT="${1:-demo-out}"
rm -rf "$OUT"
mconv inspect fixtures/qwen3-tiny
mconv hf2mcore fixtures/qwen3-tiny "$OUT/megatron" --tp 2 --pp 2 --spec local
mconv inspect "$OUT/megatron"
mconv mcore2hf "$OUT/megatron" "$OUT/hf"
mconv verify fixtures/qwen3-tiny "$OUT/hf"
