"""Qwen3.5 text (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) and Qwen3-Next: round trips, and the oracle: megatron-core's own GPTModel with
its GatedDeltaNet and gated attention (tests/qwen3_5_oracle.py), built from the args hf2mcore stores,
loads what hf2mcore writes (strict) and gives transformers' logits."""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import replace
from functools import partial

import pytest
import torch
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fixtures.make_fixtures import fuse_experts, make_qwen3_5
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


@pytest.fixture(scope="session")
def qwen3_5_moe_per_expert_dir(tmp_path_factory):
    """Qwen3.5-MoE with its experts, the MTP layer's too, per expert as save_pretrained writes them."""
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_moe_per_expert") / "hf", seed=8, moe=True, mtp=True)


@pytest.fixture(scope="session")
def qwen3_5_vl_moe_dir(tmp_path_factory):
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_vl_moe") / "hf", seed=10, vl=True, moe=True, mtp=True)


# The round-trip sweep's model kinds: the fixture of each one's HF model (every one with an MTP layer, its
# experts per expert) and the transformers class that loads what mcore2hf writes. Only Qwen3.5-MoE's
# checkpoints (text and VL) hold experts fused; Qwen3-Next's, and so mconv, per expert only.
KINDS = {"dense": ("qwen3_5_mtp_dir", "AutoModelForCausalLM"),
         "moe": ("qwen3_5_moe_per_expert_dir", "AutoModelForCausalLM"),
         "next": ("qwen3_next_dir", "AutoModelForCausalLM"),
         "vl": ("qwen3_5_vl_dir", "AutoModelForImageTextToText"),
         "vl_moe": ("qwen3_5_vl_moe_dir", "AutoModelForImageTextToText")}
MOE, STACKED = ("moe", "next", "vl_moe"), ("moe", "vl_moe")
# The pipeline layouts of the models' 4 layers that megatron-core can build (uneven first/last stages;
# VPP2 at one layer a chunk).
PIPELINES = (dict(), dict(pp=2), dict(pp=2, vpp=2), dict(pp=4), dict(pp=2, first_stage_layers=1),
             dict(pp=3, first_stage_layers=1, last_stage_layers=1), dict(pp=3, last_stage_layers=2))
EVEN = dict(vpp=1, first_stage_layers=None, last_stage_layers=None)
# What hf2mcore must refuse in one sentence, writing nothing: a drawn case changed to one that megatron-core
# (or the legacy format) cannot hold, and what the sentence says.
REFUSALS = {"tp4": (dict(tp=4), "num_key_value_heads (query groups)=2 is not divisible by tp=4"),
            "pp3": (dict(EVEN, pp=3), "4 layers cannot be split evenly over 3 pipeline stages"),
            "vpp": (dict(EVEN, pp=4, vpp=2), "pipeline stage 0 holds 1 layer, not divisible by vpp=2"),
            "legacy-etp": (dict(fmt="torch", tp=1, etp=2), "etp=2 does not divide tp=1: Megatron-LM's legacy format"),
            "dist-te": (dict(fmt="torch_dist", spec="te"), "fmt='torch_dist' is written in megatron-core's local-spec")}
EP_REFUSALS = {True: (dict(ep=8), "4 experts are not divisible by ep=8"),  # by whether the model has experts
               False: (dict(ep=2), "the model has no experts, so the expert layout EP 2 ETP 1")}


def expert_prefixes(tensors, decoder: bool = True, mtp: bool = True) -> list[str]:
    """The `...mlp.experts.` prefixes under which `tensors` holds experts per expert, of the decoder's
    layers and of the MTP layer."""
    return sorted({n.removesuffix("0.down_proj.weight") for n in tensors if n.endswith(".experts.0.down_proj.weight")
                   and (mtp if n.startswith("mtp.") else decoder)})


