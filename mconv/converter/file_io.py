"""Moving bytes between open files: whole-buffer pread / pwrite and file-to-file copies in the kernel.

In-kernel copies (os.copy_file_range) are the default on machines of fewer than 4 CPUs and off on
larger ones; MCONV_COPY_FILE_RANGE=1 or 0 chooses. Measured on 2026-12-01 (README, Benchmarks):
on the 2-core VM (one worker thread by default) they were faster for every command in 6 of 6
back-to-back pairs, and on the 16-core H200 host (4 worker threads) pread/pwrite through reused
memory was faster for every command (bench/results-convert-h200.log, run 3).

Every write of at least WRITEBACK_BYTES also starts the disk write of its range at once (Linux
sync_file_range(SYNC_FILE_RANGE_WRITE), which does not wait for it): the pages go to disk while the
next window is copied, so the fsync each output file ends with finds little left to do, instead of
the whole file (the kernel would start on its own only past vm.dirty_background_ratio of memory,
gigabytes on a large host). MCONV_WRITEBACK=0 turns it off. Measured: README, Benchmarks.
"""
from __future__ import annotations

import ctypes
import errno
import os

import torch

from mconv.errors import MconvError

SETTING = "MCONV_COPY_FILE_RANGE"
WRITEBACK_SETTING = "MCONV_WRITEBACK"
# None: the variable holds something else, which the first copy or write refuses by name.
KERNEL_COPIES = {"": (os.cpu_count() or 1) < 4, "1": True, "0": False}.get(os.environ.get(SETTING, ""))
WRITEBACK = {"": True, "1": True, "0": False}.get(os.environ.get(WRITEBACK_SETTING, ""))

COPY_CALL_BYTES = 64 * 2**20  # bytes one copy_file_range call moves at most (interrupts wait no longer)
# copy_file_range's errnos for "not between these files": other file systems (Linux 5.19+ copies only
# within one file system unless it implements cross-device copies), old kernels, file systems without it.
COPY_REFUSED = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}
_refused: set[tuple[int, int]] = set()  # (input device, output device) pairs the kernel would not copy between

WRITEBACK_BYTES = 2**20  # smaller writes (headers, metadata) are left to the closing fsync
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_sync_file_range = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # Linux only
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def _bad_setting(name: str, choices: str, unset: str) -> MconvError:
    return MconvError(f"{name}={os.environ.get(name)!r}: set it to {choices}, or leave it unset ({unset})")


def check_settings() -> None:
    """Raise MconvError (one sentence naming the variable) if MCONV_COPY_FILE_RANGE or
    MCONV_WRITEBACK holds anything but 0 or 1 (the command line checks before any work)."""
    if KERNEL_COPIES is None:
        raise _bad_setting(SETTING, "1 (copy file to file in the kernel) or 0 (pread/pwrite)",
                           "1 on machines of fewer than 4 CPUs")
    if WRITEBACK is None:
        raise _bad_setting(WRITEBACK_SETTING, "1 (start each write's write-back at once) or 0 (leave it to fsync)",
                           "1")


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing bytes [offset, offset + nbytes) of `fd` to disk without waiting (see the module
    docstring); a no-op for ranges under WRITEBACK_BYTES, with MCONV_WRITEBACK=0 and off Linux. Its
    errors are left to the fsync that closes every output file (which reports a failed write-back).
    Raises MconvError if MCONV_WRITEBACK holds anything but 0 or 1 (`check_settings`)."""
    if WRITEBACK is None:
        check_settings()
    if WRITEBACK and _sync_file_range is not None and nbytes >= WRITEBACK_BYTES:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # ctypes releases the GIL


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """pwrite all of `view` at byte `offset` of `fd` (OSError as pwrite raises it: ENOSPC, EIO...),
    and start its write-back (`start_writeback`)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    start_writeback(fd, offset, len(view))


def copy_range(source: int, offset: int, dest: int, at: int, nbytes: int) -> bool:
    """Copy `nbytes` bytes at `offset` of the open file `source` to byte `at` of `dest`, file to
    file in the kernel (os.copy_file_range, COPY_CALL_BYTES a call), so they never pass through
    user memory. False where the kernel does not copy between the two files' file systems
    (COPY_REFUSED; remembered per pair of devices, so not tried again) or the input ends early:
    the caller then writes the bytes itself; also False (nothing tried) unless KERNEL_COPIES. Other
    errors (ENOSPC) are raised; MconvError if MCONV_COPY_FILE_RANGE is bad (`check_settings`)."""
    if KERNEL_COPIES is None:
        check_settings()
    if not KERNEL_COPIES or not hasattr(os, "copy_file_range"):
        return False
    devices = (os.fstat(source).st_dev, os.fstat(dest).st_dev)
    if devices in _refused:
        return False
    done = 0
    while done < nbytes:
        try:
            n = os.copy_file_range(source, dest, min(nbytes - done, COPY_CALL_BYTES), offset + done, at + done)
        except OSError as e:
            if e.errno not in COPY_REFUSED:
                raise
            _refused.add(devices)
            return False
        if n == 0:
            return False
        done += n
    start_writeback(dest, at, nbytes)
    return True


def pread_all(fd: int, buffer: memoryview, offset: int, ended) -> None:
    """Fill `buffer` with the bytes of `fd` from `offset` on, by preadv (which may read fewer than
    asked). MconvError(ended()) where the file ends first: `ended` says which file, and why that is
    wrong for it."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise MconvError(ended())
        done += n


def pread_into(ranges: list[tuple[int, int, int, int]], dest: torch.Tensor | memoryview, path: object) -> None:
    """Read `ranges` (file descriptor, file offset, byte offset in `dest`, bytes) of the file `path`
    into `dest` (a contiguous CPU tensor or a writable buffer) with preadv. Raises MconvError if the
    file ends early."""
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy()) if isinstance(dest, torch.Tensor) else dest
    for fd, offset, at, nbytes in ranges:
        pread_all(fd, view[at:at + nbytes], offset, lambda: f"{path} ended early (changed while reading?)")
