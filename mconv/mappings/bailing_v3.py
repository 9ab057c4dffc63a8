"""BailingMoeV3 (`BailingMoeV3ForCausalLM`, Ling 3.0): KDA and head-wise gated MLA layers, DeepSeek-style MoE.

Megatron names and TP rules are AReaL's Bailing V3 layout (branch `chucai.dzq/gh-bailing-v3-swe-sft`,
`areal/models/mcore/bailing_v3*.py`, `kda_attention.py`): one GPTModel-style layer per HF layer.
Layer i is MLA when `(i+1) % layer_group_size == 0` or i lies in the incomplete tail group, else KDA;
MoE when `i >= first_k_dense_replace`, else dense (HF `modeling_bailing_moe_v3.py`).

- KDA `in_proj` = `[q; k; v; f; g]` (HF `f_proj` is the decay features, `g_proj` the output gate;
  without `no_kda_lora` the f and g sections are the low-rank `f_a_proj`/`g_a_proj` and
  `f_b_proj`/`g_b_proj` are their own column-parallel linears), `conv1d` = `[q; k; v]`: each section
  is split by TP on its own (`KimiDeltaAttention.sharded_state_dict`'s per-section split).
  `beta_proj`, `A_log`, `dt_bias` are split by heads; `out_norm` is one `[head_dim]` norm.
- MLA: the down projections are `TELinear(parallel_mode="duplicated")` under Transformer Engine
  (whole on every TP rank) but `ColumnParallelLinear` in megatron-core's local spec (split on dim 0):
  two rules, one per spec. The head-wise gate `linear_gate [heads, hidden]` is column-parallel.
- MTP layers (`model.layers.{L+j}`, DeepSeek-V3 style: `enorm`, `hnorm`, `eh_proj [h, 2h]` on
  `cat(enorm(embedding), hnorm(hidden))`, an MLA + MoE layer, `final_layernorm`) have no place in AReaL's
  layout: by default they are left out (AReaL and Megatron-Bridge drop them too) and hf2mcore says so;
  with `--mtp` they become megatron-core's MTP block (`mtp.layers.{j}.`, multi_token_prediction.py:
  `enorm`, `hnorm`, column-parallel `eh_proj`, the inner layer `mtp_model_layer.` built from the last
  decoder layer's spec, `final_layernorm`) on the last pipeline stage, which then also holds a copy of
  the word embedding (GPTModel builds one wherever MTP runs).
"""
from types import SimpleNamespace

from mconv.converter.options import option
from mconv.converter.transforms import COLUMN, DUPLICATED, GLU, REPLICATED, ROW, SECTIONED
from mconv.errors import MconvError
from mconv.mappings.common import config_value, rope_parameters, rope_theta
from mconv.mappings.qwen3 import DENSE_MLP, H, L, embedding_and_output
from mconv.mappings.qwen3_moe import MOE_MLP, moe
from mconv.mappings.schema import Architecture, DistKeys, Rule, extra_state, linear, mtp_block_rules

A, HA = L + "self_attention.", H + "attention."


def _layer_kinds(layers: int, group: int, total: int | None = None) -> frozenset[int]:
    """The MLA layers among the first `total` (default `layers`) HF layers: the last of every
    `layer_group_size` group, and any incomplete tail group, which includes every MTP layer (i >= layers)."""
    total = layers if total is None else total
    if group <= 1:
        return frozenset(range(total))
    full = layers // group * group
    return frozenset(i for i in range(total) if (i + 1) % group == 0 or i >= full)


def _rope_scaling(config: dict) -> dict:
    scaling, where = rope_parameters(config)
    kind = scaling["rope_type"]
    if kind not in ("default", "yarn"):
        raise MconvError(f"config.json {where} rope_type {kind!r}: megatron-core's MLA knows only plain "
                         "RoPE and YaRN")
    return scaling if kind == "yarn" else {}


