"""config.json fields read as transformers reads them: rotary embeddings (YaRN against
megatron-core's YarnRotaryEmbedding), refused forward-pass fields, config-class defaults, a model
named by model_type alone, and a tied model whose files also hold lm_head.weight. The forward
oracle for YaRN is in test_oracle_megatron.py."""
import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from mconv.cli import main
from mconv.mappings import ARCHITECTURES, architecture_for
from mconv.mappings.common import rope_args, rope_parameters
from tests.conftest import FIXTURES
from tests.megatron_oracle import read_config
from tests.test_errors import assert_refused

DENSE, MOE, TIED = (read_config(FIXTURES / name) for name in ("qwen3-tiny", "qwen3-moe-tiny", "qwen3-tiny-tied"))
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def without(config: dict, *keys) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


ROPE_CONFIGS = {  # name: config.json
    "5.x default": DENSE,
    "4.x top-level rope_theta": {**without(DENSE, "rope_parameters"), "rope_theta": 5000.0},
    "no rope fields": without(DENSE, "rope_parameters"),
    "5.x yarn": {**DENSE, "rope_parameters": {**YARN, "rope_theta": 1e6}},
    "5.x yarn, no original length": {**DENSE, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}},
    "4.x rope_scaling with type": {**without(DENSE, "rope_parameters"), "rope_theta": 5000.0,
                                   "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}},
    "4.x rope_scaling over rope_parameters": {**DENSE, "rope_theta": 5000.0, "rope_scaling": YARN},
    "yarn, all settings": {**DENSE, "rope_parameters": {**YARN, "rope_theta": 1e4, "beta_fast": 16.0, "beta_slow": 2.0,
                                                        "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False}},
    "yarn, mscale without mscale_all_dim": {**DENSE, "rope_parameters": {**YARN, "rope_theta": 1e4, "mscale": 0.7}},
    "yarn, attention_factor as derived": {**DENSE, "rope_parameters": {**YARN, "rope_theta": 1e4,
                                                                      "attention_factor": 0.1 * math.log(4.0) + 1}},
    "yarn, factor from the lengths": {**DENSE, "max_position_embeddings": 256,
                                      "rope_parameters": {**YARN, "factor": None, "rope_theta": 1e4}},
}


@pytest.mark.parametrize("config", ROPE_CONFIGS.values(), ids=ROPE_CONFIGS)
def test_rope_parameters_as_transformers_reads_them(config):
    ours, _ = rope_parameters(config)
    theirs = Qwen3Config.from_dict(config).rope_parameters
    for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "mscale"):
        assert ours.get(key) == theirs.get(key), key


@pytest.mark.parametrize("config", [c for c in ROPE_CONFIGS.values() if rope_parameters(c)[0]["rope_type"] == "yarn"],
                         ids=[n for n, c in ROPE_CONFIGS.items() if rope_parameters(c)[0]["rope_type"] == "yarn"])
def test_yarn_settings_give_transformers_frequencies(config):
    """megatron-core's YarnRotaryEmbedding built from the Megatron-LM args mconv stores (as
    GPTModel builds it) gives transformers' YaRN inverse frequencies and cos/sin factor."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding

    torch.cuda.current_device = lambda: "cpu"  # get_emb moves its tables to the current device
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config.from_dict(config), "cpu")
    a = rope_args(config)
    assert a["position_embedding_type"] == "yarn"
    yarn = YarnRotaryEmbedding(kv_channels=config["head_dim"], rotary_base=a["rotary_base"],
                               use_cpu_initialization=True, scaling_factor=a["rotary_scaling_factor"],
                               original_max_position_embeddings=a["yarn_original_max_position_embeddings"],
                               beta_fast=a["yarn_beta_fast"], beta_slow=a["yarn_beta_slow"], mscale=a["mscale"],
                               mscale_all_dim=a["mscale_all_dim"],
                               correction_range_round_to_int=a["yarn_correction_range_round_to_int"])
    emb, mscale = yarn.get_emb(2)
    assert torch.equal(emb[1, 0, 0, : len(inv_freq)], inv_freq)
    assert mscale == pytest.approx(attention_factor, rel=1e-12)


REFUSED = {  # name: (config.json, what the message names)
    "linear": ({**DENSE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "'linear'"),
    "dynamic": ({**DENSE, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "'dynamic'"),
    "llama3": ({**without(DENSE, "rope_parameters"), "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}, "rope_scaling has rope_type 'llama3'"),
    "partial rotary": ({**DENSE, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "yarn attention_factor": ({**DENSE, "rope_parameters": {**YARN, "rope_theta": 1e6, "attention_factor": 2.0}},
                              "attention_factor"),
    "gelu": ({**DENSE, "hidden_act": "gelu"}, "hidden_act"),
    "attention bias": ({**DENSE, "attention_bias": True}, "attention_bias"),
    "qwen3 sliding window": ({**without(DENSE, "layer_types"), "use_sliding_window": True, "sliding_window": 8,
                              "max_window_layers": 2},
                             "use_sliding_window gives layers [2, 3]"),
    "qwen3 layer_types": ({**DENSE, "layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    "qwen3-moe sliding window": ({**MOE, "use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
}


@pytest.mark.parametrize("config,fragment", REFUSED.values(), ids=REFUSED)
def test_forward_fields_mconv_cannot_carry_are_refused_by_name(tmp_path, config, fragment):
    source = FIXTURES / ("qwen3-moe-tiny" if config.get("num_local_experts") else "qwen3-tiny")
    hf = shutil.copytree(source, tmp_path / "hf")
    (hf / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["hf2mcore", str(hf), str(tmp_path / "out"), "-q"])
    assert_refused(result, tmp_path / "out", "config.json", fragment)


@pytest.mark.parametrize("config,config_class", [(DENSE, Qwen3Config), (MOE, Qwen3MoeConfig)], ids=["qwen3", "qwen3-moe"])
def test_config_class_defaults(config, config_class):
    """A config.json without head_dim / num_key_value_heads: the values transformers' config class
    (and so its attention) uses."""
    config = without(config, "head_dim", "num_key_value_heads")
    hf = config_class.from_dict(config)
    dims = architecture_for(config).dims(config)
    assert dims.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert dims.groups == hf.num_key_value_heads


def test_model_type_picks_transformers_causal_lm_class(tmp_path):
    named = [arch for arch in ARCHITECTURES.values() if arch.model_type]
    assert {arch.name for arch in named} >= {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
    for arch in named:
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch.model_type] == arch.name
    hf = shutil.copytree(FIXTURES / "qwen3-moe-tiny", tmp_path / "hf")
    (hf / "config.json").write_text(json.dumps(without(MOE, "architectures")))
    assert type(AutoModelForCausalLM.from_pretrained(hf)).__name__ == "Qwen3MoeForCausalLM"
    result = CliRunner().invoke(main, ["hf2mcore", str(hf), str(tmp_path / "out"), "--format", "torch"])
    assert result.exit_code == 0, result.output
    assert "Qwen3MoeForCausalLM" in result.output


@pytest.mark.parametrize("config,fragment", [({**without(DENSE, "architectures"), "model_type": "llama"}, "'llama'"),
                                             (without(DENSE, "architectures", "model_type"), "model_type")],
                         ids=["unsupported", "neither"])
def test_model_type_refused(tmp_path, config, fragment):
    hf = shutil.copytree(FIXTURES / "qwen3-tiny", tmp_path / "hf")
    (hf / "config.json").write_text(json.dumps(config))
    assert_refused(CliRunner().invoke(main, ["hf2mcore", str(hf), str(tmp_path / "out")]), tmp_path / "out",
                   "config.json", fragment)


def tied_with_head(tmp_path, head: torch.Tensor | None = None):
    hf = shutil.copytree(FIXTURES / "qwen3-tiny-tied", tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone() if head is None else head
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return hf


def logits(hf_dir) -> torch.Tensor:
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        return model.eval()(torch.tensor([list(range(3, 60, 4))])).logits


def test_tied_model_with_redundant_lm_head(tmp_path):
    """transformers loads a tied model whose files also hold lm_head.weight; so does mconv, saying so,
    and the model it gives back has transformers' logits."""
    hf = tied_with_head(tmp_path)
    reference = logits(hf)
    result = CliRunner().invoke(main, ["hf2mcore", str(hf), str(tmp_path / "ckpt"), "--format", "torch"])
    assert result.exit_code == 0, result.output
    assert "lm_head.weight equals model.embed_tokens.weight bit for bit" in result.output
    result = CliRunner().invoke(main, ["mcore2hf", str(tmp_path / "ckpt"), str(tmp_path / "back"), "-q"])
    assert result.exit_code == 0, result.output
    assert torch.equal(logits(tmp_path / "back"), reference)


def test_tied_model_with_different_lm_head_is_refused(tmp_path):
    embedding = load_file(FIXTURES / "qwen3-tiny-tied" / "model.safetensors")["model.embed_tokens.weight"]
    head = embedding.clone()
    head[-1, -1] += 1
    hf = tied_with_head(tmp_path, head)
    assert_refused(CliRunner().invoke(main, ["hf2mcore", str(hf), str(tmp_path / "out")]), tmp_path / "out",
                   "lm_head.weight differs from model.embed_tokens.weight")


def test_yarn_args_in_torch_dist_common_state(tmp_path):
    """torch_dist keys do not depend on the rotary embedding (it has no parameters): a YaRN model
    converts both ways bit for bit, and megatron-core's own common-state loader reads the YaRN args."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    hf = shutil.copytree(FIXTURES / "qwen3-tiny", tmp_path / "hf")
    config = {**DENSE, "rope_parameters": {**YARN, "rope_theta": 1e6}}
    (hf / "config.json").write_text(json.dumps(config))
    for command in (["hf2mcore", hf, tmp_path / "ckpt", "-q"], ["mcore2hf", tmp_path / "ckpt", tmp_path / "back", "-q"]):
        result = CliRunner().invoke(main, [str(c) for c in command])
        assert result.exit_code == 0, result.output
    args = load_common_state_dict(str(tmp_path / "ckpt" / "release"))["args"]
    assert {k: getattr(args, k) for k in rope_args(config)} == rope_args(config)
    original = load_file(hf / "model.safetensors")
    back = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k].view(torch.uint8), back[k].view(torch.uint8)) for k in original)


MALFORMED = {  # id: (fixture, field, value, what the one line says)
    "hidden_size null": ("qwen3-tiny", "hidden_size", None, "hidden_size is null, where a value is needed"),
    "moe_intermediate_size null": ("qwen3-moe-tiny", "moe_intermediate_size", None,
                                   "moe_intermediate_size is null, where a value is needed"),
    "linear_num_value_heads null": ("qwen3-5-tiny", "linear_num_value_heads", None,
                                    "gives 'linear_num_value_heads' as null"),
    "linear_key_head_dim a string": ("qwen3-5-tiny", "linear_key_head_dim", "8",
                                     'linear_key_head_dim is "8", not a whole number'),
    "rms_norm_eps null": ("qwen3-tiny", "rms_norm_eps", None, "rms_norm_eps is null, where a value is needed"),
    "attention_dropout a string": ("qwen3-tiny", "attention_dropout", "abc", 'attention_dropout is "abc", not a number'),
    "rope_theta null in the block": ("qwen3-tiny", "rope_parameters", {"rope_type": "default", "rope_theta": None},
                                     "rope_parameters.rope_theta is null, where a value is needed"),
    "max_position_embeddings null": ("bailing-v3-tiny", "max_position_embeddings", None,
                                     "max_position_embeddings is null, where a value is needed"),
    "rope_parameters a string": ("qwen3-tiny", "rope_parameters", "x", 'rope_parameters is "x", not an object'),
    "rope factor a string": ("qwen3-tiny", "rope_parameters", {"rope_type": "yarn", "factor": "4"},
                             'rope_parameters.factor is "4", not a number'),
    "quantization_config a string": ("qwen3-tiny", "quantization_config", "fp8",
                                     'quantization_config is "fp8", not an object'),
    "layer_types a string": ("qwen3-5-tiny", "layer_types", "full", 'layer_types is "full", not a list'),
    "top-k beyond the experts": ("qwen3-moe-tiny", "num_experts_per_tok", 99,
                                 "num_experts_per_tok is 99, more than the model's"),
}


@pytest.mark.parametrize("fixture,field,value,fragment", MALFORMED.values(), ids=MALFORMED)
def test_malformed_config_fields_are_one_line(tmp_path, fixture, field, value, fragment):
    """A null where a table needs a value, or a value of the wrong JSON type, in a field mconv reads
    (new-user pass: these were tracebacks): hf2mcore and inspect each say so in one line naming
    config.json and the field, nothing written."""
    hf = shutil.copytree(FIXTURES / fixture, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, field: value}))
    result = CliRunner().invoke(main, ["hf2mcore", str(hf), str(tmp_path / "out"), "-q"])
    assert_refused(result, tmp_path / "out", "config.json", fragment)
    shown = CliRunner().invoke(main, ["inspect", str(hf)])
    assert shown.exit_code == 1 and shown.stderr.count("\n") == 1 and fragment in shown.stderr, shown.output


def test_a_side_file_that_is_not_json_stops_the_conversion(tmp_path):
    """A generation config or tokenizer file that is not JSON is named before any weight is written
    (it was copied into the output as it was, broken)."""
    hf = shutil.copytree(FIXTURES / "qwen3-tiny", tmp_path / "hf")
    (hf / "tokenizer_config.json").write_text("{bad")
    result = CliRunner().invoke(main, ["hf2mcore", str(hf), str(tmp_path / "out"), "-q"])
    assert_refused(result, tmp_path / "out", "tokenizer_config.json is not valid JSON")
