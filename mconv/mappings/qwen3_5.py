"""Qwen3.5 / Qwen3.6 text (`Qwen3_5ForCausalLM`): gated delta-net and gated attention layers.

Megatron side: megatron-core 0.19's native layout, a GPTModel whose layer specs come from
`get_transformer_block_with_experimental_attention_variant_spec` (`experimental_attention_variant
gated_delta_net`, `attention_output_gate`), as Megatron-LM, Megatron-Bridge (0.5 on) and mbridge
train it (reference qwen3-5.md, section 2). The layer kinds follow config.json's `layer_types`
(transformers fills it from `full_attention_interval`; Megatron-LM's `linear_attention_freq` list):

- gated delta-net (`linear_attention`): `in_proj` = sections [Q; K; V; Z; B; A] (HF `in_proj_qkv`
  holds Q, K, V flat; `in_proj_z`, `in_proj_b`, `in_proj_a`), `conv1d` = [Q; K; V], each section
  split by TP on its own (GatedDeltaNet's `in_proj_split_sections`); `A_log`, `dt_bias` split by
  value heads; `out_norm` is a zero-centred norm in Megatron and HF's `linear_attn.norm` a plain one
  (w' = w - 1); `out_proj` row-parallel;
- gated attention (`full_attention`): `linear_qkv` per query group [q heads; gate heads; k; v], from
  HF `q_proj`'s per-head [q_h; gate_h] rows; q/k norms, like every other norm here, are `1 + w` on
  both sides (Megatron's `layernorm_zero_centered_gamma`), so copied unchanged; 25% rotary.

Without Transformer Engine megatron-core has no spec for these layers; `--spec local` names the
input norms as separate modules (`input_layernorm`, `pre_mlp_layernorm`), as a model assembled from
megatron-core's non-TE modules has them (tests/qwen3_5_oracle.py).
"""
from dataclasses import replace
from types import SimpleNamespace

from mconv.converter.options import option
from mconv.converter.transforms import COLUMN, GATED_QKV, GLU, REPLICATED, ROW, SECTIONED, ZERO_CENTRED
from mconv.errors import MconvError
from mconv.mappings import qwen3, qwen3_moe
from mconv.mappings.common import config_default, config_value
from mconv.mappings.qwen3 import DENSE_MLP, EMBEDDING_AND_OUTPUT, H, L
from mconv.mappings.schema import Architecture, DistKeys, Rule, extra_state, linear, mtp_block_rules

