"""The host's share of a live export (`iter_hf_weights`), on the CPU: the Qwen3-30B-A3B tensor count
(48 layers, 128 experts: 18,867 HF tensors) with tiny dimensions, in about as many buckets as the
real shape's 114 at 512 MiB (`--buckets`; sizing them by bytes makes 115 here), so that what is
timed is the Python per bucket and per tensor, not the copies.

    python3 bench/export_host.py [--repeat 3] [--buckets 114]

Prints one JSON line per mode: the fastest of --repeat exports after a first (which plans); then
what one full pass of Python's cyclic garbage collector costs in such a process (it walks every
tracked object: the model's modules and tensors, the export's cached plans), before and after
`gc.freeze()` moves those objects out of its reach.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.live_bench as live_bench  # noqa: E402
from mconv.converter import fp8  # noqa: E402

TINY = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, num_hidden_layers=48)


def stand_in_quantization():
    """fp8.quantize_all replaced by one returning, per list length, the same FP8 views and scales."""
    made: dict[int, list] = {}

    def quantize_all(named, scale_fmt="float", batched=None, **_):
        if named and len(named) not in made:
            flat = torch.empty(sum(t.numel() for _, t in named), dtype=fp8.FP8)
            pieces = flat.split([t.numel() for _, t in named])
            made[len(named)] = [(q.view(t.shape), torch.ones(fp8.grid(t.shape))) for q, (_, t) in zip(pieces, named)]
        return made.get(len(named), [])

    fp8.quantize_all = quantize_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--buckets", type=int, default=114)
    options = parser.parse_args()
    from megatron.core import parallel_state as ps

    from mconv.live import iter_hf_weights

    live_bench.DEVICE = "cpu"
    stand_in_quantization()
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        hf = dict(live_bench.MODELS["qwen3-30b-a3b"], **TINY)
        model, _ = live_bench.build(hf)
        nbytes = sum(t.nbytes for bucket in iter_hf_weights([model], hf) for _, t in bucket)
        bucket_bytes = nbytes // options.buckets
        for quantize in (None, "fp8"):
            times, buckets = [], []
            for _ in range(options.repeat + 1):
                start = time.perf_counter()
                buckets = list(iter_hf_weights([model], hf, bucket_bytes=bucket_bytes, quantize=quantize))
                times.append(time.perf_counter() - start)
            print(json.dumps({"quantize": quantize or "bf16", "buckets": len(buckets),
                              "tensors": sum(map(len, buckets)), "first_s": round(times[0], 3),
                              "export_s": round(min(times[1:]), 3)}), flush=True)
        collect = []
        for freeze in (False, True):
            if freeze:
                gc.freeze()
            start = time.perf_counter()
            gc.collect()
            collect.append(round(time.perf_counter() - start, 3))
        print(json.dumps({"gc_tracked_objects": len(gc.get_objects()) + gc.get_freeze_count(),
                          "gc_collect_s": collect[0], "gc_collect_after_freeze_s": collect[1]}), flush=True)
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
