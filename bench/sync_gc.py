"""What Python's cyclic garbage collector costs a colocated weight sync, on one GPU.

The Qwen3-30B-A3B-shaped model of bench/live_bench.py (48 layers), bf16 then FP8, synced through
IPCEngine into a ParameterReceiver process (bench/sync_ipc_bench.py's), 512 MiB buckets: after a
first sync (maps, plans), six rounds of four syncs with the collector on and off in turn. Prints per
round each sync's wall time and, per sync, the collector's time in the trainer's process, its number
of collections and how many were full (generation 2) ones, which walk every tracked object.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/sync_gc.py
"""
from __future__ import annotations

import gc
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.live_bench import MODELS, build, require_gpu  # noqa: E402
from bench.sync_ipc_bench import BUCKET, receive  # noqa: E402

collected = {"s": 0.0, "collections": 0, "full": 0, "started": 0.0}


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        collected["started"] = time.perf_counter()
        return
    collected["s"] += time.perf_counter() - collected["started"]
    collected["collections"] += 1
    collected["full"] += info["generation"] == 2


def rounds(model, hf: dict, quantize: str | None) -> None:
    from mconv.live import iter_hf_weights
    from mconv.live.sync import IPCEngine, sync_weights

    shapes = {name: (list(t.shape), str(t.dtype).removeprefix("torch."))
              for bucket in iter_hf_weights([model], hf, bucket_bytes=BUCKET, quantize=quantize) for name, t in bucket}
    context = multiprocessing.get_context("spawn")
    address, authkey = os.path.join(tempfile.mkdtemp(), "engine.sock"), os.urandom(16)
    ready, done, sums = context.Event(), context.Event(), context.Queue()
    receiver = context.Process(target=receive, args=(shapes, address, authkey, ready, done, sums), daemon=True)
    receiver.start()
    assert ready.wait(120), "receiver did not start"
    engine = IPCEngine(address, authkey)
    sync_weights([model], hf, engine, bucket_bytes=BUCKET, quantize=quantize)  # maps the buffers, plans
    for mode in ("on", "off") * 3:
        (gc.enable if mode == "on" else gc.disable)()
        times, collections = [], []
        for _ in range(4):
            collected.update(s=0.0, collections=0, full=0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            sync_weights([model], hf, engine, bucket_bytes=BUCKET, quantize=quantize)
            torch.cuda.synchronize()
            times.append(round((time.perf_counter() - start) * 1e3, 1))
            collections.append({"gc_ms": round(collected["s"] * 1e3, 1), "collections": collected["collections"],
                                "full": collected["full"]})
        print(json.dumps({"quantize": quantize or "bf16", "collector": mode, "sync_ms": times,
                          "median_ms": statistics.median(times), "gc": collections}), flush=True)
    gc.enable()
    done.set()
    sums.get(timeout=600)
    receiver.join(60)
    engine.close()


def main() -> None:
    require_gpu("sync_gc.py")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    gc.callbacks.append(on_gc)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        hf = dict(MODELS["qwen3-30b-a3b"], num_hidden_layers=48)
        model, _ = build(hf)
        print(json.dumps({"gc_tracked_objects": len(gc.get_objects())}), flush=True)
        for quantize in (None, "fp8"):
            rounds(model, hf, quantize)
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
