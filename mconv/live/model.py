"""The megatron-core model of an HF config, for the architectures megatron-core builds itself: its
TransformerConfig (transformer_config) and the rank's GPTModel chunks (build_model).

One source of facts: both start from the Megatron-LM args mconv stores in the checkpoints it
writes (megatron_io.megatron_lm_args), mapped to config fields as Megatron-LM's own
`core_transformer_config_from_args` maps them (megatron.training is Megatron-LM's, not a library
dependency, so the mapping of the args mconv stores is repeated here: `_config_fields`).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import torch

from mconv.converter import megatron_io
from mconv.converter.layout import Layout
from mconv.converter.options import DTYPES, torch_dtype
from mconv.converter.planner import model_dims, validate_layout
from mconv.converter.transforms import padded_vocab_size
from mconv.errors import MconvError
from mconv.live.chunks import _config
from mconv.mappings import architecture_for

# Config fields the args set that stay the caller's to choose: `dtype` sets them (as --bf16 / --fp16 do).
_DTYPE_FIELDS = ("params_dtype", "pipeline_dtype", "bf16", "fp16")


def _megatron_args(config: dict, layout: Layout, spec: str, dtype: torch.dtype | None) -> argparse.Namespace:
    """The Megatron-LM args mconv stores for this model at `layout`."""
    if spec not in ("local", "te"):
        raise MconvError(f"spec must be 'local' or 'te' (Transformer Engine), not {spec!r}")
    arch = architecture_for(config)
    if arch.needs_bridge:
        raise MconvError(f"megatron-core cannot build {arch.name} itself: {arch.needs_bridge}")
    dims = model_dims(arch, config)
    validate_layout(dims, layout, arch.check_layout)
    dtype = torch_dtype(dtype)
    if dtype is None:
        name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        if name not in DTYPES:
            raise MconvError(f"config.json's dtype is {name!r}; pass dtype= one of torch.float32, bfloat16, float16")
        dtype = torch_dtype(name)
    padded = padded_vocab_size(dims.vocab, layout.vocab_divisor, layout.tp)
    return megatron_io.megatron_lm_args(layout, dims, arch.megatron_args(dims), spec, padded, dtype, "torch")


def _config_fields(args: argparse.Namespace, config_class) -> dict:
    """Megatron-LM's `core_transformer_config_from_args` (megatron.training.argument_utils,
    Megatron-LM 0.19; 0.14's reads layernorm_epsilon from norm_epsilon, which mconv stores as
    the same value) on the args mconv stores: every config field named like an arg, then the args
    it renames. Fields the config class lacks (an older megatron-core) are left out, as there."""
    import torch.nn.functional as F

    names = {f.name for f in dataclasses.fields(config_class)}
    fields = {name: getattr(args, name) for name in names if hasattr(args, name)}
    fields.update(pipeline_dtype=args.params_dtype, num_moe_experts=args.num_experts,
                  rotary_interleaved=args.rotary_interleaved,
                  num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
                  num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
                  num_query_groups=args.num_query_groups if args.group_query_attention else None,
                  # validate_args' default: each weight in as many shards as TP (ETP) ranks, no GTP.
                  tensor_parallel_num_weight_shards=args.tensor_model_parallel_size,
                  expert_tensor_parallel_num_weight_shards=args.expert_tensor_parallel_size)
    if args.swiglu:
        fields.update(activation_func=F.silu, gated_linear_unit=True)
    if getattr(args, "rope_type", None) is None:
        fields.pop("rope_type", None)
    return {name: value for name, value in fields.items() if name in names}


def _yarn(config, args: argparse.Namespace) -> None:
    """Megatron-LM's `_apply_yarn_config_from_args`: GPTModel's YaRN reads these attributes off a
    (non-MLA) config."""
    if args.position_embedding_type != "yarn" or getattr(args, "multi_latent_attention", False):
        return
    for field, arg in (("rotary_scaling_factor", "rotary_scaling_factor"),
                       ("original_max_position_embeddings", "yarn_original_max_position_embeddings"),
                       ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"), ("mscale", "mscale"),
                       ("mscale_all_dim", "mscale_all_dim"),
                       ("correction_range_round_to_int", "yarn_correction_range_round_to_int")):
        if not hasattr(config, f"yarn_{field}"):
            setattr(config, f"yarn_{field}", getattr(args, arg))


def transformer_config(hf_config: str | Path | dict, layout: Layout, spec: str = "local",
                       dtype: torch.dtype | None = None, revision: str | None = None, **overrides):
    """megatron-core's TransformerConfig (MLATransformerConfig for multi-latent attention) of the
    model in `hf_config` (its directory, hub name at `revision`, or config dict) at `layout`: the
    one Megatron-LM's `core_transformer_config_from_args` makes from the args mconv stores.

    `spec` is the layer spec the model will be built with ("local", or "te" for Transformer
    Engine: it sets transformer_impl and grouped-GEMM experts); `dtype` the parameters' dtype
    (default: config.json's dtype, else bfloat16). `overrides` set the trainer's own choices
    (fusions, recomputation, initialisation, MoE dispatcher, sequence_parallel, ...). Raises
    MconvError for an architecture megatron-core cannot build, a layout the model does not fit,
    an override of a field the HF config and layout fix, or a field this megatron-core lacks.
    """
    return _model_config(_megatron_args(_config(hf_config, revision), layout, spec, dtype), overrides)


def _model_config(args: argparse.Namespace, overrides: dict):
    """The TransformerConfig made from the stored `args`, with `overrides`: see transformer_config."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    config_class = MLATransformerConfig if getattr(args, "multi_latent_attention", False) else TransformerConfig
    fields = _config_fields(args, config_class)
    known = {f.name for f in dataclasses.fields(config_class)}
    for name, value in overrides.items():
        if name not in known:
            raise MconvError(f"transformer_config: megatron-core's {config_class.__name__} has no field {name!r}")
        if name in fields and name not in _DTYPE_FIELDS and value != fields[name]:
            raise MconvError(f"transformer_config: {name} is {fields[name]!r} for this HF config and layout; "
                             f"overrides set only what they leave open (dtype= sets the parameters' dtype)")
    made = config_class(**{**fields, **overrides})
    _yarn(made, args)
    return made


def _check_parallel_state(layout: Layout, experts: bool) -> None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise MconvError("build_model: initialise megatron-core's parallel_state first "
                         "(parallel_state.initialize_model_parallel with the layout's sizes)")
    found = dict(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                 vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1)
    if experts:
        found.update(ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size())
    for name, size in found.items():
        if getattr(layout, name) != size:
            raise MconvError(f"build_model: the layout has {name.upper()}{getattr(layout, name)}, megatron-core's "
                             f"parallel_state {name.upper()}{size}")


def build_model(hf_config: str | Path | dict, layout: Layout, spec: str = "local", dtype: torch.dtype | None = None,
                parallel_output: bool = True, revision: str | None = None, **overrides) -> list[torch.nn.Module]:
    """This rank's model chunks (one GPTModel per virtual pipeline stage, with its pre/post-process
    parts and `vp_stage`) of the model in `hf_config` at `layout`, built on megatron-core's
    parallel_state as the caller initialised it (whose sizes must be the layout's) with the
    model-parallel RNG tracker set up (`tensor_parallel.model_parallel_cuda_manual_seed`), and
    randomly initialised: ready for `load_hf_weights`. The config is `transformer_config(hf_config,
    layout, spec, dtype, **overrides)`; the layer spec megatron-core's local one, or with
    spec="te" its Transformer Engine one. `parallel_output=False` gathers the logits over TP.
    Raises MconvError as transformer_config does, and naming the size where the layout and
    parallel_state differ or when Transformer Engine is missing for spec="te"."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    args = _megatron_args(_config(hf_config, revision), layout, spec, dtype)
    if spec == "te":  # before parallel_state: what is missing from the environment comes first
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise MconvError("build_model: spec='te' needs Transformer Engine, which is not installed; "
                             "spec='local' builds megatron-core's own layers") from None
    _check_parallel_state(layout, bool(args.num_experts))
    gpt_rope = inspect.signature(GPTModel.__init__).parameters["position_embedding_type"].annotation
    if repr(args.position_embedding_type) not in str(gpt_rope):
        raise MconvError(f"build_model: this megatron-core's GPTModel has no {args.position_embedding_type!r} "
                         "position embedding (megatron-core 0.19 has YaRN)")
    config = _model_config(args, overrides)
    chunks = []
    for v in range(layout.vpp):
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=spec == "te",
                                           normalization=config.normalization,
                                           qk_l2_norm=getattr(config, "qk_l2_norm", False), vp_stage=v)
        # The rotary arguments as Megatron-LM's GPT builder passes them from its args.
        chunks.append(GPTModel(config=config, transformer_layer_spec=block, vocab_size=args.padded_vocab_size,
                               max_sequence_length=args.max_position_embeddings,
                               pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                               share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                               parallel_output=parallel_output, position_embedding_type=args.position_embedding_type,
                               rotary_percent=args.rotary_percent, rotary_base=args.rotary_base, vp_stage=v))
    return chunks
