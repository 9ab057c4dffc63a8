"""Megatron-LM's `torch_dist` format for mconv's models: what a checkpoint holds comes from megatron-core.

The keys, global shapes, layer stacking and expert axes are not re-derived here: megatron-core
builds the model (local spec, TP1/PP1/EP1, on the meta device, so it costs no memory) and its
`sharded_state_dict()` says what the checkpoint holds; torch_dist keys are independent of the
parallel layout, so the trainer reshards on load. Only the bytes come from mconv, through the
format-level reader and writer (`torch_dist_io`, which import neither megatron-core nor DCP): each
box megatron-core planned is traced back to its parameter, built from the HF slices when the writer
gets to it. One parameter per writer thread is in memory at a time, whatever the size of the model.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
import warnings
from argparse import Namespace
from pathlib import Path
from typing import Callable, Iterator

import torch

from mconv.converter import torch_dist_io
from mconv.converter.torch_dist_io import COMMON_KEY, DistEntry
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
            raise MconvError("torch_dist conversion runs in its own process group; "
                             "call it outside an initialised torch.distributed job")
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
    Megatron-LM's core_transformer_config_from_args that these architectures use)."""
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
    parameter on the meta device;
    `dtypes` overrides parameter dtypes (as a bf16 trainer's Float16Module would, per tensor)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = core_config(args, dtype)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                      qk_l2_norm=False)
    with torch.device("meta"):
        if getattr(args, "vision_layers", None):  # Qwen3-VL: the Megatron Qwen3VLModel instead
            from mconv.mappings.qwen3_vl import megatron_model

            model = megatron_model(args, config)
        else:
            model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                             max_sequence_length=args.max_position_embeddings,
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                             position_embedding_type="rope", rotary_base=args.rotary_base)
        for name, param in model.named_parameters():
            if dtypes and name in dtypes and param.dtype != dtypes[name]:
                param.data = torch.empty(param.shape, dtype=dtypes[name])
    return model


def _storage_id(tensor: torch.Tensor) -> int:
    # Meta tensors have no data, but views and `.data` aliases share the parameter's storage object.
    return tensor.untyped_storage()._cdata


def _parameter_names(model) -> dict[int, str]:
    return {_storage_id(t): name for name, t in model.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor)}


def sharded_parameters(model) -> dict[str, list]:
    """megatron-core's ShardedTensors (the boxes of global checkpoint tensors) of each parameter, by
    parameter name; a GLU fc1 has two, its gate and up halves."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    names = _parameter_names(model)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    boxes: dict[str, list] = {}
    for entry in nested_values(sharded):
        if isinstance(entry, ShardedTensor):
            boxes.setdefault(names[_storage_id(entry.data)], []).append(entry)
    return boxes


def write_entries(args: Namespace, dtype: torch.dtype, common: dict, parameter: Callable[[str], torch.Tensor], dtypes: dict[str, torch.dtype]) -> list[DistEntry]:
    """What a torch_dist checkpoint of mconv's model holds, as the writer's entries: every main-replica
    ShardedTensor and ShardedObject of megatron-core's `sharded_state_dict()` of the meta model (keys,
    global shapes, offsets as megatron-core plans them), then the `common` state (as Megatron-LM's:
    args, checkpoint_version, iteration). `parameter(name)`
    builds the full (TP1) tensor of a parameter named as in the local-spec state dict, `dtypes`
    each parameter's dtype. Needs `megatron_process_group()`."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    model = meta_model(args, dtype, dtypes)
    names = _parameter_names(model)
    local = threading.local()  # each writer thread builds its own parameters

    def box(entry) -> Callable[[], torch.Tensor]:
        name = names.get(_storage_id(entry.data))
        if name is None:
            raise MconvError(f"internal: megatron-core planned {entry.key}, which is not a model parameter")
        view, sizes = entry.data, (1,) * entry.prepend_axis_num + tuple(entry.local_shape)

        def produce() -> torch.Tensor:
            if getattr(local, "name", None) != name:  # GLU fc1 is two boxes of one parameter, written in turn
                local.name, local.full = name, parameter(name)
            full = local.full
            if view.storage_offset() == 0 and view.numel() == full.numel() and view.is_contiguous():
                return full.view(sizes)  # the whole parameter: no copy
            return full.as_strided(view.size(), view.stride(), view.storage_offset()).reshape(sizes)
        return produce, name

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    entries = []
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor) and item.replica_id in (0, (0, 0, 0), (0, 0)):
            produce, name = box(item)
            entries.append(DistEntry(item.key, tuple(item.global_shape), item.dtype, produce,
                                     tuple(item.global_offset), (1,) * item.prepend_axis_num + tuple(item.local_shape),
                                     group=name))
        elif isinstance(item, ShardedObject) and item.replica_id in (0, (0, 0, 0), (0, 0)):
            entries.append(DistEntry(item.unique_key, None, None, lambda data=item.data: data))
        elif not isinstance(item, (ShardedTensor, ShardedObject)):
            raise MconvError(f"internal: megatron-core's sharded state dict holds a {type(item).__name__}")
    entries.append(DistEntry(COMMON_KEY, None, None, lambda: common))
    return entries


