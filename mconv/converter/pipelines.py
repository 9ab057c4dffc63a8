"""Offline conversions: HF -> Megatron, Megatron -> HF, and inspection."""
from __future__ import annotations

import functools
import json
import os
import threading
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from mconv import __version__
from mconv.converter import megatron_io as mio
from mconv.converter import fp8, torch_dist, torch_dist_io, torch_save
from mconv.converter.adapter_dir import compare_adapters, is_adapter
from mconv.converter.hf_io import (HFCheckpoint, copy_side_files, expert_orientation_for, stacked_expert,
                                   tensor_difference, write_config_dtype, write_hf_config)
from mconv.converter.hf_write import ShardedSafetensorsWriter, StagingBuffer
from mconv.converter.hub import check_revision, resolve_model
from mconv.converter.layout import Layout
from mconv.converter.megatron_checkpoint import open_checkpoint
from mconv.converter.output import SharedStaging, check_output_path, output_path, staged_directory, write_errors
from mconv.converter.options import (DEFAULT_SHARD_BYTES, FORMATS, MAX_ITERATION, check_count, option, shard_bytes,
                                    torch_dtype)
from mconv.converter.parallel import TorchrunTeam, run_ordered, share
from mconv.converter.planner import ExportTask, Plan, ShardSource, TensorTask, make_plan
from mconv.converter.summary import Summary, describe_files
from mconv.converter.summary import nbytes as _nbytes
from mconv.converter.transforms import (Piece, ShardLayout, cast_dtype, check_cast, checked_cast, fp32_note, merge,
                                        split)
from mconv.errors import MconvError
from mconv.mappings import architecture_for

LOAD_BATCH_BYTES = 32 * 2**20  # Megatron tensors loaded together when exporting (bounds memory)


def _bar(total: int, description: str, progress: bool) -> tqdm:
    """A bytes progress bar on stderr, shown only when `progress` and stderr is a terminal (tqdm's
    disable=None: a bar written to a log file leaves carriage-return fragments in it). Decimal
    units: tqdm names its prefixes k, M, G whatever the divisor, so 1000 makes `MB` mean MB."""
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1000,
                disable=None if progress else True, leave=False)


COMPARE_BYTES = 64 * 2**20  # rows of the tied head compared at a time


def _tied_copy(plan: Plan, ckpt: HFCheckpoint, name: str) -> str | None:
    """For a model with tied embeddings, the embedding tensor whose copy `name` is if the table's
    untied output layer reads `name` (transformers loads such files and ties the head anyway);
    None otherwise."""
    heads = {hf for rule in plan.arch.rules if rule.megatron == "output_layer.weight" and rule.exported
             for hf in rule.hf}
    embeddings = [hf for rule in plan.arch.rules if rule.megatron == "embedding.word_embeddings.weight" for hf in rule.hf]
    return embeddings[0] if plan.dims.tied and name in heads and embeddings else None


