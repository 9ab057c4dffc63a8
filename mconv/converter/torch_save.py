"""torch.save archives written in place: torch.save lays an archive out, mconv fills in its storages.

A torch.save file is a zip archive (torch's `PyTorchStreamWriter`, `caffe2/serialize/inline_container.cc`):
`<name>/data.pkl` (the pickled object; each tensor's storage is a persistent id naming a record),
a few small records (`.format_version`, `.storage_alignment`, `byteorder`, `version`,
`.data/serialization_id`), one uncompressed record `<name>/data/<key>` per storage, its bytes
aligned to 64, and the central directory. Storage keys are `0, 1, ...` in the order the pickler
first meets each storage (`torch.serialization._save`'s `persistent_id`).

Under `torch.serialization.skip_data()` torch.save writes all of that except the storages' bytes,
seeking over them (their CRC-32 fields are left 0). `plan_archive` runs it into memory (the skipped
bytes never exist) and finds each storage's record; the caller then fills every record, from any
source and window by window, and `ArchiveLayout.set_crc` patches the CRC-32 computed on the way
(the zip standard's, as torch computes it with zlib; computed here by Intel ISA-L through `isal`, the
same polynomial three to four times faster, releasing the GIL): a file that `torch.load` reads and whose every
record checks (`zipfile.ZipFile.testzip`), written without any tensor whole in memory.
"""
from __future__ import annotations

import bisect
import io
import mmap
import os
import pickle
import struct
import threading
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from isal.isal_zlib import crc32

from mconv.converter import file_io
from mconv.errors import MconvError

_EOCD = struct.Struct("<4s4H2LH")  # zip end of central directory record
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header


def members(tail: bytes, length: int, read: Callable[[int, int], bytes],
             central: dict[str, int] | None = None) -> dict[str, tuple[int, int, int]] | None:
    """name -> (local header offset, size, compression) of a zip archive of `length` bytes whose
    last bytes are `tail`, from its end records and central directory (zip64 where torch.save
    writes them); None if the archive does not end in a comment-less end record. `read(at, n)`
    gives archive-relative bytes; `central`, if given, receives name -> offset of the member's
    central directory header. Raises ValueError / struct.error on inconsistent records."""
    if len(tail) < _EOCD.size or tail[-_EOCD.size:-_EOCD.size + 4] != b"PK\x05\x06":
        return None
    _, _, _, _, count, size, offset, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if comment:
        return None
    if 0xFFFF == count or 0xFFFFFFFF in (size, offset):
        locator = read(length - _EOCD.size - _EOCD64_LOCATOR.size, _EOCD64_LOCATOR.size)
        signature, _, at, _ = _EOCD64_LOCATOR.unpack(locator)
        record = read(at, _EOCD64.size)
        if signature != b"PK\x06\x07" or record[:4] != b"PK\x06\x06":
            raise ValueError("a broken zip64 end record")
        *_, count, size, offset = _EOCD64.unpack(record)
    directory, members, at = read(offset, size), {}, 0
    for _ in range(count):
        (signature, _, _, _, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _,
         local) = _CENTRAL.unpack_from(directory, at)
        if signature != b"PK\x01\x02":
            raise ValueError("a broken central directory")
        name = directory[at + _CENTRAL.size:at + _CENTRAL.size + name_len].decode("utf-8", "replace")
        extra = directory[at + _CENTRAL.size + name_len:at + _CENTRAL.size + name_len + extra_len]
        wide = [v for v in (usize, csize, local) if v == 0xFFFFFFFF]
        while wide and len(extra) >= 4:  # the zip64 field holds, in order, the fields set to 0xFFFFFFFF
            tag, n = struct.unpack_from("<2H", extra)
            if tag == 1:
                values = list(struct.unpack_from(f"<{len(wide)}Q", extra, 4))
                usize = values.pop(0) if usize == 0xFFFFFFFF else usize
                csize = values.pop(0) if csize == 0xFFFFFFFF else csize
                local = values.pop(0) if local == 0xFFFFFFFF else local
                break
            extra = extra[4 + n:]
        if method == zipfile.ZIP_STORED and csize != usize:
            raise ValueError(f"{name} has two sizes")
        members[name] = (local, usize, method)
        if central is not None:
            central[name] = offset + at
        at += _CENTRAL.size + name_len + extra_len + comment_len
    return members


def record_start(local: int, read: Callable[[int, int], bytes]) -> int:
    """Where the data of the member whose local header is at `local` starts (archive-relative)."""
    signature, *_, name_len, extra_len = _LOCAL.unpack(read(local, _LOCAL.size))
    if signature != b"PK\x03\x04":
        raise ValueError(f"no local header at byte {local}")
    return local + _LOCAL.size + name_len + extra_len


