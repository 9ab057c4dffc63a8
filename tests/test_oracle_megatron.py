"""Oracle: megatron-core's GPTModel, built as a Megatron-LM job builds it from the args hf2mcore
stores (Megatron-LM's parse_args defaults + the stored args, validate_args,
core_transformer_config_from_args), loads what hf2mcore writes (strict=True) and its forward
matches transformers' logits on the same HF checkpoint."""
import argparse
import json
import shutil

import pytest
import torch

from mconv import Layout, hf2mcore
from tests.conftest import FIXTURES, load_rank_file
from tests.megatron_oracle import MegatronRun, hf_logits, megatron_logits, read_config, trainer_args

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

# YaRN as transformers 5 writes it (rope_parameters) and as 4.x did (a rope_scaling block beside a
# top-level rope_theta, the old `type` key, every YaRN setting away from its default). A short
# pretraining length makes the frequency ramp act on the 15 test positions.
YARN_CASES = [
    ("qwen3-tiny", dict(tp=2), {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 16}}),
    ("qwen3-moe-tiny", dict(tp=2, ep=2, etp=1),
     {"rope_parameters": None, "rope_theta": 10000.0,
      "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                       "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False}}),
]


def stored_args(ckpt) -> argparse.Namespace:
    return load_rank_file(next(ckpt.glob("release/mp_rank_*/model_optim_rng.pt")))["args"]


def forward(tmp_path, hf_dir, sizes) -> torch.Tensor:
    """hf2mcore at the layout, then megatron-core's forward of a model built from the stored args."""
    summary = hf2mcore(hf_dir, tmp_path / "megatron", Layout(**sizes), fmt="torch", progress=False)
    run = MegatronRun(tmp_path / "megatron", read_config(hf_dir), **sizes,
                      padded_vocab=summary.plan.padded_vocab, tokens=TOKENS)
    run.args = trainer_args(stored_args(tmp_path / "megatron"), run)
    return megatron_logits(run, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fixture,sizes", CASES, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in s.items())}" for f, s in CASES])
def test_megatron_core_forward_matches_transformers(tmp_path, fixture, sizes):
    hf_dir = FIXTURES / fixture
    ours = forward(tmp_path, hf_dir, sizes)
    reference = hf_logits(hf_dir, TOKENS)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("fixture,sizes,rope", YARN_CASES, ids=["qwen3-rope_parameters", "qwen3-moe-rope_scaling"])
def test_yarn_forward_matches_transformers(tmp_path, fixture, sizes, rope):
    config = read_config(FIXTURES / fixture)
    hf_dir, plain_dir = (shutil.copytree(FIXTURES / fixture, tmp_path / name) for name in ("hf", "plain"))
    (hf_dir / "config.json").write_text(json.dumps({k: v for k, v in {**config, **rope}.items() if v is not None}))
    (plain_dir / "config.json").write_text(json.dumps(
        {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}))
    ours = forward(tmp_path, hf_dir, sizes)
    assert (ours - hf_logits(hf_dir, TOKENS)).abs().max().item() < 1e-4
    # The check sees YaRN: the model without it (what dropping rope scaling gave) is far off.
    assert (ours - hf_logits(plain_dir, TOKENS)).abs().max().item() > 1e-2
