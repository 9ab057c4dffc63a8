"""Offline conversion Megatron -> HF (`mconv mcore2hf`): sharded safetensors from either format."""
from __future__ import annotations

import functools
import threading
from contextlib import closing
from pathlib import Path
from typing import Callable, Iterator

import torch

from mconv.converter import fp8
from mconv.converter.hf_config import side_files
from mconv.converter.hf_experts import expert_orientation_for, fp8_per_expert, stacked_expert
from mconv.converter.hf_write import ShardedSafetensorsWriter, StagingBuffer
from mconv.converter.hub import check_revision, resolve_model
from mconv.converter.megatron_checkpoint import open_checkpoint
from mconv.converter.options import (DEFAULT_SHARD_BYTES, MAX_WORKERS, check_count, check_path, dtype_name,
                                     shard_bytes, torch_dtype)
from mconv.converter.output import check_output_path, output_path, staged_directory
from mconv.converter.parallel import TorchrunTeam, run_ordered, share
from mconv.converter.pipelines import _bar, _kept_per_expert, _run_team
from mconv.converter.planner import ExportTask, ShardSource
from mconv.converter.summary import Summary
from mconv.converter.summary import nbytes as _nbytes
from mconv.converter.transforms import cast_dtype, check_cast, fp32_note, merge
from mconv.errors import MconvError


