"""export-lora for Qwen3-VL, dense and MoE: Megatron-Bridge LoRA adapters (made in Megatron layout by
tests/test_lora.py's Adapters) on the language model's linear layers, the routed experts, and the
vision tower's blocks and patch mergers (`linear_qkv` with the vision per-head interleave, the
non-gated `linear_fc1`, `linear_proj`, `linear_fc2`; biases untouched) become one PEFT adapter:
`model.language_model.layers.*`, `model.visual.*`, and for the stacked experts of Qwen3-VL-MoE the
3-D form of peft's `target_parameters` (which vLLM reads).

Oracles: peft's PeftModel on transformers' Qwen3VL(Moe)ForConditionalGeneration with the exported
adapter gives the logits of transformers on the `--merge` output (text-only and text+image), and
`--merge` equals mcore2hf of the rank files with the adapters merged in Megatron layout (mcore2hf
itself checked against mbridge's Qwen3VLModel in test_qwen3_vl_oracle.py); and (slow) peft's logits
equal mbridge's Megatron Qwen3VLModel running the merged rank files at MoE TP2/EP2.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.make_fixtures import make_qwen3_vl
from mconv import Layout, mcore2hf
from mconv.converter.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mconv.converter.transforms import padded_vocab_size
from tests.conftest import FIXTURES
from tests.qwen3_vl_oracle import PATCHES, VLRun, example_inputs, hf_logits, megatron_logits
from tests.test_errors import assert_refused, mconv
from tests.test_lora import ALPHA, R, export, lora_checkpoint
from tests.test_roundtrip import read_all

DENSE = FIXTURES / "qwen3-vl-tiny"
VISION_LINEAR = (".attn.qkv.weight", ".attn.proj.weight", ".linear_fc1.weight", ".linear_fc2.weight")


def all_moe(tmp: Path) -> Path:
    """Qwen3-VL-MoE without dense layers (4.x expert orientation on disk): peft 0.21 on transformers 5
    retargets gate/up/down_proj LoRA on a MoE model's dense MLPs to the fused expert parameters, so
    the peft oracle runs on a model whose MLPs are all experts (dense layers: the merge oracle)."""
    return make_qwen3_vl(tmp / "hf", seed=7, moe=True, text={"mlp_only_layers": []})


def peft_logits(hf_dir: Path, adapter: Path, inputs: dict) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32),
                                      adapter).eval()
    out = {}
    with torch.no_grad():
        for name, (ids, pixels) in inputs.items():
            extra = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": torch.tensor([PATCHES]),
                                               "mm_token_type_ids": (ids == model.config.image_token_id).int()}
            out[name] = model(input_ids=ids, **extra).logits
    return out


def assert_merge_equals_megatron_layout_merge(tmp_path: Path, hf_dir: Path, lora: Path, merged: Path) -> None:
    export(lora, tmp_path / "ours", "--merge", "--base-model", hf_dir, "--dtype", "float32")
    mcore2hf(merged, tmp_path / "theirs", progress=False, expert_orientation="4.x")
    ours, theirs, base = read_all(tmp_path / "ours"), read_all(tmp_path / "theirs"), read_all(hf_dir)
    assert ours.keys() == theirs.keys() == base.keys()
    for name in ours:
        assert ours[name].shape == base[name].shape, name  # stacked experts in the base model's orientation
        assert torch.allclose(ours[name], theirs[name].float(), atol=1e-6, rtol=0), name
        # every linear layer of the language model and the vision tower got its delta, nothing else changed
        adapted = (name.startswith("model.language_model.layers.") and name.endswith(("proj.weight", "_proj"))
                   or name.startswith("model.visual.") and name.endswith(VISION_LINEAR))
        assert torch.equal(ours[name], base[name].float()) != adapted, name


def assert_peft_equals_merge(tmp_path: Path, hf_dir: Path) -> None:
    inputs = example_inputs(json.loads((hf_dir / "config.json").read_text()))
    reference = hf_logits(tmp_path / "ours", inputs)
    logits = peft_logits(hf_dir, tmp_path / "adapter", inputs)
    for name in inputs:
        assert (logits[name] - reference[name]).abs().max() < 1e-4, name
        assert (reference[name] - hf_logits(hf_dir, {name: inputs[name]})[name]).abs().max() > 1e-2  # it matters


def test_dense_adapter_and_merge(tmp_path):
    lora, merged = lora_checkpoint(tmp_path, DENSE, Layout(tp=2), vision=True)
    export(lora, tmp_path / "adapter")
    assert_merge_equals_megatron_layout_merge(tmp_path, DENSE, lora, merged)
    assert_peft_equals_merge(tmp_path, DENSE)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    # attn.proj, not proj: peft matches target_modules as name suffixes, and patch_embed.proj (a Conv3d) has no adapter
    assert config["target_modules"] == ["attn.proj", "down_proj", "gate_proj", "k_proj", "linear_fc1", "linear_fc2",
                                        "o_proj", "q_proj", "qkv", "up_proj", "v_proj"]
    assert "target_parameters" not in config
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert tensors["base_model.model.model.visual.blocks.1.attn.qkv.lora_B.weight"].shape == (3 * 32, R)
    assert tensors["base_model.model.model.visual.deepstack_merger_list.1.linear_fc1.lora_A.weight"].shape == (R, 128)
    assert not any(key.endswith("bias") for key in tensors)


@pytest.mark.parametrize("sizes,spec", [(dict(tp=2, ep=2, etp=1), "te"), (dict(tp=2, ep=2, etp=2), "local")],
                         ids=["tp2-ep2-etp1-te-grouped", "tp2-ep2-etp2-local"])
def test_moe_expert_adapters_in_the_3d_form(tmp_path, sizes, spec):
    """The routed experts' adapters (per expert, or one per EP rank under TE grouped GEMM) become
    `mlp.experts.base_layer.lora_A/B` (gate_up_proj) and `mlp.experts.lora_A/B` (down_proj)."""
    hf_dir = all_moe(tmp_path)
    lora, merged = lora_checkpoint(tmp_path, hf_dir, Layout(**sizes), spec=spec, vision=True)
    export(lora, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert not {"gate_proj", "up_proj", "down_proj", "experts"} & set(config["target_modules"])
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    p, experts, hidden, ffn = "base_model.model.model.language_model.layers.2.mlp.experts.", 4, 64, 40
    assert tensors[p + "base_layer.lora_A.weight"].shape == (experts * R, hidden)
    assert tensors[p + "base_layer.lora_B.weight"].shape == (2 * ffn, R * experts)
    assert tensors[p + "lora_A.weight"].shape == (experts * R, ffn)
    assert tensors[p + "lora_B.weight"].shape == (hidden, R * experts)
    assert_merge_equals_megatron_layout_merge(tmp_path, hf_dir, lora, merged)
    assert_peft_equals_merge(tmp_path, hf_dir)


def test_moe_with_dense_layers_merge(tmp_path):
    """The MoE fixture's dense layer (mlp_only_layers) keeps its per-module adapters beside the 3-D ones."""
    hf_dir = FIXTURES / "qwen3-vl-moe-tiny"
    lora, merged = lora_checkpoint(tmp_path, hf_dir, Layout(tp=2, ep=2), vision=True)
    export(lora, tmp_path / "adapter")
    assert_merge_equals_megatron_layout_merge(tmp_path, hf_dir, lora, merged)
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert "base_model.model.model.language_model.layers.1.mlp.gate_proj.lora_A.weight" in tensors
    assert "base_model.model.model.language_model.layers.1.mlp.experts.lora_A.weight" not in tensors
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} <= set(config["target_modules"])