def dims(config: dict) -> SimpleNamespace:
    """Model dimensions from a BailingMoeV3 config.json (key names from the HF modeling code)."""
    if config.get("use_qkv_bias"):
        raise MconvError("config.json sets use_qkv_bias=true: megatron-core's MLA has no bias on its down "
                         "projections (and a linear_proj bias only with biases on every linear layer), so "
                         "this variant has no exact Megatron layout")
    granularity = config.get("gated_attention_proj_granularity_type", "head_wise")
    if granularity != "head_wise":
        raise MconvError(f"config.json gated_attention_proj_granularity_type={granularity!r}: AReaL's gated MLA "
                         "(linear_gate [heads, hidden]) is head-wise only")
    hidden = config_value(config, "hidden_size")
    heads = config_value(config, "num_attention_heads")
    layers = config_value(config, "num_hidden_layers")
    head_dim = config.get("head_dim") or hidden // heads
    nope, rope = config_value(config, "qk_nope_head_dim"), config_value(config, "qk_rope_head_dim")
    v_head = config_value(config, "v_head_dim")
    q_lora = config.get("q_lora_rank")
    kv_lora = config_value(config, "kv_lora_rank")
    experts = config.get("num_experts") or 0
    first_dense = config.get("first_k_dense_replace", 0) or 0
    mtp = config.get("num_nextn_predict_layers", 0) or 0
    # Layer kinds by the HF rules, for the MTP layers (HF layers L + j) too.
    mla_layers = _layer_kinds(layers, config.get("layer_group_size", 1) or 1, layers + mtp)
    moe_layers = frozenset(i for i in range(layers + mtp) if experts and i >= first_dense)
    d = SimpleNamespace(
        layers=layers, hidden=hidden, heads=heads, groups=heads, vocab=config_value(config, "vocab_size"),
        tied=bool(config.get("tie_word_embeddings", False)), norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta(config), rope_scaling=_rope_scaling(config),
        rope_interleave=bool(config.get("rope_interleave", True)),
        max_positions=config.get("max_position_embeddings", 4096), ffn=config_value(config, "intermediate_size"),
        # KDA
        mla_layers=mla_layers, kda_layers=frozenset(range(layers + mtp)) - mla_layers,
        head_dim=head_dim, kda=heads * head_dim, conv_kernel=config.get("short_conv_kernel_size", 4),
        kda_lora=not config.get("no_kda_lora", False),
        # MLA
        q_lora=q_lora, kv_lora=kv_lora, qk_nope=nope, qk_rope=rope, v_head=v_head,
        q_rows=heads * (nope + rope), kv_down=kv_lora + rope, kv_up=heads * (nope + v_head), attn_out=heads * v_head,
        # MoE
        experts=experts, moe_layers=moe_layers,
        # MTP: the HF model's layers, and those converted (planner.model_dims sets it for --mtp)
        hf_mtp_layers=mtp, mtp_layers=0, eh_in=2 * hidden, mtp_loss_scale=config.get("mtp_loss_scaling_factor", 0.1))
    if experts:
        d.moe_ffn = config_value(config, "moe_intermediate_size")
        d.shared_ffn = (config.get("moe_shared_expert_intermediate_size") or d.moe_ffn) * (
            config.get("num_shared_experts", 0) or 0)
        d.top_k = config_value(config, "num_experts_per_tok")
        d.n_group, d.topk_group = config.get("n_group", 1) or 1, config.get("topk_group", 1) or 1
        d.scaling = config.get("routed_scaling_factor", 1.0)
        d.score_function = config.get("score_function") or config.get("scoring_func") or "sigmoid"
    return d


