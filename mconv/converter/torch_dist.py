"""Megatron-LM's `torch_dist` format, written and read through megatron-core itself.

The keys, global shapes, layer stacking and expert axes are not re-derived here: megatron-core
builds the model (local spec, TP1/PP1/EP1, on the meta device, so it costs no memory) and its
`sharded_state_dict()` says what the checkpoint holds; torch_dist keys are independent of the
parallel layout, so the trainer reshards on load. Only the bytes come from mconv: when
torch.distributed.checkpoint's writer asks for a tensor, the meta view it was planned with is
traced back to its parameter and that parameter is built from the HF slices on the spot. One
parameter is in memory at a time, whatever the size of the model.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import tempfile
import warnings
from argparse import Namespace
from pathlib import Path
from typing import Callable, Iterator

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
        freq = args.moe_layer_freq
        moe = dict(num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_router_topk=args.moe_router_topk, moe_router_pre_softmax=args.moe_router_pre_softmax,
                   moe_layer_freq=1 if all(freq) else list(freq), moe_grouped_gemm=False)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, params_dtype=dtype, use_cpu_initialization=True,
        perform_initialization=False, **moe)


def meta_model(args: Namespace, dtype: torch.dtype, dtypes: dict[str, torch.dtype] | None = None):
    """megatron-core's GPTModel for these args, local spec, every parameter on the meta device;
    `dtypes` overrides parameter dtypes (as a bf16 trainer's Float16Module would, per tensor)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = core_config(args, dtype)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                      qk_l2_norm=False)
    with torch.device("meta"):
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


def _streaming_strategy(materialize: Callable[[torch.Tensor], torch.Tensor], progress: Callable[[int], None]):
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                                    _replace_state_dict_keys_with_sharded_keys,
                                                                    mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class StreamingPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor) and data.is_meta:
                data = materialize(data)
                progress(data.nbytes)
            return data

    class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        """megatron-core's torch_dist save, with torch's serial file writer, which asks for each
        tensor only when it writes it (megatron's own writer stages everything first)."""

        def save(self, sharded_state_dict, checkpoint_dir):
            sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=True, thread_count=1)
            planner = StreamingPlanner(dedup_replicated_tensors=False, flatten_state_dict=False,
                                       flatten_sharded_tensors=False)
            dcp_save(mcore_to_pyt_state_dict(sharded, False), storage_writer=writer, planner=planner)

    return StreamingSaveStrategy()


def save(iter_dir: Path, args: Namespace, dtype: torch.dtype, iteration: int | None, model_chunks: int,
         parameter: Callable[[str], torch.Tensor], dtypes: dict[str, torch.dtype],
         progress: Callable[[int], None]) -> None:
    """Write a torch_dist checkpoint; `parameter(name)` builds the full (TP1) tensor of a parameter
    named as in megatron-core's local-spec state dict, `dtypes` gives each parameter's dtype."""
    iter_dir.mkdir(parents=True)
    with megatron_process_group():
        from megatron.core import dist_checkpointing

        model = meta_model(args, dtype, dtypes)
        names = _parameter_names(model)
        cache: dict[str, torch.Tensor] = {}

        def materialize(view: torch.Tensor) -> torch.Tensor:
            name = names.get(_storage_id(view))
            if name is None:
                raise MconvError("internal: megatron-core planned a tensor that is not a model parameter")
            if name not in cache:  # GLU fc1 is written as two halves of one parameter, one after the other
                cache.clear()
                cache[name] = parameter(name)
            full = cache[name]
            if view.storage_offset() == 0 and view.numel() == full.numel() and view.is_contiguous():
                return full.view(view.size())  # the whole parameter (maybe with a stacking axis): no copy
            return full.as_strided(view.size(), view.stride(), view.storage_offset()).clone()

        sharded = model.sharded_state_dict()
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration or 0}
        state.update({"model": sharded} if model_chunks == 1 else {"model0": sharded})
        dist_checkpointing.save(state, str(iter_dir), sharded_strategy=_streaming_strategy(materialize, progress))


