"""One rank's model chunks as mconv sees them (LiveModel: layout, coordinates, planned tensors), and
what loading and exporting share: the HF config or directory a call names, and byte-bounded buckets."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from mconv.converter.hf_config import read_config
from mconv.converter.hub import resolve_model
from mconv.converter.layout import Layout, Rank
from mconv.converter.planner import RankPlan, model_dims, plan_rank, validate_layout
from mconv.errors import MconvError
from mconv.mappings import architecture_for
from mconv.transport.copies import _held

# Transformer Engine's grouped experts name expert e's weight `experts.linear_fc1.weight{e}` (the tables'
# TE name); a TE model with SequentialMLP experts (moe_grouped_gemm off) names it as the local spec does.
_SEQUENTIAL_EXPERT = re.compile(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _canonical(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name.replace(".to_wrap.", ".")


def _unwrap(chunk):
    while not hasattr(chunk, "vocab_size") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _vocab_size(core) -> int:
    """The padded vocabulary of a GPTModel, or of a vision-language model's `language_model` (Qwen3VLModel)."""
    return core.vocab_size if hasattr(core, "vocab_size") else core.language_model.vocab_size


@dataclass
class LiveModel:
    """One rank's view of a live Megatron model: its layout, its coordinates and its tensors, each
    matched to the planned tensor of the same name."""

    arch: object
    config: dict
    dims: object
    layout: Layout
    spec: str
    rank: Rank
    plan: RankPlan
    tensors: list[dict[str, torch.Tensor]]  # per chunk: planned Megatron name -> the model's tensor

    @classmethod
    def of(cls, model_chunks: Sequence[torch.nn.Module], hf_config: dict) -> "LiveModel":
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise MconvError("initialise megatron-core's parallel_state first (torch.distributed.init_process_group, "
                             "then parallel_state.initialize_model_parallel with the model's TP, PP and EP sizes)")
        chunks = list(model_chunks)
        core = _unwrap(chunks[0])
        if getattr(core, "config", None) is None:
            raise MconvError(f"model chunk 0 is a {type(core).__name__}, not a megatron-core model (a GPTModel, "
                             "Qwen3VLModel, ..., or a DDP / Float16Module wrapping one)")
        vpp = getattr(core.config, "virtual_pipeline_model_parallel_size", None)
        if vpp and vpp != len(chunks):
            raise MconvError(f"the model has {vpp} virtual pipeline chunks on each rank (its config's "
                             f"virtual_pipeline_model_parallel_size), model_chunks {len(chunks)}: pass all {vpp}")
        # Detached views share the parameters' storage: writes land in the model, reads build no graph.
        states = [{_canonical(k): v.detach() for k, v in c.state_dict(keep_vars=True).items()
                   if isinstance(v, torch.Tensor) and ".adapter." not in k} for c in chunks]
        tp = ps.get_tensor_model_parallel_world_size()
        # Norms fused into a linear (linear_qkv, MLA up projections, dense fc1) exist only under TE.
        fused = any(k.endswith(".layer_norm_weight") for s in states for k in s)
        if fused:
            states = [{_SEQUENTIAL_EXPERT.sub(r"experts.\2.weight\1", k): v for k, v in s.items()} for s in states]
        arch = architecture_for(hf_config)
        dims = model_dims(arch, hf_config, mtp=bool(getattr(core.config, "mtp_num_layers", None)))
        # A dense model has no expert groups to follow, though megatron-core sizes them anyway
        # (Megatron-LM's and the bridges' default ETP is TP).
        experts = bool(getattr(dims, "experts", 0))
        layout = Layout(tp=tp, pp=ps.get_pipeline_model_parallel_world_size(), vpp=len(chunks),
                        ep=ps.get_expert_model_parallel_world_size() if experts else 1,
                        etp=ps.get_expert_tensor_parallel_world_size() if experts else 1,
                        first_stage_layers=core.config.num_layers_in_first_pipeline_stage,
                        last_stage_layers=core.config.num_layers_in_last_pipeline_stage,
                        vocab_divisor=_vocab_size(core) // tp)
        rank = Rank(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                    ep=ps.get_expert_model_parallel_rank() if experts else 0,
                    etp=ps.get_expert_tensor_parallel_rank() if experts else 0)
        validate_layout(dims, layout, arch.check_layout)
        spec = "te" if fused else "local"
        plan = plan_rank(arch, dims, layout, spec, rank)
        for v, (state, tasks) in enumerate(zip(states, plan.chunks)):
            planned = {t.megatron: t for t in tasks if t.shard is not None}
            unknown = sorted(set(state) - set(planned))
            missing = sorted(set(planned) - set(state))
            if unknown or missing:
                what = (f"unknown parameters {unknown[:4]}" if unknown else "") + \
                       (" and " if unknown and missing else "") + (f"missing parameters {missing[:4]}" if missing else "")
                tied = (any(n.endswith("output_layer.weight") for n in unknown + missing) and
                        f" (the HF config's tie_word_embeddings is {bool(dims.tied)}: "
                        f"{'no' if dims.tied else 'an'} output layer of its own)")
                raise MconvError(f"model chunk {v} does not match {arch.name} at {layout.describe()} ({spec} spec): "
                                 f"{what}{tied or ''}")
            for name, task in planned.items():
                if tuple(state[name].shape) != task.shape:
                    raise MconvError(f"model chunk {v}: {name} has shape {list(state[name].shape)}, the HF config "
                                     f"and layout imply {list(task.shape)}")
                if state[name].is_meta:
                    raise MconvError(f"model chunk {v}: {name} is on the meta device (no values: a lazy "
                                     "initialization not materialized); materialize the model first")
                if not _held(state[name]):
                    raise MconvError(f"model chunk {v}: {name} has no memory (its storage was freed in place, "
                                     "an offload's untyped_storage().resize_(0)): load it back first")
        return cls(arch, hf_config, dims, layout, spec, rank, plan, states)

    def peer_plan(self, **coordinates) -> RankPlan:
        """The plan of another rank of this pipeline stage (same tensor order, other shards)."""
        rank = Rank(**{**vars(self.rank), **coordinates})
        return plan_rank(self.arch, self.dims, self.layout, self.spec, rank)


def _model_dir(name_or_path, revision: str | None, weights: bool) -> Path:
    """The HF model directory a name or path names; MconvError for a config dict, which holds no files."""
    if isinstance(name_or_path, dict):
        raise MconvError("a config dict holds no " + ("weights" if weights else "tokenizer or side files")
                         + "; pass the HF model directory or hub name")
    return _resolved(str(name_or_path), revision, weights)


@functools.cache
def _resolved(name_or_path: str, revision: str | None, weights: bool) -> Path:
    """A hub name is resolved once per process (online, each resolution asks the Hub for the
    revision's commit; a weight sync must not)."""
    return resolve_model(name_or_path, revision, weights=weights)


def _config(hf_config, revision: str | None = None) -> dict:
    """The HF config a live API is given: a dict as it is (its model class checked here, to be named
    as `hf_config` rather than a config.json), else the model directory's or hub name's config.json."""
    if isinstance(hf_config, dict):
        architecture_for(hf_config, where="hf_config (a dict)")
        return hf_config
    return read_config(_model_dir(hf_config, revision, False))


def _buckets(items: list, nbytes, limit: int, together=None) -> Iterator[list]:
    """Consecutive items up to `limit` bytes per bucket (an item larger than that alone). Consecutive
    items with the same `together(item)` key other than None share one bucket, whatever its size."""
    units, key = [], None
    for item in items:
        k = together(item) if together else None
        if units and k is not None and k == key:
            units[-1].append(item)
        else:
            units.append([item])
        key = k
    bucket, size = [], 0
    for unit in units:
        n = sum(nbytes(item) for item in unit)
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket += unit
        size += n
    if bucket:
        yield bucket
