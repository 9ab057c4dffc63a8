"""export-lora for Qwen3-VL (dense): Megatron-Bridge LoRA adapters on the language model's linear layers
(made in Megatron layout at TP2 by tests/test_lora.py's Adapters) become a PEFT adapter on
`model.language_model.layers.*`. Oracles: `--merge` equals mcore2hf of the rank files with the
adapters merged in Megatron layout (mcore2hf itself checked against mbridge's Qwen3VLModel in
test_qwen3_vl_oracle.py), and peft's PeftModel on transformers' Qwen3VLForConditionalGeneration with
the exported adapter gives the logits of transformers on the `--merge` output (text-only and
text+image)."""
import json

import torch

from mconv import Layout, mcore2hf
from tests.conftest import FIXTURES
from tests.qwen3_vl_oracle import PATCHES, example_inputs, hf_logits
from tests.test_errors import assert_refused, mconv
from tests.test_lora import ALPHA, export, lora_checkpoint
from tests.test_roundtrip import read_all

DENSE = FIXTURES / "qwen3-vl-tiny"


def test_adapter_and_merge(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    lora, merged = lora_checkpoint(tmp_path, DENSE, Layout(tp=2))
    export(lora, tmp_path / "adapter")
    export(lora, tmp_path / "ours", "--merge", "--base-model", DENSE, "--dtype", "float32")
    mcore2hf(merged, tmp_path / "theirs", progress=False)
    ours, theirs, base = read_all(tmp_path / "ours"), read_all(tmp_path / "theirs"), read_all(DENSE)
    assert ours.keys() == theirs.keys() == base.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name].float(), atol=1e-6, rtol=0), name
        # every language linear layer got its delta, nothing else changed
        adapted = name.startswith("model.language_model.layers.") and name.endswith("proj.weight")
        assert torch.equal(ours[name], base[name].float()) != adapted, name

    inputs = example_inputs(json.loads((DENSE / "config.json").read_text()))
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(DENSE, dtype=torch.float32),
                                      tmp_path / "adapter").eval()
    reference = hf_logits(tmp_path / "ours", inputs)
    with torch.no_grad():
        for name, (ids, pixels) in inputs.items():
            extra = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": torch.tensor([PATCHES]),
                                               "mm_token_type_ids": (ids == model.config.image_token_id).int()}
            logits = model(input_ids=ids, **extra).logits
            assert (logits - reference[name]).abs().max() < 1e-4, name
            assert (reference[name] - hf_logits(DENSE, {name: inputs[name]})[name]).abs().max() > 1e-2  # it matters


def test_expert_adapters_of_stacked_experts_are_refused(tmp_path):
    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-vl-moe-tiny", Layout(tp=2, ep=2))
    assert_refused(mconv("export-lora", lora, tmp_path / "out", "--alpha", ALPHA, "-q"), tmp_path / "out",
                   "LoRA adapters on the routed experts of Qwen3VLMoeForConditionalGeneration are not exported yet")