def entries(args: Namespace, dtype: torch.dtype, common: dict, parameter: Callable[[str], torch.Tensor],
            dtypes: dict[str, torch.dtype]) -> list[DistEntry]:
    """`write_entries` in its own megatron-core process group (computed once per writing process)."""
    with megatron_process_group():
        return write_entries(args, dtype, common, parameter, dtypes)


def parameter_session(reader: torch_dist_io.TorchDistReader, args: Namespace, dtype: torch.dtype):
    """(load, dtype_of, load_rows) for a torch_dist checkpoint read by megatron-core's (TP1)
    parameter names: load(names) -> {name: tensor}; dtype_of(name) is the stored dtype of that
    parameter; load_rows([(name, start, dest)]) reads rows [start, start + len(dest)) of each
    parameter into `dest` (a contiguous tensor of the stored dtype: the output's own memory).
    megatron-core's sharded state dict says which box of which global tensor each parameter (or each
    half of a GLU fc1: a range of its rows) is; the reader reads those boxes, whatever chunking was written."""
    with megatron_process_group():
        model = meta_model(args, dtype)
        shapes = {name: t.shape for name, t in model.state_dict(keep_vars=True).items()
                  if isinstance(t, torch.Tensor)}
        boxes = sharded_parameters(model)
    where = reader.iter_dir
    rows: dict[str, list[tuple]] = {}  # name -> (key, global shape, offsets, row axis, first row, rows, sizes)
    for name, entries in boxes.items():
        for entry in entries:
            view, row = entry.data, shapes[name][1:].numel()
            if (not view.dim() or not view.is_contiguous() or view.shape[1:] != shapes[name][1:]
                    or view.storage_offset() % row):
                raise MconvError(f"internal: megatron-core's box {entry.key} of {name} is not a range of its rows")
            rows.setdefault(name, []).append((entry.key, tuple(entry.global_shape), tuple(entry.global_offset),
                                              entry.prepend_axis_num,
                                              view.storage_offset() // row, view.shape[0],
                                              (1,) * entry.prepend_axis_num + tuple(entry.local_shape)))

    def stored_dtype(name: str) -> torch.dtype:
        key = boxes[name][0].key
        if key not in reader.tensors:
            raise MconvError(f"{where}: tensor {key} (for {name}) is missing from the checkpoint")
        return reader.tensors[key].dtype

    def load_rows(parts: list[tuple[str, int, torch.Tensor]]) -> None:
        requests = []
        for name, start, dest in parts:
            if name not in boxes:
                raise MconvError(f"internal: megatron-core's model has no parameter {name}")
            stop = start + dest.shape[0]
            for key, global_shape, offsets, axis, first, length, sizes in rows[name]:
                lo, hi = max(start, first), min(stop, first + length)
                if lo >= hi:
                    continue
                if key in reader.tensors and reader.tensors[key].shape != global_shape:
                    raise MconvError(f"{where}: tensor {key} has shape {list(reader.tensors[key].shape)}, "
                                     f"the HF config implies {list(global_shape)}")
                box = list(offsets)
                box[axis] += lo - first
                part = dest.narrow(0, lo - start, hi - lo)
                requests.append((key, tuple(box), part.view(sizes[:axis] + (hi - lo,) + sizes[axis + 1:])))
        reader.read(requests)

    def load(wanted: list[str]) -> dict[str, torch.Tensor]:
        out = {name: torch.empty(shapes[name], dtype=stored_dtype(name)) for name in wanted}
        load_rows([(name, 0, buffer) for name, buffer in out.items()])
        return out

    return load, stored_dtype, load_rows
