"""The torch_dist file format (torch.distributed.checkpoint as megatron-core uses it), read: boxes of
global tensors by key, independent of any model, without megatron-core.

On disk (torch 2.x `FileSystemWriter`, which megatron-core's `dist_checkpointing.save` drives):
`.metadata` is a pickle of DCP's `Metadata` (global key -> global shape, dtype and the chunks
stored, each chunk -> file, byte offset, length); every chunk is a torch.save archive of one
tensor (a zip: `data.pkl`, then the storage bytes stored uncompressed); objects (megatron-core's
ShardedObjects: `_extra_state`, `common_state`) are torch.save archives of `[object]` stored as
bytes under their unique key (`key/shard_{offsets}_{shape}`); `metadata.json` names the backend.

Reading parses `.metadata` once per reader, through mconv's restricted unpickler, and indexes each
key's stored chunks once (dcp_metadata); a read of many boxes finds the overlapping chunks, decodes each chunk's
archive header (a small restricted unpickle) and reads the storage bytes straight into the
destination, requests sorted by file and offset and merged into large `preadv` calls. The writer
is `torch_dist_write`.
"""
from __future__ import annotations

import argparse
import bisect
import io
import os
import struct
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from mconv.converter import file_io, safe_load, torch_save
from mconv.converter.dcp_metadata import StoredChunk, StoredTensor, index_metadata
from mconv.converter.saved_args import described, saved_args
from mconv.errors import MconvError

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"  # megatron-core <= 0.18 keeps the common state here (0.19 reads it first)
COMMON_KEY = "common_state/shard_0_1"  # megatron-core 0.19's ShardedObject("common_state", ...).unique_key
MERGE_GAP_BYTES = 64 * 2**10  # reads closer than this are merged into one request
metadata_reads = 0  # `.metadata` files this process parsed (tests count them)


@dataclass(frozen=True)
class _ChunkData:
    """Where a chunk's storage bytes are and how its tensor views them (from its archive header)."""

    start: int  # file offset of the storage bytes
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_bytes: int

    @property
    def dense(self) -> bool:
        expected, step = [], 1
        for s in reversed(self.size):
            expected.insert(0, step)
            step *= s
        return self.storage_offset == 0 and (tuple(expected) == self.stride or step <= 1)


class _Window(io.RawIOBase):
    """A read-only file object over bytes [offset, offset+length) of an open file (zipfile reads a
    chunk archive of unusual layout through it)."""

    def __init__(self, fd: int, offset: int, length: int):
        self.fd, self.base, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        n = os.preadv(self.fd, [memoryview(buffer)[:n]], self.base + self.pos)
        self.pos += n
        return n


def stored_records(length: int, read: Callable[[int, int], bytes]) -> list[tuple[int, int, str]] | None:
    """(data offset, size, name) of each uncompressed member of a zip archive of `length` bytes, by
    offset, from its own records (`torch_save.members`, `torch_save.record_start`; `read(at, n)` gives its bytes); None
    if it is not laid out as torch.save writes. Raises ValueError / struct.error on records that
    are inconsistent or point outside it."""
    def checked(at: int, n: int) -> bytes:
        data = read(at, n) if 0 <= at and n >= 0 and at + n <= length else b""
        if len(data) != n:
            raise ValueError(f"a record points past the archive (byte {at})")
        return data

    tail = min(length, 4096)
    members = torch_save.members(checked(length - tail, tail), length, checked)
    if members is None:
        return None
    records = sorted((torch_save.record_start(local, checked), size, name) for name, (local, size, method) in members.items()
                     if method == zipfile.ZIP_STORED)
    if any(start + size > length for start, size, _ in records):
        raise ValueError("a record runs past the archive")
    return records


