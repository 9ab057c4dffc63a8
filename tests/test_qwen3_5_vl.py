"""Qwen3.5-VL (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`): export-lora and
mconv.live on the vision-language classes.

export-lora: Megatron-Bridge LoRA adapters (tests/test_lora.py's Adapters, in Megatron layout) on every linear
layer of the language model (delta-net in_proj / out_proj, the gated linear_qkv, linear_proj, the MLPs, the
MoE model's shared expert and routed experts, the MTP block's layer) and of the vision tower (blocks and patch
merger). Oracles: peft's PeftModel on transformers' own VL class with the exported adapter, merged
(`merge_and_unload`), and export-lora `--merge`, both equal mcore2hf of the rank files with the adapters
merged in Megatron layout (mcore2hf itself proven for these classes by tests/test_qwen3_5.py).

mconv.live (slow): Megatron-Bridge's own Qwen3VLModel, built as its Qwen3.5-VL providers build it
(tests/qwen3_5_vl_oracle.py), loaded by `load_hf_weights` must hold hf2mcore's rank files' tensors, and
`iter_hf_weights` / `save_hf_weights` must give back the HF checkpoint bit for bit.
"""
from __future__ import annotations

import argparse

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from fixtures.make_fixtures import make_qwen3_5
from mconv import Layout, hf2mcore, mcore2hf
from mconv.cli import main
from tests.test_lora import export, lora_checkpoint
from tests.test_roundtrip import read_all

MTP_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron-Bridge's default targets


@pytest.mark.parametrize("model,sizes", [("qwen3_5_vl_dir", dict(tp=2)), ("qwen3_6_vl_moe_dir", dict(tp=2, ep=2))],
                         ids=["dense-tp2", "moe-tp2-ep2"])
def test_export_lora_peft_merge_equals_megatron_layout_merge(tmp_path, request, model, sizes):
    """Adapters at TP2 (`--spec te`, `--mtp`; the MoE model at EP2 as well) on the language model, its MTP
    layer and the vision tower. peft on transformers' VL class loads the exported adapter with no missing and
    no unexpected LoRA module but the MTP layer's (transformers has no MTP module, and peft leaves them out);
    its merge_and_unload, export-lora --merge and mcore2hf of the Megatron-layout merge are the same weights,
    under the names transformers' VL class gives them (`model.language_model.`, `model.visual.`), the MTP
    layer's (`mtp.layers.0.`) from --merge and the Megatron-layout merge."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    hf_dir = request.getfixturevalue(model)
    lora, merged = lora_checkpoint(tmp_path, hf_dir, Layout(**sizes), spec="te", vision=True, mtp=MTP_TARGETS)
    export(lora, tmp_path / "adapter")
    export(lora, tmp_path / "ours", "--merge", "--base-model", hf_dir, "--dtype", "float32")
    mcore2hf(merged, tmp_path / "theirs", progress=False)
    theirs, ours, original = read_all(tmp_path / "theirs"), read_all(tmp_path / "ours"), read_all(hf_dir)

    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    base = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    injected = {name.removeprefix("base_model.model.").replace(".default.weight", ".weight")
                for name, _ in peft_model.named_parameters() if ".lora_" in name}
    exported = {name.removeprefix("base_model.model.") for name in adapter}
    mtp_modules = {name for name in exported if name.startswith("mtp.")}
    assert mtp_modules and injected == exported - mtp_modules
    peft_merged = peft_model.merge_and_unload().state_dict()

    assert ours.keys() == theirs.keys() == original.keys()
    changed = 0
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor.float(), atol=1e-6, rtol=0), name
        if not name.startswith("mtp."):
            assert torch.allclose(peft_merged[name], tensor.float(), atol=1e-6, rtol=0), name
        changed += not torch.equal(tensor.float(), original[name].float())
    modules = {name.rsplit(".lora_", 1)[0] for name in exported}
    assert changed == len(modules)  # every adapted weight changed (a stacked experts tensor: once), nothing else
    assert any(name.startswith("model.visual.") for name in modules)
    # the MoE model's MTP experts: TE grouped GEMM, one adapter per EP rank, as in its decoder layers
    assert ("mtp.layers.0.mlp.experts.base_layer" in modules) == (model == "qwen3_6_vl_moe_dir")
    assert any(name.startswith("model.language_model.layers.") and ".linear_attn.in_proj_qkv" in name
               for name in modules)


def test_export_lora_mtp_grouped_experts(tmp_path, qwen3_5_moe_dir):
    """The text class: Megatron-Bridge's LoRA on the MTP layer's TE grouped-GEMM experts (one adapter per EP
    rank, `mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc1.adapter.*`) at TP2/EP2, beside the decoder's:
    export-lora writes them in the 3-D form of the model's experts, and --merge equals mcore2hf of the
    Megatron-layout merge, the MTP layer's experts changed and kept per expert as the base holds them
    (mcore2hf's `hf_mtp_experts`), beside the fused decoder experts."""
    lora, merged = lora_checkpoint(tmp_path, qwen3_5_moe_dir, Layout(tp=2, ep=2), spec="te", mtp=MTP_TARGETS)
    export(lora, tmp_path / "adapter")
    export(lora, tmp_path / "ours", "--merge", "--base-model", qwen3_5_moe_dir, "--dtype", "float32")
    mcore2hf(merged, tmp_path / "theirs", progress=False)
    ours, theirs, original = read_all(tmp_path / "ours"), read_all(tmp_path / "theirs"), read_all(qwen3_5_moe_dir)
    assert ours.keys() == theirs.keys() == original.keys()
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor.float(), atol=1e-6, rtol=0), name
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.mtp.layers.0.mlp.experts.base_layer.lora_A.weight" in adapter  # the 3-D form
    assert not torch.equal(ours["mtp.layers.0.mlp.experts.3.down_proj.weight"],
                           original["mtp.layers.0.mlp.experts.3.down_proj.weight"].float())


