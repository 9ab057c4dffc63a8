"""The live-engine API on a GPU (skipped without one): a megatron-core GPTModel on the device,
loaded with load_hf_weights through the pinned staging path, gives back every HF tensor bit for
bit through iter_hf_weights, and its forward matches transformers; sync_weights' CUDA IPC path
puts every tensor bit for bit into another process's preallocated parameters."""
import multiprocessing
import os
import tempfile

import pytest
import torch

from tests.conftest import FIXTURES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        yield
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _gpu_model(hf_dir):
    """megatron-core's GPTModel for the fixture `hf_dir`, on the GPU (weights not loaded)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.megatron_oracle import MegatronRun, _transformer_config, read_config

    hf_config = read_config(hf_dir)
    config, theta = _transformer_config(MegatronRun(hf_dir, hf_config))
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", qk_l2_norm=False)
    with torch.device("cuda"):
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=384, max_sequence_length=256,
                        position_embedding_type="rope", rotary_base=theta, parallel_output=False,
                        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings"))).eval()


@pytest.mark.parametrize("fixture", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_gpu_load_and_export_are_exact(process_group, fixture):
    import mconv.live
    from mconv.converter.hf_io import HFCheckpoint
    from tests.megatron_oracle import hf_logits

    hf_dir = FIXTURES / fixture
    model = _gpu_model(hf_dir)
    mconv.live.load.STAGE_BYTES = 50_000  # many staging batches even for a tiny model
    mconv.live.load_hf_weights([model], hf_dir)
    source = HFCheckpoint(hf_dir)
    names = []
    for bucket in mconv.live.iter_hf_weights([model], hf_dir, bucket_bytes=100_000, dtype=torch.bfloat16):
        for name, tensor in bucket:
            assert tensor.is_cuda and torch.equal(tensor.cpu(), source.read(name)), name
            names.append(name)
    assert sorted(names) == sorted(source.tensors)
    tokens = list(range(3, 40, 3))
    seq = len(tokens)
    with torch.no_grad():
        torch.backends.cuda.matmul.allow_tf32 = False
        logits = model(torch.tensor([tokens], device="cuda"), torch.arange(seq, device="cuda").unsqueeze(0),
                       torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device="cuda"), diagonal=1))
    assert (logits.float().cpu()[..., :300] - hf_logits(hf_dir, tokens)).abs().max().item() < 1e-3


def test_gpu_fp8_export_follows_the_weights(process_group):
    """iter_hf_weights(quantize="fp8") on a GPU (fp8_batch's kernels; each bucket's plan kept and, for
    the schedule's own views of parameters, used without looking at them: quantize_batch's
    `unchanged`) yields fp8.quantize's CPU bytes of the model's weights, twice, again after every
    parameter changed in place (new values at the same addresses), and after one was replaced
    (`param.data`: the model planned anew)."""
    import mconv.live
    from mconv.converter import fp8

    hf_dir = FIXTURES / "qwen3-moe-tiny"
    model = _gpu_model(hf_dir)
    mconv.live.load_hf_weights([model], hf_dir)

    def check():
        export = lambda **options: {name: t.cpu() for bucket in mconv.live.iter_hf_weights(  # noqa: E731
            [model], hf_dir, bucket_bytes=100_000, **options) for name, t in bucket}
        plain, got = export(), export(quantize="fp8")
        quantized = [name for name in got if name + fp8.SCALE_SUFFIX in got]
        assert len(quantized) > 10
        for name in quantized:
            q, scale = fp8.quantize(plain[name])
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(got[name + fp8.SCALE_SUFFIX], scale), name

    check()
    check()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    check()
    param = next(p for name, p in model.named_parameters() if "linear_fc1" in name)
    param.data = param.data * 0.5
    check()


def test_fp8_quantize_on_gpu_gives_the_cpu_bytes():
    """fp8.quantize on CUDA equals its CPU result (itself equal to compressed-tensors', test_fp8.py),
    edge and all-zero blocks, both scale formats; before the divisor became a tensor, CUDA's
    multiply-by-reciprocal put a third of the scales one ulp off (seen on the H200)."""
    from mconv.converter import fp8

    torch.manual_seed(0)
    w = torch.randn(300, 200) * 3
    w[:128, :128] = 0
    w[200, 5] = 5000.0
    for tensor in (w.bfloat16(), w, (torch.randn(1536, 2048) * 0.02).bfloat16()):
        for fmt in fp8.SCALE_FORMATS:
            (q, scale), (gq, gscale) = fp8.quantize(tensor, fmt), fp8.quantize(tensor.cuda(), fmt)
            assert gq.is_cuda and torch.equal(gq.cpu().view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(gscale.cpu(), scale)


def test_fp8_batched_quantize_on_gpu_gives_the_cpu_bytes():
    """quantize_tensors on CUDA (fp8_batch's Triton kernels: many weights, mixed dtypes, strided
    views, edge blocks, subnormal values and scales, in one batch) gives fp8.quantize's CPU bytes and
    scales, both scale formats; a weight holding NaN is refused by name. (Triton's CPU interpreter casts to e4m3 wrongly, so
    the hardware cast is checked here only.)"""
    from mconv.converter import fp8
    from mconv.errors import MconvError

    torch.manual_seed(0)
    w = torch.randn(300, 200, device="cuda") * 3
    w[:128, :128] = 0
    w[200, 5], w[130, :10] = 5000.0, -1e-7
    big = torch.randn(1536, 2048, device="cuda") * 0.02
    tiny = torch.randn(256, 130, device="cuda") * 1e-37  # subnormal scales, and one underflowing to 0 (eps)
    tiny[128:, :128] = torch.tensor(2.0 ** -149) * torch.randint(-300, 300, (128, 128))
    tiny[:128, 128:] = torch.tensor(2.0 ** -149)
    weights = [w, w.bfloat16(), big.bfloat16(), big.bfloat16().t(), big[100:1000, 3:700], w.half(), tiny]
    for fmt in fp8.SCALE_FORMATS:
        out = fp8.quantize_tensors([(str(i), x) for i, x in enumerate(weights)], fp8.Quantization(lambda n: True, fmt))
        for i, x in enumerate(weights):
            q, scale = fp8.quantize(x.cpu(), fmt)
            assert out[2 * i][1].is_cuda and torch.equal(out[2 * i][1].cpu().view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(out[2 * i + 1][1].cpu(), scale)
    w[3, 3] = float("nan")
    with pytest.raises(MconvError, match="^w holds inf or NaN"):
        fp8.quantize_tensors([("big", big), ("w", w)], fp8.Quantization(lambda n: True))


def _ipc_receiver(hf_dir, address, authkey, ready, done, out, delay_cycles=0, direct=False):
    """The engine's process: zeroed CUDA parameters shaped as the checkpoint's, filled by syncs;
    saved to `out` (with the last version) once `done` is set. `delay_cycles`: each bucket's copies
    wait behind a GPU sleep of that many clock cycles, so they are still queued when the receiver
    replies (a trainer that reused the bucket's buffer without waiting for them would corrupt them)."""
    from safetensors.torch import load_file, save_file

    from mconv.transport.receiver import ParameterReceiver

    class SlowReceiver(ParameterReceiver):
        def load(self, buffers):
            torch.cuda._sleep(delay_cycles)
            return super().load(buffers)

    params = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        params.update((name, torch.zeros_like(t, device="cuda")) for name, t in load_file(path).items())
    receiver = (SlowReceiver if delay_cycles else ParameterReceiver)(params, address, authkey, direct=direct)
    receiver.start()
    ready.set()
    done.wait()
    save_file({name: t.cpu() for name, t in params.items()}, out, metadata={"version": str(receiver.version)})


@pytest.mark.parametrize("delay_cycles, quantize, direct", [(0, None, False), (20_000_000, None, False),
                                                           (0, "fp8", False), (0, None, True), (0, "fp8", True)],
                         ids=["receiver", "slow-receiver", "fp8", "direct", "direct-fp8"])
def test_gpu_ipc_sync_is_exact(process_group, tmp_path, delay_cycles, quantize, direct):
    """sync_weights (NCCL alone: its agreement tensors on the GPU) through IPCEngine (one CUDA IPC handle per bucket, two reused buffers) into a
    receiver process that owns preallocated parameters: every HF tensor of the MoE fixture (loaded
    into megatron-core from the checkpoint) arrives bit for bit, over many buckets, twice, the
    receiver replying before its copies finish, with IPC events the trainer waits for. The slow
    receiver's copies wait about 10 ms behind a GPU sleep per bucket: the trainer, which packs the
    bucket after next into the same buffer, gets there first unless it waits for the "done" event.
    FP8: the receiver holds iter_hf_weights(quantize="fp8")'s tensors (FP8 weights, float32 scales,
    the rest bf16; tests/test_fp8.py holds them to compressed-tensors' bytes), and gets their bytes
    through the sync's packing, which quantizes straight into the bucket buffers. Direct: the
    receiver shares its parameters (ParameterReceiver(direct=True)) and the trainer copies each
    bucket straight into them (no buffer), FP8 weights quantized straight into the receiver's FP8
    weights and scales; verify=True reads them back (against a quantization of its own). FP8: a
    sync after one weight took a NaN fails, naming it, its update aborted (the check comes after
    the last bucket), and the next sync is exact."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    import mconv.live
    from mconv.converter.hf_io import HFCheckpoint
    from mconv.errors import MconvError
    from mconv.live.sync import IPCEngine, sync_weights

    hf_dir = FIXTURES / "qwen3-moe-tiny"
    model = _gpu_model(hf_dir)
    mconv.live.load_hf_weights([model], hf_dir)
    if quantize:  # what the receiver holds and must get: the export's tensors
        from safetensors.torch import save_file

        hf_dir = tmp_path / "exported"
        hf_dir.mkdir()
        save_file({name: t.cpu() for bucket in mconv.live.iter_hf_weights(
            [model], FIXTURES / "qwen3-moe-tiny", dtype=torch.bfloat16, quantize=quantize) for name, t in bucket},
            hf_dir / "model.safetensors")
    context = multiprocessing.get_context("spawn")
    address, authkey = str(tmp_path / "engine.sock"), os.urandom(16)
    ready, done = context.Event(), context.Event()
    receiver = context.Process(target=_ipc_receiver, args=(hf_dir, address, authkey, ready, done,
                                                           str(tmp_path / "received.safetensors"), delay_cycles,
                                                           direct),
                               daemon=True)
    receiver.start()
    engine = IPCEngine(address, authkey)
    try:
        assert ready.wait(120), "the receiver process did not start"
        def sync(step):
            return sync_weights([model], FIXTURES / "qwen3-moe-tiny", engine, version=f"step-{step}",
                                bucket_bytes=100_000, dtype=torch.bfloat16, quantize=quantize, verify=direct)

        result = sync(1)
        if quantize:
            weight = next(p for n, p in model.named_parameters() if "linear_fc2" in n)
            kept, weight.data[1, 1] = weight.data[1, 1].item(), float("nan")
            with pytest.raises(MconvError, match=r"update was aborted: rank 0: \S+ holds inf or NaN"):
                sync("nan")
            weight.data[1, 1] = kept
        result = sync(2)
        assert result.buckets > 4
        if direct:  # written straight into the receiver's parameters, FP8 weights too
            assert "targets" in engine._carried and not engine._buffers
            assert not quantize or any(w.places for w in engine.__dict__["_mconv_writes"][1].values())
        else:
            assert sorted(engine._carried["done"]) == [0, 1]  # the receiver replied with its "done" events
        if quantize and not direct:  # the buckets' weights were quantized straight into their buffers
            layouts = engine.__dict__["_mconv_layouts"]
            assert any(signature[2] for signature in layouts)
            assert all(layout.places for signature, layout in layouts.items() if signature[2])
    finally:
        engine.close()
        done.set()
        receiver.join(120)
    assert receiver.exitcode == 0
    received = load_file(tmp_path / "received.safetensors")
    if quantize:
        expected = load_file(hf_dir / "model.safetensors")
    else:
        source = HFCheckpoint(hf_dir)
        expected = {name: source.read(name) for name in source.tensors}
    with safe_open(tmp_path / "received.safetensors", "pt") as f:
        assert f.metadata()["version"] == "step-2"
    assert sorted(received) == sorted(expected)
    assert any(t.dtype == torch.float8_e4m3fn for t in received.values()) == bool(quantize)
    for name, tensor in received.items():
        assert torch.equal(tensor.view(torch.uint8), expected[name].view(torch.uint8)), name


def test_gpu_stacked_fp8_export_is_the_offline_bytes(process_group, tmp_path):
    """Qwen3-VL-MoE (mbridge's Qwen3VLModel, built as the CPU oracle builds it) on the GPU:
    iter_hf_weights(stacked_experts=True, quantize="fp8") quantizes each expert of the stacked
    tensors on CUDA, and every tensor it yields, FP8 weights and scales and the 16-bit rest, holds the
    bytes `mcore2hf --quantize fp8` writes on the CPU (test_fp8_stacked.py holds those to
    compressed-tensors'), in both expert orientations."""
    if not os.environ.get("CI"):  # the GPU image has mbridge only where its wheel is carried (docs/tests.md)
        pytest.importorskip("mbridge")
    import json

    import mconv.live
    from mconv import Layout, hf2mcore, mcore2hf
    from mconv.converter.transforms import padded_vocab_size
    from tests.qwen3_vl_oracle import VLRun, build_model
    from tests.test_fp8 import bits
    from tests.test_roundtrip import read_all

    hf_dir = FIXTURES / "qwen3-vl-moe-tiny"
    config = json.loads((hf_dir / "config.json").read_text())
    with torch.device("cuda"):
        model = build_model(VLRun(None, config, padded_vocab=padded_vocab_size(config["text_config"]["vocab_size"],
                                                                               128, 1)))
    mconv.live.load_hf_weights([model], hf_dir)
    hf2mcore(hf_dir, tmp_path / "m", Layout(), fmt="torch", progress=False)
    for orientation in ("4.x", "5.x"):
        mcore2hf(tmp_path / "m", tmp_path / orientation, progress=False, quantize="fp8", expert_orientation=orientation)
        offline = read_all(tmp_path / orientation)
        yielded = {}
        for bucket in mconv.live.iter_hf_weights([model], hf_dir, stacked_experts=True, expert_orientation=orientation,
                                                 quantize="fp8"):
            for name, tensor in bucket:
                assert tensor.is_cuda and name not in yielded, name
                yielded[name] = tensor.cpu()
        assert sorted(yielded) == sorted(offline)
        assert yielded["model.language_model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
        for name, tensor in yielded.items():
            assert torch.equal(bits(tensor.to(offline[name].dtype)), bits(offline[name])), (orientation, name)


def _sglang_reader(payload, out):
    """What SGLang's TP rank 0 does with its entry (sglang 0.5.23: tp_worker.deserialize_own_rank after
    srt/utils/patch_torch.monkey_patch_torch_reductions, whose rebuild maps a device UUID to this
    process's device number; written out here, SGLang does not install on the GPU machine)."""
    import base64
    import pickle

    from torch.multiprocessing import reductions

    original = reductions.rebuild_cuda_tensor

    def rebuild(*args):
        uuid = args[6]
        index = next(i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == uuid)
        return original(*args[:6], index, *args[7:])

    reductions.rebuild_cuda_tensor = rebuild
    data = pickle.loads(base64.b64decode(payload))
    # bytes, not tensors: a CPU tensor in a queue is a shared file this process would have to outlive
    out.put([(m.name, str(m.dtype), list(m.shape), data["flattened_tensor"][m.start_idx:m.end_idx].cpu().numpy().tobytes())
             for m in data["metadata"]])
    del data
    torch.cuda.synchronize()


def test_sglang_payload_opens_in_another_process():
    """sglang_payload of a CUDA bucket: one CUDA IPC handle naming the GPU by UUID (a string where
    torch puts the device number), which another process opens (with SGLang's UUID rebuild) into
    exactly the tensors packed."""
    from mconv.live.sync.engines import FlatBucket
    from mconv.live.sync.sglang import sglang_payload
    from mconv.transport.flat import layout, pack

    named = [("a", torch.randn(63, device="cuda").bfloat16()), ("b", torch.randn(8, 64, device="cuda")),
             ("c", torch.arange(7, device="cuda"))]
    entries, nbytes = layout(named)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pack(named, entries, buffer)
    torch.cuda.synchronize()
    (payload,) = sglang_payload(FlatBucket("v1", 0, buffer, entries))
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    reader = context.Process(target=_sglang_reader, args=(payload, out))
    reader.start()
    back = {name: (dtype, shape, data) for name, dtype, shape, data in out.get(timeout=120)}
    reader.join(60)
    assert reader.exitcode == 0
    for name, tensor in named:
        assert back[name] == (str(tensor.dtype), list(tensor.shape), tensor.cpu().view(torch.uint8).numpy().tobytes()), name
