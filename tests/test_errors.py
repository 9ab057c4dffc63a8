"""Bad input: one line naming the culprit, exit status 1, no output (and no partial output)."""
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mconv.cli import main
from tests.conftest import FIXTURES

TINY = FIXTURES / "qwen3-tiny"


def mconv(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def legacy(*args):
    """hf2mcore in the legacy per-rank format (these tests edit rank files)."""
    return mconv("hf2mcore", *args, "--format", "torch", "-q")


def assert_refused(result, out: Path, *fragments):
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mconv: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if ".mconv-partial-" in p.name]


def copy_model(tmp_path, source=TINY) -> Path:
    return Path(shutil.copytree(source, tmp_path / "hf"))


def edit_weights(hf: Path, edit):
    tensors = load_file(hf / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


def test_missing_safetensors_file(tmp_path):
    hf = copy_model(tmp_path)
    (hf / "model.safetensors").unlink()
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "model.safetensors")


def test_shard_listed_in_index_is_missing(tmp_path):
    hf = copy_model(tmp_path)
    names = load_file(hf / "model.safetensors").keys()
    (hf / "model.safetensors").unlink()  # transformers reads model.safetensors before an index
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "model-00001-of-00002.safetensors")


def test_truncated_safetensors(tmp_path):
    hf = copy_model(tmp_path)
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) - 1000])
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "is truncated: its header describes")


def test_garbage_safetensors(tmp_path):
    hf = copy_model(tmp_path)
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "model.safetensors is not a valid safetensors file (", "header too large")


def test_tensor_missing(tmp_path):
    hf = copy_model(tmp_path)
    edit_weights(hf, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out",
                   "model.layers.2.mlp.up_proj.weight", "missing")


def test_unexpected_tensor(tmp_path):
    hf = copy_model(tmp_path)
    edit_weights(hf, lambda t: t.update({"model.layers.0.self_attn.rotary.inv_freq": torch.zeros(4)}))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out",
                   "model.layers.0.self_attn.rotary.inv_freq", "unexpected")


def test_shape_disagrees_with_config(tmp_path):
    hf = copy_model(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    config["intermediate_size"] = 128
    (hf / "config.json").write_text(json.dumps(config))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out",
                   "model.layers.0.mlp.gate_proj.weight", "[96, 64]", "[128, 64]")


def test_unsupported_architecture(tmp_path):
    hf = copy_model(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (hf / "config.json").write_text(json.dumps(config))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "GPT2LMHeadModel")


@pytest.mark.parametrize("options,fragment", [
    (["--tp", "8"], "num_attention_heads=4 is not divisible by --tp 8"),
    (["--tp", "4"], "num_key_value_heads (query groups)=2 is not divisible by --tp 4"),
    (["--pp", "3"], "4 layers cannot be split evenly over 3 pipeline stages"),
    (["--pp", "2", "--vpp", "4"], "not divisible by --vpp 4"),
    (["--pp", "2", "--first-stage-layers", "4"], "leave 0 of 4 layers"),
])
def test_layout_does_not_fit(tmp_path, options, fragment):
    assert_refused(mconv("hf2mcore", TINY, tmp_path / "out", *options), tmp_path / "out", fragment)


def test_output_exists(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    result = mconv("hf2mcore", TINY, out)
    assert result.exit_code == 1 and "already exists; pass --overwrite" in result.stderr
    assert (out / "keep").read_text() == "x"


def test_overwrite_replaces_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("x")
    assert mconv("hf2mcore", TINY, out, "--overwrite", "-q").exit_code == 0
    assert not (out / "stale").exists() and (out / "release").is_dir()


def test_checkpoint_args_disagree_with_hf_config(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "--hf-config", FIXTURES / "qwen3-tiny-tied"),
                   tmp_path / "out", "num_layers=4", "implies 2")


def test_checkpoint_without_stored_config_needs_hf_config(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    shutil.rmtree(tmp_path / "m" / "hf_config")
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out", "--hf-config")
    assert mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "--hf-config", TINY, "-q").exit_code == 0


def test_missing_rank_file(tmp_path):
    assert legacy(TINY, tmp_path / "m", "--tp", "2").exit_code == 0
    (tmp_path / "m" / "release" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out", "mp_rank_01", "missing")


def test_megatron_tensor_missing(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    path = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    del state["model"]["decoder.layers.1.mlp.linear_fc2.weight"]
    torch.save(state, path)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out",
                   "decoder.layers.1.mlp.linear_fc2.weight")


class Exploit:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/mconv-exploit-ran"),))


def test_legacy_reader_refuses_arbitrary_pickles(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    path = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["payload"] = Exploit()
    torch.save(state, path)
    Path("/tmp/mconv-exploit-ran").unlink(missing_ok=True)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out", "does not unpickle")
    assert not Path("/tmp/mconv-exploit-ran").exists()


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(mconv("mcore2hf", tmp_path / "empty", tmp_path / "out"), tmp_path / "out", "not a Megatron checkpoint")


def test_inputs_are_not_modified(tmp_path):
    hf = copy_model(tmp_path)
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    assert mconv("hf2mcore", hf, tmp_path / "m", "--tp", "2", "-q").exit_code == 0
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
