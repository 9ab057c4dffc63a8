"""The live-engine API: HF weights into a trainer's sharded Megatron model, and HF-named tensors
out of it at every weight sync. The same tables, planner and transforms as the offline tools.

Every function runs on every rank of the job (they issue collectives), with megatron-core's
parallel_state initialised and `model_chunks` the rank's model chunks (one per virtual pipeline
stage), wrapped or not (DDP / Float16Module `module.` prefixes, Megatron-Bridge LoRA `.to_wrap.`).
"""
from __future__ import annotations

import os
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from mconv.converter.hf_io import HFCheckpoint, ShardedSafetensorsWriter, copy_side_files, read_config
from mconv.converter.layout import Layout, Rank
from mconv.converter.planner import RankPlan, TensorTask, make_plan, plan_rank, validate_layout
from mconv.converter.transforms import merge, merge_single, split
from mconv.errors import MconvError
from mconv.mappings import architecture_for

DEFAULT_BUCKET_BYTES = 512 * 2**20
Bucket = list[tuple[str, torch.Tensor]]


def _canonical(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name.replace(".to_wrap.", ".")


def _unwrap(chunk):
    while not hasattr(chunk, "vocab_size") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


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

        chunks = list(model_chunks)
        core = _unwrap(chunks[0])
        # Detached views share the parameters' storage: writes land in the model, reads build no graph.
        states = [{_canonical(k): v.detach() for k, v in c.state_dict(keep_vars=True).items()
                   if isinstance(v, torch.Tensor) and ".adapter." not in k} for c in chunks]
        tp = ps.get_tensor_model_parallel_world_size()
        fused = any(k.endswith(".self_attention.linear_qkv.layer_norm_weight") for s in states for k in s)
        layout = Layout(tp=tp, pp=ps.get_pipeline_model_parallel_world_size(), vpp=len(chunks),
                        ep=ps.get_expert_model_parallel_world_size(),
                        etp=ps.get_expert_tensor_parallel_world_size(),
                        first_stage_layers=core.config.num_layers_in_first_pipeline_stage,
                        last_stage_layers=core.config.num_layers_in_last_pipeline_stage,
                        vocab_divisor=core.vocab_size // tp)
        rank = Rank(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                    ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank())
        arch = architecture_for(hf_config)
        dims = arch.dims(hf_config)
        validate_layout(dims, layout)
        spec = "te" if fused else "local"
        plan = plan_rank(arch, dims, layout, spec, rank)
        for v, (state, tasks) in enumerate(zip(states, plan.chunks)):
            planned = {t.megatron: t for t in tasks if t.shard is not None}
            unknown = sorted(set(state) - set(planned))
            missing = sorted(set(planned) - set(state))
            if unknown or missing:
                what = (f"unknown parameters {unknown[:4]}" if unknown else "") + \
                       (" and " if unknown and missing else "") + (f"missing parameters {missing[:4]}" if missing else "")
                raise MconvError(f"model chunk {v} does not match {arch.name} at {layout.describe()} ({spec} spec): "
                                 f"{what}")
            for name, task in planned.items():
                if tuple(state[name].shape) != task.shape:
                    raise MconvError(f"model chunk {v}: {name} has shape {list(state[name].shape)}, the HF config "
                                     f"and layout imply {list(task.shape)}")
        return cls(arch, hf_config, dims, layout, spec, rank, plan, states)

    def peer_plan(self, **coordinates) -> RankPlan:
        """The plan of another rank of this pipeline stage (same tensor order, other shards)."""
        rank = Rank(**{**vars(self.rank), **coordinates})
        return plan_rank(self.arch, self.dims, self.layout, self.spec, rank)


def _config(hf_config) -> dict:
    return hf_config if isinstance(hf_config, dict) else read_config(Path(hf_config))


def load_hf_weights(model_chunks: Sequence[torch.nn.Module], hf_dir: str | Path) -> None:
    """Copy the HF checkpoint into this rank's parameters. Each rank reads only the slices it owns
    (its TP/ETP shard, its PP stage's layers, its EP rank's experts), straight from the files."""
    ckpt = HFCheckpoint(hf_dir)
    live = LiveModel.of(model_chunks, ckpt.config)
    for tasks, tensors in zip(live.plan.chunks, live.tensors):
        for task in tasks:
            if task.shard is None:
                continue
            for name, shape in zip(task.hf, task.hf_shapes):
                if name not in ckpt.tensors:
                    raise MconvError(f"{ckpt.dir}: tensor {name} is missing from the checkpoint")
                if ckpt.tensors[name].shape != shape:
                    raise MconvError(f"{ckpt.dir}: tensor {name} has shape {list(ckpt.tensors[name].shape)}, "
                                     f"config.json implies {list(shape)}")
            shard = split(task.shard, lambda s, dim, a, b: ckpt.read(task.hf[s], dim, a, b))
            tensors[task.megatron].copy_(shard)
    ckpt.close()


def _all_gather(tensors: list[torch.Tensor], group) -> list[list[torch.Tensor]]:
    """result[r][i] is group rank r's tensors[i] (same shapes on every rank): one collective per
    dtype for the whole list, no host synchronisation."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return [tensors]
    out: list[list] = [[None] * len(tensors) for _ in range(size)]
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_dtype[t.dtype].append(i)
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        gathered = torch.empty(size * flat.numel(), dtype=dtype, device=flat.device)
        dist.all_gather_into_tensor(gathered, flat, group=group)
        for r in range(size):
            offset = r * flat.numel()
            for i in indices:
                out[r][i] = gathered[offset:offset + tensors[i].numel()].view(tensors[i].shape)
                offset += tensors[i].numel()
    return out


def _exported(plan: RankPlan) -> list[tuple[int, TensorTask]]:
    """(chunk, task) of the tensors this rank contributes to the HF model, in plan order, which is
    the same on every rank of a stage (so peers' collectives line up)."""
    return [(v, t) for v, chunk in enumerate(plan.chunks) for t in chunk if t.shard is not None and t.rule.exported]


def _buckets(tasks: list, nbytes, limit: int) -> Iterator[list]:
    bucket, size = [], 0
    for item in tasks:
        if bucket and size + nbytes(item) > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes(item)
    if bucket:
        yield bucket


def _stage_buckets(live: LiveModel, bucket_bytes: int, dtype: torch.dtype | None) -> Iterator[Bucket]:
    from megatron.core import parallel_state as ps

    tp_group, ep_group = ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group()
    etp_group = ps.get_expert_tensor_parallel_group()
    tasks = _exported(live.plan)
    tp_peers = [_exported(live.peer_plan(tp=r)) for r in range(live.layout.tp)]
    etp_peers = [_exported(live.peer_plan(etp=r)) for r in range(live.layout.etp)]
    ep_peers = [_exported(live.peer_plan(ep=r)) for r in range(live.layout.ep)]
    index = {id(task): i for i, (_, task) in enumerate(tasks)}

    def nbytes(item) -> int:
        v, task = item
        local = live.tensors[v][task.megatron]
        n = sum(torch.Size(s).numel() for s in task.hf_shapes) * local.element_size()
        return n * (live.layout.ep if task.rule.group == "etp" else 1)

    for bucket in _buckets(tasks, nbytes, bucket_bytes):
        out: Bucket = []
        for group_name, group, peers in (("tp", tp_group, tp_peers), ("etp", etp_group, etp_peers)):
            members = [(v, t) for v, t in bucket if t.rule.group == group_name]
            gathered = [(v, t) for v, t in members if not t.rule.kind.replicated]
            shards = _all_gather([live.tensors[v][t.megatron] for v, t in gathered], group)
            merged: list[list[torch.Tensor]] = []
            for i, (v, task) in enumerate(gathered):
                if len(shards) == 1:
                    merged.append(merge_single(task.shard, shards[0][i], task.hf_shapes))
                    continue
                layouts = [peers[r][index[id(task)]][1].shard for r in range(len(shards))]
                merged.append(merge(layouts, [shards[r][i] for r in range(len(shards))], task.hf_shapes))
            whole = {id(t): [live.tensors[v][t.megatron].view(t.hf_shapes[0])] for v, t in members
                     if t.rule.kind.replicated}
            whole.update({id(t): m for (_, t), m in zip(gathered, merged)})
            if group_name == "tp":
                out += [(n, x) for _, t in members for n, x in zip(t.hf, whole[id(t)])]
                continue
            # Experts: every EP rank holds other experts; gather the rebuilt HF tensors over EP.
            flat = [x for _, t in members for x in whole[id(t)]]
            per_ep = _all_gather(flat, ep_group)
            for j, tensors in enumerate(per_ep):
                names = [n for _, t in members for n in ep_peers[j][index[id(t)]][1].hf]
                out += list(zip(names, tensors))
        yield [(n, x if dtype is None else x.to(dtype)) for n, x in out]


def iter_hf_weights(model_chunks: Sequence[torch.nn.Module], hf_config: str | Path | dict,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
                    gather_pp: bool = False) -> Iterator[Bucket]:
    """Yield buckets of (HF name, tensor) for this rank's pipeline stage (every stage by default
    yields its own layers; with gather_pp every rank yields the whole model, stage by stage).

    Tensors are gathered over TP/ETP (one collective per bucket and dtype), experts over EP, with
    global layer and expert numbers, fused QKV / GLU split, vocabulary padding removed; they stay
    on the parameters' device. `hf_config` is the HF model directory or its config dict.
    """
    live = LiveModel.of(model_chunks, _config(hf_config))
    if not gather_pp or live.layout.pp == 1:
        yield from _stage_buckets(live, bucket_bytes, dtype)
        return
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    mine = list(_stage_buckets(live, bucket_bytes, dtype))
    layouts = [None] * live.layout.pp  # (names, shapes, dtypes) of every stage's buckets: one exchange
    dist.all_gather_object(layouts, [[(n, tuple(x.shape), x.dtype) for n, x in b] for b in mine], group=group)
    device = next(iter(live.tensors[0].values())).device
    for stage, stage_buckets in enumerate(layouts):
        source = dist.get_global_rank(group, stage)
        for b, entries in enumerate(stage_buckets):
            tensors = ([x for _, x in mine[b]] if stage == live.rank.pp else
                       [torch.empty(shape, dtype=dt, device=device) for _, shape, dt in entries])
            for dt in {t.dtype for t in tensors}:
                members = [t for t in tensors if t.dtype == dt]
                flat = torch.cat([t.reshape(-1) for t in members])
                dist.broadcast(flat, src=source, group=group)
                offset = 0
                for t in members:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
            yield [(name, t) for (name, _, _), t in zip(entries, tensors)]


def save_hf_weights(model_chunks: Sequence[torch.nn.Module], out_dir: str | Path, hf_config: str | Path,
                    max_shard_bytes: int = 3_000_000_000, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Save the live model as an HF directory, the same files `mconv mcore2hf` writes.

    Rank 0 lays out the shard files (headers are known in advance); one rank per pipeline stage
    (TP, EP and DP rank 0) writes its stage's tensors into them in place; rank 0 then writes the
    index, copies config and tokenizer from `hf_config` (the HF model directory) and renames the
    finished directory into place. The output path must be on a filesystem all ranks share.
    """
    from megatron.core import parallel_state as ps

    config = read_config(Path(hf_config))
    live = LiveModel.of(model_chunks, config)
    full = make_plan(live.arch, config, live.layout, live.spec)
    dtypes: dict[str, torch.dtype] = {}
    local = {name: tensor.dtype for tasks, tensors in zip(live.plan.chunks, live.tensors)
             for task in tasks if task.shard is not None for name in task.hf
             for tensor in [tensors[task.megatron]]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    for part in gathered:
        dtypes.update(part)
    entries = [(name, dtypes[name], shape) for task in full.exports() for name, shape in zip(task.hf, task.hf_shapes)]

    out = Path(out_dir).absolute()
    staging = out.with_name(f".{out.name}.mconv-partial-live")
    writer = ShardedSafetensorsWriter(staging, entries, max_shard_bytes)
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        writer.create()
        writer.close()
    dist.barrier()
    writes = (live.rank.tp == 0 and live.rank.ep == 0 and live.rank.etp == 0
              and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
    if writes:
        writer.open_existing()
    for bucket in _stage_buckets(live, bucket_bytes, None):
        if writes:
            for name, tensor in bucket:
                writer.write(name, tensor.cpu())
    if writes:
        writer.close()
    dist.barrier()
    if dist.get_rank() == 0:
        writer.write_index()
        copy_side_files(Path(hf_config), staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    dist.barrier()


__all__ = ["load_hf_weights", "iter_hf_weights", "save_hf_weights", "LiveModel"]
