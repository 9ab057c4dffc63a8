"""Hugging Face model directories beside their weights: config.json read and checked, the files that
describe the model (config, generation config, tokenizer, remote code) copied next to converted
weights, and config.json rewritten for them. The weights are `hf_io` (read) and `hf_write`."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from mconv.converter.options import dtype_name
from mconv.converter.output import copy_file, file_kind
from mconv.converter.remote_code import remote_code_files
from mconv.errors import MconvError

# Files that describe the model rather than hold weights; copied next to converted weights.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
              "video_preprocessor_config.json")


def side_file_differences(a: Path, b: Path) -> list[str]:
    """The generation config and tokenizer files (SIDE_FILES but config.json) that one of the
    directories `a` and `b` has and the other lacks or holds otherwise, byte for byte (a conversion
    copies them as they are): `tokenizer.json: only in A`, `...: the files differ`."""
    differences = []
    for name in (name for name in SIDE_FILES if name != "config.json"):
        files = [Path(side) / name for side in (a, b)]
        there = [f.is_file() for f in files]
        if there[0] != there[1]:
            differences.append(f"{name}: only in {(a, b)[there.index(True)]}")
        elif there[0] and files[0].read_bytes() != files[1].read_bytes():
            differences.append(f"{name}: the files differ")
    return differences


def read_json(path: Path, what: str, object_pairs_hook=None) -> dict:
    """A JSON object from `path` (`what` says what the file should be, for the error).

    Raises MconvError naming the file if it is missing, not a regular file (a FIFO or a device is
    never opened), not UTF-8, not JSON, or not a JSON object."""
    if not path.is_file():
        missing = not os.path.lexists(path) or (path.is_symlink() and not path.exists())
        raise MconvError(f"{path} {'does not exist' if missing else 'is not a regular file'}: {what}")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as e:
        raise MconvError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): {what}") from None
    except (ValueError, RecursionError) as e:
        raise MconvError(f"{path} is not valid JSON ({str(e).splitlines()[0]}): {what}") from None
    except OSError as e:
        raise MconvError(f"{path} cannot be read ({e.strerror}): {what}") from None
    if not isinstance(value, dict):
        raise MconvError(f"{path} holds a JSON {type(value).__name__}, not an object: {what}")
    return value


# Standard transformers config fields and what they must be: a config.json that gives another type
# (or a size no model has, which would make the plan itself unbounded) is refused by name, before
# any table reads it. The limits are far above any released model.
CONFIG_FIELDS = {
    **{key: (int, 1, 2**31) for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "intermediate_size", "vocab_size", "max_position_embeddings",
                                         "moe_intermediate_size", "num_experts_per_tok", "decoder_sparse_step",
                                         "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                                         # Qwen3.5 / Qwen3-Next's gated delta net, BailingMoeV3's MLA and KDA
                                         "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                         "linear_value_head_dim", "linear_conv_kernel_dim", "short_conv_kernel_size",
                                         "v_head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "kv_lora_rank",
                                         "n_group", "topk_group", "layer_group_size",
                                         # vision towers (vision_config)
                                         "depth", "num_heads", "patch_size", "temporal_patch_size",
                                         "spatial_merge_size", "in_channels", "out_hidden_size",
                                         "num_position_embeddings")},
    **{key: (int, 0, 2**31) for key in ("q_lora_rank", "num_shared_experts", "num_nextn_predict_layers",
                                         "first_k_dense_replace", "mtp_num_hidden_layers")},
    "full_attention_interval": (int, 1, 2**31),
    "attention_dropout": (float, 0, 1),
    **{key: (int, 1, 100_000) for key in ("num_hidden_layers", "num_experts", "num_local_experts")},
    **{key: (float, 0, float("inf")) for key in ("rms_norm_eps", "rope_theta", "layer_norm_eps",
                                                  "partial_rotary_factor", "routed_scaling_factor")},
    **{key: (bool, None, None) for key in ("tie_word_embeddings", "attention_bias", "norm_topk_prob")},
    "architectures": (list, None, None),  # of names
    "mlp_only_layers": (list, None, None),  # of layer numbers
    "layer_types": (list, None, None),  # of names
    "deepstack_visual_indexes": (list, None, None),  # of layer numbers
    **{key: (str, None, None) for key in ("hidden_act", "score_function", "scoring_func", "model_type")},
    **{key: (dict, None, None) for key in ("rope_parameters", "rope_scaling", "quantization_config",
                                            "text_config", "vision_config")},
}
_LIST_ITEMS = {"architectures": (str, "names"), "mlp_only_layers": (int, "layer numbers"),
               "layer_types": (str, "layer types"), "deepstack_visual_indexes": (int, "layer numbers")}
# Fields a null cannot stand for (transformers' config classes would hold None where a number goes);
# others may be null for "none" or "the default" (head_dim, q_lora_rank, rope_scaling...)
_NEVER_NULL = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
               "max_position_embeddings", "moe_intermediate_size", "num_experts_per_tok", "decoder_sparse_step",
               "rms_norm_eps", "rope_theta", "attention_dropout", "full_attention_interval", "first_k_dense_replace")
_ROPE_NAMES = ("rope_type", "type")  # the rotary block's fields that are names; the others numbers, flags or lists


def check_config(config: dict, path: Path) -> None:
    """Refuse standard config fields of the wrong type or size (`CONFIG_FIELDS`), in config.json
    and in a nested `text_config` and `vision_config` (vision-language models), and a rotary block
    (`rope_parameters`, `rope_scaling`) holding a name where a number goes or the reverse. A null
    is left to the table that reads the field (a default, or MissingConfigField)."""
    for where, fields in (("", config), ("text_config.", config.get("text_config")),
                          ("vision_config.", config.get("vision_config"))):
        if not isinstance(fields, dict):
            continue
        for key, (kind, low, high) in CONFIG_FIELDS.items():
            value = fields.get(key)
            if value is None:
                if key in fields and key in _NEVER_NULL:
                    raise MconvError(f"{path}: {where}{key} is null, where a value is needed")
                continue
            number = kind in (int, float) and isinstance(value, (int, float) if kind is float else int)
            if isinstance(value, bool) != (kind is bool) or not (number or isinstance(value, kind)):
                what = {float: "a number", dict: "an object", list: "a list", int: "a whole number", str: "a name",
                        bool: "true or false"}[kind]
                raise MconvError(f"{path}: {where}{key} is {_shown(value)}, not {what}")
            if number and not low <= value <= high:
                raise MconvError(f"{path}: {where}{key} is {value!r}, outside [{low}, {high:,}]")
            if kind is list:
                item, items = _LIST_ITEMS[key]
                if not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
                    raise MconvError(f"{path}: {where}{key} is {_shown(value)}, not a list of {items}")
        experts = fields.get("num_local_experts") or fields.get("num_experts")
        top_k = fields.get("num_experts_per_tok")
        if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts:
            raise MconvError(f"{path}: {where}num_experts_per_tok is {top_k}, more than the model's {experts} experts")
        for block in ("rope_parameters", "rope_scaling"):
            for name, value in (fields.get(block) or {}).items():
                if value is None and name == "rope_theta":
                    raise MconvError(f"{path}: {where}{block}.rope_theta is null, where a value is needed")
                if isinstance(value, list) and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in value):
                    raise MconvError(f"{path}: {where}{block}.{name} is {_shown(value)}, not a list of numbers")
                if value is None or isinstance(value, (dict, list, bool)):  # (per-layer-type blocks: the tables'; flags
                    continue  # such as mrope_interleaved)
                named = name in _ROPE_NAMES
                if isinstance(value, str) != named:
                    raise MconvError(f"{path}: {where}{block}.{name} is {_shown(value)}, "
                                     f"not {'a name' if named else 'a number'}")


def _shown(value) -> str:
    """A config value as a message quotes it: its JSON, cut at 60 characters."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_config(directory: Path) -> dict:
    """config.json of an HF model directory, its standard fields checked (`check_config`)."""
    path = Path(directory) / "config.json"
    config = read_json(path, "an HF model directory needs its config.json")
    check_config(config, path)
    return config


