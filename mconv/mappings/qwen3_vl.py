"""Qwen3-VL, dense (`Qwen3VLForConditionalGeneration`) and MoE (`Qwen3VLMoeForConditionalGeneration`).

Megatron side: the `Qwen3VLModel` of mbridge (git main) and Megatron-Bridge 0.6 (same parameter
names): `vision_model.*` (on the first pipeline stage only) and `language_model.*`, a Qwen3 /
Qwen3-MoE GPT model whose rules are reused here under that prefix. HF side: `model.visual.*`,
`model.language_model.*`, `lm_head.weight`; MoE experts stacked (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), which the HF reader presents per expert (see hf_io.expand_stacked_experts).

Vision tower facts (read from mbridge `models/qwen3_vl` and Megatron-Bridge `qwen3_vl_bridge.py`,
checked by the oracle tests): TP on the vision tower is the language TP; `attn.qkv` `[3Dv, Dv]`
holds `[Q_all; K_all; V_all]` and Megatron's `linear_qkv` is per head `[q_h; k_h; v_h]`; every
vision linear has a bias (split with a column-parallel weight, whole with a row-parallel one);
the MLP is not gated; norms are LayerNorms (weight and bias); the merger's norm acts before the
2x2 patch shuffle (`[Dv]`), the deepstack mergers' norms after it (`[Dv * m^2]`).
"""
from dataclasses import replace
from types import SimpleNamespace

from mconv.converter.layout import count
from mconv.converter.options import option
from mconv.converter.transforms import COLUMN, QKV, REPLICATED, ROW
from mconv.errors import MconvError
from mconv.mappings import qwen3, qwen3_moe
from mconv.mappings.common import config_value, fields_of, rope_parameters
from mconv.mappings.schema import FIRST, GPT_LOCAL_KEYS, Architecture, Rule, extra_state, prefixed

V = "vision_model."
B, HB = V + "decoder.layers.{block}.", "model.visual.blocks.{block}."
BLOCK = ("block", "vision_layers")
MERGER = ("merger", "deepstack")
VISION_QKV = ("vision_heads", "vision_heads", "vision_head_dim")


def hf_language(name: str) -> str:
    return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name


def _linear_with_bias(module: str, hf_module: str, kind, fan: str, **options) -> tuple[Rule, ...]:
    """A biased Megatron linear layer: the bias is split like the weight's rows for a column-parallel
    layer and kept whole on every rank for a row-parallel one (megatron-core adds it after the reduce)."""
    out, _ = fan.split()
    bias_kind = REPLICATED if kind is ROW else kind
    return (Rule(f"{module}.weight", {f"{hf_module}.weight": fan}, kind, **options),
            Rule(f"{module}.bias", {f"{hf_module}.bias": out}, bias_kind, **options),
            extra_state(module, stage=FIRST, repeat=options.get("repeat")))


def _norm(module: str, hf_module: str, size: str, te: str | None = None, **options) -> tuple[Rule, ...]:
    """A LayerNorm (weight and bias); under the TE spec fused into the next linear layer as
    `layer_norm_weight` / `layer_norm_bias` when `te` names that layer."""
    return (Rule(f"{module}.weight", {f"{hf_module}.weight": size}, REPLICATED,
                 te=te and f"{te}.layer_norm_weight", **options),
            Rule(f"{module}.bias", {f"{hf_module}.bias": size}, REPLICATED, te=te and f"{te}.layer_norm_bias", **options))


def _merger(module: str, hf_module: str, norm_size: str, **options) -> tuple[Rule, ...]:
    """A patch merger: norm, then fc1 (column) and fc2 (row), with biases. The TE spec builds its
    norm from TENorm, which carries `_extra_state` in Transformer Engine 2.x."""
    return (*_norm(f"{module}.patch_norm", f"{hf_module}.norm", norm_size, **options),
            extra_state(f"{module}.patch_norm", stage=FIRST, specs=("te",), repeat=options.get("repeat")),
            *_linear_with_bias(f"{module}.linear_fc1", f"{hf_module}.linear_fc1", COLUMN, "merger_hidden merger_hidden",
                               **options),
            *_linear_with_bias(f"{module}.linear_fc2", f"{hf_module}.linear_fc2", ROW, "hidden merger_hidden", **options))


