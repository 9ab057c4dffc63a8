"""HF-named tensors out of a live Megatron model at every weight sync (iter_hf_weights, in buckets)
and an HF directory written from it (save_hf_weights): the same tables, planner and transforms as
the offline tools."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from mconv.converter import fp8
from mconv.converter.hf_config import read_config, side_files
from mconv.converter.hf_experts import expert_orientation_for, fp8_per_expert, stack_experts, stacked_expert
from mconv.converter.hf_write import ShardedSafetensorsWriter
from mconv.converter.output import SharedStaging, check_output_path, output_path, write_failure
from mconv.converter.options import DEFAULT_SHARD_BYTES, option, shard_bytes
from mconv.converter.planner import make_plan, model_dims
from mconv.converter.transforms import Piece, ShardLayout, cast_dtype, check_cast, merge
from mconv.errors import MconvError
from mconv.live.chunks import LiveModel, _config, _model_dir
from mconv.live.schedule import _GroupStep, _checked, _prepared
from mconv.mappings import architecture_for

DEFAULT_BUCKET_BYTES = 512 * 2**20
Bucket = list[tuple[str, torch.Tensor]]


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
        raw = (lambda t: t.view(torch.uint8)) if dtype == fp8.FP8 else (lambda t: t)  # gloo has no float8
        dist.all_gather_into_tensor(raw(gathered), raw(flat), group=group)
        for r in range(size):
            offset = r * flat.numel()
            for i in indices:
                out[r][i] = gathered[offset:offset + tensors[i].numel()].view(tensors[i].shape)
                offset += tensors[i].numel()
    return out


def _stack_bucket(entries: Bucket, transposed: bool, experts: int) -> Bucket:
    """The bucket with per-expert modules of stacked experts replaced by their stacked tensors, each
    where its first module was (the schedule put all the experts of a stacked tensor in this bucket)."""
    groups: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    out: list = []
    for name, tensor in entries:
        view = stacked_expert(name)
        if view is None:
            out.append((name, tensor))
            continue
        stacked, expert, part, _ = view
        if stacked not in groups:
            groups[stacked] = {}
            out.append((stacked, None))
        groups[stacked].setdefault(expert, {})[part] = tensor
    for stacked, modules in groups.items():
        if sorted(modules) != list(range(experts)):
            raise MconvError(f"internal: {stacked} has experts {sorted(modules)[:4]}... in its bucket, "
                             f"not all {experts}")
    return [(name, tensor if tensor is not None else stack_experts(
                [[parts[p] for p in sorted(parts)] for _, parts in sorted(groups[name].items())], transposed))
            for name, tensor in out]


def _stage_buckets(live: LiveModel, schedule: list[list[_GroupStep]], dtype: torch.dtype | None,
                   stacked: str | None = None, quantization: fp8.Quantization | None = None,
                   deferred: bool = False) -> Iterator[Bucket]:
    """This rank's stage's buckets (iter_hf_weights'). `deferred`: each bucket comes as (bucket,
    picked, fixed): the weights `quantization` quantizes last left unquantized, and which they are
    (fp8.picked_weights; none without `quantization`), for a caller that quantizes them where it
    wants them (a sync's flat buffer: fp8.quantize_picked gives the bytes iter_hf_weights yields);
    `fixed`, the positions in the bucket of the schedule's own views of parameters (the same
    tensors at every call while the schedule stands, which _prepared keeps only while no
    parameter moved)."""
    from megatron.core import parallel_state as ps

    groups = {"tp": ps.get_tensor_model_parallel_group(), "etp": ps.get_expert_tensor_parallel_group()}
    ep_group = ps.get_expert_model_parallel_group()
    one_ep_rank = dist.get_world_size(ep_group) == 1
    # stacked experts are quantized expert by expert once stacked, each expert's matrix (gate and up
    # together) as stored: not before the gathers, which send per-expert modules
    early = quantization if stacked is None else None
    picks = live.__dict__.setdefault("_fp8_picks", {})  # fp8.quantize_tensors' per bucket, kept with the model's plan
    # (picked list, key for quantize_batch's plans, whether its weights are all at fixed positions) by id(picked list)
    keys = live.__dict__.setdefault("_fp8_keys", {})
    for steps in schedule:
        out: Bucket = []
        fixed: list[int] = []
        done: set[str] = set()  # quantized before a gather: weights and scales
        for group, step in zip(("tp", "etp"), steps):
            if not (step.static or step.gathered or step.permuted):
                continue  # no collectives to line up: every rank of the stage has the same schedule
            rebuilt = list(step.static)
            for local, dim, order, sizes, names in step.permuted:
                rebuilt += zip(names, local.index_select(dim, order).split(sizes, dim))
            if step.gathered:
                rebuilt += _gather_and_merge(step.gathered, groups[group], early, done)
            if group == "tp" or one_ep_rank:  # (one EP rank: its experts are all the experts, quantized below)
                fixed += range(len(out), len(out) + len(step.static))
                out += rebuilt
                continue
            # Experts: every EP rank holds other experts; gather the rebuilt HF tensors over EP, in FP8
            # where they are quantized (whole HF tensors: the bytes are those quantized after the gather).
            order = {name: i for i, (name, _) in enumerate(rebuilt)}
            mine = [rebuilt[order[n]] for name in step.ep_names[live.rank.ep]
                    for n in ((name, fp8.scale_name(name)) if name in done else (name,))]  # (quantized over ETP)
            if early is not None:
                mine = fp8.quantize_tensors(mine, early, frozenset(done), picks)
            for names, tensors in zip(step.ep_names, _all_gather([t for _, t in mine], ep_group)):
                out += zip(names if early is None else _with_scales(names, mine, done), tensors)
        if stacked is not None:
            out, fixed = _stack_bucket(out, stacked == "4.x", live.dims.experts), []
        if dtype is not None:  # but the tensors the model keeps in float32 (transforms.cast_dtype), and
            # the weights to quantize, which are quantized from the model's own values
            casts = {n: None if n in done or (quantization and quantization.applies(n, x.shape))
                     else cast_dtype(dtype, live.arch.fp32_kind(n) is not None) for n, x in out}
            check_cast([(n, x) for n, x in out if casts[n] == dtype], dtype)  # one host synchronisation per bucket
            uncast = out
            out = [(n, x if casts[n] is None else x.to(casts[n])) for n, x in out]
            fixed = [i for i in fixed if out[i][1] is uncast[i][1]]  # (`to` keeps a tensor already in its dtype)
        if quantization is None:
            yield (out, [], fixed) if deferred else out
            continue
        picked = fp8.picked_weights(out, quantization, frozenset(done), picks)
        if deferred or not picked:
            yield (out, picked, fixed) if deferred else out
            continue
        known = keys.get(id(picked))
        if known is None or known[0] is not picked:  # (the entry holds the list: its id is not taken again)
            weights, key = [out[i][1] for i, _ in picked], None
            if weights[0].is_cuda and fp8.batchable(weights):  # (what quantize_all batches: fp8_batch's plans)
                from mconv.converter.fp8_batch import PlanKey

                key = PlanKey()
            fixed_at = set(fixed)
            known = keys[id(picked)] = (picked, key, all(i in fixed_at for i, _ in picked))
        # the schedule's own views of parameters, unmoved since _prepared: the same tensors as the last call's
        yield fp8.with_scales(out, picked, fp8.quantize_all([out[i] for i, _ in picked], quantization.scale_fmt,
                                                            key=known[1], unchanged=known[2]))


def _with_scales(names: list[str], mine: Bucket, done: set[str]) -> list[str]:
    """An EP peer's HF names (`names`, in the order of this rank's) as this rank's quantized tensors
    `mine` lay them out, each FP8 weight followed by its scale (the same on every EP rank: same
    shapes in the same order); those go into `done`."""
    out: list[str] = []
    for name in names:
        if mine[len(out)][1].dtype == fp8.FP8:
            out += [name, fp8.scale_name(name)]
            done.update(out[-2:])
        else:
            out.append(name)
    return out


def _block_layout(layout: ShardLayout) -> ShardLayout:
    """The layout of a shard's FP8 scales, where `layout`'s pieces start on block boundaries."""
    return ShardLayout(layout.dim, tuple(Piece(p.source, p.start // fp8.BLOCK, -(-p.stop // fp8.BLOCK))
                                         for p in layout.pieces))


def _gather_and_merge(gathered: list, group, quantization: fp8.Quantization | None, done: set[str]) -> Bucket:
    """The HF tensors of the shards `gathered` ((local shard, every rank's layout, HF names, HF
    shapes, `_block_aligned`)), gathered over `group` (one collective per dtype) and merged. Where
    `quantization` is given and the shard `_block_aligned`, each rank quantizes its shard first and
    the FP8 shards and their scales are gathered and merged (half the bytes; the names come
    quantized, with their scales, and go into `done`)."""
    early = [quantization is not None and aligned for *_, aligned in gathered]
    picked = [(names[0], local) for (local, _, names, _, _), e in zip(gathered, early) if e]
    quantized = iter(fp8.quantize_all(picked, quantization.scale_fmt) if picked else [])
    sent = [list(next(quantized)) if e else [local] for (local, *_), e in zip(gathered, early)]
    shards = _all_gather([t for tensors in sent for t in tensors], group)
    out, k = [], 0
    for (_, layouts, names, shapes, _), tensors in zip(gathered, sent):
        pieces = [[rank_shards[k + j] for rank_shards in shards] for j in range(len(tensors))]
        k += len(tensors)
        if len(tensors) == 1:
            out += zip(names, merge(layouts, pieces[0], shapes))
            continue
        qs = merge(layouts, [q.view(torch.uint8) for q in pieces[0]], shapes)
        scales = merge([_block_layout(layout) for layout in layouts], pieces[1], [fp8.grid(s) for s in shapes])
        for name, q, scale in zip(names, qs, scales):
            out += [(name, q.view(fp8.FP8)), (fp8.scale_name(name), scale)]
            done.update((name, fp8.scale_name(name)))
    return out


def _orientation(config: dict, value: str | None) -> str | None:
    """hf_experts.expert_orientation_for of the model `config` describes (the same on every rank)."""
    arch = architecture_for(config)
    return expert_orientation_for(arch, model_dims(arch, config), value)


def iter_hf_weights(model_chunks: Sequence[torch.nn.Module], hf_config: str | Path | dict,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
                    gather_pp: bool = False, revision: str | None = None, stacked_experts: bool = False,
                    expert_orientation: str | None = None, quantize: str | None = None,
                    fp8_scale: str | None = None) -> Iterator[Bucket]:
    """Yield buckets of (HF name, tensor) for this rank's pipeline stage (every stage by default
    yields its own layers; with gather_pp every rank yields the whole model, stage by stage).

    Every rank of this rank's TP, ETP and EP groups (and PP group, with gather_pp) must call it: they
    check their arguments and plan first, and agree (a path missing on one is one MconvError on all
    of them; a flag all-reduced over those groups, one host synchronisation), then gather.
    Tensors are gathered over TP/ETP (one collective per bucket and dtype), experts over EP, with
    global layer and expert numbers, fused QKV / GLU split, vocabulary padding removed; they stay
    on the parameters' device. `hf_config` is the HF model directory, a hub name (at `revision`)
    or the config dict. `dtype` casts them (torch's cast) but those the model keeps in float32
    (BailingMoeV3's router `expert_bias`, KDA `A_log` / `dt_bias`: the table's Rule.fp32), which
    come in float32, as the model keeps them; a cast is refused with an MconvError naming the
    tensor where it would turn finite values into inf (transforms.check_cast: one host
    synchronisation per bucket where `dtype`'s range is narrower, e.g. bfloat16 to float16).

    Experts come per expert (`<p>.mlp.experts.{e}.gate_proj.weight` `[I, h]`, ..., as AReaL sends
    them to inference engines). With `stacked_experts` (models whose HF checkpoints stack them:
    Qwen3-VL-MoE, Qwen3.5-MoE; MconvError otherwise) each layer's experts come as the HF
    checkpoint's stacked `<p>.mlp.experts.gate_up_proj` / `down_proj` (no `.weight`), contiguous, in
    `expert_orientation`:
    "4.x" `[E, h, 2I]` / `[E, I, h]` (what mcore2hf writes by default), "5.x" `[E, 2I, h]` /
    `[E, h, I]`; a bucket then holds all the experts of its stacked tensors, whatever `bucket_bytes`.
    Where a stacked tensor is square, `expert_orientation` must be given (MconvError otherwise: no
    orientation is read right by both transformers 4.57 and 5.x, see hf_experts.expert_orientation_for).
    `expert_orientation` without `stacked_experts` is an MconvError (it would change nothing).

    `quantize="fp8"` (`fp8_scale` "ue8m0" for power-of-two scales): each weight the model's FP8
    releases quantize comes as (name, float8_e4m3fn weight) and (name + "_scale_inv", float32 scale)
    in the same bucket, quantized on the tensors' device after the gathers, the bytes `mcore2hf
    --quantize fp8` writes (fp8.quantize; `dtype` then casts the other tensors only). Stacked
    experts come as the stacked float8_e4m3fn tensor and its `_scale_inv` [E, ceil(rows/128),
    ceil(cols/128)], each expert's matrix quantized as it is stacked (in `expert_orientation`);
    transformers 5.17 loads stacked FP8 experts unscaled (docs/fp8.md), so for transformers leave
    `stacked_experts` off (Qwen's FP8 releases of Qwen3.5/3.6-MoE hold their experts per expert).

    The plan is made at the first call and kept, with views of the parameters, until a parameter
    moves (then the next call plans anew): before freeing or offloading parameters by replacing
    `param.data`, call `clear_cache(model_chunks)`, or their old storages stay allocated.
    """
    planned: dict = {}

    def plan() -> None:  # on every rank; what fails here (a path missing on one node) is agreed on below
        config = _config(hf_config, revision)
        arch = architecture_for(config)
        if stacked_experts and not arch.stacked_experts:
            raise MconvError(f"stacked_experts: {arch.name} checkpoints keep their experts per "
                             "expert (stacked mlp.experts.gate_up_proj / down_proj is the HF form of Qwen3-VL-MoE)")
        if expert_orientation is not None and not stacked_experts:
            raise MconvError("expert_orientation applies with stacked_experts=True (experts come per expert otherwise)")
        if not isinstance(gather_pp, bool):
            raise MconvError(f"{option('gather_pp', gather_pp)} is not True or False")
        stacked = _orientation(config, expert_orientation) if stacked_experts else None
        quantization = fp8.writer_quantization(arch, quantize, fp8_scale, config)
        chunks, cast = _checked(model_chunks, bucket_bytes, dtype)  # (after the options: as before the agreement)
        planned.update(stacked=stacked, cast=cast, quantization=quantization,
                       prepared=_prepared(chunks, config, bucket_bytes, stacked_experts))

    _agree_in_groups(_attempt(plan), gather_pp)
    stacked, dtype, quantization = planned["stacked"], planned["cast"], planned["quantization"]
    live, schedule = planned["prepared"]
    if not gather_pp or live.layout.pp == 1:
        yield from _stage_buckets(live, schedule, dtype, stacked, quantization)
        return
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    try:
        mine = list(_stage_buckets(live, schedule, dtype, stacked, quantization))
        layout = [[(n, tuple(x.shape), x.dtype) for n, x in b] for b in mine]
    except MconvError as e:  # (a refused cast) told to the other stages, which would wait for these buckets
        layout = str(e)
    layouts = [None] * live.layout.pp  # (names, shapes, dtypes) of every stage's buckets: one exchange
    dist.all_gather_object(layouts, layout, group=group)
    refused = next((found for found in layouts if isinstance(found, str)), None)
    if refused is not None:
        raise MconvError(refused)
    device = next(iter(live.tensors[0].values())).device
    for stage, stage_buckets in enumerate(layouts):
        source = dist.get_global_rank(group, stage)
        for b, entries in enumerate(stage_buckets):
            tensors = ([x for _, x in mine[b]] if stage == live.rank.pp else
                       [torch.empty(shape, dtype=dt, device=device) for _, shape, dt in entries])
            for dt in dict.fromkeys(t.dtype for t in tensors):  # in order: a set's differs from rank to rank
                members = [t for t in tensors if t.dtype == dt]
                flat = torch.cat([t.reshape(-1) for t in members])
                dist.broadcast(flat.view(torch.uint8) if dt == fp8.FP8 else flat, src=source, group=group)
                offset = 0
                for t in members:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
            yield [(name, t) for (name, _, _), t in zip(entries, tensors)]


def save_hf_weights(model_chunks: Sequence[torch.nn.Module], out_dir: str | Path, hf_config: str | Path,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    revision: str | None = None, expert_orientation: str | None = None,
                    quantize: str | None = None, fp8_scale: str | None = None) -> None:
    """Save the live model as an HF directory, the same files `mconv mcore2hf` writes.

    Rank 0 lays out the shard files (headers are known in advance); one rank per pipeline stage
    (TP, EP and DP rank 0) writes its stage's tensors into them in place; rank 0 then writes the
    index, copies config and tokenizer from `hf_config` (the HF model directory or hub name) and
    renames the finished directory into place (replacing an existing `out_dir` that an mconv command
    could have written; MconvError for any other, for one that another mconv run is writing and for
    one that appears meanwhile: output.Claim); config.json's dtype
    names the dtype written. The output path must be on a filesystem all ranks share. Stacked HF
    experts (Qwen3-VL-MoE, Qwen3.5-MoE) are written in `expert_orientation` (Qwen3-VL-MoE: "4.x", the
    default, or "5.x", as mcore2hf's: required where a stacked tensor is square; Qwen3.5-MoE: "5.x";
    MconvError when given for another model).
    Each tensor is written in the dtype the model holds it in. `quantize="fp8"` / `fp8_scale` write
    block-wise FP8 as `mcore2hf --quantize fp8` does (the same bytes); Qwen3.5-MoE's experts then per
    expert unless `expert_orientation` is given (hf_experts.fp8_per_expert).

    Raises MconvError on every rank when a write fails on any rank (full disk, read-only file
    system, no permission: `cannot write OUT: <cause>; nothing was written`); the hidden staging
    directory `.NAME.mconv-partial-live` is removed and an existing `out_dir` is left as it was.
    `max_shard_bytes` may be a size string ("1GB"); MconvError naming it if it is no positive size.
    """
    from megatron.core import parallel_state as ps

    max_shard_bytes = shard_bytes(max_shard_bytes)
    out = output_path(out_dir)
    planned: dict = {}

    def plan() -> None:  # on every rank; what fails here (a path missing on one node) is agreed on below
        source = _model_dir(hf_config, revision, False)
        check_output_path(out, True, (source,))  # (an mconv output is replaced, never the input)
        config = read_config(source)
        side_files(source)  # a bad tokenizer file stops the save now, not after the weights
        arch = architecture_for(config)
        quantization = fp8.writer_quantization(arch, quantize, fp8_scale, config)
        stacked = (None if fp8_per_expert(arch, quantization, expert_orientation)
                   else _orientation(config, expert_orientation))
        chunks, _ = _checked(model_chunks, bucket_bytes, None)
        planned.update(source=source, config=config, quantization=quantization, stacked=stacked,
                       prepared=_prepared(chunks, config, bucket_bytes, stacked is not None))

    failure = _attempt(plan)
    if dist.is_initialized():
        _agree(out, None, failure)
    elif failure is not None:  # no ranks to tell (the arguments are checked before the process group is needed)
        raise failure
    source, config, quantization, stacked = (planned[k] for k in ("source", "config", "quantization", "stacked"))
    live, schedule = planned["prepared"]
    full = make_plan(live.arch, config, live.layout, live.spec, mtp=bool(live.dims.mtp_layers))
    dtypes: dict[str, torch.dtype] = {}
    local = {name: tensor.dtype for tasks, tensors in zip(live.plan.chunks, live.tensors)
             for task in tasks if task.shard is not None for name in task.hf
             for tensor in [tensors[task.megatron]]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    for part in gathered:
        dtypes.update(part)
    plain = [(name, dtypes[name], shape) for task in full.exports() for name, shape in zip(task.hf, task.hf_shapes)]

    shared = SharedStaging(out, "live", overwrite=True)
    staging = shared.path
    writer = ShardedSafetensorsWriter(staging, plain, max_shard_bytes, stacked, quantization=quantization)
    first = dist.get_rank() == 0
    try:
        def prepare():
            shared.make()
            writer.create()
            writer.close()

        _agree(out, staging, _attempt(prepare) if first else None)
        writes = (live.rank.tp == 0 and live.rank.ep == 0 and live.rank.etp == 0
                  and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
        failure = _attempt(writer.open_existing) if writes else None
        # every rank takes part in every bucket's collectives; stacked experts come stacked (and quantized)
        for bucket in _stage_buckets(live, schedule, None, stacked, quantization):
            if writes and failure is None:
                failure = _attempt(lambda: [writer.write(name, tensor.cpu()) for name, tensor in bucket])
        if writes:
            closed = _attempt(writer.close)
            failure = failure or closed
        _agree(out, staging, failure)

        def finish():
            writer.finish(source, live.arch.hf_config(config, live.dims), config)
            shared.commit()

        _agree(out, staging, _attempt(finish) if first else None)
    except BaseException:
        writer.abandon()  # (closed already, but where an error cut the writing short)
        if first:
            shared.remove()
        raise


def _attempt(action) -> Exception | None:
    """Run `action`; return what it raised (None if nothing), for the ranks to agree on (`_agree` here,
    sync.core's collectives)."""
    try:
        action()
    except (Exception, SystemExit) as e:  # an engine calling sys.exit fails the sync, as it does on every rank
        return e
    return None


def _agree_in_groups(failure: Exception | None, gather_pp: bool) -> None:
    """Every rank an export's collectives reach learns whether one failed before them, and if one
    did, every such rank raises (the first failing rank's MconvError; another exception as it is on
    its rank): only the groups the export uses take part (TP, ETP, EP, and PP with `gather_pp`), so
    ranks that do not export (other data-parallel replicas of a dense model) need not call. A flag
    is all-reduced over each group of more than one rank, the sequence twice (what one group learns
    reaches the others'), then read on the host (one synchronisation); the messages are gathered
    the same way only where a rank failed. Without parallel_state, `failure` is raised as it is."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        groups = []
    else:
        groups = [ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
                  ps.get_expert_model_parallel_group()] + ([ps.get_pipeline_model_parallel_group()] if gather_pp else [])
        groups = [g for g in groups if dist.get_world_size(g) > 1] * 2
    if groups:
        flag = torch.tensor([failure is not None], dtype=torch.int32, device=_collective_device())
        for group in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            said = None if failure is None else str(failure) if isinstance(failure, MconvError) else (
                f"rank {dist.get_rank()}: {type(failure).__name__}: {failure}")
            for group in groups:
                heard: list = [None] * dist.get_world_size(group)
                dist.all_gather_object(heard, said, group=group)
                said = said or next((m for m in heard if m is not None), None)
            if failure is None:
                raise MconvError(said or "a rank this one exports with failed before the export (its error says why)")
    if failure is not None:
        raise failure


def _collective_device() -> torch.device:
    """Where the agreement tensors live: the CPU with gloo, the current GPU with NCCL alone (which
    has no CPU tensors)."""
    if "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _agree(out: Path, staging: Path | None, failure: Exception | None) -> None:
    """A collective: every rank learns whether any rank's step failed, and if one did, every rank
    raises. A failed write (full disk, read-only file system, no permission: output.write_failure)
    or an MconvError becomes one MconvError sentence naming `out` on every rank; any other exception
    (a bug) is re-raised as it is on its rank and named on the others. The caller removes the
    staging directory."""
    known = failure if isinstance(failure, MconvError) or failure is None else write_failure(failure, out, staging)
    mine = None if failure is None else str(known or f"rank {dist.get_rank()}: {type(failure).__name__}: {failure}")
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    first = next((m for m in messages if m is not None), None)
    if failure is not None and known is None:
        raise failure
    if first is not None:
        raise MconvError(first)
