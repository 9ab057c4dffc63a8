"""Sharing a conversion between processes: local worker processes, or the ranks of a torchrun job.

A conversion is split into shares of its output (HF tensors for mcore2hf, rank files for the legacy
hf2mcore); member 0 prepares the output (files whose layout is fixed in advance) and finishes it
(index, metadata, rename); every member writes its share in place. Local workers report progress
to the parent's single progress bar through a queue. Under torchrun the members meet through
torch.distributed's key-value store (torchrun's own TCPStore), without a process group, so each
member stays free to run megatron-core's one-process group for torch_dist checkpoints.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

from mconv.errors import MconvError


def share(costs: Sequence[int], index: int, size: int) -> list[int]:
    """Indices of the items member `index` of `size` converts: largest first to the least loaded
    member, deterministic, so every member computes the same split without talking."""
    loads = [0] * size
    owner = {}
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        member = min(range(size), key=lambda m: (loads[m], m))
        owner[i] = member
        loads[member] += costs[i]
    return sorted(i for i, m in owner.items() if m == index)


@dataclass
class TorchrunTeam:
    """The ranks of a torchrun job, meeting through torchrun's key-value store."""

    rank: int
    size: int
    store: object
    job: str

    @classmethod
    def from_environment(cls, job: str) -> "TorchrunTeam | None":
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
            return None
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(hours=6))
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), store, job)

    def barrier(self, name: str) -> None:
        key = f"mconv/{self.job}/{name}"
        if self.store.add(key, 1) == self.size:
            self.store.set(f"{key}/open", "1")
        self.store.wait([f"{key}/open"])

    def step(self, name: str, action: Callable[[], None]) -> None:
        """Run a step on this rank, then wait for all ranks; if any rank failed, every rank stops
        with that rank's message (instead of waiting for it forever)."""
        failed = f"mconv/{self.job}/failed"
        try:
            action()
        except MconvError as e:
            self.store.set(failed, f"rank {self.rank}: {e}")
        self.barrier(name)
        if self.store.check([failed]):
            raise MconvError(self.store.get(failed).decode())


def _worker(target: Callable, index: int, size: int, queue, args: tuple) -> None:
    try:
        target(index, size, lambda n: queue.put(("progress", n)), *args)
        queue.put(("done", index))
    except MconvError as e:
        queue.put(("error", str(e)))
    except (OSError, RuntimeError) as e:  # raised as itself in the parent, which can tell a failed write
        queue.put(("raise", e))
    except BaseException:
        queue.put(("error", f"worker {index} crashed: {traceback.format_exc().strip().splitlines()[-1]}"))


def run_workers(target: Callable, workers: int, args: tuple, progress: Callable[[int], None]) -> None:
    """Run target(index, size, progress, *args) in `workers` fresh processes; progress from all of
    them feeds one callback; the first error stops the others and is raised here."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(target, i, workers, queue, args), daemon=True)
                 for i in range(workers)]
    for process in processes:
        process.start()
    finished = 0
    try:
        while finished < workers:
            kind, value = queue.get()
            if kind == "progress":
                progress(value)
            elif kind == "done":
                finished += 1
            elif kind == "raise":
                raise value
            else:
                raise MconvError(value)
    finally:
        for process in processes:
            if process.is_alive() and finished < workers:
                process.kill()
            process.join()
