"""mconv.live on mbridge's Megatron Qwen3VLModel (MoE, TP2/EP2/ETP1: the vision tower split over TP,
experts over EP): after `load_hf_weights` its logits equal transformers' (text-only and text+image);
`iter_hf_weights` yields every HF tensor once, bit-exactly, with per-expert names (as AReaL sends them
to inference engines); `save_hf_weights` writes the checkpoint back (exactly, in the fp32 of the
model; stacked experts in the 4.x orientation) and transformers loads it."""
import json

import pytest
import torch

from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.transforms import padded_vocab_size
from tests.conftest import FIXTURES
from tests.qwen3_vl_oracle import VLRun, example_inputs, hf_logits, megatron_logits
from tests.test_roundtrip import assert_bit_identical, read_all

pytestmark = pytest.mark.slow
MOE = FIXTURES / "qwen3-vl-moe-tiny"


def test_live_load_export_and_save(tmp_path):
    from transformers import AutoModelForImageTextToText

    config = json.loads((MOE / "config.json").read_text())
    inputs = example_inputs(config)
    run = VLRun(None, config, tp=2, ep=2, padded_vocab=padded_vocab_size(config["text_config"]["vocab_size"], 128, 2),
                inputs=inputs, live_hf=MOE, live_out=tmp_path)
    ours, theirs = megatron_logits(run, tmp_path), hf_logits(MOE, inputs)
    for name in inputs:
        assert (ours[name] - theirs[name]).abs().max() < 1e-4, name

    ckpt = HFCheckpoint(MOE)  # per-expert views of the stacked experts
    for rank in range(run.world):
        yielded = torch.load(tmp_path / f"yielded{rank}.pt")
        names = [name for name, _ in yielded]
        assert sorted(names) == sorted(ckpt.tensors) and len(set(names)) == len(names)
        for name, tensor in yielded:
            assert torch.equal(tensor, ckpt.read(name).float()), name  # the model is fp32, the fixture bf16
    assert "model.language_model.layers.0.mlp.experts.3.gate_proj.weight" in ckpt.tensors
    assert_bit_identical({k: v.float() for k, v in read_all(MOE).items()}, read_all(tmp_path / "saved"))
    _, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