_LOCAL_CRC, _CENTRAL_CRC = 14, 16  # byte offset of the CRC-32 field in a local / central directory header


@dataclass
class StorageRecord:
    """Where one storage's bytes go in the archive: archive offsets of its first byte and of its two
    CRC-32 fields (local header, central directory)."""

    key: str
    offset: int
    nbytes: int
    crc_at: tuple[int, int]


@dataclass
class ArchiveLayout:
    """A torch.save archive with its storages' bytes left out: `runs` are the (archive offset, bytes)
    ranges torch.save wrote, `size` the archive's length, `records` each storage's record by the
    storage (`untyped_storage()._cdata` of the tensor passed in)."""

    size: int
    runs: list[tuple[int, bytearray]]
    records: list[StorageRecord] = field(default_factory=list)  # in storage key order
    _by_storage: dict[int, int] = field(default_factory=dict)

    def record(self, tensor: torch.Tensor) -> StorageRecord:
        """The record of the storage of `tensor`, one of the tensors of the object laid out."""
        return self.records[self._by_storage[tensor.untyped_storage()._cdata]]

    def copy(self) -> "ArchiveLayout":
        """The same layout with runs of its own (CRCs are patched into them): one layout serves
        every archive of a tensor of one shape and dtype."""
        return ArchiveLayout(self.size, [(offset, bytearray(data)) for offset, data in self.runs], self.records,
                             self._by_storage)

    def set_crc(self, record: StorageRecord, crc: int) -> None:
        """Write `crc` (the storage bytes' CRC-32) into both of the record's CRC fields."""
        starts = [offset for offset, _ in self.runs]
        for at in record.crc_at:
            offset, data = self.runs[bisect.bisect_right(starts, at) - 1]
            if not offset <= at <= offset + len(data) - 4:
                raise MconvError(f"internal: the CRC-32 field of storage {record.key} is not in a written range")
            struct.pack_into("<L", data, at - offset, crc)

    def write_runs(self, fd: int, base: int) -> None:
        """pwrite every run into file `fd`, the archive starting at byte `base`."""
        for offset, data in self.runs:
            file_io.pwrite_all(fd, memoryview(data), base + offset)


class _Sink(io.RawIOBase):
    """A seekable file object that keeps what is written as runs and skips what is seeked over."""

    def __init__(self):
        self.runs: list[tuple[int, bytearray]] = []
        self.position = self.size = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.size}[whence]
        self.position = base + offset
        self.size = max(self.size, self.position)
        return self.position

    def tell(self) -> int:
        return self.position

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.runs and self.runs[-1][0] + len(self.runs[-1][1]) == self.position:
            self.runs[-1][1].extend(view)
        else:
            self.runs.append((self.position, bytearray(view)))
        self.position += len(view)
        self.size = max(self.size, self.position)
        return len(view)

    def read_at(self, at: int, n: int) -> bytes:
        """Archive bytes [at, at + n) (zeros where nothing was written)."""
        out = bytearray(n)
        for offset, data in self.runs:
            lo, hi = max(at, offset), min(at + n, offset + len(data))
            if lo < hi:
                out[lo - at:hi - at] = data[lo - offset:hi - offset]
        return bytes(out)


def _storage_order(obj) -> list[int]:
    """The storages of `obj`'s tensors (by `_cdata`) in the order torch.save's pickler first meets
    them, which is the order of their keys: the pickle is walked as torch.save walks it."""
    order: dict[int, None] = {}

    class Walker(pickle.Pickler):
        def persistent_id(self, value):
            if isinstance(value, torch.storage.TypedStorage):
                value = value._untyped_storage
            if torch.is_storage(value):
                order.setdefault(value._cdata, None)
                return str(len(order))
            return None

    Walker(io.BytesIO(), protocol=2).dump(obj)  # torch.save's DEFAULT_PROTOCOL
    return list(order)


def save(obj, sink: io.RawIOBase) -> None:
    """torch.save `obj` into the in-memory file `sink`. torch's C++ writer reports anything raised in
    the sink's `write` (an interrupt: Ctrl-C, or SIGTERM as KeyboardInterrupt) as a RuntimeError
    ("unexpected pos"), which would read as a full disk: the sink's own exception is raised instead."""
    raised: list[BaseException] = []
    write = sink.write

    def recording(data):
        try:
            return write(data)
        except BaseException as e:
            raised.append(e)
            raise
    sink.write = recording
    try:
        torch.save(obj, sink)
    except RuntimeError:
        if raised:
            raise raised[0] from None
        raise
    finally:
        del sink.write


