"""BailingMoeV3 in torch_dist: per-layer keys derived from the table (mconv/converter/torch_dist.py)
and bit-exact round trips over model variants."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.make_fixtures import make_bailing_v3
from mconv import Layout, hf2mcore, mcore2hf
from tests.megatron_oracle import read_config
from tests.test_bailing import SMALL
from tests.test_roundtrip import assert_bit_identical, read_all

SECTIONS = ("query", "key", "value", "g", "gate")


@st.composite
def model_case(draw):
    layers = draw(st.integers(1, 5))
    model = dict(SMALL, num_hidden_layers=layers, layer_group_size=draw(st.integers(1, 4)),
                 first_k_dense_replace=draw(st.integers(0, layers)), no_kda_lora=draw(st.booleans()),
                 q_lora_rank=draw(st.sampled_from([None, 16])), tie_word_embeddings=draw(st.booleans()),
                 num_experts=draw(st.sampled_from([4, 8])), vocab_size=draw(st.integers(17, 120)))
    layout = Layout(tp=draw(st.sampled_from([1, 2, 4])), vocab_divisor=draw(st.sampled_from([1, 8, 128])))
    return model, layout, draw(st.sampled_from([torch.bfloat16, torch.float32]))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_case(), seed=st.integers(0, 2**16))
def test_torch_dist_round_trip_is_bit_identical(tmp_path_factory, case, seed):
    model, layout, dtype = case
    tmp = tmp_path_factory.mktemp("bailing-dist")
    hf = make_bailing_v3(tmp / "hf", seed=seed, dtype=dtype, tokenizer=False, **model)
    hf2mcore(hf, tmp / "megatron", layout, fmt="torch_dist", progress=False)
    mcore2hf(tmp / "megatron", tmp / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp / "back"))


def test_keys_are_per_layer_with_kda_sections(tmp_path):
    """What AReaL's model asks for: per-layer keys (KDA and MLA layers differ), local-spec names,
    the KDA fused tensors one global tensor per section, experts on an expert axis, fp32 buffers kept."""
    from mconv.converter.torch_dist_io import TorchDistReader

    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False)  # layers: 0 KDA+dense, 1 MLA+dense, 2 KDA+MoE, 3 MLA+MoE
    hf2mcore(hf, tmp_path / "m", Layout(), progress=False)
    stored = TorchDistReader(tmp_path / "m" / "release").tensors
    c = read_config(hf)
    p = c["num_attention_heads"] * c["head_dim"]
    assert {f"decoder.layers.0.self_attention.in_proj.weight.{s}" for s in SECTIONS} <= stored.keys()
    assert stored["decoder.layers.0.self_attention.in_proj.weight.gate"].shape == (p, c["hidden_size"])
    assert stored["decoder.layers.2.self_attention.conv1d.weight.value"].shape == (p, 1, c["short_conv_kernel_size"])
    assert stored["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"].shape == (
        c["num_experts"], 2 * c["moe_intermediate_size"], c["hidden_size"])
    assert stored["decoder.layers.3.mlp.router.expert_bias"].dtype == torch.float32
    assert {"decoder.layers.1.input_layernorm.weight", "decoder.layers.1.self_attention.kv_layernorm.weight",
            "decoder.layers.0.input_layernorm.weight", "decoder.layers.2.pre_mlp_layernorm.weight"} <= stored.keys()
    assert not any(key.startswith("decoder.layers.self_attention") for key in stored)
