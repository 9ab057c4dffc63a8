"""mcore2hf copies tensor bytes file to file (os.copy_file_range) where they are bytes of an input
file, and through memory (pwrite) otherwise. The bytes each path moves are counted at the two
system calls; what they write is checked against safetensors' own reader (`load_file`) of the HF
input, bit for bit; the legacy rank files' tensor offsets against Python's `zipfile` records and
torch's own (unmapped) `torch.load` of the same file."""
from __future__ import annotations

import argparse
import errno
import os
import struct
import threading
import zipfile

import pytest
import torch

from mconv import Layout
from mconv.converter import megatron_io as mio
from mconv.converter.layout import Rank
from mconv.converter.hf2mcore import hf2mcore
from mconv.converter.mcore2hf import mcore2hf
from tests.conftest import FIXTURES, assert_hf_bits_equal, hf_tensors, load_rank_file

pytestmark = pytest.mark.usefixtures("kernel_copies")  # the path under test, whatever the machine's default (file_io)
TINY, MOE = FIXTURES / "qwen3-tiny", FIXTURES / "qwen3-moe-tiny"


def _counted(monkeypatch, refused: int | None = None) -> dict[str, int]:
    """Count the bytes os.copy_file_range (`kernel`) and os.pwrite (`memory`) write; with `refused`,
    copy_file_range fails with that errno, as across file systems or on an old kernel."""
    counts, lock = {"kernel": 0, "memory": 0}, threading.Lock()  # worker threads write too
    real_copy, real_pwrite = os.copy_file_range, os.pwrite

    def copy(*args, **kwargs):
        if refused is not None:
            raise OSError(refused, os.strerror(refused))
        n = real_copy(*args, **kwargs)
        with lock:
            counts["kernel"] += n
        return n

    def pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        with lock:
            counts["memory"] += n
        return n

    monkeypatch.setattr(os, "copy_file_range", copy)
    monkeypatch.setattr(os, "pwrite", pwrite)
    return counts


def _header_bytes(directory) -> int:
    return sum(8 + struct.unpack("<Q", path.read_bytes()[:8])[0] for path in directory.glob("*.safetensors"))


