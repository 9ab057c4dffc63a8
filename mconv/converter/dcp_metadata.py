"""torch.distributed.checkpoint's `.metadata`, checked and indexed: every global tensor's shape,
dtype and stored chunks (file, byte offset, length), and every stored object's place. The file is
unpickled by safe_load (DCP's classes as stand-ins); `torch_dist_io.TorchDistReader` reads the boxes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mconv.errors import MconvError


@dataclass(frozen=True)
class StoredChunk:
    """One stored box of a global tensor (or an object): where it is and which box it is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int  # byte offset of its torch.save archive in `file`
    length: int


@dataclass
class StoredTensor:
    """A global tensor as `.metadata` describes it: its key, shape, dtype and stored chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[StoredChunk]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _kind(record) -> str | None:
    """The DCP metadata class a record from `.metadata` stands for (see safe_load.StoredObject)."""
    cls = type(record)
    return cls.__qualname__ if cls.__module__.startswith("torch.distributed.checkpoint.") else None


def index_metadata(path: Path, metadata) -> tuple[dict[str, StoredTensor], dict[str, StoredChunk]]:
    """Check DCP's Metadata (`metadata`, unpickled from `path` by safe_load.load_pickle: its stand-ins
    of DCP's classes, any shape of them) and index every key's stored chunks: ({tensor key:
    StoredTensor}, {object key: StoredChunk}). MconvError naming the file and the entry that is
    not what DCP writes (a storage entry outside the checkpoint, a chunk outside its tensor,
    stored transforms)."""
    def bad(what: str) -> MconvError:
        return MconvError(f"{path}: {what}; the file is not a torch.distributed.checkpoint metadata file "
                          "mconv can read")

    if _kind(metadata) != "Metadata" or not isinstance(getattr(metadata, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise bad(f"it holds a {type(metadata).__name__}")
    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        if (_kind(index) != "MetadataIndex" or not isinstance(getattr(index, "fqn", None), str)
                or not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".")
                or not isinstance(info.offset, int) or not isinstance(info.length, int)
                or info.offset < 0 or info.length < 0):
            raise bad(f"storage entry {getattr(index, 'fqn', index)!s:.80} names no file inside the checkpoint")
        if getattr(info, "transform_descriptors", None):
            raise MconvError(f"{path}: {index.fqn} is stored with transforms {list(info.transform_descriptors)} "
                             "(compression?), which mconv does not read")
        offset = None if getattr(index, "offset", None) is None else tuple(index.offset)
        where[(index.fqn, offset)] = (name, info.offset, info.length)
    tensors, objects = {}, {}
    for key, entry in metadata.state_dict_metadata.items():
        if _kind(entry) == "BytesStorageMetadata":
            if (key, None) not in where:
                raise bad(f"object {key} has no storage entry")
            objects[key] = StoredChunk((), (), *where[(key, None)])
            continue
        properties = getattr(getattr(entry, "properties", None), "state", None)
        if (_kind(entry) != "TensorStorageMetadata" or not isinstance(properties, tuple) or not properties
                or not isinstance(properties[0], torch.dtype) or not isinstance(getattr(entry, "size", None), torch.Size)
                or not isinstance(getattr(entry, "chunks", None), list)
                or not all(_kind(c) == "ChunkStorageMetadata" for c in entry.chunks)):
            raise bad(f"entry {key!s:.80} is not a tensor or object description")
        shape = tuple(entry.size)
        chunks = []
        for c in entry.chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            if (len(offsets) != len(shape) or len(sizes) != len(shape)
                    or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, sizes, shape))):
                raise bad(f"tensor {key} has a chunk {list(sizes)} at {list(offsets)} outside its shape {list(shape)}")
            if (key, offsets) not in where:
                raise bad(f"tensor {key} has no storage entry for its chunk at {list(offsets)}")
            chunks.append(StoredChunk(offsets, sizes, *where[(key, offsets)]))
        tensors[key] = StoredTensor(key, shape, properties[0], chunks)
    return tensors, objects
