"""What a conversion did (or, for a dry run, would do): counts, readable lines and the plan for scripts."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from mconv.converter.layout import count
from mconv.converter.options import dtype_name
from mconv.converter.planner import Plan, RankPlan, TensorTask, group_rank, group_size


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype`."""
    return math.prod(shape) * dtype.itemsize


@dataclass(repr=False)
class Summary:
    """What a conversion did (or, for a dry run, would do). `lines`: one readable line per output
    file; `files_plan`: the same as data (`describe_files`), for `--dry-run --json`."""

    plan: Plan
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the user must know (HF tensors left out)
    files_plan: list[dict] = field(default_factory=list)
    # The layout as shown, where the plan's is not the checkpoint's (mcore2hf reads a torch_dist
    # checkpoint through a TP1 PP1 plan of its global tensors).
    layout: str | None = None

    def __repr__(self) -> str:
        return (f"Summary({self.plan.arch.name}, {self.layout or self.plan.layout.describe()}: "
                f"{count(self.files, 'file')}, {count(self.tensors, 'tensor')}, {self.bytes:,} bytes)")


def _task(task: TensorTask, chunk: int, rank_plan: RankPlan, plan: Plan, dtype: torch.dtype) -> dict:
    """One Megatron tensor of a rank file as data: names, kind, which shard of which group, shapes."""
    return {"megatron": task.megatron, "chunk": chunk, "hf": list(task.hf), "kind": task.rule.kind.name,
            "shard": {"group": task.rule.group, "rank": group_rank(task.rule, rank_plan.rank),
                      "of": group_size(task.rule, plan.layout), "dim": task.shard.dim},
            "shape": list(task.shape), "hf_shapes": [list(s) for s in task.hf_shapes],
            "dtype": dtype_name(dtype), "bytes": nbytes(task.shape, dtype)}


def describe_files(plan: Plan, dtype_of: Callable[[TensorTask], torch.dtype], label: Callable[[RankPlan], str],
                   rank: bool = True) -> Summary:
    """The summary of writing `plan`'s rank files: per file (named by `label`) a line and its tensors
    as data (`rank`: with the file's TP/PP/EP/ETP ranks; off for torch_dist's global tensors).
    `dtype_of(task)` is the dtype a task's tensor is written in."""
    summary = Summary(plan)
    for rank_plan in plan.ranks:
        tensors = [_task(t, v, rank_plan, plan, dtype_of(t)) for v, chunk in enumerate(rank_plan.chunks)
                   for t in chunk if t.shape is not None]
        size = sum(t["bytes"] for t in tensors)
        summary.files += 1
        summary.tensors += len(tensors)
        summary.bytes += size
        summary.lines.append(f"{label(rank_plan)}: {count(len(rank_plan.chunks), 'chunk')}, {count(len(tensors), 'tensor')}, "
                             f"{size:,} bytes")
        summary.files_plan.append({"file": label(rank_plan),
                                   "rank": vars(rank_plan.rank).copy() if rank else None,
                                   "chunks": len(rank_plan.chunks), "tensors": tensors})
    return summary
