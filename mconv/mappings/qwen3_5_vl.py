"""Qwen3.5 / Qwen3.6 vision-language (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`).

Megatron side: Megatron-Bridge's Qwen3VLModel for Qwen3.5 (reference qwen3-5.md, section 3): Qwen3-VL's
vision tower (`vision_model.*`, mconv's Qwen3-VL rules, without deepstack mergers: Qwen3.5's tower has
none) on the first pipeline stage, and the Qwen3.5 language model under `language_model.`; HF side
`model.visual.*`, `model.language_model.*`, `lm_head.weight`. mbridge embeds transformers' vision
model instead (`vision_model.blocks.*`), which these rules do not write.

torch_dist: the language model's keys are the text classes' (Transformer Engine names, per layer)
under `language_model.`; the vision tower's are Qwen3-VL's local-spec ones, its blocks stacked (Megatron-Bridge
builds the tower from its own config, whose layers are all alike).
"""
from dataclasses import replace
from types import SimpleNamespace

from mconv.mappings import qwen3_5, qwen3_vl
from mconv.mappings.qwen3 import DENSE_MLP, EMBEDDING_AND_OUTPUT
from mconv.mappings.schema import Architecture, prefixed


def dims(config: dict) -> SimpleNamespace:
    return qwen3_vl.dims(config, qwen3_5.dims)


def moe_dims(config: dict) -> SimpleNamespace:
    return qwen3_vl.dims(config, qwen3_5.moe_dims)


def check_layout(d: SimpleNamespace, layout) -> None:
    qwen3_vl.check_layout(d, layout)
    qwen3_5.check_layout(d, layout)


def megatron_args(d: SimpleNamespace) -> dict:
    return qwen3_vl.megatron_args(d, qwen3_5.megatron_args)


def moe_megatron_args(d: SimpleNamespace) -> dict:
    return qwen3_vl.megatron_args(d, qwen3_5.moe_megatron_args)


DIST_KEYS = replace(qwen3_5.DIST_KEYS, tower=qwen3_vl.V)


def _language(rules):
    return prefixed(rules, "language_model.", qwen3_vl.hf_language)


def _language_model(mlp):
    """The language model's rules, its MTP (top-level `mtp.*` in the HF checkpoint) included."""
    return _language(EMBEDDING_AND_OUTPUT + qwen3_5.GDN + qwen3_5.GATED_ATTENTION + mlp + qwen3_5.mtp(mlp))


NEEDS_BRIDGE = ("megatron-core has no Qwen3.5 vision-language model; Megatron-Bridge's Qwen3.5 VL bridge builds its "
                "Qwen3VLModel, which load_hf_weights fills")
QWEN3_5_VL = Architecture("Qwen3_5ForConditionalGeneration", dims,
                          qwen3_vl.VISION + _language_model(DENSE_MLP), megatron_args, check_layout=check_layout,
                          needs_bridge=NEEDS_BRIDGE, dropped=qwen3_5.dropped, hf_config=qwen3_5.hf_config,
                          torch_dist=DIST_KEYS, fp8=qwen3_5.fp8_projection)
QWEN3_5_VL_MOE = Architecture("Qwen3_5MoeForConditionalGeneration", moe_dims,
                              qwen3_vl.VISION + _language_model(qwen3_5.MOE_MLP), moe_megatron_args,
                              check_layout=check_layout, stacked_experts=True, expert_orientations=("5.x",),
                              experts_as_input=True, needs_bridge=NEEDS_BRIDGE, dropped=qwen3_5.dropped,
                              hf_config=qwen3_5.hf_config, torch_dist=DIST_KEYS, fp8=qwen3_5.fp8_projection)
