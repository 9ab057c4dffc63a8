"""torch.save archives laid out by torch.save and filled in place (mconv.converter.torch_save).

Oracles: torch.load (weights_only) reads back every tensor and object as given; Python's zipfile
checks every record's CRC-32 (`testzip`); megatron-core's own loaders read the files hf2mcore writes
this way (tests/test_oracle_megatron.py, tests/test_torch_dist.py)."""
from __future__ import annotations

import argparse
import os
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mconv.converter import safe_load, torch_save
from mconv.errors import MconvError

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


def _write(path, obj, values, window_rows):
    """obj's placeholders filled with `values` (same structure), `window_rows` rows per window."""
    layout = torch_save.plan_archive(obj)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        for name, placeholder in obj["model"].items():
            value = values[name]
            windows = ([value] if value.dim() == 0 else
                       [value[i:i + window_rows] for i in range(0, max(1, len(value)), window_rows)])
            torch_save.fill(fd, 0, layout, layout.record(placeholder), windows, value.dtype)
        layout.write_runs(fd, 0)
    finally:
        os.close(fd)
    return layout


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 9), max_size=3)), min_size=1,
                       max_size=6),
       window_rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_filled_archive_loads_as_torch_save_wrote_it(tmp_path_factory, shapes, window_rows, seed):
    generator = torch.Generator().manual_seed(seed)
    values = {f"t{i}": torch.randint(0, 100, shape, generator=generator).to(dtype) for i, (dtype, shape) in
              enumerate(shapes)}
    obj = {"args": argparse.Namespace(hidden_size=64, params_dtype=torch.bfloat16), "iteration": 7,
           "model": {name: torch.empty_like(value) for name, value in values.items()}}
    path = tmp_path_factory.mktemp("archive") / "model_optim_rng.pt"
    layout = _write(path, obj, values, window_rows)
    assert path.stat().st_size == layout.size
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every CRC-32, data records included
    loaded = safe_load.load_torch(path)
    assert loaded["iteration"] == 7 and loaded["args"] == obj["args"]
    assert loaded["model"].keys() == values.keys()
    for name, value in values.items():
        assert loaded["model"][name].dtype == value.dtype and loaded["model"][name].equal(value)


def test_the_layout_is_planned_without_touching_the_placeholders():
    """4 GiB of placeholders: torch.save under skip_data reads none of it (it would take seconds and
    the memory if it did)."""
    big = {"model": {f"w{i}": torch.empty(2**29, dtype=torch.bfloat16) for i in range(4)}}
    layout = torch_save.plan_archive(big)
    assert sum(r.nbytes for r in layout.records) == 4 * 2**30
    assert sum(len(data) for _, data in layout.runs) < 2**16
    assert [r.offset % 64 for r in layout.records] == [0] * 4  # torch's storage alignment


