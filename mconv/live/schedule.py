"""The plan of a live model's export, made once and kept while no parameter moves: which HF tensors
each bucket holds and how each is rebuilt from this rank's shards (a view, one index_select, or a
gather over TP / ETP / EP), for iter_hf_weights and sync_weights; the cache of it per model
(_LIVE_CACHE, clear_cache) and the cheap checks that its parameters are still where it was made."""
from __future__ import annotations

import itertools
import json
import operator
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple, Sequence

import torch

from mconv.converter import fp8
from mconv.converter.options import check_count, torch_dtype
from mconv.converter.planner import RankPlan, TensorTask
from mconv.converter.hf_experts import stacked_expert
from mconv.converter.transforms import ShardLayout, merge_single
from mconv.errors import MconvError
from mconv.live.chunks import LiveModel, _buckets


def _exported(plan: RankPlan) -> list[tuple[int, TensorTask]]:
    """(chunk, task) of the tensors this rank contributes to the HF model, in plan order, which is
    the same on every rank of a stage (so peers' collectives line up)."""
    return [(v, t) for v, chunk in enumerate(plan.chunks) for t in chunk if t.shard is not None and t.rule.exported]


@dataclass
class _GroupStep:
    """One bucket's tensors of one parallel group (TP, or ETP then EP for experts), planned once."""

    static: list[tuple[str, torch.Tensor]]  # replicated tensors, and views of one-rank shards: no work per call
    # (local shard, peers' layouts, HF names, HF shapes, whether FP8 export quantizes it before the gather)
    gathered: list[tuple[torch.Tensor, list, tuple, tuple, bool]]
    permuted: list[tuple[torch.Tensor, int, torch.Tensor, list[int], tuple]]  # one-rank shards: see _permutation
    ep_names: list[list[str]] | None = None  # experts: HF names of every EP rank's tensors, in order
    reads: list[torch.Tensor] = field(default_factory=list)  # the model's tensors the step reads


def _permutation(layout, hf_shapes, device) -> tuple[torch.Tensor, list[int]] | None:
    """For a shard that holds whole HF tensors (a group of one rank, e.g. fused QKV at TP1): the
    indices along `layout.dim` that put the shard's pieces in HF order, and each HF tensor's length
    along it. One index_select then rebuilds all the HF tensors of the shard in one copy (`merge`
    makes one strided copy per HF tensor, and its Python costs more than the copies at TP1 on a GPU).
    None if the pieces do not cover each HF tensor exactly once, or the values differ (`offset`)."""
    if layout.offset:
        return None
    index, sizes = [], []
    positions, offset = [], 0
    for p in layout.pieces:
        positions.append((p, offset))
        offset += p.length
    for source, shape in enumerate(hf_shapes):
        covered = 0
        for p, at in sorted(((p, at) for p, at in positions if p.source == source), key=lambda x: x[0].start):
            if p.start != covered:
                return None
            index.extend(range(at, at + p.length))
            covered = p.stop
        if covered != shape[layout.dim]:
            return None
        sizes.append(covered)
    return torch.tensor(index, dtype=torch.long, device=device), sizes


def _stacked_key(item) -> str | None:
    """The stacked HF expert tensor an exported expert module belongs to (None for other tensors)."""
    view = stacked_expert(item[1].hf[0]) if item[1].rule.group == "etp" else None
    return view and view[0]


def _schedule(live: LiveModel, bucket_bytes: int, stacked: bool = False) -> list[list[_GroupStep]]:
    """The buckets of this rank's stage, each a TP step and an expert step; the same structure on
    every rank of the stage, so the collectives of peers line up. `stacked`: all the experts of a
    stacked HF tensor go into one bucket (this rank's local experts of a layer there, its EP peers'
    into the same bucket of theirs)."""
    tasks = _exported(live.plan)
    peers = {"tp": [_exported(live.peer_plan(tp=r)) for r in range(live.layout.tp)],
             "etp": [_exported(live.peer_plan(etp=r)) for r in range(live.layout.etp)]}
    ep_peers = [_exported(live.peer_plan(ep=r)) for r in range(live.layout.ep)]
    index = {id(task): i for i, (_, task) in enumerate(tasks)}
    fp8_weights = (fp8.Quantization(partial(live.arch.fp8, d=live.dims)) if live.arch.fp8 is not None
                   else None)  # what quantize="fp8" picks

    def nbytes(item) -> int:
        v, task = item
        n = sum(torch.Size(s).numel() for s in task.hf_shapes) * live.tensors[v][task.megatron].element_size()
        return n * (live.layout.ep if task.rule.group == "etp" else 1)

    schedule = []
    for bucket in _buckets(tasks, nbytes, bucket_bytes, _stacked_key if stacked else None):
        steps = []
        for group in ("tp", "etp"):
            step = _GroupStep([], [], [])
            members = [(v, t) for v, t in bucket if t.rule.group == group]
            for v, task in members:
                local = live.tensors[v][task.megatron]
                step.reads.append(local)
                layouts = [peer[index[id(task)]][1].shard for peer in peers[group]]
                one_rank = len(layouts) == 1 or task.rule.kind.replicated
                views = merge_single(task.shard, local, task.hf_shapes) if one_rank else None
                storage = local.untyped_storage().data_ptr()
                permutation = _permutation(task.shard, task.hf_shapes, local.device) if one_rank else None
                if views is not None and all(x.untyped_storage().data_ptr() == storage for x in views):
                    step.static += list(zip(task.hf, views))
                elif permutation is not None:
                    step.permuted.append((local, task.shard.dim, *permutation, task.hf))
                else:
                    step.gathered.append((local, layouts, task.hf, task.hf_shapes,
                                          _block_aligned(layouts, task.hf, task.hf_shapes, fp8_weights)))
            if group == "etp":
                step.ep_names = [[n for _, t in members for n in ep_peer[index[id(t)]][1].hf] for ep_peer in ep_peers]
            steps.append(step)
        schedule.append(steps)
    return schedule


