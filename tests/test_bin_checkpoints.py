"""HF checkpoints saved as `.bin` pickles (`pytorch_model.bin`, or shards and
`pytorch_model.bin.index.json`). Oracle: transformers 4.57's own `save_pretrained` writes the same
model both ways (`safe_serialization=False` and True, in a subprocess from its own target dir; 5.x
writes only safetensors); hf2mcore of the `.bin` files must write the same bytes as hf2mcore of the
safetensors files, and inspect, verify and `mconv.live.load_hf_weights` read them too. A `.bin`
whose pickle names a global that would execute is refused with one line, and nothing runs."""
import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import FIXTURES
from tests.ranks import start_ranks
from tests.test_errors import assert_refused, mconv

TRANSFORMERS_4 = Path(sys.prefix) / "tf-4.57"
SAVE = """
import sys, warnings
warnings.filterwarnings("ignore")
from transformers import AutoModelForCausalLM
fixture, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(fixture, torch_dtype="auto")
model.save_pretrained(out + "/safetensors", safe_serialization=True)
model.save_pretrained(out + "/bin", safe_serialization=False)
model.save_pretrained(out + "/bin-sharded", safe_serialization=False, max_shard_size="100KB")
"""
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    if not TRANSFORMERS_4.is_dir() and not os.environ.get("CI"):
        pytest.skip(f"no transformers 4.57 at {TRANSFORMERS_4} (scripts/install.sh installs it there)")
    out = tmp_path_factory.mktemp("saved")
    result = subprocess.run([sys.executable, "-c", SAVE, str(FIXTURES / "qwen3-tiny"), str(out)],
                            env={**os.environ, "PYTHONPATH": str(TRANSFORMERS_4)}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "bin" / "pytorch_model.bin").is_file() and not list((out / "bin").glob("*.safetensors"))
    assert (out / "bin-sharded" / "pytorch_model.bin.index.json").is_file()
    assert len(list((out / "bin-sharded").glob("pytorch_model-*.bin"))) > 1
    return out


def same_files(a: Path, b: Path) -> None:
    """The same files, byte for byte, but DCP's `.metadata`, which records the output's own path."""
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != ".metadata")
    assert names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != ".metadata")
    match, mismatch, errors = filecmp.cmpfiles(a, b, [str(n) for n in names], shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_bin_converts_as_its_safetensors_twin(saved, tmp_path, fmt):
    layout = ["--tp", "2"]
    assert mconv("hf2mcore", saved / "safetensors", tmp_path / "st", "--format", fmt, *layout, "-q").exit_code == 0
    for variant in ("bin", "bin-sharded"):
        result = mconv("hf2mcore", saved / variant, tmp_path / variant, "--format", fmt, *layout, "-q")
        assert result.exit_code == 0, result.output
        same_files(tmp_path / "st" / "release", tmp_path / variant / "release")
        result = mconv("verify", saved / "safetensors", saved / variant)  # verify reads .bin too
        assert result.exit_code == 0 and "identical" in result.output, result.output
    info = json.loads(mconv("inspect", saved / "bin-sharded", "--json").output)
    assert info["kind"] == "huggingface" and info["size"]["files"] > 1


@pytest.mark.slow  # a megatron-core model in a spawned process
def test_load_hf_weights_reads_bin(saved, tmp_path):
    """The live loader fills every parameter of a megatron-core model from the sharded `.bin` files
    exactly as from the safetensors ones (staged and direct)."""

    from tests.megatron_oracle import MegatronRun, read_config

    run = MegatronRun(tmp_path, read_config(saved / "safetensors"), padded_vocab=384)
    out = tmp_path / "out.pt"
    start_ranks(_live_worker, args=(run, saved, out), nprocs=1)
    assert torch.load(out) == "exact"


def _live_worker(rank, run, saved, out):
    import warnings

    warnings.filterwarnings("ignore")
    from mconv.live import load_hf_weights
    from tests.megatron_oracle import one_process_gpt

    with one_process_gpt(run) as model:
        load_hf_weights([model], saved / "safetensors")
        expected = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        for staged in (False, True):
            for tensor in expected:
                model.state_dict()[tensor].zero_() if model.state_dict()[tensor].is_floating_point() else None
            load_hf_weights([model], saved / "bin-sharded", staged=staged)
            for name, tensor in model.state_dict().items():
                if isinstance(tensor, torch.Tensor):
                    assert torch.equal(tensor, expected[name]), name
        torch.save("exact", out)


def test_stacked_experts_in_a_bin(tmp_path):
    """Stacked experts (Qwen3-VL-MoE) in a `.bin` that torch.save wrote from the safetensors
    fixture's tensors: converted as the safetensors original is."""
    from safetensors.torch import load_file

    source = FIXTURES / "qwen3-vl-moe-tiny"
    hf = tmp_path / "hf"
    hf.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            (hf / path.name).write_bytes(path.read_bytes())
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(path))
    (hf / "model.safetensors.index.json").unlink(missing_ok=True)
    torch.save(tensors, hf / "pytorch_model.bin")
    for name, model in (("st", source), ("bin", hf)):
        result = mconv("hf2mcore", model, tmp_path / name, "--tp", "2", "--ep", "2", "--format", "torch", "-q")
        assert result.exit_code == 0, result.output
    same_files(tmp_path / "st" / "release", tmp_path / "bin" / "release")


