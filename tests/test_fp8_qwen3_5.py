"""Block-wise FP8 of Qwen3.5 / Qwen3.6 (dense and MoE, text and VL, with MTP) and Qwen3-Next, as Qwen's
FP8 releases hold it (docs/fp8.md, "Qwen3.5, Qwen3.6 and Qwen3-Next"): which tensors are FP8 is
written out here per tensor kind from those sources, not taken from mconv's table; their bytes and
scales are compressed-tensors' block quantization of the bf16 weights (fused Megatron sections, gated
`linear_qkv`, experts: each HF tensor, or each expert's matrix, quantized on its own; the MoE models'
experts per expert as the releases hold them, stacked only with --expert-orientation); the skip
list names exactly the 16-bit weights' modules; FP8 -> Megatron -> FP8 gives the same bytes
(`mconv verify`); and transformers 5 loads the output (128-aligned models: its dequantizing reader is
exact only there) as the dequantization formula gives it."""
import json

import pytest
import torch

from fixtures.make_fixtures import make_qwen3_5
from mconv import Layout, hf2mcore, mcore2hf
from mconv.converter.pipelines import compare_hf
from tests.conftest import hf_tensors
from tests.test_fp8 import KEYS, bits, needs_compressed_tensors, reference_quantize

# The releases' FP8 tensors, by the name past the layer: attention (gated q_proj included), the delta-net's
# q/k/v and z (Qwen3-Next: qkvz) and out_proj, dense and shared-expert MLPs, routed experts (per expert or
# stacked), in the decoder and in the MTP layer.
FP8_KINDS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
             "linear_attn.in_proj_qkvz.weight",
             "linear_attn.out_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
             "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# And those they keep in 16-bit: the delta-net's b and a (ba), conv1d, decay and norm, every norm, the
# router and shared-expert gate, MTP's fc, embeddings, lm_head, the whole vision tower.
KEPT_KINDS = ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.in_proj_ba.weight",
              "linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias", "norm.weight",
              "layernorm.weight", "norm_embedding.weight", "norm_hidden.weight", "mlp.gate.weight",
              "mlp.shared_expert_gate.weight", "mtp.fc.weight", "embed_tokens.weight", "lm_head.weight")