def _export(tmp_path, monkeypatch, name: str, refused: int | None = None, workers: int = 1) -> dict[str, int]:
    with monkeypatch.context() as patch:
        counts = _counted(patch, refused)
        mcore2hf(tmp_path / "m", tmp_path / name, progress=False, workers=workers)
    return counts


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("fixture", [TINY, MOE], ids=["qwen3", "qwen3-moe"])
def test_tp1_tensor_bytes_go_file_to_file(tmp_path, monkeypatch, fixture, fmt):
    """At TP1 (and every torch_dist checkpoint, read as TP1) each tensor byte is copied in the kernel
    (fused QKV and GLU pieces included); only the safetensors headers go through memory. Forced to
    fall back (EXDEV), every byte goes through memory instead and the files are the same."""
    expected = hf_tensors(fixture)
    tensor_bytes = sum(t.nbytes for t in expected.values())
    hf2mcore(fixture, tmp_path / "m", Layout(), fmt=fmt, progress=False)
    for name, workers in (("hf", 1), ("hf-threads", 2)):
        counts = _export(tmp_path, monkeypatch, name, workers=workers)
        assert counts == {"kernel": tensor_bytes, "memory": _header_bytes(tmp_path / name)}, name
        assert_hf_bits_equal(expected, tmp_path / name)
    counts = _export(tmp_path, monkeypatch, "fallback", errno.EXDEV)
    assert counts == {"kernel": 0, "memory": tensor_bytes + _header_bytes(tmp_path / "fallback")}
    for path in (tmp_path / "hf").iterdir():
        assert (tmp_path / "fallback" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("refused", [errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP])
def test_every_refusal_falls_back(tmp_path, monkeypatch, refused):
    """The other errnos copy_file_range gives where it cannot copy between two files."""
    hf2mcore(TINY, tmp_path / "m", Layout(), fmt="torch", progress=False)
    counts = _export(tmp_path, monkeypatch, "hf", refused)
    assert counts["kernel"] == 0
    assert_hf_bits_equal(hf_tensors(TINY), tmp_path / "hf")


@pytest.mark.parametrize("fixture, layout", [(TINY, Layout(tp=2)), (MOE, Layout(tp=2, ep=2))],
                         ids=["qwen3-tp2", "qwen3-moe-tp2-ep2"])
def test_whole_rows_of_tp_shards_go_file_to_file(tmp_path, monkeypatch, fixture, layout):
    """Legacy TP shards: pieces that are whole rows of one rank's tensor (column, vocabulary, QKV, GLU,
    experts) are copied in the kernel, the rest (row-parallel shards, merged along dim 1) through
    memory; every tensor byte is written exactly once."""
    expected = hf_tensors(fixture)
    tensor_bytes = sum(t.nbytes for t in expected.values())
    hf2mcore(fixture, tmp_path / "m", layout, fmt="torch", progress=False)
    counts = _export(tmp_path, monkeypatch, "hf")
    assert tensor_bytes // 2 < counts["kernel"] < tensor_bytes
    assert counts["kernel"] + counts["memory"] == tensor_bytes + _header_bytes(tmp_path / "hf")
    assert_hf_bits_equal(expected, tmp_path / "hf")


def _damaged(case: str, monkeypatch, rank_files) -> None:
    if case == "mapping shifted":  # every tensor of mconv's rank files fills its record: none fits shifted
        real = mio._file_mappings
        monkeypatch.setattr(mio, "_file_mappings", lambda: {key: [(lo, hi, offset + 64) for lo, hi, offset in spans]
                                                            for key, spans in real().items()})
    elif case == "no mapping":
        monkeypatch.setattr(mio, "_file_mappings", lambda: {})
    else:  # a zip comment: torch reads the file, mconv's struct parser leaves it alone
        for path in rank_files:
            data = bytearray(path.read_bytes())
            data[-2:] = (4).to_bytes(2, "little")
            path.write_bytes(bytes(data) + b"note")


@pytest.mark.parametrize("case", ["mapping shifted", "no mapping", "zip comment"])
def test_legacy_offsets_that_do_not_check_out_are_read_through_the_mapping(tmp_path, monkeypatch, case):
    hf2mcore(TINY, tmp_path / "m", Layout(pp=2), fmt="torch", progress=False)
    _damaged(case, monkeypatch, sorted((tmp_path / "m").glob(f"release/mp_rank_*/{mio.RANK_FILE}")))
    counts = _export(tmp_path, monkeypatch, "hf")
    assert counts["kernel"] == 0
    assert_hf_bits_equal(hf_tensors(TINY), tmp_path / "hf")


def test_rank_file_offsets_agree_with_zipfile(tmp_path):
    """Oracles: zipfile's records (each located tensor lies inside its storage record, `data/<key>`)
    and torch.load without mmap (the bytes at the offset are the tensor's). Views into a shared
    storage are found at their storage offset; a strided view is not located."""
    base = torch.randn(10, 8)
    model = {"whole": torch.randn(6, 4).to(torch.bfloat16), "rows": base[3:7], "column": base[:, 1],
             "scalar": torch.tensor(2.5), "ints": torch.arange(9)}
    path = tmp_path / "mp_rank_00" / mio.RANK_FILE
    path.parent.mkdir()
    torch.save({"model": model, "args": argparse.Namespace(tensor_model_parallel_size=1)}, path)
    mapped = mio.rank_chunks(mio.load_rank_file(path), path)[0]
    plain = load_rank_file(path)["model"]
    data = path.read_bytes()
    records = []
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name_len, extra_len = struct.unpack_from("<2H", data, info.header_offset + 26)  # the local header's
            start = info.header_offset + 30 + name_len + extra_len
            records.append((info.filename, start, start + info.file_size))
    files = mio.MappedRankFiles({Rank(0, 0): path})
    try:
        for name, tensor in mapped.items():
            found = files.locate(Rank(0, 0), tensor)
            if name == "column":
                assert found is None
                continue
            fd, at = found
            assert os.fstat(fd).st_ino == path.stat().st_ino
            assert data[at:at + tensor.nbytes] == plain[name].reshape(-1).view(torch.uint8).numpy().tobytes(), name
            inside = [n for n, lo, hi in records if lo <= at and at + tensor.nbytes <= hi]
            assert len(inside) == 1 and inside[0].split("/")[-2] == "data", (name, inside)
    finally:
        files.close()
