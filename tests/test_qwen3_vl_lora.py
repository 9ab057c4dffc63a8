"""export-lora for Qwen3-VL, dense and MoE: Megatron-Bridge LoRA adapters (made in Megatron layout by
tests/test_lora.py's Adapters) on the language model's linear layers, the routed experts, and the
vision tower's blocks and patch mergers (`linear_qkv` with the vision per-head interleave, the
non-gated `linear_fc1`, `linear_proj`, `linear_fc2`; biases untouched) become one PEFT adapter:
`model.language_model.layers.*`, `model.visual.*`, and for the stacked experts of Qwen3-VL-MoE the
3-D form of peft's `target_parameters` (which vLLM reads).

Oracles: peft's PeftModel on transformers' Qwen3VL(Moe)ForConditionalGeneration with the exported
adapter gives the logits of transformers on the `--merge` output (text-only and text+image), and
`--merge` equals mcore2hf of the rank files with the adapters merged in Megatron layout (mcore2hf
itself checked against mbridge's Qwen3VLModel in test_qwen3_vl_oracle.py); and (slow) peft's logits
equal mbridge's Megatron Qwen3VLModel running the merged rank files at MoE TP2/EP2.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.make_fixtures import make_qwen3_vl
from mconv import Layout, mcore2hf
from mconv.converter.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mconv.converter.transforms import padded_vocab_size
from tests.conftest import FIXTURES, load_rank_file
from tests.qwen3_vl_oracle import PATCHES, VLRun, example_inputs, hf_logits, megatron_logits
from tests.test_errors import assert_refused, mconv
from tests.test_lora import (ALPHA, R, assert_same_files, export, lora_checkpoint, needs_vllm, run_vllm,
                             save_dist_adapters)
from tests.test_roundtrip import read_all

DENSE = FIXTURES / "qwen3-vl-tiny"
VISION_LINEAR = (".attn.qkv.weight", ".attn.proj.weight", ".linear_fc1.weight", ".linear_fc2.weight")


def all_moe(tmp: Path) -> Path:
    """Qwen3-VL-MoE without dense layers (4.x expert orientation on disk): peft 0.21 on transformers 5
    retargets gate/up/down_proj LoRA on a MoE model's dense MLPs to the fused expert parameters, so
    the peft oracle runs on a model whose MLPs are all experts (dense layers: the merge oracle)."""
    return make_qwen3_vl(tmp / "hf", seed=7, moe=True, text={"mlp_only_layers": []})


def peft_logits(hf_dir: Path, adapter: Path, inputs: dict) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32),
                                      adapter).eval()
    out = {}
    with torch.no_grad():
        for name, (ids, pixels) in inputs.items():
            extra = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": torch.tensor([PATCHES]),
                                               "mm_token_type_ids": (ids == model.config.image_token_id).int()}
            out[name] = model(input_ids=ids, **extra).logits
    return out


def assert_merge_equals_megatron_layout_merge(tmp_path: Path, hf_dir: Path, lora: Path, merged: Path) -> None:
    export(lora, tmp_path / "ours", "--merge", "--base-model", hf_dir, "--dtype", "float32")
    mcore2hf(merged, tmp_path / "theirs", progress=False)  # stacked experts: 4.x, as the base
    ours, theirs, base = read_all(tmp_path / "ours"), read_all(tmp_path / "theirs"), read_all(hf_dir)
    assert ours.keys() == theirs.keys() == base.keys()
    for name in ours:
        assert ours[name].shape == base[name].shape, name  # stacked experts in the base model's orientation
        assert torch.allclose(ours[name], theirs[name].float(), atol=1e-6, rtol=0), name
        # every linear layer of the language model and the vision tower got its delta, nothing else changed
        adapted = (name.startswith("model.language_model.layers.") and name.endswith(("proj.weight", "_proj"))
                   or name.startswith("model.visual.") and name.endswith(VISION_LINEAR))
        assert torch.equal(ours[name], base[name].float()) != adapted, name


def assert_peft_equals_merge(tmp_path: Path, hf_dir: Path) -> None:
    inputs = example_inputs(json.loads((hf_dir / "config.json").read_text()))
    reference = hf_logits(tmp_path / "ours", inputs)
    logits = peft_logits(hf_dir, tmp_path / "adapter", inputs)
    for name in inputs:
        assert (logits[name] - reference[name]).abs().max() < 1e-4, name
        assert (reference[name] - hf_logits(hf_dir, {name: inputs[name]})[name]).abs().max() > 1e-2  # it matters


def test_dense_adapter_and_merge(tmp_path):
    lora, merged = lora_checkpoint(tmp_path, DENSE, Layout(tp=2), vision=True)
    export(lora, tmp_path / "adapter")
    assert_merge_equals_megatron_layout_merge(tmp_path, DENSE, lora, merged)
    assert_peft_equals_merge(tmp_path, DENSE)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    # attn.proj, not proj: peft matches target_modules as name suffixes, and patch_embed.proj (a Conv3d) has no adapter
    assert config["target_modules"] == ["attn.proj", "down_proj", "gate_proj", "k_proj", "linear_fc1", "linear_fc2",
                                        "o_proj", "q_proj", "qkv", "up_proj", "v_proj"]
    assert "target_parameters" not in config
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert tensors["base_model.model.model.visual.blocks.1.attn.qkv.lora_B.weight"].shape == (3 * 32, R)
    assert tensors["base_model.model.model.visual.deepstack_merger_list.1.linear_fc1.lora_A.weight"].shape == (R, 128)
    assert not any(key.endswith("bias") for key in tensors)


@pytest.mark.parametrize("sizes,spec", [(dict(tp=2, ep=2, etp=1), "te"), (dict(tp=2, ep=2, etp=2), "local")],
                         ids=["tp2-ep2-etp1-te-grouped", "tp2-ep2-etp2-local"])
def test_moe_expert_adapters_in_the_3d_form(tmp_path, sizes, spec):
    """The routed experts' adapters (per expert, or one per EP rank under TE grouped GEMM) become
    `mlp.experts.base_layer.lora_A/B` (gate_up_proj) and `mlp.experts.lora_A/B` (down_proj)."""
    hf_dir = all_moe(tmp_path)
    lora, merged = lora_checkpoint(tmp_path, hf_dir, Layout(**sizes), spec=spec, vision=True)
    export(lora, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert not {"gate_proj", "up_proj", "down_proj", "experts"} & set(config["target_modules"])
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    p, experts, hidden, ffn = "base_model.model.model.language_model.layers.2.mlp.experts.", 4, 64, 40
    assert tensors[p + "base_layer.lora_A.weight"].shape == (experts * R, hidden)
    assert tensors[p + "base_layer.lora_B.weight"].shape == (2 * ffn, R * experts)
    assert tensors[p + "lora_A.weight"].shape == (experts * R, ffn)
    assert tensors[p + "lora_B.weight"].shape == (hidden, R * experts)
    assert_merge_equals_megatron_layout_merge(tmp_path, hf_dir, lora, merged)
    assert_peft_equals_merge(tmp_path, hf_dir)


def test_moe_with_dense_layers(tmp_path):
    """The MoE fixture's dense layer (mlp_only_layers) keeps its per-module adapters beside the 3-D ones,
    and peft applies both."""
    hf_dir = FIXTURES / "qwen3-vl-moe-tiny"
    lora, merged = lora_checkpoint(tmp_path, hf_dir, Layout(tp=2, ep=2), vision=True)
    export(lora, tmp_path / "adapter")
    assert_merge_equals_megatron_layout_merge(tmp_path, hf_dir, lora, merged)
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert "base_model.model.model.language_model.layers.1.mlp.gate_proj.lora_A.weight" in tensors
    assert "base_model.model.model.language_model.layers.1.mlp.experts.lora_A.weight" not in tensors
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    # mlp.gate_proj, not gate_proj: the table also has (per-expert) experts.{e}.gate_proj modules without such adapters
    assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} <= set(config["target_modules"])
    assert_peft_equals_merge(tmp_path, hf_dir)


def test_torch_dist_adapter_checkpoint(tmp_path, monkeypatch):
    """Vision and language adapters in a torch_dist checkpoint (keys of mbridge's Qwen3VLModel, stacked
    like their base layers) export as the same rank files do."""
    lora, _ = lora_checkpoint(tmp_path, DENSE, Layout(), vision=True, adapter_only=True)
    adapters = {k: v for k, v in load_rank_file(lora / "release" / "mp_rank_00" / "model_optim_rng.pt")["model"].items() if ".adapter." in k}
    assert any(k.startswith("vision_model.decoder.deepstack_merger_list.1.") for k in adapters)
    dist = save_dist_adapters(tmp_path, DENSE, adapters, monkeypatch)
    export(lora, tmp_path / "from-legacy")
    export(dist, tmp_path / "from-dist", "--hf-config", DENSE)
    assert_same_files(tmp_path / "from-dist", tmp_path / "from-legacy")


def test_canonical_expert_adapters_of_stacked_experts_are_refused(tmp_path):
    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-vl-moe-tiny", Layout(tp=2, ep=2), canonical=True)
    assert_refused(mconv("export-lora", lora, tmp_path / "out", "--alpha", ALPHA, "-q"), tmp_path / "out",
                   "separate gate and up adapters (CanonicalLoRA)")


@pytest.mark.slow
def test_peft_equals_mbridge_forward_of_merged_rank_files(tmp_path):
    """mbridge's Megatron Qwen3VLModel (gloo, TP2/EP2/ETP1) on the rank files with the adapters merged
    in Megatron layout gives peft's logits on the exported adapter, text-only and text+image."""
    hf_dir = all_moe(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    lora, merged = lora_checkpoint(tmp_path, hf_dir, Layout(tp=2, ep=2), vision=True)
    export(lora, tmp_path / "adapter")
    inputs = example_inputs(config)
    run = VLRun(merged, config, tp=2, ep=2, etp=1, inputs=inputs,
                padded_vocab=padded_vocab_size(config["text_config"]["vocab_size"], 128, 2))
    reference = megatron_logits(run, tmp_path)
    logits = peft_logits(hf_dir, tmp_path / "adapter", inputs)
    for name in inputs:
        assert (logits[name] - reference[name]).abs().max() < 1e-4, name
        assert (reference[name] - hf_logits(hf_dir, {name: inputs[name]})[name]).abs().max() > 1e-2, name


# ----------------------------------------------------------------------------- a real client: vLLM on the CPU

IMAGE_SIZE = 32  # pixels: 4 x 4 patches of 8 -> 4 merged image tokens


def vllm_model(tmp: Path, moe: bool) -> Path:
    """A tiny Qwen3-VL model vLLM's CPU build serves: text head_dim 32 (its CPU attention needs >= 32),
    a byte-level BPE tokenizer with the vision special tokens, and a processor config (image patches
    of 8, 2x2 merge, images of 32x32 to 64x64 pixels)."""
    from fixtures.make_fixtures import make_tokenizer

    tokenizer = make_tokenizer()
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(specials)))
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6], "mrope_interleaved": True}
    hf = make_qwen3_vl(tmp / "hf", seed=5, moe=moe, dtype=torch.float32, text=dict(
        head_dim=32, rope_parameters=rope, **({"mlp_only_layers": []} if moe else {})), **ids)
    tokenizer.save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text())
    if moe:  # vLLM 0.32's Qwen3-VL-MoE reads text_config.norm_topk_prob, which transformers 5 does not write
        config["text_config"]["norm_topk_prob"] = True
        (hf / "config.json").write_text(json.dumps(config, indent=2))
    size = {"shortest_edge": IMAGE_SIZE ** 2, "longest_edge": (2 * IMAGE_SIZE) ** 2}
    patches = dict(patch_size=8, temporal_patch_size=2, merge_size=2, size=size, do_resize=True, do_rescale=True,
                   rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True, resample=3)
    (hf / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor", "image_processor": {
        "image_processor_type": "Qwen2VLImageProcessor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], **patches}, "video_processor": {
        "video_processor_type": "Qwen3VLVideoProcessor", "image_mean": [0.5] * 3, "image_std": [0.5] * 3, **patches}}))
    return hf


