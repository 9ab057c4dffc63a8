"""Qwen3.5 text (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) and Qwen3-Next: round trips, and the oracle: megatron-core's own GPTModel with
its GatedDeltaNet and gated attention (tests/qwen3_5_oracle.py), built from the args hf2mcore stores,
loads what hf2mcore writes (strict) and gives transformers' logits."""
from __future__ import annotations

import json
import os
import re
import shutil
from functools import partial

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from fixtures.make_fixtures import make_qwen3_5
from mconv import Layout, MconvError, hf2mcore, mcore2hf
from mconv.cli import main
from tests.conftest import FIXTURES, assert_hf_bits_equal, hf_tensors, load_rank_file
from tests.megatron_oracle import (MegatronRun, assert_same, hf_logits, layout_logits, megatron_logits, read_config,
                                   trainer_args)
from tests.qwen3_5_oracle import WRONG_RULES, block_spec, hf_mtp_logits, mtp_spec, wrong_rules
from tests.test_fp8 import COMPRESSED_TENSORS, assert_live_fp8_is_offline, bits, reference_quantize
from tests.test_fp8_qwen3_5 import is_fp8
from tests.test_live import assert_every_hf_tensor_once
from tests.test_oracle_megatron import stored_args

TOKENS = list(range(3, 283, 4))  # 70 tokens: more than one 64-token chunk of the delta rule


@pytest.mark.parametrize("sizes,spec,fmt", [(dict(tp=2), "te", "torch"), (dict(tp=2, pp=2), "local", "torch"),
                                            (dict(tp=2, pp=2, vpp=2), "te", "torch"), (dict(tp=2), "local", "torch_dist")])
def test_round_trip_is_bit_identical(tmp_path, qwen3_5_dir, sizes, spec, fmt):
    round_trip(tmp_path, qwen3_5_dir, sizes, spec, fmt)


@pytest.mark.parametrize("sizes,spec,fmt,mtp", [(dict(tp=2, ep=2), "te", "torch", True),
                                                (dict(ep=2, pp=2), "local", "torch", False),
                                                (dict(tp=2, ep=2), "local", "torch_dist", True)])
def test_moe_round_trip_is_bit_identical(tmp_path, qwen3_5_moe_dir, sizes, spec, fmt, mtp):
    """With --mtp, the MTP layer's experts come back per expert beside the fused ones, as they were."""
    round_trip(tmp_path, qwen3_5_moe_dir, sizes, spec, fmt, mtp)


def test_per_expert_moe_comes_back_per_expert(tmp_path):
    """Experts as transformers' save_pretrained writes them come back in that form, the MTP layer's
    fused ones fused."""
    hf_dir = make_qwen3_5(tmp_path / "hf", seed=8, moe=True, num_hidden_layers=2,
                          layer_types=["linear_attention", "full_attention"], mtp=True, fused_mtp_experts=True)
    round_trip(tmp_path, hf_dir, dict(tp=2, ep=2), "te", "torch", mtp=True)
    # --expert-orientation 5.x fuses them; verify says the values are the same, stored differently
    mcore2hf(tmp_path / "megatron", tmp_path / "fused", expert_orientation="5.x", progress=False)
    done = CliRunner().invoke(main, ["verify", str(hf_dir), str(tmp_path / "fused")])
    lines = done.output.splitlines()
    assert done.exit_code == 1 and len(lines) == 5, lines  # 2 layers' gate_up_proj and down_proj, then "differ"
    assert all(line.startswith("  model.layers.") and "stored as per-expert tensors vs [" in line
               and line.endswith(": the same values, stored differently") for line in lines[:4]), lines


@pytest.mark.parametrize("sizes,spec,fmt", [(dict(tp=2, ep=2, pp=2), "te", "torch"), (dict(), "local", "torch_dist")])
def test_next_round_trip_is_bit_identical(tmp_path, qwen3_next_dir, sizes, spec, fmt):
    round_trip(tmp_path, qwen3_next_dir, sizes, spec, fmt, mtp=True)