_LIVE_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def clear_cache(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Drop what mconv keeps of `model_chunks` between exports and syncs (the LiveModel and its
    bucket schedule, made at the first call and reused while no parameter moves), which holds views
    of the parameters' storages. Call it before freeing or offloading the parameters by replacing
    them (`param.data = param.data.to("cpu")`): otherwise their old storages, GPU memory, stay
    allocated until the next export, sync or save of the model, which plans it anew. An offload in
    place frees the memory anyway (`param.untyped_storage().resize_(0)`, as RL trainers do with
    Megatron's parameter buffers, or torch_memory_saver's). Cheap; the next call plans again
    (seconds for a large model)."""
    chunks = list(model_chunks)
    if chunks:
        _LIVE_CACHE.pop(chunks[0], None)


class _Slots(NamedTuple):
    """Parameters (and buffers an export reads) as four parallel lists: what holds each, its name
    there, the tensor and its address."""

    holders: list[dict]
    names: list[str]
    tensors: list[torch.Tensor]
    addresses: list[int]


class _Planned(NamedTuple):
    """A model's cached plan (_LIVE_CACHE): what it was made for (_cache_key), its slots, LiveModel
    and schedule, the slots each bucket reads, and those a sync checks up front (_prepared_for_sync)."""

    key: tuple
    slots: _Slots
    live: LiveModel
    schedule: list
    per_bucket: list[_Slots]
    up_front: _Slots


def _parameter_slots(model_chunks, read: set[int]) -> _Slots:
    """Where each parameter lives (its module's parameter dict and name), the parameter and its
    storage address, as four lists, to tell cheaply whether the model still holds the same tensors
    in place; with them the buffers at the addresses in `read` (those an export reads, e.g. a
    router's expert_bias)."""
    slots = [(held, name, tensor, tensor.data_ptr()) for chunk in model_chunks for module in chunk.modules()
             for held in (module._parameters, module._buffers) for name, tensor in held.items()
             if tensor is not None and (held is module._parameters or tensor.data_ptr() in read)]
    return _Slots(*map(list, zip(*slots))) if slots else _Slots([], [], [], [])


def _unmoved(slots) -> bool:
    """Whether every slot of _parameter_slots still holds its tensor at its address (mapped over C
    functions: 12.6k parameters in a 30B MoE)."""
    modules, names, params, addresses = slots
    return (all(map(operator.is_, map(dict.get, modules, names), params))
            and list(map(torch.Tensor.data_ptr, params)) == addresses)


def _checked(model_chunks, bucket_bytes: int, dtype) -> tuple[list[torch.nn.Module], torch.dtype | None]:
    """`model_chunks` as a list and `dtype` as a torch dtype (a name such as "bfloat16" taken too).
    MconvError naming the argument for model_chunks that are no list of modules, a bucket_bytes that
    is no positive integer, a dtype mconv does not write (options.torch_dtype)."""
    chunks = None if isinstance(model_chunks, (torch.nn.Module, str, bytes)) else list(model_chunks)
    if not chunks or not all(isinstance(chunk, torch.nn.Module) for chunk in chunks):
        what = ("empty" if chunks == [] else f"a {type(model_chunks).__name__}" if chunks is None
                else "a list of " + ", ".join(sorted({type(chunk).__name__ for chunk in chunks})))
        raise MconvError(f"model_chunks is {what}; pass the list of this rank's megatron-core model chunks ([model] "
                         "without virtual pipeline stages)")
    check_count(bucket_bytes, "bucket_bytes")
    return chunks, torch_dtype(dtype)


def _cache_key(model_chunks, hf_config: dict, bucket_bytes: int, stacked: bool) -> tuple:
    """What a cached LiveModel and schedule were made for (_LIVE_CACHE)."""
    return (tuple(id(c) for c in model_chunks), json.dumps(hf_config, sort_keys=True, default=str), bucket_bytes,
            stacked)


def _prepared(model_chunks, hf_config: dict, bucket_bytes: int, stacked: bool = False) -> tuple[LiveModel, list]:
    """LiveModel and schedule of a model, computed once per model, config, bucket size and expert
    form, and again if any parameter was replaced or its storage moved (a wrapper or optimizer
    replaced `param.data`). The check on a cached schedule walks no module tree, but reads every
    parameter's address: 7-10 ms for the 12.6k parameters of a 30B MoE on an H200's host (a sync
    makes it bucket by bucket instead: _prepared_for_sync)."""
    key = _cache_key(model_chunks, hf_config, bucket_bytes, stacked)
    cached = _LIVE_CACHE.get(model_chunks[0])
    if cached is None or cached.key != key or not _unmoved(cached.slots):
        live = LiveModel.of(model_chunks, hf_config)
        schedule = _schedule(live, bucket_bytes, stacked)
        slots = _parameter_slots(model_chunks, {t.data_ptr() for steps in schedule for step in steps
                                                for t in step.reads})
        cached = _LIVE_CACHE[model_chunks[0]] = _Planned(key, slots, live, schedule, *_bucket_slots(slots, schedule))
    return cached.live, cached.schedule


def _prepared_for_sync(model_chunks, hf_config: dict, bucket_bytes: int) -> tuple[LiveModel, list, Callable]:
    """_prepared for a weight sync, which checks the parameters bucket by bucket as it comes to them
    (checking them all up front took 7-10 ms of a 43 ms sync of a 30B MoE on an H200, while the
    host waited for nothing during the copies): (LiveModel, schedule, unmoved), `unmoved(k)`
    whether every parameter bucket k reads is still the one planned, in place (where not, the caller
    plans anew with _prepared). Up front, every parameter of bucket 0 and one of each other bucket
    are checked: an offload that replaced every `param.data` is planned anew here."""
    key = _cache_key(model_chunks, hf_config, bucket_bytes, False)
    cached = _LIVE_CACHE.get(model_chunks[0])
    if cached is None or cached.key != key or not _unmoved(cached.up_front):
        _prepared(model_chunks, hf_config, bucket_bytes)  # (checks every parameter)
        cached = _LIVE_CACHE[model_chunks[0]]
    per_bucket = cached.per_bucket
    return cached.live, cached.schedule, lambda index: _unmoved(per_bucket[index])


def _bucket_layout(schedule: list[list[_GroupStep]]) -> list[tuple[list[str], list[tuple]]]:
    """What each bucket of `schedule` holds and takes part in: its HF names (its experts' on every EP
    rank) and the dtype and shape of each model tensor it reads (they decide its collectives)."""
    return [([name for step in steps for name in itertools.chain(
        (n for n, _ in step.static), (n for item in step.permuted for n in item[4]),
        (n for item in step.gathered for n in item[2]), itertools.chain.from_iterable(step.ep_names or ()))],
        [(t.dtype, tuple(t.shape)) for step in steps for t in step.reads]) for steps in schedule]


def _bucket_slots(slots: _Slots, schedule: list[list[_GroupStep]]) -> tuple[list[_Slots], _Slots]:
    """The slots each bucket of `schedule` reads (those at the addresses of the tensors its steps
    read), and those a sync checks before any bucket: all of bucket 0's and one of each other
    bucket's (a sample that finds an offload of them all)."""
    at: dict[int, list[int]] = defaultdict(list)
    for i, address in enumerate(slots.addresses):
        at[address].append(i)
    per_bucket = [sorted({i for step in steps for t in step.reads for i in at.get(t.data_ptr(), ())})
                  for steps in schedule]
    subset = lambda rows: _Slots(*([column[i] for i in rows] for column in slots))  # noqa: E731
    up_front = set(per_bucket[0] if per_bucket else ()) | {rows[0] for rows in per_bucket if rows}
    return [subset(rows) for rows in per_bucket], subset(sorted(up_front))


def _block_aligned(layouts: list[ShardLayout], names, shapes, quantization: fp8.Quantization | None) -> bool:
    """Whether every rank's shard can be quantized in place, giving the bytes of the gathered HF
    tensors' quantization: all its HF tensors are quantized, and each piece starts on a block
    boundary and holds whole blocks (the last may end with the HF tensor's edge block), so the
    shard's blocks are the HF tensors' blocks (reference fp8.md 1.6; 192-row shards would not be).
    Part of the cached schedule: it depends on the model's structure only (`quantization` picks
    the architecture's FP8 weights, whatever the scale format)."""
    if quantization is None or not all(quantization.applies(n, s) for n, s in zip(names, shapes)):
        return False
    for layout in layouts:
        if layout.pad or layout.offset:
            return False
        for i, p in enumerate(layout.pieces):
            last = i == len(layout.pieces) - 1 and p.stop == shapes[p.source][layout.dim]
            if p.start % fp8.BLOCK or (p.length % fp8.BLOCK and not last):
                return False
    return True
