"""vLLM on a GPU (skipped without a GPU or without a CUDA build of vLLM; scripts/bundle-vllm-gpu.sh
makes one that this project's H200 machine can carry, and tests/vllm_gpu_engine.py runs it):

- sync_weights through CUDA IPC (VLLMIPCEngine), into vLLM's own `ipc` weight-transfer backend (engine core
  in the Receiver's process) or mconv's `mconv_shm` backend (vLLM's default engine-core process), leaves vLLM holding,
  bit for bit, what vLLM's own loader makes of the same weights written as HF files, and generating
  the same tokens with the same log-probabilities; a sync whose bucket vLLM refuses (a spoiled
  shape) is aborted, vLLM still generates, and the next sync verifies; tied embeddings too;
- VLLMServerEngine(transport="cuda_ipc") into `vllm serve` on the trainer's GPU (skipped where vLLM's
  server packages are missing: the H200 bundle has none);
- vLLM loads `mcore2hf --quantize fp8` output (Qwen3, Qwen3-MoE, Qwen3.5-VL and Qwen3.5-VL-MoE served text
  only, Qwen3-Next) as FP8 linear layers holding the bytes and scales mconv wrote, and its log-probabilities
  stay within what the rounding of the weights alone explains (transformers on the CPU, same prompts).
"""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mconv.errors import MconvError
from mconv.live.sync import VLLMIPCEngine, sync_weights
from tests.conftest import FIXTURES, ROOT, hf_tensors, plugin_metadata
from tests.test_gpu import _gpu_model, process_group  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (CUDA build)")]


class VLLMProcess:
    """tests/vllm_gpu_engine.py in a subprocess (its log lines are passed on to stderr)."""

    def __init__(self, hf_dir, socket: str | None = None, authkey: bytes | None = None, backend: str = "ipc"):
        served = [socket, authkey.hex(), backend] if socket else []
        env = dict(os.environ)
        if backend == "mconv_shm":  # vLLM's engine-core process finds the backend through mconv's plugin, as installed
            plugin = plugin_metadata(Path(tempfile.mkdtemp()))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT), str(plugin)]))
        self.process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "vllm_gpu_engine.py"), str(hf_dir),
                                         *served], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._answer()

    def _answer(self) -> str:
        for line in self.process.stdout:
            if line.startswith("MCONV "):
                return line[len("MCONV "):].strip()
            sys.stderr.write(line)
        raise RuntimeError(f"vLLM's process ended with status {self.process.wait()}")

    def dump(self, path) -> tuple[dict, dict]:
        """({name: tensor} of every parameter vLLM holds, its answer: tokens, logprobs, version)."""
        from safetensors.torch import load_file

        self.process.stdin.write(json.dumps({"op": "dump", "path": str(path)}) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self._answer())
        return load_file(path), answer

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def differing(a: dict, b: dict) -> list[str]:
    assert sorted(a) == sorted(b)
    return [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(bits(a[n]), bits(b[n]))]


class SpoiledShape(VLLMIPCEngine):
    """Names the first matrix of its third bucket with the shape reversed: vLLM's loader refuses it
    in the middle of the update."""

    spoiled, sent = None, 0

    def _update(self, buffer, entries):
        self.sent += 1
        if self.sent == 3:
            victim = next(e for e in entries if len(e.shape) == 2 and e.shape[0] != e.shape[1])
            entries = [dataclasses.replace(e, shape=e.shape[::-1]) if e is victim else e for e in entries]
            self.spoiled = victim.name
        super()._update(buffer, entries)


@pytest.mark.parametrize("fixture,backend", [("qwen3-tiny", "ipc"), ("qwen3-tiny-tied", "ipc"), ("qwen3-moe-tiny", "ipc"),
                                             ("qwen3-tiny-tied", "mconv_shm"), ("qwen3-moe-tiny", "mconv_shm")])
