"""mconv.live.sync against a real engine: vLLM's CPU build (its own Python 3.11 process, the
oracle's generation) takes the weights of a Megatron model (gloo, CPU: Qwen3 at TP2 with tied
embeddings, and Qwen3-MoE at TP2/EP2/ETP1 into a second engine) through `sync_weights`, and its
greedy tokens and logprobs then equal transformers' on the same new weights (transformers reads
them from the HF files the trainer loaded them from, not from the sync). Before the sync, and
after a sync without the prefix-cache reset, they differ. A rank that raises mid-sync, and a
trainer model that is not the engine's, are refused on every rank; the next sync works."""
import json
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import FIXTURES, raising_at
from tests.test_lora import VLLM_PYTHON, needs_vllm

TIED = FIXTURES / "qwen3-tiny-tied"
MOE = FIXTURES / "qwen3-moe-tiny"  # 8 experts, top-2, one dense layer
PROMPTS = [[(7 * p + 13 * i) % 300 for i in range(72)] for p in range(3)]  # two full 32-token blocks each: cached
EXAMPLE = Path(__file__).parents[1] / "examples" / "vllm_sync_engine.py"  # the engine side
BUCKET = 40_000  # q, k and v of one layer land in different buckets
SPOILT = "model.layers.1.mlp.down_proj.weight"
SGLANG = Path(__file__).parents[1] / ".sglang"
# Skipped only outside CI (.ci/run installs it), as the vLLM tests.
needs_sglang = pytest.mark.skipif((not SGLANG.is_dir() or not VLLM_PYTHON.is_file()) and not os.environ.get("CI"),
                                  reason="no SGLang at .sglang (scripts/install-sglang.sh)")


def perturbed(source: Path, out: Path, seed: int) -> Path:
    """The HF model with every matrix + 0.15 * randn and every vector * 1.1, in float32."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: (t.float() + 0.15 * torch.randn(t.shape, generator=generator) if t.dim() == 2 else t.float() * 1.1)
               for name, t in sorted(load_file(source / "model.safetensors").items())}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((source / name).read_bytes())
    return out


def reference(hf_dir: Path) -> tuple[list, list]:
    """transformers' greedy tokens and their logprobs (float32) for PROMPTS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPTS), max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[:, len(PROMPTS[0]):]
    logprobs = torch.stack([torch.log_softmax(step, -1) for step in out.logits], 1).gather(2, tokens[..., None])[..., 0]
    return tokens.tolist(), logprobs.tolist()


def same(served: dict, expected: tuple) -> bool:
    tokens, logprobs = expected
    return served["tokens"] == tokens and max(abs(a - b) for s, e in zip(served["logprobs"], logprobs)
                                              for a, b in zip(s, e)) < 1e-4


def _generator(rank: int, socket: str, authkey: bytes, served: dict):
    """generate(tag): rank 0 asks the engine at `socket` to generate and keeps its answer in
    served[tag]; every rank waits for it. And the connection (None off rank 0), to close."""
    import torch.distributed as dist

    from mconv.transport import shm

    gen = shm.connect(socket + ".gen", authkey) if rank == 0 else None

    def generate(tag):
        if rank == 0:
            served[tag] = shm.request(gen, {"op": "generate"})
        dist.barrier()
    return generate, gen


