"""The fast byte paths of the readers and writers, each against a library we did not write:
torch_dist chunk archives (zip parsed with struct; written without copying the tensor) against
`zipfile` and `torch.load`; staged safetensors output against `safetensors.safe_open`; the
TorchDistReader under threads (one descriptor per file)."""
from __future__ import annotations

import io
import os
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from mconv.converter import torch_dist_io, torch_dist_write, torch_save
from mconv.converter.hf_write import ShardedSafetensorsWriter, StagingBuffer
from mconv.converter.torch_dist_write import DistEntry


def _archive(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("value", [torch.zeros(3, 5, dtype=torch.bfloat16), torch.arange(7.0), [{"a": 1}],
                                   torch.ones(0, 4)])
def test_zip_members_parsed_with_struct_agree_with_zipfile(value):
    """Oracle: Python's zipfile reading the same torch.save archive."""
    data = _archive(value)
    members = torch_save.members(data[-4096:], len(data), lambda at, n: data[at:at + n])
    expected = {i.filename: (i.header_offset, i.file_size, i.compress_type)
                for i in zipfile.ZipFile(io.BytesIO(data)).infolist()}
    assert members == expected
    for name, (local, size, _) in members.items():
        start = torch_save.record_start(local, lambda at, n: data[at:at + n])
        assert data[start:start + size] == zipfile.ZipFile(io.BytesIO(data)).read(name)


def test_zip_with_a_comment_is_left_to_zipfile():
    data = bytearray(_archive(torch.zeros(2)))
    data[-2:] = (4).to_bytes(2, "little")  # a 4-byte archive comment
    data += b"note"
    assert torch_save.members(bytes(data[-4096:]), len(data), lambda at, n: bytes(data[at:at + n])) is None


def _entries():
    full = torch.randn(6, 4).to(torch.bfloat16)  # a GLU fc1: two boxes, views into one tensor
    return [
        DistEntry("fc1", (2, 3, 4), torch.bfloat16, lambda: full[:3].reshape(1, 3, 4), (0, 0, 0), (1, 3, 4), "p"),
        DistEntry("fc1", (2, 3, 4), torch.bfloat16, lambda: full[3:].reshape(1, 3, 4), (1, 0, 0), (1, 3, 4), "p"),
        DistEntry("norm", (5,), torch.float32, lambda: torch.arange(5.0)),
        DistEntry("obj/shard_0_1", None, None, lambda: {"x": 1}),
    ], full


def test_written_chunks_are_torch_save_archives(tmp_path):
    """Oracle: torch.load (weights_only) of each chunk's bytes, as DCP's reader loads it; and the
    chunk of a view holds the view's bytes only (torch.save alone would store the whole storage)."""
    entries, full = _entries()
    torch_dist_write.write(tmp_path, entries)
    data = (tmp_path / torch_dist_write.data_file(0)).read_bytes()
    reader = torch_dist_io.TorchDistReader(tmp_path)
    loaded = {}
    for key, info in reader.tensors.items():
        for chunk in info.chunks:
            tensor = torch.load(io.BytesIO(data[chunk.offset:chunk.offset + chunk.length]), weights_only=True)
            assert tensor.untyped_storage().nbytes() == tensor.nbytes
            loaded[(key, chunk.offsets)] = tensor
    assert torch.equal(torch.cat([loaded[("fc1", (0, 0, 0))], loaded[("fc1", (1, 0, 0))]]).reshape(6, 4), full)
    assert torch.equal(loaded[("norm", (0,))], torch.arange(5.0))
    assert torch.equal(reader.read_box("fc1").reshape(6, 4), full)
    assert torch.equal(reader.read_box("fc1", (0, 1, 2), (2, 2, 2)), full.reshape(2, 3, 4)[:, 1:3, 2:4])
    assert reader.read_object("obj/shard_0_1") == {"x": 1}


def test_reader_threads_open_one_descriptor_per_file(tmp_path, monkeypatch):
    entries, full = _entries()
    torch_dist_write.write(tmp_path, entries)
    reader = torch_dist_io.TorchDistReader(tmp_path)
    reader.close()
    opened, real_open, gate = [], os.open, threading.Barrier(8)

    def counting_open(path, *args, **kwargs):
        if str(path).endswith(".distcp"):
            opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)

    def read(_):
        gate.wait()
        return reader.read_box("fc1")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(read, range(8)))
    assert all(torch.equal(r.reshape(6, 4), full) for r in results)
    assert len(opened) == 1
    reader.close()


