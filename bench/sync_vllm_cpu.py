"""Where a weight sync into vLLM's CPU build spends its time (the table in docs/weight-sync.md).

For the tiny Qwen3 (tied embeddings, TP2) and Qwen3-MoE (TP2/EP2/ETP1) fixtures: a vLLM engine
process (vLLM's CPU venv, `scripts/install-vllm.sh`; float32, in-process `LLM` serving mconv's
`Receiver`, with examples/vllm_sync_engine.py's engine arguments) and two gloo trainer ranks that load the fixture and
sync it `--syncs` times with `VLLMEngine`, 64 KiB buckets. Per sync: the wall time on rank 0,
`SyncResult.seconds` of the sending rank (gather: `iter_hf_weights`; pack: copies into the
shared-memory bucket files; engine: waiting for the engine beyond what gather and pack overlapped),
and the engine process's own seconds in loading the buckets (vLLM's `update_weights`) and finishing
the update (`finish_weight_update`, the MoE prepacking, the prefix-cache reset). The first sync
also pays one-time work (planning, the model check, bucket layouts). Prints a markdown table.

    python3 bench/sync_vllm_cpu.py --syncs 3
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VLLM_PYTHON = ROOT / ".venv" / "vllm311" / "bin" / "python"
BUCKET = 64 << 10
MODELS = {"qwen3-tiny-tied": dict(tp=2), "qwen3-moe-tiny": dict(tp=2, ep=2, etp=1)}

ENGINE = """
import sys, time
from examples.vllm_sync_engine import LLM_ARGS  # (and its settings of the environment)
from vllm import LLM
from mconv.transport import shm
from mconv.transport.vllm_receiver import Receiver, engine_args

seconds = {"load": 0.0, "finish": 0.0}

class Timed(Receiver):
    def load(self, buffers):
        started = time.perf_counter()
        super().load(buffers)
        seconds["load"] += time.perf_counter() - started

    def complete(self, message):
        started = time.perf_counter()
        super().complete(message)
        seconds["finish"] += time.perf_counter() - started

hf_dir, socket, authkey = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
llm = LLM(model=hf_dir, **LLM_ARGS, **engine_args())
Timed(llm, socket, authkey).start()
with shm.listen(socket + ".timings", authkey) as listener:
    print("READY", flush=True)
    with listener.accept() as conn:
        while True:
            try:
                shm.receive(conn)
            except EOFError:
                break
            shm.send(conn, dict(seconds))
            seconds.update(load=0.0, finish=0.0)
"""


def trainer(rank: int, store: str, hf_dir: str, sizes: dict, socket: str, authkey: bytes, syncs: int, out: str):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv import Layout
    from mconv.live import build_model, load_hf_weights
    from mconv.live.sync import VLLMEngine, sync_weights
    from mconv.transport import shm

    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=sizes["tp"],
                                 expert_model_parallel_size=sizes.get("ep", 1),
                                 expert_tensor_parallel_size=sizes.get("etp"))
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    chunks = build_model(hf_dir, Layout(**sizes), dtype=torch.float32, use_cpu_initialization=True)
    load_hf_weights(chunks, hf_dir)
    engine = VLLMEngine(socket, authkey)
    timings = shm.connect(socket + ".timings", authkey) if rank == 0 else None
    rows = []
    for index in range(syncs):
        dist.barrier()
        started = time.perf_counter()
        result = sync_weights(chunks, hf_dir, engine, version=f"bench-{index}", bucket_bytes=BUCKET)
        wall = time.perf_counter() - started
        if rank == 0:
            rows.append({"wall": wall, **result.seconds, "buckets": result.buckets, "bytes": result.bytes,
                         **{f"engine_{k}": v for k, v in shm.request(timings, {"op": "timings"}).items()}})
    engine.close()
    if rank == 0:
        timings.close()
        Path(out).write_text(json.dumps(rows))
    dist.barrier()


def run(name: str, sizes: dict, syncs: int) -> list[dict]:
    hf_dir = ROOT / "fixtures" / name
    with tempfile.TemporaryDirectory() as tmp:
        socket, authkey = f"{tmp}/engine.sock", secrets.token_bytes(16)
        (Path(tmp) / "engine.py").write_text(ENGINE)
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'vllm_site'}:{ROOT}"}
        log = Path(tmp) / "engine.log"
        with open(log, "w") as stream:
            engine = subprocess.Popen([str(VLLM_PYTHON), f"{tmp}/engine.py", str(hf_dir), socket, authkey.hex()],
                                      stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        try:
            while "\nREADY\n" not in "\n" + log.read_text():
                if engine.poll() is not None:
                    raise SystemExit(f"the vLLM engine for {name} stopped:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
            mp.start_processes(trainer, args=(f"{tmp}/store", str(hf_dir), sizes, socket, authkey, syncs,
                                              f"{tmp}/rows.json"), nprocs=2, start_method="spawn")
            return json.loads((Path(tmp) / "rows.json").read_text())
        finally:
            engine.kill()
            engine.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=3)
    options = parser.parse_args()
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"no vLLM CPU venv at {VLLM_PYTHON}: run scripts/install-vllm.sh")
    print(f"# {' '.join(sys.argv)}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("| model | layout | sync | buckets | MB | wall ms | gather ms | pack ms | engine wait ms | "
          "vLLM load ms | vLLM finish ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, sizes in MODELS.items():
        layout = "/".join(f"{k.upper()}{v}" for k, v in sizes.items())
        for index, row in enumerate(run(name, sizes, options.syncs)):
            print(f"| {name} | {layout} | {index + 1} | {row['buckets']} | {row['bytes'] / 1e6:.2f} | "
                  + " | ".join(f"{1000 * row[k]:.0f}" for k in ("wall", "gather", "pack", "engine",
                                                                   "engine_load", "engine_finish")) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
