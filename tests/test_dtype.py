"""`mcore2hf --dtype`: an explicit cast on export; by default each tensor keeps its dtype, and
config.json's dtype names what was written. Oracle: transformers loads the output
(`dtype="auto"`, i.e. from config.json) with the requested dtype, and its parameters equal
torch's cast of the original model's."""
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from mconv.cli import main
from tests.conftest import FIXTURES


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory):
    """A float32 training checkpoint (TP2) whose stored HF config still says bfloat16, as when a
    bf16 model was trained in fp32."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("dtype")
    source = FIXTURES / "qwen3-tiny"
    fp32 = tmp / "fp32"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(fp32)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, fp32 / name)
    assert json.loads((fp32 / "config.json").read_text())["dtype"] == "bfloat16"
    ckpt = tmp / "ckpt"
    result = CliRunner().invoke(main, ["hf2mcore", str(fp32), str(ckpt), "--tp", "2", "--format", "torch", "-q"])
    assert result.exit_code == 0, result.output
    return fp32, ckpt


@pytest.mark.parametrize("dtype,workers", [(None, 1), ("bfloat16", 1), ("float16", 1), ("float32", 1),
                                           ("bfloat16", 2)])
def test_dtype_on_export(fp32_checkpoint, tmp_path, dtype, workers):
    from transformers import AutoModelForCausalLM

    fp32, ckpt = fp32_checkpoint
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["mcore2hf", str(ckpt), str(out), "-q", "--workers", str(workers)]
                                + (["--dtype", dtype] if dtype else []))
    assert result.exit_code == 0, result.output
    expected = getattr(torch, dtype or "float32")  # default: the checkpoint's own dtype, float32
    assert json.loads((out / "config.json").read_text())["dtype"] == str(expected).removeprefix("torch.")
    original = AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert loaded.dtype == expected
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == expected, name
        assert torch.equal(tensor, original[name].to(expected)), name


# ----------------------------------------------------------------------------- every safetensors dtype

def _cast_fixture(tmp_path, dtype):
    """The fixture with every tensor cast to `dtype`, written by safetensors itself."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "qwen3-tiny", hf)
    tensors = {k: (v * 64).to(dtype) for k, v in load_file(hf / "model.safetensors").items()}
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return hf, tensors


def _safetensors_dtypes():
    from safetensors.torch import _TYPES

    return sorted(_TYPES.items())


@pytest.mark.parametrize("code,dtype", _safetensors_dtypes(), ids=[code for code, _ in _safetensors_dtypes()])
def test_every_safetensors_dtype_round_trips_or_is_refused_up_front(tmp_path, code, dtype):
    """Each dtype the safetensors format has (safetensors' own list), through both formats: a round
    trip bit for bit (safetensors reads the result), or one line at hf2mcore time naming a tensor
    and the dtype, never a failure when the checkpoint is read back."""
    from tests.conftest import assert_hf_bits_equal
    from tests.test_errors import assert_refused, mconv

    hf, tensors = _cast_fixture(tmp_path, dtype)
    for fmt in ("torch_dist", "torch"):
        ckpt, out = tmp_path / f"ckpt-{fmt}", tmp_path / f"out-{fmt}"
        result = mconv("hf2mcore", hf, ckpt, "--tp", "2", "--format", fmt, "-q")
        if result.exit_code:
            assert_refused(result, ckpt, ": tensor ", f"dtype {code}")
            continue
        result = mconv("mcore2hf", ckpt, out, "-q")
        assert result.exit_code == 0, result.output
        assert_hf_bits_equal(tensors, out)


# ----------------------------------------------------------------------------- hf2mcore --dtype

