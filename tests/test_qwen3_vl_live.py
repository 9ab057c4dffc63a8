"""mconv.live on mbridge's Megatron Qwen3VLModel (MoE; TP2/EP2/ETP1: the vision tower split over TP,
experts over EP; and PP2 x VPP2, two chunks per rank, the vision tower on the first, every rank
yielding the whole model with gather_pp): after `load_hf_weights` its logits equal transformers'
(text-only and text+image); `iter_hf_weights` yields every HF tensor once, bit-exactly, with
per-expert names (as AReaL sends them to inference engines); with `stacked_experts` it yields the
stacked `gate_up_proj` / `down_proj` instead, each once: in the 5.x orientation they and every other
tensor equal transformers' own model state (`state_dict()`), in the default 4.x orientation the
fixture's (4.x) tensors; `save_hf_weights` writes the checkpoint back in either orientation (exactly,
in the fp32 of the model) and transformers loads it."""
import json

import pytest
import torch

from fixtures.make_fixtures import make_qwen3_vl
from mconv import Layout, hf2mcore, mcore2hf
from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.transforms import padded_vocab_size
from tests.conftest import FIXTURES
from tests.qwen3_vl_oracle import VLRun, example_inputs, hf_logits, megatron_logits
from tests.test_fp8 import bits
from tests.test_qwen3_vl import transposed_experts
from tests.test_roundtrip import assert_bit_identical, read_all

pytestmark = pytest.mark.slow
MOE = FIXTURES / "qwen3-vl-moe-tiny"


@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, vpp=2)])
def test_live_load_export_and_save(tmp_path, sizes):
    from transformers import AutoModelForImageTextToText

    hf = MOE if sizes.get("tp") else make_qwen3_vl(  # 2 layers per chunk, one of them dense
        tmp_path / "hf", seed=5, moe=True, text={"num_hidden_layers": 8, "mlp_only_layers": [5]},
        vision={"deepstack_visual_indexes": [1]})
    config = json.loads((hf / "config.json").read_text())
    inputs = example_inputs(config)
    run = VLRun(None, config, **sizes, inputs=inputs, live_hf=hf, live_out=tmp_path,
                padded_vocab=padded_vocab_size(config["text_config"]["vocab_size"], 128, sizes.get("tp", 1)))
    ours, theirs = megatron_logits(run, tmp_path), hf_logits(hf, inputs)
    for name in inputs:
        assert (ours[name] - theirs[name]).abs().max() < 1e-4, name

    ckpt = HFCheckpoint(hf)  # per-expert views of the stacked experts
    for rank in range(run.world):
        yielded = [pair for bucket in torch.load(tmp_path / f"yielded{rank}.pt") for pair in bucket]
        names = [name for name, _ in yielded]
        assert sorted(names) == sorted(ckpt.tensors) and len(set(names)) == len(names)
        for name, tensor in yielded:
            assert torch.equal(tensor, ckpt.read(name).float()), name  # the model is fp32, the fixture bf16
    assert "model.language_model.layers.0.mlp.experts.3.gate_proj.weight" in ckpt.tensors

    state = AutoModelForImageTextToText.from_pretrained(hf, dtype=torch.float32).state_dict()
    assert tuple(state["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 80, 64)  # [E, 2I, h]
    fixture = {k: v.float() for k, v in read_all(hf).items()}  # its experts are in the 4.x orientation
    for label, expected in (("stacked5", state), ("stacked4", fixture)):
        for rank in range(run.world):
            yielded = [pair for bucket in torch.load(tmp_path / f"{label}{rank}.pt") for pair in bucket]
            assert sorted(name for name, _ in yielded) == sorted(expected), label
            for name, tensor in yielded:
                assert tensor.is_contiguous() and torch.equal(tensor, expected[name]), (label, name)

    assert_bit_identical(fixture, read_all(tmp_path / "saved"))
    assert_bit_identical(transposed_experts(fixture), read_all(tmp_path / "saved5"))
    for saved in ("saved", "saved5"):
        _, info = AutoModelForImageTextToText.from_pretrained(tmp_path / saved, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    # FP8: the stacked experts quantized expert by expert, each FP8 tensor (scales too) the bytes of
    # `mcore2hf --quantize fp8`'s output (whose experts test_fp8_stacked.py holds to compressed-tensors'
    # bytes), each in its weight's bucket; the other tensors its values (the live model is fp32)
    hf2mcore(hf, tmp_path / "m", Layout(), fmt="torch", progress=False)
    for orientation in ("4.x", "5.x"):
        mcore2hf(tmp_path / "m", tmp_path / orientation, progress=False, quantize="fp8", expert_orientation=orientation)
    for label, orientation in (("stacked4-fp8", "4.x"), ("stacked5-fp8", "5.x"), ("saved-fp8", "4.x")):
        offline = read_all(tmp_path / orientation)
        assert offline["model.language_model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
        runs = ([[list(read_all(tmp_path / label).items())]] if label == "saved-fp8" else
                [torch.load(tmp_path / f"{label}{rank}.pt") for rank in range(run.world)])
        for buckets in runs:
            assert sorted(name for bucket in buckets for name, _ in bucket) == sorted(offline), label
            for bucket in buckets:
                held = {name for name, _ in bucket}
                for name, tensor in bucket:
                    assert name.removesuffix("_scale_inv") in held, (label, name)
                    assert torch.equal(bits(tensor.to(offline[name].dtype)), bits(offline[name])), (label, name)
