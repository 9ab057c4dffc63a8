"""BailingMoeV3 in torch_dist: per-layer keys derived from the table (mconv/converter/torch_dist.py),
bit-exact round trips over model variants (MTP kept or not), the derived boxes equal to megatron-core's
`sharded_state_dict()` of the oracle's model, and megatron-core's `dist_checkpointing.load` reading what
hf2mcore wrote into that model at TP2/EP2.

The oracle model is tests/test_bailing_oracle.py's: megatron-core's GPTModel with its own local-spec
MLA (plus AReaL's head-wise `linear_gate`), dense MLP and MoE (SequentialMLP, sigmoid router with expert
bias, shared experts), whose `sharded_state_dict()` megatron-core computes; megatron-core has no KDA, so
the KDA module there is given AReaL's `KimiDeltaAttention.sharded_state_dict` (kda_attention.py,
branch chucai.dzq/gh-bailing-v3-swe-sft): `A_log`/`dt_bias` split by TP on axis 0, `in_proj.weight`
and `conv1d.weight` one global tensor per section (`.query`, `.key`, `.value`, `.g`, `.gate`), the
output norm replicated, the linears as megatron-core shards them; and, as AReaL's KDA layers keep a
separate `input_layernorm`, no `sharded_state_dict_keys_map` there (megatron-core's local MLA spec has
none either), so every Bailing layer's norms keep their local-spec names.
"""
from __future__ import annotations

import dataclasses
import types
from collections import Counter
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.make_fixtures import make_bailing_v3
from mconv import Layout, hf2mcore, mcore2hf
from tests.conftest import load_rank_file
from tests.megatron_oracle import _cpu_shims, _free_port, read_config
from tests.ranks import start_ranks
from tests.test_bailing import SMALL
from tests.test_roundtrip import assert_bit_identical, read_all

SECTIONS = ("query", "key", "value", "g", "gate")


@st.composite
def model_case(draw):
    layers, mtp = draw(st.integers(1, 5)), draw(st.integers(0, 1))
    # With MTP the last decoder layer is MoE: megatron-core builds the MTP layer from its spec.
    model = dict(SMALL, num_hidden_layers=layers, layer_group_size=draw(st.integers(1, 4)),
                 first_k_dense_replace=draw(st.integers(0, layers - mtp)), no_kda_lora=draw(st.booleans()),
                 q_lora_rank=draw(st.sampled_from([None, 16])), tie_word_embeddings=draw(st.booleans()),
                 num_experts=draw(st.sampled_from([4, 8])), vocab_size=draw(st.integers(17, 120)),
                 num_nextn_predict_layers=mtp)
    layout = Layout(tp=draw(st.sampled_from([1, 2, 4])), vocab_divisor=draw(st.sampled_from([1, 8, 128])))
    return model, layout, draw(st.sampled_from([torch.bfloat16, torch.float32]))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_case(), seed=st.integers(0, 2**16))
def test_torch_dist_round_trip_is_bit_identical(tmp_path_factory, case, seed):
    model, layout, dtype = case
    tmp = tmp_path_factory.mktemp("bailing-dist")
    hf = make_bailing_v3(tmp / "hf", seed=seed, dtype=dtype, tokenizer=False, **model)
    # MTP layers kept in megatron-core's MTP block (per layer, `mtp.layers.{j}.transformer_layer.`).
    hf2mcore(hf, tmp / "megatron", layout, fmt="torch_dist", progress=False, mtp=bool(model["num_nextn_predict_layers"]))
    mcore2hf(tmp / "megatron", tmp / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp / "back"))