# What Megatron-LM's args hold for a job run with --bf16, --fp16 or neither (its validate_args sets
# params_dtype from the flags): params_dtype, bf16, fp16.
MEGATRON_FLAGS = {torch.float32: (torch.float32, False, False), torch.bfloat16: (torch.bfloat16, True, False),
                  torch.float16: (torch.float16, False, True)}


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype_on_import(fp32_checkpoint, tmp_path, fmt, dtype):
    """hf2mcore --dtype: every stored tensor is torch's cast of the HF tensor (read back by
    safetensors after mcore2hf, and by torch.load from the legacy rank files), the args record the
    dtype as Megatron-LM does, and mcore2hf gives the cast tensors back."""
    from safetensors.torch import load_file

    from tests.conftest import assert_hf_bits_equal, load_rank_file

    fp32, _ = fp32_checkpoint
    target = getattr(torch, dtype)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    result = CliRunner().invoke(main, ["hf2mcore", str(fp32), str(ckpt), "--tp", "2", "--format", fmt,
                                       "--dtype", dtype, "-q"])
    assert result.exit_code == 0, result.output
    if fmt == "torch":
        states = [load_rank_file(path) for path in sorted(ckpt.glob("release/mp_rank_*/model_optim_rng.pt"))]
        assert {t.dtype for state in states for t in state["model"].values() if isinstance(t, torch.Tensor)} == {target}
    else:
        states = [load_rank_file(ckpt / "release" / "common.pt")]
    for state in states:
        args = state["args"]
        assert (args.params_dtype, args.bf16, args.fp16) == MEGATRON_FLAGS[target]
    assert json.loads((ckpt / "mconv.json").read_text())["dtype"] == dtype
    assert CliRunner().invoke(main, ["mcore2hf", str(ckpt), str(out), "-q"]).exit_code == 0
    assert_hf_bits_equal({k: v.to(target) for k, v in load_file(fp32 / "model.safetensors").items()}, out)


# ----------------------------------------------------------------------------- casts beyond the range

OVERFLOW = ("cannot cast model.layers.0.mlp.down_proj.weight to float16: values up to 1e+30 are beyond "
            "float16's range (65504)")


@pytest.fixture(scope="module")
def huge_value(tmp_path_factory):
    """The bfloat16 fixture with one value float16 cannot hold (1e30), and its TP2 legacy checkpoint."""
    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("huge")
    hf = tmp / "hf"
    shutil.copytree(FIXTURES / "qwen3-tiny", hf)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][3, 5] = 1e30
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    ckpt = tmp / "ckpt"
    result = CliRunner().invoke(main, ["hf2mcore", str(hf), str(ckpt), "--tp", "2", "--format", "torch", "-q"])
    assert result.exit_code == 0, result.output
    return hf, ckpt


@pytest.mark.parametrize("tp", ["1", "2"])  # TP1 reads the rows cast; TP2 splits down_proj by columns, then casts
def test_hf2mcore_refuses_a_cast_to_inf(huge_value, tmp_path, tp):
    from tests.test_errors import assert_refused

    hf, _ = huge_value
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["hf2mcore", str(hf), str(out), "--tp", tp, "--dtype", "float16", "-q"])
    assert_refused(result, out, OVERFLOW)
    # the oracle: torch's own cast turns the value into inf; bfloat16 holds it
    assert torch.tensor(1e30, dtype=torch.bfloat16).to(torch.float16).isinf()
    assert CliRunner().invoke(main, ["hf2mcore", str(hf), str(out), "--dtype", "bfloat16", "-q"]).exit_code == 0


def test_mcore2hf_refuses_a_cast_to_inf(huge_value, tmp_path):
    from tests.test_errors import assert_refused

    _, ckpt = huge_value
    out = tmp_path / "out"
    assert_refused(CliRunner().invoke(main, ["mcore2hf", str(ckpt), str(out), "--dtype", "float16", "-q"]),
                   out, OVERFLOW)


def test_a_merged_adapter_cast_to_inf_is_refused(huge_value, tmp_path):
    """export-lora --merge --dtype float16 goes through the same check (base + delta, then the cast)."""
    from mconv import Layout
    from tests.test_errors import assert_refused
    from tests.test_lora import lora_checkpoint

    hf, _ = huge_value
    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-tiny", Layout(), adapter_only=True)
    out = tmp_path / "out"
    assert_refused(CliRunner().invoke(main, ["export-lora", str(lora), str(out), "--alpha", "8", "--merge",
                                             "--base-model", str(hf), "--dtype", "float16"]), out, OVERFLOW)
