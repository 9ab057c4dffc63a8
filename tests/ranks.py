"""Start the ranks of a multi-process test warm: from a fork server that has imported torch and
megatron-core once (about 10 s of CPU a process on the 2-core CI machine, much of a tiny oracle
run's time), instead of spawning fresh interpreters that import them again, rank by rank and test
by test. A launch from another environment or working directory than the server's (a test that
sets HF_HOME, say: libraries read such settings when imported) spawns fresh interpreters, as
before."""
import multiprocessing
import os

import torch.multiprocessing as mp

# What the rank workers import (a module that fails to import here is skipped by multiprocessing,
# and the rank then imports it itself).
PRELOAD = ["tests.megatron_oracle", "tests.qwen3_vl_oracle", "megatron.core.models.gpt",
           "megatron.core.dist_checkpointing", "megatron.training.checkpointing", "mconv.live"]

_server_started_in: list[tuple[dict, str]] = []  # the environment and directory the server started with


def start_ranks(worker, args: tuple, nprocs: int) -> None:
    """Run `worker(rank, *args)` in `nprocs` processes and wait for them (torch.multiprocessing's
    start_processes: an exception in a rank is raised here with its traceback)."""
    here = (dict(os.environ), os.getcwd())
    if not _server_started_in:
        multiprocessing.set_forkserver_preload(PRELOAD)
        _server_started_in.append(here)
    method = "forkserver" if _server_started_in[0] == here else "spawn"
    mp.start_processes(worker, args=args, nprocs=nprocs, start_method=method)
