"""export-lora: Megatron-Bridge LoRA adapters -> HF PEFT adapters and merged HF models.

Adapters are made here directly in Megatron layout, rank by rank, in the form Megatron-Bridge's
ParallelLinearAdapter holds them (B column-parallel in the base layer's row layout; A split on
dim 0 for column-parallel bases, dim 1 for row-parallel ones; experts by ETP and EP), and merged
into a copy of the rank files with the adapter's forward semantics (W + alpha/r * B @ A per rank
shard, with the other ranks' A or B pieces the all-gathers bring). Oracles: megatron-core's forward
on the merged rank files against peft's PeftModel (and transformers on `--merge` output), and
mconv's mcore2hf of the merged rank files (itself checked against megatron-core) against `--merge`.
"""
import json
import os
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.make_fixtures import make_qwen3_moe
from mconv import Layout, hf2mcore, mcore2hf
from mconv.converter import megatron_io as mio
from mconv.converter.layout import Rank
from mconv.converter.lora import ADAPTER_WEIGHTS, adapter_to_peft
from tests.conftest import FIXTURES, ROOT, load_rank_file
from tests.megatron_oracle import MegatronRun, hf_logits, megatron_logits, read_config
from tests.test_errors import assert_refused, mconv
from tests.test_roundtrip import read_all

R, ALPHA = 4, 8.0
SCALE = ALPHA / R
TOKENS = list(range(3, 60, 4))
# a vision-language model's language layers too, and a gated delta-net's in_proj / out_proj (Qwen3.5)
MODULE = re.compile(r"(?:language_model\.)?decoder\.layers\.(\d+)\.(.+?)\.?(linear_qkv|linear_proj|linear_fc1|linear_fc2|"
                    r"in_proj|out_proj)\.weight(\d*)")
# megatron-core's MTP block (a vision-language model's under language_model.): its layer's linear layers (which
# Megatron-Bridge's LoRA wraps by name) and eh_proj
MTP_MODULE = re.compile(r"(?:language_model\.)?mtp\.layers\.(\d+)\.(?:mtp_model_layer\.(.+?)\.?)?"
                        r"(linear_qkv|linear_proj|linear_fc1|linear_fc2|eh_proj)\.weight(\d*)")
LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)")
VISION_MODULE = re.compile(r"vision_model\..+\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight")


def randn(ident: str, *shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(ident.encode()))
    return torch.randn(shape, generator=generator) * 0.2


def chunks_of(state: dict) -> list[dict]:
    if "model" in state:
        return [state["model"]]
    return [state[k] for k in sorted((k for k in state if k.startswith("model")), key=lambda k: int(k[5:]))]


