#!/usr/bin/env bash
# The oldest supported set-up in .venv-oldest: Python 3.10, torch 2.6.0 and setup.cfg's lower bounds
# (constraints-oldest.txt), the light install of mconv (no megatron-core) and the oracles of the fast
# tests that scripts/test-oldest.sh runs there (transformers 4.57 beside, for
# the .bin tests). About 70 s and 5 GB (torch's CUDA build, as PyPI has it).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
VENV=.venv-oldest
UV="$(find_uv)"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c '
import sys, torch, transformers, peft, hypothesis, pytest, mconv
assert sys.version_info[:2] == (3, 10) and torch.__version__.split("+")[0] == "2.6.0"' 2>/dev/null; then
    if [ ! -x "$VENV/bin/python" ]; then
        PYTHON="$(find_python 3.10)"
        "$UV" venv --quiet --allow-existing --python "$PYTHON" "$VENV"
    fi
    "$UV" pip install --quiet --python "$VENV/bin/python" -c constraints-oldest.txt -e . \
        torch transformers peft pytest hypothesis
fi
install_transformers_4 "$VENV"
