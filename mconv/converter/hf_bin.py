"""HF checkpoints saved as pickles: `pytorch_model.bin`, or shards listed by
`pytorch_model.bin.index.json`, as transformers' `save_pretrained(..., safe_serialization=False)`
writes them and older fine-tunes ship them. transformers reads them with
`torch.load(weights_only=True)`; mconv does the same, through its one restricted unpickler
(`safe_load.load_torch`: nothing in the file executes), memory-mapped so that a tensor's bytes are
read only when sliced; a file in torch's older pre-zip format (`_use_new_zipfile_serialization=False`),
which transformers loads too, cannot be mapped and is read whole into memory."""
from __future__ import annotations

from pathlib import Path

import torch

from mconv.converter import safe_load
from mconv.converter.options import dtype_name
from mconv.errors import MconvError

BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_SINGLE_NAME = "pytorch_model.bin"


def read_bin(path: Path, dtypes) -> dict[str, torch.Tensor]:
    """The named tensors of a `.bin` state dict, memory-mapped (not read; read whole in the pre-zip
    format). `dtypes`: the dtypes mconv converts. Raises MconvError naming the file: a refused
    global (nothing runs), a file that is not a torch.save file (zip or pre-zip), an object other
    than a dict of named tensors, a tensor that is not dense (sparse, quantized, nested, meta) or of
    another dtype."""
    if not path.is_file():  # torch.load would block on a FIFO
        raise MconvError(f"{path} is not a regular file, so not a PyTorch weights file")
    state = safe_load.load_torch(path, mmap=True)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise MconvError(f"{path} holds a {type(state).__name__}, not a state dict of named tensors")
    for name, tensor in state.items():
        if not safe_load.is_dense(tensor):
            raise MconvError(f"{path}: tensor {name:.200} is a sparse, quantized, nested or meta tensor, not a dense "
                             "one as weights are saved")
        if tensor.dtype not in dtypes:
            raise MconvError(f"{path}: tensor {name} has dtype {dtype_name(tensor.dtype)}, "
                             "which mconv does not convert")
    return state