@pytest.mark.parametrize("moe,sizes", [(False, dict(tp=2, pp=2)), (True, dict(tp=2, ep=2))], ids=["dense", "moe"])
def test_vl_round_trip_is_bit_identical(tmp_path, qwen3_5_vl_dir, moe, sizes):
    """Qwen3.5-VL: Qwen3-VL's vision tower (its rules, proven by tests/test_qwen3_vl_oracle.py) without
    deepstack, and the Qwen3.5 language model with its MTP (the MoE model's MTP experts fused, as Qwen3.6's);
    as rank files and as torch_dist (whose keys tests/test_torch_dist_keys.py checks)."""
    hf_dir = make_qwen3_5(tmp_path / "hf", seed=10, vl=True, moe=True, fused_experts=True, mtp=True,
                          fused_mtp_experts=True) if moe else qwen3_5_vl_dir
    for spec, fmt in (("te", "torch"), ("local", "torch_dist")):
        (tmp_path / fmt).mkdir()
        round_trip(tmp_path / fmt, hf_dir, sizes, spec, fmt, mtp=True)


def test_vl_vision_tower_is_qwen3_vl_tower(tmp_path, qwen3_5_vl_dir):
    """The vision tower's rank tensors (TP2/PP2, te) are, bit for bit, those mconv's Qwen3-VL table writes
    (whose oracle is mbridge's Qwen3VLModel, tests/test_qwen3_vl_oracle.py) for a Qwen3-VL checkpoint
    holding the same vision weights, without deepstack; and no other tensor of the first stage is a
    vision one."""
    qwen3_vl = shutil.copytree(FIXTURES / "qwen3-vl-tiny", tmp_path / "qwen3_vl")
    config = read_config(qwen3_vl)
    config["vision_config"]["deepstack_visual_indexes"] = []
    (qwen3_vl / "config.json").write_text(json.dumps(config))
    visual = {n: t for n, t in hf_tensors(qwen3_5_vl_dir).items() if n.startswith("model.visual.")}
    tensors = {n: t for n, t in load_file(qwen3_vl / "model.safetensors").items() if not n.startswith("model.visual.")}
    save_file({**tensors, **visual}, qwen3_vl / "model.safetensors", metadata={"format": "pt"})
    towers = []
    for hf_dir in (qwen3_5_vl_dir, qwen3_vl):
        out = tmp_path / hf_dir.parent.name / "m"
        hf2mcore(hf_dir, out, Layout(tp=2, pp=2), spec="te", fmt="torch", progress=False)
        towers.append({path.parent.name: {n: t for n, t in load_rank_file(path)["model"].items() if "vision" in n}
                       for path in sorted(out.glob("release/*/model_optim_rng.pt"))})
    ours, theirs = towers
    assert ours.keys() == theirs.keys() and sum(map(len, ours.values())) == sum(map(len, theirs.values())) > 60
    for rank, tower in theirs.items():
        assert ours[rank].keys() == tower.keys(), rank
        for name, tensor in tower.items():
            assert (tensor is None and ours[rank][name] is None) or torch.equal(ours[rank][name], tensor), name


def round_trip(tmp_path, hf_dir, sizes, spec, fmt, mtp=False):
    """hf2mcore then mcore2hf gives back every HF tensor bit for bit, in the same form (fused or per
    expert); without `mtp`, all but the MTP tensors."""
    hf2mcore(hf_dir, tmp_path / "megatron", Layout(**sizes), spec=spec, fmt=fmt, mtp=mtp, progress=False)
    mcore2hf(tmp_path / "megatron", tmp_path / "back", progress=False)
    expected = {name: t for name, t in hf_tensors(hf_dir).items() if mtp or not name.startswith("mtp.")}
    assert_hf_bits_equal(expected, tmp_path / "back")