A, HA, HS = L + "self_attention.", H + "linear_attn.", H + "self_attn."
MTP_KEY = "mtp_num_hidden_layers"
LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(config: dict) -> list[str]:
    """Each layer's kind as transformers reads config.json: `layer_types`, else full attention every
    `full_attention_interval` (default 4) layers, the others linear."""
    layers = config_value(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    types = ["linear_attention" if t == "mamba" else "full_attention" if t == "attention" else t for t in types]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if len(types) != layers or unknown:
        raise MconvError(f"config.json's layer_types must give one of {', '.join(LAYER_TYPES)} for each of the "
                         f"{layers} layers; found {len(types)} entries" + (f", {unknown}" if unknown else ""))
    return types


def dims(config: dict, groups: int = 4) -> SimpleNamespace:
    """transformers' `Qwen3_5TextConfig` (defaults: head_dim 256, `groups` KV heads, 25% rotary,
    gated delta-net 16 key / 32 value heads of 128). Raises MconvError for what Megatron cannot
    compute: attention biases, an activation other than silu, value heads not a multiple of key heads."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    whole_head = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    d = qwen3.attention_dims({**config, "partial_rotary_factor": None, "rope_scaling": None,
                              "rope_parameters": whole_head}, head_dim=256, groups=groups)
    if d.rope["position_embedding_type"] != "rope" and partial != 1.0:
        raise MconvError("config.json's rope_parameters combine YaRN with partial_rotary_factor; mconv maps partial "
                         "rotary embeddings with the default rope_type only")
    d.rope["rotary_percent"] = float(partial)
    d.q_gate = 2 * d.q
    types = layer_types(config)
    d.linear_layers = frozenset(i for i, t in enumerate(types) if t == "linear_attention")
    d.key_heads, d.value_heads = (config_default(config, "linear_num_key_heads", 16),
                                  config_default(config, "linear_num_value_heads", 32))
    d.key_dim, d.value_dim = (config_default(config, "linear_key_head_dim", 128),
                              config_default(config, "linear_value_head_dim", 128))
    d.conv_kernel = config_default(config, "linear_conv_kernel_dim", 4)
    d.qk, d.vd = d.key_heads * d.key_dim, d.value_heads * d.value_dim
    if d.value_heads % d.key_heads:
        raise MconvError(f"config.json's linear_num_value_heads={d.value_heads} is not a multiple of "
                         f"linear_num_key_heads={d.key_heads}")
    # MTP: the HF model's layers (an undeclared config key transformers keeps), those converted
    # (planner.model_dims sets it for --mtp), and eh_proj's input width [embedding; hidden].
    d.hf_mtp_layers = config.get(MTP_KEY, config.get("num_nextn_predict_layers", 0)) or 0
    d.mtp_layers, d.eh_in = 0, 2 * d.hidden
    return d


def check_layout(d: SimpleNamespace, layout) -> None:
    """megatron-core's TransformerConfig: the delta-net key and value heads divide by TP; and check_mtp."""
    check_mtp(d)
    for field, value in (("linear_num_key_heads", d.key_heads), ("linear_num_value_heads", d.value_heads)):
        if value % layout.tp:
            raise MconvError(f"config.json's {field}={value} is not divisible by {option('tp', layout.tp)}")


def check_mtp(d: SimpleNamespace) -> None:
    """hf2mcore --mtp: megatron-core's MTP block cannot hold several MTP layers (transformers' and
    vLLM's share one `fc` and its norms over them, megatron-core has one per depth), nor an MTP layer
    whose MLP (MoE or dense) is not the last decoder layer's, from which it builds it."""
    if d.mtp_layers > 1:
        raise MconvError(f"{option('mtp', True)}: config.json's {MTP_KEY}={d.mtp_layers}: these MTP layers share one "
                         "mtp.fc and its norms, while megatron-core's MTP block has its own per layer")
    kind = {True: "MoE", False: "a dense MLP"}
    last, mtp = d.layers - 1 in d.moe_layers, d.layers in d.moe_layers
    if d.mtp_layers and last != mtp:
        raise MconvError(f"{option('mtp', True)}: config.json gives the MTP layer {kind[mtp]} and the last decoder "
                         f"layer {kind[last]}; megatron-core builds its MTP layer with the last decoder layer's MLP")


def megatron_args(d: SimpleNamespace, base=qwen3.megatron_args) -> dict:
    # Megatron-LM 0.19 parses --apply-layernorm-1p into layernorm_zero_centered_gamma but restores
    # apply_layernorm_1p from checkpoint args: store both.
    mtp = dict(mtp_num_layers=d.mtp_layers, mtp_loss_scaling_factor=0.1) if d.mtp_layers else {}  # check_mtp: one
    return dict(base(d), **mtp, apply_layernorm_1p=True, layernorm_zero_centered_gamma=True, attention_output_gate=True,
                experimental_attention_variant="gated_delta_net",
                linear_attention_freq=[int(i in d.linear_layers) for i in range(d.layers)],
                linear_conv_kernel_dim=d.conv_kernel, linear_key_head_dim=d.key_dim, linear_value_head_dim=d.value_dim,
                linear_num_key_heads=d.key_heads, linear_num_value_heads=d.value_heads)


def gdn(d, layer):
    return layer in d.linear_layers


def full(d, layer):
    return layer not in d.linear_layers


# torch_dist keys of the sections (GatedDeltaNet.sharded_state_dict: `in_proj.weight.query` ...).
IN_PROJ_SECTIONS = ("query", "key", "value", "z", "beta", "alpha")
QKV_ROWS = "qk+qk+vd"


def gated_delta_net(in_proj: dict[str, str]) -> tuple[Rule, ...]:
    """A gated delta-net layer's attention, `in_proj` the HF tensors of its six sections."""
    return (
        Rule(L + "input_layernorm.weight", {H + "input_layernorm.weight": "hidden"}, REPLICATED,
             te=A + "in_proj.layer_norm_weight", when=gdn),
        *linear(A + "in_proj", in_proj, SECTIONED, when=gdn, dist_sections=IN_PROJ_SECTIONS),
        Rule(A + "conv1d.weight", {HA + "conv1d.weight": QKV_ROWS + " 1 conv_kernel"}, SECTIONED, when=gdn,
             dist_sections=IN_PROJ_SECTIONS[:3]),
        Rule(A + "A_log", {HA + "A_log": "value_heads"}, COLUMN, when=gdn),
        Rule(A + "dt_bias", {HA + "dt_bias": "value_heads"}, COLUMN, when=gdn),
        Rule(A + "out_norm.weight", {HA + "norm.weight": "value_dim"}, ZERO_CENTRED, when=gdn),
        extra_state(A + "out_norm", specs=("te",), when=gdn),  # TENorm
        *linear(A + "out_proj", {HA + "out_proj.weight": "hidden vd"}, ROW, when=gdn),
    )


GDN = gated_delta_net({HA + "in_proj_qkv.weight": QKV_ROWS + " hidden", HA + "in_proj_z.weight": "vd hidden",
                       HA + "in_proj_b.weight": "value_heads hidden", HA + "in_proj_a.weight": "value_heads hidden"})
GATED_ATTENTION = (
    *(replace(r, when=full) for r in qwen3.ATTENTION if not r.megatron.startswith(A + "linear_qkv")),
    *linear(A + "linear_qkv", {HS + "q_proj.weight": "q_gate hidden", HS + "k_proj.weight": "kv hidden",
                               HS + "v_proj.weight": "kv hidden"}, GATED_QKV, when=full),
)
# megatron-core builds these layers with Transformer Engine only: its torch_dist keys are TE names.
DIST_KEYS = DistKeys(per_layer=True, te_names=True)
NEEDS_BRIDGE = ("megatron-core builds gated delta-net layers only with Transformer Engine "
                "(get_transformer_block_with_experimental_attention_variant_spec); Megatron-Bridge's Qwen3.5 bridge "
                "builds the model, which load_hf_weights fills")


def mtp(mlp: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """The HF model's MTP (`mtp.*`, which transformers drops on load): `fc` over [pre_fc_norm_embedding
    (next token's embedding); pre_fc_norm_hidden (hidden state)], one gated full-attention layer with
    the model's MLP (`mtp.layers.0.`), `norm`; in megatron-core's MTP block (hf2mcore --mtp)."""
    return mtp_block_rules(GATED_ATTENTION + mlp, "mtp.layers.{mtp}.", {
        "enorm": "mtp.pre_fc_norm_embedding.weight", "hnorm": "mtp.pre_fc_norm_hidden.weight",
        "final_layernorm": "mtp.norm.weight", "eh_proj": "mtp.fc.weight"}, "model.embed_tokens.weight")


def dropped(d: SimpleNamespace) -> dict[str, str]:
    return {} if d.mtp_layers else {"mtp.": "multi-token prediction, which transformers drops on load: not converted; "
                                            "--mtp keeps it in megatron-core's MTP block"}


def hf_config(config: dict, d: SimpleNamespace) -> dict:
    """config.json of a conversion without the MTP layers (hf2mcore without --mtp) says there are none,
    so loaders that build them (vLLM's Qwen3.5 MTP) do not look for their weights."""
    if not d.hf_mtp_layers or d.mtp_layers:
        return config
    if "text_config" in config:
        return {**config, "text_config": hf_config(config["text_config"], d)}
    return {**config, **{key: 0 for key in (MTP_KEY, "num_nextn_predict_layers") if key in config}}


# The delta-net input projections the FP8 releases store in FP8 (Qwen3.5/3.6: q/k/v and z; Qwen3-Next:
# its fused qkvz). b and a (Qwen3-Next: ba) stay 16-bit: one row per value head, too few for a TP rank
# to hold whole 128-row blocks (docs/fp8.md).
GDN_FP8 = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_qkvz.weight")


def fp8_projection(name: str, d: SimpleNamespace | None = None) -> bool:
    """Which HF weights Qwen's FP8 releases of Qwen3.5 / Qwen3.6 (dense and MoE, text and VL) and
    Qwen3-Next store in FP8: Qwen3's choice (qwen3.fp8_projection: every `*_proj.weight` of the
    language model, routed experts per expert or stacked, the vision tower 16-bit), which takes in the
    gated attention, the shared expert, the delta-net `out_proj` and the MTP layer's projections, plus
    the delta-net input projections GDN_FP8. 16-bit: in_proj_b / in_proj_a (in_proj_ba), conv1d,
    A_log, dt_bias, the norms, the router and `shared_expert_gate`, `mtp.fc`, embeddings and lm_head.
    Sources in docs/fp8.md ("Qwen3.5, Qwen3.6 and Qwen3-Next")."""
    return qwen3.fp8_projection(name) or name.endswith(GDN_FP8)


def architecture(name: str, dims, mlp: tuple[Rule, ...], args, **options) -> Architecture:
    """A Qwen3.5 text model (or Qwen3-Next) whose decoder layers' MLP rules are `mlp`."""
    gdn_rules = options.pop("gdn", GDN)
    return Architecture(name, dims, EMBEDDING_AND_OUTPUT + gdn_rules + GATED_ATTENTION + mlp + mtp(mlp), args,
                        check_layout=check_layout, torch_dist=DIST_KEYS, needs_bridge=NEEDS_BRIDGE, dropped=dropped,
                        hf_config=hf_config, fp8=fp8_projection, **options)


QWEN3_5 = architecture("Qwen3_5ForCausalLM", dims, DENSE_MLP, megatron_args, model_type="qwen3_5_text")


def moe_dims(config: dict) -> SimpleNamespace:
    """transformers' `Qwen3_5MoeTextConfig`: 2 KV heads by default, every layer MoE (no
    `mlp_only_layers`), the router always renormalising its top-k weights, a gated shared expert."""
    moe_ffn = config_value(config, "moe_intermediate_size")
    d = dims({**config, "intermediate_size": config.get("intermediate_size", moe_ffn)}, groups=2)
    d.experts = config.get("num_local_experts") or config_value(config, "num_experts")
    d.moe_ffn, d.top_k = moe_ffn, config_value(config, "num_experts_per_tok")
    d.shared_ffn = config_value(config, "shared_expert_intermediate_size")
    d.norm_topk_prob, d.moe_layers = True, frozenset(range(d.layers + d.hf_mtp_layers))  # MTP layers too
    return d


def moe_megatron_args(d: SimpleNamespace) -> dict:
    return dict(megatron_args(d, qwen3_moe.megatron_args), moe_shared_expert_intermediate_size=d.shared_ffn,
                moe_shared_expert_gate=True)


SHARED_EXPERT = (
    *linear(L + "mlp.shared_experts.linear_fc1", {H + "mlp.shared_expert.gate_proj.weight": "shared_ffn hidden",
                                                  H + "mlp.shared_expert.up_proj.weight": "shared_ffn hidden"},
            GLU, when=qwen3_moe.moe),
    *linear(L + "mlp.shared_experts.linear_fc2", {H + "mlp.shared_expert.down_proj.weight": "hidden shared_ffn"},
            ROW, when=qwen3_moe.moe),
    # SharedExpertMLP's sigmoid gate: a bare [1, hidden] parameter, whole on every TP rank.
    Rule(L + "mlp.shared_experts.gate_weight", {H + "mlp.shared_expert_gate.weight": "1 hidden"}, REPLICATED,
         when=qwen3_moe.moe),
)
# The official checkpoints hold the routed experts fused, `gate_up_proj [E, 2I, h]` (transformers
# 5.x's orientation; transformers refuses the transposed one for this model); `save_pretrained` writes
# them per expert, Qwen3.5's MTP layer holds them per expert, Qwen3.6's fused. transformers loads both:
# mcore2hf writes the form hf2mcore read.
MOE_MLP = qwen3_moe.MOE_MLP + SHARED_EXPERT
QWEN3_5_MOE = architecture("Qwen3_5MoeForCausalLM", moe_dims, MOE_MLP, moe_megatron_args,
                           model_type="qwen3_5_moe_text", stacked_experts=True, expert_orientations=("5.x",),
                           experts_as_input=True)


def next_dims(config: dict) -> SimpleNamespace:
    """transformers' `Qwen3NextConfig`: Qwen3.5-MoE's dimensions (2 KV heads by default), dense MLP
    layers where `mlp_only_layers` / `decoder_sparse_step` say, the router renormalising its top-k
    weights iff `norm_topk_prob` (default true); `in_proj_qkvz` / `in_proj_ba` grouped by key head."""
    d = dims(config, groups=2)
    d.experts = config.get("num_local_experts") or config_value(config, "num_experts")
    d.moe_ffn, d.top_k = config_value(config, "moe_intermediate_size"), config_value(config, "num_experts_per_tok")
    d.shared_ffn = config_value(config, "shared_expert_intermediate_size")
    d.norm_topk_prob = bool(config.get("norm_topk_prob", True))
    step, dense_layers = config.get("decoder_sparse_step", 1) or 1, set(config.get("mlp_only_layers") or [])
    moe = [i not in dense_layers and (i + 1) % step == 0 for i in range(max(d.layers, d.hf_mtp_layers))]
    # MTP layer j is built as decoder layer j is (vLLM's Qwen3NextMTP numbers its layers from 0).
    d.moe_layers = frozenset([i for i in range(d.layers) if moe[i]] +
                             [d.layers + j for j in range(d.hf_mtp_layers) if moe[j]])
    # One key head's group of in_proj_qkvz holds its value heads' rows: r = value heads / key heads.
    d.group_values, d.group_v_rows = d.value_heads // d.key_heads, d.vd // d.key_heads
    return d


# Qwen3-Next's spelling of the same six sections: per key head g, [q_g; k_g; v_g; z_g] and [b_g; a_g].
NEXT_GDN = gated_delta_net({HA + "in_proj_qkvz.weight": "key_heads*(key_dim+key_dim+group_v_rows+group_v_rows) hidden",
                            HA + "in_proj_ba.weight": "key_heads*(group_values+group_values) hidden"})
QWEN3_NEXT = architecture("Qwen3NextForCausalLM", next_dims, DENSE_MLP + MOE_MLP, moe_megatron_args,
                          model_type="qwen3_next", gdn=NEXT_GDN)