def test_vllm_ipc_sync_holds_what_vllm_loads(process_group, fixture, backend, tmp_path):  # noqa: F811
    import mconv.live

    hf_dir, authkey, socket = FIXTURES / fixture, os.urandom(16), str(tmp_path / "engine.sock")
    synced = VLLMProcess(hf_dir, socket, authkey, backend)
    try:
        model = _gpu_model(hf_dir).bfloat16()
        mconv.live.load_hf_weights([model], hf_dir)
        before, _ = synced.dump(tmp_path / "before.safetensors")
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)  # an optimizer step's worth of change, everywhere
        mconv.live.save_hf_weights([model], tmp_path / "stepped", hf_dir)
        engine = VLLMIPCEngine(socket, authkey)
        result = sync_weights([model], hf_dir, engine, version="step-1", bucket_bytes=1 << 16, verify=True)
        assert result.buckets > 3, result
        after, synced_answer = synced.dump(tmp_path / "after.safetensors")
        assert synced_answer["version"] == "step-1"
        spoiled = SpoiledShape(socket, authkey)
        with pytest.raises(MconvError, match="weight sync step-bad") as refused:
            sync_weights([model], hf_dir, spoiled, version="step-bad", bucket_bytes=1 << 16)
        spoiled.close()
        print(f"{fixture}: {spoiled.spoiled} sent with its shape reversed: {refused.value}")
        assert spoiled.spoiled is not None
        assert "telling the engine failed" not in str(refused.value)  # the abort itself went through
        _, aborted = synced.dump(tmp_path / "aborted.safetensors")  # vLLM generates after the abort
        assert aborted["version"] == "failed:step-bad"
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1)
        again = sync_weights([model], hf_dir, engine, version="step-2", bucket_bytes=1 << 16, verify=True)
        assert again.buckets == result.buckets
        assert synced.dump(tmp_path / "step-2.safetensors")[1]["version"] == "step-2"
        engine.close()
    finally:
        synced.close()
    fresh = VLLMProcess(tmp_path / "stepped")
    try:
        loaded, loaded_answer = fresh.dump(tmp_path / "loaded.safetensors")
    finally:
        fresh.close()
    assert differing(after, loaded) == []
    assert synced_answer["tokens"] == loaded_answer["tokens"]
    assert synced_answer["logprobs"] == loaded_answer["logprobs"]
    unchanged = set(after) - set(differing(before, after))
    print(f"{fixture}: {len(after)} vLLM parameters, unchanged by the sync: {sorted(unchanged)}")
    assert not unchanged



class VLLMServer:
    """`vllm serve` (its OpenAI server, vLLM's engine core and worker in processes of their own) of
    HF_DIR on this GPU with VLLM_SERVER_DEV_MODE=1 and mconv's backend, found through mconv's plugin
    entry point (a distribution's metadata on its path, as installing mconv gives); its log goes to
    LOG."""

    def __init__(self, hf_dir, log):
        import socket
        import time
        import urllib.request

        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{free.getsockname()[1]}"
        plugin = plugin_metadata(Path(tempfile.mkdtemp()))
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT), str(plugin)]))}
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--host", "127.0.0.1",
             "--port", self.url.rsplit(":", 1)[1], "--dtype", "bfloat16", "--max-model-len", "128", "--enforce-eager",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", str(256 << 20),
             "--gpu-memory-utilization", "0.3", "--enable-prefix-caching", "--attention-backend", "TRITON_ATTN",
             "--weight-transfer-config", '{"backend": "mconv_shm"}'],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.model = str(hf_dir)
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM's server ended with status {self.process.returncode}: "
                                   + Path(log).read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(2)
        self.close()
        raise RuntimeError("vLLM's server did not start in 400 s: " + Path(log).read_text()[-3000:])

    def complete(self) -> dict:
        """Greedy tokens for PROMPTS, their log-probabilities and the prompts' top-5 log-probabilities."""
        import urllib.request

        from tests.vllm_gpu_engine import PROMPTS

        request = urllib.request.Request(
            f"{self.url}/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": self.model, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "logprobs": 0,
                             "prompt_logprobs": 5, "ignore_eos": True, "return_token_ids": True}).encode())
        with urllib.request.urlopen(request, timeout=120) as response:
            choices = sorted(json.loads(response.read())["choices"], key=lambda c: c["index"])
        return {"tokens": [c["token_ids"] for c in choices],
                "logprobs": [c["logprobs"]["token_logprobs"] for c in choices],
                "prompt_logprobs": [c["prompt_logprobs"] for c in choices]}

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def test_vllm_server_takes_cuda_ipc_syncs(process_group, tmp_path):  # noqa: F811
    """VLLMServerEngine with the model on the server's GPU: each bucket one CUDA IPC handle in an
    /update_weights request. The server then answers as a fresh server of the same weights written
    as HF files does (tokens, their log-probabilities, the prompts' top-5), a sync failing at its
    second bucket is aborted (version failed:<v>, the server generating), and the next sync holds."""
    import mconv.live
    from mconv.live.sync import VLLMServerEngine

    missing = [m for m in ("uvicorn", "prometheus_fastapi_instrumentator", "model_hosting_container_standards")
               if importlib.util.find_spec(m) is None]
    if missing:  # vLLM without its server's packages (scripts/bundle-vllm-gpu.sh carries them since 2026-12-03)
        pytest.skip(f"vLLM's OpenAI server needs {', '.join(missing)}, which this environment lacks")

    class BreaksAtSecondBucket(VLLMServerEngine):
        def update(self, bucket):
            if bucket.index == 1:
                raise RuntimeError("injected failure")
            super().update(bucket)

    hf_dir = FIXTURES / "qwen3-tiny-tied"
    server = VLLMServer(hf_dir, tmp_path / "synced.log")
    try:
        model = _gpu_model(hf_dir).bfloat16()
        mconv.live.load_hf_weights([model], hf_dir)
        before = server.complete()
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        mconv.live.save_hf_weights([model], tmp_path / "stepped", hf_dir)
        engine = VLLMServerEngine(server.url, transport="cuda_ipc")
        result = sync_weights([model], hf_dir, engine, version="step-1", bucket_bytes=1 << 16)
        assert result.buckets > 3, result
        synced = server.complete()
        assert engine.version == "step-1"
        broken = BreaksAtSecondBucket(server.url, transport="cuda_ipc")
        with pytest.raises(MconvError, match="weight sync step-bad failed") as refused:
            sync_weights([model], hf_dir, broken, version="step-bad", bucket_bytes=1 << 16)
        assert "telling the engine failed" not in str(refused.value)
        assert broken.version == "failed:step-bad"
        server.complete()  # the server generates after the abort
        sync_weights([model], hf_dir, engine, version="step-2", bucket_bytes=1 << 16)
        assert server.complete() == synced
        engine.close()
        broken.close()
    finally:
        server.close()
    fresh = VLLMServer(tmp_path / "stepped", tmp_path / "fresh.log")
    try:
        loaded = fresh.complete()
    finally:
        fresh.close()
    print(f"served after the sync: {synced['tokens']}; a fresh server of the stepped files: {loaded['tokens']}")
    assert synced == loaded
    assert before["prompt_logprobs"] != synced["prompt_logprobs"]

