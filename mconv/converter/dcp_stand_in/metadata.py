"""Stand-ins for the records of torch/distributed/checkpoint/metadata.py (torch 2.11) that mconv
writes into `.metadata`: the same class names, fields in the same order, the same defaults and the
same pickled state (`TensorProperties.__getstate__`, `MetadataIndex.__init__`), so that their pickle
is that of DCP's classes once the module name is swapped (see the package docstring). DCP's helper
methods (`TensorProperties.create_from_tensor`) and the type aliases are left out: mconv only
builds and pickles these records; it reads `.metadata` through safe_load's own stand-ins.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


@dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


class _MEM_FORMAT_ENCODING(Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_ENCODING = {torch.contiguous_format: _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
             torch.channels_last: _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST,
             torch.preserve_format: _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT}


@dataclass
class TensorProperties:
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False

    def __getstate__(self):
        """DCP pickles these five as a tuple, the memory format by its `_MEM_FORMAT_ENCODING`
        (torch.memory_format cannot be pickled); its `__setstate__` decodes it."""
        return self.dtype, self.layout, self.requires_grad, _ENCODING[self.memory_format], self.pin_memory


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: str | os.PathLike | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset=None, index: int | None = None):
        # DCP's own __init__, in its order: `offset` is left unset (the class default) when None,
        # so the pickled state of an object's index has no `offset`.
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", torch.Size(offset))