def side_files(source: Path) -> list[str]:
    """The config, generation config and tokenizer files `source` holds, and the remote code their
    `auto_map` names (remote_code.remote_code_files: never imported here): what copy_side_files
    copies. Commands call it before converting, so that a bad one stops them before the weights.
    One that is there but is not a regular file (a FIFO, a device, a directory, a dangling symlink),
    or a .json one that is not a JSON object, raises MconvError naming it, as every file mconv
    reads does: skipped or copied, it would be missing or broken in this output and every later one
    without a word. A symlink to a regular file is one."""
    found = []
    for name in SIDE_FILES + tuple(remote_code_files(source, SIDE_FILES)):
        path = Path(source) / name
        if not os.path.lexists(path):
            continue
        if not path.is_file():  # never opened: a FIFO would block, /dev/zero never end
            what = ("a directory" if path.is_dir() else file_kind(path)) + (", not a regular file" if path.exists() else "")
            raise MconvError(f"{path} is {what}: mconv copies a model's config and tokenizer files beside its weights")
        if name.endswith(".json") and name != "config.json":  # (config.json: read_config's)
            read_json(path, "mconv copies a model's config and tokenizer files beside its weights, as they are")
        found.append(name)
    return found


def copy_side_files(source: Path, destination: Path) -> list[str]:
    """Copy `side_files(source)` into `destination` (raising as it does); returns their names."""
    copied = side_files(source)
    for name in copied:
        copy_file(Path(source) / name, Path(destination) / name)
    return copied


def write_hf_config(directory: Path, config: dict, original: dict) -> None:
    """Replace the copied config.json by `config` (an architecture's rewrite of `original`, e.g. with
    the keys of both transformers 4.x and 5.x), leaving the file as it was if nothing changed."""
    if config != original:
        (Path(directory) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_config_dtype(directory: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
    """Record the dtype of the weights written (`entries`: name, dtype, shape; the dtype holding
    most bytes if they are mixed) in `directory`/config.json, under the key the config already
    uses (`dtype` in transformers 5, `torch_dtype` before), as `save_pretrained` does."""
    written: dict[torch.dtype, int] = {}
    for _, dtype, shape in entries:
        written[dtype] = written.get(dtype, 0) + math.prod(shape) * dtype.itemsize
    dtype = max(written, key=written.get)
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    key = "dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"
    if config.get(key) == dtype_name(dtype):
        return  # already right: keep the file as it was
    config[key] = dtype_name(dtype)
    path.write_text(json.dumps(config, indent=2) + "\n")
