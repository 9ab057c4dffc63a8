"""The torch_dist file format, written (see `torch_dist_io` for what is on disk): each chunk laid out
as torch.save does (the archive format DCP's reader expects; `torch_save`), planned once per shape
and dtype, its tensor bytes filled window by window from reused memory, with one fsync per file;
each member of a team writes its own `__{member}_0.distcp`, and one `.metadata` is written at the
end (pickled from mconv's stand-ins of DCP's classes, `dcp_stand_in`: torch.distributed.checkpoint
is not imported).
"""
from __future__ import annotations

import functools
import io
import json
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mconv.converter import dcp_stand_in, file_io, torch_save
from mconv.converter.dcp_stand_in import metadata as dcp
from mconv.converter.dcp_stand_in.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from mconv.converter.parallel import share
from mconv.converter.torch_dist_io import COMMON_FILE, METADATA_FILE
from mconv.errors import MconvError

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}

@dataclass
class DistEntry:
    """One box of a global tensor a torch_dist checkpoint will hold (or one object).

    `produce()` gives the box's bytes (`sizes`, `dtype`, C order) when the writer gets to it: a
    tensor, or consecutive windows of them (tensors, each used before the next is asked for, so a
    window of reused memory at a time, or `torch_save.FileRange`s of input files); `offsets` defaults to zeros and `sizes` to `global_shape`
    (the whole tensor). An object entry has `global_shape=None`, `key` its unique key
    (`key/shard_0_1`), and `produce()` returns the object (a restricted-unpickler type: tensors,
    dicts, Namespace...). Entries with the same `group` are written by the same team member, in
    order (e.g. two halves of one parameter).
    """

    key: str
    global_shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    produce: Callable[[], Any]
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None
    group: str | None = None

    def __post_init__(self):
        if self.global_shape is not None:
            self.global_shape = tuple(self.global_shape)
            self.offsets = tuple(self.offsets) if self.offsets is not None else (0,) * len(self.global_shape)
            self.sizes = tuple(self.sizes) if self.sizes is not None else self.global_shape

    @property
    def nbytes(self) -> int:
        return 0 if self.global_shape is None else self.dtype.itemsize * torch.Size(self.sizes).numel()


@functools.lru_cache(maxsize=256)
def _chunk_layout(dtype: torch.dtype, sizes: tuple[int, ...]) -> torch_save.ArchiveLayout:
    """How torch.save lays out the archive of one tensor of `sizes` and `dtype` (the same for every
    chunk of that shape: planned once, copied per chunk)."""
    return torch_save.plan_archive(torch.empty(sizes, dtype=dtype))


def _write_entry(fd: int, position: int, entry: DistEntry) -> int:
    """Write `entry` as the torch.save archive DCP's reader expects at byte `position` of `fd`
    (a tensor: laid out by torch.save, its bytes filled window by window, CRC-32 set); returns its length."""
    value = entry.produce()
    if entry.global_shape is None:
        archive = io.BytesIO()
        torch_save.save([value], archive)
        file_io.pwrite_all(fd, archive.getbuffer(), position)
        return archive.tell()
    layout = _chunk_layout(entry.dtype, entry.sizes).copy()
    windows = [value] if isinstance(value, torch.Tensor) else value
    torch_save.fill(fd, position, layout, layout.records[0],
                    (w.detach().cpu().contiguous() if isinstance(w, torch.Tensor) else w for w in windows), entry.dtype)
    layout.write_runs(fd, position)
    return layout.size


def data_file(member: int) -> str:
    return f"__{member}_0.distcp"


def _part_file(member: int) -> str:
    return f".mconv-part-{member}.json"


def member_share(entries: Sequence[DistEntry], member: int, members: int) -> list[int]:
    """Indices of the entries team member `member` of `members` writes (whole groups, balanced by bytes)."""
    groups: dict[str, list[int]] = {}
    for i, entry in enumerate(entries):
        groups.setdefault(entry.group or entry.key, []).append(i)
    runs = list(groups.values())
    mine = share([sum(entries[i].nbytes for i in run) + 1 for run in runs], member, members)
    return sorted(i for r in mine for i in runs[r])