def test_keys_are_per_layer_with_kda_sections(tmp_path):
    """What AReaL's model asks for: per-layer keys (KDA and MLA layers differ), local-spec names,
    the KDA fused tensors one global tensor per section, experts on an expert axis, fp32 buffers kept."""
    from mconv.converter.torch_dist_io import TorchDistReader

    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False)  # layers: 0 KDA+dense, 1 MLA+dense, 2 KDA+MoE, 3 MLA+MoE
    hf2mcore(hf, tmp_path / "m", Layout(), progress=False)
    stored = TorchDistReader(tmp_path / "m" / "release").tensors
    c = read_config(hf)
    p = c["num_attention_heads"] * c["head_dim"]
    assert {f"decoder.layers.0.self_attention.in_proj.weight.{s}" for s in SECTIONS} <= stored.keys()
    assert stored["decoder.layers.0.self_attention.in_proj.weight.gate"].shape == (p, c["hidden_size"])
    assert stored["decoder.layers.2.self_attention.conv1d.weight.value"].shape == (p, 1, c["short_conv_kernel_size"])
    assert stored["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"].shape == (
        c["num_experts"], 2 * c["moe_intermediate_size"], c["hidden_size"])
    assert stored["decoder.layers.3.mlp.router.expert_bias"].dtype == torch.float32
    assert {"decoder.layers.1.input_layernorm.weight", "decoder.layers.1.self_attention.kv_layernorm.weight",
            "decoder.layers.0.input_layernorm.weight", "decoder.layers.2.pre_mlp_layernorm.weight"} <= stored.keys()
    assert not any(key.startswith("decoder.layers.self_attention") for key in stored)


# ------------------------------------------------------------------------- megatron-core's loader

