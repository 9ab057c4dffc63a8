"""Block-wise FP8 of BailingMoeV3 (Ling 3.0), as vLLM 0.32 loads it (docs/fp8.md, "BailingMoeV3"):
which modules vLLM builds as FP8 linears is asked of vLLM's own quantization config and Ling model code
(its Fp8Config, the model's name mapper and fused modules, Ling's suffix-mode exclusions), run on the
config.json mconv writes; the FP8 bytes and scales are compressed-tensors' block quantization of the
bf16 weights, the same at every layout; and FP8 -> Megatron -> FP8 gives the same bytes."""
import dataclasses
import json

import pytest
import torch

from mconv import Layout, MconvError, hf2mcore, mcore2hf
from mconv.converter.pipelines import compare_hf
from tests.conftest import FIXTURES, hf_tensors
from tests.test_fp8 import KEYS, bits, needs_compressed_tensors, reference_quantize
from tests.test_lora import needs_vllm, run_vllm

LING = FIXTURES / "bailing-v3-tiny"  # layers 0, 2 KDA and 1, 3 MLA (q-LoRA); 0, 1 dense MLP and 2, 3 MoE

# vLLM's decisions, in the vLLM venv: for each linear module its BailingMoeV3 builds with the quant
# config (model_executor/models/bailing_moe_v3.py: KDA's qkv_proj / qkvb_proj, b_proj, f/g/o_proj; MLA's
# fused_qkv_a_proj, q_b_proj, kv_b_proj, g_proj, dense; the MLPs' gate_up_proj / down_proj; the routed
# experts' FusedMoE), whether the FP8 config mconv wrote leaves it unquantized, by vLLM's own functions.
VLLM_DECIDES = """
import json, sys
from types import SimpleNamespace
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.model_loader.utils import configure_quant_config
from vllm.model_executor.models import bailing_moe_v3 as ling

config = json.load(open(sys.argv[1]))
quant = Fp8Config.from_config(config["quantization_config"])
configure_quant_config(quant, ling.BailingMoeV3ForCausalLM)  # HF names to vLLM's, fused modules
ling._configure_ling_fp8_quant_config(quant, SimpleNamespace(quantization_config=config["quantization_config"]))
group = config["layer_group_size"]
decided = {}
for i in range(config["num_hidden_layers"]):
    at = f"model.layers.{i}."
    mla = (i + 1) % group == 0 or i >= config["num_hidden_layers"] // group * group
    if mla:
        attention = ["fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "g_proj", "dense"]
    else:
        separate_b = ling._is_fp8_module_excluded(quant, at + "self_attn.b_proj")  # as KDA's __init__ asks
        attention = (["qkv_proj", "b_proj"] if separate_b else ["qkvb_proj"]) + ["f_proj", "g_proj", "o_proj"]
    mlp = (["mlp.gate_up_proj", "mlp.down_proj"] if i < config["first_k_dense_replace"] else
           ["mlp.experts", "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj"])
    for module in [f"self_attn.{a}" for a in attention] + mlp:
        decided[at + module] = ling._is_fp8_module_excluded(quant, at + module)
print("DECIDED " + json.dumps(decided))
"""

# A vLLM module's HF weights (the model's hf_to_vllm_mapper: .attention. -> .self_attn.; its fused modules).
PARTS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "qkvb_proj": ["q_proj", "k_proj", "v_proj", "b_proj"],
         "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"], "gate_up_proj": ["gate_proj", "up_proj"]}


def hf_weights(vllm_module: str, written: dict) -> list[str]:
    at, _, name = vllm_module.replace(".self_attn.", ".attention.").rpartition(".")
    if name == "experts":
        return [n for n in written if n.startswith(f"{at}.experts.") and n.endswith("_proj.weight")]
    return [f"{at}.{part}.weight" for part in PARTS.get(name, [name])]


