"""Tensors a model keeps in float32 (the tables' Rule.fp32) under a cast: what `hf2mcore --dtype` and
`mcore2hf --dtype` write equals what transformers' own `from_pretrained(dtype=...)` holds, tensor by
tensor (the live `iter_hf_weights(dtype=)` is checked the same way in test_bailing_oracle.py)."""
import importlib
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors import safe_open

from fixtures.make_fixtures import make_bailing_v3
from mconv import Layout, hf2mcore
from mconv.cli import main
from mconv.mappings import ARCHITECTURES
from tests.test_roundtrip import assert_bit_identical, read_all


def bailing_fp32_modules() -> list[str]:
    """The BailingMoeV3 tensors a cast keeps in float32. Its HF code is remote code (not in
    transformers; it builds `A_log` and `dt_bias` in float32 and the releases store them and the
    router's `expert_bias` in float32, reference bailing-v3.md), so the names are those transformers
    keeps in float32 (`_keep_in_fp32_modules_strict`) in its models of the same modules: DeepSeek-V3's
    router selection bias (`e_score_correction_bias`, Bailing's `expert_bias`: test_bailing_oracle.py
    runs Bailing's router as DeepseekV3MoE with it) and the KDA decay gate's `A_log` / `dt_bias`
    (Glm5Next; it also keeps its `conv1d`, which Bailing's remote code builds in the model's dtype)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextPreTrainedModel

    assert "e_score_correction_bias" in DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict
    assert {"A_log", "dt_bias"} <= set(Glm5NextPreTrainedModel._keep_in_fp32_modules_strict)
    return ["expert_bias", "A_log", "dt_bias"]


def transformers_cast(hf_dir: Path, dtype: torch.dtype, fp32_modules: list[str]) -> dict[str, torch.Tensor]:
    """The state dict transformers' `from_pretrained(hf_dir, dtype=dtype)` loads into a model with
    one parameter per tensor of `hf_dir/model.safetensors` (named as there) that keeps
    `fp32_modules` in float32 (`_keep_in_fp32_modules_strict`): transformers' own loading path
    decides each tensor's dtype and casts it."""
    from transformers import PretrainedConfig, PreTrainedModel

    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}

    class Checkpoint(PreTrainedModel):
        config_class = PretrainedConfig
        _keep_in_fp32_modules_strict = fp32_modules

        def __init__(self, config):
            super().__init__(config)
            for name, shape in shapes.items():
                module, (*path, leaf) = self, name.split(".")
                for part in path:
                    if not hasattr(module, part):
                        module.add_module(part, torch.nn.Module())
                    module = getattr(module, part)
                module.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape)))
            self.post_init()

        def _init_weights(self, module):
            pass

    model, info = Checkpoint.from_pretrained(hf_dir, config=PretrainedConfig(), dtype=dtype, output_loading_info=True)
    assert not any(info.values()), info
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_qwen3_models_keep_no_tensor_in_float32():
    """transformers keeps nothing in float32 in Qwen3, Qwen3-MoE, Qwen3-VL or Qwen3-VL-MoE (no model
    class there has `_keep_in_fp32_modules` or `_keep_in_fp32_modules_strict`), and neither do their tables."""
    from transformers import PreTrainedModel

    for name, module in (("Qwen3ForCausalLM", "qwen3"), ("Qwen3MoeForCausalLM", "qwen3_moe"),
                         ("Qwen3VLForConditionalGeneration", "qwen3_vl"),
                         ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe")):
        classes = [c for c in vars(importlib.import_module(f"transformers.models.{module}.modeling_{module}")).values()
                   if isinstance(c, type) and issubclass(c, PreTrainedModel)]
        assert classes and not any(c._keep_in_fp32_modules or c._keep_in_fp32_modules_strict for c in classes), name
        assert not any(rule.fp32 for rule in ARCHITECTURES[name].rules), name


def test_bailing_cast_keeps_float32_tensors(tmp_path):
    """A float32 BailingMoeV3 cast to bfloat16 on the way in (`hf2mcore --dtype`) or out (`mcore2hf
    --dtype`) is, tensor by tensor, what transformers loads with dtype=bfloat16: `expert_bias`,
    `A_log` and `dt_bias` stay float32 (they came out bfloat16), every other tensor is torch's cast;
    each command says so in one line."""
    hf = make_bailing_v3(tmp_path / "hf", seed=3, dtype=torch.float32, tokenizer=False)
    expected = transformers_cast(hf, torch.bfloat16, bailing_fp32_modules())
    note = ("mconv: note: kept 6 tensors in float32, as the model keeps them (attention.A_log, attention.dt_bias, "
            "mlp.gate.expert_bias); --dtype bfloat16 cast the others")

    def mconv(*args) -> str:
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result.stderr

    assert note in mconv("hf2mcore", hf, tmp_path / "in", "--tp", 2, "--format", "torch", "--dtype", "bfloat16")
    assert "note" not in mconv("mcore2hf", tmp_path / "in", tmp_path / "in-hf")
    hf2mcore(hf, tmp_path / "out", Layout(tp=2), progress=False)
    assert mconv("mcore2hf", tmp_path / "out", tmp_path / "out-hf", "--dtype", "bfloat16").splitlines() == [note]
    for back in ("in-hf", "out-hf"):
        assert_bit_identical(expected, read_all(tmp_path / back))