def _moe_syncs(rank: int, socket: str, authkey: bytes, weights: dict) -> dict:
    """Qwen3-MoE at TP2/EP2/ETP1 into the MoE engine: a sync through vLLM's weight-transfer API, then
    one through its reload route, after one parameter of rank 1 moved to a new storage (found as
    the sync reaches it: that rank alone plans anew mid-sync); rank 0 returns what the engine
    served before, after each."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv import Layout
    from mconv.live import build_model, load_hf_weights, schedule
    from mconv.live.sync import VLLMEngine, sync_weights

    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    chunks = build_model(MOE, Layout(tp=2, ep=2, etp=1), dtype=torch.float32, use_cpu_initialization=True)
    served = {}
    generate, gen = _generator(rank, socket, authkey, served)
    generate("before")
    engines = [VLLMEngine(socket, authkey), VLLMEngine(socket, authkey, route="reload")]
    for step, engine in enumerate(engines, 1):
        if step == 2 and rank == 1:  # one parameter of one rank moved since the last sync, before new weights
            planned = schedule._LIVE_CACHE[chunks[0]]  # (those a sync checks up front: one of each bucket, bucket 0's)
            checked = {id(p) for p in planned.up_front.tensors}
            moved = next(p for name, p in chunks[0].named_parameters()  # (an expert's: rank 1's own, gathered)
                         if id(p) not in checked and ".experts." in name)
            moved.data = moved.data.clone()  # (its old storage, which the cached plan reads, keeps moe-1's values)
            del planned
        load_hf_weights(chunks, weights[f"moe-{step}"])
        sync_weights(chunks, MOE, engine, version=f"moe-{step}", bucket_bytes=BUCKET, verify=step == 1)
        generate(f"moe-{step}")
        engine.close()
    if gen is not None:
        gen.close()
    ps.destroy_model_parallel()
    return served


def _trainer(rank: int, tmp: Path, socket: str, authkey: bytes, weights: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv import Layout, MconvError
    from mconv.live import build_model, load_hf_weights, save_hf_weights
    from mconv.live.sync import SharedMemoryEngine, VLLMEngine, agree, core, sync_weights
    from mconv.transport import shm
    from mconv.transport.receiver import ParameterReceiver
    from tests.megatron_oracle import _cpu_shims

    _cpu_shims()
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    moe = _moe_syncs(rank, socket + ".moe", authkey, weights)
    ps.initialize_model_parallel(2)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    chunks = build_model(TIED, Layout(tp=2), dtype=torch.float32, use_cpu_initialization=True)
    engine = VLLMEngine(socket, authkey, reset_prefix_cache=False)
    served, errors = {"moe": moe}, {}
    generate, gen = _generator(rank, socket, authkey, served)

    def refused(tag, action):
        try:
            action()
        except MconvError as e:
            errors[tag] = str(e)

    generate("before")
    load_hf_weights(chunks, weights["step-1"])
    sync_weights(chunks, TIED, engine, version="step-1-stale", bucket_bytes=BUCKET)
    generate("stale")  # the prompts' cached prefix KV is the old weights'
    engine.reset_prefix_cache = True
    sync_weights(chunks, TIED, engine, version="step-1", bucket_bytes=BUCKET)  # a second sync in a row
    generate("step-1")

    # An engine that owns its parameters (a CPU ParameterReceiver on a thread of rank 0), synced and
    # verified twice: the second sync does not plan, check the engine's model, lay out buckets or
    # tell which shards FP8 quantizes before their gathers again, and its new values arrive bit for
    # bit. A receiver that spoils one tensor's load is named.
    from safetensors.torch import load_file
    if rank == 0:
        held = {n: torch.zeros_like(t) for n, t in load_file(Path(weights["step-1"]) / "model.safetensors").items()}
        own = ParameterReceiver(held, socket + ".own", authkey)
        own.start()
        spoilt = SPOILT

        class Spoiling(ParameterReceiver):
            def load(self, buffers):
                super().load(buffers)
                if any(e[0] == spoilt for b in buffers for e in b["entries"]):
                    self.params[spoilt].view(-1)[5] += 1
        Spoiling({n: t.clone() for n, t in held.items()}, socket + ".spoilt", authkey).start()
        from mconv.live import schedule
        from mconv.live.sync import pack

        calls = {name: 0 for name in ("make_plan", "_check", "layout", "_block_aligned")}
        for name in calls:
            module = schedule if name == "_block_aligned" else pack if name == "layout" else agree
            def counted(*args, _name=name, _original=getattr(module, name), **kwargs):
                calls[_name] += 1
                return _original(*args, **kwargs)
            setattr(module, name, counted)
    dist.barrier()
    own_engine = SharedMemoryEngine(socket + ".own", authkey)
    sync_weights(chunks, TIED, own_engine, version="own-1", bucket_bytes=BUCKET, verify=True)
    first = dict(calls) if rank == 0 else None
    load_hf_weights(chunks, weights["step-2"])
    sync_weights(chunks, TIED, own_engine, version="own-2", bucket_bytes=BUCKET, verify=True)
    if rank == 0:
        step2 = load_file(Path(weights["step-2"]) / "model.safetensors")
        errors["own"] = [own.version, first["make_plan"] == first["_check"] == 1 and first["layout"] > 5,
                         {name: calls[name] - first[name] for name in calls},
                         all(torch.equal(held[n], t) for n, t in step2.items())]
    refused("spoilt", lambda: sync_weights(chunks, TIED, SharedMemoryEngine(socket + ".spoilt", authkey),
                                           version="spoilt", bucket_bytes=BUCKET, verify=True))
    own_engine.close()

    if rank == 1:  # rank 1 raises after the second bucket's collectives (rank 0 has sent bucket 1 by then)
        original = core._stage_buckets
        core._stage_buckets = raising_at(original, 1, RuntimeError("injected failure"))
    refused("failure", lambda: sync_weights(chunks, TIED, engine, version="step-2-broken", bucket_bytes=BUCKET))
    if rank == 1:
        core._stage_buckets = original
    generate("failed")
    # A config missing on one node: rank 0 has told vLLM to start; every rank refuses, vLLM is told abort.
    refused("one-rank", lambda: sync_weights(chunks, TIED if rank == 0 else tmp / "missing", engine,
                                             version="one-rank", bucket_bytes=BUCKET))
    refused("int8", lambda: sync_weights(chunks, TIED, engine, version="int8", dtype=torch.int8))  # zeros before
    refused("version", lambda: sync_weights(chunks, TIED, engine, version="step 7\nINFO: forged"))
    refused("version-bytes", lambda: sync_weights(chunks, TIED, engine, version=b"step-7"))
    refused("save-one-rank", lambda: save_hf_weights(chunks, tmp / "never", TIED if rank == 0 else tmp / "missing"))
    import sys
    refused("exit", lambda: sync_weights(chunks, TIED, lambda bucket: sys.exit(3), version="exit"))  # rank 1 hung
    refused("nested", lambda: sync_weights(chunks, TIED, lambda bucket: sync_weights(chunks, TIED, engine,
                                                                                     version="inner"), version="outer"))
    from mconv.live.sync import Engine

    class Unabortable(Engine):  # refuses a bucket, then its abort too
        def update(self, bucket):
            raise RuntimeError("bucket refused")

        def abort(self, version, reason):
            raise RuntimeError("abort refused")
    refused("unabortable", lambda: sync_weights(chunks, TIED, Unabortable(), version="unabortable"))
    sync_weights(chunks, TIED, engine, version="step-2", bucket_bytes=BUCKET, verify=True)  # vLLM's checksums agree
    generate("step-2")

    # A callable engine gets every HF tensor exactly once, bit for bit the HF file's, bucket by bucket.
    from safetensors.torch import load_file
    seen, indices = [], []

    def take(bucket):
        indices.append(bucket.index)
        seen.extend((name, tensor.clone()) for name, tensor in bucket)
    result = sync_weights(chunks, TIED, take, bucket_bytes=BUCKET)
    if rank == 0:
        expected = load_file(Path(weights["step-2"]) / "model.safetensors")
        errors["callable"] = [indices == list(range(result.buckets)) and result.buckets > 5,
                              sorted(n for n, _ in seen) == sorted(expected),
                              all(torch.equal(t, expected[n]) for n, t in seen)]

    # SGLang's disaggregated route: its WeightUpdater (another process) receives every HF tensor once.
    from mconv.live.sync import SGLangDistributedEngine
    sglang = SGLangDistributedEngine(weights["sglang"], master_address="127.0.0.1", master_port=int(weights["port"]),
                                     world_size=2, backend="gloo", timeout=120)
    sync_weights(chunks, TIED, sglang, version="sglang", bucket_bytes=BUCKET)
    sglang.close()
    # And its colocated route: each bucket read by SGLang's update_weights_from_tensor code.
    from mconv.live.sync import SGLangEngine
    torch.multiprocessing.set_sharing_strategy("file_system")  # SGLang's process is no child of this one
    sync_weights(chunks, TIED, SGLangEngine(weights["sglang"], timeout=120), version="sglang-colocated",
                 bucket_bytes=BUCKET)

    other = build_model(FIXTURES / "qwen3-tiny", Layout(tp=2), dtype=torch.float32, use_cpu_initialization=True)
    refused("mismatch", lambda: sync_weights(other, FIXTURES / "qwen3-tiny", engine, version="other"))
    # A CUDA IPC engine for a model on the CPU: refused before it is told anything (no receiver listens there)
    from mconv.live.sync import VLLMIPCEngine
    refused("cpu-ipc", lambda: sync_weights(chunks, TIED, VLLMIPCEngine(socket + ".none", authkey), version="cpu"))
    if rank == 0:  # the Receiver asks the ipc route for no tied lm_head (on a GPU vLLM's is the embedding)
        ipc = VLLMIPCEngine(socket, authkey)
        errors["ipc-expected"] = sorted(set(engine.expected()) ^ set(ipc.expected()))
        ipc.close()
    generate("after-mismatch")

    # The other route: vLLM's reload_weights, fed bucket by bucket.
    load_hf_weights(chunks, weights["step-1"])
    reload = VLLMEngine(socket, authkey, route="reload")
    sync_weights(chunks, TIED, reload, version="step-1-reload", bucket_bytes=BUCKET, verify=True)
    generate("reload")

    # Rank 1 is killed in the middle of a sync (after its first bucket's collectives): rank 0 gets one
    # error at once (gloo: its peer's connection is gone), and vLLM's update (reload route) is aborted.
    if rank == 1:
        (tmp / "rank1.json").write_text(json.dumps({"served": served, "errors": errors}))

        def killed(*args, **kwargs):
            for i, bucket in enumerate(original(*args, **kwargs)):
                if i == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield bucket
        core._stage_buckets = killed
    refused("killed", lambda: sync_weights(chunks, TIED, reload, version="step-3", bucket_bytes=BUCKET))
    served["killed"] = shm.request(gen, {"op": "generate"})
    engine.close()
    reload.close()
    (tmp / "rank0.json").write_text(json.dumps({"served": served, "errors": errors}))


@pytest.mark.slow
@needs_vllm
@needs_sglang
def test_vllm_generates_with_the_synced_weights(tmp_path):
    weights = {"step-1": perturbed(TIED, tmp_path / "step-1", 1), "step-2": perturbed(TIED, tmp_path / "step-2", 2),
               "moe-1": perturbed(MOE, tmp_path / "moe-1", 3), "moe-2": perturbed(MOE, tmp_path / "moe-2", 4)}
    socket, authkey = str(tmp_path / "engine.sock"), secrets.token_bytes(16)
    env = {**os.environ, "PYTHONPATH": f"{Path(__file__).parent / 'vllm_site'}:{Path(__file__).parents[1]}"}
    engines, logs = [], [tmp_path / "engine.log", tmp_path / "engine-moe.log"]
    for hf, address, log in ((TIED, socket, logs[0]), (MOE, socket + ".moe", logs[1])):
        with open(log, "w") as out:  # a file, not a pipe: vLLM logs more than a pipe holds
            engines.append(subprocess.Popen([str(VLLM_PYTHON), str(EXAMPLE), str(hf), address, authkey.hex(),
                                             json.dumps(PROMPTS)], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                            env=env))
    try:
        old, new1, new2 = reference(TIED), reference(weights["step-1"]), reference(weights["step-2"])  # vLLM starts meanwhile
        moe_old, moe_new1, moe_new2 = reference(MOE), reference(weights["moe-1"]), reference(weights["moe-2"])
        sglang, weights["sglang"], weights["port"] = start_sglang(tmp_path)
        engines.append(sglang)
        started = time.monotonic()
        for engine, log in zip(engines, logs):
            while "\nREADY\n" not in "\n" + log.read_text():
                assert engine.poll() is None and time.monotonic() - started < 300, log.read_text()[-3000:]
                time.sleep(0.2)
        context = mp.get_context("spawn")
        trainers = [context.Process(target=_trainer, args=(rank, tmp_path, socket, authkey,
                                                           {k: str(v) for k, v in weights.items()}))
                    for rank in range(2)]
        for trainer in trainers:
            trainer.start()
        # Not join(): torch's shared-memory manager, which rank 0 starts for SGLangEngine's CPU buffers,
        # inherits the trainers' descriptors, their end-of-process pipes too, and lives until SGLang's
        # process, its client, is gone (killed below).
        deadline = time.monotonic() + 600
        while any(t.exitcode is None for t in trainers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [t.exitcode for t in trainers] == [0, -signal.SIGKILL]  # rank 1 killed mid-sync
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    served = ranks[0]["served"]

    from safetensors.torch import load_file
    sglang = torch.load(tmp_path / "sglang.pt")  # SGLang's WeightUpdater, after sync_weights at TP2 by both routes
    step2 = load_file(weights["step-2"] / "model.safetensors")
    assert sorted(sglang["received"]) == sorted(step2) and all(torch.equal(sglang["received"][n], t) for n, t in step2.items())
    assert sorted(sglang["loaded"]) == sorted(step2) and all(torch.equal(sglang["loaded"][n], t) for n, t in step2.items())
    assert ("sglang", False) in sglang["versions"] and sglang["versions"][-1] == ("sglang-colocated", False)
    assert len(sglang["versions"]) > 10

    moe = served["moe"]  # Qwen3-MoE at TP2/EP2: both routes
    assert same(moe["before"], moe_old) and not same(moe["before"], moe_new1)
    assert same(moe["moe-1"], moe_new1) and moe["moe-1"]["version"] == "moe-1"
    assert same(moe["moe-2"], moe_new2) and moe["moe-2"]["version"] == "moe-2"

    assert same(served["before"], old) and not same(served["before"], new1)
    assert not same(served["stale"], new1)  # no prefix-cache reset: old KV for the cached prompt blocks
    assert same(served["step-1"], new1) and served["step-1"]["version"] == "step-1"

    for rank in ranks:  # one error, the same on every rank; the engine knows the update failed
        assert rank["errors"]["failure"] == ("weight sync step-2-broken failed; its update was aborted: "
                                             "rank 1: RuntimeError: injected failure")
    assert served["failed"]["version"] == "failed:step-2-broken"
    for rank in ranks:  # refused on every rank, whichever rank failed (each hung or broke the group before)
        assert rank["errors"]["one-rank"].startswith("weight sync one-rank refused before any bucket was sent: rank 1: ")
        assert "missing" in rank["errors"]["one-rank"]
        assert rank["errors"]["version"] == (
            "weight sync 'step 7\\nINFO: forged' refused before any bucket was sent: rank 0: "
            "version='step 7\\nINFO: forged' is not a version: give a non-empty string of at most 200 printable "
            "characters (a training step, a checkpoint name)")
        assert rank["errors"]["version-bytes"] == (
            "weight sync b'step-7' refused before any bucket was sent: rank 0: version=b'step-7' (bytes) is not a "
            "version: give a str (a checkpoint name) or an int (a training step)")
        assert "missing" in rank["errors"]["save-one-rank"]  # rank 0 got gloo's error before
        assert rank["errors"]["int8"] == ("weight sync int8 refused before any bucket was sent: rank 0: "
                                          "dtype=torch.int8 is not a dtype mconv writes; available: float32, bfloat16, "
                                          "float16")
        assert rank["errors"]["exit"] == ("weight sync exit failed; its update was aborted: rank 0: "
                                          "SystemExit: 3")
        assert rank["errors"]["nested"].startswith("weight sync outer failed; its update was aborted: rank 0: "
                                                   "weight sync inner: another sync_weights is running in this process")
        assert rank["errors"]["unabortable"] == (  # rank 1 too says that the abort failed
            "weight sync unabortable failed; its update was aborted: rank 0: RuntimeError: bucket refused "
            "(and telling the engine failed: rank 0: RuntimeError: abort refused)")
    assert same(served["step-2"], new2) and served["step-2"]["version"] == "step-2"  # the next sync works

    for rank in ranks:  # a 4-layer untied trainer model against the engine's 2-layer tied one: nothing sent
        assert rank["errors"]["mismatch"].startswith(
            "weight sync other refused before any bucket was sent: rank 0: the trainer's model does not match "
            "the engine's: the engine's model has no model.layers.2.input_layernorm.weight")
        assert rank["errors"]["cpu-ipc"] == ("weight sync cpu refused before any bucket was sent: rank 0: "
                                             "VLLMIPCEngine needs the model on a CUDA device; it is on cpu")
    assert served["after-mismatch"] == served["step-2"]
    assert ranks[0]["errors"]["ipc-expected"] == ["lm_head.weight"]
    assert ranks[0]["errors"]["callable"] == [True, True, True]

    assert ranks[0]["errors"]["own"] == ["own-2", True, {"make_plan": 0, "_check": 0, "layout": 0, "_block_aligned": 0},
                                         True]
    for rank in ranks:
        assert rank["errors"]["spoilt"] == ("weight sync spoilt is not verified: rank 0: the engine holds "
                                            f"other bytes than were sent for {SPOILT} (1 of 24 tensors)")
    assert ranks[0]["errors"]["killed"].startswith("weight sync step-3 failed: a trainer rank was lost mid-sync (")
    assert served["killed"]["version"] == "failed:step-3"
    assert same(served["reload"], new1) and served["reload"]["version"] == "step-1-reload"
    assert same(served["killed"], new1)  # and vLLM serves again (the update's lock was released)


SGLANG_READ = """
import sys, torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