# vLLM's fused modules and the HF projections they are made of, in order (Qwen3.5's delta-net
# projections: vLLM's Qwen3_5 packed_modules_mapping).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
# vLLM's names of a vision-language model's language model, and the checkpoint's (its hf_to_vllm_mapper).
RENAMED = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))


def written_form(vllm_name: str, written: dict) -> torch.Tensor | None:
    """What vLLM's parameter `vllm_name` holds when it keeps the file's tensors as they are: fused
    projections concatenated along dim 0, experts stacked (w13: gate then up; w2: down)."""
    for ours, theirs in RENAMED:
        if vllm_name.startswith(ours):
            vllm_name = theirs + vllm_name.removeprefix(ours)
    prefix, _, leaf = vllm_name.rpartition(".")
    prefix = prefix.removesuffix(".routed_experts")  # vLLM 0.26's fused-MoE module, inside Qwen3-MoE's experts
    suffix = "_scale_inv" if leaf.endswith("_scale_inv") else ""
    if prefix.endswith(".experts") and leaf.startswith(("w13_weight", "w2_weight")):
        parts = ("gate_proj", "up_proj") if leaf.startswith("w13") else ("down_proj",)
        experts = []
        while all(f"{prefix}.{len(experts)}.{p}.weight{suffix}" in written for p in parts):
            experts.append(torch.cat([written[f"{prefix}.{len(experts)}.{p}.weight{suffix}"] for p in parts]))
        return torch.stack(experts) if experts else None
    if f"{prefix}.{leaf}" in written:  # fused in the checkpoint too (Qwen3-Next's in_proj_qkvz, in_proj_ba)
        return written[f"{prefix}.{leaf}"]
    module, _, proj = prefix.rpartition(".")
    names = [f"{module}.{p}.{leaf}" for p in FUSED.get(proj, (proj,))]
    return torch.cat([written[n] for n in names]) if all(n in written for n in names) else None


def fp8_source(kind: str, where: Path) -> Path:
    """A 128-aligned bf16 checkpoint of `kind` in `where` (every FP8 projection whole 128-row blocks,
    as vLLM's fused FP8 modules need)."""
    from fixtures.make_fixtures import QWEN3_5, make_qwen3, make_qwen3_5, make_qwen3_moe
    from tests.test_fp8 import ALIGNED, MOE
    from tests.test_fp8_qwen3_5 import ALIGNED as ALIGNED_3_5, EXPERTS

    if kind == "qwen3-next":
        return make_qwen3_5(where, seed=3, next=True, intermediate_size=256, **EXPERTS, **ALIGNED_3_5)
    if kind.startswith("qwen3.5"):
        rope = {**QWEN3_5["rope_parameters"], "mrope_section": [8, 4, 4], "mrope_interleaved": True}
        mlp = dict(moe=True, **EXPERTS) if kind.endswith("moe") else dict(intermediate_size=128)
        return make_qwen3_5(where, seed=3, vl=True, rope_parameters=rope, **mlp, **ALIGNED_3_5)
    return make_qwen3(where, **ALIGNED) if kind == "dense" else make_qwen3_moe(where, **MOE)