def _areal_kda_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """AReaL's KimiDeltaAttention.sharded_state_dict for the oracle's KDA module (see the module docstring)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

    own = {}
    self._save_to_state_dict(own, "", keep_vars=True)
    sharded = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets)
    for name, module in self.named_children():
        if name in ("conv1d", "out_norm"):
            sharded.update(make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True),
                                                               f"{prefix}{name}.", {"weight": 0} if name == "conv1d"
                                                               else {}, sharded_offsets))
        else:
            sharded.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata))

    def split(whole, sizes, names):
        template = whole.without_data()

        def build(key, tensor, replica_id, flattened_range):
            full = dataclasses.replace(template, key=key, data=tensor, dtype=tensor.dtype, replica_id=replica_id,
                                       flattened_range=flattened_range)
            pieces, start = [], 0
            for size, section in zip(sizes, names):
                (piece,) = full.narrow(0, start, size)
                piece.key = f"{piece.key}.{section}"
                pieces.append(piece)
                start += size
            return pieces
        return ShardedTensorFactory(whole.key, whole.data, build, torch.cat, whole.replica_id)

    sharded[f"{prefix}in_proj.weight"] = split(sharded[f"{prefix}in_proj.weight"], self.sections, SECTIONS)
    sharded[f"{prefix}conv1d.weight"] = split(sharded[f"{prefix}conv1d.weight"], self.sections[:3], SECTIONS[:3])
    return sharded


def _oracle_model(args, hf_config: dict, tp: int, ep: int):
    """test_bailing_oracle.py's model for this rank, built from the stored args, with AReaL's KDA
    sharded_state_dict (see the module docstring)."""
    from tests.test_bailing_oracle import _core_config, bailing_model

    model = bailing_model(_core_config(args, tp, ep), hf_config, args.padded_vocab_size)
    for layer in model.decoder.layers:
        if type(layer.self_attention).__name__ == "AReaLKDA":
            layer.self_attention.sharded_state_dict = types.MethodType(_areal_kda_sharded_state_dict,
                                                                       layer.self_attention)
            # AReaL's KDA layer keeps its own input_layernorm (TENorm), so no key map; the oracle builds
            # the rest of the layer from megatron-core's local GPT spec, whose map is for a fused qkv norm.
            layer.submodules_config.sharded_state_dict_keys_map = {}
    return model


def _worker(rank: int, mode: str, dist_dir: Path, legacy_dir: Path, hf_config: dict, tp: int, ep: int, port: int,
            out: Path):
    """mode "keys" (one process, TP1): megatron-core's boxes of the oracle model and mconv's derived ones;
    mode "load": dist_checkpointing.load into the rank's model, its parameters against the legacy rank
    file of that rank, and the logits."""
    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=max(tp, ep))
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.training.checkpointing import get_checkpoint_name

    from mconv.converter.torch_dist_io import TorchDistReader
    from tests.test_bailing_oracle import TOKENS

    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    reader = TorchDistReader(dist_dir / "release")
    model = _oracle_model(reader.args, hf_config, tp, ep)  # from the args hf2mcore stored, as a trainer resumes
    if mode == "keys":
        from tests.megatron_dist_oracle import box_record, parameter_names, sharded_items

        names = parameter_names(model)
        torch.save([box_record(item, names) for item in sharded_items(model)], out)
        dist.destroy_process_group()
        return
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(dist_dir / "release"),
                                     strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(loaded["model"], strict=True)
    legacy = load_rank_file(get_checkpoint_name(str(legacy_dir), 0, True, expert_parallel=ep > 1,
                                                expert_rank=ps.get_expert_model_parallel_rank()))
    ours = model.state_dict()
    differing = [name for name, tensor in legacy["model"].items()
                 if not name.endswith("_extra_state") and not torch.equal(ours[name], tensor)]
    tokens = torch.tensor([TOKENS])
    mask = torch.ones(1, 1, len(TOKENS), len(TOKENS), dtype=torch.bool).triu(1)
    with torch.no_grad():
        logits = model(tokens, torch.arange(len(TOKENS))[None], mask)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, differing)
    if rank == 0:
        torch.save((logits[..., : hf_config["vocab_size"]], gathered), out)
    dist.barrier()
    dist.destroy_process_group()


VARIANTS = {"default": {}, "kda-lora-no-q-lora-tied": dict(no_kda_lora=False, q_lora_rank=None, tie_word_embeddings=True),
            "mtp": dict(num_nextn_predict_layers=1)}


def _run(tmp_path: Path, variant: str, mode: str, tp: int, ep: int):
    """hf2mcore's torch_dist (vocabulary padded for `tp`) and legacy rank files (TP `tp`, EP `ep`, local
    spec) of the variant's fp32 model, and what `_worker` returns for them."""
    model = VARIANTS[variant]
    mtp = bool(model.get("num_nextn_predict_layers"))
    hf = make_bailing_v3(tmp_path / "hf", seed=11, dtype=torch.float32, tokenizer=False, **model)
    hf2mcore(hf, tmp_path / "dist", Layout(tp=tp), fmt="torch_dist", progress=False, mtp=mtp)
    hf2mcore(hf, tmp_path / "legacy", Layout(tp=tp, ep=ep), spec="local", fmt="torch", progress=False, mtp=mtp)
    out = tmp_path / "out.pt"
    start_ranks(_worker, args=(mode, tmp_path / "dist", tmp_path / "legacy", read_config(hf), tp, ep,
                               _free_port(), out), nprocs=max(tp, ep))
    return hf, mtp, torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_derived_boxes_equal_the_oracle_models(tmp_path, variant):
    """mconv's torch_dist boxes for BailingMoeV3 equal the `sharded_state_dict()` of the oracle's model
    (megatron-core's MLA, MoE, MTP block; AReaL's KDA keys), box for box (see test_torch_dist_keys.py)."""
    from tests.test_torch_dist_keys import derived

    hf, mtp, theirs = _run(tmp_path, variant, "keys", 1, 1)
    ours, _, _ = derived(read_config(hf), Layout(), lambda name: torch.float32, mtp)
    assert Counter(ours) == Counter(theirs), (sorted(set(ours) - set(theirs), key=str)[:5],
                                              sorted(set(theirs) - set(ours), key=str)[:5])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_core_loads_bailing_torch_dist_at_tp2_ep2(tmp_path, variant):
    """megatron-core's dist_checkpointing.load (every key of the model's sharded state dict and of the
    checkpoint accounted for) reads hf2mcore's torch_dist into the TP2/EP2 model: each rank's parameters
    equal the legacy TP2/EP2 rank file hf2mcore writes for that rank (which the forward oracle of
    test_bailing_oracle.py proves), and the forward equals the transformers-modules reference."""
    from tests.test_bailing_oracle import TOKENS, HFReference

    hf, _, (logits, differing) = _run(tmp_path, variant, "load", 2, 2)
    assert differing == [[], []]
    reference = HFReference(hf)(TOKENS)[:1]  # the decoder's logits (MTP depths follow)
    assert ((logits - reference).abs().max() / reference.abs().max()).item() < 1e-5