def test_canonical_expert_adapters_of_stacked_experts_are_refused(tmp_path):
    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-vl-moe-tiny", Layout(tp=2, ep=2), canonical=True)
    assert_refused(mconv("export-lora", lora, tmp_path / "out", "--alpha", ALPHA, "-q"), tmp_path / "out",
                   "separate gate and up adapters (CanonicalLoRA)")


@pytest.mark.slow
def test_peft_equals_mbridge_forward_of_merged_rank_files(tmp_path):
    """mbridge's Megatron Qwen3VLModel (gloo, TP2/EP2/ETP1) on the rank files with the adapters merged
    in Megatron layout gives peft's logits on the exported adapter, text-only and text+image."""
    hf_dir = all_moe(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    lora, merged = lora_checkpoint(tmp_path, hf_dir, Layout(tp=2, ep=2), vision=True)
    export(lora, tmp_path / "adapter")
    inputs = example_inputs(config)
    run = VLRun(merged, config, tp=2, ep=2, etp=1, inputs=inputs,
                padded_vocab=padded_vocab_size(config["text_config"]["vocab_size"], 128, 2))
    reference = megatron_logits(run, tmp_path)
    logits = peft_logits(hf_dir, tmp_path / "adapter", inputs)
    for name in inputs:
        assert (logits[name] - reference[name]).abs().max() < 1e-4, name
        assert (reference[name] - hf_logits(hf_dir, {name: inputs[name]})[name]).abs().max() > 1e-2, name