def write_share(iter_dir: Path, entries: Sequence[DistEntry], member: int, members: int,
                progress: Callable[[int], None] = lambda n: None, stop: threading.Event | None = None) -> None:
    """Write team member `member`'s share of `entries` into `__{member}_0.distcp` (one fsync), and
    where each landed into a part file `finish` reads. Once `stop` is set it returns at the next
    entry, leaving its file incomplete (the caller discards the output)."""
    path = iter_dir / data_file(member)
    records, position = [], 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        for i in member_share(entries, member, members):
            if stop is not None and stop.is_set():
                return
            entry = entries[i]
            size = _write_entry(fd, position, entry)
            records.append([entry.key, list(entry.offsets) if entry.global_shape is not None else None,
                            position, size])
            position += size
            progress(entry.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    (iter_dir / _part_file(member)).write_text(json.dumps(records))


def dcp_metadata(entries: Sequence[DistEntry], placed: Sequence[tuple[str, tuple[int, ...] | None, str, int, int]],
                 checkpoint_id: str, save_id: str) -> dcp.Metadata:
    """DCP's `Metadata` of a checkpoint of `entries`, each stored where `placed` says (key, offsets or
    None for an object, file, byte offset, length), as torch's `FileSystemWriter.finish` completes it
    (`storage_data`, `storage_meta`, `version`). Chunks are listed by offsets; each key and each file
    name is one string wherever it occurs (as in DCP's own writer), so the pickle refers to it."""
    state: dict[str, dcp.TensorStorageMetadata | dcp.BytesStorageMetadata] = {}
    for entry in entries:
        if entry.global_shape is None:
            state[entry.key] = dcp.BytesStorageMetadata()
        elif entry.key not in state:
            state[entry.key] = dcp.TensorStorageMetadata(dcp.TensorProperties(dtype=entry.dtype),
                                                         torch.Size(entry.global_shape), [])
        elif tuple(state[entry.key].size) != entry.global_shape or state[entry.key].properties.dtype != entry.dtype:
            raise MconvError(f"internal: tensor {entry.key} is given two global shapes or dtypes")
    keys, files = {key: key for key in state}, {}
    sizes = {(e.key, e.offsets): e.sizes for e in entries if e.global_shape is not None}
    storage, chunks = {}, {}
    for key, offsets, file, offset, length in placed:
        storage[dcp.MetadataIndex(keys[key], offsets)] = _StorageInfo(files.setdefault(file, file), offset, length)
        if offsets is not None:
            chunks.setdefault(key, []).append(offsets)
    for key, entry in state.items():
        if isinstance(entry, dcp.TensorStorageMetadata):
            entry.chunks = [dcp.ChunkStorageMetadata(torch.Size(o), torch.Size(sizes[(key, o)]))
                            for o in sorted(chunks.get(key, []))]
    return dcp.Metadata(state, storage_data=storage, storage_meta=dcp.StorageMeta(checkpoint_id, save_id),
                        version=CURRENT_DCP_VERSION)


def finish(iter_dir: Path, entries: Sequence[DistEntry], members: int, common_pt: Any = None,
           checkpoint_id: str | None = None) -> None:
    """After every member's `write_share`: write DCP's `.metadata` (one for all members; a fresh
    uuid4 as its `save_id`, as DCP's writer draws one; `checkpoint_id` the directory's final path,
    which DCP's writer records, by default `iter_dir`), `common.pt` (if given: the common state as
    megatron-core <= 0.18 reads it) and `metadata.json`."""
    placed = []
    for member in range(members):
        part, name = iter_dir / _part_file(member), data_file(member)
        placed += [(key, None if offsets is None else tuple(offsets), name, offset, length)
                   for key, offsets, offset, length in json.loads(part.read_text())]
        part.unlink()
    metadata = dcp_metadata(entries, placed, checkpoint_id or str(iter_dir), str(uuid.uuid4()))
    if common_pt is not None:
        _write_file(iter_dir / COMMON_FILE, lambda f: torch.save(common_pt, f))
    _write_file(iter_dir / METADATA_FILE, lambda f: f.write(dcp_stand_in.dumps(metadata)))
    _write_file(iter_dir / "metadata.json", lambda f: f.write(json.dumps(BACKEND).encode()))


def _write_file(path: Path, write: Callable[[io.BufferedWriter], Any]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write(iter_dir: Path, entries: Sequence[DistEntry], workers: int = 1, common_pt: Any = None,
          progress: Callable[[int], None] = lambda n: None, checkpoint_id: str | None = None) -> None:
    """Write a whole torch_dist checkpoint into `iter_dir` from `entries`, `workers` threads each
    writing its own `.distcp` file (pread, torch.save and the writes release the GIL)."""
    iter_dir.mkdir(parents=True, exist_ok=True)
    if workers <= 1:
        write_share(iter_dir, entries, 0, 1, progress)
    else:
        from concurrent.futures import ThreadPoolExecutor

        stop = threading.Event()  # set on an error or an interrupt: the other writers stop at their next entry
        with ThreadPoolExecutor(workers) as pool:
            try:
                for future in [pool.submit(write_share, iter_dir, entries, m, workers, progress, stop)
                               for m in range(workers)]:
                    future.result()
            except BaseException:
                stop.set()
                raise
    finish(iter_dir, entries, max(workers, 1), common_pt, checkpoint_id)