VISION = (
    Rule(V + "patch_embed.proj.weight", {"model.visual.patch_embed.proj.weight":
                                         "vision_hidden in_channels temporal_patch patch patch"}, REPLICATED, stage=FIRST),
    Rule(V + "patch_embed.proj.bias", {"model.visual.patch_embed.proj.bias": "vision_hidden"}, REPLICATED, stage=FIRST),
    Rule(V + "pos_embed.weight", {"model.visual.pos_embed.weight": "vision_positions vision_hidden"}, REPLICATED,
         stage=FIRST),
    # Local ViT spec: input_layernorm / pre_mlp_layernorm; TE spec: fused into linear_qkv / linear_fc1.
    *_norm(B + "input_layernorm", HB + "norm1", "vision_hidden", te=B + "self_attention.linear_qkv",
           stage=FIRST, repeat=BLOCK),
    *_linear_with_bias(B + "self_attention.linear_qkv", HB + "attn.qkv", QKV, "vision_qkv vision_hidden",
                       stage=FIRST, repeat=BLOCK, qkv_dims=VISION_QKV),
    extra_state(B + "self_attention.core_attention", stage=FIRST, specs=("te",), repeat=BLOCK),
    *_linear_with_bias(B + "self_attention.linear_proj", HB + "attn.proj", ROW, "vision_hidden vision_hidden",
                       stage=FIRST, repeat=BLOCK),
    *_norm(B + "pre_mlp_layernorm", HB + "norm2", "vision_hidden", te=B + "mlp.linear_fc1", stage=FIRST, repeat=BLOCK),
    *_linear_with_bias(B + "mlp.linear_fc1", HB + "mlp.linear_fc1", COLUMN, "vision_ffn vision_hidden",
                       stage=FIRST, repeat=BLOCK),
    *_linear_with_bias(B + "mlp.linear_fc2", HB + "mlp.linear_fc2", ROW, "vision_hidden vision_ffn",
                       stage=FIRST, repeat=BLOCK),
    *_merger(V + "merger", "model.visual.merger", "vision_hidden", stage=FIRST),
    *_merger(V + "decoder.deepstack_merger_list.{merger}", "model.visual.deepstack_merger_list.{merger}",
             "merger_hidden", stage=FIRST, repeat=MERGER),
)


