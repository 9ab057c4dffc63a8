"""BailingMoeV3 (Ling 3.0): bit-exact round trips over layouts and model variants, the MTP rule, the
names AReaL's Bailing V3 bridge loads, and the Megatron args (with the refusals megatron-core forces)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fixtures.make_fixtures import BAILING_V3, bailing_v3_tensors, make_bailing_v3
from mconv import Layout, MconvError, hf2mcore, mcore2hf
from mconv.converter import megatron_io as mio
from mconv.converter.planner import make_plan
from mconv.mappings import architecture_for
from tests.conftest import FIXTURES, ROOT, load_rank_file
from tests.ranks import start_ranks
from tests.test_roundtrip import assert_bit_identical, read_all

SMALL = dict(hidden_size=32, head_dim=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=8, intermediate_size=32, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
             vocab_size=100)


@st.composite
def model_and_layout(draw):
    layers = draw(st.integers(1, 5))
    mtp = draw(st.sampled_from([0, 1, 2]))
    # With MTP kept, the last decoder layer is MoE like the MTP layers (megatron-core builds them from its spec).
    model = dict(SMALL, num_hidden_layers=layers, layer_group_size=draw(st.integers(1, 4)),
                 num_nextn_predict_layers=mtp, first_k_dense_replace=draw(st.integers(0, layers - bool(mtp))),
                 no_kda_lora=draw(st.booleans()),
                 q_lora_rank=draw(st.sampled_from([None, 16])), tie_word_embeddings=draw(st.booleans()),
                 num_experts=draw(st.sampled_from([4, 8])), vocab_size=draw(st.integers(17, 120)))
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([p for p in (1, 2, 3) if p <= layers]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if model["num_experts"] % e == 0]))
    etp = draw(st.sampled_from([e for e in (1, 2, 4) if tp % e == 0]))
    layout = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, vocab_divisor=draw(st.sampled_from([1, 8, 128])))
    try:
        layout.validate(layers)
    except MconvError:
        layout = Layout(tp=tp, ep=ep, etp=etp, vocab_divisor=layout.vocab_divisor)
    return model, layout, draw(st.sampled_from(["local", "te"])), draw(st.sampled_from([torch.bfloat16, torch.float32]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_and_layout(), seed=st.integers(0, 2**16))
def test_round_trip_is_bit_identical(tmp_path_factory, case, seed):
    """HF -> Megatron -> HF is bit-identical; a model with MTP layers is converted with --mtp (without it
    they are left out, test_mtp_layers_are_left_out_with_a_note)."""
    model, layout, spec, dtype = case
    tmp = tmp_path_factory.mktemp("bailing")
    hf = make_bailing_v3(tmp / "hf", seed=seed, dtype=dtype, tokenizer=False, **model)
    mtp = bool(model["num_nextn_predict_layers"])
    hf2mcore(hf, tmp / "megatron", layout, spec=spec, fmt="torch", progress=False, mtp=mtp)
    mcore2hf(tmp / "megatron", tmp / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp / "back"))


def test_fixture_round_trip_keeps_fp32_buffers(tmp_path):
    hf2mcore(FIXTURES / "bailing-v3-tiny", tmp_path / "m", Layout(tp=2, ep=2), spec="te", fmt="torch", progress=False)
    state = load_rank_file(tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt")["model"]
    assert state["decoder.layers.3.mlp.router.expert_bias"].dtype == torch.float32
    assert state["decoder.layers.0.self_attention.A_log"].dtype == torch.float32
    assert state["decoder.layers.1.self_attention.linear_gate.weight"].dtype == torch.bfloat16
    # As a checkpoint from another tool: no mconv.json, so the spec is read from the names (the fused MLA norms).
    (tmp_path / "m" / "mconv.json").unlink()
    mcore2hf(tmp_path / "m", tmp_path / "back", hf_config=FIXTURES / "bailing-v3-tiny", progress=False)
    assert_bit_identical(read_all(FIXTURES / "bailing-v3-tiny"), read_all(tmp_path / "back"))


def test_config_carries_every_ling3_key():
    config = json.loads((FIXTURES / "bailing-v3-tiny" / "config.json").read_text())
    keys = """vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads
        head_dim rms_norm_eps use_qkv_bias rope_theta rope_scaling rope_interleave q_lora_rank kv_lora_rank
        qk_nope_head_dim qk_rope_head_dim v_head_dim gated_attention_proj_granularity_type layer_group_size
        no_kda_lora kda_safe_gate kda_lower_bound short_conv_kernel_size num_experts num_experts_per_tok
        num_shared_experts moe_intermediate_size moe_shared_expert_intermediate_size first_k_dense_replace n_group
        topk_group routed_scaling_factor score_function num_nextn_predict_layers mtp_loss_scaling_factor
        tie_word_embeddings""".split()
    assert not set(keys) - config.keys()
    assert config == BAILING_V3


def test_mtp_layers_are_left_out_with_a_note(tmp_path):
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, num_nextn_predict_layers=1)
    summary = hf2mcore(hf, tmp_path / "m", Layout(tp=2), fmt="torch", progress=False)
    assert summary.notes == ["left out model.layers.4.* (multi-token-prediction layer: AReaL's layout has no MTP, "
                             "so it is not converted; --mtp keeps it in megatron-core's MTP block)"]
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    original = {k: v for k, v in read_all(hf).items() if not k.startswith("model.layers.4.")}
    assert len(original) < len(read_all(hf))
    assert_bit_identical(original, read_all(tmp_path / "back"))
    cli = subprocess.run([sys.executable, "-m", "mconv.cli", "hf2mcore", str(hf), str(tmp_path / "c"), "--format",
                          "torch"], capture_output=True, text=True, cwd=ROOT)  # -q hides notes too
    assert cli.returncode == 0 and cli.stderr.strip() == "mconv: note: " + summary.notes[0]


# AReaL's Bailing V3 bridge (areal-project/AReaL branch chucai.dzq/gh-bailing-v3-swe-sft,
# areal/models/mcore/bailing_v3_bridge.py): _DIRECT_MAPPING, _KDA_ATTENTION_MAPPING,
# _MLA_ATTENTION_MAPPING_{COMMON,Q_LORA,Q_DIRECT} and _MLP_MAPPING, copied as data.
AREAL_DIRECT = {"embedding.word_embeddings.weight": "model.word_embeddings.weight",
                "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
AREAL_KDA = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.in_proj.weight": ["attention.q_proj.weight", "attention.k_proj.weight", "attention.v_proj.weight",
                                      "attention.f_proj.weight", "attention.g_proj.weight"],
    "self_attention.conv1d.weight": ["attention.q_conv1d.weight", "attention.k_conv1d.weight",
                                     "attention.v_conv1d.weight"],
    "self_attention.beta_proj.weight": ["attention.b_proj.weight"],
    "self_attention.out_norm.weight": ["attention.o_norm.weight"],
    "self_attention.out_proj.weight": ["attention.o_proj.weight"],
    "self_attention.dt_bias": ["attention.dt_bias"],
    "self_attention.A_log": ["attention.A_log"],
}
AREAL_MLA_Q_DIRECT = {"self_attention.linear_q_proj.weight": ["attention.q_proj.weight"]}
AREAL_MLA_Q_LORA = {
    "self_attention.linear_q_down_proj.weight": ["attention.q_a_proj.weight"],
    "self_attention.linear_q_up_proj.layer_norm_weight": ["attention.q_a_layernorm.weight"],
    "self_attention.linear_q_up_proj.weight": ["attention.q_b_proj.weight"],
}
AREAL_MLA = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.linear_kv_down_proj.weight": ["attention.kv_a_proj_with_mqa.weight"],
    "self_attention.linear_kv_up_proj.layer_norm_weight": ["attention.kv_a_layernorm.weight"],
    "self_attention.linear_kv_up_proj.weight": ["attention.kv_b_proj.weight"],
    "self_attention.linear_proj.weight": ["attention.dense.weight"],
    "self_attention.linear_gate.weight": ["attention.g_proj.weight"],
}
AREAL_MLP = {
    "mlp.linear_fc1.layer_norm_weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_experts.down_proj.weight"],
    "mlp.shared_experts.linear_fc1.weight": ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.router.expert_bias": ["mlp.gate.expert_bias"],
    "mlp.experts.linear_fc1.weight": ["mlp.experts.{expert_id}.gate_proj.weight", "mlp.experts.{expert_id}.up_proj.weight"],
    "mlp.experts.linear_fc2.weight": ["mlp.experts.{expert_id}.down_proj.weight"],
}


def areal_hf_names(name: str, config: dict) -> list[str]:
    """What AReaL's bridge maps a Megatron name to (its _weight_name_mapping_mcore_to_hf, by substring)."""
    if name in AREAL_DIRECT:
        return [AREAL_DIRECT[name]]
    layer = name.split(".")[2]
    prefix = f"model.layers.{layer}."
    if "self_attention" in name or "input_layernorm.weight" in name:
        i, group, total = int(layer), config["layer_group_size"], config["num_hidden_layers"]
        is_kda = group > 1 and i < total // group * group and (i + 1) % group != 0
        mapping = AREAL_KDA if is_kda else {**AREAL_MLA, **(AREAL_MLA_Q_LORA if config["q_lora_rank"] else AREAL_MLA_Q_DIRECT)}
    else:
        mapping = AREAL_MLP
    for keyword, names in mapping.items():
        if keyword in name:
            expert = name.split("weight")[-1]
            return [prefix + n.format(expert_id=expert) for n in names]
    raise AssertionError(f"AReaL's bridge has no mapping for {name}")


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}, {"tie_word_embeddings": True},
                                       {"layer_group_size": 4, "num_hidden_layers": 6, "first_k_dense_replace": 1}])