def is_fp8(name: str) -> bool:
    """Which the releases store in FP8; every tensor of the fixtures is one kind or the other."""
    fp8, kept = name.endswith(FP8_KINDS), name.endswith(KEPT_KINDS) or name.startswith("model.visual.")
    assert fp8 != kept, name
    return fp8 and not name.startswith("model.visual.")


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with stacked experts as Qwen's FP8 releases name them, per expert: `gate_up_proj
    [E, 2I, h]` (transformers 5.x's orientation, gate rows first) as `{e}.gate_proj.weight` and
    `{e}.up_proj.weight`, `down_proj [E, h, I]` as `{e}.down_proj.weight`."""
    out = {}
    for name, tensor in tensors.items():
        prefix, _, proj = name.rpartition(".mlp.experts.")
        if proj == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            out.update({f"{prefix}.mlp.experts.{e}.{part}.weight": matrix[e]
                        for e in range(len(tensor)) for part, matrix in (("gate_proj", gate), ("up_proj", up))})
        elif proj == "down_proj":
            out.update({f"{prefix}.mlp.experts.{e}.down_proj.weight": tensor[e] for e in range(len(tensor))})
        else:
            out[name] = tensor
    return out


def stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with per-expert experts stacked, as the bf16 releases hold them (per_expert's inverse)."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        prefix, found, rest = name.partition(".mlp.experts.")
        expert, _, part = rest.partition(".")
        if found and expert.isdigit():
            proj = "down_proj" if part == "down_proj.weight" else "gate_up_proj"
            experts.setdefault(f"{prefix}.mlp.experts.{proj}", {}).setdefault(int(expert), {})[part] = tensor
        else:
            out[name] = tensor
    for name, by_expert in experts.items():  # gate_proj before up_proj
        out[name] = torch.stack([torch.cat([parts[p] for p in sorted(parts)]) for _, parts in sorted(by_expert.items())])
    return out


def assert_quantized(original: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> list[str]:
    """Each FP8 kind of `original` is written as compressed-tensors quantizes it (with its
    `_scale_inv`), every other tensor as it was; returns the FP8 names."""
    quantized = [name for name in original if is_fp8(name)]
    assert written.keys() == original.keys() | {name + "_scale_inv" for name in quantized}
    for name, tensor in original.items():
        if name in quantized:
            q, scale = expected_fp8(tensor)
            assert torch.equal(bits(written[name]), bits(q)) and torch.equal(written[name + "_scale_inv"], scale), name
        else:
            assert written[name].dtype == tensor.dtype and torch.equal(bits(written[name]), bits(tensor)), name
    return quantized


def expected_fp8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' block quantization of a weight, or of each expert's matrix of a stacked one."""
    if tensor.dim() == 2:
        return reference_quantize(tensor)
    q, scale = zip(*(reference_quantize(matrix) for matrix in tensor))
    return torch.stack(q), torch.stack(scale)


@needs_compressed_tensors
@pytest.mark.parametrize("model,sizes", [
    ("qwen3_5_mtp_dir", dict(tp=2)), ("qwen3_5_moe_dir", dict(tp=2, ep=2)), ("qwen3_next_dir", dict(tp=2, ep=2)),
    ("qwen3_5_vl_dir", dict(tp=2)), ("qwen3_6_vl_moe_dir", dict(tp=2, ep=2, etp=2))],
    ids=["dense-mtp", "moe-stacked-mtp", "next", "vl", "vl-moe-stacked-mtp"])
def test_written_as_the_releases(tmp_path, request, model, sizes):
    """`mcore2hf --quantize fp8` from TP2 (EP2, ETP2: delta-net sections, gated linear_qkv and experts
    split) writes each FP8 kind as compressed-tensors quantizes the HF tensor (none of these tiny
    dimensions is a multiple of 128: edge blocks everywhere), every other tensor as it was, and
    modules_to_not_convert naming exactly the 16-bit weights' modules in full; the MoE models' experts,
    stacked in the input (decoder; Qwen3.6's MTP layer too), per expert as the FP8 releases hold them,
    each module quantized on its own, and stacked, each expert's matrix quantized, with
    --expert-orientation 5.x; read back and written again it gives the same bytes (`mconv verify`)
    and the same quantization_config."""
    source = request.getfixturevalue(model)
    layout = Layout(**sizes)
    hf2mcore(source, tmp_path / "m", layout, fmt="torch", mtp=True, progress=False)
    summary = mcore2hf(tmp_path / "m", tmp_path / "fp8", progress=False, quantize="fp8")
    original, written = hf_tensors(source), hf_tensors(tmp_path / "fp8")
    quantized = assert_quantized(per_expert(original), written)
    if "moe" in model:
        assert any(name.endswith(".mlp.experts.gate_up_proj") for name in original)
        lm = "model.language_model." if "vl" in model else "model."
        assert {f"{lm}layers.0.mlp.experts.3.up_proj.weight_scale_inv",
                "mtp.layers.0.mlp.experts.3.down_proj.weight_scale_inv"} <= written.keys()
        assert any("written per expert" in note for note in summary.notes), summary.notes
        fused = mcore2hf(tmp_path / "m", tmp_path / "fp8-5.x", progress=False, quantize="fp8", expert_orientation="5.x")
        assert_quantized(stacked(per_expert(original)), hf_tensors(tmp_path / "fp8-5.x"))  # Qwen3.5's MTP too
        assert not any("written per expert" in note for note in fused.notes)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    kept = config.pop("modules_to_not_convert")
    assert config == KEYS
    sixteen_bit = [name for name in original if name not in quantized and name.endswith(".weight")]
    assert sorted(kept) == sorted(name.removesuffix(".weight") for name in sixteen_bit)
    lm = "model.language_model." if "vl" in model else "model."
    assert {"mtp.fc", "lm_head", lm + "layers.0.input_layernorm"} <= set(kept)
    ba = ["linear_attn.in_proj_ba"] if model == "qwen3_next_dir" else ["linear_attn.in_proj_b", "linear_attn.in_proj_a"]
    assert {f"{lm}layers.1.{m}" for m in ba + ["linear_attn.conv1d", "linear_attn.norm"]} <= set(kept)
    if "moe" in model or "next" in model:
        assert {lm + "layers.0.mlp.gate", lm + "layers.0.mlp.shared_expert_gate", "mtp.layers.0.mlp.gate"} <= set(kept)
    if "vl" in model:
        assert "model.visual.blocks.0.attn.qkv" in kept and "model.visual.merger.linear_fc2" in kept

    hf2mcore(tmp_path / "fp8", tmp_path / "m-fp8", layout, fmt="torch", mtp=True, progress=False)
    mcore2hf(tmp_path / "m-fp8", tmp_path / "again", progress=False, quantize="fp8")
    tensors, _, differences = compare_hf(tmp_path / "fp8", tmp_path / "again")
    assert differences == [] and tensors >= len(written)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"] == {
        **config, "modules_to_not_convert": kept}


# 128-aligned shapes (one key and one value head of 128, head_dim 128, MLPs of 128 and 256): every FP8
# tensor is whole blocks, where transformers' dequantization is right (reference fp8.md 3.1).
ALIGNED = dict(hidden_size=128, head_dim=128, num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=1,
               linear_num_value_heads=1, linear_key_head_dim=128, linear_value_head_dim=128)
EXPERTS = dict(moe_intermediate_size=128, shared_expert_intermediate_size=128)


@needs_compressed_tensors
@pytest.mark.parametrize("kind", ["dense", "moe", "moe-stacked", "next"])
def test_transformers_loads_the_output(tmp_path, kind):
    """transformers 5 loads `mcore2hf --quantize fp8` of a 128-aligned model (on a CPU it dequantizes FP8
    itself) with no missing or unexpected keys: every parameter equals `float(q) * scale` of the written
    tensors (the formula, written out here) bit for bit, the other tensors the written bf16 ones. The
    MoE models' experts are written per expert, as Qwen's FP8 releases hold them, also from stacked
    ones (the bf16 releases' form, decoder and MTP layer); stacked FP8 experts (--expert-orientation
    5.x) transformers 5.17 loads unscaled, their scales unexpected (docs/fp8.md)."""
    from transformers import AutoModelForCausalLM

    options = {"dense": dict(intermediate_size=256), "moe": dict(moe=True, **EXPERTS),
               "moe-stacked": dict(moe=True, fused_experts=True, mtp=True, fused_mtp_experts=True, **EXPERTS),
               "next": dict(next=True, intermediate_size=256, **EXPERTS)}
    source = make_qwen3_5(tmp_path / "hf", seed=3, **ALIGNED, **options[kind])
    hf2mcore(source, tmp_path / "m", Layout(), fmt="torch", mtp=kind == "moe-stacked", progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "fp8", progress=False, quantize="fp8")
    if kind == "moe-stacked":
        mcore2hf(tmp_path / "m", tmp_path / "fp8-5.x", progress=False, quantize="fp8", expert_orientation="5.x")
        _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8-5.x", dtype=torch.bfloat16,
                                                       output_loading_info=True)
        assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in info["unexpected_keys"], info
    written = hf_tensors(tmp_path / "fp8")
    assert sum(t.dtype == torch.float8_e4m3fn for t in written.values()) > 10
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, tensor in model.state_dict().items():
        prefix, _, proj = name.rpartition(".")
        if prefix.endswith(".mlp.experts"):  # transformers 5 stacks the per-expert tensors in memory
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            names = [f"{prefix}.{e}.{part}.weight" for e in range(len(tensor)) for part in parts]
            tensor = tensor.reshape(len(names), -1, tensor.shape[-1])
        else:
            names, tensor = [name], tensor[None]
        for n, t in zip(names, tensor):
            scale = written.get(n + "_scale_inv")
            if scale is None:
                assert torch.equal(t, written[n]), n
                continue
            per_element = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
            assert per_element.shape == t.shape, n
            assert torch.equal(t, (written[n].float() * per_element).bfloat16()), n
    with torch.no_grad():
        assert model(torch.tensor([list(range(3, 60, 4))])).logits.isfinite().all()


@needs_compressed_tensors
def test_export_lora_merge_writes_fp8_experts_per_expert(tmp_path, qwen3_5_moe_dir):
    """`export-lora --merge --quantize fp8` onto Qwen3.5-MoE's stacked experts (adapters on every
    linear layer, experts included, at TP2/EP2): the float32 merge equals mcore2hf of the
    Megatron-layout merge (tests/test_lora.py), stacked as the base; its FP8 form holds the experts
    per expert as the FP8 releases do (the base's per-expert MTP experts too), each as
    compressed-tensors quantizes the float32 merge."""
    from tests.test_lora import export, lora_checkpoint
    from tests.test_roundtrip import read_all

    lora, merged = lora_checkpoint(tmp_path, qwen3_5_moe_dir, Layout(tp=2, ep=2))
    export(lora, tmp_path / "ours", "--merge", "--base-model", qwen3_5_moe_dir, "--dtype", "float32")
    export(lora, tmp_path / "ours-fp8", "--merge", "--base-model", qwen3_5_moe_dir, "--dtype", "float32",
           "--quantize", "fp8")
    mcore2hf(merged, tmp_path / "theirs", progress=False)
    ours, theirs, base = read_all(tmp_path / "ours"), read_all(tmp_path / "theirs"), per_expert(hf_tensors(qwen3_5_moe_dir))
    mtp = [name for name in per_expert(ours) if name.startswith("mtp.")]  # --merge keeps the base's MTP, untouched
    assert mtp and all(torch.equal(per_expert(ours)[name], base[name].float()) for name in mtp)
    ours = {name: tensor for name, tensor in ours.items() if not name.startswith("mtp.")}
    assert ours.keys() == theirs.keys() and "model.layers.0.mlp.experts.gate_up_proj" in theirs
    for name in theirs:
        assert torch.allclose(ours[name], theirs[name].float(), atol=1e-6, rtol=0), name
    merged_expert = "model.layers.0.mlp.experts.1.down_proj.weight"
    assert not torch.equal(per_expert(ours)[merged_expert], base[merged_expert].float())
    written = read_all(tmp_path / "ours-fp8")
    assert f"{merged_expert}_scale_inv" in written and "mtp.layers.0.mlp.experts.1.up_proj.weight_scale_inv" in written
    assert_quantized(per_expert(ours) | {name: base[name].float() for name in mtp}, written)


@pytest.mark.slow
@needs_compressed_tensors
def test_live_fp8_of_aligned_gated_attention(tmp_path, monkeypatch):
    """megatron-core's Qwen3.5 (dense, 128-aligned: each head's q and gate rows whole blocks) at TP2
    (gloo, CPU; tests/test_qwen3_5.py's oracle run): its logits equal transformers', and
    iter_hf_weights / save_hf_weights(quantize="fp8") hold the bytes of `mcore2hf --quantize fp8`,
    FP8 sent over TP (shards of whole blocks, the gated linear_qkv's per-head pieces among them,
    quantized in place before the gather; the delta-net in_proj, whose b and a stay 16-bit, after)."""
    from tests.megatron_oracle import hf_logits
    from tests.test_fp8 import assert_live_fp8_is_offline
    from tests.test_qwen3_5 import TOKENS, megatron_forward

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # megatron-core's jit_fuser is torch.compile
    hf = make_qwen3_5(tmp_path / "hf", seed=3, **dict(ALIGNED, num_key_value_heads=2, linear_num_key_heads=2,
                                                       linear_num_value_heads=2), intermediate_size=256)
    ours, run = megatron_forward(tmp_path, hf, dict(tp=2), live_quantize="fp8")
    assert (ours[:1] - hf_logits(hf, TOKENS)).abs().max().item() < 1e-4
    mcore2hf(tmp_path / "ranks", tmp_path / "offline", progress=False, quantize="fp8")
    assert_live_fp8_is_offline(tmp_path / "live", run.world, tmp_path / "offline", {"tp"})
