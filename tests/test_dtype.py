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
