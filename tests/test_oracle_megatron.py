"""Oracle: megatron-core's GPTModel loads what hf2mcore writes (strict=True) and its forward
matches transformers' logits on the same HF checkpoint."""
import pytest

from mconv import Layout, hf2mcore
from tests.conftest import FIXTURES
from tests.megatron_oracle import MegatronRun, hf_logits, megatron_logits, read_config

TOKENS = list(range(3, 60, 4))

CASES = [  # fixture, tp, pp, vpp, first-stage layers, last-stage layers
    ("qwen3-tiny", 1, 1, 1, None, None),
    ("qwen3-tiny", 2, 1, 1, None, None),
    ("qwen3-tiny", 1, 2, 1, None, None),
    ("qwen3-tiny", 2, 2, 1, None, None),
    ("qwen3-tiny", 1, 2, 2, None, None),
    ("qwen3-tiny", 1, 2, 1, 1, 3),
    ("qwen3-tiny-tied", 2, 1, 1, None, None),
    ("qwen3-tiny-tied", 1, 2, 1, None, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("fixture,tp,pp,vpp,first,last", CASES)
def test_megatron_core_forward_matches_transformers(tmp_path, fixture, tp, pp, vpp, first, last):
    hf_dir = FIXTURES / fixture
    layout = Layout(tp=tp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    summary = hf2mcore(hf_dir, tmp_path / "megatron", layout, progress=False)
    run = MegatronRun(tmp_path / "megatron", read_config(hf_dir), tp=tp, pp=pp, vpp=vpp,
                      first_stage_layers=first, last_stage_layers=last,
                      padded_vocab=summary.plan.padded_vocab, tokens=TOKENS)
    ours = megatron_logits(run, tmp_path)
    reference = hf_logits(hf_dir, TOKENS)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-4