@functools.cache
def _box_planner_class():
    """A DCP load planner that reads boxes of global tensors; DCP finds the stored chunks that
    overlap each box. (Defined once: a class made per call would be cyclic garbage holding the
    destination buffers until the garbage collector ran.)"""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxLoadPlanner(LoadPlanner):
        def __init__(self, requests: dict[tuple[str, tuple[int, ...]], torch.Tensor]):
            self.requests = requests  # (key, global offset) -> destination view with the box's shape

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.metadata = metadata

        def create_local_plan(self):
            items = []
            for (key, offsets), dest in self.requests.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value):
            raise MconvError("internal: a tensor read was planned as bytes")

        def resolve_tensor(self, read_item):
            dest = self.requests[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                dest = dest.narrow(dim, start, length)
            return dest

        def commit_tensor(self, read_item, tensor):
            pass  # resolve_tensor handed out views of the destination: the data is in place

    return BoxLoadPlanner


class TorchDistReader:
    """Reads parameters of a torch_dist checkpoint by their megatron-core (TP1) names.

    megatron-core's sharded state dict says which box of which global tensor each parameter (or
    each half of a GLU fc1) is; torch.distributed.checkpoint reads exactly those boxes, whatever
    chunking the checkpoint was written with.
    """

    def __init__(self, iter_dir: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.iter_dir = iter_dir
        with quiet_megatron():
            from megatron.core.dist_checkpointing.serialization import load_common_state_dict

            try:
                self.common = load_common_state_dict(str(iter_dir))
                self.metadata = FileSystemReader(str(iter_dir)).read_metadata()
            except Exception as e:  # megatron-core and DCP raise assorted types for unreadable checkpoints
                raise MconvError(f"{iter_dir} is not a readable torch_dist checkpoint ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})") from None
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.tensors = {key: md for key, md in self.metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}
        self.args = self.common.get("args") if isinstance(self.common, dict) else None

    def global_shape(self, key: str) -> tuple[int, ...] | None:
        entry = self.tensors.get(key)
        return None if entry is None else tuple(entry.size)

    def nbytes(self) -> int:
        total = 0
        for entry in self.tensors.values():
            n = entry.properties.dtype.itemsize
            for s in entry.size:
                n *= s
            total += n
        return total

    @contextlib.contextmanager
    def session(self, args: Namespace, dtype: torch.dtype):
        """Yields (load, dtype_of) within a megatron-core process group: load(names) ->
        {name: tensor}; dtype_of(name) is the stored dtype of that parameter."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint import load as dcp_load

        with megatron_process_group():
            model = meta_model(args, dtype)
            shapes = {name: t.shape for name, t in model.state_dict(keep_vars=True).items()
                      if isinstance(t, torch.Tensor)}
            boxes = sharded_parameters(model)

            def stored_dtype(name: str) -> torch.dtype:
                key = boxes[name][0].key
                if key not in self.tensors:
                    raise MconvError(f"{self.iter_dir}: tensor {key} (for {name}) is missing from the checkpoint")
                return self.tensors[key].properties.dtype

            def load(wanted: list[str]) -> dict[str, torch.Tensor]:
                out, requests = {}, {}
                for name in wanted:
                    if name not in boxes:
                        raise MconvError(f"internal: megatron-core's model has no parameter {name}")
                    out[name] = buffer = torch.empty(shapes[name], dtype=stored_dtype(name))
                    for entry in boxes[name]:
                        expected = (1,) * entry.prepend_axis_num + tuple(entry.local_shape)
                        if tuple(self.tensors[entry.key].size) != tuple(entry.global_shape):
                            raise MconvError(f"{self.iter_dir}: tensor {entry.key} has shape "
                                             f"{list(self.tensors[entry.key].size)}, the HF config implies "
                                             f"{list(entry.global_shape)}")
                        view = entry.data
                        dest = buffer.as_strided(view.size(), view.stride(), view.storage_offset())
                        requests[(entry.key, tuple(entry.global_offset))] = dest.view(expected)
                dcp_load({}, storage_reader=FileSystemReader(str(self.iter_dir)), planner=_box_planner_class()(requests),
                         no_dist=True)
                return out

            yield load, stored_dtype