# As SGLang's update_weights_from_tensor(load_format="flattened_bucket") on TP rank 1 does.
data = MultiprocessingSerializer.deserialize(open(sys.argv[1]).read().split()[1])
metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                    end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
tensors = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata).reconstruct_tensors()
# The receive buffer SGLang's NCCL flattened_bucket path lays out from names, dtypes and shapes alone.
empty = FlattenedTensorBucket.empty([m.name for m in metadata], [m.dtype for m in metadata],
                                    [m.shape for m in metadata], "cpu")
torch.save({"tensors": {n: t.clone() for n, t in tensors},
            "offsets": [(m.start_idx, m.end_idx) for m in empty.metadata]}, sys.argv[2])
"""


VLLM_PACKED_READ = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from safetensors.torch import save_file
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
from mconv.transport.vllm_receiver import engine_args, packed_update_info
try:
    engine_args("nccl")
    raise SystemExit("engine_args took a backend mconv has no trainer side for")
except ValueError as e:
    assert "'mconv_shm' or 'ipc'" in str(e), e
info = packed_update_info(json.load(open("entries.json")))
buffer = torch.frombuffer(bytearray(open("bucket.bin", "rb").read()), dtype=torch.uint8)
dtypes = [getattr(torch, name) for name in info["dtype_names"]]
tensors = unpack_tensor(buffer, info["names"], info["shapes"], dtypes, info["tensor_sizes"])
save_file({name: tensor.clone() for name, tensor in tensors}, "back.safetensors")
try:
    packed_update_info(json.load(open("aliased.json")))
    print("UNPACKED " + json.dumps(None))
except ValueError as e:
    print("UNPACKED " + json.dumps(str(e)))
"""


@needs_vllm
@pytest.mark.slow
def test_vllm_packed_format_cuts_the_flat_bucket(tmp_path):
    """The update info VLLMIPCEngine's buckets reach vLLM's ipc backend with (packed_update_info:
    names and byte sizes in buffer order), cut by vLLM's own unpack_tensor (the split its
    packed_ipc_consumer makes), gives back exactly the tensors sent, mixed dtypes in mconv's
    widest-first order; a bucket with an alias (tied lm_head sharing the embedding's bytes) is
    refused by name; engine_args refuses a backend mconv does not drive."""
    from safetensors.torch import load_file

    from mconv.transport.flat import layout, pack
    from tests.conftest import ROOT
    from tests.test_lora import run_vllm

    generator = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(63, generator=generator).bfloat16()), ("b", torch.randn(8, 64, generator=generator)),
             ("c", torch.randn(5, 3, generator=generator).half()), ("d", torch.arange(7)),
             ("e", torch.randn(64, 64, generator=generator).to(torch.float8_e4m3fn))]
    entries, nbytes = layout(named)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    pack(named, entries, buffer)
    (tmp_path / "bucket.bin").write_bytes(buffer.numpy().tobytes())
    (tmp_path / "entries.json").write_text(json.dumps([e.to_json() for e in entries]))
    aliased, _ = layout(named, aliases={"lm_head": "b"})
    (tmp_path / "aliased.json").write_text(json.dumps([e.to_json() for e in aliased]))
    refusal = run_vllm(tmp_path, VLLM_PACKED_READ, ROOT, marker="UNPACKED ")
    back = load_file(tmp_path / "back.safetensors")
    for name, tensor in named:
        assert back[name].dtype == tensor.dtype and torch.equal(back[name].view(torch.uint8),
                                                                tensor.view(torch.uint8)), name
    assert refusal == ("bucket entry lm_head shares bytes with b: vLLM's packed format takes tensors back to back, "
                       "each once"), refusal


