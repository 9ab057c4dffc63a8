"""Peak memory does not grow with the checkpoint: converting ~1 GB of weights costs the process
well under 256 MB beyond what the same command costs on a tiny model."""
import subprocess
import sys

import pytest

from tests.conftest import FIXTURES, ROOT

MARGIN = 256 * 2**20


# A child's peak RSS counts the pages it shares with its parent before exec, so mconv is started by a
# small interpreter that has loaded nothing, not by this test process (which holds torch).
LAUNCHER = ("import os, sys; pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ); "
            "_, status, usage = os.wait4(pid, 0); print(usage.ru_maxrss); "
            "sys.exit(os.waitstatus_to_exitcode(status))")


def peak_rss(*args) -> int:
    """Run `mconv ARGS` in a fresh process; its peak resident set size in bytes (from wait4)."""
    result = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "mconv.cli", *map(str, args),
                             "-q"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1]) * 1024


@pytest.mark.slow
def test_peak_memory_is_independent_of_model_size(tmp_path):
    from transformers import Qwen3Config

    from fixtures.make_fixtures import make_synthetic

    big = make_synthetic(tmp_path / "big", Qwen3Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=36, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]))
    size = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    assert size > 4 * MARGIN

    base_in = peak_rss("hf2mcore", FIXTURES / "qwen3-tiny", tmp_path / "tiny")
    base_out = peak_rss("mcore2hf", tmp_path / "tiny", tmp_path / "tiny-back")
    big_in = peak_rss("hf2mcore", big, tmp_path / "m", "--tp", "2")
    big_out = peak_rss("mcore2hf", tmp_path / "m", tmp_path / "back")
    print(f"checkpoint {size / 2**20:.0f} MiB; hf2mcore torch_dist peak {big_in / 2**20:.0f} MiB "
          f"(tiny {base_in / 2**20:.0f}); mcore2hf peak {big_out / 2**20:.0f} MiB (tiny {base_out / 2**20:.0f})")
    assert big_in - base_in < MARGIN
    assert big_out - base_out < MARGIN


@pytest.mark.slow
def test_legacy_rank_file_is_written_without_holding_it(tmp_path):
    """The legacy format at TP1 puts the whole model into one torch.save file; it is laid out by
    torch.save and filled window by window, so memory does not hold the rank (it did: 11 GiB at
    TP1 on the benchmark model). torch.load reads the file back bit for bit (its oracle)."""
    from transformers import Qwen3Config

    import torch

    from fixtures.make_fixtures import make_synthetic
    from mconv.converter import safe_load

    big = make_synthetic(tmp_path / "big", Qwen3Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=36, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]))
    size = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    base = peak_rss("hf2mcore", FIXTURES / "qwen3-tiny", tmp_path / "tiny", "--format", "torch")
    peak = peak_rss("hf2mcore", big, tmp_path / "m", "--format", "torch", "--workers", "2")
    print(f"checkpoint {size / 2**20:.0f} MiB; legacy hf2mcore TP1 peak {peak / 2**20:.0f} MiB "
          f"(tiny {base / 2**20:.0f})")
    assert peak - base < MARGIN
    state = safe_load.load_torch(tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt", mmap=True)
    from safetensors import safe_open
    wanted = {"model.layers.35.mlp.down_proj.weight": "decoder.layers.35.mlp.linear_fc2.weight",
              "model.norm.weight": "decoder.final_layernorm.weight",
              "lm_head.weight": "output_layer.weight"}
    for file in big.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in wanted.keys() & set(f.keys()):
                ours, theirs = state["model"][wanted.pop(name)], f.get_tensor(name)  # random bits: compare bytes
                assert ours.reshape(-1).view(torch.uint8).equal(theirs.reshape(-1).view(torch.uint8)), name
    assert not wanted


@pytest.mark.slow
def test_legacy_export_does_not_fault_in_the_rank_files(tmp_path):
    """mcore2hf of a legacy TP1 checkpoint copies the tensors file to file, so the memory-mapped rank
    file (about 420 MB here) is never faulted into the process: its peak RSS stays within MARGIN of
    the same command's on the tiny model (it was the whole rank file more). With --quantize fp8 the
    weights to quantize are read (pread) rather than copied, and quantized a window of block rows at
    a time: the same bound (the whole rank file more, before: read through the mapping)."""
    from transformers import Qwen3Config

    from fixtures.make_fixtures import make_synthetic
    from mconv import Layout, hf2mcore

    big = make_synthetic(tmp_path / "big", Qwen3Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=10, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]), finite=True)
    hf2mcore(FIXTURES / "qwen3-tiny", tmp_path / "tiny", Layout(), fmt="torch", progress=False)
    hf2mcore(big, tmp_path / "m", Layout(), fmt="torch", progress=False)
    rank_file = sum(p.stat().st_size for p in (tmp_path / "m").rglob("*.pt"))
    assert rank_file > 1.5 * MARGIN
    base_out = peak_rss("mcore2hf", tmp_path / "tiny", tmp_path / "tiny-back")
    big_out = peak_rss("mcore2hf", tmp_path / "m", tmp_path / "back")
    big_fp8 = peak_rss("mcore2hf", tmp_path / "m", tmp_path / "back-fp8", "--quantize", "fp8")
    print(f"rank file {rank_file / 2**20:.0f} MiB; legacy mcore2hf peak {big_out / 2**20:.0f} MiB, "
          f"--quantize fp8 {big_fp8 / 2**20:.0f} MiB (tiny {base_out / 2**20:.0f})")
    assert big_out - base_out < MARGIN
    assert big_fp8 - base_out < MARGIN


def test_fp8_weights_larger_than_a_batch_are_quantized_by_windows(tmp_path, monkeypatch):
    """mcore2hf --quantize fp8 of weights larger than a read batch (LOAD_BATCH_BYTES made 256 KiB)
    reads and quantizes them a window of whole 128-row blocks at a time: the files are those of a
    batch that holds them whole (fp8.quantize, compressed-tensors' bytes: tests/test_fp8.py), and no
    tensor the conversion allocates is larger than a window in float32 (2 batches; the largest
    weight, 1 MiB in bfloat16, is 2 MiB in float32). At TP2, gate/up are rows of their shards,
    down_proj the columns of two shards."""
    import filecmp

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from fixtures.make_fixtures import make_qwen3
    from mconv import Layout, hf2mcore, mcore2hf

    hf = make_qwen3(tmp_path / "hf", tokenizer=False, hidden_size=512, intermediate_size=1024, head_dim=128,
                    num_hidden_layers=1, vocab_size=128)
    hf2mcore(hf, tmp_path / "m", Layout(tp=2), fmt="torch", progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "whole", quantize="fp8", progress=False)

    class Largest(TorchDispatchMode):  # the largest tensor memory an operator allocates (views and in-place ops
        nbytes = 0                      # allocate none)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and not func._schema.is_mutable:
                Largest.nbytes = max([Largest.nbytes] + [t.untyped_storage().nbytes() for t in tree_leaves(out)
                                                         if isinstance(t, torch.Tensor)])
            return out

    batch = 256 * 2**10
    monkeypatch.setattr("mconv.converter.mcore2hf.LOAD_BATCH_BYTES", batch)
    with Largest():
        mcore2hf(tmp_path / "m", tmp_path / "windows", quantize="fp8", progress=False)
    assert 0 < Largest.nbytes <= 2 * batch
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "windows").iterdir())
    assert filecmp.cmpfiles(tmp_path / "whole", tmp_path / "windows", files, shallow=False)[0] == files
