"""The trainer's host work in one weight sync, on the CPU (no GPU needed): what is left of a sync's
time once the device copies are taken away, and the part a GPU cannot hide.

The Qwen3-30B-A3B layout of bench/live_bench.py (`--layers`, default 48: 18,867 HF tensors, 128
experts a layer) with tiny dimensions (hidden 64, expert FFN 16), one gloo rank, synced by
`sync_weights` into an in-process engine, in about 113 buckets (`--bucket-bytes`):
  - direct: an engine that offers its own tensors (`Engine.targets`, as IPCEngine does for a
    ParameterReceiver(direct=True)): each bucket is copied straight into them;
  - packed: a callable engine taking each packed bucket and doing nothing with it.
Prints, per route, the wall time of syncs 1..N after the first (which plans and allocates) and
their `SyncResult.seconds`, and the export alone (iter_hf_weights). On the CPU the copies are
memcpy's (about 40 MB a sync); on a GPU they are kernel launches, and the rest is host work.

    python3 bench/sync_host_cpu.py [--layers 48] [--syncs 4] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.live_bench as live_bench  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--syncs", type=int, default=4, help="timed syncs after the first")
    parser.add_argument("--bucket-bytes", type=int, default=360_000, help="about 113 buckets at 48 layers")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one more direct sync, planned already (top 25, own time)")
    options = parser.parse_args()
    live_bench.DEVICE = "cpu"
    from tests.megatron_oracle import _cpu_shims

    _cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv.live import iter_hf_weights
    from mconv.live.sync import sync_weights
    from mconv.live.sync.engines import CallableEngine, Engine

    class Direct(Engine):
        def __init__(self, params):
            super().__init__()
            self.params = params

        def targets(self, device):
            return self.params

        def update(self, bucket):
            pass

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        hf = dict(live_bench.MODELS["qwen3-30b-a3b"], num_hidden_layers=options.layers, vocab_size=1024,
                  hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16)
        model, _ = live_bench.build(hf)
        params = {name: torch.empty_like(t) for bucket in iter_hf_weights([model], hf) for name, t in bucket}
        print(f"{len(params)} tensors, {sum(t.nbytes for t in params.values()):,} bytes", flush=True)
        direct = Direct(params)
        for route, engine in (("direct", direct), ("packed", CallableEngine(lambda bucket: None))):
            sync_weights([model], hf, engine, bucket_bytes=options.bucket_bytes)  # plans, allocates
            for index in range(1, options.syncs + 1):
                start = time.perf_counter()
                result = sync_weights([model], hf, engine, bucket_bytes=options.bucket_bytes)
                print(f"{route} sync {index}: {(time.perf_counter() - start) * 1e3:.1f} ms, {result.buckets} buckets, "
                      f"{({k: round(v * 1e3, 1) for k, v in result.seconds.items()})} ms", flush=True)
        start = time.perf_counter()
        sum(1 for bucket in iter_hf_weights([model], hf, bucket_bytes=options.bucket_bytes) for _ in bucket)
        print(f"export alone: {(time.perf_counter() - start) * 1e3:.1f} ms")
        if options.profile:
            profile = cProfile.Profile()
            profile.enable()
            sync_weights([model], hf, direct, bucket_bytes=options.bucket_bytes)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