class _ChunkIndex:
    """The stored chunks of one tensor, indexed dimension by dimension (sorted starts, bisect), so
    finding the chunks a box overlaps costs about log(chunks), not one test per chunk: stacked keys
    hold one chunk per layer (and expert, and GLU half)."""

    def __init__(self, chunks: Sequence[StoredChunk], dim: int = 0):
        self.dim = dim
        groups: dict[int, list[StoredChunk]] = {}
        for chunk in chunks:
            groups.setdefault(chunk.offsets[dim] if chunk.offsets else 0, []).append(chunk)
        self.starts = sorted(groups)
        self.longest = max((c.sizes[dim] for c in chunks if c.sizes), default=1)
        last = not chunks or dim + 1 >= len(chunks[0].offsets)
        self.groups = {start: (group if last else _ChunkIndex(group, dim + 1)) for start, group in groups.items()}

    def find(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[StoredChunk]:
        if not offsets:
            yield from (c for group in self.groups.values() for c in group)
            return
        lo = bisect.bisect_left(self.starts, offsets[self.dim] - self.longest + 1)
        hi = bisect.bisect_left(self.starts, offsets[self.dim] + sizes[self.dim])
        for start in self.starts[lo:hi]:
            group = self.groups[start]
            if isinstance(group, _ChunkIndex):
                yield from group.find(offsets, sizes)
            else:
                yield from group


def _box_overlap(a_off, a_size, b_off, b_size) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    starts = tuple(max(x, y) for x, y in zip(a_off, b_off))
    stops = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size))
    if any(b <= a for a, b in zip(starts, stops)):
        return None
    return starts, tuple(b - a for a, b in zip(starts, stops))


def _narrow(tensor: torch.Tensor, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(starts, sizes)):
        if start != 0 or size != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, size)
    return tensor


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(bytearray())