@needs_sglang
@pytest.mark.slow
def test_sglang_reads_the_flattened_bucket(tmp_path):
    """SGLang's own deserializer and FlattenedTensorBucket, in another process (Python 3.11, another
    torch), read mconv's payload back into exactly the tensors sent, with mixed dtypes (an odd-sized
    bfloat16 tensor first, which unpadded back-to-back packing in that order would misalign)."""
    from mconv.live.sync.engines import FlatBucket
    from mconv.live.sync.sglang import sglang_payload
    from mconv.transport.flat import layout, pack

    torch.multiprocessing.set_sharing_strategy("file_system")  # the reader is no child of this process
    generator = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(63, generator=generator).bfloat16()), ("b", torch.randn(8, 64, generator=generator)),
             ("c", torch.randn(5, 3, generator=generator).half()), ("d", torch.arange(7)),
             ("e", torch.randn(64, 64, generator=generator).bfloat16())]
    entries, nbytes = layout(named)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    pack(named, entries, buffer)
    (tmp_path / "payload.txt").write_text(" ".join(sglang_payload(FlatBucket("v1", 0, buffer, entries), tp_size=2)))
    (tmp_path / "read.py").write_text(SGLANG_READ)
    env = {**os.environ, "PYTHONPATH": f"{SGLANG}:{Path(__file__).parent / 'vllm_site'}"}
    done = subprocess.run([str(VLLM_PYTHON), "read.py", "payload.txt", "back.pt"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    back = torch.load(tmp_path / "back.pt")
    assert list(back["tensors"]) == [e.name for e in entries]
    for name, tensor in named:
        assert back["tensors"][name].dtype == tensor.dtype and torch.equal(back["tensors"][name], tensor), name
    assert back["offsets"] == [(e.offset, e.offset + e.nbytes) for e in entries]


SGLANG_SERVE = """
import http.server, json, sys, torch, pydantic, torch.distributed as dist
from sglang.srt.managers import io_struct
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
from sglang.srt.runtime_context import _CONTEXT
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

# An SGLang worker: its own default group, SGLang's request types (as its HTTP server validates them)
# and its WeightUpdater, joining the trainer's group and receiving each broadcast, or reading each
# update_weights_from_tensor payload as TP rank 0 of SGLang's scheduler does. Its model is a recorder:
# what reaches load_weights is saved for the test.
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
_CONTEXT.set_server_args(ServerArgs(model_path=sys.argv[2], device="cpu"))

class Recorder(torch.nn.Module):
    def load_weights(self, named):
        loaded.update((name, tensor.clone()) for name, tensor in named)

loaded, recorder = {}, Recorder()
updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                        get_model=lambda: recorder, update_model_fields=None, recapture_cuda_graph=None,
                        get_model_runner=None)
TYPES = {"init_weights_update_group": io_struct.InitWeightsUpdateGroupReqInput,
         "update_weights_from_distributed": io_struct.UpdateWeightsFromDistributedReqInput,
         "update_weights_from_tensor": io_struct.UpdateWeightsFromTensorReqInput,
         "begin_weight_update": io_struct.BeginWeightUpdateReqInput, "end_weight_update": io_struct.EndWeightUpdateReqInput,
         "destroy_weights_update_group": io_struct.DestroyWeightsUpdateGroupReqInput,
         "update_weight_version": io_struct.UpdateWeightVersionReqInput}
log, received, versions, session = [], {}, [], []

def serve(route, payload):
    if route.startswith("flush_cache?timeout="):
        return "Cache flushed."
    if route == "begin_weight_update" and session:  # SGLang's scheduler refuses so (weight_updater.py)
        return False, "a weight-update session is already open; call end_weight_update() first"
    if route == "update_weights_from_distributed" and "refused" in payload["names"]:
        return False, "Unaligned received tensor refused"  # as SGLang refuses a bucket before receiving it
    if route.startswith("update_weights_from_") and not session:  # SGLang's words (weight_updater.py)
        return False, f"{route} must run between begin_weight_update() and end_weight_update()"
    session[:] = [True] if route == "begin_weight_update" else [] if route == "end_weight_update" else session
    unknown = set(payload) - set(TYPES[route].__struct_fields__)
    assert not unknown, f"{route}: SGLang has no field {sorted(unknown)}"
    req = pydantic.TypeAdapter(TYPES[route]).validate_python(payload)
    if route == "init_weights_update_group":
        return updater.init_weights_update_group(req.master_address, req.master_port, req.rank_offset,
                                                 req.world_size, req.group_name, req.backend)
    if route == "update_weights_from_distributed":
        tensors = updater.receive_weights_from_distributed(names=req.names, dtypes=req.dtypes, shapes=req.shapes,
                                                           group_name=req.group_name, load_format=req.load_format)
        received.update((name, tensor.clone()) for name, tensor in tensors)
        versions.append((req.load_format, req.flush_cache))
        return True, ""
    if route == "update_weights_from_tensor":  # as SGLang's scheduler and model runner do, on TP rank 0
        monkey_patch_torch_reductions()
        named = MultiprocessingSerializer.deserialize(req.serialized_named_tensors[0])
        versions.append((req.load_format, req.flush_cache))
        return updater.update_weights_from_tensor(named_tensors=named, load_format=req.load_format)
    if route == "update_weight_version":
        versions.append((req.new_version, req.abort_all_requests))
    if route == "destroy_weights_update_group":
        return updater.destroy_weights_update_group(req.group_name)
    return True, ""

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # server_info: SGLang's server arguments, tp_size among them
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"tp_size": 1, "dp_size": 1}).encode())

    def do_POST(self):
        route = self.path.strip("/")
        log.append(route)
        answer = serve(route, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        body = answer.encode() if isinstance(answer, str) else json.dumps(
            {"success": answer[0], "message": answer[1]}).encode()
        self.send_response(200 if isinstance(answer, str) or answer[0] else 400)
        self.end_headers()
        self.wfile.write(body)
        if route == "destroy_weights_update_group" or route.startswith("flush_cache"):  # what came so far, for the test
            torch.save({"log": log, "received": received, "loaded": loaded, "versions": versions}, sys.argv[1] + ".pt")

server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
open(sys.argv[1] + ".port", "w").write(str(server.server_port))
server.serve_forever()
"""


def start_sglang(tmp: Path) -> tuple[subprocess.Popen, str, int]:
    """SGLang's worker (SGLANG_SERVE) in another process, its HTTP address once it listens, and a free
    port for the update group's store. It saves what it received so far to tmp/sglang.pt whenever a
    group goes; the caller kills it."""
    import socket

    (tmp / "serve.py").write_text(SGLANG_SERVE)
    env = {**os.environ, "PYTHONPATH": f"{SGLANG}:{Path(__file__).parent / 'vllm_site'}"}
    with open(tmp / "sglang.log", "w") as log:  # a file, not a pipe, which could fill and stall it
        worker = subprocess.Popen([str(VLLM_PYTHON), "serve.py", str(tmp / "sglang"), str(TIED)], cwd=tmp, env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1200):
        if (tmp / "sglang.port").is_file() and (tmp / "sglang.port").read_text():
            break
        assert worker.poll() is None, (tmp / "sglang.log").read_text()[-3000:]
        time.sleep(0.1)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    return worker, f"http://127.0.0.1:{(tmp / 'sglang.port').read_text()}", port


@needs_sglang
@pytest.mark.slow
def test_sglang_receives_buckets_by_both_routes(tmp_path):
    """SGLang 0.5.23's own request types and weight-update code, in another process (Python 3.11,
    torch 2.13, gloo, no GPU), take mconv's buckets by both routes, exactly (mixed dtypes, FP8 too),
    under the sync's version, between begin and end, with one cache flush:

    - SGLangEngine (colocated): each bucket one update_weights_from_tensor request, read as SGLang's
      TP rank 0 reads it (its deserializer, then WeightUpdater.update_weights_from_tensor with the
      flattened bucket into the model's load_weights), an alias (tied lm_head) too; outside a session
      SGLang's refusal is one line.
    - SGLangDistributedEngine: the update group is made once, each bucket is one request and one
      broadcast. A bucket SGLang cannot lay out (an alias) and a refusal are one line each; a refused
      bucket fails at once and the next goes through a group made anew; an aborted sync ends SGLang's
      session."""
    from mconv import MconvError
    from mconv.live.sync.engines import FlatBucket
    from mconv.live.sync.sglang import SGLangDistributedEngine, SGLangEngine
    from mconv.transport.flat import layout, pack

    worker, url, port = start_sglang(tmp_path)
    strategy = torch.multiprocessing.get_sharing_strategy()
    try:
        generator = torch.Generator().manual_seed(0)
        buckets = [[("a", torch.randn(63, generator=generator).bfloat16()), ("b", torch.randn(8, 64, generator=generator)),
                    ("c", torch.arange(7))],
                   [("d", torch.randn(5, 3, generator=generator).half()),
                    ("e", torch.randn(4, 32, generator=generator).to(torch.float8_e4m3fn))]]
        torch.multiprocessing.set_sharing_strategy("file_system")  # SGLang's process is no child of this one
        SGLangEngine(url).start("v5")  # a trainer that died mid-sync leaves SGLang's session open
        colocated = SGLangEngine(url, timeout=120)
        colocated.start("v6")  # ends it and begins its own
        for index, named in enumerate(buckets):
            entries, nbytes = layout(named, aliases={"lm_head": "a"} if index == 0 else None)
            pack(named, entries, colocated.buffer(index, nbytes, torch.device("cpu")))
            colocated.update(FlatBucket("v6", index, colocated.buffer(index, nbytes, torch.device("cpu")), entries))
        colocated.finish("v6")
        with pytest.raises(RuntimeError, match=r"^SGLang refused update_weights_from_tensor: update_weights_from_"
                                               r"tensor must run between "):
            SGLangEngine(url, session=False).update(FlatBucket("v6", 1, colocated.buffer(1, nbytes, torch.device("cpu")),
                                                               entries))
        colocated.close()
        with pytest.raises(MconvError, match=r"^SGLangEngine needs SGLang at TP 1 \(its server runs tp_size=2\)"):
            SGLangEngine(lambda route, payload: {"tp_size": 2} if route == "server_info" else {}).start("v6")
        loaded = torch.load(tmp_path / "sglang.pt")["loaded"]
        sent = dict(named for bucket in buckets for named in bucket) | {"lm_head": buckets[0][0][1]}
        assert sorted(loaded) == sorted(sent)
        for name, tensor in sent.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name].view(torch.uint8),
                                                                       tensor.view(torch.uint8)), name

        engine = SGLangDistributedEngine(url, master_address="127.0.0.1", master_port=port, world_size=2,
                                         backend="gloo", timeout=120)
        engine.start("v7")
        for index, named in enumerate(buckets):
            entries, nbytes = layout(named)
            buffer = engine.buffer(0, nbytes, torch.device("cpu"))
            pack(named, entries, buffer)
            engine.update(FlatBucket("v7", index, buffer, entries))
        engine.finish("v7")
        engine.start("v8")
        refused = [("refused", torch.ones(3))]
        entries, nbytes = layout(refused)
        pack(refused, entries, engine.buffer(0, nbytes, torch.device("cpu")))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^SGLang refused update_weights_from_distributed: Unaligned "):
            engine.update(FlatBucket("v8", 0, engine.buffer(0, nbytes, torch.device("cpu")), entries))
        assert time.monotonic() - started < 60  # at once, not after the engine's timeout (120 s)
        entries, nbytes = layout(buckets[1])  # the next bucket goes through a group made anew
        pack(buckets[1], entries, engine.buffer(0, nbytes, torch.device("cpu")))
        engine.update(FlatBucket("v8", 1, engine.buffer(0, nbytes, torch.device("cpu")), entries))
        with pytest.raises(MconvError, match=r"^bucket 0: a is not right after the tensor before it "):
            entries, nbytes = layout(buckets[0][1:], aliases={"a": "b"})
            engine.update(FlatBucket("v8", 0, engine.buffer(0, nbytes, torch.device("cpu")), entries))
        engine.abort("v8", "the trainer failed")  # SGLang's session ends: it would refuse the next one
        engine.close()
        assert worker.poll() is None, (tmp_path / "sglang.log").read_text()[-3000:]
    finally:
        worker.kill()
        torch.multiprocessing.set_sharing_strategy(strategy)
    refusing = SGLangDistributedEngine(lambda route, payload: (False, "not now"),  # as sglang.Engine answers
                                       master_address="127.0.0.1", master_port=port, world_size=2)
    with pytest.raises(RuntimeError, match=r"^SGLang refused begin_weight_update: not now$"):
        refusing.start("v9")
    back = torch.load(tmp_path / "sglang.pt")
    assert back["log"] == ["begin_weight_update", "begin_weight_update", "end_weight_update",
                           "begin_weight_update", "update_weights_from_tensor", "update_weights_from_tensor",
                           "end_weight_update", "update_weight_version", "flush_cache?timeout=60.0",
                           "update_weights_from_tensor", "begin_weight_update", "init_weights_update_group", "update_weights_from_distributed",
                           "update_weights_from_distributed", "end_weight_update", "update_weight_version",
                           "flush_cache?timeout=60.0", "begin_weight_update", "update_weights_from_distributed",
                           "destroy_weights_update_group", "init_weights_update_group",
                           "update_weights_from_distributed", "end_weight_update", "destroy_weights_update_group"]
    assert back["versions"] == ([("flattened_bucket", False)] * 2 + [("v6", False)]
                                + [("flattened_bucket", False)] * 2 + [("v7", False), ("flattened_bucket", False)])
    sent = dict(named for bucket in buckets for named in bucket)
    assert sorted(back["received"]) == sorted(sent)
    for name, tensor in sent.items():
        got = back["received"][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_killed_trainers_bucket_files_are_removed():
    """A trainer killed mid-run leaves its shared-memory bucket files (memory held until they are
    removed): the next SharedBuffer.create on the host removes those of processes that are gone,
    and leaves a running process's files, another PID namespace's and files without a process id
    in their name."""
    import sys

    from mconv.transport import shm

    child = subprocess.run([sys.executable, "-c", "import os, signal\nfrom mconv.transport.shm import SharedBuffer\n"
                            "print(SharedBuffer.create(64).path, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)"],
                           capture_output=True, text=True, cwd=Path(__file__).parents[1])
    orphan = child.stdout.split()[0]
    assert child.returncode == -signal.SIGKILL and os.path.exists(orphan), child
    kept = [os.path.join(os.path.dirname(orphan), shm.BUCKET_PREFIX + name)
            for name in ("made-by-an-older-mconv", f"1.{os.path.basename(orphan).split('.')[1]}")]  # namespace 1
    for path in kept:
        open(path, "wb").close()
    live = shm.SharedBuffer.create(64)
    try:
        assert not os.path.exists(orphan)
        assert os.path.exists(live.path) and all(os.path.exists(path) for path in kept)
        assert shm.remove_orphans() == []
    finally:
        live.close()
        for path in kept:
            os.unlink(path)


def test_receiver_aborts_an_update_whose_trainer_is_gone(tmp_path):
    """A receiver does not wait forever for a trainer: a connection that closes mid-update (its
    process died) or a trainer silent for the receiver's timeout aborts the update (lock released,
    the reason named; the version as it was, since nothing was loaded); a trainer does not wait forever for an engine
    that does not answer (RemoteEngine's timeout, an error naming the engine and the request), nor
    twice for a receiver that hangs (after a timed-out request, the update's later requests fail at
    once and the abort is not sent: the closed connection aborts the update once the receiver gets
    to it, and the next update is served)."""
    import threading

    from mconv import MconvError
    from mconv.live.sync import RemoteEngine, SharedMemoryEngine
    from mconv.transport import shm
    from mconv.transport.receiver import ParameterReceiver

    receiver = ParameterReceiver({"w": torch.zeros(4)}, str(tmp_path / "engine.sock"), b"key", timeout=0.5)
    receiver.start()

    def aborted(version, receiver=receiver):
        started = time.monotonic()
        while receiver._failed != version:  # (the last update aborted)
            assert time.monotonic() - started < 5, receiver.failure
            time.sleep(0.02)
        assert not receiver.lock.locked() and receiver.version is None  # (no bucket loaded: the weights as they were)
        return receiver.failure

    gone = SharedMemoryEngine(str(tmp_path / "engine.sock"), b"key")
    gone.start("v1")
    gone.close()
    assert aborted("v1") == "the trainer's connection closed in the middle of update v1"
    silent = SharedMemoryEngine(str(tmp_path / "engine.sock"), b"key")
    silent.start("v2")
    assert aborted("v2") == "no request from the trainer for 0.5 s in the middle of update v2"
    with pytest.raises(MconvError, match=r"^the engine at .*engine.sock refused 'finish': finish without a weight "
                                         r"update in progress \(the last one was aborted"):
        silent.finish("v2")
    silent.close()
    receiver.close()

    class Hung(ParameterReceiver):
        def begin(self, message):
            if message["version"] == "v4":
                time.sleep(1.5)

    hung = Hung({"w": torch.zeros(4)}, str(tmp_path / "hung.sock"), b"key")
    hung.start()
    engine = SharedMemoryEngine(str(tmp_path / "hung.sock"), b"key", timeout=0.5)
    with pytest.raises(RuntimeError, match="did not answer 'start': no reply to 'start' within 0.5 s$"):
        engine.start("v4")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="'finish' not sent, an earlier request of this update got no answer"):
        engine.finish("v4")  # (an update queued behind a hung one likewise): no second wait
    engine.abort("v4", "the start timed out")  # the closed connection aborts it
    assert time.monotonic() - started < 0.25
    assert aborted("v4", hung) == "the trainer's connection closed in the middle of update v4"
    engine.start("v5")  # the next update is served
    engine.abort("v5", "done")
    assert aborted("v5", hung) == "done"
    engine.close()
    hung.close()

    listener = shm.listen(str(tmp_path / "mute.sock"), b"key")
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    with pytest.raises(RuntimeError, match=f"the engine at {tmp_path / 'mute.sock'} did not answer 'start': "
                                           r"no reply to 'start' within 0.3 s$"):
        RemoteEngine(str(tmp_path / "mute.sock"), b"key", timeout=0.3).start("v3")
    listener.close()


