import configparser
import os
import signal
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
# A run started in the background of a non-interactive shell (`nohup`, `cmd &`) has SIGINT ignored,
# and every process it starts inherits that: the interrupt tests' mconv processes would not see
# their Ctrl-C. A handler (unlike SIG_IGN) is reset to the default in a started program.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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


# Qwen3.5 / Qwen3-Next models, made once a session for the tests of several files (test_qwen3_5.py,
# test_fp8_qwen3_5.py, test_qwen3_5_vl.py).
def _make_qwen3_5(*args, **kwargs):
    from fixtures.make_fixtures import make_qwen3_5  # imports transformers: only where one is used

    return make_qwen3_5(*args, **kwargs)


@pytest.fixture(scope="session")
def qwen3_5_dir():
    return FIXTURES / "qwen3-5-tiny"  # fixtures/make_fixtures.py's make_qwen3_5 (the docs convert it)


@pytest.fixture(scope="session")
def qwen3_5_mtp_dir(tmp_path_factory):
    """Dense Qwen3.5 with its MTP layer (Qwen3.5-27B's form)."""
    return _make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_mtp") / "hf", seed=7, mtp=True)


@pytest.fixture(scope="session")
def qwen3_5_moe_dir(tmp_path_factory):
    """Qwen3.5-MoE as the official checkpoints hold it: experts fused, the MTP layer's per expert."""
    return _make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_moe") / "hf", seed=8, moe=True, fused_experts=True, mtp=True)


@pytest.fixture(scope="session")
def qwen3_5_vl_dir(tmp_path_factory):
    """Qwen3.5-VL (dense) whose language model has the text fixture's shape, with an MTP layer."""
    return _make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_vl") / "hf", seed=10, vl=True, mtp=True)


@pytest.fixture(scope="session")
def qwen3_6_vl_moe_dir(tmp_path_factory):
    """Qwen3.6-VL-MoE's form: experts fused (stacked) in the decoder and in the MTP layer."""
    return _make_qwen3_5(tmp_path_factory.mktemp("qwen3_6_vl_moe") / "hf", seed=10, vl=True, moe=True,
                         fused_experts=True, mtp=True, fused_mtp_experts=True)


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory):
    return _make_qwen3_5(tmp_path_factory.mktemp("qwen3_next") / "hf", seed=9, next=True, mtp=True)


def plugin_metadata(where: Path) -> Path:
    """A distribution's metadata holding setup.cfg's `vllm.general_plugins` entry points (what `pip
    install mconv` puts beside vLLM), in `where`, which goes on the server's path."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    info = where / "mconv_vllm_plugin-0.dist-info"  # not "mconv": the checkout's own egg-info would shadow it
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mconv-vllm-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]" + setup["options.entry_points"]["vllm.general_plugins"]
                                           + "\n")
    return where


def raising_at(make_buckets, at: int, error: BaseException):
    """`make_buckets` (mconv.live.sync.core._stage_buckets) made to raise `error` where it would give
    bucket `at`: a sync that fails, or is interrupted, mid-way."""
    def raising(*args, **kwargs):
        for i, bucket in enumerate(make_buckets(*args, **kwargs)):
            if i == at:
                raise error
            yield bucket
    return raising
