"""megatron-core's own view of a torch_dist checkpoint (test-only): the local-spec model built on the
meta device (TP1/PP1/EP1, a one-process gloo group) and its `sharded_state_dict()`, the boxes
megatron-core saves and loads. mconv derives the same boxes from its tables without megatron-core
(mconv/converter/torch_dist.py); tests/test_torch_dist_keys.py holds the two equal.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from argparse import Namespace
from types import SimpleNamespace
from typing import Iterator

import torch

from mconv.errors import MconvError


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """megatron-core warns about Transformer Engine, Apex and GPTModel's deprecation on import."""
    loggers = [logging.getLogger(name) for name in ("megatron", "megatron.core", "torch.utils.cpp_extension")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


@contextlib.contextmanager
def megatron_process_group() -> Iterator[None]:
    """A one-process gloo group with megatron-core's parallel state at TP1/PP1/EP1."""
    import torch.distributed as dist

    with quiet_megatron():
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import initialize_rng_tracker
    with quiet_megatron():
        if dist.is_initialized():
            raise MconvError("megatron_process_group runs in its own process group")
        with tempfile.TemporaryDirectory() as store:
            dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
            try:
                ps.initialize_model_parallel(1, 1)
                initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
                yield
            finally:
                ps.destroy_model_parallel()
                dist.destroy_process_group()


def core_config(args: Namespace, dtype: torch.dtype):
    """megatron-core's TransformerConfig for the Megatron-LM args mconv writes (the subset of
    Megatron-LM's core_transformer_config_from_args that the Qwen3 architectures use)."""
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if getattr(args, "num_experts", None):
        moe = dict(num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_router_topk=args.moe_router_topk, moe_router_pre_softmax=args.moe_router_pre_softmax,
                   moe_layer_freq=args.moe_layer_freq, moe_grouped_gemm=False)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, params_dtype=dtype, use_cpu_initialization=True,
        perform_initialization=False, **moe)


def meta_model(args: Namespace, dtype: torch.dtype, dtypes: dict[str, torch.dtype] | None = None):
    """megatron-core's GPTModel (Qwen3-VL: mbridge's Qwen3VLModel) for these args, local spec, every
    parameter on the meta device; `dtypes` overrides parameter dtypes (as a bf16 trainer's
    Float16Module would, per tensor)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = core_config(args, dtype)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                      qk_l2_norm=False)
    with torch.device("meta"):
        if getattr(args, "vision_layers", None):  # Qwen3-VL: the Megatron Qwen3VLModel instead
            model = qwen3_vl_model(args, config)
        else:
            model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                             max_sequence_length=args.max_position_embeddings,
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                             position_embedding_type="rope", rotary_base=args.rotary_base)
        with_dtypes(model, dtypes)
    return model


def with_dtypes(model, dtypes: dict[str, torch.dtype] | None):
    """`model` (on the meta device) with its parameters of `dtypes` (by name) in those dtypes."""
    for name, param in model.named_parameters():
        if dtypes and name in dtypes and param.dtype != dtypes[name]:
            param.data = torch.empty(param.shape, dtype=dtypes[name], device="meta")
    return model


def _storage_id(tensor: torch.Tensor) -> int:
    # Meta tensors have no data, but views and `.data` aliases share the parameter's storage object.
    return tensor.untyped_storage()._cdata


def parameter_names(model) -> dict[int, str]:
    return {_storage_id(t): name for name, t in model.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor)}


def sharded_items(model, prefix: str = "") -> list:
    """Every ShardedTensor and ShardedObject of the model's `sharded_state_dict(prefix)` (factories
    applied; a VL model's language model saves under `language_model.`)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    sharded = model.sharded_state_dict(prefix=prefix)
    apply_factories(sharded)
    return list(nested_values(sharded))


