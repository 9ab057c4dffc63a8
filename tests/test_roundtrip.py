"""HF -> Megatron -> HF is bit-identical (every tensor, every dtype) over random layouts and shapes,
and transformers loads what mcore2hf writes with no missing or unexpected keys."""
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from fixtures.make_fixtures import make_qwen3
from mconv import Layout, MconvError, hf2mcore, mcore2hf
from tests.conftest import FIXTURES


def read_all(directory):
    tensors = {}
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for file in files:
        with safe_open(directory / file, "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


@st.composite
def model_and_layout(draw):
    groups = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if groups % d == 0]))
    layers = draw(st.integers(1, 6))
    pp = draw(st.sampled_from([p for p in (1, 2, 3, 4) if p <= layers]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    first = last = None
    if pp > 1 and draw(st.booleans()):
        first = draw(st.integers(1, layers))
        last = draw(st.one_of(st.none(), st.integers(1, layers)))
    layout = Layout(tp=tp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last,
                     vocab_divisor=draw(st.sampled_from([1, 8, 128])))
    try:
        layout.validate(layers)
    except MconvError:
        layout = Layout(tp=tp, pp=1, vocab_divisor=layout.vocab_divisor)
    head_dim = draw(st.sampled_from([4, 8]))
    model = dict(num_key_value_heads=groups, num_attention_heads=groups * draw(st.sampled_from([1, 2, 3])),
                 head_dim=head_dim, hidden_size=draw(st.sampled_from([16, 24, 32])),
                 intermediate_size=8 * tp * draw(st.integers(1, 3)), num_hidden_layers=layers,
                 vocab_size=draw(st.integers(17, 300)), tie_word_embeddings=draw(st.booleans()),
                 dtype=draw(st.sampled_from([torch.bfloat16, torch.float32, torch.float16])),
                 spec=draw(st.sampled_from(["local", "te"])))
    return model, layout


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_and_layout(), seed=st.integers(0, 2**16))
def test_round_trip_is_bit_identical(tmp_path_factory, case, seed):
    model, layout = case
    spec, dtype = model.pop("spec"), model.pop("dtype")
    tmp = tmp_path_factory.mktemp("rt")
    hf = make_qwen3(tmp / "hf", seed=seed, dtype=dtype, tokenizer=False, **model)
    hf2mcore(hf, tmp / "megatron", layout, spec=spec, fmt="torch", progress=False)
    mcore2hf(tmp / "megatron", tmp / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp / "back"))


@pytest.mark.parametrize("fixture", ["qwen3-tiny", "qwen3-tiny-tied"])
def test_transformers_loads_output_without_missing_or_unexpected_keys(tmp_path, fixture):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf2mcore(FIXTURES / fixture, tmp_path / "m", Layout(tp=2, pp=2), spec="te", fmt="torch", progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "back", max_shard_bytes=100_000, progress=False)
    assert len(list((tmp_path / "back").glob("model-*.safetensors"))) > 1
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    tensors = read_all(tmp_path / "back")
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert AutoTokenizer.from_pretrained(tmp_path / "back")("mconv").input_ids
    assert (tmp_path / "back" / "generation_config.json").is_file()
    assert_bit_identical(read_all(FIXTURES / fixture), tensors)


def test_sharded_hf_input_and_iteration_directory(tmp_path):
    hf = make_qwen3(tmp_path / "hf", tokenizer=False, max_shard_size="100KB")
    assert (hf / "model.safetensors.index.json").exists()
    hf2mcore(hf, tmp_path / "m", Layout(tp=2), iteration=42, fmt="torch", progress=False)
    assert (tmp_path / "m" / "latest_checkpointed_iteration.txt").read_text() == "42"
    mcore2hf(tmp_path / "m" / "iter_0000042", tmp_path / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp_path / "back"))