def megatron_forward(tmp_path, hf_dir, sizes, vl_dir=None, live_quantize=None, then=(),
                     wrong_at=None) -> tuple[torch.Tensor, MegatronRun]:
    """The oracle run: hf2mcore writes a torch_dist checkpoint (at TP1) and legacy rank files (`--spec
    te`) at `sizes`; megatron-core's model at `sizes`, built from the stored args, loads the torch_dist
    one (resharded by megatron-core itself, strict), checks the rank files hold exactly what it loaded,
    then mconv.live's load_hf_weights must give it the same tensors (tests/megatron_oracle.py's
    live_over_checkpoint); it gives its logits, and iter_hf_weights / save_hf_weights write to
    `tmp_path / "live"` (with `live_quantize`: iter_hf_weights' and save_hf_weights' `quantize`). With `vl_dir` (a Qwen3.5-VL model whose language model has this shape), the same
    model then loads its language model in the same way (torch_dist keys under `language_model.`, rank
    files holding exactly those tensors; MTP as `hf_dir` has it) and gives `tmp_path / "language_model_logits.pt"`.
    Megatron-Bridge's AutoBridge loads `hf_dir` into a second copy of the model on each rank (reports
    `tmp_path / "bridge{rank}.pt"`, one delta-net in_proj then perturbed; tests/megatron_oracle.py).
    Then, in the same processes, each of `then`'s (sizes, format) layouts: hf2mcore writes `--spec te`
    rank files at its sizes, and a model built for them loads them (strict; "torch") or the TP1
    torch_dist checkpoint (resharded, strict, then checked against those rank files; "torch_dist"), and
    gives `megatron_logits{i}.pt` (i from 1); at the layout numbered `wrong_at`, also each of
    WRONG_RULES' logits (`megatron_logits{i}_wrong{j}.pt`)."""
    mtp = "mtp_num_hidden_layers" in read_config(hf_dir)  # converted with --mtp: megatron-core's MTP block
    checkpoints = []
    for directory, name in ((hf_dir, ""), (vl_dir, "vl_")) if vl_dir else ((hf_dir, ""),):
        hf2mcore(directory, tmp_path / f"{name}dist", Layout(), fmt="torch_dist", mtp=mtp, progress=False)
        summary = hf2mcore(directory, tmp_path / f"{name}ranks", Layout(**sizes), spec="te", fmt="torch", mtp=mtp,
                           progress=False)
        checkpoints.append((tmp_path / f"{name}dist", tmp_path / f"{name}ranks"))
    (tmp_path / "live").mkdir()
    run = MegatronRun(tmp_path / "dist", read_config(hf_dir), **sizes, padded_vocab=summary.plan.padded_vocab,
                      tokens=TOKENS, fmt="torch_dist", block_spec=block_spec, mtp_spec=mtp_spec, same_as=tmp_path / "ranks",
                      live_hf=hf_dir, live_out=tmp_path / "live", live_quantize=live_quantize, live_over_checkpoint=True,
                      language_model_of=checkpoints[1] if vl_dir else None, bridge_hf=hf_dir,
                      bridge_perturbed="self_attention.in_proj.weight")
    run.args = trainer_args(stored_args(tmp_path / "ranks"), run)
    for i, (more, fmt) in enumerate(then, 1):
        ranks = tmp_path / f"ranks{i}"
        written = {k: n for k, n in more.items() if k != "dp"}  # dp: replicas of the layout, not in the files
        summary = hf2mcore(hf_dir, ranks, Layout(**written), spec="te", fmt="torch", mtp=mtp, progress=False)
        layout = MegatronRun(tmp_path / "dist" if fmt == "torch_dist" else ranks, run.hf_config, **more,
                             padded_vocab=summary.plan.padded_vocab, tokens=TOKENS, fmt=fmt, block_spec=block_spec,
                             mtp_spec=mtp_spec, same_as=ranks if fmt == "torch_dist" else None,
                             wrong_rules=partial(wrong_rules, hf_dir) if i == wrong_at else None)
        layout.args = trainer_args(stored_args(ranks), layout)
        run.then.append(layout)
    return megatron_logits(run, tmp_path), run


