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
With `--server`, vLLM runs as its OpenAI server instead (engine core and worker in processes of
their own, `VLLM_SERVER_DEV_MODE=1`, mconv's plugin), synced with `VLLMServerEngine` over HTTP; its
load and finish are then inside "engine wait" (the server reports no timings of its own).

    python3 bench/sync_vllm_cpu.py --syncs 3 [--server]
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket as socketlib
import subprocess
import sys
import tempfile
import time
import urllib.request
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


def trainer(rank: int, store: str, hf_dir: str, sizes: dict, socket: str, authkey: bytes, syncs: int, out: str,
            url: str | None = None):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv import Layout
    from mconv.live import build_model, load_hf_weights
    from mconv.live.sync import VLLMEngine, VLLMServerEngine, sync_weights
    from mconv.transport import shm

    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=sizes["tp"],
                                 expert_model_parallel_size=sizes.get("ep", 1),
                                 expert_tensor_parallel_size=sizes.get("etp"))
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    chunks = build_model(hf_dir, Layout(**sizes), dtype=torch.float32, use_cpu_initialization=True)
    load_hf_weights(chunks, hf_dir)
    engine = VLLMEngine(socket, authkey) if url is None else VLLMServerEngine(url)
    timings = shm.connect(socket + ".timings", authkey) if rank == 0 and url is None else None
    rows = []
    for index in range(syncs):
        dist.barrier()
        started = time.perf_counter()
        result = sync_weights(chunks, hf_dir, engine, version=f"bench-{index}", bucket_bytes=BUCKET)
        wall = time.perf_counter() - started
        if rank == 0:
            engine_seconds = shm.request(timings, {"op": "timings"}) if timings is not None else {}
            rows.append({"wall": wall, **result.seconds, "buckets": result.buckets, "bytes": result.bytes,
                         **{f"engine_{k}": v for k, v in engine_seconds.items()}})
    engine.close()
    if timings is not None:
        timings.close()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()


def server_command(hf_dir: Path, port: int) -> list[str]:
    """vLLM's OpenAI server with examples/vllm_sync_engine.py's engine arguments and mconv's backend."""
    from examples.vllm_sync_engine import LLM_ARGS

    flags = [f"--{key.replace('_', '-')}" + ("" if value is True else f"={value}") for key, value in LLM_ARGS.items()
             if key not in ("distributed_executor_backend", "skip_tokenizer_init")]  # vLLM's own defaults there
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--host", "127.0.0.1",
            "--port", str(port), *flags, "--weight-transfer-config", '{"backend": "mconv_shm"}']


def run(name: str, sizes: dict, syncs: int, server: bool) -> list[dict]:
    from tests.test_vllm_server import plugin_metadata

    hf_dir = ROOT / "fixtures" / name
    with tempfile.TemporaryDirectory() as tmp:
        socket, authkey = f"{tmp}/engine.sock", secrets.token_bytes(16)
        (Path(tmp) / "engine.py").write_text(ENGINE)
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'vllm_site'}:{ROOT}"}
        log, url = Path(tmp) / "engine.log", None
        if server:
            with socketlib.socket() as free:
                free.bind(("127.0.0.1", 0))
                port = free.getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
                       PYTHONPATH=f"{env['PYTHONPATH']}:{plugin_metadata(Path(tmp) / 'plugin')}")
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by the example's import: vLLM's default here
        with open(log, "w") as stream:
            engine = subprocess.Popen(server_command(hf_dir, port) if server else
                                      [str(VLLM_PYTHON), f"{tmp}/engine.py", str(hf_dir), socket, authkey.hex()],
                                      stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        try:
            while not (_answers(url) if server else "\nREADY\n" in "\n" + log.read_text()):
                if engine.poll() is not None:
                    raise SystemExit(f"the vLLM engine for {name} stopped:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
            mp.start_processes(trainer, args=(f"{tmp}/store", str(hf_dir), sizes, socket, authkey, syncs,
                                              f"{tmp}/rows.json", url), nprocs=2, start_method="spawn")
            return json.loads((Path(tmp) / "rows.json").read_text())
        finally:
            engine.kill()
            engine.wait()


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/health", timeout=5).close()
        return True
    except OSError:
        return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--server", action="store_true", help="vLLM as its OpenAI server, VLLMServerEngine")
    options = parser.parse_args()
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"no vLLM CPU venv at {VLLM_PYTHON}: run scripts/install-vllm.sh")
    print(f"# {' '.join(sys.argv)}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("| model | layout | sync | buckets | MB | wall ms | gather ms | pack ms | engine wait ms | "
          "vLLM load ms | vLLM finish ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, sizes in MODELS.items():
        layout = "/".join(f"{k.upper()}{v}" for k, v in sizes.items())
        for index, row in enumerate(run(name, sizes, options.syncs, options.server)):
            print(f"| {name} | {layout} | {index + 1} | {row['buckets']} | {row['bytes'] / 1e6:.2f} | "
                  + " | ".join(f"{1000 * row[k]:.0f}" if k in row else "-" for k in (
                      "wall", "gather", "pack", "engine", "engine_load", "engine_finish")) + " |", flush=True)


if __name__ == "__main__":
    main()