def megatron_args(d: SimpleNamespace) -> dict:
    """Megatron-LM args for this model (megatron-core MLATransformerConfig and MoE router names).
    Raises MconvError where megatron-core's MLA or router cannot compute what the HF model does."""
    if not d.rope_interleave:
        raise MconvError("config.json sets rope_interleave=false: megatron-core's MLA always de-interleaves the "
                         "RoPE slice (apply_rotary_pos_emb(mla_rotary_interleaved=True)), so it would not "
                         "compute what this model does")
    args = dict(
        normalization="RMSNorm", norm_epsilon=d.norm_eps, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        position_embedding_type="rope", rotary_base=d.rope_theta, rotary_percent=1.0,
        max_position_embeddings=d.max_positions, ffn_hidden_size=d.ffn, kv_channels=d.head_dim,
        num_query_groups=d.heads, group_query_attention=False, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=d.q_lora, kv_lora_rank=d.kv_lora, qk_head_dim=d.qk_nope,
        qk_pos_emb_head_dim=d.qk_rope, v_head_dim=d.v_head, rope_type="rope", rotary_scaling_factor=1.0)
    if d.rope_scaling:
        s = d.rope_scaling
        args.update(rope_type="yarn", rotary_scaling_factor=s["factor"], mscale=s.get("mscale", 1.0),
                    mscale_all_dim=s.get("mscale_all_dim", 0.0),
                    original_max_position_embeddings=s.get("original_max_position_embeddings", d.max_positions),
                    beta_fast=s.get("beta_fast", 32), beta_slow=s.get("beta_slow", 1))
    if d.mtp_layers:
        last = d.layers - 1  # megatron-core builds every MTP layer from the last decoder layer's spec
        for layer in range(d.layers, d.layers + d.mtp_layers):
            if (layer in d.moe_layers) != (last in d.moe_layers):
                kind = {True: "MoE", False: "a dense MLP"}
                raise MconvError(f"{option('mtp', True)}: config.json first_k_dense_replace gives MTP layer model.layers.{layer} "
                                 f"{kind[layer in d.moe_layers]} and the last decoder layer "
                                 f"{kind[last in d.moe_layers]}; megatron-core builds its MTP layers with the last "
                                 "decoder layer's spec")
        args.update(mtp_num_layers=d.mtp_layers, mtp_loss_scaling_factor=d.mtp_loss_scale)
    if d.experts:
        # megatron-core scores a group by the sum of its top (topk / group_topk) experts
        # (moe_utils.group_limited_topk); the HF BailingMoeV3Gate by its top 2.
        if d.n_group > 1 and d.top_k != 2 * d.topk_group:
            raise MconvError(f"config.json num_experts_per_tok={d.top_k} with topk_group={d.topk_group}: "
                             "megatron-core's group-limited routing scores each group by its top "
                             "num_experts_per_tok/topk_group experts and the HF gate by its top 2, so they "
                             "agree only when num_experts_per_tok == 2 * topk_group")
        args.update(num_experts=d.experts, moe_ffn_hidden_size=d.moe_ffn, moe_router_topk=d.top_k,
                    moe_router_score_function=d.score_function, moe_router_pre_softmax=False,
                    moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
                    moe_router_num_groups=d.n_group if d.n_group > 1 else None,
                    moe_router_group_topk=d.topk_group if d.n_group > 1 else None,
                    moe_router_topk_scaling_factor=d.scaling,
                    moe_shared_expert_intermediate_size=d.shared_ffn or None,
                    moe_layer_freq=[int(i in d.moe_layers) for i in range(d.layers)])
    return args


def kda(d, layer):
    return layer in d.kda_layers


def mla(d, layer):
    return layer in d.mla_layers


def _when(*conditions):
    return lambda d, layer: all(c(d, layer) for c in conditions)


def full_rank(d, layer):
    return not d.kda_lora


def low_rank(d, layer):
    return d.kda_lora


def q_full(d, layer):
    return d.q_lora is None


def q_low_rank(d, layer):
    return d.q_lora is not None


def shared(d, layer):
    return bool(getattr(d, "shared_ffn", 0))


QKV_IN = {HA + "q_proj.weight": "kda hidden", HA + "k_proj.weight": "kda hidden", HA + "v_proj.weight": "kda hidden"}
INPUT_NORM = (
    Rule(L + "input_layernorm.weight", {H + "input_layernorm.weight": "hidden"}, REPLICATED),
    extra_state(L + "input_layernorm", specs=("te",)),  # TENorm
)

