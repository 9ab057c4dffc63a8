"""Oracle: megatron-core's GPTModel loads what hf2mcore writes (strict=True) and its forward
matches transformers' logits on the same HF checkpoint."""
import pytest

from mconv import Layout, hf2mcore
from tests.conftest import FIXTURES
from tests.megatron_oracle import MegatronRun, hf_logits, megatron_logits, read_config

TOKENS = list(range(3, 60, 4))

CASES = [  # fixture, layout
    ("qwen3-tiny", dict()),
    ("qwen3-tiny", dict(tp=2)),
    ("qwen3-tiny", dict(pp=2)),
    ("qwen3-tiny", dict(tp=2, pp=2)),
    ("qwen3-tiny", dict(pp=2, vpp=2)),
    ("qwen3-tiny", dict(pp=2, first_stage_layers=1, last_stage_layers=3)),
    ("qwen3-tiny-tied", dict(tp=2)),
    ("qwen3-tiny-tied", dict(pp=2)),
    ("qwen3-moe-tiny", dict(tp=2, ep=2, etp=1)),
    ("qwen3-moe-tiny", dict(tp=2, ep=2, etp=2)),
    ("qwen3-moe-tiny", dict(pp=2, ep=2)),
    ("qwen3-moe-tiny", dict(tp=2, ep=4, etp=1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("fixture,sizes", CASES, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in s.items())}" for f, s in CASES])
def test_megatron_core_forward_matches_transformers(tmp_path, fixture, sizes):
    hf_dir = FIXTURES / fixture
    layout = Layout(**sizes)
    summary = hf2mcore(hf_dir, tmp_path / "megatron", layout, fmt="torch", progress=False)
    run = MegatronRun(tmp_path / "megatron", read_config(hf_dir), **sizes,
                      padded_vocab=summary.plan.padded_vocab, tokens=TOKENS)
    ours = megatron_logits(run, tmp_path)
    reference = hf_logits(hf_dir, TOKENS)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-4