def _equal_bits(ckpt: HFCheckpoint, a: str, b: str) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes, compared a block of rows at a time."""
    x, y = ckpt.tensors[a], ckpt.tensors[b]
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    rows = x.shape[0] if x.shape else 1
    step = max(1, COMPARE_BYTES // max(1, x.nbytes // max(rows, 1)))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if not torch.equal(*(ckpt.read(n, 0, start, stop).reshape(-1).view(torch.uint8) for n in (a, b))):
            return False
    return True


def check_hf_tensors(plan: Plan, ckpt: HFCheckpoint) -> list[str]:
    """Every HF tensor the plan needs is there with its shape, and nothing else is, except the
    tensors the table drops and the copy of the embedding a tied model's files may also hold as
    its output layer (`lm_head.weight`), accepted when equal to the embedding bit for bit and not
    converted. Returns one note per dropped group the checkpoint holds and per such copy; raises
    MconvError naming a missing, mis-shaped, unexpected or differing tensor."""
    expected = plan.hf_shapes()
    dropped = plan.arch.dropped(plan.dims)
    held = [prefix for prefix in dropped if any(name.startswith(prefix) for name in ckpt.tensors)]
    for name, shape in expected.items():
        if name not in ckpt.tensors:
            raise MconvError(f"{ckpt.dir}: tensor {name} is missing from the checkpoint")
        if ckpt.tensors[name].shape != shape:
            raise MconvError(f"{ckpt.dir / ckpt.tensors[name].file}: tensor {name} has shape "
                             f"{list(ckpt.tensors[name].shape)}, but config.json implies {list(shape)}")
        if ckpt.tensors[name].transposed_stride and "4.x" not in plan.arch.expert_orientations:
            stacked = stacked_expert(name)[0]
            raise MconvError(f"{ckpt.dir / ckpt.tensors[name].file}: the stacked experts {stacked} are transposed "
                             f"(transformers 4.x's [E, in, out]), which transformers refuses for {plan.arch.name}: "
                             "store them as [E, out, in]")
    notes = []
    for name, info in ckpt.tensors.items():
        if name in expected or name.startswith(tuple(held)):
            continue
        embedding = _tied_copy(plan, ckpt, name)
        if embedding is None:
            raise MconvError(f"{ckpt.dir / info.file}: unexpected tensor {name} "
                             f"(not part of {plan.arch.name} as described by config.json)")
        if not _equal_bits(ckpt, name, embedding):
            raise MconvError(f"{ckpt.dir / info.file}: tensor {name} differs from {embedding}, but config.json sets "
                             "tie_word_embeddings, so the output layer is the embedding")
        notes.append(f"{name} equals {embedding} bit for bit (tied embeddings): not converted")
    return [f"left out {prefix}* ({dropped[prefix]})" for prefix in held] + notes


def refuse_megatron(path: str | Path, why: str) -> None:
    """Refuse a Megatron checkpoint (save or iteration directory) given where an HF model is expected,
    a common mix-up of the two directions: MconvError `PATH is a Megatron checkpoint; <why>`."""
    path = Path(path)
    if ((path / mio.TRACKER).is_file() or (path / "metadata.json").is_file()
            or any(path.glob(f"mp_rank_*/{mio.RANK_FILE}"))):
        raise MconvError(f"{path} is a Megatron checkpoint; {why}")


WINDOW_BYTES = 32 * 2**20  # bytes of a Megatron tensor built and written at a time (per thread)


def _shard_dtype(task: TensorTask, ckpt: HFCheckpoint, cast: torch.dtype | None = None) -> torch.dtype:
    """The dtype of a Megatron shard: `cast` (hf2mcore --dtype; float32 for a tensor the model keeps
    in float32, see transforms.cast_dtype), else that of its HF tensors, which must agree (no silent cast)."""
    if cast is not None:
        return cast_dtype(cast, task.rule.fp32)
    dtypes = {ckpt.tensors[name].dtype for name in task.hf}
    if len(dtypes) > 1:
        found = ", ".join(f"{name} {str(ckpt.tensors[name].dtype).removeprefix('torch.')}" for name in task.hf)
        raise MconvError(f"{ckpt.dir}: {task.megatron} is made of tensors of different dtypes ({found}); "
                         "mconv does not cast silently")
    return dtypes.pop()


def _shard_windows(task: TensorTask, ckpt: HFCheckpoint, memory: StagingBuffer, rows: tuple[int, int] | None = None,
                   cast: torch.dtype | None = None) -> Iterator[torch.Tensor | torch_save.FileRange]:
    """One Megatron shard (or its rows [start, stop) along dim 0) from the HF slices, as consecutive
    windows of its bytes for `torch_save.fill`: the ranges of the HF files its pieces are (fused
    QKV, GLU fc1, whole tensors), as `torch_save.FileRange`s, else rows read into `memory` about
    WINDOW_BYTES at a time (each valid until the next is asked for: reused memory, no fresh pages,
    never a whole large tensor), the vocabulary padding as zeros. A shard split along another
    dimension (row-parallel at TP > 1), or whose values differ from the HF ones (`ShardLayout.offset`),
    is built whole, in one window. With `cast`, every window is
    torch's cast of the HF rows to that dtype (no file ranges then, but for tensors already in it),
    refused where it turns finite values into inf (transforms.check_cast)."""
    layout, shapes = task.shard, [ckpt.tensors[name].shape for name in task.hf]
    dtype, shape = _shard_dtype(task, ckpt, cast), layout.shape(shapes)
    first = layout.pieces[0]
    start, stop = rows or (0, shape[0] if shape else 1)
    if layout.dim != 0 or layout.offset:
        if (len(layout.pieces) > 1 or layout.pad or first.start or first.stop != shapes[first.source][layout.dim]
                or layout.offset):
            whole = split(layout, lambda s, dim, a, b: ckpt.read(task.hf[s], dim, a, b)).narrow(0, start, stop - start)
            yield checked_cast(", ".join(task.hf), whole, dtype)
            return
        layout = ShardLayout(0, (Piece(first.source, 0, shape[0]),))  # the whole tensor, read by rows
    row = _nbytes(shape[1:], dtype)
    step = max(1, WINDOW_BYTES // max(row, 1))
    offset = 0
    for p in layout.pieces:
        a, b = max(start, offset), min(stop, offset + p.length)
        name = task.hf[p.source]
        source = (ckpt.byte_range(name, p.start + a - offset, p.start + b - offset)
                  if a < b and ckpt.tensors[name].dtype == dtype else None)
        if source is not None:
            yield torch_save.FileRange(*source)
        for lo in range(a, b, step) if source is None else ():
            hi = min(b, lo + step)
            out = memory.take((hi - lo) * row).view(dtype).view((hi - lo, *shape[1:]))
            ckpt.read_into(name, 0, p.start + lo - offset, p.start + hi - offset, out)
            yield out
        offset += p.length
    for lo in range(max(start, offset), stop, step):  # the vocabulary padding
        yield memory.take((min(stop, lo + step) - lo) * row).zero_().view(dtype)


def _window_memory(local: threading.local) -> StagingBuffer:
    """This thread's memory for `_shard_windows` (one StagingBuffer per thread, kept in `local`)."""
    if not hasattr(local, "memory"):
        local.memory = StagingBuffer(WINDOW_BYTES)
    return local.memory