# torch_dist keys of the sections, `in_proj.weight.query` ... (KimiDeltaAttention.sharded_state_dict).
IN_PROJ_SECTIONS = ("query", "key", "value", "g", "gate")
KDA = (
    *linear(A + "in_proj", {**QKV_IN, HA + "f_proj.weight": "kda hidden", HA + "g_proj.weight": "kda hidden"},
            SECTIONED, when=_when(kda, full_rank), dist_sections=IN_PROJ_SECTIONS),
    *linear(A + "in_proj", {**QKV_IN, HA + "f_a_proj.weight": "head_dim hidden",
                            HA + "g_a_proj.weight": "head_dim hidden"}, SECTIONED, when=_when(kda, low_rank),
            dist_sections=IN_PROJ_SECTIONS),
    *linear(A + "f_b_proj", {HA + "f_b_proj.weight": "kda head_dim"}, COLUMN, when=_when(kda, low_rank)),
    *linear(A + "g_b_proj", {HA + "g_b_proj.weight": "kda head_dim"}, COLUMN, when=_when(kda, low_rank)),
    Rule(A + "conv1d.weight", {HA + "q_conv1d.weight": "kda 1 conv_kernel", HA + "k_conv1d.weight": "kda 1 conv_kernel",
                               HA + "v_conv1d.weight": "kda 1 conv_kernel"}, SECTIONED, when=kda,
         dist_sections=IN_PROJ_SECTIONS[:3]),
    *linear(A + "beta_proj", {HA + "b_proj.weight": "heads hidden"}, COLUMN, when=kda),
    Rule(A + "A_log", {HA + "A_log": "heads"}, COLUMN, when=kda, fp32=True),
    Rule(A + "dt_bias", {HA + "dt_bias": "kda"}, COLUMN, when=kda, fp32=True),
    Rule(A + "out_norm.weight", {HA + "o_norm.weight": "head_dim"}, REPLICATED, when=kda),
    extra_state(A + "out_norm", specs=("te",), when=kda),
    *linear(A + "out_proj", {HA + "o_proj.weight": "hidden kda"}, ROW, when=kda),
)


def _down_projection(module: str, hf: dict[str, str], when) -> tuple[Rule, ...]:
    """An MLA down projection: whole on every TP rank under TE (TELinear, parallel_mode="duplicated"),
    split on dim 0 under megatron-core's local spec (ColumnParallelLinear, output gathered)."""
    return (Rule(f"{module}.weight", hf, DUPLICATED, when=when, specs=("te",)),
            Rule(f"{module}.weight", hf, COLUMN, when=when, specs=("local",)),
            extra_state(module, when=when))


MLA = (
    *linear(A + "linear_q_proj", {HA + "q_proj.weight": "q_rows hidden"}, COLUMN, when=_when(mla, q_full)),
    *_down_projection(A + "linear_q_down_proj", {HA + "q_a_proj.weight": "q_lora hidden"}, _when(mla, q_low_rank)),
    Rule(A + "q_layernorm.weight", {HA + "q_a_layernorm.weight": "q_lora"}, REPLICATED,
         te=A + "linear_q_up_proj.layer_norm_weight", when=_when(mla, q_low_rank)),
    *linear(A + "linear_q_up_proj", {HA + "q_b_proj.weight": "q_rows q_lora"}, COLUMN, when=_when(mla, q_low_rank)),
    *_down_projection(A + "linear_kv_down_proj", {HA + "kv_a_proj_with_mqa.weight": "kv_down hidden"}, mla),
    Rule(A + "kv_layernorm.weight", {HA + "kv_a_layernorm.weight": "kv_lora"}, REPLICATED,
         te=A + "linear_kv_up_proj.layer_norm_weight", when=mla),
    *linear(A + "linear_kv_up_proj", {HA + "kv_b_proj.weight": "kv_up kv_lora"}, COLUMN, when=mla),
    *linear(A + "linear_gate", {HA + "g_proj.weight": "heads hidden"}, COLUMN, when=mla),
    *linear(A + "linear_proj", {HA + "dense.weight": "hidden attn_out"}, ROW, when=mla),
    extra_state(A + "core_attention", specs=("te",), when=mla),
)