def _serve_receiver(address: str, ready) -> None:
    """A ParameterReceiver's process (for a test that kills it)."""
    from mconv.transport.receiver import ParameterReceiver

    ParameterReceiver({"w": torch.zeros(4)}, address, b"good").start()
    ready.set()
    time.sleep(600)


def test_a_receiver_outlives_bad_clients_and_a_trainer_outlives_its_restart(tmp_path):
    """Clients with the wrong key, that close at once or never answer the handshake leave a
    ParameterReceiver serving the next trainer (its accept loop died of the first before); the
    wrong key is said so; connecting to a listener that never answers takes no longer than the
    engine's timeout (it hung); an engine whose receiver's process was killed and started again
    between syncs takes the next sync's first request on a new connection (it failed once), the new
    receiver listening at the socket file the killed one left (EADDRINUSE before); a live listener's
    address is refused naming it."""
    import multiprocessing
    import socket
    import time

    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine
    from mconv.transport import shm

    context = multiprocessing.get_context("spawn")
    address = str(tmp_path / "r.sock")

    def receiver():
        ready = context.Event()
        process = context.Process(target=_serve_receiver, args=(address, ready), daemon=True)
        process.start()
        assert ready.wait(60)
        return process

    process = receiver()
    with pytest.raises(MconvError, match=f"^the engine at {address} refused the connection: another authkey than its "
                                         "receiver's$"):
        SharedMemoryEngine(address, b"bad", timeout=5).expected()
    closed = socket.socket(socket.AF_UNIX)
    closed.connect(address)
    closed.close()
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(address)  # never answers the challenge
    engine = SharedMemoryEngine(address, b"good", timeout=5)
    assert engine.expected() == {"w": [4]}
    process.kill()
    process.join()
    process = receiver()  # at the socket file the killed one left (it was EADDRINUSE)
    assert engine.expected() == {"w": [4]}
    process.kill()
    silent.close()

    mute = socket.socket(socket.AF_UNIX)
    mute.bind(str(tmp_path / "mute.sock"))
    mute.listen()
    with pytest.raises(OSError, match="cannot listen at .*mute.sock: .* in use .another receiver listens there"):
        shm.listen(str(tmp_path / "mute.sock"), b"good")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no answer from .* within 0.5 s while connecting"):
        SharedMemoryEngine(str(tmp_path / "mute.sock"), b"good", timeout=0.5).expected()
    assert time.monotonic() - started < 5
    mute.close()


