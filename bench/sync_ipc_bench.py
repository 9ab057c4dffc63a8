"""GPU benchmark of the colocated weight sync (sync_weights through IPCEngine, CUDA IPC on one GPU).

On the Qwen3-30B-A3B-shaped model of bench/live_bench.py (layers reduced), bf16, TP1, a receiver
process on the same GPU owns preallocated parameters (mconv.transport.receiver.ParameterReceiver)
and copies every tensor into them. In one run, best of 3 each:
  - floor: one device-to-device copy of the synced bytes (a flat torch copy of at most 4 GiB, scaled);
  - export: iter_hf_weights alone (the gathers and splits the sync starts from);
  - ipc: sync_weights into the receiver, one CUDA IPC handle per flat bucket;
  - per_tensor: the same buckets from iter_hf_weights into the same receiver, one CUDA IPC handle
    per tensor (one request per bucket), as trainers without flat buckets do.
  - verify: one sync with verify=True (the receiver's parameters read back and compared per tensor).
Then bf16 and FP8 (quantize="fp8") each: the receiver's parameters are checked bit for bit against
the exported tensors (a positional checksum per tensor, computed in both processes), and the peak
extra device memory of the trainer's process during a sync. Prints one JSON line per dtype and
bucket size (`--bucket-mb`, default 512, mconv's default; several sizes to choose that default:
`--no-baselines` skips the per-tensor and verified syncs). `--direct yes` (or `both`): the receiver
shares its parameters (ParameterReceiver(direct=True), allocated as one storage per dtype) and the
sync copies each bucket straight into them: one copy on the device instead of two, no request per
bucket (FP8 weights are quantized straight into the receiver's FP8 weights and scales).
FP8 also prints `ipc_vs_source_floor`: the sync against one device copy of the bytes the export
reads (the model's bf16 weights, about twice the FP8 bytes sent), which the quantization must read.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.live_bench import MODELS, build, log, require_gpu, timed  # noqa: E402

CHUNK = 64 << 20  # bytes a checksum takes at a time, so that it fits beside a full model


def checksum(tensor: torch.Tensor) -> int:
    """A positional checksum of the tensor's bytes (equal bytes give equal sums; a moved or
    changed byte almost surely not), taken CHUNK bytes at a time."""
    data, total = tensor.contiguous().view(-1).view(torch.uint8), 0
    for start in range(0, data.numel(), CHUNK):
        part = data[start:start + CHUNK].to(torch.int64)
        weights = (torch.arange(start, start + part.numel(), device=data.device, dtype=torch.int64) % 65521) + 1
        total += int((part * weights).sum())
    return total


def allocate(shapes: dict, direct: bool) -> dict[str, torch.Tensor]:
    """The receiver's parameters {HF name: CUDA tensor} for `shapes` ({name: (shape, dtype name)}):
    each its own tensor, or, `direct`, views of one storage per dtype (shared once, not one IPC
    handle per parameter)."""
    if not direct:
        return {name: torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
                for name, (shape, dtype) in shapes.items()}
    params = {}
    for dtype in sorted({d for _, d in shapes.values()}):
        named = [(name, shape) for name, (shape, d) in shapes.items() if d == dtype]
        sizes = [torch.Size(shape).numel() for _, shape in named]
        flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype), device="cuda")
        params.update((name, t.view(shape)) for (name, shape), t in zip(named, flat.split(sizes)))
    return params


def receive(shapes, address, authkey, ready, done, sums, direct=False):
    from mconv.transport.receiver import ParameterReceiver

    params = allocate(shapes, direct)
    receiver = ParameterReceiver(params, address, authkey, direct=direct)
    receiver.start()
    ready.set()
    done.wait()
    sums.put({name: checksum(t) for name, t in params.items()})
    receiver.close()


def run(hf: dict, model, quantize: str | None, bucket: int, baselines: bool, direct: bool = False) -> dict:
    from mconv.live import iter_hf_weights
    from mconv.live.sync import IPCEngine, sync_weights
    from mconv.transport import cuda_ipc
    from mconv.transport.flat import Entry, dtype_name

    def export():
        return iter_hf_weights([model], hf, bucket_bytes=bucket, quantize=quantize)

    sent = {name: (list(t.shape), dtype_name(t.dtype), checksum(t)) for named in export() for name, t in named}
    nbytes = sum(torch.Size(s).numel() * getattr(torch, d).itemsize for s, d, _ in sent.values())
    largest = max(torch.Size(s).numel() * getattr(torch, d).itemsize for s, d, _ in sent.values())
    # The floor: one device copy of the synced bytes, through a buffer of at most 4 GiB copied as many
    # times as the bytes need (a full model does not fit twice beside the trainer's),
    # before the receiver allocates its parameters.
    size = min(nbytes, 4 << 30)
    src, dst = torch.empty(size, dtype=torch.uint8, device="cuda"), torch.empty(size, dtype=torch.uint8, device="cuda")
    copy_s = timed(lambda: dst.copy_(src), repeats=3) / size  # per byte
    floor_copy_s = copy_s * nbytes
    del src, dst
    torch.cuda.empty_cache()
    context = multiprocessing.get_context("spawn")
    address, authkey = os.path.join(tempfile.mkdtemp(), "engine.sock"), os.urandom(16)
    ready, done, sums = context.Event(), context.Event(), context.Queue()
    receiver = context.Process(target=receive, args=({n: v[:2] for n, v in sent.items()}, address, authkey,
                                                     ready, done, sums, direct), daemon=True)
    receiver.start()
    assert ready.wait(120), "receiver did not start"
    engine = IPCEngine(address, authkey)
    result = {"quantize": quantize or "bf16", "direct": direct, "tensors": len(sent), "bytes": nbytes,
              "bucket_bytes": bucket, "floor_copy_s": floor_copy_s}
    if quantize:
        read = sum(t.nbytes for named in iter_hf_weights([model], hf, bucket_bytes=bucket) for _, t in named)
        result["floor_source_copy_s"] = copy_s * read

    result["export_s"] = timed(lambda: [None for named in export() for _ in named], repeats=3)

    def ipc():
        result["last"] = sync_weights([model], hf, engine, bucket_bytes=bucket, quantize=quantize).seconds

    ipc()  # buffers allocated and mapped once, as in every sync after a trainer's first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result["ipc_s"] = timed(ipc, repeats=3)
    result["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    result["two_buckets_plus_largest_bytes"] = 2 * bucket + largest

    if not baselines:
        return finished(result, receiver, done, sums, engine, sent, nbytes)

    def per_tensor():
        engine.start("per-tensor")
        for named in export():
            torch.cuda.synchronize()
            engine._request({"op": "update", "buffers": [
                {"ipc": cuda_ipc.share(t.contiguous().view(-1).view(torch.uint8)),
                 "entries": [Entry(name, dtype_name(t.dtype), tuple(t.shape), 0, t.numel() * t.element_size())
                             .to_json()]} for name, t in named]})
        engine.finish("per-tensor")

    result["per_tensor_s"] = timed(per_tensor, repeats=3)

    def verified():
        sync_weights([model], hf, engine, bucket_bytes=bucket, quantize=quantize, verify=True)
        result["engine_verified"] = True  # an MconvError names the tensors otherwise

    result["verify_s"] = timed(verified, repeats=1)  # the receiver ends holding what the flat path sent
    result["ipc_vs_per_tensor"] = result["ipc_s"] / result["per_tensor_s"]
    return finished(result, receiver, done, sums, engine, sent, nbytes)


def finished(result, receiver, done, sums, engine, sent, nbytes) -> dict:
    """Stop the receiver, check what it holds against what was sent, and add the ratios."""
    done.set()
    received = sums.get(timeout=600)
    receiver.join(60)
    engine.close()
    result["verified"] = received == {name: v[2] for name, v in sent.items()}
    result["ipc_vs_floor"] = result["ipc_s"] / result["floor_copy_s"]
    if "floor_source_copy_s" in result:
        result["ipc_vs_source_floor"] = result["ipc_s"] / result["floor_source_copy_s"]
    result["ipc_GBps"] = nbytes / result["ipc_s"] / 1e9
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--quantize", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[512], help="bucket sizes in MiB, each a run")
    parser.add_argument("--no-baselines", action="store_true", help="skip the per-tensor and verified syncs")
    parser.add_argument("--direct", choices=["no", "yes", "both"], default="no",
                        help="the receiver shares its parameters (ParameterReceiver(direct=True), one storage per "
                             "dtype) and the trainer writes into them: 'both' runs each way")
    options = parser.parse_args()
    require_gpu("sync_ipc_bench.py")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        hf = dict(MODELS["qwen3-30b-a3b"], num_hidden_layers=options.layers)
        log("building the model")
        model, _ = build(hf)
        for quantize in options.quantize:
            for bucket_mb, direct in itertools.product(options.bucket_mb, {"no": [False], "yes": [True],
                                                                          "both": [False, True]}[options.direct]):
                log("syncing", quantize, f"{bucket_mb} MiB buckets", "direct" if direct else "packed")
                started = time.perf_counter()
                line = run(hf, model, None if quantize == "bf16" else quantize, bucket_mb << 20,
                           not options.no_baselines, direct)
                print(json.dumps({"model": "qwen3-30b-a3b", "layers": options.layers, **line,
                                  "wall_s": time.perf_counter() - started}), flush=True)
                torch.cuda.empty_cache()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