LOAD_BATCH_BYTES = 32 * 2**20  # Megatron tensors loaded together when exporting (bounds memory)


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
                   threads: int = 1, quantization: fp8.Quantization | None = None, where: Path | None = None) -> None:
    """Write member `index`'s share of the HF tensors into the prepared shard files (a group of HF
    tensors cast to `cast(names)` unless None; the weights `quantization` picks quantized from the
    merged HF tensor, in the shards' dtype, with their scales; MconvError naming the checkpoint `where`
    and the tensor where one holds inf or NaN), a batch of LOAD_BATCH_BYTES per job,
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

    def quantized(name: str, shape) -> bool:  # here (the writer quantizes stacked experts: writer.quantizes)
        return quantization is not None and quantization.applies(name, shape) and not writer.quantizes(name)

    def quantize_rows(task: ExportTask) -> int | None:
        """A group larger than a batch whose weights are all quantized: each weight read (pread) and
        quantized a window of whole fp8.BLOCK-row blocks (about LOAD_BATCH_BYTES in the shards' dtype;
        each block lies in one window, so the bytes are the whole weight's) at a time, straight into
        the staged output, its scales (one per 128x128 block) written whole at the end. None if it
        cannot be: a group within a batch, shards of several dtypes (`merge` refuses them), pieces
        that are neither rows of a shard (`_row_parts`) nor the columns of one HF tensor."""
        dtype, names = session.dtype_of(task.sources[0]), list(zip(task.hf, task.hf_shapes))
        columns = len(names) == 1 and all(s.shard.dim == 1 and not s.shard.pad and not s.shard.offset
                                          for s in task.sources)
        if (sum(_nbytes(shape, dtype) for _, shape in names) <= LOAD_BATCH_BYTES
                or any(session.dtype_of(s) != dtype for s in task.sources)
                or not all(quantized(name, shape) and writer.place(name) for name, shape in names)
                or not columns and _row_parts(task, {name: torch.empty((1, 1), dtype=dtype) for name, _ in names},
                                              session.dtype_of) is None):
            return None
        for name, shape in names:
            scale = torch.empty(fp8.grid(shape), dtype=torch.float32)
            step = fp8.BLOCK * max(1, LOAD_BATCH_BYTES // (fp8.BLOCK * _nbytes(shape[1:], dtype)))
            for first in range(0, shape[0], step):
                window = torch.empty((min(step, shape[0] - first), shape[1]), dtype=dtype)
                if columns:  # the same rows of every shard, merged along the columns
                    shards = [torch.empty((len(window), s.shard.shape(task.hf_shapes)[1]), dtype=dtype)
                              for s in task.sources]
                    session.load_rows([(s, first, shard) for s, shard in zip(task.sources, shards)])
                    merge([s.shard for s in task.sources], shards, [window.shape], [window])
                else:
                    session.load_rows(_row_parts(task, {name: window}, session.dtype_of, first))
                staged = writer.stage([(name, fp8.FP8, tuple(window.shape))], local.buffer, first)
                blocks = scale[first // fp8.BLOCK:first // fp8.BLOCK + fp8.grid(window.shape)[0]]
                fp8.quantize(window, quantization.scale_fmt, f"{where}: tensor {name}", out=(staged.views[name], blocks))
                staged.flush()
            writer.write(fp8.scale_name(name), scale)
        return sum(_nbytes(shape, fp8.FP8) + _nbytes(fp8.grid(shape), torch.float32) for _, shape in names)

    def write_batch(batch: list[ExportTask]) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = StagingBuffer()
        if len(batch) == 1 and quantization is not None:
            written = quantize_rows(batch[0])
            if written is not None:
                return written
        outputs, stacked = [], []  # stacked: experts' modules the writer quantizes, given in the shards' dtype
        for task in batch:
            exact = session.dtype_of(task.sources[0])
            for name, shape in zip(task.hf, task.hf_shapes):
                if writer.quantizes(name):
                    stacked.append((name, exact, shape))
                else:
                    outputs.append((name, cast(task.hf) or exact, shape))
        if quantization is not None:
            outputs = fp8.quantized_entries(outputs, quantization)[0] + stacked
        if (len(batch) == 1 and sum(_nbytes(s, d) for _, d, s in outputs) > local.buffer.keep
                and not any(map(quantized, batch[0].hf, batch[0].hf_shapes))):
            written = write_rows(batch[0], outputs[0][1])
            if written is not None:
                return written
        staged = writer.stage(outputs, local.buffer)
        views = staged.views
        # A weight to quantize is built exact (the shards' dtype) beside the staged memory, read
        # (pread) like the others rather than through a memory-mapped rank file, which would stay
        # resident: the batch's HF tensors, not the checkpoint.
        targets = {name: torch.empty(shape, dtype=session.dtype_of(task.sources[0])) if quantized(name, shape)
                   else views[name] for task in batch for name, shape in zip(task.hf, task.hf_shapes)}
        parts, merged = [], []
        for task in batch:
            rows = _row_parts(task, {name: targets[name] for name in task.hf}, session.dtype_of)
            parts.extend(rows or [])
            if rows is None:
                merged.append(task)
        fill(staged, parts)
        shards = iter(session.load([source for task in merged for source in task.sources]) if merged else [])
        for task in merged:
            task_shards = [next(shards) for _ in task.sources]
            if len({shard.dtype for shard in task_shards}) > 1:
                dtypes = ", ".join(dtype_name(t.dtype) for t in task_shards)
                raise MconvError(f"the TP/ETP shards of {task.sources[0].megatron} have different dtypes "
                                 f"({dtypes}, by group rank); mconv does not cast silently")
            written_exact = quantization is not None and any(map(quantization.applies, task.hf, task.hf_shapes))
            if cast(task.hf) is not None and not written_exact:
                check_cast([(", ".join(task.hf), shard) for shard in task_shards], cast(task.hf))  # as hf2mcore names it
            merge([s.shard for s in task.sources], task_shards, task.hf_shapes, [targets[name] for name in task.hf])
        for name, exact in targets.items():
            if exact is not views[name]:
                fp8.quantize(exact, quantization.scale_fmt, f"{where}: tensor {name}", out=(views[name], views[fp8.scale_name(name)]))
        staged.flush()
        return sum(views[name].numel() if writer.quantizes(name) else views[name].nbytes for name, _, _ in outputs)

    # closing: on an error or an interrupt, the writers stop before the output is cleaned up
    with closing(run_ordered((functools.partial(write_batch, b) for b in _batches(mine, LOAD_BATCH_BYTES)),
                             threads)) as writes:
        for written in writes:
            progress(written)


def mcore2hf(ckpt_dir: str | Path, out_dir: str | Path, hf_config: str | Path | None = None,
             max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, progress: bool = True,
             workers: int = 1, dtype: torch.dtype | None = None, revision: str | None = None,
             expert_orientation: str | None = None, quantize: str | None = None,
             fp8_scale: str | None = None, torchrun: bool = False) -> Summary:
    """Megatron -> HF. `workers` threads write disjoint tensors of the shards. With `torchrun` (the
    command line's, run by `torchrun -m mconv.cli`), every rank of the torchrun job this process
    belongs to writes its share (with `workers` threads), rank 0 prepares and finishes the output,
    and every rank must call it; without, this process converts alone, torchrun or not.

    `hf_config`: a directory or hub name (at `revision`) with the model's config.json, for
    checkpoints mconv did not write. `dtype`: cast every tensor to it (float32, bfloat16 or float16)
    but those the model keeps in float32 (transforms.cast_dtype; a summary note counts them); by
    default each tensor keeps its dtype. config.json's `dtype` (`torch_dtype`) names the dtype
    written (the one holding most bytes, if mixed). `expert_orientation` ("4.x" or "5.x") of stacked
    HF experts (Qwen3-VL-MoE): see hf_experts.expert_orientation_for (4.x by default, required where a
    stacked tensor is square, MconvError for a model whose HF checkpoints keep experts per expert).
    Qwen3.5-MoE's are written "5.x" (the only one transformers loads), or per expert where hf2mcore's
    input had them so and no `expert_orientation` is given; in FP8 without `expert_orientation` always
    per expert, as Qwen's FP8 releases hold them (hf_experts.fp8_per_expert).
    `dtype` may be named as --dtype names it ("bfloat16"); `max_shard_bytes` may be a size string ("1GB").
    `quantize="fp8"`: write block-wise FP8 as the model's FP8 releases hold it (the architecture's
    `fp8` weights, quantized by fp8.quantize from the merged HF tensor, so the bytes do not depend
    on the layout; the rest in `dtype` or as stored; config.json's quantization_config); `fp8_scale`
    "ue8m0" for power-of-two scales (fp8.writer_quantization says what is refused). Without it, an
    FP8 source's quantization_config is dropped from config.json."""
    dtype, max_shard_bytes = torch_dtype(dtype), shard_bytes(max_shard_bytes)
    workers = check_count(workers, "workers", high=MAX_WORKERS)
    check_path(ckpt_dir, "ckpt_dir")
    check_revision(revision, hf_config)
    if hf_config:
        hf_config = resolve_model(hf_config, revision, weights=False, progress=progress, parameter="hf_config")
    ckpt = open_checkpoint(ckpt_dir, hf_config)
    side_files(ckpt.config_dir)  # a bad tokenizer file stops the command now, not after the weights
    arch = ckpt.plan.arch
    quantization = fp8.writer_quantization(arch, quantize, fp8_scale, ckpt.config)
    exports = ckpt.plan.exports()
    per_expert, stack, fp8_experts = None, None, fp8_per_expert(arch, quantization, expert_orientation)
    if not fp8_experts:
        stack = expert_orientation_for(arch, ckpt.plan.dims, expert_orientation)
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
        planned = ShardedSafetensorsWriter(out, plain, max_shard_bytes, stack, per_expert, quantization)
        entries = planned.entries  # (the files are laid out in `prepare`)
        summary = Summary(ckpt.plan, tensors=len(entries), bytes=sum(_nbytes(s, d) for _, d, s in entries),
                          layout="torch_dist (any layout)" if ckpt.location.format == "torch_dist" else None)
        unstacked = fp8_experts and any(
            stacked_expert(name) and not _kept_per_expert(ckpt.metadata, name) for name, _, _ in plain)
        summary.notes += filter(None, [fp32_note(arch, [name for name, _, _ in entries], dtype),
                                       fp8.block_note(ckpt.config, quantization), unstacked and (
            "the FP8 experts are written per expert, as Qwen's FP8 releases hold them, though hf2mcore's input "
            "stacked them; --expert-orientation 5.x stacks them (vLLM reads those, transformers 5.17 loads "
            "them unscaled)")])

        def prepare(staging: Path) -> ShardedSafetensorsWriter:
            writer = ShardedSafetensorsWriter(staging, plain, max_shard_bytes, stack, per_expert, quantization)
            writer.create().close()
            summary.files = len(writer.files)
            return writer

        def finish(writer: ShardedSafetensorsWriter, staging: Path) -> None:
            writer.finish(ckpt.config_dir, arch.hf_config(ckpt.config, ckpt.plan.dims), ckpt.config)

        def write_here(staging: Path, index: int, size: int, report: Callable[[int], None]) -> None:
            with ShardedSafetensorsWriter(staging, plain, max_shard_bytes, stack, per_expert,
                                          quantization).open_existing() as writer:
                _write_exports(session, exports, index, size, writer, report, cast, workers, quantization,
                               ckpt.location.save_dir)

        team = TorchrunTeam.from_environment(f"mcore2hf:{out}") if torchrun else None
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