class Adapters:
    """Random Megatron-Bridge adapters for every linear layer of one rank file's chunks (with `vision`,
    also on a Qwen3-VL vision tower's blocks and patch mergers, which Megatron-Bridge's LoRA wraps by name)."""

    def __init__(self, config: dict, layout: Layout, canonical: bool, vision: bool = False, mtp: tuple[str, ...] = ()):
        config = config.get("text_config", config)  # Qwen3-VL: adapters on the language model
        self.config, self.layout, self.canonical, self.vision = config, layout, canonical, vision
        self.mtp = mtp  # the MTP block's modules with adapters (linear_qkv, ..., eh_proj)
        experts = config.get("num_local_experts") or config.get("num_experts") or 0
        self.per_ep = experts // layout.ep if experts else 0

    def shards(self, ident: str, column: bool, out: int, fan_in: int, size: int, rank: int):
        """(A, B) of this group rank, and the delta this rank's base shard gets in the forward pass."""
        if column:  # linear_in ColumnParallel(gather_output): A [r/tp, in]; the rank sees all of A
            a_parts = [randn(f"{ident}/A/{g}", R // size, fan_in) for g in range(size)]
            b = randn(f"{ident}/B/{rank}", out // size, R)
            return a_parts[rank], b, b @ torch.cat(a_parts)
        a = randn(f"{ident}/A/{rank}", R, fan_in // size)  # linear_in RowParallel: A [r, in/tp]
        b_parts = [randn(f"{ident}/B/{g}", out // size, R) for g in range(size)]  # linear_out gathered
        return a, b_parts[rank], torch.cat(b_parts) @ a

    def add(self, rank, v: int, chunk: dict) -> dict:
        """Adapter tensors for the chunk's linear layers; merges each layer's delta into `chunk`."""
        layers = self.layout.chunk_layers(self.config["num_hidden_layers"])[rank.pp][v]
        adapters = {}
        mtp = [n for n in chunk if MTP_MODULE.fullmatch(n) and MTP_MODULE.fullmatch(n).group(3) in self.mtp]
        for name in [n for n in chunk if MODULE.fullmatch(n) or self.vision and VISION_MODULE.fullmatch(n)] + mtp:
            if VISION_MODULE.fullmatch(name):  # a vision block or merger: no experts, split at the language TP
                module = VISION_MODULE.fullmatch(name).group(1)
                path = grouped = ""
                size, group_rank, ident, prefix = self.layout.tp, rank.tp, name, name.removesuffix(".weight")
            else:
                match = MODULE.fullmatch(name) or MTP_MODULE.fullmatch(name)
                layer, path, module, grouped = match.groups()
                layer, path = f"mtp{layer}" if match.re is MTP_MODULE else layers.start + int(layer), path or ""
                expert = re.search(r"(^|\.)experts(\.|$)", path) is not None  # routed, not shared_experts (TP)
                size, group_rank = (self.layout.etp, rank.etp) if expert else (self.layout.tp, rank.tp)
                local = LOCAL_EXPERT.search(path)
                if grouped:  # TE grouped GEMM: one adapter for all of the EP rank's experts
                    ident, prefix = f"{layer}.{module}.ep{rank.ep}", name.rsplit(".", 1)[0]
                else:
                    global_expert = rank.ep * self.per_ep + int(local.group(1)) if local else ""
                    ident = f"{layer}.{LOCAL_EXPERT.sub('e', path)}{global_expert}.{module}"
                    prefix = name.removesuffix(".weight")
            weight = chunk[name]
            column = module in ("linear_qkv", "linear_fc1", "in_proj", "eh_proj")
            out, fan_in = weight.shape[0] * (size if column else 1), weight.shape[1] * (1 if column else size)
            canonical = self.canonical and not grouped and not name.startswith("vision_model.")  # language only
            if canonical and module == "linear_qkv":
                delta = self._canonical_qkv(ident, prefix, fan_in, size, group_rank, adapters)
            elif canonical and module == "linear_fc1":
                parts = [self._one(f"{ident}/{p}", f"{prefix}.adapter.adapter_{p}", True, out // 2, fan_in, size,
                                   group_rank, adapters) for p in ("gate", "up")]
                delta = torch.cat(parts)
            else:
                delta = self._one(ident, f"{prefix}.adapter", column, out, fan_in, size, group_rank, adapters)
            chunk[name] = weight.float() + SCALE * delta
        return adapters

    def _one(self, ident, prefix, column, out, fan_in, size, rank, adapters):
        a, b, delta = self.shards(ident, column, out, fan_in, size, rank)
        adapters[f"{prefix}.linear_in.weight"], adapters[f"{prefix}.linear_out.weight"] = a, b
        return delta

    def _canonical_qkv(self, ident, prefix, fan_in, size, rank, adapters):
        """CanonicalLoRA's q/k/v adapters; their outputs are interleaved by query group as in linear_qkv."""
        c = self.config
        d, heads, groups = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        q, k, v = (self._one(f"{ident}/{p}", f"{prefix}.adapter.adapter_{p}", True, rows, fan_in, size, rank,
                             adapters) for p, rows in (("q", heads * d), ("k", groups * d), ("v", groups * d)))
        local_groups = groups // size
        return torch.cat([q.view(local_groups, -1, fan_in), k.view(local_groups, -1, fan_in),
                          v.view(local_groups, -1, fan_in)], dim=1).reshape(-1, fan_in)


def lora_checkpoint(tmp: Path, hf_dir: Path, layout: Layout, spec="local", canonical=False, adapter_only=False,
                    vision=False, mtp: tuple[str, ...] = ()):
    """hf2mcore's legacy rank files plus adapters (`lora/`) and the same with the adapters merged (`merged/`);
    with `mtp` (module names), converted with --mtp and adapters on those modules of the MTP block too."""
    config = read_config(hf_dir)
    hf2mcore(hf_dir, tmp / "lora", layout, spec=spec, fmt="torch", progress=False, mtp=bool(mtp))
    shutil.copytree(tmp / "lora", tmp / "merged")
    adapters = Adapters(config, layout, canonical, vision, mtp)
    for rank in layout.ranks():
        lora_path = mio.rank_file(tmp / "lora" / "release", layout, rank)
        merged_path = mio.rank_file(tmp / "merged" / "release", layout, rank)
        state = load_rank_file(lora_path)
        added = [adapters.add(rank, v, chunk) for v, chunk in enumerate(chunks_of(state))]  # merges into state
        torch.save(state, merged_path)
        state = load_rank_file(lora_path)
        for chunk, extra in zip(chunks_of(state), added):
            if adapter_only:
                chunk.clear()
            chunk.update(extra)
        torch.save(state, lora_path)
    return tmp / "lora", tmp / "merged"


def export(*args):
    result = mconv("export-lora", *args, "--alpha", ALPHA, "-q")
    assert result.exit_code == 0, result.output
    return result


def peft_logits(hf_dir: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits


# ----------------------------------------------------------------------------- oracle: megatron-core forward

def all_moe(tmp: Path) -> Path:
    """Qwen3-MoE without dense layers: peft 0.21 on transformers 5 drops LoRA on the dense MLPs of a
    Qwen3-MoE (it retargets every gate/up/down_proj to the fused expert parameters), so the peft
    oracle runs on a model whose MLPs are all experts; dense layers are checked by the merge oracle."""
    return make_qwen3_moe(tmp / "hf", seed=3, mlp_only_layers=[])


@pytest.mark.slow
@pytest.mark.parametrize("model,sizes", [(lambda tmp: FIXTURES / "qwen3-tiny", dict(tp=2)),
                                         (all_moe, dict(tp=2, ep=2, etp=1))], ids=["qwen3-tp2", "qwen3-moe-tp2-ep2"])
def test_peft_adapter_matches_megatron_core_forward_of_merged_model(tmp_path, model, sizes):
    hf_dir = model(tmp_path)
    lora, merged = lora_checkpoint(tmp_path, hf_dir, Layout(**sizes))
    export(lora, tmp_path / "adapter")
    export(lora, tmp_path / "merged-hf", "--merge", "--base-model", hf_dir, "--dtype", "float32")
    run = MegatronRun(merged, read_config(hf_dir), **sizes, padded_vocab=512, tokens=TOKENS)
    reference = megatron_logits(run, tmp_path)
    assert (reference - hf_logits(hf_dir, TOKENS)).abs().max() > 1e-2  # the adapter matters
    assert (peft_logits(hf_dir, tmp_path / "adapter") - reference).abs().max().item() < 1e-4
    assert (hf_logits(tmp_path / "merged-hf", TOKENS) - reference).abs().max().item() < 1e-4


# ------------------------------------------------------------- oracle: mcore2hf of the merged rank files

LAYOUTS = [  # fixture, layout, spec, canonical, adapter-only
    ("qwen3-tiny", dict(tp=2, pp=2, vpp=2), "local", False, True),
    ("qwen3-tiny", dict(tp=2), "local", True, False),
    ("qwen3-tiny", dict(tp=2, pp=2), "te", False, False),
    ("qwen3-moe-tiny", dict(tp=2, ep=2, etp=2), "local", False, True),
    ("qwen3-moe-tiny", dict(tp=2, ep=4, etp=1, pp=2), "te", False, False),  # one adapter per EP rank's experts
    ("qwen3-moe-tiny", dict(tp=2, ep=2, etp=1), "local", True, False),
]


@pytest.mark.parametrize("fixture,sizes,spec,canonical,adapter_only", LAYOUTS,
                         ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in s.items())}-{sp}{'-canonical' if c else ''}"
                              f"{'-adapter-only' if a else ''}" for f, s, sp, c, a in LAYOUTS])
def test_merge_equals_megatron_layout_merge_at_any_layout(tmp_path, fixture, sizes, spec, canonical, adapter_only):
    lora, merged = lora_checkpoint(tmp_path, FIXTURES / fixture, Layout(**sizes), spec, canonical, adapter_only)
    export(lora, tmp_path / "ours", "--merge", "--base-model", FIXTURES / fixture, "--dtype", "float32")
    mcore2hf(merged, tmp_path / "theirs", progress=False)
    ours, theirs = read_all(tmp_path / "ours"), read_all(tmp_path / "theirs")
    assert ours.keys() == theirs.keys()
    base, changed = read_all(FIXTURES / fixture), 0
    for name in ours:
        assert ours[name].dtype == torch.float32
        assert torch.allclose(ours[name], theirs[name].float(), atol=1e-6, rtol=0), name
        changed += not torch.equal(ours[name], base[name].float())
    assert changed == sum(1 for n in ours if n.endswith("proj.weight"))  # every linear layer got its delta


def test_adapter_layout_independent_and_vllm_shaped(tmp_path):
    """The same adapter read at TP2 and as a library call at its gathered TP1 form gives identical
    tensors; q/k/v share A, gate/up share A; keys and config follow vLLM's rules."""
    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-tiny", Layout(tp=2))
    summary = json.loads(export(lora, tmp_path / "adapter", "--base-model", "Qwen/Qwen3-tiny", "--json").stdout)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {k: summary[k] for k in ("output", "r", "alpha", "target_modules", "adapter_tensors", "layout")} == {
        "output": "adapter", "r": config["r"], "alpha": config["lora_alpha"], "target_modules": config["target_modules"],
        "adapter_tensors": len(load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)), "layout": "TP2 PP1"}, summary
    assert config["r"] == R and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["bias"] == "none" and not config["modules_to_save"] and not config["use_dora"]
    assert config["base_model_name_or_path"] == "Qwen/Qwen3-tiny"
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert len(tensors) == 4 * 7 * 2 and all(".default." not in k for k in tensors)
    p = "base_model.model.model.layers.3."
    assert torch.equal(tensors[p + "self_attn.q_proj.lora_A.weight"], tensors[p + "self_attn.v_proj.lora_A.weight"])
    assert torch.equal(tensors[p + "mlp.gate_proj.lora_A.weight"], tensors[p + "mlp.up_proj.lora_A.weight"])
    assert tensors[p + "self_attn.k_proj.lora_B.weight"].shape == (64, R)
    gathered = gather_tp2(lora)
    library = adapter_to_peft({Rank(0, 0): [gathered]}, read_config(FIXTURES / "qwen3-tiny"), Layout())
    assert library.tensors.keys() == tensors.keys()
    for key in tensors:
        assert torch.equal(library.tensors[key], tensors[key]), key


def gather_tp2(lora: Path) -> dict:
    """The adapters of TP2 rank files as one TP1 chunk, gathered by hand with Megatron's rules:
    column-parallel pieces concatenated (a column base's A, every B), a row base's A on dim 1,
    fc1's per-rank [gate_r; up_r] B regrouped as [gate; up]."""
    states = [chunks_of(load_rank_file(lora / "release" / f"mp_rank_0{t}" / "model_optim_rng.pt"))[0]
              for t in range(2)]
    gathered = {}
    for name in (n for n in states[0] if ".adapter." in n):
        if "linear_fc1.adapter.linear_out" in name:
            halves = [s[name].chunk(2) for s in states]
            gathered[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            row_a = name.endswith("linear_in.weight") and ("linear_proj" in name or "linear_fc2" in name)
            gathered[name] = torch.cat([s[name] for s in states], dim=1 if row_a else 0)
    return gathered


def save_dist_adapters(tmp_path: Path, hf_dir: Path, adapters: dict, monkeypatch) -> Path:
    """An adapter-only torch_dist checkpoint as megatron-core saves Megatron-Bridge's adapters (TP1 names
    and tensors): each adapter's key is its base layer's key with `weight` replaced by
    `adapter.linear_in.weight` / `adapter.linear_out.weight`, stacked like it on a prepended axis where
    megatron-core stacks the base layer (decoder and vision layers, deepstack mergers: the base key
    without the index has a leading axis of that many entries), saved by dist_checkpointing.save."""
    from torch.distributed.checkpoint import FileSystemReader

    from tests.megatron_dist_oracle import megatron_process_group

    hf2mcore(hf_dir, tmp_path / "base-dist", Layout(), progress=False)
    base_keys = FileSystemReader(str(tmp_path / "base-dist" / "release")).read_metadata().state_dict_metadata
    iter_dir = tmp_path / "dist" / "iter_0000010"
    iter_dir.mkdir(parents=True)
    (tmp_path / "dist" / "latest_checkpointed_iteration.txt").write_text("10")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # megatron-core's writer calls them
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    with megatron_process_group():
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        sharded = {}
        for name, tensor in adapters.items():
            stacked = re.fullmatch(r"(.+?)\.(\d+)\.(.+)", name)
            key, base = name, name.split(".adapter.")[0] + ".weight"
            if stacked and f"{stacked[1]}.{stacked[3]}".split(".adapter.")[0] + ".weight" in base_keys:
                key = f"{stacked[1]}.{stacked[3]}"
                base = key.split(".adapter.")[0] + ".weight"
                count = base_keys[base].size[0]
                sharded[f"{key}/{stacked[2]}"] = ShardedTensor.from_rank_offsets(
                    key, tensor, (0, int(stacked[2]), count), prepend_axis_num=1)
            else:
                sharded[key] = ShardedTensor.from_rank_offsets(key, tensor)
            assert base in base_keys, name  # megatron-core's key of the base layer
        dist_checkpointing.save({"model": sharded}, str(iter_dir))
    return tmp_path / "dist"


def test_torch_dist_adapter_checkpoint(tmp_path, monkeypatch):
    """export-lora of the torch_dist form of the TP2 adapters (gathered by hand) equals that of the rank files."""
    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-tiny", Layout(tp=2))
    dist = save_dist_adapters(tmp_path, FIXTURES / "qwen3-tiny", gather_tp2(lora), monkeypatch)
    export(lora, tmp_path / "from-legacy")
    assert_refused(mconv("export-lora", dist, tmp_path / "x", "--alpha", 1), tmp_path / "x", "--hf-config")
    export(dist, tmp_path / "from-dist", "--hf-config", FIXTURES / "qwen3-tiny")
    assert_same_files(tmp_path / "from-dist", tmp_path / "from-legacy")


def assert_same_files(ours: Path, theirs: Path) -> None:
    ours, theirs = load_file(ours / ADAPTER_WEIGHTS), load_file(theirs / ADAPTER_WEIGHTS)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


# ----------------------------------------------------------------------------- bad inputs

def edit_rank(lora: Path, rank_dir: str, edit) -> None:
    path = lora / "release" / rank_dir / "model_optim_rng.pt"
    state = load_rank_file(path)
    edit(state["model"])
    torch.save(state, path)


def different_rank(chunk):  # layer 2's fc2 adapter trained with r=8 (A [8, ffn/2], B [hidden/2, 8] on each rank)
    chunk["decoder.layers.2.mlp.linear_fc2.adapter.linear_in.weight"] = torch.zeros(8, 48)
    chunk["decoder.layers.2.mlp.linear_fc2.adapter.linear_out.weight"] = torch.zeros(32, 8)


BAD = {
    "no adapters": (lambda chunk: [chunk.pop(n) for n in [n for n in chunk if ".adapter." in n]],
                    ["holds no LoRA adapter tensors"]),
    "ranks disagree": (different_rank, ["different ranks", "linear_fc2.adapter.linear_out.weight has 8"]),
    "no such module": (lambda chunk: chunk.update({
        "decoder.layers.0.self_attention.linear_q_proj.adapter.linear_in.weight": torch.zeros(4, 64)}),
        ["linear_q_proj", "not a LoRA A or B tensor"]),
    "router adapter": (lambda chunk: chunk.update({"decoder.layers.0.mlp.router.adapter.linear_in.weight":
                                                   torch.zeros(4, 64)}), ["mlp.router", "not a LoRA A or B tensor"]),
    "DoRA magnitude": (lambda chunk: chunk.update({"decoder.layers.1.mlp.linear_fc1.adapter.weight_magnitude":
                                                   torch.zeros(96)}), ["weight_magnitude", "DoRA"]),
    "layer beyond the model": (lambda chunk: chunk.update({
        "decoder.layers.7.mlp.linear_fc2.adapter.linear_in.weight": torch.zeros(4, 48),
        "decoder.layers.7.mlp.linear_fc2.adapter.linear_out.weight": torch.zeros(32, 4)}), ["decoder.layers.7"]),
    "shard missing on one rank": (
        lambda chunk: chunk.pop("decoder.layers.3.self_attention.linear_qkv.adapter.linear_out.weight"),
        ["decoder.layers.3.self_attention.linear_qkv.adapter.linear_out.weight", "mp_rank_01", "other ranks"]),
    "A without its B": (  # on every rank: peft would load the adapter with no B for it
        lambda chunk: chunk.pop("decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"),
        ["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight", "no linear_out"]),
    "B without its A": (  # peft would give the missing A random values
        lambda chunk: chunk.pop("decoder.layers.1.mlp.linear_fc1.adapter.linear_in.weight"),
        ["decoder.layers.1.mlp.linear_fc1.adapter.linear_out.weight", "no linear_in"]),
    "integer adapter": (lambda chunk: chunk.update({"decoder.layers.2.mlp.linear_fc2.adapter.linear_in.weight":
                                                    torch.zeros(4, 48, dtype=torch.int32)}),
                        ["linear_fc2.adapter.linear_in.weight", "int32, not a floating-point tensor"]),
    "wrong shape": (lambda chunk: chunk.update({"decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight":
                                                torch.zeros(4, 64)}), ["linear_fc1.adapter.linear_in.weight", "[4, 64]",
                                                                       "expected [2, 64]"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapters_are_refused(tmp_path, case):
    edit, fragments = BAD[case]
    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-tiny", Layout(tp=2), adapter_only=True)
    edit_rank(lora, "mp_rank_01", edit)
    if case in ("no adapters", "A without its B", "B without its A"):
        edit_rank(lora, "mp_rank_00", edit)
    assert_refused(mconv("export-lora", lora, tmp_path / "out", "--alpha", 8), tmp_path / "out", *fragments)
    if case == "ranks disagree":  # inspect says so rather than offer the export
        edit_rank(lora, "mp_rank_00", edit)
        said = mconv("inspect", lora).stdout
        assert "rank 4, 8" in said and "export-lora refuses adapters of different ranks" in said, said
    if case == "B without its A":  # merging too (it was a KeyError's traceback)
        assert_refused(mconv("export-lora", lora, tmp_path / "out", "--alpha", 8, "--merge", "--base-model",
                             FIXTURES / "qwen3-tiny"), tmp_path / "out", *fragments)


def test_options_are_checked(tmp_path):
    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-tiny", Layout(tp=2))
    out = tmp_path / "out"
    assert_refused(mconv("export-lora", lora, out), out, "alpha", "--alpha")
    assert_refused(mconv("export-lora", lora, out, "--alpha", 8, "--rank", 16), out, "rank 4", "--rank 16")
    assert mconv("export-lora", lora, out, "--alpha", 8, "--rank", 0).exit_code == 2  # a usage error
    assert_refused(mconv("export-lora", lora, out, "--alpha", 8, "--merge"), out, "--merge needs --base-model")
    assert_refused(mconv("export-lora", lora, out, "--alpha", 8, "--merge", "--base-model",
                         FIXTURES / "qwen3-moe-tiny"), out, "Qwen3MoeForCausalLM", "Qwen3ForCausalLM")
    assert_refused(mconv("export-lora", lora, out, "--alpha", 8, "--hf-config", FIXTURES / "qwen3-tiny-tied"),
                   out, "num_layers=4")
    # Megatron-Bridge's run_config.yaml gives alpha; --rank agrees with the tensors.
    (lora / "run_config.yaml").write_text("model:\n  num_layers: 4\npeft:\n  _target_: megatron.bridge.peft.lora.LoRA\n"
                                          "  dim: 4\n  alpha: 16\n")
    assert mconv("export-lora", lora, out, "--rank", 4, "-q").exit_code == 0
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 16
    assert mconv("export-lora", lora, out, "--alpha", 8, "-q").exit_code == 1  # exists
    assert mconv("export-lora", lora, out, "--alpha", 8, "-q", "--overwrite").exit_code == 0
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 8


# ----------------------------------------------------------------------------- a real client: vLLM on the CPU

VLLM_PYTHON = Path(os.environ.get("MCONV_VLLM_PYTHON", FIXTURES.parent / ".venv" / "vllm311" / "bin" / "python"))
# The LoRA-to-vLLM example (docs/lora.md), run in the vLLM venv by the test below.
VLLM_SCRIPT = (ROOT / "examples" / "lora_to_vllm.py").read_text()


# Skipped only outside CI: .ci/run installs the venv, so in CI a missing venv is a failure, not a skip.
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file() and not os.environ.get("CI"),
                                reason=f"no vLLM CPU venv at {VLLM_PYTHON} (scripts/install-vllm.sh; or set "
                                       "MCONV_VLLM_PYTHON)")


def run_vllm(tmp_path: Path, script: str, *args, marker: str = "TOKENS "):
    """Run `script` in the vLLM venv (torchvision made importable by tests/vllm_site); the JSON it prints
    after `marker`."""
    import subprocess

    (tmp_path / "vllm_check.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "vllm_site"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(VLLM_PYTHON), str(tmp_path / "vllm_check.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=480, cwd=tmp_path, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[0][len(marker):])


@pytest.mark.slow
@needs_vllm
def test_vllm_loads_the_adapter_and_generates_what_peft_does(tmp_path):
    """vLLM's own loader accepts the exported adapter, and its greedy tokens (float32) are transformers+peft's.
    Dense Qwen3 only: vLLM's CPU build has no MoE-LoRA kernel."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf_dir = FIXTURES / "qwen3-tiny"
    lora, _ = lora_checkpoint(tmp_path, hf_dir, Layout(tp=2), adapter_only=True)
    export(lora, tmp_path / "adapter", "--base-model", hf_dir)
    served = run_vllm(tmp_path, VLLM_SCRIPT, hf_dir, tmp_path / "adapter", json.dumps(TOKENS))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                      tmp_path / "adapter").eval()
    assert served == greedy(model, TOKENS, 8)
    with model.disable_adapter():
        assert greedy(model, TOKENS, 8) != served  # the adapter changes what is generated


def greedy(model, tokens: list[int], steps: int) -> list[int]:
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(tokens):]