def dims(config: dict, language=qwen3.dims) -> SimpleNamespace:
    text, vision = config_value(config, "text_config"), config_value(config, "vision_config")
    # The top-level tie_word_embeddings decides (5.x MoE text configs carry their own default true,
    # which transformers and Megatron-Bridge ignore).
    with fields_of("text_config"):
        d = language({**text, "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))})
    section = rope_parameters(text)[0].get("mrope_section")
    rotary = int(d.head_dim * d.rope["rotary_percent"])  # Qwen3.5 rotates a part of each head
    if not section or sum(section) * 2 != rotary:
        raise MconvError(f"config.json: text_config's mrope_section {section} does not cover the {rotary} rotary "
                         f"dimensions of head_dim {d.head_dim} (its entries must add up to {rotary // 2})")
    d.mrope_section = list(section)
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise MconvError(f"config.json: vision_config.hidden_act is {vision['hidden_act']!r}; the Megatron "
                         "Qwen3VLModel's vision blocks use gelu_pytorch_tanh (tanh-approximated GELU)")
    with fields_of("vision_config"):
        hidden, heads = config_value(vision, "hidden_size"), config_value(vision, "num_heads")
        merge = config_value(vision, "spatial_merge_size")
        d.vision_layers, d.vision_hidden, d.vision_heads = config_value(vision, "depth"), hidden, heads
        d.vision_ffn = config_value(vision, "intermediate_size")
        d.in_channels, d.patch = config_value(vision, "in_channels"), config_value(vision, "patch_size")
        d.temporal_patch, d.spatial_merge = config_value(vision, "temporal_patch_size"), merge
        d.vision_positions = config_value(vision, "num_position_embeddings")
        out_hidden = config_value(vision, "out_hidden_size")
    d.vision_head_dim, d.vision_qkv = hidden // heads, 3 * hidden
    d.merger_hidden = hidden * merge * merge
    d.deepstack_indexes = list(vision.get("deepstack_visual_indexes") or [])
    d.deepstack = len(d.deepstack_indexes)
    if out_hidden != d.hidden:
        raise MconvError(f"config.json: vision_config.out_hidden_size {vision['out_hidden_size']} differs from "
                         f"text_config.hidden_size {d.hidden}")
    for key in ("image_token_id", "video_token_id", "vision_start_token_id"):
        setattr(d, key, config.get(key))
    return d


def moe_dims(config: dict) -> SimpleNamespace:
    d = dims(config, qwen3_moe.dims)
    # Qwen3-VL-MoE's router always renormalises its top-k weights, whatever norm_topk_prob says
    # (transformers 5.17 Qwen3VLMoeTextTopKRouter; 5.x configs do not write the key).
    d.norm_topk_prob = True
    return d


def check_layout(d: SimpleNamespace, layout) -> None:
    """Vision TP is the language TP (mbridge copies the language config; Megatron-Bridge sets it),
    and the deepstack targets (language layers 0..k-1) must be in the first pipeline chunk, where the
    vision tower is (Megatron-Bridge asserts k <= its layers; mbridge asserts k < the layers of
    every stage)."""
    if d.vision_heads % layout.tp:
        raise MconvError(f"vision_config.num_heads={d.vision_heads} is not divisible by {option('tp', layout.tp)} "
                         "(the vision tower is split at the language model's tensor parallel size)")
    first = len(layout.chunk_layers(d.layers)[0][0])
    if d.deepstack > first:
        raise MconvError(f"the {d.deepstack} deepstack_visual_indexes feed language layers 0..{d.deepstack - 1}, "
                         f"but the first pipeline stage (chunk) holds only {count(first, 'layer')}; they must be on the "
                         f"first stage, with the vision tower: give it more layers ({option('first_stage_layers')})")


def megatron_args(d: SimpleNamespace, language=qwen3.megatron_args) -> dict:
    return dict(language(d), position_embedding_type="mrope", mrope_section=d.mrope_section,
                **{f"vision_{k}": getattr(d, f"vision_{k}") for k in ("layers", "hidden", "heads", "ffn")},
                in_channels=d.in_channels, patch_size=d.patch, temporal_patch_size=d.temporal_patch,
                spatial_merge_size=d.spatial_merge,
                num_position_embeddings=d.vision_positions, deepstack_visual_indexes=d.deepstack_indexes,
                image_token_id=d.image_token_id, video_token_id=d.video_token_id,
                vision_start_token_id=d.vision_start_token_id)


def check_torch_dist(d: SimpleNamespace) -> None:
    """mbridge's Qwen3VLModel asserts fewer deepstack targets than language layers."""
    if d.deepstack >= d.layers:
        raise MconvError(f"mbridge's Qwen3VLModel needs more language layers ({d.layers}) than deepstack "
                         f"targets ({d.deepstack}); use {option('fmt', 'torch')}")


DIST_KEYS = replace(GPT_LOCAL_KEYS, check=check_torch_dist)


def moe_megatron_args(d: SimpleNamespace) -> dict:
    return megatron_args(d, qwen3_moe.megatron_args)


def hf_config(config: dict, d: SimpleNamespace | None = None) -> dict:
    """config.json that transformers 4.57 and 5.x both read: 4.x reads rope_theta + rope_scaling and
    num_experts, 5.x rope_parameters and num_local_experts (reference qwen3-vl.md, section 2). 4.57 ties
    lm_head to the embeddings by text_config's tie_word_embeddings, 5.x by the top-level one (5.x MoE
    text configs carry a default true): text_config gets the top-level value (seen with 4.57.6: lm_head
    silently dropped, logits off by 1.0). MoE text configs get `norm_topk_prob: true`, which 4.x writes and
    vLLM 0.32's Qwen3-VL-MoE reads (5.x neither writes nor needs it: its router always renormalises)."""
    text = dict(config["text_config"])
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    rope = rope_parameters(text)[0]
    text["rope_parameters"] = rope
    text["rope_theta"] = rope["rope_theta"]
    text["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    experts = text.get("num_local_experts") or text.get("num_experts")
    if experts:
        text["num_experts"] = text["num_local_experts"] = experts
        text["norm_topk_prob"] = True
    return {**config, "text_config": text}


LANGUAGE = prefixed(qwen3.EMBEDDING_AND_OUTPUT + qwen3.ATTENTION + qwen3.DENSE_MLP, "language_model.", hf_language)
NEEDS_BRIDGE = ("megatron-core has no Qwen3-VL vision model; mbridge "
                "(`AutoBridge.from_pretrained(hf_dir).get_model()`) or Megatron-Bridge builds Qwen3VLModel, "
                "which load_hf_weights fills")
QWEN3_VL = Architecture("Qwen3VLForConditionalGeneration", dims, VISION + LANGUAGE, megatron_args,
                        check_layout=check_layout, hf_config=hf_config, torch_dist=DIST_KEYS, needs_bridge=NEEDS_BRIDGE,
                        fp8=qwen3.fp8_projection)
QWEN3_VL_MOE = Architecture("Qwen3VLMoeForConditionalGeneration", moe_dims,
                            VISION + LANGUAGE + prefixed(qwen3_moe.MOE_MLP, "language_model.", hf_language),
                            moe_megatron_args, check_layout=check_layout, stacked_experts=True, hf_config=hf_config,
                            torch_dist=DIST_KEYS, needs_bridge=NEEDS_BRIDGE, fp8=qwen3.fp8_projection)
