"""Start the ranks of a multi-process test warm: from a fork server that has imported torch and
megatron-core once (about 10 s of CPU a process on the 2-core CI machine, most of a tiny oracle
run's time), instead of spawning fresh interpreters that import them again, rank by rank and test
by test. The server lives as long as the pytest process; it is started with that process's
environment, working directory and sys.path, which no rank worker relies on changing."""
import multiprocessing

import torch.multiprocessing as mp

# What the rank workers import (a module that fails to import here is skipped by multiprocessing,
# and the rank then imports it itself).
PRELOAD = ["tests.megatron_oracle", "tests.qwen3_vl_oracle", "megatron.core.models.gpt", "megatron.core.dist_checkpointing",
           "megatron.training.checkpointing", "mconv.live"]


def start_ranks(worker, args: tuple, nprocs: int) -> None:
    """Run `worker(rank, *args)` in `nprocs` processes and wait for them (torch.multiprocessing's
    start_processes: an exception in a rank is raised here with its traceback)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(worker, args=args, nprocs=nprocs, start_method="forkserver")
