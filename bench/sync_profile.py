"""Where a colocated weight sync's time goes, on one GPU (the figures docs/weight-sync.md quotes).

The Qwen3-30B-A3B-shaped model of bench/live_bench.py (`--layers`, default 48), bf16 (FP8 weights
and scales with `--quantize fp8`), TP1, 512 MiB buckets, synced through IPCEngine into a
ParameterReceiver process, three times (the first maps the buffers and builds the plans), then
once more under cProfile. Prints per sync the wall time, `SyncResult.seconds` and the receiver's
own milliseconds (its request handling, JSON, handle mapping, copy launches, load including the
wait for its copies); then the trainer's profile (top 25 by own time). First, a micro-benchmark
of the copy primitives on one 512 MiB bucket of 3 MiB expert matrices: one flat copy,
torch._foreach_copy_, a copy_ per tensor, and the batched copies torch has for flat buffers
(torch._chunk_cat into one, torch.split_with_sizes_copy out of one: FSDP2's).

`--timeline`: for each sync, the trainer's phases in milliseconds from the sync's start (first
start and last end of each, and its total): where the wall time goes outside the bucket loop.
`--export`: no sync: iter_hf_weights alone (`--quantize`), its wall time four times (until the
device is done with the last bucket) and the fourth's profile.

    python3 bench/sync_profile.py --layers 48 [--quantize fp8] [--direct] [--sort cumtime] [--timeline] [--export]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.live_bench import MODELS, build, require_gpu, timed  # noqa: E402
from bench.sync_ipc_bench import allocate  # noqa: E402

BUCKET = 512 << 20


def copy_primitives() -> dict:
    """Milliseconds of each way to copy 165 [768, 2048] bf16 matrices into one buffer or out of it (best of 20)."""
    src = [torch.randn(768, 2048, device="cuda").to(torch.bfloat16) for _ in range(165)]
    flat = torch.empty(165 * 768 * 2048, dtype=torch.bfloat16, device="cuda")
    dst = list(flat.view(165, 768, 2048).unbind(0))
    other = torch.empty_like(flat)

    def per_tensor():
        for d, s in zip(dst, src):
            d.copy_(s)

    sizes, outs = [s.numel() for s in src], [s.view(-1) for s in src]
    return {name: round(timed(fn, repeats=20) * 1e3, 3) for name, fn in (
        ("flat_copy", lambda: flat.copy_(other)), ("foreach_copy", lambda: torch._foreach_copy_(dst, src)),
        ("copy_per_tensor", per_tensor), ("chunk_cat", lambda: torch._chunk_cat(src, 0, 1, out=flat.view(1, -1))),
        ("split_with_sizes_copy", lambda: torch.split_with_sizes_copy(flat, sizes, out=outs)))}


def timeline(engine) -> dict:
    """Time the trainer's phases of a sync: wraps the sync's steps (module functions sync_weights
    calls, `engine`'s requests) to record (first start, last end, total) in seconds since
    `origin[0]`; returns {phase: [start, end, total]}, emptied by the caller per sync."""
    from mconv.live import schedule
    from mconv.live.sync import core

    phases: dict[str, list[float]] = {}
    origin = [0.0]

    def timed_step(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter() - origin[0]
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter() - origin[0]
                got = phases.setdefault(name, [start, end, 0.0])
                got[1] = end
                got[2] += end - start
        return call

    for name in ("_prepared", "_agree_models", "_agree_dtypes", "_write", "_pack", "_started", "_config",
                 "architecture_for"):
        setattr(core, name, timed_step(name, getattr(core, name)))
    schedule._unmoved = timed_step("_unmoved", schedule._unmoved)
    for name in ("expected", "dtypes", "start", "targets", "update", "flush", "finish"):
        setattr(engine, name, timed_step(name, getattr(engine, name)))
    return phases, origin


def profile_export(export, sort: str) -> None:
    """Time `export()`'s buckets consumed four times (wall, until the device is done), profiling
    the fourth; print the times and the profile's top 40 by `sort`."""
    profile = cProfile.Profile()
    for index in range(4):
        torch.cuda.synchronize()
        if index == 3:
            profile.enable()
        start = time.perf_counter()
        tensors = sum(len(bucket) for bucket in export())
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        profile.disable()
        print(f"export {index}{' (profiled)' if index == 3 else ''}: {wall * 1e3:.1f} ms, {tensors} tensors", flush=True)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(40)
    print(out.getvalue())


def receive(shapes, address, authkey, ready, commands, reports, direct=False):
    """The engine's process: a ParameterReceiver whose steps are timed (milliseconds per sync)."""
    from mconv.transport import copies, receiver, shm

    spent: dict[str, float] = {}

    def timer(name, fn):
        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return timed_call

    copies.CopyPlan.run = timer("copy_launches", copies.CopyPlan.run)
    receiver.ParameterReceiver._map = timer("map_handle", receiver.ParameterReceiver._map)
    receiver.ParameterReceiver.load = timer("load", receiver.ParameterReceiver.load)
    receiver.UpdateReceiver.handle = timer("handle", receiver.UpdateReceiver.handle)
    receiver.ParameterReceiver.changed = timer("changed", receiver.ParameterReceiver.changed)
    receiver.ParameterReceiver.complete = timer("complete", receiver.ParameterReceiver.complete)
    shm.receive = timer("read_request", shm.receive)  # includes waiting for the next request
    engine = receiver.ParameterReceiver(allocate(shapes, direct), address, authkey, direct=direct)
    engine.start()
    ready.set()
    while commands.get() == "report":
        reports.put({name: round(seconds * 1e3, 1) for name, seconds in spent.items()})
        spent.clear()
    engine.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--quantize", choices=["bf16", "fp8"], default="bf16",
                        help="fp8: the syncs send FP8 weights and scales (sync_weights(quantize='fp8'))")
    parser.add_argument("--direct", action="store_true",
                        help="the receiver shares its parameters and the trainer writes into them")
    parser.add_argument("--timeline", action="store_true", help="each sync's phases, ms from its start")
    parser.add_argument("--export", action="store_true", help="profile iter_hf_weights alone, no sync")
    parser.add_argument("--sort", default="tottime", help="the profile's order (pstats: tottime, cumtime)")
    options = parser.parse_args()
    require_gpu("sync_profile.py")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mconv.live import iter_hf_weights
    from mconv.live.sync import IPCEngine, sync_weights
    from mconv.transport.flat import dtype_name

    print("copy primitives, ms:", copy_primitives(), flush=True)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        hf = dict(MODELS["qwen3-30b-a3b"], num_hidden_layers=options.layers)
        model, _ = build(hf)
        quantize = None if options.quantize == "bf16" else options.quantize
        shapes = {name: (list(t.shape), dtype_name(t.dtype))
                  for bucket in iter_hf_weights([model], hf, bucket_bytes=BUCKET, quantize=quantize)
                  for name, t in bucket}
        if options.export:
            profile_export(lambda: iter_hf_weights([model], hf, bucket_bytes=BUCKET, quantize=quantize), options.sort)
            ps.destroy_model_parallel()
            dist.destroy_process_group()
            return
        context = multiprocessing.get_context("spawn")
        address, authkey = os.path.join(store, "engine.sock"), os.urandom(16)
        ready, commands, reports = context.Event(), context.Queue(), context.Queue()
        process = context.Process(target=receive, args=(shapes, address, authkey, ready, commands, reports,
                                                        options.direct), daemon=True)
        process.start()
        assert ready.wait(120), "the receiver did not start"
        engine = IPCEngine(address, authkey)
        phases, origin = timeline(engine) if options.timeline else ({}, [0.0])
        profile = cProfile.Profile()
        for index in range(4):
            if index == 3:
                profile.enable()
            torch.cuda.synchronize()
            start = origin[0] = time.perf_counter()
            phases.clear()
            result = sync_weights([model], hf, engine, bucket_bytes=BUCKET, version=f"v{index}", quantize=quantize)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            profile.disable()
            commands.put("report")
            print(f"sync {index}{' (profiled)' if index == 3 else ''}: {wall * 1e3:.1f} ms, {result.buckets} buckets, "
                  f"trainer seconds {({k: round(v, 4) for k, v in result.seconds.items()})}, "
                  f"receiver ms {reports.get(timeout=600)}", flush=True)
            if phases:
                print("  phases, ms from the start (first start, last end, total):", ", ".join(
                    f"{name} {a * 1e3:.1f}-{b * 1e3:.1f} ({t * 1e3:.1f})"
                    for name, (a, b, t) in sorted(phases.items(), key=lambda item: item[1][0])), flush=True)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(options.sort).print_stats(40)
        print(out.getvalue())
        commands.put("stop")
        process.join(60)
        engine.close()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