def test_a_bin_in_torchs_pre_zip_format(tmp_path):
    """A `.bin` torch.save wrote in its pre-zip format (`_use_new_zipfile_serialization=False`, torch
    < 1.6's default; transformers loads it, torch cannot memory-map it): converted as the
    safetensors original is, and verify reads it as the same tensors."""
    from safetensors.torch import load_file

    source = FIXTURES / "qwen3-tiny"
    hf = Path(shutil.copytree(source, tmp_path / "hf", ignore=shutil.ignore_patterns("*.safetensors")))
    torch.save(load_file(source / "model.safetensors"), hf / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert not (hf / "pytorch_model.bin").read_bytes().startswith(b"PK")
    for name, model in (("st", source), ("bin", hf)):
        result = mconv("hf2mcore", model, tmp_path / name, "--tp", "2", "--format", "torch", "-q")
        assert result.exit_code == 0, result.output
    same_files(tmp_path / "st" / "release", tmp_path / "bin" / "release")
    result = mconv("verify", source, hf)
    assert result.exit_code == 0 and "identical" in result.output, result.output


class _Runs:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_bin_that_would_execute_is_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes((FIXTURES / "qwen3-tiny" / "config.json").read_bytes())
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "payload": _Runs(str(marker))}, hf / "pytorch_model.bin")
    out = tmp_path / "out"
    assert_refused(mconv("hf2mcore", hf, out), out, "pytorch_model.bin", "refused to unpickle", "system")
    result = mconv("inspect", hf)
    assert result.exit_code == 1 and "refused to unpickle" in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_a_bin_holding_a_tensor_that_is_no_dense_weight_is_one_sentence(tmp_path, kind):
    """A `.bin` whose state dict holds a sparse (or meta) tensor under a weight's name: hf2mcore, its
    dry run and inspect each name the file and the tensor in one line (hf2mcore raised torch's
    "copy_() between dense and sparse Tensors" traceback; inspect counted it as float32 bytes)."""
    from safetensors.torch import load_file

    source = FIXTURES / "qwen3-tiny"
    hf = Path(shutil.copytree(source, tmp_path / "hf", ignore=shutil.ignore_patterns("*.safetensors")))
    state = load_file(source / "model.safetensors")
    name = "model.norm.weight"
    state[name] = state[name].float().to_sparse() if kind == "sparse" else torch.empty_like(state[name], device="meta")
    torch.save(state, hf / "pytorch_model.bin")
    said = f"{hf / 'pytorch_model.bin'}: tensor {name} is a sparse, quantized, nested or meta tensor"
    out = tmp_path / "out"
    assert_refused(mconv("hf2mcore", hf, out, "-q"), out, said)
    assert_refused(mconv("hf2mcore", hf, out, "--dry-run"), out, said)
    result = mconv("inspect", hf)
    assert result.exit_code == 1 and said in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_hub_name_of_a_bin_only_model(tmp_path, monkeypatch):
    """A hub repository with only `.bin` weights (in an offline cache laid out as huggingface_hub
    leaves it): hf2mcore of the name writes what hf2mcore of the directory writes."""
    import huggingface_hub.constants as constants
    from safetensors.torch import load_file

    from tests.test_hub import add_snapshot

    source = tmp_path / "bin-only"
    source.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((FIXTURES / "qwen3-tiny" / name).read_bytes())
    torch.save(load_file(FIXTURES / "qwen3-tiny" / "model.safetensors"), source / "pytorch_model.bin")
    cache = tmp_path / "home" / "hub"
    add_snapshot(cache, "tiny-org/bin-only", source, "c" * 40, "main")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for name, model in (("hub", "tiny-org/bin-only"), ("dir", FIXTURES / "qwen3-tiny")):
        result = mconv("hf2mcore", model, tmp_path / name, "--format", "torch", "-q")
        assert result.exit_code == 0, result.output
    same_files(tmp_path / "hub" / "release", tmp_path / "dir" / "release")