@pytest.fixture(scope="session")
def qwen3_5_input(request, tmp_path_factory):
    """`(kind, fused, fused_mtp) -> directory`: the kind's HF model with the decoder's experts (`fused`)
    and the MTP layer's (`fused_mtp`) fused as the official checkpoints hold them (Qwen3.5's MTP experts
    per expert, Qwen3.6's fused), or per expert; each form made once."""
    bases = {kind: request.getfixturevalue(fixture) for kind, (fixture, _) in KINDS.items()}
    made = {}

    def get(kind, fused, fused_mtp):
        if (kind, fused, fused_mtp) not in made:
            hf_dir = bases[kind]
            if fused or fused_mtp:
                tensors = hf_tensors(hf_dir)
                hf_dir = shutil.copytree(hf_dir, tmp_path_factory.mktemp(f"{kind}_fused") / "hf")
                save_file(fuse_experts(tensors, expert_prefixes(tensors, fused, fused_mtp)),
                          hf_dir / "model.safetensors", metadata={"format": "pt"})
            made[kind, fused, fused_mtp] = hf_dir
        return made[kind, fused, fused_mtp]
    return get


@st.composite
def round_trip_case(draw):
    kind = draw(st.sampled_from(sorted(KINDS)))
    stacked = kind in STACKED
    fmt = draw(st.sampled_from(["torch", "torch_dist"]))
    tp = draw(st.sampled_from([1, 2]))
    experts = {}
    if kind in MOE:  # torch_dist takes any ETP, the legacy format ETP | TP
        experts = dict(ep=draw(st.sampled_from([1, 2, 4])),
                       etp=draw(st.sampled_from([e for e in (1, 2) if fmt == "torch_dist" or tp % e == 0])))
    layout = Layout(tp=tp, **experts, **draw(st.sampled_from(PIPELINES)), vocab_divisor=draw(st.sampled_from([128, 1])))
    return dict(kind=kind, layout=layout, fmt=fmt,
                spec="local" if fmt == "torch_dist" else draw(st.sampled_from(["te", "local"])),
                mtp=draw(st.booleans()), fused=stacked and draw(st.booleans()),
                fused_mtp=stacked and draw(st.booleans()),
                orientation=draw(st.sampled_from([None, "5.x"])) if stacked else None,
                shard_bytes=draw(st.sampled_from([3_000_000_000, 150_000])),
                refused=draw(st.sampled_from([None, "ep", *REFUSALS])))


def pinned(kind, layout, fmt, spec="te", mtp=True, fused=False, fused_mtp=False, orientation=None,
           shard_bytes=3_000_000_000, refused=None):
    return dict(kind=kind, layout=layout, fmt=fmt, spec=spec if fmt == "torch" else "local", mtp=mtp, fused=fused,
                fused_mtp=fused_mtp, orientation=orientation, shard_bytes=shard_bytes, refused=refused)


# Pinned, whatever is drawn (hypothesis derandomizes from the test's source, so any edit draws other cases):
# every model kind; each form of the experts, back in that form: Qwen3.5-MoE's official one (decoder's fused,
# the MTP layer's per expert), Qwen3.6's (both fused), the decoder's per expert beside Qwen3.6's MTP layer,
# Qwen3-Next's (per expert); and save_pretrained's (all per expert) fused by --expert-orientation 5.x.
PINNED = [pinned("dense", Layout(tp=2, pp=2, vpp=2), "torch_dist", shard_bytes=150_000),
          pinned("vl", Layout(tp=2, pp=3, first_stage_layers=1, last_stage_layers=1), "torch", spec="local",
                 mtp=False, refused="tp4"),
          pinned("moe", Layout(tp=2, pp=2, ep=2), "torch", fused=True, refused="pp3"),
          pinned("vl_moe", Layout(tp=2, ep=2), "torch", fused=True, fused_mtp=True, shard_bytes=150_000,
                 refused="legacy-etp"),
          pinned("moe", Layout(ep=4, etp=2), "torch_dist", fused_mtp=True, refused="dist-te"),
          pinned("vl_moe", Layout(pp=4, ep=2, vocab_divisor=1), "torch", orientation="5.x", refused="vpp"),
          pinned("next", Layout(tp=2, pp=2, ep=2, etp=2), "torch_dist", refused="ep")]