def test_te_names_are_arealS_bridge_names(overrides):
    config = {**BAILING_V3, **overrides}
    plan = make_plan(architecture_for(config), config, Layout(), "te")
    tasks = [t for t in plan.ranks[0].chunks[0] if t.shard is not None]
    assert tasks
    for task in tasks:
        assert list(task.hf) == areal_hf_names(task.megatron, config), task.megatron
    # Every HF tensor of the checkpoint is covered, and nothing else is asked for.
    assert plan.hf_shapes() == {name: shape for name, (shape, _) in bailing_v3_tensors(config).items()}


def test_megatron_args_for_a_trainer():
    arch = architecture_for(BAILING_V3)
    args = arch.megatron_args(arch.dims(BAILING_V3))
    assert args["moe_layer_freq"] == [0, 0, 1, 1]
    assert {k: args[k] for k in ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                                 "moe_router_group_topk", "moe_router_topk", "moe_router_topk_scaling_factor",
                                 "moe_shared_expert_intermediate_size", "moe_ffn_hidden_size", "num_experts")} == dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk=4, moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=32, moe_ffn_hidden_size=32, num_experts=8)
    assert {k: args[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                 "qk_pos_emb_head_dim", "v_head_dim", "rotary_percent", "rope_type",
                                 "rotary_base")} == dict(
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=16, rotary_percent=1.0, rope_type="rope", rotary_base=600000.0)
    yarn = dict(BAILING_V3, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    args = arch.megatron_args(arch.dims(yarn))
    assert {k: args[k] for k in ("rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
                                 "original_max_position_embeddings")} == dict(
        rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
        original_max_position_embeddings=64)


@pytest.mark.parametrize("overrides, field", [
    ({"num_experts_per_tok": 2}, "num_experts_per_tok=2 with topk_group=2"),
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"use_qkv_bias": True}, "use_qkv_bias=true"),
    ({"gated_attention_proj_granularity_type": "element_wise"}, "gated_attention_proj_granularity_type"),
])
def test_refuses_what_megatron_core_cannot_compute(tmp_path, overrides, field):
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, **overrides)
    with pytest.raises(MconvError, match="^config.json") as error:
        hf2mcore(hf, tmp_path / "m", Layout(), fmt="torch", progress=False)
    assert field in str(error.value) and not (tmp_path / "m").exists()


