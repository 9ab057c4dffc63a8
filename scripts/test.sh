#!/usr/bin/env bash
# Install (if needed) and run the whole test suite, slow megatron-core oracle tests included (or the
# test files, folders and pytest options given: ./scripts/test.sh tests/test_docs.py -k cli).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
# mconv's and the tests' own bytecode, once per change (see UV_COMPILE_BYTECODE in scripts/python.sh)
.venv/bin/python -m compileall -q mconv tests fixtures >/dev/null
# the whole tests/ folder unless the arguments name test files or folders (tests/test_x.py::test_y too)
targets=(tests)
for arg in "$@"; do
    if [[ $arg != -* && -e ${arg%%::*} ]]; then targets=(); break; fi
done
exec .venv/bin/python -m pytest -n 2 -p no:cacheprovider --durations=25 "${targets[@]}" "$@"
