"""mconv.live.sync.VLLMServerEngine against a running vLLM server: vLLM's CPU build started as
`vllm serve` does it (its OpenAI server, the engine core and its worker in processes of their own,
vLLM's default), with VLLM_SERVER_DEV_MODE=1 and the `mconv_shm` weight-transfer backend, which
vLLM finds through mconv's `vllm.general_plugins` entry point (setup.cfg's, installed here as a
distribution's metadata on the server's path). A Megatron trainer (gloo, CPU, Qwen3 with tied
embeddings) syncs new weights into it, and the server's greedy tokens and logprobs then equal
transformers' on those weights (before: they differ; the prompts' prefix blocks are cached, so a
sync without the prefix-cache reset would serve stale answers), also after a trainer that died
mid-sync left the server paused with its update open. A sync that fails mid-way leaves the server
serving with its version "failed:<version>", and the next sync works; a trainer model that is not
the served one, and verify=True, are refused before any bucket."""
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mconv.live.sync import VLLMServerEngine
from tests.conftest import plugin_metadata
from tests.test_lora import VLLM_PYTHON, needs_vllm
from tests.test_weight_sync import BUCKET, MOE, PROMPTS, TIED, perturbed, reference, same

ROOT = Path(__file__).parents[1]


class BreaksAtSecondBucket(VLLMServerEngine):
    def update(self, bucket):
        if bucket.index == 1:
            raise RuntimeError("injected failure")
        super().update(bucket)


def complete(url: str) -> dict:
    """The server's greedy tokens and their logprobs for PROMPTS, and its weight version."""
    request = urllib.request.Request(f"{url}/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": str(TIED), "prompt": PROMPTS, "max_tokens": 8,
                                                      "temperature": 0, "logprobs": 0, "ignore_eos": True,
                                                      "return_token_ids": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        choices = sorted(json.loads(response.read())["choices"], key=lambda c: c["index"])
    with urllib.request.urlopen(f"{url}/weight_info", timeout=60) as response:
        version = json.loads(response.read())["weight_version"]
    return {"tokens": [c["token_ids"] for c in choices], "logprobs": [c["logprobs"]["token_logprobs"] for c in choices],
            "version": version}


def _trainer(tmp: Path, url: str, weights: dict) -> None:
    """One trainer rank (TP1) syncing into the server at `url`; what it saw goes to tmp/seen.json."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from safetensors.torch import load_file

    from mconv import Layout, MconvError
    from mconv.live import build_model, load_hf_weights
    from mconv.live.sync import FlatBucket, sync_weights
    from mconv.transport.flat import layout, pack
    from tests.megatron_oracle import _cpu_shims

    _cpu_shims()
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    ps.initialize_model_parallel(1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    chunks = build_model(TIED, Layout(), dtype=torch.float32, use_cpu_initialization=True)
    engine, seen = VLLMServerEngine(url), {"before": complete(url)}
    # A trainer that dies mid-sync: the server paused, its update open, a bucket loaded. The next sync
    # ends that update and starts its own.
    dead = VLLMServerEngine(url)
    dead.start("dead")
    named = sorted(load_file(Path(weights["step-1"]) / "model.safetensors").items())[:3]
    entries, size = layout(named)
    pack(named, entries, buffer := dead.buffer(0, size, torch.device("cpu")))
    dead.update(FlatBucket("dead", 0, buffer, entries))
    with urllib.request.urlopen(f"{url}/is_paused", timeout=60) as response:
        seen["paused by the dead trainer"] = json.loads(response.read())["is_paused"]
    for step, version, sync_engine in ((1, "step-1", engine), (2, "step-2-broken", BreaksAtSecondBucket(url)),
                                       (2, "step-2", engine)):
        load_hf_weights(chunks, weights[f"step-{step}"])
        try:
            sync_weights(chunks, TIED, sync_engine, version=version, bucket_bytes=BUCKET)
        except MconvError as e:
            seen[f"{version} error"] = str(e)
        seen[version] = complete(url)
    for tag, other in (("mismatch", VLLMServerEngine(url, model_dir=MOE)), ("verify", engine)):
        try:
            sync_weights(chunks, TIED, other, version=tag, bucket_bytes=BUCKET, verify=tag == "verify")
        except MconvError as e:
            seen[f"{tag} error"] = str(e)
    seen["after refusals"] = complete(url)
    engine.close()
    (tmp / "seen.json").write_text(json.dumps(seen))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.slow
@needs_vllm
def test_vllm_server_takes_syncs(tmp_path):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{ROOT / 'tests' / 'vllm_site'}:{ROOT}:{plugin_metadata(tmp_path / 'plugin')}"}
    with open(tmp_path / "server.log", "w") as log:  # a file, not a pipe: vLLM logs more than a pipe holds
        server = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(TIED), "--port", str(port),
             "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", str(64 << 20),
             "--block-size", "32", "--enable-prefix-caching", "--weight-transfer-config", '{"backend": "mconv_shm"}'],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        weights = {f"step-{s}": perturbed(TIED, tmp_path / f"step-{s}", s) for s in (1, 2)}
        old, new1, new2 = reference(TIED), reference(weights["step-1"]), reference(weights["step-2"])
        started = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() - started < 300, \
                    (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        trainer = mp.get_context("spawn").Process(target=_trainer, args=(tmp_path, url, {k: str(v) for k, v in
                                                                                          weights.items()}))
        trainer.start()
        trainer.join(600)
        assert trainer.exitcode == 0, (tmp_path / "server.log").read_text()[-3000:]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert same(seen["before"], old) and not same(seen["before"], new1)
    assert seen["paused by the dead trainer"] is True
    assert same(seen["step-1"], new1) and seen["step-1"]["version"] == "step-1"
    assert seen["step-2-broken error"] == ("weight sync step-2-broken failed; its update was aborted: "
                                           "rank 0: RuntimeError: injected failure")
    assert seen["step-2-broken"]["version"] == "failed:step-2-broken"  # and the server answered
    assert same(seen["step-2"], new2) and seen["step-2"]["version"] == "step-2"
    assert seen["mismatch error"].startswith("weight sync mismatch refused before any bucket was sent: rank 0: the "
                                             "trainer's model does not match the engine's: the engine's model has no ")
    assert "verify=True: VLLMServerEngine cannot read the engine's weights back" in seen["verify error"]
    assert same(seen["after refusals"], new2) and seen["after refusals"]["version"] == "step-2"