def _rank_archive(plan: Plan, ckpt: HFCheckpoint, i: int, args, iteration: int | None, cast: torch.dtype | None):
    """Rank `i`'s file as torch.save lays it out (torch_save.plan_archive), with the placeholder
    tensor standing for each task's shard."""
    chunks, placeholders = [], []
    for chunk in plan.ranks[i].chunks:
        state = {}
        for task in chunk:
            state[task.megatron] = (None if task.shard is None else
                                    torch.empty(task.shape, dtype=_shard_dtype(task, ckpt, cast)))
            if task.shard is not None:
                placeholders.append((task, state[task.megatron]))
        chunks.append(state)
    return torch_save.plan_archive(mio.rank_state(chunks, args, iteration)), placeholders


def _write_rank_files(plan: Plan, ckpt: HFCheckpoint, index: int, size: int, progress: Callable[[int], None],
                      iter_dir: Path, args, iteration: int | None, threads: int = 1,
                      cast: torch.dtype | None = None) -> None:
    """Write member `index`'s share of the rank files. Each file is laid out by torch.save itself
    (`torch_save.plan_archive`: its pickle, records and directory, the tensors' bytes left out); then
    `threads` threads fill in its tensors, window by window from the HF files (split by tensor, so
    a single rank file gains too), each CRC-32 computed on the way, and the small records are
    written last, with one fsync per file. Memory holds a window per thread, not a rank."""
    costs = [sum(_nbytes(t.shape, torch.float32) for chunk in r.chunks for t in chunk if t.shape) for r in plan.ranks]
    local = threading.local()  # each thread's StagingBuffer
    files = []
    try:
        jobs = []
        for i in share(costs, index, size):
            layout, placeholders = _rank_archive(plan, ckpt, i, args, iteration, cast)
            path = mio.rank_file(iter_dir, plan.layout, plan.ranks[i].rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            files.append((fd, layout))
            os.ftruncate(fd, layout.size)
            jobs += [(fd, layout, task, placeholder) for task, placeholder in placeholders]

        def fill(fd: int, layout, task: TensorTask, placeholder: torch.Tensor) -> int:
            torch_save.fill(fd, 0, layout, layout.record(placeholder),
                            _shard_windows(task, ckpt, _window_memory(local), cast=cast))
            return placeholder.nbytes

        jobs.sort(key=lambda job: -job[3].nbytes)  # largest first: the threads end together
        # closing: on an error or an interrupt, the writers stop before the output is cleaned up
        with closing(run_ordered((functools.partial(fill, *job) for job in jobs), threads)) as fills:
            for written in fills:
                progress(written)
        for fd, layout in files:
            layout.write_runs(fd, 0)
            os.fsync(fd)
    finally:
        for fd, _ in files:
            os.close(fd)


def _flat_plan(plan: Plan) -> Plan:
    """The TP1/PP1/EP1 local-spec plan whose tensors are a torch_dist checkpoint's global ones, with the
    vocabulary padded as the target TP pads it."""
    return make_plan(plan.arch, plan.config, Layout(vocab_divisor=plan.layout.vocab_divisor * plan.layout.tp), "local",
                     bool(plan.dims.mtp_layers))


def _torch_dist_entries(plan: Plan, ckpt: HFCheckpoint, args, common: dict, cast: torch.dtype | None) -> list:
    """What the torch_dist checkpoint holds (torch_dist.plan_boxes), each box built from the HF slices
    when written."""
    flat = _flat_plan(plan)
    dtypes = {task.megatron: _shard_dtype(task, ckpt, cast) for task in flat.ranks[0].chunks[0] if task.shard}
    local = threading.local()  # each writer thread's StagingBuffer

    def windows(task: TensorTask, start: int, stop: int) -> Iterator[torch.Tensor]:
        return _shard_windows(task, ckpt, _window_memory(local), (start, stop), cast)
    return torch_dist.entries(flat, args, common, windows, dtypes)


# HF names of the multi-token-prediction layers kept outside the decoder (Qwen3.5 / Qwen3.6 / Qwen3-Next)
MTP_PREFIX = "mtp."


def _expert_forms(ckpt: HFCheckpoint, plan: Plan) -> dict[str, str]:
    """mconv.json's record of how the input held its routed experts, stacked or per expert, for
    mcore2hf to write them alike: the decoder layers' (`hf_experts`) and, converted with --mtp, the MTP
    layers' (`hf_mtp_experts`: Qwen3.5 keeps them per expert, Qwen3.6 stacked)."""
    def form(mtp: bool) -> str:
        return "stacked" if any(name.startswith(MTP_PREFIX) == mtp for name in ckpt.stacked) else "per_expert"
    return {"hf_experts": form(False), **({"hf_mtp_experts": form(True)} if plan.dims.mtp_layers else {})}


def _kept_per_expert(metadata: dict, name: str) -> bool:
    """Whether the HF experts tensor `name` was per expert in hf2mcore's input (mconv.json, _expert_forms)."""
    key = "hf_mtp_experts" if name.startswith(MTP_PREFIX) else "hf_experts"
    return metadata.get(key) == "per_expert"


def hf2mcore(hf_dir: str | Path, out_dir: str | Path, layout: Layout, spec: str = "local", fmt: str = "torch_dist",
             iteration: int | None = None, overwrite: bool = False, dry_run: bool = False,
             progress: bool = True, workers: int = 1, revision: str | None = None, mtp: bool = False,
             dtype: torch.dtype | None = None) -> Summary:
    """HF -> Megatron. `hf_dir` is a local directory or a hub name (`Qwen/Qwen3-8B`, at `revision`;
    see `hub.resolve_model`). `workers` threads read the tensors of the rank files (legacy format)
    or write their own `.distcp` files (torch_dist); under torchrun every rank writes its share (its
    rank files, or its own `.distcp` file; rank 0 writes `.metadata`). `mtp`: keep the
    multi-token-prediction layers in megatron-core's MTP block (planner.model_dims). `dtype`: cast
    every tensor to it (torch's cast; float32, bfloat16 or float16) but those the model keeps in
    float32 (transforms.cast_dtype; counted in the summary's notes), recorded in the args as
    Megatron-LM records its --bf16/--fp16 (`params_dtype`, `bf16`, `fp16`) and in mconv.json; by
    default each tensor keeps its HF dtype (MconvError where the tensors of one shard differ).
    `dtype` may be named as --dtype names it ("bfloat16"); `iteration` is 0 to options.MAX_ITERATION."""
    if not isinstance(layout, Layout):
        raise MconvError(f"{option('layout', layout)} is not a Layout (mconv.converter.layout.Layout(tp=2, ...))")
    dtype, workers = torch_dtype(dtype), check_count(workers, "workers")
    if iteration is not None:
        check_count(iteration, "iteration", 0, MAX_ITERATION)
    if fmt not in FORMATS:
        raise MconvError(f"{option('fmt')} {fmt!r} is not supported; available: {', '.join(FORMATS)}")
    if fmt == "torch_dist" and spec == "te":
        raise MconvError(f"{option('fmt', 'torch_dist')} is written in megatron-core's local-spec layout; the "
                         "extra _extra_state objects a Transformer Engine model also asks for cannot be derived "
                         f"without Transformer Engine. Use {option('spec', 'local')} (same tensor keys) or "
                         f"{option('fmt', 'torch')}")
    if fmt == "torch":
        layout.check_legacy()
    hf_dir = resolve_model(hf_dir, revision, progress=progress)
    refuse_megatron(hf_dir, "hf2mcore reads HF models (`mconv mcore2hf` converts a checkpoint to one)")
    ckpt = HFCheckpoint(hf_dir, dequantize=dtype or torch.bfloat16)
    arch = architecture_for(ckpt.config, ckpt.dir / "config.json")
    plan = make_plan(arch, ckpt.config, layout, spec, mtp)
    notes = check_hf_tensors(plan, ckpt)
    arch_args = arch.megatron_args(plan.dims)
    if fmt == "torch_dist":
        torch_dist.check_model(plan)
    cast, dtype = dtype, dtype or Counter(info.dtype for info in ckpt.tensors.values()).most_common(1)[0][0]
    notes += filter(None, [fp32_note(arch, plan.hf_shapes(), cast)])

    def dtype_of(task: TensorTask) -> torch.dtype:
        return _shard_dtype(task, ckpt, cast)
    if fmt == "torch_dist":
        summary = describe_files(_flat_plan(plan), dtype_of, lambda r: "global tensors (any layout)", rank=False)
        summary.plan = plan
    else:
        summary = describe_files(plan, dtype_of, lambda r: layout.rank_dir(r.rank))
    summary.notes = notes
    if dry_run:
        check_output_path(out_dir, overwrite, (Path(hf_dir),))
        return summary

    args = mio.megatron_lm_args(layout, plan.dims, arch_args, spec, plan.padded_vocab,
                                dtype, fmt)

    common = {"args": args, "checkpoint_version": mio.CHECKPOINT_VERSION, "iteration": iteration or 0}
    dist_entries = functools.cache(lambda: _torch_dist_entries(plan, ckpt, args, common, cast))

    def write_share(staging: Path, index: int, size: int, report: Callable[[int], None]) -> None:
        iter_dir = staging / mio.iteration_dir_name(iteration)
        if fmt == "torch":
            _write_rank_files(plan, ckpt, index, size, report, iter_dir, args, iteration, workers, cast)
        else:  # a torchrun rank: its own .distcp file
            iter_dir.mkdir(parents=True, exist_ok=True)
            torch_dist_io.write_share(iter_dir, dist_entries(), index, size, report)

    def finish(_, staging: Path, dist_members: int = 0) -> None:
        if dist_members:  # torchrun: one .metadata for all ranks' files
            torch_dist_io.finish(staging / mio.iteration_dir_name(iteration), dist_entries(), dist_members, common,
                                 str(out / mio.iteration_dir_name(iteration)))
        mio.write_tracker(staging, iteration)
        (staging / mio.HF_CONFIG_DIR).mkdir()
        copy_side_files(ckpt.dir, staging / mio.HF_CONFIG_DIR)
        mio.write_metadata(staging, {"mconv_version": __version__, "architecture": arch.name, "spec": spec,
                                     "format": fmt, "layout": layout.to_dict(),
                                     "dtype": str(dtype).removeprefix("torch."),
                                     **(_expert_forms(ckpt, plan) if arch.experts_as_input else {})})

    out = output_path(out_dir)
    team = TorchrunTeam.from_environment(f"hf2mcore:{out}")
    if team is not None:
        check_output_path(out, overwrite, (Path(hf_dir),))
        _run_team(team, out, overwrite, lambda staging: None,
                  lambda _, staging: finish(_, staging, team.size if fmt == "torch_dist" else 0),
                  lambda staging, report: write_share(staging, team.rank, team.size, report),
                  summary.bytes, "hf2mcore", progress)
        return summary
    with staged_directory(out, overwrite, inputs=(Path(hf_dir),)) as staging:
        with _bar(summary.bytes, "hf2mcore", progress) as bar:
            if fmt == "torch_dist":  # threads, each writing its own .distcp file, one .metadata
                torch_dist_io.write(staging / mio.iteration_dir_name(iteration), dist_entries(), workers, common,
                                    bar.update, checkpoint_id=str(out / mio.iteration_dir_name(iteration)))
            else:
                write_share(staging, 0, 1, bar.update)
        finish(None, staging)
    ckpt.close()
    return summary


def _batches(exports: list[ExportTask], budget: int) -> Iterator[list[ExportTask]]:
    """Consecutive export tasks whose HF tensors add up to about `budget` bytes (at least one); a
    task larger than `budget` is a batch of its own (written by windows of rows where it can be)."""
    batch, size = [], 0
    for task in exports:
        nbytes = sum(_nbytes(shape, torch.float32) for shape in task.hf_shapes) // 2
        if batch and nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(task)
        size += nbytes
        if size >= budget:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _by_rows(task: ExportTask, source: ShardSource) -> bool:
    """Whether each of the source shard's pieces is a range of rows of an HF tensor: pieces along dim
    0, or (a group of one shard) one whole HF tensor."""
    layout = source.shard
    if layout.dim == 0:
        return True
    piece = layout.pieces[0]
    return (len(task.sources) == 1 and len(layout.pieces) == 1 and not layout.pad and not piece.start
            and piece.stop == task.hf_shapes[piece.source][layout.dim])


def _row_parts(task: ExportTask, views: dict[str, torch.Tensor], dtype_of, first: int = 0) -> list | None:
    """For an HF tensor group whose pieces are each a range of rows of one shard (any group of one
    shard, as at TP1; column, vocabulary, QKV and GLU pieces of TP shards), the (source, first row,
    destination) reads that build the HF tensors in place (`views`: the HF tensors, or rows from
    `first` on of one of them); None otherwise (pieces along another dimension to merge, a cast,
    shards of another dtype: `merge` and its checks)."""
    if any(not view.dim() or view.dtype != dtype_of(source) or source.shard.offset
           for view in views.values() for source in task.sources):
        return None
    if not all(_by_rows(task, source) for source in task.sources):
        return None
    parts = []
    for source in task.sources:
        offset = 0
        for p in source.shard.pieces:
            dest = views.get(task.hf[p.source])
            start, stop = (p.start, p.stop) if source.shard.dim == 0 else (0, task.hf_shapes[p.source][0])
            if dest is not None:
                lo, hi = max(start, first), min(stop, first + dest.shape[0])
                if lo < hi:
                    parts.append((source, offset + lo - start, dest.narrow(0, lo - first, hi - lo)))
            offset += p.length
    return parts


def _write_exports(session, exports: list[ExportTask], index: int, size: int, writer: ShardedSafetensorsWriter,
                   progress: Callable[[int], None], cast: Callable[[tuple[str, ...]], torch.dtype | None],
                   threads: int = 1, quantization: fp8.Quantization | None = None) -> None:
    """Write member `index`'s share of the HF tensors into the prepared shard files (a group of HF
    tensors cast to `cast(names)` unless None; the weights `quantization` picks quantized from the
    merged HF tensor, in the shards' dtype, with their scales), a batch of LOAD_BATCH_BYTES per job,
    `threads` jobs at a time (tensors go to disjoint, precomputed ranges of the files). `session` is the checkpoint's (megatron_checkpoint.
    Session). Each batch is staged as its range of the output files (`writer.stage`): a piece that
    is rows of one shard (`_row_parts`) and bytes of an input file (`session.file_rows`) is copied
    file to file; other pieces of one shard are read straight into the staged memory
    (`session.load_rows`), the shards of other groups loaded and merged into it; then it is
    written (memory reused from batch to batch)."""
    costs = [sum(_nbytes(s, torch.float32) for s in task.hf_shapes) for task in exports]
    mine = [exports[i] for i in share(costs, index, size)]
    local = threading.local()  # each thread's StagingBuffer

    def fill(staged, parts: list) -> None:
        """Copy each part file to file where it is bytes of an input file; read the others."""
        rest = [part for part in parts
                if (ranges := session.file_rows(*part)) is None or not staged.copy(part[2], ranges)]
        if rest:
            session.load_rows(rest)

    def write_rows(task: ExportTask, out_dtype: torch.dtype) -> int | None:
        """A group larger than the staging buffer, put into the output a window of
        LOAD_BATCH_BYTES of rows at a time (None if it cannot be: see `_row_parts`)."""
        names = list(zip(task.hf, task.hf_shapes))
        if (any(writer.place(name) is None or not shape for name, shape in names)
                or _row_parts(task, {name: torch.empty((1,) * len(shape), dtype=out_dtype) for name, shape in names},
                              session.dtype_of) is None):
            return None
        for name, shape in names:
            row = _nbytes(shape[1:], out_dtype)
            step = max(1, LOAD_BATCH_BYTES // max(row, 1))
            for first in range(0, shape[0], step):
                staged = writer.stage([(name, out_dtype, (min(step, shape[0] - first), *shape[1:]))],
                                      local.buffer, first)
                fill(staged, _row_parts(task, staged.views, session.dtype_of, first))
                staged.flush()
        return sum(_nbytes(shape, out_dtype) for _, shape in names)

    def quantized(name: str, shape) -> bool:
        return quantization is not None and quantization.applies(name, shape)

    def write_batch(batch: list[ExportTask]) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = StagingBuffer()
        outputs = [(name, cast(task.hf) or session.dtype_of(task.sources[0]), shape)
                   for task in batch for name, shape in zip(task.hf, task.hf_shapes)]
        if quantization is not None:
            outputs = fp8.quantized_entries(outputs, quantization)[0]
        if (len(batch) == 1 and sum(_nbytes(s, d) for _, d, s in outputs) > local.buffer.keep
                and not any(map(quantized, batch[0].hf, batch[0].hf_shapes))):
            written = write_rows(batch[0], outputs[0][1])
            if written is not None:
                return written
        staged = writer.stage(outputs, local.buffer)
        views = staged.views
        parts, merged = [], []
        for task in batch:
            rows = _row_parts(task, {name: views[name] for name in task.hf}, session.dtype_of)
            parts.extend(rows or [])
            if rows is None:
                merged.append(task)
        fill(staged, parts)
        shards = iter(session.load([source for task in merged for source in task.sources]) if merged else [])
        for task in merged:
            task_shards = [next(shards) for _ in task.sources]
            if len({shard.dtype for shard in task_shards}) > 1:
                dtypes = ", ".join(str(t.dtype).removeprefix("torch.") for t in task_shards)
                raise MconvError(f"the TP/ETP shards of {task.sources[0].megatron} have different dtypes "
                                 f"({dtypes}, by group rank); mconv does not cast silently")
            exact = [torch.empty(shape, dtype=task_shards[0].dtype) if quantized(name, shape) else views[name]
                     for name, shape in zip(task.hf, task.hf_shapes)]
            if cast(task.hf) is not None and not any(map(quantized, task.hf, task.hf_shapes)):
                check_cast([(", ".join(task.hf), shard) for shard in task_shards], cast(task.hf))  # as hf2mcore names it
            merge([s.shard for s in task.sources], task_shards, task.hf_shapes, exact)
            if quantization is not None:
                for name, tensor in fp8.quantize_tensors(list(zip(task.hf, exact)), quantization):
                    if tensor is not views[name]:
                        views[name].copy_(tensor)
        staged.flush()
        return sum(views[name].nbytes for name, _, _ in outputs)

    # closing: on an error or an interrupt, the writers stop before the output is cleaned up
    with closing(run_ordered((functools.partial(write_batch, b) for b in _batches(mine, LOAD_BATCH_BYTES)),
                             threads)) as writes:
        for written in writes:
            progress(written)


def mcore2hf(ckpt_dir: str | Path, out_dir: str | Path, hf_config: str | Path | None = None,
             max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, progress: bool = True,
             workers: int = 1, dtype: torch.dtype | None = None, revision: str | None = None,
             expert_orientation: str | None = None, quantize: str | None = None,
             fp8_scale: str | None = None) -> Summary:
    """Megatron -> HF. `workers` threads write disjoint tensors of the shards; under torchrun every
    rank writes its share (with `workers` threads) and rank 0 prepares and finishes the output.

    `hf_config`: a directory or hub name (at `revision`) with the model's config.json, for
    checkpoints mconv did not write. `dtype`: cast every tensor to it (float32, bfloat16 or float16)
    but those the model keeps in float32 (transforms.cast_dtype; a summary note counts them); by
    default each tensor keeps its dtype. config.json's `dtype` (`torch_dtype`) names the dtype
    written (the one holding most bytes, if mixed). `expert_orientation` ("4.x" or "5.x") of stacked
    HF experts (Qwen3-VL-MoE): see hf_io.expert_orientation_for (4.x by default, required where a
    stacked tensor is square, MconvError for a model whose HF checkpoints keep experts per expert).
    Qwen3.5-MoE's are written "5.x" (the only one transformers loads), or per expert where hf2mcore's
    input had them so and no `expert_orientation` is given.
    `dtype` may be named as --dtype names it ("bfloat16"); `max_shard_bytes` may be a size string ("1GB").
    `quantize="fp8"`: write block-wise FP8 as the model's FP8 releases hold it (the architecture's
    `fp8` weights, quantized by fp8.quantize from the merged HF tensor, so the bytes do not depend
    on the layout; the rest in `dtype` or as stored; config.json's quantization_config); `fp8_scale`
    "ue8m0" for power-of-two scales (fp8.writer_quantization says what is refused). Without it, an
    FP8 source's quantization_config is dropped from config.json."""
    dtype, workers, max_shard_bytes = torch_dtype(dtype), check_count(workers, "workers"), shard_bytes(max_shard_bytes)
    check_revision(revision, hf_config)
    if hf_config:
        hf_config = resolve_model(hf_config, revision, weights=False, progress=progress, parameter="hf_config")
    ckpt = open_checkpoint(ckpt_dir, hf_config)
    arch = ckpt.plan.arch
    quantization = fp8.writer_quantization(arch, quantize, fp8_scale)
    exports = ckpt.plan.exports()
    stack = expert_orientation_for(arch, ckpt.plan.dims, expert_orientation)
    per_expert = None
    if arch.experts_as_input and expert_orientation is None:  # as hf2mcore's input had them
        per_expert = functools.partial(_kept_per_expert, ckpt.metadata)

    def cast(names: tuple[str, ...]) -> torch.dtype | None:
        return cast_dtype(dtype, any(arch.fp32_kind(name) for name in names))
    inputs = (ckpt.location.save_dir, ckpt.config_dir)
    out = output_path(out_dir)
    check_output_path(out, overwrite, inputs)
    with ckpt.session() as session:
        plain = [(name, cast(task.hf) or session.dtype_of(task.sources[0]), shape)
                 for task in exports for name, shape in zip(task.hf, task.hf_shapes)]
        entries, kept = fp8.quantized_entries(plain, quantization) if quantization else (plain, [])
        summary = Summary(ckpt.plan, tensors=len(entries), bytes=sum(_nbytes(s, d) for _, d, s in entries),
                          layout="torch_dist (any layout)" if ckpt.location.format == "torch_dist" else None)
        summary.notes += filter(None, [fp32_note(arch, [name for name, _, _ in entries], dtype)])

        def prepare(staging: Path) -> ShardedSafetensorsWriter:
            writer = ShardedSafetensorsWriter(staging, entries, max_shard_bytes, stack, per_expert)
            writer.create()
            writer.close()
            summary.files = len(writer.files)
            return writer

        def finish(writer: ShardedSafetensorsWriter, staging: Path) -> None:
            writer.write_index()
            copy_side_files(ckpt.config_dir, staging)
            write_hf_config(staging, fp8.output_config(arch.hf_config(ckpt.config, ckpt.plan.dims), quantization, kept),
                            ckpt.config)
            write_config_dtype(staging, plain)  # the unquantized dtype, as the FP8 releases' config.json has it

        def write_here(staging: Path, index: int, size: int, report: Callable[[int], None]) -> None:
            writer = ShardedSafetensorsWriter(staging, entries, max_shard_bytes, stack, per_expert)
            writer.open_existing()
            _write_exports(session, exports, index, size, writer, report, cast, workers, quantization)
            writer.close()

        team = TorchrunTeam.from_environment(f"mcore2hf:{out}")
        if team is not None:
            _run_team(team, out, overwrite, prepare, finish,
                      lambda staging, report: write_here(staging, team.rank, team.size, report),
                      summary.bytes, "mcore2hf", progress)
            return summary
        with staged_directory(out, overwrite, inputs=inputs) as staging:
            writer = prepare(staging)
            with _bar(summary.bytes, "mcore2hf", progress) as bar:
                write_here(staging, 0, 1, bar.update)
            finish(writer, staging)
    return summary


def _run_team(team: TorchrunTeam, out: Path, overwrite: bool, prepare, finish, write_share, total: int,
              label: str, progress: bool) -> None:
    """The torchrun protocol: rank 0 prepares a staging directory every rank can compute the name
    of; all ranks write their shares; rank 0 finishes and renames it into place."""
    shared = SharedStaging(out, "torchrun", overwrite)
    staging = shared.path
    prepared = {}

    def first():
        if team.rank == 0:
            shared.make()
            prepared["writer"] = prepare(staging)

    def last():
        if team.rank == 0:
            finish(prepared["writer"], staging)
            shared.commit()

    def step(name: str, action) -> None:
        def guarded():  # a failed write (full disk...) stops every rank with one sentence
            with write_errors(out, staging):
                action()
        team.step(name, guarded)

    try:
        step("prepared", first)
        with _bar(total, f"{label} (rank {team.rank})", progress and team.rank == 0) as bar:
            step("written", lambda: write_share(staging, bar.update))
        step("finished", last)
    except BaseException:
        if team.rank == 0:
            shared.remove()
        raise


QUANTIZATION_MEANING = ("quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt")


def compare_hf(a: str | Path, b: str | Path, progress: bool = False) -> tuple[int, int, list[str]]:
    """Compare two HF models (directories or hub names) tensor by tensor (names, dtypes, shapes,
    bytes), one tensor in memory at a time; or two PEFT adapters (adapter_dir.compare_adapters).
    Returns (tensors, bytes, differences). MconvError for a Megatron checkpoint, or an adapter
    compared with a model."""
    for path in (a, b):
        refuse_megatron(path, "verify compares HF models (convert it with `mconv mcore2hf` first)")
    dirs = [resolve_model(x, progress=progress) for x in (a, b)]
    adapters = [is_adapter(d) for d in dirs]
    if all(adapters):
        return compare_adapters(*dirs)
    if any(adapters):
        adapter, model = (a, b) if adapters[0] else (b, a)
        raise MconvError(f"{adapter} is a PEFT adapter and {model} is not; verify compares two models or two adapters")
    left, right = (HFCheckpoint(d) for d in dirs)
    differences = [f"{name}: only in {left.dir}" for name in sorted(left.tensors.keys() - right.tensors.keys())]
    differences += [f"{name}: only in {right.dir}" for name in sorted(right.tensors.keys() - left.tensors.keys())]
    for name in sorted(left.stacked.keys() | right.stacked.keys()):  # the per-expert view hides how they are stored
        shapes = [side.stacked.get(name) for side in (left, right)]
        if shapes[0] != shapes[1]:
            a, b = (f"{list(s)}" if s else "per-expert tensors" for s in shapes)
            differences.append(f"{name}: stored as {a} vs {b} (stacked experts in another orientation or form; "
                               "the experts' values are compared one by one)")
    # FP8 bytes mean what quantization_config says (method, format, block size, scale format): equal
    # bytes under different settings are different weights. Which modules it keeps in 16-bit shows
    # in the tensors themselves.
    settings = [{key: (side.config.get("quantization_config") or {}).get(key) for key in QUANTIZATION_MEANING}
                for side in (left, right)]
    for key in QUANTIZATION_MEANING:
        if settings[0][key] != settings[1][key]:
            differences.append(f"config.json quantization_config.{key}: {json.dumps(settings[0][key])} vs "
                               f"{json.dumps(settings[1][key])}")
    common = sorted(left.tensors.keys() & right.tensors.keys())
    total = 0
    with _bar(sum(left.tensors[n].nbytes for n in common), "verify", progress) as bar:
        for name in common:
            x, y = left.read(name), right.read(name)
            differences += filter(None, [tensor_difference(name, x, y)])
            total += x.nbytes
            bar.update(x.nbytes)
    return len(common), total, differences