def test_refusal_is_one_line_on_the_command_line(tmp_path):
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, num_experts_per_tok=6)
    cli = subprocess.run([sys.executable, "-m", "mconv.cli", "hf2mcore", str(hf), str(tmp_path / "m"), "--format",
                          "torch", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1, cli.stderr
    assert cli.stderr.startswith("mconv: error: config.json num_experts_per_tok=6 with topk_group=2")


LORA_MODULE = re.compile(r"decoder\.layers\.(\d+)\.(.*?)\.?(in_proj|out_proj|linear_q_up_proj|linear_kv_up_proj|linear_gate|"
                         r"linear_proj|linear_fc1|linear_fc2)\.weight")
LORA_COLUMN = {"in_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_gate", "linear_fc1"}


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """The fixture at TP2/EP2 with random Megatron-Bridge adapters on KDA in_proj (one A, B rows in the
    rank's [q; k; v; f; g] sections), MLA, gate, dense, experts and shared experts (`lora`); the same
    checkpoint with every adapter merged in Megatron layout as in test_lora.py, W + alpha/r * B @ A per
    rank shard (`merged`); export-lora's adapter (`adapter`) and its --merge output in fp32 (`ours`)."""
    from tests.test_lora import SCALE, Adapters, chunks_of, export

    tmp_path, layout = tmp_path_factory.mktemp("bailing-lora"), Layout(tp=2, ep=2)
    hf2mcore(FIXTURES / "bailing-v3-tiny", tmp_path / "lora", layout, fmt="torch", progress=False)
    shutil.copytree(tmp_path / "lora", tmp_path / "merged")
    adapters = Adapters(BAILING_V3, layout, canonical=False)
    for rank in layout.ranks():
        path = mio.rank_file(tmp_path / "lora" / "release", layout, rank)
        state = load_rank_file(path)
        added = {}
        for name, weight in list(chunks_of(state)[0].items()):
            if not LORA_MODULE.fullmatch(name):
                continue
            layer, module_path, module = LORA_MODULE.fullmatch(name).groups()
            expert = re.search(r"local_experts\.(\d+)", module_path)
            size, group_rank = (layout.etp, rank.etp) if expert else (layout.tp, rank.tp)
            ident = f"{layer}.{module_path}{rank.ep * 4 + int(expert.group(1)) if expert else ''}.{module}"
            column = module in LORA_COLUMN
            out, fan_in = weight.shape[0] * (size if column else 1), weight.shape[1] * (1 if column else size)
            a, b, delta = adapters.shards(ident, column, out, fan_in, size, group_rank)
            prefix = name.removesuffix(".weight") + ".adapter"
            added[prefix + ".linear_in.weight"], added[prefix + ".linear_out.weight"] = a, b
            chunks_of(state)[0][name] = weight.float() + SCALE * delta
        torch.save(state, mio.rank_file(tmp_path / "merged" / "release", layout, rank))
        state = load_rank_file(path)
        chunks_of(state)[0].update(added)
        torch.save(state, path)
    export(tmp_path / "lora", tmp_path / "adapter")
    export(tmp_path / "lora", tmp_path / "ours", "--merge", "--base-model", FIXTURES / "bailing-v3-tiny", "--dtype",
           "float32")
    return tmp_path


def test_export_lora_merge_equals_megatron_layout_merge(tmp_path, lora):
    """LoRA at TP2/EP2 (the `lora` fixture): export-lora --merge must equal mcore2hf of the rank files
    merged in Megatron layout (whose base mapping the oracle in test_bailing_oracle.py checks)."""
    hf = FIXTURES / "bailing-v3-tiny"
    peft = load_file(lora / "adapter" / "adapter_model.safetensors")
    a = "base_model.model.model.layers.0.attention.{}_proj.lora_A.weight"
    assert all(torch.equal(peft[a.format("q")], peft[a.format(x)]) for x in "kvfg")
    mcore2hf(lora / "merged", tmp_path / "theirs", progress=False)
    ours, theirs, base = read_all(lora / "ours"), read_all(tmp_path / "theirs"), read_all(hf)
    assert ours.keys() == theirs.keys() == base.keys()
    changed = 0
    for name in ours:
        assert torch.allclose(ours[name], theirs[name].float(), atol=1e-6, rtol=0), name
        changed += not torch.equal(ours[name], base[name].float())
    assert changed == len([k for k in peft if "lora_B" in k]) == 80  # every targeted HF projection


def test_export_lora_merge_cast_keeps_float32_tensors(tmp_path, lora):
    """`export-lora --merge --dtype bfloat16` is, tensor by tensor, what transformers loads from the
    float32 merge with dtype=bfloat16 (expert_bias, A_log and dt_bias stay float32), and says so."""
    from tests.test_fp32_kept import bailing_fp32_modules, transformers_cast
    from tests.test_lora import ALPHA, mconv

    result = mconv("export-lora", lora / "lora", tmp_path / "cast", "--merge", "--base-model",
                   FIXTURES / "bailing-v3-tiny", "--dtype", "bfloat16", "--alpha", ALPHA)
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("mconv: note: kept 6 tensors in float32, as the model keeps them"), result.stderr
    assert_bit_identical(transformers_cast(lora / "ours", torch.bfloat16, bailing_fp32_modules()),
                         read_all(tmp_path / "cast"))


def _hf_module_tree(hf_dir) -> torch.nn.Module:
    """BailingMoeV3 as a module tree under the HF names (transformers cannot build it: remote code): an
    nn.Linear for every 2-D `.weight` (each LoRA target is one), loaded with the checkpoint's tensors in
    fp32; other tensors (norms, conv1d, A_log, dt_bias, expert_bias) as plain parameters of a module."""
    root = torch.nn.Module()
    tensors = read_all(hf_dir)
    linear = {name for name, t in tensors.items() if name.endswith(".weight") and t.dim() == 2}
    for name in sorted(tensors, key=lambda n: n not in linear):  # a Linear before its buffers (gate.expert_bias)
        tensor, (*path, leaf) = tensors[name], name.split(".")
        module = root
        for part in path[:-1] if name in linear else path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        if name in linear:
            module.add_module(path[-1], torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False))
            getattr(module, path[-1]).weight.data = tensor.float()
        else:
            module.register_parameter(leaf, torch.nn.Parameter(tensor.float(), requires_grad=False))
    return root


def test_peft_loads_the_adapter_and_merges_as_export_lora(lora):
    """peft is the oracle for the exported adapter: injected into a module tree with the HF names
    (_hf_module_tree), PeftModel.from_pretrained reports no missing LoRA keys and no unexpected keys, and
    peft's merge_and_unload gives the weights export-lora --merge writes (fp32, every tensor)."""
    from peft import LoraConfig, PeftModel

    # The adapter's task_type CAUSAL_LM makes peft wrap a transformers model (generation methods); the
    # module tree has none, so the plain PeftModel wraps it, with the adapter_config.json read by peft.
    config = LoraConfig.from_pretrained(lora / "adapter")
    config.task_type = None
    model = PeftModel.from_pretrained(_hf_module_tree(FIXTURES / "bailing-v3-tiny"), lora / "adapter", config=config)
    loaded = load_file(lora / "adapter" / "adapter_model.safetensors")
    injected = {name for name, _ in model.named_parameters() if ".lora_" in name}
    assert {k.replace(".weight", ".default.weight") for k in loaded} == injected  # no missing, no unexpected
    merged = {name: p for name, p in model.merge_and_unload().named_parameters()}
    ours = read_all(lora / "ours")
    assert merged.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6, rtol=0), name