def test_wrong_window_bytes_and_dtypes_are_refused(tmp_path):
    obj = {"model": {"w": torch.empty(4, 4)}}
    layout = torch_save.plan_archive(obj)
    fd = os.open(tmp_path / "f.pt", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(MconvError, match="given 32 bytes"):
            torch_save.fill(fd, 0, layout, layout.record(obj["model"]["w"]), [torch.zeros(2, 4)])
        with pytest.raises(MconvError, match="was given torch.bfloat16"):
            torch_save.fill(fd, 0, layout, layout.record(obj["model"]["w"]), [torch.zeros(4, 4, dtype=torch.bfloat16)],
                            torch.float32)
    finally:
        os.close(fd)


def test_hf2mcore_legacy_files_are_valid_zips(tmp_path):
    """Every rank file hf2mcore writes passes zipfile's CRC check and torch.load reads it."""
    from click.testing import CliRunner

    from mconv.cli import main
    from tests.conftest import FIXTURES

    out = tmp_path / "m"
    result = CliRunner().invoke(main, ["hf2mcore", str(FIXTURES / "qwen3-moe-tiny"), str(out), "--format", "torch",
                                       "--tp", "2", "--ep", "2", "--pp", "2", "--workers", "3", "-q"])
    assert result.exit_code == 0, result.output
    files = sorted(out.glob("release/mp_rank_*/model_optim_rng.pt"))
    assert len(files) == 4
    for path in files:
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None
        assert safe_load.load_torch(path)["model"]


def test_hf2mcore_torch_dist_chunks_are_valid_zips(tmp_path):
    """Every chunk archive in the `.distcp` files (located by torch's own DCP metadata reader) passes
    zipfile's CRC check and torch.load reads it."""
    import io

    from click.testing import CliRunner
    from torch.distributed.checkpoint import FileSystemReader

    from mconv.cli import main
    from tests.conftest import FIXTURES

    out = tmp_path / "m"
    result = CliRunner().invoke(main, ["hf2mcore", str(FIXTURES / "qwen3-moe-tiny"), str(out), "--workers", "2", "-q"])
    assert result.exit_code == 0, result.output
    metadata = FileSystemReader(out / "release").read_metadata()
    tensors = 0
    for index, info in metadata.storage_data.items():
        with open(out / "release" / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            assert archive.testzip() is None, index.fqn
        loaded = safe_load.load_torch(out, io.BytesIO(data))
        tensors += isinstance(loaded, torch.Tensor)
    assert tensors > 50


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_files_the_kernel_cannot_copy_between_give_the_same_bytes(tmp_path, monkeypatch, kernel_copies, fmt):
    """Where os.copy_file_range refuses (EXDEV: input and output on different file systems; ENOSYS:
    an old kernel), the bytes go through pread/pwrite and the output is the same, byte for byte
    (the writer is deterministic: two runs give identical files)."""
    import errno

    from mconv.converter.hf2mcore import hf2mcore
    from mconv.converter.layout import Layout
    from tests.conftest import FIXTURES

    from mconv.converter import file_io

    source = FIXTURES / "qwen3-moe-tiny"
    hf2mcore(source, tmp_path / "kernel", Layout(tp=2), fmt=fmt, progress=False, workers=2)
    calls = []

    def refuse(*args):
        calls.append(args)
        raise OSError(errno.EXDEV, "Invalid cross-device link")
    monkeypatch.setattr(os, "copy_file_range", refuse)
    hf2mcore(source, tmp_path / "copied", Layout(tp=2), fmt=fmt, progress=False, workers=2)
    assert 1 <= len(calls) <= 2 and file_io._refused  # refused once per thread at most, then not tried again
    files = sorted(p.relative_to(tmp_path / "kernel") for p in (tmp_path / "kernel").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "copied") for p in (tmp_path / "copied").rglob("*") if p.is_file())
    for name in files:
        if name.name != ".metadata":  # it holds a random save id
            assert (tmp_path / "kernel" / name).read_bytes() == (tmp_path / "copied" / name).read_bytes(), name


def test_an_interrupt_while_torch_save_lays_out_an_archive_stays_an_interrupt(monkeypatch):
    """torch's C++ writer turns anything the file object raises into a RuntimeError ("unexpected
    pos"), which reads as a full disk; a Ctrl-C landing in the sink's write is raised as itself."""
    calls = []

    def interrupted(self, data):
        calls.append(len(data))
        raise KeyboardInterrupt
    monkeypatch.setattr(torch_save._Sink, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        torch_save.plan_archive({"model": {"w": torch.empty(4, 4)}})
    assert calls


def test_metadata_names_the_final_directory(tmp_path):
    """DCP's writer records the path it saved to as `storage_meta.checkpoint_id`: the final
    iteration directory, not the staging directory renamed into place."""
    from torch.distributed.checkpoint import FileSystemReader

    from mconv.converter.layout import Layout
    from mconv.converter.hf2mcore import hf2mcore
    from tests.conftest import FIXTURES

    hf2mcore(FIXTURES / "qwen3-tiny", tmp_path / "m", Layout(), progress=False, workers=2)
    metadata = FileSystemReader(tmp_path / "m" / "release").read_metadata()
    assert metadata.storage_meta.checkpoint_id == str(tmp_path / "m" / "release")


def test_a_bad_copy_setting_is_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from mconv.cli import main
    from mconv.converter import file_io
    from tests.conftest import FIXTURES

    monkeypatch.setenv("MCONV_COPY_FILE_RANGE", "yes")
    monkeypatch.setattr(file_io, "KERNEL_COPIES", None)  # as the module reads that value at import
    result = CliRunner().invoke(main, ["hf2mcore", str(FIXTURES / "qwen3-tiny"), str(tmp_path / "m"), "-q"])
    assert result.exit_code == 1 and not (tmp_path / "m").exists()
    assert result.output.strip().splitlines() == [
        "mconv: error: MCONV_COPY_FILE_RANGE='yes': set it to 1 (copy file to file in the kernel) or 0 "
        "(pread/pwrite), or leave it unset (1 on machines of fewer than 4 CPUs)"]
