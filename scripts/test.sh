#!/usr/bin/env bash
# Install (if needed) and run the whole test suite, slow megatron-core oracle tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
# mconv's and the tests' own bytecode, once per change (see UV_COMPILE_BYTECODE in scripts/python.sh)
.venv/bin/python -m compileall -q mconv tests fixtures >/dev/null
exec .venv/bin/python -m pytest -n 2 -p no:cacheprovider --durations=25 tests "$@"