MOE_EXTRAS = (
    extra_state(L + "pre_mlp_layernorm", specs=("te",), when=moe),  # TENorm
    Rule(L + "mlp.router.expert_bias", {H + "mlp.gate.expert_bias": "experts"}, REPLICATED, when=moe, fp32=True),
    *linear(L + "mlp.shared_experts.linear_fc1", {H + "mlp.shared_experts.gate_proj.weight": "shared_ffn hidden",
                                                  H + "mlp.shared_experts.up_proj.weight": "shared_ffn hidden"},
            GLU, when=_when(moe, shared)),
    *linear(L + "mlp.shared_experts.linear_fc2", {H + "mlp.shared_experts.down_proj.weight": "hidden shared_ffn"},
            ROW, when=_when(moe, shared)),
)

MTP = mtp_block_rules(INPUT_NORM + MLA + DENSE_MLP + MOE_MLP + MOE_EXTRAS, None,
                      {name: f"{H}{name}.weight" for name in ("enorm", "hnorm", "final_layernorm", "eh_proj")},
                      "model.word_embeddings.weight")


def hf_config(config: dict, d: SimpleNamespace) -> dict:
    """config.json of a conversion without MTP layers (hf2mcore without --mtp) says there are none, so
    loaders that build them (vLLM's BailingMoeV3 MTP, the model's own code) do not look for weights."""
    return {**config, "num_nextn_predict_layers": 0} if d.hf_mtp_layers and not d.mtp_layers else config


def fp8_projection(name: str, d: SimpleNamespace) -> bool:
    """Which HF weights mconv stores in FP8: every projection (`*_proj.weight`, MLA's `dense`: the
    routed and shared experts, the dense MLP, KDA q/k/v/f/g/o, MLA q/q_a/q_b/kv_a/kv_b, MTP `eh_proj`)
    but KDA's `b_proj` and MLA's head-wise `g_proj` ([heads, hidden]: too few rows for a TP rank to
    hold whole 128-row blocks). That is what vLLM 0.32's BailingMoeV3 loads at any TP
    (model_executor/models/bailing_moe_v3.py: MLA `q_a_proj` and `kv_a_proj_with_mqa` fuse into one
    FP8 `fused_qkv_a_proj`, an FP8 KDA `b_proj` fuses into `qkvb_proj`, whose scales it places only at
    TP 1, and MLA `g_proj` must hold whole blocks per rank) and the narrowed exclusions Ling's own
    repository adopts (docs/fp8.md). The router, conv1d, norms, embeddings and lm_head stay 16-bit."""
    if (not name.endswith(("_proj.weight", ".attention.kv_a_proj_with_mqa.weight", ".attention.dense.weight"))
            or name.endswith(".attention.b_proj.weight")):
        return False
    return not (name.endswith(".attention.g_proj.weight") and int(name.split(".")[2]) in d.mla_layers)


BAILING_V3 = Architecture("BailingMoeV3ForCausalLM", dims,
                          embedding_and_output("model.word_embeddings.weight") + INPUT_NORM + KDA + MLA
                          + DENSE_MLP + MOE_MLP + MOE_EXTRAS + MTP, megatron_args, dropped=lambda d: {
                              f"model.layers.{d.layers + j}.": "multi-token-prediction layer: AReaL's layout has "
                              "no MTP, so it is not converted; --mtp keeps it in megatron-core's MTP block"
                              for j in range(0 if d.mtp_layers else d.hf_mtp_layers)}, hf_config=hf_config,
                          # torch_dist: KDA and MLA layers differ, so keys are per layer; local names
                          # (megatron-core's local MLA spec has no keys map, AReaL's KDA layer has its own
                          # input_layernorm).
                          torch_dist=DistKeys(per_layer=True), fp8=fp8_projection,
                          needs_bridge="megatron-core has no Kimi Delta Attention (KDA) layer; AReaL's Bailing V3 "
                                       "model (areal/models/mcore/bailing_v3.py) builds it, and load_hf_weights "
                                       "fills it")