@pytest.mark.parametrize("stack", [None, "5.x", "4.x"])
def test_staged_output_is_what_safetensors_reads(tmp_path, stack):
    """Oracle: safetensors.safe_open. Mixed dtypes put an f32 tensor at an offset that is not a
    multiple of 4 (it is written from its own memory); stacked experts of both orientations."""
    experts = {f"m.mlp.experts.{e}.{p}.weight": torch.randn(4, 6).to(torch.bfloat16)
               for e in range(3) for p in ("gate_proj", "up_proj")}
    experts.update({f"m.mlp.experts.{e}.down_proj.weight": torch.randn(6, 4).to(torch.bfloat16) for e in range(3)})
    tensors = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(2, 3), "c": torch.arange(5, dtype=torch.int64),
               **experts, "d": torch.randn(7).to(torch.float16)}
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    writer = ShardedSafetensorsWriter(tmp_path, entries, 100, stack)
    writer.create()
    buffer = StagingBuffer(keep=64)
    names = list(tensors)
    for batch in (names[:4], names[4:11], names[11:]):
        staged = writer.stage([(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in batch], buffer)
        for n in batch:
            staged.views[n].copy_(tensors[n])
        staged.flush()
    writer.close()
    writer.write_index()
    found = {}
    for file in writer.files:
        with safe_open(str(tmp_path / file), framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    for name, tensor in tensors.items():
        if stack is None or ".experts." not in name:
            assert torch.equal(found[name], tensor), name
    if stack is not None:
        gate_up, down = found["m.mlp.experts.gate_up_proj"], found["m.mlp.experts.down_proj"]
        if stack == "4.x":
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        for e in range(3):
            assert torch.equal(gate_up[e], torch.cat([experts[f"m.mlp.experts.{e}.gate_proj.weight"],
                                                      experts[f"m.mlp.experts.{e}.up_proj.weight"]]))
            assert torch.equal(down[e], experts[f"m.mlp.experts.{e}.down_proj.weight"])


COPIED = (("a", 0, 4), ("a", 6, 8), ("b", 0, 6), ("c", 3, 7))  # rows of tensors copied file to file


@pytest.mark.parametrize("refused", [False, True])
def test_staged_output_with_bytes_copied_file_to_file(tmp_path, monkeypatch, kernel_copies, refused):
    """Oracle: safetensors.safe_open. Rows of some tensors (whole tensors, a head, a tail, a middle
    stretch; each in two ranges) are copied from an input file into the output; their staged
    memory then holds garbage, which `flush` must not write around them. Refused (EXDEV), `copy`
    says so and the memory, which holds the right bytes, is written instead."""
    import errno

    tensors = {"a": torch.randn(8, 4).to(torch.bfloat16), "b": torch.randn(6, 2),
               "c": torch.arange(10, dtype=torch.int64), "d": torch.randn(5).to(torch.float16)}
    source, where, at = tmp_path / "input.bin", {}, 0
    for name, tensor in tensors.items():
        where[name], at = at, at + tensor.nbytes
    source.write_bytes(b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values()))
    if refused:
        def exdev(*args):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        monkeypatch.setattr(os, "copy_file_range", exdev)
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    (tmp_path / "out").mkdir()
    writer = ShardedSafetensorsWriter(tmp_path / "out", entries, 10**6)
    writer.create()
    staged = writer.stage(entries, StagingBuffer())
    for name, tensor in tensors.items():
        staged.views[name].copy_(tensor)
    fd = os.open(source, os.O_RDONLY)
    try:
        for name, lo, hi in COPIED:
            dest, row = staged.views[name][lo:hi], tensors[name][0].nbytes
            half = (hi - lo) // 2 * row
            ranges = [(fd, where[name] + lo * row, 0, half), (fd, where[name] + lo * row + half, half, dest.nbytes - half)]
            assert staged.copy(dest, ranges) is not refused
            if not refused:
                dest.reshape(-1).view(torch.uint8).fill_(0xAB)
    finally:
        os.close(fd)
    staged.flush()
    writer.close()
    with safe_open(str(tmp_path / "out" / writer.files[0]), framework="pt") as f:
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor), name
