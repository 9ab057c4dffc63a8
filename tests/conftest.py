import os
import sys
import warnings
from pathlib import Path

# megatron-core's fused functions are torch.compile'd (megatron.core.jit): each process that ran a
# forward compiled them with inductor first, some 20 s of CPU per rank and most of an oracle test's
# time. The oracles check weights, not kernels; eager runs the same functions. Set before anything
# imports torch or starts a process, so that every rank and subprocess inherits it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# One intra-op thread per process: the suite runs two workers on two cores, and the ranks of a gloo
# world are processes of their own; two threads each only contend (`tests/test_torch_dist.py`'s
# megatron-core loads, two at a time: 88 s wall with two threads, 80 s with one, 2026-12-02). torch
# reads it when imported (set later, as tests/megatron_oracle.py did, it changed nothing).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "fixtures"

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


@pytest.fixture(autouse=True)
def _copies_not_yet_refused(monkeypatch):
    """Each test starts with no pair of file systems marked as refusing in-kernel copies
    (file_io.copy_range remembers refusals for the process: a test that forces one would
    otherwise send later tests' bytes through memory)."""
    from mconv.converter import file_io

    monkeypatch.setattr(file_io, "_refused", set())


@pytest.fixture
def kernel_copies(monkeypatch):
    """In-kernel copies on in this process (MCONV_COPY_FILE_RANGE=1; by default only on machines of
    fewer than 4 CPUs, see file_io), whatever machine the tests run on."""
    from mconv.converter import file_io

    monkeypatch.setattr(file_io, "KERNEL_COPIES", True)


def load_rank_file(path, map_location=None):
    """A legacy rank file (or any .pt file the tests wrote) read by torch itself with weights_only,
    the args Namespace allowed: the tests unpickle nothing more than mconv does.
    The (object, name) form matters: a plain entry is removed from torch's allow-list on exit,
    which would also drop megatron-core's own registration of argparse.Namespace (made when
    megatron.core is imported) and make its later loads in this process fail."""
    import argparse

    import torch

    with torch.serialization.safe_globals([(argparse.Namespace, "argparse.Namespace")]):
        return torch.load(path, map_location=map_location, weights_only=True)


def hf_tensors(directory) -> dict:
    """Every tensor of the HF model in `directory`, as safetensors' own reader (`load_file`) gives it."""
    from safetensors.torch import load_file

    found = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        found.update(load_file(path))
    return found


def assert_hf_bits_equal(expected: dict, directory) -> None:
    """The HF model in `directory` holds exactly `expected`'s tensors, bit for bit."""
    import torch

    found = hf_tensors(directory)
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert found[name].dtype == tensor.dtype and found[name].shape == tensor.shape, name
        assert torch.equal(found[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