# 9 conversions and transformers loads in all, about the time of the 14 parametrized round trips this replaced
# (CI's 40-minute budget); derandomized, so every run converts the same cases.
@settings(max_examples=2, deadline=None, derandomize=True, database=None)
@given(case=round_trip_case())
@example(case=PINNED[0])
@example(case=PINNED[1])
@example(case=PINNED[2])
@example(case=PINNED[3])
@example(case=PINNED[4])
@example(case=PINNED[5])
@example(case=PINNED[6])
def test_round_trip_is_bit_identical(tmp_path_factory, qwen3_5_input, case):
    """hf2mcore then mcore2hf gives back every HF tensor bit for bit (without `--mtp` all but the MTP
    layer's), its experts in the form they came in, fused or per expert (`--expert-orientation 5.x`:
    all fused, as the official checkpoints hold them), and transformers loads the output with no
    missing, unexpected or mismatched key. The case changed to a layout that cannot be built is refused
    in one sentence, writing nothing."""
    tmp = tmp_path_factory.mktemp("round_trip")
    hf_dir = qwen3_5_input(case["kind"], case["fused"], case["fused_mtp"])
    options = dict(layout=case["layout"], spec=case["spec"], fmt=case["fmt"], mtp=case["mtp"], progress=False)
    if case["refused"]:
        changes, message = EP_REFUSALS[case["kind"] in MOE] if case["refused"] == "ep" else REFUSALS[case["refused"]]
        sizes = {k: v for k, v in changes.items() if k not in options}
        other = {k: v for k, v in changes.items() if k in options}
        with pytest.raises(MconvError) as refused:
            hf2mcore(hf_dir, tmp / "refused", **dict(options, layout=replace(case["layout"], **sizes), **other))
        assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
        assert not (tmp / "refused").exists()
    hf2mcore(hf_dir, tmp / "megatron", **options)
    mcore2hf(tmp / "megatron", tmp / "back", expert_orientation=case["orientation"],
             max_shard_bytes=case["shard_bytes"], progress=False)
    expected = {name: t for name, t in hf_tensors(hf_dir).items() if case["mtp"] or not name.startswith("mtp.")}
    assert_hf_bits_equal(fuse_experts(expected, expert_prefixes(expected) if case["orientation"] else []), tmp / "back")
    import transformers

    model_class = getattr(transformers, KINDS[case["kind"]][1])
    _, info = model_class.from_pretrained(tmp / "back", output_loading_info=True)
    assert not any(info.values()), info


def test_verify_tells_per_expert_from_fused_experts(qwen3_5_input):
    """The same experts per expert and fused (Qwen3.5-MoE's 4 MoE layers and its MTP layer): verify
    says, on each fused tensor's line, the same values stored differently, and exits 1."""
    fused = qwen3_5_input("moe", True, True)
    done = CliRunner().invoke(main, ["verify", str(qwen3_5_input("moe", False, False)), str(fused)])
    names = sorted(n for n in hf_tensors(fused) if n.endswith(("gate_up_proj", "down_proj")))
    lines = done.output.splitlines()
    assert done.exit_code == 1 and len(lines) == len(names) + 1 == 11, lines
    for line, name in zip(lines, names):
        assert line.startswith(f"  {name}: stored as per-expert tensors vs [") and line.endswith(
            ": the same values, stored differently"), line


def test_every_expert_form_gives_the_oracle_model(tmp_path, qwen3_5_input, qwen3_5_moe_dir):
    """Qwen3.5-MoE's experts in each stored form (decoder's and MTP layer's each fused or per expert:
    Qwen3.6's fused MTP experts among them) give the very rank files (`--spec te --mtp`, TP2/EP2/ETP1)
    whose model test_megatron_core_forward_matches_transformers runs (the official form's): so that
    oracle's logits and MTP logits hold for every form."""
    def rank_files(hf_dir, out):
        hf2mcore(hf_dir, out, Layout(tp=2, ep=2, etp=1), spec="te", fmt="torch", mtp=True, progress=False)
        return {path.relative_to(out): load_rank_file(path)["model"] for path in sorted(out.rglob("*.pt"))}

    expected = rank_files(qwen3_5_moe_dir, tmp_path / "official")
    assert any("mtp" in name for model in expected.values() for name in model)
    for fused in (False, True):
        for fused_mtp in (False, True):
            got = rank_files(qwen3_5_input("moe", fused, fused_mtp), tmp_path / f"{fused}-{fused_mtp}")
            assert got.keys() == expected.keys()
            for rank, model in expected.items():
                assert model.keys() == got[rank].keys(), (fused, fused_mtp, rank)
                assert all(torch.equal(t, got[rank][n]) if t is not None else got[rank][n] is None
                           for n, t in model.items()), (fused, fused_mtp, rank)


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