# What Megatron-Bridge 0.6.2 leaves unloaded in these models (it warns and leaves them as built): at TP1
# (the dense run) the padded embedding and output layer (it pads the vocabulary only at TP > 1); Qwen3-Next's
# dense layer (`mlp_only_layers`: no `mlp.linear_fc*` rows); Qwen3.5-MoE's MTP experts in SequentialMLP's
# names (its MTP rows name only TE's grouped `experts.linear_fc*.weight{e}`, which a CPU model without
# Transformer Engine cannot build; the decoder's experts have rows in both namings).
BRIDGE_GAPS = {"qwen3_5_mtp_dir": r"\.(embedding\.word_embeddings|output_layer)\.weight$",
               "qwen3_5_moe_dir": r"^0\.mtp\.layers\.0\.mtp_model_layer\.mlp\.experts\.local_experts\.",
               "qwen3_next_dir": r"^0\.decoder\.layers\.1\.mlp\.linear_fc"}


# Further layouts of each oracle run, in its two processes after the first (sizes, what the model loads:
# see megatron_forward): TP1 (dense: two replicas, each the whole model; Qwen3-Next: experts at EP2), TP2
# and plain PP2 (TP1 stages) of Qwen3.5 and Qwen3-Next, the first layouts giving TP2/EP2/ETP1 and
# PP2 x VPP2. WRONG_RULES at the dense TP2 layout, where each of them changes the model's tensors.
MORE_LAYOUTS = {"qwen3_5_mtp_dir": [(dict(dp=2), "torch"), (dict(tp=2), "torch"), (dict(pp=2), "torch_dist")],
                "qwen3_5_moe_dir": [], "qwen3_next_dir": [(dict(pp=2), "torch_dist"), (dict(ep=2), "torch")]}
WRONG_AT = {"qwen3_5_mtp_dir": 2}


@pytest.mark.slow
# Delta-net sections at TP2 in the MoE runs; the dense run (with its MTP layer) splits the layers over
# PP2 x VPP2 (one per chunk, each chunk's spec built for its vp_stage, the MTP block on the last): each
# chunk numbers its layers from 0 and the kind follows the global index. Then MORE_LAYOUTS.
@pytest.mark.parametrize("model,sizes", [("qwen3_5_mtp_dir", dict(pp=2, vpp=2)), ("qwen3_5_moe_dir", dict(tp=2, ep=2, etp=1)),
                                         ("qwen3_next_dir", dict(tp=2, ep=2, etp=1))],
                         ids=["dense-pp2-vpp2", "moe-tp2-ep2", "next-tp2-ep2"])