def sharded_parameters(model) -> dict[str, list]:
    """megatron-core's ShardedTensors (the boxes of global checkpoint tensors) of each parameter, by
    parameter name; a GLU fc1 has two, its gate and up halves."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    names = parameter_names(model)
    boxes: dict[str, list] = {}
    for entry in sharded_items(model):
        if isinstance(entry, ShardedTensor):
            boxes.setdefault(names[_storage_id(entry.data)], []).append(entry)
    return boxes


def box_record(item, names: dict[int, str]) -> tuple:
    """A comparable record of one megatron-core box: tensors (key, global shape, dtype, global offset,
    sizes with the prepended axes, replica id, parameter name, first row of the parameter it holds);
    objects (unique key, replica id, data)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if not isinstance(item, ShardedTensor):
        return ("object", item.unique_key, tuple(item.replica_id), item.data)
    view = item.data
    row_bytes = view.stride(0) if view.dim() else 1
    return ("tensor", item.key, tuple(item.global_shape), item.dtype, tuple(item.global_offset),
            (1,) * item.prepend_axis_num + tuple(item.local_shape), tuple(item.replica_id),
            names[_storage_id(view)], view.storage_offset() // row_bytes)


def qwen3_vl_model(args, config):
    """The Megatron `Qwen3VLModel` of mbridge (git main) for these Megatron-LM args, from megatron-core's
    local specs, as a CPU trainer builds it (vision blocks `get_vit_layer_with_local_spec`; mergers
    WrappedTorchNorm / ColumnParallelLinear / RowParallelLinear), built on the current device;
    `config` is the language model's TransformerConfig. Its `sharded_state_dict()` gives the
    torch_dist keys (the vision tower's local-spec norms keep their local names there)."""
    import dataclasses

    import torch

    try:
        from mbridge.models.qwen3_vl.model import Qwen3VLModel
        from mbridge.models.qwen3_vl.transformer_config import Qwen3VLTransformerConfig
    except ImportError as e:
        raise MconvError(f"the Qwen3-VL torch_dist oracle builds mbridge's Qwen3VLModel, which is not installed "
                         f"({e}); install the mbridge wheel in wheels/ (scripts/install.sh does)") from None

    config = Qwen3VLTransformerConfig(**{
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init},
        "mrope_section": list(args.mrope_section)}, patch_size=args.patch_size,
        temporal_patch_size=args.temporal_patch_size, in_channels=args.in_channels,
        spatial_merge_size=args.spatial_merge_size, num_position_embeddings=args.num_position_embeddings,
        out_hidden_size=args.hidden_size, deepstack_visual_indexes=list(args.deepstack_visual_indexes))
    vision = SimpleNamespace(depth=args.vision_layers, hidden_size=args.vision_hidden, num_heads=args.vision_heads,
                             intermediate_size=args.vision_ffn, patch_size=args.patch_size,
                             temporal_patch_size=args.temporal_patch_size, in_channels=args.in_channels,
                             spatial_merge_size=args.spatial_merge_size,
                             num_position_embeddings=args.num_position_embeddings, out_hidden_size=args.hidden_size,
                             deepstack_visual_indexes=list(args.deepstack_visual_indexes))
    # megatron-core's MultimodalRotaryEmbedding puts its frequencies on torch.cuda.current_device() when
    # built; the model is built on the meta device to read its keys, so they go there, GPU or not.
    # mbridge also logs a warning that its Qwen3VLModel is "under development".
    current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: "meta"
    logger = logging.getLogger("mbridge")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return _qwen3_vl_model(Qwen3VLModel, config, vision, args)
    finally:
        torch.cuda.current_device = current_device
        logger.setLevel(level)


def _qwen3_vl_model(Qwen3VLModel, config, vision, args):
    from copy import deepcopy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from mbridge.models.qwen3_vl.transformer_config import get_vision_model_config
    from mbridge.models.qwen3_vl.utils import PatchMergerSubmodules

    return Qwen3VLModel(
        language_transformer_config=config,
        language_transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                                   normalization=args.normalization, qk_l2_norm=False),
        language_vocab_size=args.padded_vocab_size, language_max_sequence_length=args.max_position_embeddings,
        vision_transformer_config=get_vision_model_config(deepcopy(config), vision),
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        vision_patch_merger_spec=PatchMergerSubmodules(WrappedTorchNorm, ColumnParallelLinear, RowParallelLinear),
        language_rotary_base=args.rotary_base,
        language_share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        image_token_id=args.image_token_id, video_token_id=args.video_token_id,
        vision_start_token_id=args.vision_start_token_id)