def test_inspect_trainer_flags_parse_back_to_the_saved_args(tmp_path):
    """`mconv inspect`'s trainer flags for this model (MLA dims, sigmoid router with expert bias and
    groups, shared experts) mean, to Megatron-LM's own parser, the args hf2mcore stored."""
    import argparse
    import warnings

    from megatron.training.arguments import add_megatron_arguments

    from mconv.converter.describe import inspect_path

    warnings.filterwarnings("ignore")
    hf2mcore(FIXTURES / "bailing-v3-tiny", tmp_path / "m", Layout(tp=2, ep=2), fmt="torch", progress=False)
    saved = vars(mio.load_rank_file(tmp_path / "m/release/mp_rank_00_000/model_optim_rng.pt")["args"])
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    parsed, unknown = parser.parse_known_args(inspect_path(tmp_path / "m")["trainer_flags"])
    assert not unknown
    for dest in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                 "v_head_dim", "rope_type", "moe_router_score_function", "moe_router_enable_expert_bias",
                 "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
                 "moe_shared_expert_intermediate_size", "moe_router_dtype", "moe_layer_freq", "num_experts"):
        assert getattr(parsed, dest) == saved[dest], dest


def _bridge_adapter_worker(rank: int, hidden: int, outs: dict, r: int, alpha: float, port: int, out):
    """Megatron-Bridge's ParallelLinearAdapter as its LoRA puts it on a TE-duplicated linear (TELinear,
    parallel_mode="duplicated": get_adapter_attributes_from_linear gives input_is_parallel=False,
    base_linear_is_parallel=False), at TP2 in gloo processes: random shards, one forward."""
    import importlib
    import types
    import warnings

    import torch.distributed as dist

    import megatron
    from tests.megatron_oracle import _cpu_shims

    warnings.filterwarnings("ignore")
    _cpu_shims()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    ps.initialize_model_parallel(2)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # megatron.bridge.peft's __init__ imports Transformer Engine; its utils module (the adapter) does not need it.
    root = next(Path(p) / "bridge" for p in megatron.__path__ if (Path(p) / "bridge").is_dir())
    for name, path in (("megatron.bridge", root), ("megatron.bridge.peft", root / "peft")):
        sys.modules.setdefault(name, types.ModuleType(name)).__path__ = [str(path)]
    utils = importlib.import_module("megatron.bridge.peft.utils")
    x = torch.randn(5, 1, hidden, generator=torch.Generator().manual_seed(0))
    result = {"x": x}
    for module, features in outs.items():
        config = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True, params_dtype=torch.float32)
        adapter = utils.ParallelLinearAdapter(hidden, features, r, module, activation="identity", alpha=alpha,
                                              input_is_parallel=False, base_linear_is_parallel=False,
                                              model_parallel_config=config)
        generator = torch.Generator().manual_seed(100 * rank + len(result))
        with torch.no_grad():
            for linear in (adapter.linear_in, adapter.linear_out):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.3)
            result[module] = (adapter.linear_in.weight.clone(), adapter.linear_out.weight.clone(), adapter(x))
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_export_lora_of_te_duplicated_mla_down_projections(tmp_path):
    """Under --spec te the MLA down projections are TELinear(parallel_mode="duplicated"), whole on every TP
    rank, but Megatron-Bridge's adapter on them is still TP-split: linear_in and linear_out are
    ColumnParallelLinear(gather_output=True), so each rank holds A's rows [r/tp, hidden] and B's rows
    [out/tp, r] (megatron/bridge/peft/utils.py). export-lora must give PEFT A, B whose product is what
    Megatron-Bridge's own adapter computes: alpha/r * B @ A @ x equals its TP2 forward."""
    from tests.megatron_oracle import _free_port
    from tests.test_lora import ALPHA, R, chunks_of, export

    config = BAILING_V3
    outs = {"linear_q_down_proj": config["q_lora_rank"],
            "linear_kv_down_proj": config["kv_lora_rank"] + config["qk_rope_head_dim"]}
    start_ranks(_bridge_adapter_worker, args=(config["hidden_size"], outs, R, ALPHA,
                                              _free_port(), tmp_path), nprocs=2)
    shards = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    layout, mla_layers = Layout(tp=2), sorted(architecture_for(config).dims(config).mla_layers)
    hf2mcore(FIXTURES / "bailing-v3-tiny", tmp_path / "m", layout, spec="te", fmt="torch", progress=False)
    for rank in layout.ranks():
        path = mio.rank_file(tmp_path / "m" / "release", layout, rank)
        state = load_rank_file(path)
        for layer in mla_layers:
            for module in outs:
                a, b, _ = shards[rank.tp][module]
                prefix = f"decoder.layers.{layer}.self_attention.{module}.adapter."
                assert chunks_of(state)[0][f"decoder.layers.{layer}.self_attention.{module}.weight"].shape[0] == \
                    b.shape[0] * 2  # the base weight is whole on the rank
                chunks_of(state)[0].update({prefix + "linear_in.weight": a, prefix + "linear_out.weight": b})
        torch.save(state, path)
    export(tmp_path / "m", tmp_path / "adapter")
    peft = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    x = shards[0]["x"]
    hf = {"linear_q_down_proj": "q_a_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa"}
    for layer in mla_layers:
        for module in outs:
            key = f"base_model.model.model.layers.{layer}.attention.{hf[module]}.lora_{{}}.weight"
            a, b = peft[key.format("A")], peft[key.format("B")]
            expected = shards[0][module][2]
            assert torch.equal(expected, shards[1][module][2])  # every rank computes the whole output
            assert torch.allclose(ALPHA / R * x @ a.T @ b.T, expected, atol=1e-5, rtol=0), (layer, module)
