"""Every large write starts its own write-back (file_io.start_writeback: Linux sync_file_range), so
the fsync closing each output file finds little left to write. The writes are recorded where they
reach the kernel (os.pwrite, os.copy_file_range) and the write-back requests where they leave
Python (the libc function); every byte of every large write must be asked for. The output is still
checked against the HF input by safetensors' own reader; MCONV_WRITEBACK=0 asks for nothing, and a
bad value is one line."""
from __future__ import annotations

import ctypes
import os
import sys
import threading

import pytest
from click.testing import CliRunner

from mconv import Layout
from mconv.cli import main
from mconv.converter import file_io
from mconv.converter.hf2mcore import hf2mcore
from mconv.converter.mcore2hf import mcore2hf
from tests.conftest import FIXTURES, assert_hf_bits_equal, hf_tensors

MOE = FIXTURES / "qwen3-moe-tiny"
LARGE = 4096  # WRITEBACK_BYTES for these tests: the tiny fixture's tensors are a few KiB


def _record(monkeypatch) -> tuple[list, list]:
    """(writes, requests): (inode, first byte, end) of each pwrite / copy_file_range of at least LARGE
    bytes, and of each write-back request."""
    writes, requests, lock = [], [], threading.Lock()
    real_pwrite, real_copy, real_request = os.pwrite, os.copy_file_range, file_io._sync_file_range

    def pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        if n >= LARGE:
            with lock:
                writes.append((os.fstat(fd).st_ino, offset, offset + n))
        return n

    def copy(source, dest, count, offset_src=None, offset_dst=None):
        n = real_copy(source, dest, count, offset_src, offset_dst)
        if n >= LARGE:
            with lock:
                writes.append((os.fstat(dest).st_ino, offset_dst, offset_dst + n))
        return n

    def request(fd, offset, nbytes, flags):
        assert flags == 2  # SYNC_FILE_RANGE_WRITE: start, do not wait
        with lock:
            requests.append((os.fstat(fd).st_ino, offset, offset + nbytes))
        return real_request(fd, offset, nbytes, flags)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "copy_file_range", copy)
    monkeypatch.setattr(file_io, "_sync_file_range", request)
    monkeypatch.setattr(file_io, "WRITEBACK_BYTES", LARGE)
    return writes, requests


def _covered(write, requests) -> bool:
    inode, lo, hi = write
    for start, end in sorted((s, e) for i, s, e in requests if i == inode):
        if start <= lo < end:
            lo = end
    return lo >= hi


@pytest.mark.skipif(sys.platform != "linux", reason="sync_file_range is Linux's (off Linux no request is made)")
@pytest.mark.parametrize("copies", [True, False], ids=["kernel-copies", "pread-pwrite"])
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_every_large_write_asks_for_its_write_back(tmp_path, monkeypatch, fmt, copies):
    monkeypatch.setattr(file_io, "KERNEL_COPIES", copies)
    for direction in ("hf2mcore", "mcore2hf"):
        with monkeypatch.context() as patch:
            writes, requests = _record(patch)
            if direction == "hf2mcore":
                hf2mcore(MOE, tmp_path / "m", Layout(tp=2, ep=2), fmt=fmt, progress=False, workers=2)
            else:
                mcore2hf(tmp_path / "m", tmp_path / "hf", progress=False, workers=2)
        assert writes, direction
        missed = [w for w in writes if not _covered(w, requests)]
        assert not missed, (direction, missed[:3])
    assert_hf_bits_equal(hf_tensors(MOE), tmp_path / "hf")


def test_off_asks_for_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(file_io, "WRITEBACK", False)
    writes, requests = _record(monkeypatch)
    hf2mcore(MOE, tmp_path / "m", Layout(), fmt="torch_dist", progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "hf", progress=False)
    assert writes and not requests
    assert_hf_bits_equal(hf_tensors(MOE), tmp_path / "hf")


@pytest.mark.skipif(sys.platform != "linux", reason="sync_file_range is Linux's (off Linux no request is made)")
def test_the_libc_call_is_bound_right(tmp_path):
    """The kernel accepts the call as bound (64-bit offsets past 4 GiB included); a range of a file
    not open for writing is refused (EBADF), so the arguments do reach it."""
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"x" * 8192, 5 * 2**30)
        assert file_io._sync_file_range(fd, 5 * 2**30, 8192, 2) == 0
    finally:
        os.close(fd)
    assert file_io._sync_file_range(-1, 0, 8192, 2) == -1 and ctypes.get_errno() == 9  # EBADF


@pytest.mark.parametrize("setting, value, message", [
    ("WRITEBACK", "on", "MCONV_WRITEBACK='on': set it to 1 (start each write's write-back at once) or 0 "
                        "(leave it to fsync), or leave it unset (1)"),
    ("KERNEL_COPIES", "2", "MCONV_COPY_FILE_RANGE='2': set it to 1 (copy file to file in the kernel) or 0 "
                           "(pread/pwrite), or leave it unset (1 on machines of fewer than 4 CPUs)")])
def test_a_bad_setting_is_one_line_before_any_work(tmp_path, monkeypatch, setting, value, message):
    """Refused by every command before it starts, also where no byte would take the path it sets
    (a cast, a dry run)."""
    assert CliRunner().invoke(main, ["hf2mcore", str(MOE), str(tmp_path / "m"), "--format", "torch", "-q"]).exit_code == 0
    monkeypatch.setenv(file_io.SETTING if setting == "KERNEL_COPIES" else file_io.WRITEBACK_SETTING, value)
    monkeypatch.setattr(file_io, setting, None)  # as the module reads that value at import
    for args in (["hf2mcore", str(MOE), str(tmp_path / "m2"), "-q"], ["hf2mcore", str(MOE), str(tmp_path / "m2"), "--dry-run"],
                 ["mcore2hf", str(tmp_path / "m"), str(tmp_path / "hf"), "--dtype", "float32", "-q"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and not (tmp_path / "m2").exists() and not (tmp_path / "hf").exists(), args
        assert result.output.strip().splitlines() == [f"mconv: error: {message}"], args
