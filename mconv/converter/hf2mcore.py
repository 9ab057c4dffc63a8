"""Offline conversion HF -> Megatron (`mconv hf2mcore`): legacy rank files or torch_dist."""
from __future__ import annotations

import functools
import os
import threading
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Callable, Iterator

import torch

from mconv import __version__
from mconv.converter import megatron_io as mio
from mconv.converter import fp8, torch_dist, torch_dist_write, torch_save
from mconv.converter.hf_config import copy_side_files, side_files
from mconv.converter.hf_experts import stacked_expert
from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.hf_write import StagingBuffer
from mconv.converter.hub import resolve_model
from mconv.converter.layout import Layout
from mconv.converter.options import FORMATS, MAX_ITERATION, MAX_WORKERS, check_count, dtype_name, option, torch_dtype
from mconv.converter.output import check_output_path, output_path, staged_directory
from mconv.converter.parallel import TorchrunTeam, run_ordered, share
from mconv.converter.pipelines import MTP_PREFIX, _bar, _run_team, refuse_megatron
from mconv.converter.planner import Plan, TensorTask, make_plan
from mconv.converter.summary import Summary, describe_files
from mconv.converter.summary import nbytes as _nbytes
from mconv.converter.transforms import Piece, ShardLayout, cast_dtype, checked_cast, fp32_note, split
from mconv.errors import MconvError
from mconv.mappings import architecture_for


COMPARE_BYTES = 64 * 2**20  # rows of the tied head compared at a time


def _tied_copy(plan: Plan, name: str) -> str | None:
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
        embedding = _tied_copy(plan, name)
        if embedding is None:
            raise MconvError(f"{ckpt.dir / info.file}: unexpected tensor {name} "
                             f"(not part of {plan.arch.name} as described by config.json)")
        if not _equal_bits(ckpt, name, embedding):
            raise MconvError(f"{ckpt.dir / info.file}: tensor {name} differs from {embedding}, but config.json sets "
                             "tie_word_embeddings, so the output layer is the embedding")
        notes.append(f"{name} equals {embedding} bit for bit (tied embeddings): not converted")
    return [f"left out {prefix}* ({dropped[prefix]})" for prefix in held] + notes


WINDOW_BYTES = 32 * 2**20  # bytes of a Megatron tensor built and written at a time (per thread)


def _shard_dtype(task: TensorTask, ckpt: HFCheckpoint, cast: torch.dtype | None = None) -> torch.dtype:
    """The dtype of a Megatron shard: `cast` (hf2mcore --dtype; float32 for a tensor the model keeps
    in float32, see transforms.cast_dtype), else that of its HF tensors, which must agree (no silent cast)."""
    if cast is not None:
        return cast_dtype(cast, task.rule.fp32)
    dtypes = {ckpt.tensors[name].dtype for name in task.hf}
    if len(dtypes) > 1:
        found = ", ".join(f"{name} {dtype_name(ckpt.tensors[name].dtype)}" for name in task.hf)
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


def _expert_forms(ckpt: HFCheckpoint, plan: Plan) -> dict[str, str]:
    """mconv.json's record of how the input held its routed experts, stacked or per expert, for
    mcore2hf to write them alike: the decoder layers' (`hf_experts`) and, converted with --mtp, the MTP
    layers' (`hf_mtp_experts`: Qwen3.5 keeps them per expert, Qwen3.6 stacked)."""
    def form(mtp: bool) -> str:
        return "stacked" if any(name.startswith(MTP_PREFIX) == mtp for name in ckpt.stacked) else "per_expert"
    return {"hf_experts": form(False), **({"hf_mtp_experts": form(True)} if plan.dims.mtp_layers else {})}