def test_megatron_core_forward_matches_transformers(tmp_path, request, model, sizes, monkeypatch):
    """The dense run also proves the VL classes' language model: a Qwen3.5-VL checkpoint's, loaded into
    the same GPTModel from its torch_dist `language_model.*` keys, equals its rank files and gives the
    logits transformers gives for that VL directory (which it loads into the text-only class).
    A second, independent mapping: Megatron-Bridge 0.6's AutoBridge (its Qwen35Bridge / Qwen35MoEBridge /
    Qwen3NextBridge tables and `load_weights_hf_to_megatron`: GDNLinearMappingSeparate / GDNLinearMapping,
    GDNConv1dMapping, QKVMapping with the output gate, RMSNorm2ZeroCenteredRMSNormMapping, fused expert
    mappings, MTP), imported without Transformer Engine, loads the same HF directory into a second copy of
    the model on each rank, at these same sizes (PP2 x VPP2, TP2/EP2): every tensor equals the one mconv's
    checkpoint gave, bit for bit, but for BRIDGE_GAPS (which must differ: left as built); one element of
    a delta-net in_proj moved by one float step is then the one more tensor that differs.
    mconv.live's export yields every HF tensor once, bit for bit; Qwen3.5-MoE's and Qwen3-Next's in FP8
    (`quantize="fp8"`: delta-net sections and gated linear_qkv gathered over TP, then split and
    quantized; experts quantized before the EP gather), the bytes `mcore2hf --quantize fp8` writes
    (Qwen3.5-MoE's stacked experts per expert in both, save_hf_weights' too, as the FP8 releases).
    The layouts of MORE_LAYOUTS give the same logits and MTP logits; at the dense TP2 layout, each of
    WRONG_RULES (tests/qwen3_5_oracle.py: what a converter following it would have written, in place of
    the loaded tensors) moves the logits by more than 1e-2."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # megatron-core's jit_fuser is torch.compile
    hf_dir = request.getfixturevalue(model)
    vl_dir = request.getfixturevalue("qwen3_5_vl_dir") if model == "qwen3_5_mtp_dir" else None
    live_quantize = "fp8" if model in ("qwen3_5_moe_dir", "qwen3_next_dir") else None
    ours, run = megatron_forward(tmp_path, hf_dir, sizes, vl_dir, live_quantize, MORE_LAYOUTS[model],
                                 WRONG_AT.get(model))
    reference = hf_logits(hf_dir, TOKENS)
    assert ours.shape[0] == 2 and (ours[:1] - reference).abs().max().item() < 1e-4
    # The MTP depth (megatron-core's MTP block; HF: transformers' modules chained as that block chains them)
    mtp = hf_mtp_logits(hf_dir, TOKENS, tmp_path)
    mtp_reference = mtp.pop("right")
    assert (ours[1:] - mtp_reference).abs().max().item() < 1e-4
    for rule, wrong in mtp.items():  # a converter following a wrong rule fails
        assert (ours[1:] - wrong).abs().max().item() > 1e-2, rule
    for i, (more, fmt) in enumerate(MORE_LAYOUTS[model], 1):
        logits = layout_logits(run, tmp_path, f"megatron_logits{i}.pt")
        assert logits.shape == ours.shape and (logits[:1] - reference).abs().max().item() < 1e-4, (more, fmt)
        assert (logits[1:] - mtp_reference).abs().max().item() < 1e-4, (more, fmt)
    if model in WRONG_AT:
        for j, rule in enumerate(WRONG_RULES):
            wrong = layout_logits(run, tmp_path, f"megatron_logits{WRONG_AT[model]}_wrong{j}.pt")
            assert (wrong[:1] - reference).abs().max().item() > 1e-2, rule
    if live_quantize:  # mconv.live's FP8 export: the bytes of mcore2hf --quantize fp8 (experts FP8 over EP)
        mcore2hf(tmp_path / "ranks", tmp_path / "offline-fp8", progress=False, quantize="fp8")
        assert_live_fp8_is_offline(tmp_path / "live", run.world, tmp_path / "offline-fp8", {"ep"})
    else:  # mconv.live's export of the same model
        assert_every_hf_tensor_once(tmp_path / "live", run, hf_dir)
    assert_same(tmp_path, "bridge", run.world, BRIDGE_GAPS[model])
    if vl_dir is not None:
        vl_ours = torch.load(tmp_path / "language_model_logits.pt")[:1, ..., :run.hf_config["vocab_size"]]
        vl_reference = hf_logits(vl_dir, TOKENS)
        assert (vl_ours - vl_reference).abs().max().item() < 1e-4
        assert (vl_reference - reference).abs().max().item() > 0.1  # another model: the second load took


def _with_config(tmp_path, hf_dir, **changes):
    copy = shutil.copytree(hf_dir, tmp_path / "hf")
    (copy / "config.json").write_text(json.dumps({**read_config(hf_dir), **changes}))
    return copy


@pytest.mark.parametrize("changes,sizes,message", [
    (dict(linear_num_value_heads=5), dict(), "linear_num_value_heads=5 is not a multiple of linear_num_key_heads=2"),
    (dict(linear_num_key_heads=1), dict(tp=2), "linear_num_key_heads=1 is not divisible by tp=2"),
    (dict(layer_types=["linear_attention"] * 3), dict(), "layer_types must give one of"),
], ids=["value-heads", "tp", "layer-types"])
def test_bad_config_is_refused_in_one_sentence(tmp_path, qwen3_5_dir, changes, sizes, message):
    hf_dir = _with_config(tmp_path, qwen3_5_dir, **changes)
    with pytest.raises(MconvError, match=re.escape(message)):
        hf2mcore(hf_dir, tmp_path / "out", Layout(**sizes), fmt="torch", progress=False)
    assert not (tmp_path / "out").exists()


def test_mtp_is_left_out_by_default_in_one_note(tmp_path, qwen3_5_moe_dir):
    """transformers drops `mtp.*` on load; without --mtp hf2mcore leaves it out and says so once, and
    mcore2hf's config.json says there is no MTP layer (vLLM would look for its weights). inspect of
    the HF model says it has one, and that hf2mcore leaves it out unless --mtp."""
    done = CliRunner().invoke(main, ["inspect", str(qwen3_5_moe_dir)])
    assert done.exit_code == 0 and ("  mtp      1 MTP layer (multi-token prediction), which hf2mcore leaves out "
                                    "unless --mtp") in done.output.splitlines(), done.output
    summary = hf2mcore(qwen3_5_moe_dir, tmp_path / "m", Layout(), fmt="torch", progress=False)
    assert [note for note in summary.notes if "mtp" in note] == [
        "left out mtp.* (multi-token prediction, which transformers drops on load: not converted; --mtp keeps it in "
        "megatron-core's MTP block)"]
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    assert read_config(tmp_path / "back")["mtp_num_hidden_layers"] == 0


@pytest.mark.parametrize("model,changes,message", [
    ("qwen3_5_moe_dir", dict(mtp_num_hidden_layers=2), "mtp_num_hidden_layers=2: these MTP layers share one mtp.fc"),
    ("qwen3_next_dir", dict(mlp_only_layers=[3]), "config.json gives the MTP layer MoE and the last decoder layer a "
                                                 "dense MLP"),
], ids=["two-layers", "other-mlp"])
def test_mtp_megatron_core_cannot_build_is_refused(tmp_path, request, model, changes, message):
    hf_dir = _with_config(tmp_path, request.getfixturevalue(model), **changes)
    with pytest.raises(MconvError, match=re.escape(message)):
        hf2mcore(hf_dir, tmp_path / "out", Layout(), fmt="torch", mtp=True, progress=False)
    assert not (tmp_path / "out").exists()


def test_transposed_fused_experts_are_refused(tmp_path, qwen3_5_moe_dir):
    """transformers refuses Qwen3.5-MoE experts stacked as [E, h, 2I] (4.x's orientation); so does hf2mcore."""
    hf_dir = shutil.copytree(qwen3_5_moe_dir, tmp_path / "hf")
    tensors = load_file(hf_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MconvError, match=r"stacked experts model\.layers\.0\.mlp\.experts\.\w+ are transposed"):
        hf2mcore(hf_dir, tmp_path / "out", Layout(), fmt="torch", progress=False)


def test_layer_kinds_from_full_attention_interval():
    """A config.json with `full_attention_interval` and no `layer_types` (transformers fills them in)."""
    from mconv.mappings.qwen3_5 import layer_types

    config = {"num_hidden_layers": 8, "full_attention_interval": 4}
    assert layer_types(config) == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert layer_types({"num_hidden_layers": 4}) == ["linear_attention"] * 3 + ["full_attention"]  # default 4


def test_a_missing_section_is_named(tmp_path, qwen3_5_dir):
    hf_dir = shutil.copytree(qwen3_5_dir, tmp_path / "hf")
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.linear_attn.in_proj_z.weight"]
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MconvError, match=r"tensor model\.layers\.1\.linear_attn\.in_proj_z\.weight is missing"):
        hf2mcore(hf_dir, tmp_path / "out", Layout(tp=2), fmt="torch", progress=False)


