"""HF PEFT adapter directories (`adapter_config.json` + `adapter_model.safetensors`, as
`export-lora` and peft's `save_pretrained` write them), for `inspect` and `verify`.

Headers are read as for HF models (validated by safetensors itself), tensors with safetensors'
`safe_open`, one at a time; nothing is imported from peft.
"""
from __future__ import annotations

import json
from pathlib import Path

from mconv.converter.hf_config import side_file_differences
from mconv.converter.hf_io import read_safetensors_header, tensor_difference
from mconv.converter.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mconv.converter.options import dtype_name
from mconv.errors import MconvError

# adapter_config.json fields that change what the adapter computes (base_model_name_or_path only
# says where the base was found; inference_mode and task_type do not change the weights' effect).
EFFECT_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "target_parameters", "use_rslora", "use_dora",
                 "rank_pattern", "alpha_pattern", "fan_in_fan_out", "bias", "modules_to_save", "layers_to_transform")


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is a PEFT adapter directory (an adapter_config.json and no model config.json)."""
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def _config(path: Path) -> dict:
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise MconvError(f"{path / ADAPTER_CONFIG} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise MconvError(f"{path / ADAPTER_CONFIG} is not a JSON object")
    return config


def _weights(path: Path) -> dict:
    """The adapter's tensors (hf_io.read_safetensors_header: validated by safetensors itself)."""
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise MconvError(f"{path} is a PEFT adapter without {ADAPTER_WEIGHTS} (mconv reads only safetensors)")
    return read_safetensors_header(weights)


def describe_adapter(path: str | Path) -> dict:
    """`inspect` of a PEFT adapter: base model, peft type, r, alpha (and the scale alpha / r),
    target modules (and parameters), dtypes {dtype: {tensors, bytes}}, size. Raises MconvError
    for a config that is not JSON or weights that are missing or not safetensors."""
    path = Path(path)
    config = _config(path)
    dtypes: dict = {}
    for info in _weights(path).values():
        count, nbytes = dtypes.get(info.dtype, (0, 0))
        dtypes[info.dtype] = (count + 1, nbytes + info.nbytes)
    r, alpha = config.get("r"), config.get("lora_alpha")
    adapter = {"peft_type": config.get("peft_type"), "base_model": config.get("base_model_name_or_path"), "r": r,
               "alpha": alpha, "scale": alpha / r if isinstance(r, int) and r and isinstance(alpha, (int, float)) else None,
               "target_modules": config.get("target_modules"), "target_parameters": config.get("target_parameters")}
    return {"kind": "peft_adapter", "path": str(path), "adapter": {k: v for k, v in adapter.items() if v is not None},
            "dtypes": {dtype_name(d): {"tensors": n, "bytes": b} for d, (n, b) in dtypes.items()},
            "size": {"tensors": sum(n for n, _ in dtypes.values()), "bytes": sum(b for _, b in dtypes.values()),
                     "files": 1}}


def render_adapter(info: dict) -> list[str]:
    """The text `mconv inspect` prints for a PEFT adapter (see describe_adapter)."""
    a = info["adapter"]
    scale = f" (scale {a['scale']:g})" if "scale" in a else ""
    targets = ", ".join(a.get("target_modules") or []) or "none"
    lines = [f"{info['path']}: PEFT {a.get('peft_type', 'unknown type')} adapter",
             ("base", a.get("base_model", "not recorded")),
             ("adapter", f"r {a.get('r')}, alpha {a.get('alpha')}{scale}, target modules {targets}"
                         + (f", target parameters {', '.join(a['target_parameters'])}" if a.get("target_parameters") else "")),
             ("dtypes", "; ".join(f"{d}: {v['tensors']} tensors, {v['bytes']:,} bytes" for d, v in info["dtypes"].items())),
             ("size", f"{info['size']['tensors']} tensors, {info['size']['bytes']:,} bytes, {ADAPTER_WEIGHTS}")]
    return [line if isinstance(line, str) else f"  {line[0]:<8} {line[1]}" for line in lines]


def compare_adapters(a: Path, b: Path) -> tuple[int, int, list[str]]:
    """Two PEFT adapters, compared bit for bit: the adapter_config.json fields that change what the
    adapter computes (EFFECT_FIELDS), the tokenizer files either holds (hf_config.side_file_differences:
    vLLM serves an adapter with its own tokenizer where it has one), then every tensor's name,
    dtype, shape and bytes, one tensor in memory at a time. Returns (tensors compared, bytes
    compared, differences)."""
    from safetensors import safe_open

    configs = [_config(Path(p)) for p in (a, b)]
    differences = [f"{ADAPTER_CONFIG}: {key} is {json.dumps(configs[0].get(key))} vs {json.dumps(configs[1].get(key))}"
                   for key in EFFECT_FIELDS if configs[0].get(key) != configs[1].get(key)]
    differences += side_file_differences(Path(a), Path(b))
    headers = [_weights(Path(p)) for p in (a, b)]
    differences += [f"{name}: only in {a}" for name in sorted(headers[0].keys() - headers[1].keys())]
    differences += [f"{name}: only in {b}" for name in sorted(headers[1].keys() - headers[0].keys())]
    total, common = 0, sorted(headers[0].keys() & headers[1].keys())
    with safe_open(Path(a) / ADAPTER_WEIGHTS, framework="pt") as left, \
            safe_open(Path(b) / ADAPTER_WEIGHTS, framework="pt") as right:
        for name in common:
            x, y = left.get_tensor(name), right.get_tensor(name)
            differences += filter(None, [tensor_difference(name, x, y)])
            total += x.nbytes
    return len(common), total, differences