def hf2mcore(hf_dir: str | Path, out_dir: str | Path, layout: Layout, spec: str = "local", fmt: str = "torch_dist",
             iteration: int | None = None, overwrite: bool = False, dry_run: bool = False,
             progress: bool = True, workers: int = 1, revision: str | None = None, mtp: bool = False,
             dtype: torch.dtype | None = None, torchrun: bool = False) -> Summary:
    """HF -> Megatron. `hf_dir` is a local directory or a hub name (`Qwen/Qwen3-8B`, at `revision`;
    see `hub.resolve_model`). `workers` threads read the tensors of the rank files (legacy format)
    or write their own `.distcp` files (torch_dist). With `torchrun` (the command line's, run by
    `torchrun -m mconv.cli`), every rank of the torchrun job this process belongs to writes its share
    (its rank files, or its own `.distcp` file; rank 0 writes `.metadata`), and every rank must call
    it; without, this process converts alone, torchrun or not (a trainer's rank 0, say). `mtp`: keep the
    multi-token-prediction layers in megatron-core's MTP block (planner.model_dims). `dtype`: cast
    every tensor to it (torch's cast; float32, bfloat16 or float16) but those the model keeps in
    float32 (transforms.cast_dtype; counted in the summary's notes), recorded in the args as
    Megatron-LM records its --bf16/--fp16 (`params_dtype`, `bf16`, `fp16`) and in mconv.json; by
    default each tensor keeps its HF dtype (MconvError where the tensors of one shard differ).
    `dtype` may be named as --dtype names it ("bfloat16"); `iteration` is 0 to options.MAX_ITERATION."""
    if not isinstance(layout, Layout):
        raise MconvError(f"{option('layout', layout)} is not a Layout (mconv.converter.layout.Layout(tp=2, ...))")
    dtype, workers = torch_dtype(dtype), check_count(workers, "workers", high=MAX_WORKERS)
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
    with HFCheckpoint(hf_dir, dequantize=dtype or torch.bfloat16) as ckpt:
        arch = architecture_for(ckpt.config, ckpt.dir / "config.json")
        plan = make_plan(arch, ckpt.config, layout, spec, mtp)
        notes = check_hf_tensors(plan, ckpt)
        if plan.padded_vocab > 2 * plan.dims.vocab:  # asked for, but rarely meant: say what it costs
            notes.append(f"--vocab-divisor {layout.vocab_divisor} (times TP {layout.tp}) pads the "
                         f"{plan.dims.vocab}-token vocabulary to {plan.padded_vocab} rows, more than twice its size: "
                         f"{plan.padded_vocab - plan.dims.vocab} zero rows in each vocabulary-sized tensor")
        side_files(ckpt.dir)  # a bad tokenizer file stops the command now, not after the weights
        if ckpt.block is not None:
            notes.append(fp8.dequantized_note(ckpt.dir, ckpt.block, dtype or torch.bfloat16))
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
                torch_dist_write.write_share(iter_dir, dist_entries(), index, size, report)

        def finish(_, staging: Path, dist_members: int = 0) -> None:
            if dist_members:  # torchrun: one .metadata for all ranks' files
                torch_dist_write.finish(staging / mio.iteration_dir_name(iteration), dist_entries(), dist_members,
                                        common, str(out / mio.iteration_dir_name(iteration)))
            mio.write_tracker(staging, iteration)
            (staging / mio.HF_CONFIG_DIR).mkdir()
            copy_side_files(ckpt.dir, staging / mio.HF_CONFIG_DIR)
            mio.write_metadata(staging, {"mconv_version": __version__, "architecture": arch.name, "spec": spec,
                                         "format": fmt, "layout": layout.to_dict(),
                                         "dtype": dtype_name(dtype),
                                         **(_expert_forms(ckpt, plan) if arch.experts_as_input else {})})

        out = output_path(out_dir)
        team = TorchrunTeam.from_environment(f"hf2mcore:{out}") if torchrun else None
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
                    torch_dist_write.write(staging / mio.iteration_dir_name(iteration), dist_entries(), workers, common,
                                        bar.update, checkpoint_id=str(out / mio.iteration_dir_name(iteration)))
                else:
                    write_share(staging, 0, 1, bar.update)
            finish(None, staging)
        return summary