def _reference_checksum(tensor: torch.Tensor) -> int:
    """The checksum flat.checksums documents, computed by numpy: sum of int16 words w[i] of the
    bytes (little-endian, a zero byte appended to an odd count) times (i % 65521 + 1)."""
    import numpy as np

    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    words = np.frombuffer(raw + b"\0" * (len(raw) % 2), dtype="<i2").astype(np.int64)
    return int((words * (np.arange(len(words)) % 65521 + 1)).sum())


CHECKED = [("a", (63,), torch.bfloat16), ("b", (100, 257), torch.float32), ("c", (7,), torch.uint8),
           ("d", (10,), torch.int8), ("e", (), torch.float32), ("f", (0,), torch.float32),
           ("g", (70001,), torch.float8_e4m3fn), ("h", (3,), torch.bool), ("i", (5, 4), torch.float16)]


@pytest.mark.parametrize("chunk", [1000, None])
def test_checksums_are_exact_and_batched(monkeypatch, chunk):
    """flat.checksums equals numpy's computation of its formula for every dtype a bucket holds,
    as separate tensors and as views of a flat bucket (1-byte tensors at odd offsets included,
    which could not be viewed as int16 word by word), whether the tensors are split across chunks
    (chunk=1000 words) or share one; and its work is a few operators per chunk, not per tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mconv.transport import flat

    if chunk:
        monkeypatch.setitem(flat._CHUNK, "cpu", chunk)
    generator = torch.Generator().manual_seed(0)
    named = [(name, (torch.randn(shape, generator=generator) * 100).to(dtype)) for name, shape, dtype in CHECKED]
    named.append(("t", torch.randn(4, 6, generator=generator).t()))  # not contiguous
    expected = {name: _reference_checksum(t) for name, t in named}
    entries, nbytes = flat.layout(named)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    flat.pack(named, entries, buffer)
    assert any(e.offset % 2 and not e.nbytes % 2 for e in entries)
    assert flat.checksums(named) == expected
    assert flat.checksums(flat.unpack(buffer, entries)) == expected
    if chunk:
        return

    class Kernels(TorchDispatchMode):  # operators that compute (each a kernel launch on a GPU), not views
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Kernels.calls += not func.is_view
            return func(*args, **(kwargs or {}))

    many = [(str(i), torch.full((i % 5 + 1, 8), i, dtype=torch.bfloat16)) for i in range(400)]
    with Kernels():
        flat.checksums(many)
    assert Kernels.calls < 20


def test_verify_names_a_changed_byte_and_swapped_tensors(tmp_path):
    """verify's comparison (sync_weights' _compare) against a CPU ParameterReceiver that, after
    loading a bucket, changes one byte of one tensor and swaps two tensors of the same size: it
    names exactly those three."""
    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine, core
    from mconv.transport.flat import checksums, layout, pack
    from mconv.transport.receiver import ParameterReceiver

    generator = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(16, 8, generator=generator).bfloat16()) for i in range(6)]
    named.append(("odd", torch.randint(0, 255, (5,), dtype=torch.uint8, generator=generator)))

    class Spoiling(ParameterReceiver):
        def load(self, buffers):
            super().load(buffers)
            self.params["w1"].view(torch.uint8).view(-1)[3] += 1
            self.params["w2"], self.params["w4"] = self.params["w4"], self.params["w2"]

    receiver = Spoiling({name: torch.zeros_like(t) for name, t in named}, str(tmp_path / "engine.sock"), b"key")
    receiver.start()
    engine = SharedMemoryEngine(str(tmp_path / "engine.sock"), b"key")
    entries, nbytes = layout(named)
    pack(named, entries, engine.buffer(0, nbytes, torch.device("cpu")))
    engine.start("v1", verify=True)
    engine.update(core.FlatBucket("v1", 0, engine.buffer(0, nbytes, torch.device("cpu")), entries))
    engine.finish("v1")
    with pytest.raises(MconvError, match=r"^the engine holds other bytes than were sent for w1, w2, w4 \(3 of 7 "
                                         r"tensors\)$"):
        core._compare(engine, checksums(named))
    engine.close()
    receiver.close()


def test_a_bucket_layout_travels_once_per_connection(tmp_path, monkeypatch):
    """A layout's entries cross once per connection: the second update of the same layout carries
    only its number, a new connection carries them again (and the receiver keeps one plan for it),
    and the receiver's parameters equal the sent tensors after every update. A number never sent is
    refused in one line, and so is a bucket not packed into the engine's own buffers."""
    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine, core
    from mconv.transport import shm
    from mconv.transport.flat import layout, pack
    from mconv.transport.receiver import ParameterReceiver

    sent = []
    request = shm.request
    monkeypatch.setattr(shm, "request", lambda conn, message, timeout=None: (
        sent.append(message.get("buffers")), request(conn, message, timeout))[1])
    generator = torch.Generator().manual_seed(0)
    names = ("a", "b", "c")
    receiver = ParameterReceiver({name: torch.zeros(4, 3) for name in names}, str(tmp_path / "engine.sock"), b"key")
    receiver.start()
    engine = SharedMemoryEngine(str(tmp_path / "engine.sock"), b"key")
    entries = None
    for step in range(3):
        named = [(name, torch.randn(4, 3, generator=generator)) for name in names]
        if entries is None:
            entries, nbytes = layout(named)
        if step == 2:  # the connection is lost: the next update opens another
            engine._conn.close()
            engine._conn = None
        pack(named, entries, engine.buffer(0, nbytes, torch.device("cpu")))
        engine.start(f"v{step}")
        engine.update(core.FlatBucket(f"v{step}", 0, engine.buffer(0, nbytes, torch.device("cpu")), entries))
        engine.finish(f"v{step}")
        assert all(torch.equal(receiver.params[name], tensor) for name, tensor in named)
    assert ["entries" in buffers[0] for buffers in sent if buffers] == [True, False, True]
    assert len(receiver._plans) == 1  # one copy plan for the layout, whichever connection sent it
    engine.start("v3")
    with pytest.raises(MconvError, match=r"^the engine at .*engine.sock refused 'update': bucket layout 7 was never "
                                         r"sent on this connection$"):
        engine._request({"op": "update", "buffers": [{"path": "unused", "layout": 7}]})
    with pytest.raises(ValueError, match=r"^bucket 0 is not in a buffer this engine's buffer\(\) gave$"):
        engine.update(core.FlatBucket("v3", 0, torch.zeros(nbytes, dtype=torch.uint8), entries))
    engine.close()
    receiver.close()