def plan_archive(obj) -> ArchiveLayout:
    """The archive torch.save writes for `obj`, its storages' bytes left out. `obj`'s tensors stand
    for the storages to be filled: they may be `torch.empty` (untouched memory is never read), each
    with a storage of its own, contiguous, on the CPU. Raises MconvError (internal) if the archive
    is not laid out as expected."""
    sink = _Sink()
    with torch.serialization.skip_data():
        save(obj, sink)
    layout = ArchiveLayout(sink.size, sink.runs)
    central: dict[str, int] = {}
    tail = sink.read_at(max(0, sink.size - 4096), min(sink.size, 4096))
    found = members(tail, sink.size, sink.read_at, central)
    if found is None:
        raise MconvError("internal: torch.save wrote an archive without a plain end record")
    records = {name.rsplit("/data/", 1)[1]: name for name in found if "/data/" in name}
    order = _storage_order(obj)
    if len(order) != len(records):
        raise MconvError(f"internal: {len(order)} storages but {len(records)} storage records in the archive")
    for key, cdata in enumerate(order):
        name = records[str(key)]
        local, nbytes, _ = found[name]
        layout._by_storage[cdata] = key
        layout.records.append(StorageRecord(str(key), record_start(local, sink.read_at), nbytes,
                                            (local + _LOCAL_CRC, central[name] + _CENTRAL_CRC)))
    return layout


@dataclass(frozen=True)
class FileRange:
    """Bytes [offset, offset + nbytes) of the open file `fd` (an input), as a window for `fill`:
    copied file to file in the kernel, not through user memory."""

    fd: int
    offset: int
    nbytes: int
    path: str  # for messages


_local = threading.local()  # each thread's buffer for inputs the kernel will not copy from


def _copy(source: FileRange, fd: int, at: int, crc: int) -> int:
    """Copy `source` to byte `at` of `fd` and return the CRC-32 continued over its bytes: copied file
    to file (`file_io.copy_range`), the CRC read through a populated read-only mapping of the
    input's page cache (no page faults, no copy); where the kernel cannot copy between the two file
    systems, read into a reused buffer (the CRC taken there) and pwritten."""
    done = 0
    while done < source.nbytes:
        n = min(file_io.COPY_CALL_BYTES, source.nbytes - done)
        start = source.offset + done
        if os.fstat(source.fd).st_size < start + n:  # a mapping past the end would kill the process (SIGBUS)
            raise MconvError(f"{source.path} ended early (changed while reading?)")
        copied = file_io.copy_range(source.fd, start, fd, at + done, n)
        checked = _mapped_crc(source.fd, start, n, crc) if copied else None
        if checked is None:  # not copied, or a file system that cannot map it: through memory
            if len(getattr(_local, "buffer", b"")) < n:
                _local.buffer = bytearray(file_io.COPY_CALL_BYTES)
            view = memoryview(_local.buffer)[:n]
            file_io.pread_into([(source.fd, start, 0, n)], view, source.path)
            checked = crc32(view, crc)
            if not copied:
                file_io.pwrite_all(fd, view, at + done)
        crc = checked
        done += n
    return crc


def _mapped_crc(fd: int, start: int, n: int, crc: int) -> int | None:
    """The CRC-32 of bytes [start, start + n) of `fd`, continued from `crc`, read through a populated
    read-only mapping; None where the file cannot be mapped (some FUSE file systems, no memory)."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(fd, start + n - base, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ,
                           offset=base)
    except OSError:
        return None
    with mapped, memoryview(mapped) as view:
        return crc32(view[start - base:], crc)


def fill(fd: int, base: int, layout: ArchiveLayout, record: StorageRecord,
         windows: Iterable[torch.Tensor | FileRange], dtype: torch.dtype | None = None) -> None:
    """Write a storage's bytes, given as consecutive `windows` (contiguous CPU tensors, of `dtype` if
    given, each used before the next is asked for, or ranges of input files), into its record of the
    archive at byte `base` of file `fd`, and set its CRC-32. Raises MconvError (internal) if the
    windows do not add up to the record or are of another dtype."""
    crc, at = 0, base + record.offset
    for window in windows:
        if isinstance(window, FileRange):
            crc = _copy(window, fd, at, crc)
            at += window.nbytes
            continue
        if dtype is not None and window.dtype != dtype:
            raise MconvError(f"internal: storage {record.key} of {dtype} was given {window.dtype} bytes")
        view = memoryview(window.reshape(-1).view(torch.uint8).numpy()) if window.numel() else memoryview(b"")
        crc = crc32(view, crc)
        file_io.pwrite_all(fd, view, at)
        at += len(view)
    if at - base - record.offset != record.nbytes:
        raise MconvError(f"internal: storage {record.key} was given {at - base - record.offset} bytes, "
                         f"its record holds {record.nbytes}")
    layout.set_crc(record, crc)