def test_export_lora_peft_merge_equals_megatron_layout_merge(tmp_path, qwen3_5_mtp_dir):
    """Megatron-Bridge LoRA at TP2 (`--spec te`, `--mtp`) on the delta-net in_proj (one A; B rows in the
    rank's [Q; K; V; Z; B; A] sections) and out_proj, the gated linear_qkv (B rows [q heads; gate heads;
    k; v] per group), linear_proj and the MLP, in the decoder and in the MTP block's layer (which
    Megatron-Bridge's LoRA wraps by name, and exports under `mtp.layers.0.*`: qwen35_bridge.py's MTP
    mappings): peft, merging export-lora's adapter into a module tree with the HF names (transformers has
    no MTP module), and export-lora --merge must both give mcore2hf of the rank files with the adapters
    merged in Megatron layout (W + alpha/r * B @ A per rank shard, tests/test_lora.py)."""
    from peft import LoraConfig, PeftModel

    from tests.test_bailing import _hf_module_tree
    from tests.test_lora import export, lora_checkpoint
    from tests.test_roundtrip import read_all

    mtp = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron-Bridge's default targets
    lora, merged = lora_checkpoint(tmp_path, qwen3_5_mtp_dir, Layout(tp=2), spec="te", mtp=mtp)
    export(lora, tmp_path / "adapter")
    export(lora, tmp_path / "ours", "--merge", "--base-model", qwen3_5_mtp_dir, "--dtype", "float32")
    config = LoraConfig.from_pretrained(tmp_path / "adapter")
    assert config.target_modules == {"in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "down_proj", "gate_proj",
                                     "up_proj", "out_proj", "k_proj", "o_proj", "q_proj", "v_proj"}
    config.task_type = None  # the plain PeftModel wraps the module tree
    model = PeftModel.from_pretrained(_hf_module_tree(qwen3_5_mtp_dir), tmp_path / "adapter", config=config)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    injected = {name for name, _ in model.named_parameters() if ".lora_" in name}
    assert {k.replace(".weight", ".default.weight") for k in adapter} == injected  # no missing, no unexpected
    peft_merged = dict(model.merge_and_unload().named_parameters())
    mcore2hf(merged, tmp_path / "theirs", progress=False)
    theirs, ours, original = read_all(tmp_path / "theirs"), read_all(tmp_path / "ours"), read_all(qwen3_5_mtp_dir)
    assert peft_merged.keys() == ours.keys() == theirs.keys()
    changed = 0
    for name, tensor in theirs.items():
        assert torch.allclose(peft_merged[name], tensor.float(), atol=1e-6, rtol=0), name
        assert torch.allclose(ours[name], tensor.float(), atol=1e-6, rtol=0), name
        changed += not torch.equal(tensor.float(), original[name].float())
    assert changed == sum("lora_B" in name for name in adapter) == 37  # 30 decoder and 7 MTP layer projections
    assert sum(name.startswith("base_model.model.mtp.layers.0.") for name in adapter) == 14
    if (COMPRESSED_TENSORS / "compressed_tensors").is_dir() or os.environ.get("CI"):
        # --quantize fp8: the release's FP8 weights (tests/test_fp8_qwen3_5.py) as compressed-tensors
        # quantizes the float32 merge, in_proj_b / in_proj_a and the rest the float32 merge itself
        export(lora, tmp_path / "ours-fp8", "--merge", "--base-model", qwen3_5_mtp_dir, "--dtype", "float32",
               "--quantize", "fp8")
        quantized = read_all(tmp_path / "ours-fp8")
        assert quantized.keys() == ours.keys() | {name + "_scale_inv" for name in ours if is_fp8(name)}
        for name, tensor in ours.items():
            q, scale = reference_quantize(tensor) if is_fp8(name) else (tensor, None)
            assert torch.equal(bits(quantized[name]), bits(q)), name
            assert scale is None or torch.equal(quantized[name + "_scale_inv"], scale), name


