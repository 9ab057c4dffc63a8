"""Sharing a conversion: worker threads within a process, and the ranks of a torchrun job.

A conversion is split into shares of its output (HF tensors for mcore2hf, rank files for the legacy
hf2mcore); member 0 prepares the output (files whose layout is fixed in advance) and finishes it
(index, metadata, rename); every member writes its share in place. Within a process, `--workers`
threads split a share further, by tensor (`run_ordered`). Under torchrun the members meet through
torch.distributed's key-value store (torchrun's own TCPStore), without a process group, so each
member stays free to run megatron-core's one-process group for torch_dist checkpoints.
"""
from __future__ import annotations

import datetime
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from mconv.errors import MconvError

T = TypeVar("T")
POLL_SECONDS = 0.1  # how often a rank waiting for the others looks at the store


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

    def _arrive(self, name: str) -> None:
        key = f"mconv/{self.job}/{name}"
        if self.store.add(key, 1) == self.size:
            self.store.set(f"{key}/open", "1")

    def barrier(self, name: str) -> None:
        """Wait for every rank. Polled: while a blocking store.wait runs, Python runs no signal
        handler, so Ctrl-C or torchrun's SIGTERM would not stop a waiting rank."""
        self._arrive(name)
        while not self.store.check([f"mconv/{self.job}/{name}/open"]):
            time.sleep(POLL_SECONDS)

    def step(self, name: str, action: Callable[[], None]) -> None:
        """Run a step on this rank, then wait for all ranks; if any rank failed, every rank stops
        with that rank's message (instead of waiting for it forever). A rank stopped by anything
        else (an interrupt) leaves a note and counts as arrived, so the others do not wait for it."""
        failed = f"mconv/{self.job}/failed"
        try:
            action()
        except MconvError as e:
            self.store.set(failed, f"rank {self.rank}: {e}")
        except BaseException as e:
            self.store.set(failed, f"rank {self.rank} stopped ({type(e).__name__})")
            self._arrive(name)
            raise
        self.barrier(name)
        if self.store.check([failed]):
            raise MconvError(self.store.get(failed).decode())


def torchrun_rank() -> tuple[int, int]:
    """This process's (rank, world size) under torchrun; (0, 1) otherwise."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), size) if size > 1 and "RANK" in os.environ else (0, 1)


SAME_ERROR_WAIT_SECONDS = 5.0  # how long a rank waits to learn whether rank 0 reports the same error


def speaks_for_itself(message: str) -> bool:
    """Whether this process should print the error `message`: rank 0 of a torchrun job speaks for
    the job, so another rank prints only what rank 0 does not (a failure of its own). Every rank
    meets the same bad input, and a failed step is reported to all ranks in the same words
    (`TorchrunTeam.step`); so rank 0 posts its message in torchrun's store and the others stay
    quiet when it matches. Outside torchrun, or if the store cannot be reached, always True."""
    rank, size = torchrun_rank()
    if size == 1:
        return True
    try:
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=SAME_ERROR_WAIT_SECONDS))
        key = (f"mconv/error/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        if rank == 0:
            store.set(key, message)
            return True
        deadline = time.monotonic() + SAME_ERROR_WAIT_SECONDS
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        return not store.check([key]) or store.get(key).decode() != message
    except Exception:  # no store to ask (a rank started by hand): better twice than never
        return True


def run_ordered(jobs: Iterable[Callable[[], T]], threads: int) -> Iterator[T]:
    """Run `jobs` on `threads` threads and yield their results in order, at most 2 x `threads` jobs
    ahead of the consumer (so memory holds a few jobs' results, not all of them).

    Threads, not processes: the work is pread, tensor copies and pwrite, which release the GIL,
    and a thread needs no second import of torch nor a second planning of the checkpoint (spawned
    worker processes paid seconds for both, and made the default slower than one worker). With
    one thread the jobs run here, one after the other. The first error stops the jobs not yet
    started and is raised here."""
    if threads <= 1:
        for job in jobs:
            yield job()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="mconv") as pool:
        pending: deque[Future] = deque()
        try:
            for job in jobs:
                pending.append(pool.submit(job))
                if len(pending) > 2 * threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