@pytest.mark.slow
@needs_compressed_tensors
@needs_vllm
def test_fp8_output_is_what_vllm_loads(tmp_path):
    """`mcore2hf --quantize fp8` of BailingMoeV3 at TP1 and at TP2/EP2/ETP1 writes the same bytes; every
    module vLLM's Ling model builds as an FP8 linear (by vLLM's own reading of the config.json written)
    holds compressed-tensors' FP8 of the bf16 weights with float32 scales, and every module it leaves
    unquantized (KDA b_proj, which it then keeps apart from q/k/v; MLA's head-wise g_proj) is bf16, as are
    the router, conv1d, norms, embeddings and lm_head; no fused module is partly FP8 (vLLM refuses that);
    modules_to_not_convert names exactly the 16-bit weights' modules. Read back (dequantized) and
    quantized again, the output gives its own bytes."""
    original = hf_tensors(LING)
    for name, sizes, fmt in (("tp1", {}, "torch"), ("tp2ep2", dict(tp=2, ep=2, etp=1), "torch_dist")):
        hf2mcore(LING, tmp_path / f"{name}-m", Layout(**sizes), fmt=fmt, progress=False)
        mcore2hf(tmp_path / f"{name}-m", tmp_path / name, progress=False, quantize="fp8")
    tensors, _, differences = compare_hf(tmp_path / "tp1", tmp_path / "tp2ep2")
    assert differences == [] and tensors > 150

    written = hf_tensors(tmp_path / "tp1")
    config = json.loads((tmp_path / "tp1" / "config.json").read_text())
    decided = run_vllm(tmp_path, VLLM_DECIDES, tmp_path / "tp1" / "config.json", marker="DECIDED ")
    fp8 = {weight for module, skipped in decided.items() if not skipped for weight in hf_weights(module, written)}
    kept = {weight for module, skipped in decided.items() if skipped for weight in hf_weights(module, written)}
    assert kept == {f"model.layers.{i}.attention.{p}.weight" for i, p in ((0, "b_proj"), (2, "b_proj"),
                                                                           (1, "g_proj"), (3, "g_proj"))}
    assert len(fp8) == 2 * 6 + 2 * 5 + 2 * 3 + 2 * (8 * 3 + 3)  # KDA, MLA, dense MLP, routed and shared experts
    for name, tensor in original.items():
        if name in fp8:
            q, scale = reference_quantize(tensor)
            assert torch.equal(bits(written[name]), bits(q)), name
            assert torch.equal(written[name + "_scale_inv"], scale) and scale.dtype == torch.float32, name
        else:
            assert torch.equal(written[name], tensor), name
    assert len(written) == len(original) + len(fp8)
    quantization = config["quantization_config"]
    assert {k: quantization[k] for k in KEYS} == KEYS
    assert sorted(quantization["modules_to_not_convert"]) == sorted(
        n.removesuffix(".weight") for n in original if n.endswith(".weight") and n not in fp8)

    hf2mcore(tmp_path / "tp1", tmp_path / "again-m", Layout(tp=2), fmt="torch", progress=False)
    mcore2hf(tmp_path / "again-m", tmp_path / "again", progress=False, quantize="fp8")
    tensors, _, differences = compare_hf(tmp_path / "tp1", tmp_path / "again")
    assert differences == [] and tensors == len(written)


def test_an_architecture_without_an_fp8_rule_is_refused_in_one_line():
    """An architecture table with no FP8 rule (`fp8=None`): `--quantize fp8` is one MconvError naming
    the option and the architecture."""
    from mconv.converter.fp8 import writer_quantization
    from mconv.mappings.bailing_v3 import BAILING_V3

    config = json.loads((LING / "config.json").read_text())
    with pytest.raises(MconvError, match=r"^quantize='fp8': mconv does not write FP8 checkpoints of "
                                         r"BailingMoeV3ForCausalLM yet \(which of its weights"):
        writer_quantization(dataclasses.replace(BAILING_V3, fp8=None), "fp8", None, config)
    assert writer_quantization(BAILING_V3, "fp8", None, config).applies("model.layers.3.attention.dense.weight", (8, 8))