@pytest.mark.slow
def test_live_load_iter_and_save(tmp_path, qwen3_5_vl_dir, qwen3_6_vl_moe_dir):
    """mconv.live on Megatron-Bridge's Qwen3VLModel for Qwen3.5-VL (tests/qwen3_5_vl_oracle.py: its vision
    tower and its language model from megatron-core's gated delta-net block spec and MTP block spec, bfloat16),
    dense at TP2 and at PP2 (the vision tower on the first stage, the MTP block on the last) and MoE at
    TP2/EP2/ETP1, one after another in one pair of gloo processes. Its parameters are exactly those
    mconv plans (LiveModel refuses any unknown or missing one); `load_hf_weights` gives them, bit for bit,
    the tensors of hf2mcore's `--spec te --mtp` rank files (no more, no less), whose layout
    tests/test_qwen3_5.py holds to megatron-core's GPTModel (language model) and Qwen3-VL's rules to
    mbridge's Qwen3VLModel (vision tower); `iter_hf_weights` yields every HF tensor of the checkpoint
    (vision tower, language model, MTP layer) exactly once on every rank with `gather_pp`, and at PP2 each
    stage its own part, bit for bit (experts per expert, and with `stacked_experts` as the checkpoint fuses
    them); `save_hf_weights` writes a directory
    `mconv verify` finds identical to the input."""
    from mconv.converter.hf_io import HFCheckpoint
    from tests.megatron_oracle import MegatronRun, read_config, trainer_args
    from tests.qwen3_5_vl_oracle import Case, run_live
    from tests.test_oracle_megatron import stored_args

    cases = []
    for name, hf_dir, sizes in (("dense", qwen3_5_vl_dir, dict(tp=2)), ("dense-pp2", qwen3_5_vl_dir, dict(pp=2)),
                                ("moe", qwen3_6_vl_moe_dir, dict(tp=2, ep=2))):
        ranks = tmp_path / name / "ranks"
        hf2mcore(hf_dir, ranks, Layout(**sizes), spec="te", fmt="torch", mtp=True, progress=False)
        # mrope as rope: Megatron-LM's validate_args refuses MTP with mrope (Megatron-Bridge builds it)
        stored = argparse.Namespace(**{**vars(stored_args(ranks)), "position_embedding_type": "rope"})
        args = trainer_args(stored, MegatronRun(None, read_config(hf_dir), **sizes, etp=1))
        cases.append(Case(hf_dir, ranks, args, tmp_path / name / "live", **sizes))
    run_live(cases)

    for case in cases:
        source = HFCheckpoint(case.hf_dir)  # the fused experts as per-expert views
        files = read_all(case.hf_dir)
        assert any(n.startswith("model.visual.") for n in files) and any(n.startswith("mtp.") for n in files)
        per_expert = {n: source.read(n) for n in source.tensors}
        for label, expected in (("yielded", per_expert), ("stage", per_expert), ("stacked", files)):
            if label == "stage" and case.pp == 1 or label == "stacked" and case.ep == 1:
                continue
            # with PP each rank is one stage: the two stages' tensors together, each once
            yielded = [[pair for bucket in torch.load(case.out / f"{label}{rank}.pt") for pair in bucket]
                       for rank in range(2)]
            for pairs in ([yielded[0] + yielded[1]] if label == "stage" else yielded):
                names = [name for name, _ in pairs]
                assert len(names) == len(set(names)) and sorted(names) == sorted(expected), (label, case.pp)
                for name, tensor in pairs:
                    assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
            if label == "stage":  # the vision tower on the first stage, the MTP layer on the last
                assert any(n.startswith("model.visual.") for n, _ in yielded[0])
                assert not any(n.startswith("model.visual.") for n, _ in yielded[1])
                assert any(n.startswith("mtp.") for n, _ in yielded[1])
                assert not any(n.startswith("mtp.") for n, _ in yielded[0])
        done = CliRunner().invoke(main, ["verify", str(case.hf_dir), str(case.out / "saved")])
        assert done.exit_code == 0 and done.output.startswith("identical: "), done.output