def gaps(a: list, b: list) -> list[float]:
    """|log p_a(t) - log p_b(t)| at every prompt position, for each token in both top-k's
    (vllm_gpu_engine's "logprobs" form: per prompt, per position, {token: logprob})."""
    return sorted(abs(lp - step_b[t]) for pa, pb in zip(a, b) for step_a, step_b in zip(pa, pb)
                  for t, lp in step_a.items() if t in step_b)


def weight_only_gaps(source: Path, written: dict, where: Path) -> list[float]:
    """The log-probability gaps that quantizing the weights alone causes: transformers (float32, on
    the CPU) on `source` against the same checkpoint with every FP8 weight of `written` dequantized
    by the block formula in plain torch (w = q * scale_inv per 128x128 block), same prompts."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    from tests.vllm_gpu_engine import PROMPTS

    shutil.copytree(source, where)
    for path in where.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name in written and written[name].dtype == torch.float8_e4m3fn:
                scale, q = written[name + "_scale_inv"].float(), written[name].float()
                blocks = q.reshape(scale.shape[0], 128, scale.shape[1], 128) * scale[:, None, :, None]
                tensors[name] = blocks.reshape(q.shape).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})

    def top20(directory) -> list:
        vision = "vision_config" in json.loads((Path(directory) / "config.json").read_text())
        auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(directory, dtype=torch.float32)
        answer = []
        for prompt in PROMPTS:
            with torch.no_grad():
                logprobs = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
            answer.append([{str(t): float(step[t]) for t in step.topk(20).indices.tolist()} for step in logprobs])
        return answer

    return gaps(top20(where), top20(source))


@pytest.mark.parametrize("kind", ["dense", "moe", "qwen3.5-vl", "qwen3.5-vl-moe", "qwen3-next"])
def test_vllm_loads_mcore2hf_fp8_as_fp8(kind, tmp_path):
    from mconv import Layout, hf2mcore, mcore2hf

    source = fp8_source(kind, tmp_path / "bf16")
    hf2mcore(source, tmp_path / "m", Layout(), progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "fp8", progress=False, quantize="fp8")
    written = hf_tensors(tmp_path / "fp8")
    held, answers = {}, {}
    for name in ("fp8", "bf16"):
        engine = VLLMProcess(tmp_path / "fp8" if name == "fp8" else source)
        try:
            held[name], answers[name] = engine.dump(tmp_path / f"{name}.safetensors")
        finally:
            engine.close()
    report = {}
    for name, tensor in held["fp8"].items():
        expected = written_form(name, written)
        report[name] = (str(tensor.dtype), list(tensor.shape),
                        None if expected is None else (str(expected.dtype), list(expected.shape),
                                                       expected.shape == tensor.shape and expected.dtype == tensor.dtype
                                                       and torch.equal(bits(expected), bits(tensor))))
    print(json.dumps(report, indent=1))
    fp8_held = {n for n, t in held["fp8"].items() if t.dtype == torch.float8_e4m3fn}
    fp8_written = {n for n, t in written.items() if t.dtype == torch.float8_e4m3fn}
    scales = {n for n in held["fp8"] if n.endswith("_scale_inv")}
    assert fp8_held and scales and all(report[n][2] and report[n][2][2] for n in fp8_held | scales), report
    assert sum(written_form(n, written).numel() for n in fp8_held) == sum(written[n].numel() for n in fp8_written)
    served = gaps(answers["fp8"]["logprobs"], answers["bf16"]["logprobs"])
    weights_only = weight_only_gaps(source, written, tmp_path / "dequantized")
    median, reference = served[len(served) // 2], weights_only[len(weights_only) // 2]
    print(f"{kind}: FP8 vs bf16 prompt log-probabilities in vLLM, largest gap {served[-1]:.4f}, median {median:.4f} "
          f"over {len(served)}; the weights' quantization alone in transformers: {weights_only[-1]:.4f}, "
          f"{reference:.4f}; greedy tokens {answers['fp8']['tokens']} vs {answers['bf16']['tokens']}")
    # Random tiny models: the weights' rounding alone moves the top-20 tails (delta-net layers carry it
    # along the sequence, MoE routers flip near ties), and vLLM quantizes the activations too (per
    # token group). Measured (median / largest; vLLM on the H200, then the weights alone in
    # transformers on the CPU): Qwen3 0.013 / 0.050 (0.009 / 0.049), Qwen3-MoE 0.010 / 0.071 (0.009 /
    # 0.052), Qwen3.5-VL 0.032 / 0.30 (0.027 / 0.24), Qwen3.5-VL-MoE 0.072 / 0.52 (0.045 / 0.43),
    # Qwen3-Next 0.056 / 0.65 (0.048 / 0.68). The bytes and scales held are checked above; this
    # bounds what vLLM computes with them by what the rounding alone explains.
    assert 0 < median < 2 * reference + 0.01 and served[-1] < 2 * weights_only[-1] + 0.1