class TorchDistReader:
    """Reads boxes of the global tensors of a torch_dist checkpoint directory by key.

    `tensors` maps each key to its global shape, dtype and stored chunks; `objects` each object's
    unique key to its chunk; `common` is megatron-core's common state dict (from `common.pt` when
    present, as megatron-core reads it, else the `common_state` object; None if neither) and `args`
    its Megatron-LM args Namespace (None if absent), both checked to be what they say (`saved_args`).
    Every pickle goes through `safe_load`. Errors: MconvError naming the file. Concurrent `read`
    calls from threads are safe (chunk decoding is idempotent).
    """

    def __init__(self, iter_dir: str | Path):
        global metadata_reads
        self._fds: dict[str, int] = {}  # first: __del__ closes them
        self._open_lock = threading.Lock()
        self.iter_dir = Path(iter_dir)
        path = self.iter_dir / METADATA_FILE
        if not path.is_file():
            raise MconvError(f"{path} is missing: {self.iter_dir} is not a complete torch_dist checkpoint")
        metadata_reads += 1
        metadata = safe_load.load_pickle(path)
        try:
            self.tensors, self.objects = index_metadata(path, metadata)
        except (TypeError, AttributeError, ValueError, IndexError) as e:  # fields of the wrong type
            raise MconvError(f"{path}: not a torch.distributed.checkpoint metadata file mconv can read "
                             f"({type(e).__name__}: {e})") from None
        self._check_extents()
        self._decoded: dict[StoredChunk, _ChunkData] = {}
        self._headers: dict[bytes, tuple] = {}  # data.pkl bytes -> (dtype, size, stride, storage offset, record)
        self._indexes: dict[str, _ChunkIndex] = {}  # built on a key's first read
        self.common, self.args = self._common_state()

    def _check_extents(self) -> None:
        """Every stored chunk lies inside its file, so a truncated or missing `.distcp` is reported
        when the checkpoint is opened (by `inspect` too, which reads no chunk), naming the file and
        the first key stored past its end; one stat per file."""
        sizes: dict[str, int] = {}
        stored = [(key, chunk) for key, info in self.tensors.items() for chunk in info.chunks]
        for key, chunk in sorted(stored + list(self.objects.items()), key=lambda kc: (kc[1].file, kc[1].offset)):
            if chunk.file not in sizes:
                path = self.iter_dir / chunk.file
                if not path.is_file():  # a directory would fail later without a name; a FIFO would block
                    raise MconvError(f"{path} {_not_a_file(path)}, but .metadata stores {key} in it")
                sizes[chunk.file] = path.stat().st_size
            if chunk.offset + chunk.length > sizes[chunk.file]:
                raise MconvError(f"{self.iter_dir / chunk.file} is truncated: it ends at byte {sizes[chunk.file]:,}, but "
                                 f".metadata stores {key} at bytes {chunk.offset:,}-{chunk.offset + chunk.length:,}; "
                                 "the checkpoint is damaged")

    _opened: dict[tuple, "TorchDistReader"] = {}
    _opened_lock = threading.Lock()

    @classmethod
    def open(cls, iter_dir: str | Path) -> "TorchDistReader":
        """The process's reader of `iter_dir`: `.metadata` is parsed once per process, however many
        callers (inspect, the export session, worker threads) read the checkpoint; a changed
        `.metadata` (another mtime, size or inode) is parsed again. The reader is shared: its callers
        never close it (its descriptors, which `file_ranges` hands out, close with its last user)."""
        path = Path(iter_dir).resolve() / METADATA_FILE
        try:
            stat = path.stat()
            key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except OSError:
            return cls(iter_dir)  # raises, naming the missing file
        with cls._opened_lock:
            reader = cls._opened.get(key)
        if reader is None:
            reader = cls(iter_dir)  # (parsed outside the lock: another checkpoint's callers need not wait)
            with cls._opened_lock:
                reader = cls._opened.setdefault(key, reader)
                while len(cls._opened) > 4:  # a long-lived process (a trainer) reads many checkpoints: keep a few
                    cls._opened.pop(next(iter(cls._opened)))  # (not closed: a caller may still be reading it)
        return reader

    def _common_state(self) -> tuple[dict | None, argparse.Namespace | None]:
        """megatron-core's common state dict and the training arguments in it; (None, None) where
        neither `common.pt` nor the `common_state` object is stored. Checked here, where they are
        read: the restricted unpickler lets through any shape of allowed objects."""
        path = self.iter_dir / COMMON_FILE
        if path.is_file():
            common, where = safe_load.load_torch(path), str(path)
        elif COMMON_KEY in self.objects:
            common = self.read_object(COMMON_KEY)
            where = f"{self.iter_dir / self.objects[COMMON_KEY].file} ({COMMON_KEY})"
        else:
            return None, None
        if not isinstance(common, dict):
            raise MconvError(f"{where} holds {described(common)}, not megatron-core's common state (a dict)")
        return common, saved_args(common, where)

    def read_object(self, key: str) -> Any:
        """An object (megatron-core ShardedObject) by its unique key, through the restricted unpickler."""
        chunk = self.objects[key]
        data = bytearray(chunk.length)
        self._pread(chunk.file, memoryview(data), chunk.offset)
        value = safe_load.load_torch(self.iter_dir / chunk.file, io.BytesIO(data))
        if not isinstance(value, list) or len(value) != 1:
            raise MconvError(f"{self.iter_dir / chunk.file}: object {key} is not stored as megatron-core stores one")
        return value[0]

    def global_shape(self, key: str) -> tuple[int, ...] | None:
        entry = self.tensors.get(key)
        return None if entry is None else entry.shape

    def read_box(self, key: str, offsets: Sequence[int] | None = None, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """The box [offsets, offsets+sizes) of global tensor `key` (the whole tensor by default)."""
        info = self._tensor(key)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(info.shape)
        out = torch.empty(tuple(sizes) if sizes is not None else info.shape, dtype=info.dtype)
        self.read([(key, offsets, out)])
        return out

    def read(self, requests: Sequence[tuple[str, Sequence[int], torch.Tensor]]) -> None:
        """Fill each destination tensor (any strides, the stored dtype) with the box of global tensor
        `key` at `offsets` of the destination's shape. All stored chunks overlapping the boxes are
        read with requests sorted by file and offset, adjacent ones merged."""
        reads: list[tuple[str, int, memoryview]] = []
        copies: list[Callable[[], None]] = []
        for key, offsets, dest in requests:
            for info, chunk, starts, lengths, target in self._overlaps(key, offsets, dest):
                self._plan_read(info, chunk, starts, lengths, target, reads, copies)
        self._read_merged(reads)
        for copy in copies:
            copy()

    def file_ranges(self, key: str, offsets: Sequence[int],
                    dest: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
        """Where the box that `read` would put into `dest` (contiguous) is stored, as (file
        descriptor, file offset, byte offset in `dest`, bytes) ranges that together cover `dest`, if
        each overlapping chunk holds its part as contiguous bytes that are also contiguous in
        `dest`; None otherwise (then `read` it). Same errors as `read`."""
        if not dest.is_contiguous():
            return None
        ranges = []
        for info, chunk, starts, lengths, target in self._overlaps(key, offsets, dest):
            at = self._contiguous_at(info, chunk, starts, lengths)
            if at is None or not target.is_contiguous():
                return None
            ranges.append((self._fd(chunk.file), at, target.data_ptr() - dest.data_ptr(), target.nbytes))
        return ranges

    def _overlaps(self, key: str, offsets: Sequence[int], dest: torch.Tensor) -> list[tuple]:
        """(stored tensor, chunk, box start within the chunk, box lengths, the part of `dest` it
        fills) for each stored chunk the box of `dest`'s shape at `offsets` overlaps; MconvError if
        there is no such box or the chunks do not cover it."""
        info = self._tensor(key)
        offsets, sizes = tuple(offsets), tuple(dest.shape)
        if dest.dtype != info.dtype or len(offsets) != len(info.shape) or any(
                o < 0 or o + s > g for o, s, g in zip(offsets, sizes, info.shape)):
            raise MconvError(f"{self.iter_dir}: tensor {key} ({info.dtype}, {list(info.shape)}) has no box "
                             f"{list(sizes)} {dest.dtype} at {list(offsets)}")
        if key not in self._indexes:
            self._indexes[key] = _ChunkIndex(info.chunks)
        found, covered, boxes = [], 0, []
        for chunk in self._indexes[key].find(offsets, sizes):
            overlap = _box_overlap(chunk.offsets, chunk.sizes, offsets, sizes)
            if overlap is None:
                continue
            starts, lengths = overlap
            # (chunks that overlap each other, a .metadata listing one twice, would count some elements
            # twice and leave others unwritten: the sum says they cover the box only where they are disjoint)
            clash = next((c for c, box in boxes if _box_overlap(*box, starts, lengths)), None)
            if clash is not None:
                raise MconvError(f"{self.iter_dir}: the stored chunks of {key} at {list(clash.offsets)} and "
                                 f"{list(chunk.offsets)} overlap; a checkpoint stores each element once")
            boxes.append((chunk, (starts, lengths)))
            covered += torch.Size(lengths).numel()
            target = _narrow(dest, [s - o for s, o in zip(starts, offsets)], lengths)
            found.append((info, chunk, [s - o for s, o in zip(starts, chunk.offsets)], lengths, target))
        if covered != dest.numel():
            raise MconvError(f"{self.iter_dir}: the stored chunks of {key} do not cover the box "
                             f"{list(sizes)} at {list(offsets)}")
        return found

    def _tensor(self, key: str) -> StoredTensor:
        info = self.tensors.get(key)
        if info is None:
            raise MconvError(f"{self.iter_dir}: tensor {key} is missing from the checkpoint")
        return info

    def _contiguous_at(self, info: StoredTensor, chunk: StoredChunk, starts: list[int],
                       lengths: tuple[int, ...]) -> int | None:
        """The file offset of the box (`starts`, `lengths` within the chunk) if it is contiguous bytes
        of a dense chunk: past its last partial axis every axis is whole and, before it, every axis
        has length 1 (a range of rows of one layer and expert); None otherwise."""
        data = self._decode(info, chunk)
        partial = max((i for i, (n, c) in enumerate(zip(lengths, chunk.sizes)) if n != c), default=0)
        if not (data.dense and lengths and all(n == 1 for n in lengths[:partial])):
            return None
        at, step = data.start, info.dtype.itemsize
        for axis in reversed(range(len(lengths))):
            at += starts[axis] * step
            step *= chunk.sizes[axis]
        return at

    def _plan_read(self, info: StoredTensor, chunk: StoredChunk, starts: list[int], lengths: tuple[int, ...],
                   target: torch.Tensor, reads: list, copies: list) -> None:
        """Plan the read of one chunk's part of a box into `target`: straight into it where the part is
        contiguous bytes of the chunk (through a staged copy if `target` is strided), else the whole
        storage record, copied out."""
        at = self._contiguous_at(info, chunk, starts, lengths)
        if at is not None:
            if target.is_contiguous():
                reads.append((chunk.file, at, _bytes_view(target)))
                return
            staged = torch.empty(lengths, dtype=info.dtype)
            reads.append((chunk.file, at, _bytes_view(staged)))
            copies.append(lambda: target.copy_(staged))
            return
        data = self._decode(info, chunk)
        storage = torch.empty(data.storage_bytes, dtype=torch.uint8)
        reads.append((chunk.file, data.start, _bytes_view(storage)))
        copies.append(lambda: target.copy_(_narrow(storage.view(info.dtype).as_strided(
            data.size, data.stride, data.storage_offset), starts, lengths)))

    def _decode(self, info: StoredTensor, chunk: StoredChunk) -> _ChunkData:
        """Parse a chunk's torch.save archive: the header pickle (restricted) and the storage record.
        The zip's end records and central directory are parsed with `struct` (`torch_save.members`); an
        archive laid out otherwise (a comment, ...) goes through `zipfile`, which also names what is
        wrong with a broken one. Header pickles are decoded once per distinct pickle (chunks of one
        shape and dtype share it)."""
        found = self._decoded.get(chunk)
        if found is not None:
            return found
        path = self.iter_dir / chunk.file
        head = bytearray(min(chunk.length, 4096))
        self._pread(chunk.file, memoryview(head), chunk.offset)
        tail = bytearray(min(chunk.length, 4096))
        self._pread(chunk.file, memoryview(tail), chunk.offset + chunk.length - len(tail))

        def read(at: int, n: int) -> bytes:  # archive-relative bytes, from head/tail when they hold them
            if at < 0 or n < 0 or at + n > chunk.length:
                raise ValueError(f"a record points past the archive (byte {at})")
            if at + n <= len(head):
                return bytes(head[at:at + n])
            if at >= chunk.length - len(tail):
                return bytes(tail[at - (chunk.length - len(tail)):][:n])
            out = bytearray(n)
            self._pread(chunk.file, memoryview(out), chunk.offset + at)
            return bytes(out)

        try:
            try:
                members = torch_save.members(bytes(tail), chunk.length, read)
                if members is None:
                    raise zipfile.BadZipFile("not laid out as torch.save writes")
                pickle_name = next((n for n in members if n.endswith("/data.pkl")), None)
                if pickle_name is None:
                    raise ValueError("no data.pkl")
                at, size, method = members[pickle_name]
                pickled = read(torch_save.record_start(at, read), size)
                if method != zipfile.ZIP_STORED:
                    raise zipfile.BadZipFile("data.pkl is compressed")
            except (ValueError, KeyError, struct.error, zipfile.BadZipFile):
                members, pickle_name, pickled = self._zip_members(chunk)
            if pickled not in self._headers:
                tensor, record = safe_load.load_tensor_header(path, pickled)
                self._headers[pickled] = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                                          tensor.storage_offset(), record)
            dtype, size, stride, offset, record = self._headers[pickled]
            at, file_size, method = members[f"{pickle_name[:-len('data.pkl')]}data/{record}"]
            if method != zipfile.ZIP_STORED:
                raise ValueError("the storage record is not stored uncompressed")
            start = chunk.offset + torch_save.record_start(at, read)
        except MconvError:
            raise
        except (ValueError, KeyError, zipfile.BadZipFile, OSError, StopIteration, struct.error) as e:
            raise MconvError(f"{path}: the stored chunk of {info.key} at byte {chunk.offset} is not a readable "
                             f"tensor archive ({e})") from None
        data = _ChunkData(start, size, stride, offset, file_size)
        extent = data.storage_offset + sum((s - 1) * st for s, st in zip(data.size, data.stride)) + 1
        if (dtype != info.dtype or data.size != chunk.sizes or file_size < extent * info.dtype.itemsize
                or start + file_size > chunk.offset + chunk.length):
            raise MconvError(f"{path}: the stored chunk of {info.key} at byte {chunk.offset} holds a {dtype} "
                             f"{list(size)} tensor, the metadata says {info.dtype} {list(chunk.sizes)}")
        self._decoded[chunk] = data
        return data

    def _zip_members(self, chunk: StoredChunk) -> tuple[dict[str, tuple[int, int, int]], str, bytes]:
        """`torch_save.members` and data.pkl's bytes through `zipfile` (any zip layout; its errors name the fault)."""
        window = _Window(self._fd(chunk.file), chunk.offset, chunk.length)
        with zipfile.ZipFile(io.BufferedReader(window, 4096)) as archive:
            names = archive.namelist()
            pickle_name = next((n for n in names if n.endswith("/data.pkl")), None)
            if pickle_name is None:
                raise ValueError("no data.pkl")
            members = {i.filename: (i.header_offset, i.file_size, i.compress_type) for i in archive.infolist()}
            return members, pickle_name, archive.read(pickle_name)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        with self._open_lock:  # reader threads: one descriptor per file, none left unclosed
            if name not in self._fds:
                path = self.iter_dir / name
                if not path.is_file():  # a directory would fail later without a name; a FIFO would block
                    raise MconvError(f"{path} {_not_a_file(path)}, but .metadata stores tensors in it")
                try:
                    self._fds[name] = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise MconvError(f"{path}: cannot be read ({e.strerror})") from None
            return self._fds[name]

    def _pread(self, name: str, buffer: memoryview, offset: int) -> None:
        file_io.pread_all(self._fd(name), buffer, offset, lambda: f"{self.iter_dir / name} ends before byte "
                                                                  f"{offset + len(buffer)} that .metadata points at "
                                                                  "(truncated?)")

    def _read_merged(self, reads: list[tuple[str, int, memoryview]]) -> None:
        """One preadv per run of requests in the same file no further apart than MERGE_GAP_BYTES."""
        reads.sort(key=lambda r: (r[0], r[1]))
        i = 0
        while i < len(reads):
            name, start, first = reads[i]
            buffers, end, j = [first], start + len(first), i + 1
            while (j < len(reads) and reads[j][0] == name and 0 <= reads[j][1] - end <= MERGE_GAP_BYTES
                   and len(buffers) < 1000):
                if reads[j][1] > end:
                    buffers.append(memoryview(bytearray(reads[j][1] - end)))
                buffers.append(reads[j][2])
                end = reads[j][1] + len(reads[j][2])
                j += 1
            fd = self._fd(name)
            n = os.preadv(fd, buffers, start) if len(buffers) > 1 else 0
            if n != end - start:  # a short read (or a single buffer): finish buffer by buffer
                at = start
                for buffer in buffers:
                    if n < len(buffer):
                        self._pread(name, buffer[max(n, 0):], at + max(n, 0))
                    n -= len(buffer)
                    at += len(buffer)
            i = j

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        self.close()


def _not_a_file(path: Path) -> str:
    """Why `path`, a data file .metadata names, cannot be read: it is missing, or no regular file."""
    return "is not a regular file" if os.path.lexists(path) else "is missing"