def test_fresh_buffers_let_the_old_ones_go():
    """An engine that takes new bucket buffers at every sync (vLLM's CUDA IPC route) drops sync_weights'
    copy plans into the old ones, which hold views of them: otherwise 2 x bucket_bytes stayed
    allocated between syncs (the plans' cache was renamed once and the release missed it)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from mconv.live.sync import CallableEngine
    from mconv.live.sync.pack import _pack
    from mconv.live.sync.vllm import _fresh_cuda_buffers

    engine = CallableEngine(lambda bucket: None)
    named = [("a", torch.ones(8)), ("b", torch.zeros(3, dtype=torch.bfloat16))]
    _, buffer = _pack(engine, 0, named, None, torch.device("cpu"))
    old = StorageWeakRef(buffer.untyped_storage())
    del buffer
    _fresh_cuda_buffers(engine)
    assert old.expired()


TINY = FIXTURES / "qwen3-tiny"  # untied, 4 layers, bf16


def _exported_dtypes(chunks, hf, **options) -> dict:
    """{HF name: dtype} of what this rank's stage exports with these sync_weights options: the real
    export (iter_hf_weights), the oracle of what a sync sends."""
    from mconv.live import iter_hf_weights

    return {name: t.dtype for bucket in iter_hf_weights(chunks, hf, **options) for name, t in bucket}


def _dtypes_worker(rank: int, tmp: str) -> None:
    """The ranks of test_dtypes_are_agreed_before_any_bucket."""
    import re

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from safetensors.torch import load_file

    from mconv import Layout, MconvError
    from mconv.converter import fp8
    from mconv.live import build_model, clear_cache, iter_hf_weights, load_hf_weights
    from mconv.live.chunks import _config
    from mconv.live.export import DEFAULT_BUCKET_BYTES
    from mconv.live.schedule import _prepared
    from mconv.live.sync import CallableEngine, SharedMemoryEngine, agree, core, sync_weights
    from mconv.mappings import architecture_for
    from mconv.mappings.schema import Architecture
    from mconv.transport.flat import dtype_name
    from mconv.transport.receiver import ParameterReceiver
    from tests.megatron_oracle import _cpu_shims

    _cpu_shims()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)

    def bf16_model(hf, layout, **sizes):
        ps.initialize_model_parallel(**sizes)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        chunks = build_model(hf, layout, dtype=torch.bfloat16, use_cpu_initialization=True)
        load_hf_weights(chunks, hf)
        return chunks

    class Recorder(CallableEngine):  # what a sync hands the engine (tied lm_head too, as vLLM's): the oracle
        sends_tied_lm_head = True

        def __init__(self):
            super().__init__(self.record)
            self.got, self.tensors = {}, {}

        def record(self, bucket):
            self.got.update((e.name, e.dtype) for e in bucket.entries)
            self.tensors.update((name, t.clone()) for name, t in bucket)

    def sent(chunks, hf, **options) -> dict:
        """On the sender (rank 0), the dtypes it expects to send are those a real sync sends (returned)."""
        recorder = Recorder()
        sync_weights(chunks, hf, recorder, **options)
        exported = {name: t for bucket in iter_hf_weights(chunks, hf, **options) for name, t in bucket}
        if rank == 0:  # the bytes are the export's (FP8: quantized in the sync's packing)
            assert all(torch.equal(t.view(torch.uint8), recorder.tensors[name].view(torch.uint8))
                       for name, t in exported.items()) and exported.keys() <= recorder.tensors.keys(), options
            config = _config(hf, None)
            live, _ = _prepared(chunks, config, DEFAULT_BUCKET_BYTES)
            quantization = fp8.writer_quantization(architecture_for(config), options.get("quantize"), None, config)
            expected = agree._sent_dtypes(live, options.get("dtype"), quantization, bool(config["tie_word_embeddings"]))
            assert {name: dtype_name(dtype) for name, dtype in expected.items()} == recorder.got, options
            assert options or set(recorder.got.values()) == {"bfloat16", "float32"}  # bf16, norms float32
        return recorder.got

    # The MoE at TP2/EP2/ETP1 (rank 0 sends its EP peer's experts too), cast or not, FP8 or not, and
    # with its router weights kept in float32 by a cast (as BailingMoeV3's expert_bias is: transforms.cast_dtype)
    chunks = bf16_model(MOE, Layout(tp=2, ep=2, etp=1), tensor_model_parallel_size=2, expert_model_parallel_size=2,
                        expert_tensor_parallel_size=1)
    for options in ({}, {"dtype": torch.float32}, {"dtype": torch.bfloat16}, {"quantize": "fp8"},
                    {"quantize": "fp8", "dtype": torch.bfloat16}):
        sent(chunks, MOE, **options)
    fp32_kind = Architecture.fp32_kind
    Architecture.fp32_kind = lambda arch, name: "mlp.gate.weight" if name.endswith("mlp.gate.weight") else None
    clear_cache(chunks)  # what a sync worked out of the model (with the table's rules) goes
    kept = sent(chunks, MOE, dtype=torch.bfloat16)
    Architecture.fp32_kind = fp32_kind
    if rank == 0:  # the sender
        assert kept["model.layers.0.mlp.gate.weight"] == "float32"
    ps.destroy_model_parallel()
    chunks = bf16_model(TIED, Layout(tp=2), tensor_model_parallel_size=2)  # lm_head.weight sent as the embedding
    sent(chunks, TIED)
    ps.destroy_model_parallel()

    # A bf16 model at PP2 (each rank a stage and its sender) into ParameterReceivers on rank 0.
    chunks = bf16_model(TINY, Layout(pp=2), pipeline_model_parallel_size=2)
    checkpoint = load_file(TINY / "model.safetensors")  # bf16, as an engine holds it
    mine = _exported_dtypes(chunks, TINY)  # this stage's tensors, the norms float32 (megatron-core's)
    receivers = {}
    if rank == 0:
        generator = torch.Generator().manual_seed(0)

        def receiver(key, dtypes):  # random parameters, to tell any write
            params = {name: torch.randn(t.shape, generator=generator).to(dtypes[name]) for name, t in checkpoint.items()}
            receivers[key] = ParameterReceiver(params, f"{tmp}/{key}.sock", b"key")
            receivers[key].start()
            return {name: t.clone() for name, t in params.items()}

        # "stage-0": holds stage 0's tensors in the dtypes stage 0 sends: only rank 1 (stage 1) is refused
        before = {"bf16": receiver("bf16", {name: t.dtype for name, t in checkpoint.items()}),
                  "stage-0": receiver("stage-0", {name: mine.get(name, t.dtype) for name, t in checkpoint.items()})}
    dist.barrier()
    refusals = {}
    for key in ("bf16", "stage-0"):
        with pytest.raises(MconvError) as refused:
            sync_weights(chunks, TINY, SharedMemoryEngine(f"{tmp}/{key}.sock", b"key"), version=key)
        refusals[key] = str(refused.value)
    # The oracle: the names each stage's export sends in float32, against the engine's bfloat16.
    sent_fp32 = [None, None]
    dist.all_gather_object(sent_fp32, sorted(name for name, dtype in mine.items() if dtype == torch.float32))
    for key, stage in (("bf16", 0), ("stage-0", 1)):
        named = sent_fp32[stage]
        assert refusals[key] == (
            f"weight sync {key} refused before any bucket was sent: rank {stage}: the trainer's model does not "
            "match the engine's: " + "; ".join(f"{name} is sent as float32, the engine holds bfloat16"
                                               for name in named[:3])
            + f"; and {len(named) - 3} more: pass sync_weights(dtype=torch.bfloat16) (the engine copies the bytes it "
            "gets, uncast)"), refusals[key]
    if rank == 0:  # no bucket reached the receivers: every byte as it was
        for key, params in before.items():
            assert all(torch.equal(receivers[key].params[n], t) for n, t in params.items())
            assert not receivers[key].lock.locked()
        assert receivers["bf16"].version is None  # refused by rank 0: never told to start
        # rank 0 had started the update when rank 1's refusal was agreed on: aborted, with rank 1's reason,
        # the version as it was (nothing was loaded)
        assert receivers["stage-0"].version is None
        assert refusals["stage-0"].endswith(receivers["stage-0"].failure)

    # With dtype= the engine's: synced and verified (twice: the second agrees from the cached
    # replies), the receiver holding the checkpoint bit for bit; an int version is a training step.
    engine = SharedMemoryEngine(f"{tmp}/bf16.sock", b"key")
    assert engine.dtypes() is engine.dtypes()  # the receiver's unchanged: nothing compared again
    for version in ("step-1", 2):
        result = sync_weights(chunks, TINY, engine, version=version, dtype=torch.bfloat16, verify=True,
                              bucket_bytes=64 << 10)
        assert result.buckets > 1 and result.version == str(version)
    for version, kind in ((b"v1", "bytes"), (True, "bool"), (["a"], "list")):
        with pytest.raises(MconvError, match=rf"^weight sync .* refused before any bucket was sent: rank 0: version="
                                             rf".* \({kind}\) is not a version: give a str \(a checkpoint name\) or an "
                                             r"int \(a training step\)$"):
            sync_weights(chunks, TINY, engine, version=version, dtype=torch.bfloat16)
    with pytest.raises(MconvError, match=r"refused before any bucket was sent: rank 0: model chunk 0 is a Linear, not a "
                                         r"megatron-core model"):
        sync_weights([torch.nn.Linear(2, 2)], TINY, engine)
    # Ranks disagreeing on bucket_bytes (their collectives would not line up): refused on both.
    with pytest.raises(MconvError, match=r"refused before any bucket was sent: the ranks called sync_weights with "
                                         r"different bucket_bytes, dtype, quantize, fp8_scale or verify: pass the same"):
        sync_weights(chunks, TINY, engine, dtype=torch.bfloat16, bucket_bytes=(64 << 10) * (rank + 1))
    # One rank's engine or verify that sync_weights does not take: refused on both ranks (rank 0
    # waited for rank 1 in a collective before); fp8_scale None and "float" are the same argument.
    for bad, said in (({"engine": None}, "rank 1: engine is None: pass an mconv.live.sync Engine"),
                      ({"verify": "yes"}, "rank 1: verify='yes': give True or False")):
        with pytest.raises(MconvError, match=r"refused before any bucket was sent: " + re.escape(said)):
            sync_weights(chunks, TINY, **{"engine": engine, "verify": False, **(bad if rank == 1 else {})},
                         dtype=torch.bfloat16)
    sync_weights(chunks, TINY, lambda bucket: None, quantize="fp8", fp8_scale="float" if rank else None)
    # An interrupted sync (Ctrl-C, caught): the engine's update is aborted at once, not at its timeout.
    original = core._stage_buckets
    core._stage_buckets = raising_at(original, 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        sync_weights(chunks, TINY, engine, version="interrupted", dtype=torch.bfloat16, bucket_bytes=64 << 10)
    core._stage_buckets = original
    if rank == 0:
        assert receivers["bf16"].version == "failed:interrupted" and not receivers["bf16"].lock.locked()
    # An engine holding the model's own mixed dtypes (norms float32): a cast to bfloat16 is refused,
    # saying to leave dtype= out; without it, synced and verified.
    if rank == 0:
        receiver("mixed", {name: torch.float32 if name in sent_fp32[0] + sent_fp32[1] else t.dtype
                           for name, t in checkpoint.items()})
    dist.barrier()
    mixed = SharedMemoryEngine(f"{tmp}/mixed.sock", b"key")
    with pytest.raises(MconvError, match=r"is sent as bfloat16, the engine holds float32.*: leave dtype= out \(the "
                                         r"model's own dtypes are the engine's\)"):
        sync_weights(chunks, TINY, mixed, dtype=torch.bfloat16)
    sync_weights(chunks, TINY, mixed, version="mixed", verify=True)
    engine.close()
    mixed.close()
    if rank == 0:
        bf16 = receivers["bf16"]
        assert bf16.version == "failed:interrupted" and receivers["mixed"].version == "mixed"
        assert all(torch.equal(bf16.params[n], t) for n, t in checkpoint.items())
        for receiver in receivers.values():
            receiver.close()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_dtypes_are_agreed_before_any_bucket(tmp_path):
    """A bf16 megatron-core model keeps its norms in float32; a ParameterReceiver copies bytes into
    its own (bf16) parameters and needs the exact dtype. A sync that would send another dtype is
    refused on every rank before any bucket: each pipeline stage's sender checks its own stage's
    tensors (at PP2, a receiver matching stage 0 is refused by rank 1), the message names the
    tensors (up to 3; the oracle: what iter_hf_weights sends) and the cast to pass, and the
    receiver's parameters keep every byte. With dtype=torch.bfloat16 the same receiver is synced
    and verified, bit for bit the checkpoint. What a sender expects to send equals what the export
    sends, with and without cast and FP8 (the MoE at TP2/EP2: experts of both EP ranks). A version
    that is no str or int is refused; an int is sent as its decimal string."""
    from tests.ranks import start_ranks

    start_ranks(_dtypes_worker, args=(str(tmp_path),), nprocs=2)


def test_engine_and_address_mistakes_are_one_sentence(tmp_path):
    """What is no engine, an address nobody listens at (no socket file, a name that is no path and
    no host:port, a socket file left without a listener, a refused port) and a key that is no bytes
    are one MconvError each, saying what to pass; the engines it names are mconv.live.sync's. A
    receiver given a str key refuses it at once (each connection failed, silently, before)."""
    import re
    import socket

    import mconv.live.sync
    from mconv import MconvError
    from mconv.live.sync import SharedMemoryEngine, sync_weights
    from mconv.live.sync.engines import as_engine
    from mconv.transport.receiver import ParameterReceiver

    for engine, message in ((None, r"engine is None: pass an mconv.live.sync Engine \(VLLMEngine, SharedMemoryEngine, "
                                   r"IPCEngine, ...\) or a callable taking each FlatBucket$"),
                            ("/tmp/engine.sock", r"engine='/tmp/engine.sock' is an address, not an engine: pass "
                                                 r"SharedMemoryEngine\('/tmp/engine.sock', authkey\) for a "
                                                 r"ParameterReceiver on this host, IPCEngine\("),
                            ("http://127.0.0.1:8000", r"engine='http://127.0.0.1:8000' is an address, not an engine: pass "
                                                      r"VLLMServerEngine\('http://127.0.0.1:8000'\) for a running vLLM "
                                                      r"server or SGLangEngine\(")):
        with pytest.raises(MconvError, match="^" + message) as refused:
            as_engine(engine)  # (sync_weights' refusal on every rank: test_dtypes_are_agreed_before_any_bucket)
        assert all(hasattr(mconv.live.sync, name) for name in re.findall(r"(\w+Engine)\(", str(refused.value)))
    with pytest.raises(MconvError, match=r"^SharedMemoryEngine: authkey is a str; give the key as bytes"):
        SharedMemoryEngine(str(tmp_path / "engine.sock"), "key")
    with pytest.raises(MconvError, match=r"^engine is the class SharedMemoryEngine, not an engine: make one"):
        as_engine(SharedMemoryEngine)
    for timeout in ("10", 0, -1, True):
        with pytest.raises(MconvError, match=rf"^SharedMemoryEngine: timeout={timeout!r}; give the seconds"):
            SharedMemoryEngine(str(tmp_path / "engine.sock"), b"key", timeout=timeout)
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises(MconvError, match=r"^sync_weights runs on every rank of an initialized process group"):
        sync_weights([], FIXTURES / "qwen3-tiny", lambda bucket: None)
    from mconv.live import iter_hf_weights
    with pytest.raises(MconvError, match=r"^initialise megatron-core's parallel_state first"):
        next(iter_hf_weights([torch.nn.Linear(2, 2)], FIXTURES / "qwen3-tiny"))
    with pytest.raises(MconvError, match=r"^hf_config \(a dict\) has neither 'architectures' nor 'model_type'"):
        next(iter_hf_weights([torch.nn.Linear(2, 2)], {}))
    # A model whose tensors lie on two devices (a model built on a GPU outside torch.device("cuda")
    # keeps megatron-core's local norms on the CPU; here "meta" stands in for the GPU)
    from types import SimpleNamespace

    from mconv.live.sync import agree
    mixed = SimpleNamespace(tensors=[{"embedding.word_embeddings.weight": torch.zeros(2)},
                                     {"decoder.final_layernorm.weight": torch.zeros(2, device="meta")}])
    with pytest.raises(MconvError, match=r"^the model's tensors lie on cpu \(embedding.word_embeddings.weight, ...\) "
                                         r"and meta \(decoder.final_layernorm.weight, ...\): move the whole model"):
        agree._model_device(mixed)
    assert agree._model_device(SimpleNamespace(tensors=[{"w": torch.zeros(2)}])) == torch.device("cpu")
    with pytest.raises(TypeError, match=r"^authkey is a str; give the key as bytes"):
        ParameterReceiver({"w": torch.zeros(1)}, str(tmp_path / "engine.sock"), "key")
    odd = ParameterReceiver({"w": torch.zeros(2, dtype=torch.uint16)}, str(tmp_path / "odd.sock"), b"key")
    odd.start()
    with pytest.raises(MconvError, match=r"^the engine at .*odd.sock holds w in uint16, a dtype no bucket carries$"):
        SharedMemoryEngine(str(tmp_path / "odd.sock"), b"key", timeout=5).dtypes()
    odd.close()

    stale = str(tmp_path / "stale.sock")
    socket.socket(socket.AF_UNIX).bind(stale)  # a socket file nobody listens at (a receiver that was killed)
    for address, message in ((str(tmp_path / "none.sock"), f"nothing listens at {tmp_path / 'none.sock'}: no such "
                                                           "socket file (start the receiver first)"),
                             ("localhost", "'localhost' is neither an existing Unix socket nor host:port (start the "
                                           "receiver first, or give its host:port)"),
                             (stale, f"nothing listens at {stale} (start the receiver first)"),
                             ("127.0.0.1:1", "nothing listens at 127.0.0.1:1 (start the receiver first)")):
        with pytest.raises(MconvError) as refused:
            SharedMemoryEngine(address, b"key", timeout=5).expected()
        assert str(refused.value) == message


def test_a_model_mismatch_names_three_and_counts_the_rest():
    """The refusal of a trainer model that does not match the engine's names three tensors of each
    kind and counts the rest (it ended in "..."); an FP8 sync into an engine that holds no FP8
    weights (names its `_scale_inv` tensors unknown) says what such an engine must hold."""
    from mconv import MconvError
    from mconv.live.sync.agree import _check

    engine = {f"model.layers.{i}.mlp.down_proj.weight": [8, 4] for i in range(5)}
    sent = {**engine, **{f"model.layers.{i}.mlp.down_proj.weight_scale_inv": [1, 1] for i in range(5)}}
    with pytest.raises(MconvError) as refused:
        _check(engine, sent)
    assert str(refused.value) == (
        "the trainer's model does not match the engine's: the engine's model has no "
        "model.layers.0.mlp.down_proj.weight_scale_inv, model.layers.1.mlp.down_proj.weight_scale_inv, "
        "model.layers.2.mlp.down_proj.weight_scale_inv and 2 more; with quantize=\"fp8\" the engine holds each "
        "quantized weight as float8_e4m3fn with a float32 _scale_inv beside it (the tensors "
        "iter_hf_weights(quantize=\"fp8\") yields): give it those, or sync without quantize")
    with pytest.raises(MconvError, match=r"^the trainer's model does not match the engine's: the trainer does not "
                                         r"send model.layers.0.mlp.down_proj.weight, .* and 2 more$"):
        _check(engine, {})