VLLM_VL_SCRIPT = """
import json, os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
if __name__ == "__main__":
    import numpy as np
    from PIL import Image
    from safetensors.torch import save_file
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    model, adapter, prompt, generate = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "generate"
    llm = LLM(model=model, enable_lora=True, max_lora_rank=8, max_loras=1, dtype="float32", max_model_len=128,
              enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=128, kv_cache_memory_bytes=64 << 20,
              distributed_executor_backend="uni", limit_mm_per_prompt={"image": 1, "video": 0},
              enable_tower_connector_lora=True)
    request = LoRARequest("exported", 1, adapter)
    llm.llm_engine.add_lora(request)  # vLLM's own adapter loader: raises ValueError for an adapter it rejects
    llm.llm_engine.pin_lora(1)  # puts its tensors into the engine's LoRA slots (set_lora of every wrapped layer)
    if not generate:  # then, in its place (one LoRA slot), an adapter it must refuse (argv[5])
        loaded = sorted(llm.llm_engine.list_loras())
        llm.llm_engine.remove_lora(1)
        try:
            llm.llm_engine.add_lora(LoRARequest("broken", 2, sys.argv[5]))
            llm.llm_engine.pin_lora(2)
            refused = None
        except Exception as e:
            refused = type(e).__name__ + ": " + str(e).splitlines()[0]
        print("LOADED " + json.dumps({"loaded": loaded, "refused": refused}))
        sys.exit(0)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (%d, %d, 3), dtype=np.uint8))
    pixels = AutoProcessor.from_pretrained(model).image_processor(images=[image], return_tensors="pt")
    save_file({k: pixels[k].contiguous() for k in ("pixel_values", "image_grid_thw")}, "image.safetensors")
    prompts = [TokensPrompt(prompt_token_ids=prompt["text"]),
               TokensPrompt(prompt_token_ids=prompt["image"], multi_modal_data={"image": image})]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompts, params, lora_request=request)
    print("TOKENS " + json.dumps({"prompts": [list(o.prompt_token_ids) for o in out],
                                  "tokens": [list(o.outputs[0].token_ids) for o in out]}))
""" % (IMAGE_SIZE, IMAGE_SIZE)