def test_export_lora_mtp_eh_proj(tmp_path, qwen3_5_mtp_dir):
    """An adapter on the MTP block's eh_proj (Megatron-Bridge wraps it when targeted; its HF module is
    `mtp.fc`): export-lora --merge merges it as the Megatron-layout merge does (TP2, column-parallel), and
    a PEFT adapter is refused in one sentence: vLLM refuses a whole adapter with a module named `fc`,
    none of the served model's LoRA modules (vllm/lora/lora_model.py check_unexpected_modules)."""
    from tests.test_lora import export, lora_checkpoint
    from tests.test_roundtrip import read_all

    lora, merged = lora_checkpoint(tmp_path, qwen3_5_mtp_dir, Layout(tp=2), spec="te", mtp=("eh_proj",))
    export(lora, tmp_path / "ours", "--merge", "--base-model", qwen3_5_mtp_dir, "--dtype", "float32")
    mcore2hf(merged, tmp_path / "theirs", progress=False)
    ours, theirs, original = read_all(tmp_path / "ours"), read_all(tmp_path / "theirs"), read_all(qwen3_5_mtp_dir)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor.float(), atol=1e-6, rtol=0), name
    changed = [n for n in ours if not torch.equal(ours[n], original[n].float())]
    assert [n for n in changed if n.startswith("mtp.")] == ["mtp.fc.weight"] and len(changed) == 31  # and the decoder's
    done = CliRunner().invoke(main, ["export-lora", str(lora), str(tmp_path / "adapter"), "--alpha", "8"])
    assert done.exit_code == 1 and done.output == (
        "mconv: error: mtp.fc (an MTP layer's eh_proj) has a LoRA adapter, which a PEFT adapter cannot carry: vLLM "
        "refuses a whole adapter naming a module fc, none of the served model's LoRA modules, and transformers has no "
        "MTP module; --merge merges it\n")
    assert not (tmp_path / "adapter").exists()


