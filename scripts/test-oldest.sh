#!/usr/bin/env bash
# The tests that need no megatron-core, on the oldest supported set-up (scripts/install-oldest.sh:
# Python 3.10, torch 2.6.0, setup.cfg's lower bounds): the light install's commands, the byte formats
# torch 2.6 writes and reads (torch.save archives, DCP's .metadata, weights_only loads of untrusted
# files and .bin checkpoints), dtypes, LoRA export against peft, and the command line's text.
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-oldest.sh
.venv-oldest/bin/python -m compileall -q mconv tests fixtures >/dev/null  # as scripts/test.sh
TESTS=(
    tests/test_install.py tests/test_imports.py tests/test_torch_save.py tests/test_io_paths.py
    tests/test_dcp_metadata.py::test_hf2mcore_metadata_is_torchs_pickle_of_what_torch_reads
    tests/test_dcp_metadata.py::test_checkpoint_resaved_by_torchs_own_dcp_converts_back
    tests/test_untrusted.py tests/test_bin_checkpoints.py tests/test_dtype.py tests/test_lora.py
    tests/test_cli_text.py
)
# test_torch_dist_adapter_checkpoint saves its input with megatron-core's dist_checkpointing.
exec .venv-oldest/bin/python -m pytest -p no:cacheprovider -m "not slow" \
    --deselect tests/test_lora.py::test_torch_dist_adapter_checkpoint "${TESTS[@]}" "$@"
