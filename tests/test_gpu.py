"""The live-engine API on a GPU (skipped without one): a megatron-core GPTModel on the device,
loaded with load_hf_weights through the pinned staging path, gives back every HF tensor bit for
bit through iter_hf_weights, and its forward matches transformers."""
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


@pytest.mark.parametrize("fixture", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_gpu_load_and_export_are_exact(process_group, fixture):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    import mconv.live
    from mconv.converter.hf_io import HFCheckpoint
    from tests.megatron_oracle import MegatronRun, _transformer_config, hf_logits, read_config

    hf_dir = FIXTURES / fixture
    config, theta = _transformer_config(MegatronRun(hf_dir, read_config(hf_dir)))
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", qk_l2_norm=False)
    with torch.device("cuda"):
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=384, max_sequence_length=256,
                         position_embedding_type="rope", rotary_base=theta, parallel_output=False).eval()
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