def test_canonical_lora_on_the_gated_linear_qkv_is_refused(tmp_path, qwen3_5_dir):
    """Megatron-Bridge's CanonicalLoRA sizes adapter_q as the query heads alone (no gate rows) and adds its
    per-group [q; k; v] output to linear_qkv's [q; gate; k; v] (peft/canonical_lora.py, LoRALinearSplitQKV):
    it cannot train a gated linear_qkv, and export-lora says so in one sentence."""
    from tests.test_lora import ALPHA

    hf2mcore(qwen3_5_dir, tmp_path / "m", Layout(), fmt="torch", progress=False)
    path = tmp_path / "m/release/mp_rank_00/model_optim_rng.pt"
    state = load_rank_file(path)
    c, r = read_config(qwen3_5_dir), 4
    adapter = "decoder.layers.3.self_attention.linear_qkv.adapter.adapter_q."  # as Megatron-Bridge would shape it
    state["model"] |= {adapter + "linear_in.weight": torch.zeros(r, c["hidden_size"]),
                       adapter + "linear_out.weight": torch.zeros(c["num_attention_heads"] * c["head_dim"], r)}
    torch.save(state, path)
    done = CliRunner().invoke(main, ["export-lora", str(tmp_path / "m"), str(tmp_path / "adapter"), "--alpha", ALPHA])
    assert done.exit_code == 1 and done.output == (
        f"mconv: error: {tmp_path / 'm/release'}: {adapter}linear_in.weight in mp_rank_00 (model chunk 0) is a "
        "CanonicalLoRA adapter on a gated linear_qkv (attention_output_gate), which Megatron-Bridge's CanonicalLoRA "
        "does not support (its adapter_q has no gate rows, so its output does not fit linear_qkv's); use LoRA on "
        "linear_qkv\n")
    assert not (tmp_path / "adapter").exists()


def test_next_export_lora_merge_equals_megatron_layout_merge(tmp_path, qwen3_next_dir):
    """Qwen3-Next at TP2/EP2: an in_proj adapter's B rows go back to in_proj_qkvz / in_proj_ba grouped by
    key head (one A for both); export-lora --merge must equal mcore2hf of the Megatron-layout merge.
    (peft cannot be the oracle here: transformers 5 fuses the experts its per-expert adapters name.)"""
    from tests.test_lora import export, lora_checkpoint
    from tests.test_roundtrip import read_all

    lora, merged = lora_checkpoint(tmp_path, qwen3_next_dir, Layout(tp=2, ep=2), spec="te")
    export(lora, tmp_path / "ours", "--merge", "--base-model", qwen3_next_dir, "--dtype", "float32")
    mcore2hf(merged, tmp_path / "theirs", progress=False)
    ours, theirs, base = read_all(tmp_path / "ours"), read_all(tmp_path / "theirs"), hf_tensors(qwen3_next_dir)
    mtp = [name for name in ours if name.startswith("mtp.")]  # --merge keeps the base model's MTP, untouched
    assert mtp and all(torch.equal(ours.pop(name), base[name].float()) for name in mtp)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name].float(), atol=1e-6, rtol=0), name
    assert not torch.equal(ours["model.layers.1.linear_attn.in_proj_qkvz.weight"],
                           base["model.layers.1.linear_attn.in_proj_qkvz.weight"].float())
