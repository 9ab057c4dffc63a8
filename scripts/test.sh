#!/usr/bin/env bash
# Install (if needed) and run the whole test suite, slow megatron-core oracle tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -n 2 -p no:cacheprovider --durations=25 tests "$@"