def greedy(model, ids: torch.Tensor, steps: int, **image) -> list[int]:
    """transformers' greedy tokens (full forward each step, images included)."""
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(steps):
            extra = {**image, "mm_token_type_ids": (ids == model.config.image_token_id).int()} if image else {}
            ids = torch.cat([ids, model(input_ids=ids, **extra).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, -steps:].tolist()


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_the_dense_adapter_like_peft(tmp_path):
    """vLLM's CPU engine (tower and connector LoRA on) accepts the adapter exported from TP2 adapters on
    the language model and the vision tower, and its greedy tokens (float32) on a text-only and a
    text+image prompt equal transformers+peft's on the same pixels; without the adapter they differ."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    hf = vllm_model(tmp_path, moe=False)
    config = json.loads((hf / "config.json").read_text())
    lora, _ = lora_checkpoint(tmp_path, hf, Layout(tp=2), vision=True, adapter_only=True)
    export(lora, tmp_path / "adapter", "--base-model", hf)
    text = list(range(3, 60, 4))
    image_prompt = text[:4] + [config["vision_start_token_id"], config["image_token_id"],
                               config["vision_end_token_id"]] + text[4:]
    served = run_vllm(tmp_path, VLLM_VL_SCRIPT, hf, tmp_path / "adapter",
                      json.dumps({"text": text, "image": image_prompt}), "generate")
    image = load_file(tmp_path / "image.safetensors")
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(hf, dtype=torch.float32),
                                      tmp_path / "adapter").eval()
    (text_ids, image_ids), ours = [torch.tensor([p]) for p in served["prompts"]], []
    assert text_ids[0].tolist() == text and (image_ids == config["image_token_id"]).sum() == 4
    for adapter in (True, False):
        with model.disable_adapter() if not adapter else torch.no_grad():
            ours.append([greedy(model, text_ids, 8), greedy(model, image_ids, 8, **image)])
    assert served["tokens"] == ours[0]
    assert all(with_adapter != without for with_adapter, without in zip(ours[0], ours[1]))  # the adapter matters


@pytest.mark.slow
@needs_vllm
def test_vllm_loads_the_moe_expert_adapter(tmp_path):
    """vLLM's CPU engine for Qwen3-VL-MoE (LoRA on) loads the exported adapter, 3-D expert form included,
    into its LoRA slots (its `FusedMoE3DWithLoRA` reshapes A/B by expert and copies them in). It cannot
    generate with it: vLLM's MoE-LoRA kernel is Triton-only, with no CPU backend."""
    hf = vllm_model(tmp_path, moe=True)
    lora, _ = lora_checkpoint(tmp_path, hf, Layout(tp=2, ep=2), vision=True, adapter_only=True)
    export(lora, tmp_path / "adapter", "--base-model", hf)
    assert load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)[
        "base_model.model.model.language_model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (4 * R, 64)
    # The same adapter with layer 0's gate_up_proj B one row too long: vLLM's copy into its slots refuses it
    # (so loading the good one checked its shapes).
    shutil.copytree(tmp_path / "adapter", tmp_path / "broken")
    tensors = load_file(tmp_path / "broken" / ADAPTER_WEIGHTS)
    key = "base_model.model.model.language_model.layers.0.mlp.experts.base_layer.lora_B.weight"
    tensors[key] = torch.cat([tensors[key], tensors[key][:1]])
    save_file(tensors, tmp_path / "broken" / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    result = run_vllm(tmp_path, VLLM_VL_SCRIPT, hf, tmp_path / "adapter", "{}", "load", tmp_path / "broken",
                      marker="LOADED ")
    assert result["loaded"] == [1] and "(81)" in result["refused"], result  # 2 * 40 + 1 rows: refused by shape
