"""LoRA export: Megatron-Bridge LoRA adapters -> HF PEFT adapters (or HF weights with the delta merged).

The adapters of a Megatron model are gathered with the same plan as its base weights: the LoRA
table (`mconv.mappings.lora`) turns each target into planner rules whose HF tensors are PEFT's
`lora_A` / `lora_B`, so the planner says which rank file and model chunk holds which rows of each,
and `transforms.merge` rebuilds them. A fused adapter becomes one PEFT module per HF projection
with the same A (qkv -> q/k/v, fc1 -> gate/up). `adapter_to_peft` does this for tensors in memory
(a live model's per-rank adapter state); `export_lora` reads them from a checkpoint (legacy rank
files memory-mapped, or torch_dist boxes) and writes a PEFT directory vLLM and peft load.

By job: `peft` (the adapter written and its keys), `gather` (adapter_to_peft), `read` (a
checkpoint's adapters and alpha), `merge` (--merge), and here `export_lora`, which runs them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mconv.converter import megatron_io as mio
from mconv.converter.hf_config import read_config
from mconv.converter.hub import check_revision, is_local, resolve_model
from mconv.converter.layout import Layout
from mconv.converter.lora.gather import adapter_to_peft
from mconv.converter.lora.merge import merge_adapter
from mconv.converter.lora.peft import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPERT_MODULES, EXPERT_PARAMETERS,
                                       MTP_ADAPTER, PEFT_PREFIX, PeftAdapter, RankStates, adapter_rank)
from mconv.converter.lora.read import read_adapter, run_config_alpha
from mconv.converter.options import DEFAULT_SHARD_BYTES, check_path, option, shard_bytes, torch_dtype
from mconv.converter.output import check_output_path, staged_directory
from mconv.errors import MconvError
from mconv.mappings import architecture_for

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "EXPERT_MODULES", "EXPERT_PARAMETERS", "MTP_ADAPTER", "PEFT_PREFIX",
           "LoraExport", "PeftAdapter", "RankStates", "adapter_rank", "adapter_to_peft", "export_lora", "merge_adapter",
           "read_adapter"]


@dataclass(repr=False)
class LoraExport:
    """What export_lora wrote."""

    adapter: PeftAdapter
    alpha: float
    layout: Layout
    format: str
    merged_tensors: int = 0
    notes: list[str] = field(default_factory=list)  # what the user must know (tensors a cast kept in float32)

    def __repr__(self) -> str:
        merged = f", {self.merged_tensors} weights merged" if self.merged_tensors else ""
        return f"LoraExport({self.adapter!r}, alpha={self.alpha:g}, from {self.format} at {self.layout.describe()}{merged})"


def _check_recorded_base(base: Path, adapter: PeftAdapter, config_dir: Path) -> None:
    """The local base model a PEFT adapter will name (`base_model` without a merge) is the model the
    adapters were trained on, as far as its config.json tells: its architecture and its sizes as
    the table reads them (the checkpoint's HF config's, in `config_dir`); not a Megatron checkpoint
    or a PEFT adapter. MconvError naming the first difference. A path with no config.json here (the
    model may be on the serving machine) is recorded as it is, as is a hub name."""
    from mconv.converter.adapter_dir import is_adapter  # (it imports this module)
    from mconv.converter.pipelines import refuse_megatron

    what = f"{option('base_model')} names the HF model the adapter was trained on"
    refuse_megatron(base, what)
    if is_adapter(base):
        raise MconvError(f"{base} is a PEFT adapter; {what}")
    if not (base / "config.json").is_file():
        return
    theirs, ours = read_config(base), read_config(config_dir)
    arch = architecture_for(theirs, base / "config.json")
    if arch.name != adapter.arch:
        raise MconvError(f"{base} is a {arch.name}, the adapter is for {adapter.arch}: give "
                         f"{option('base_model')} the model it was trained on")
    sizes = [vars(arch.dims(config)) for config in (theirs, ours)]
    for key in ("layers", "hidden", "heads", "groups", "head_dim", "ffn", "vocab", "experts", "moe_ffn"):
        if sizes[0].get(key) != sizes[1].get(key):
            raise MconvError(f"{base} has {key} {sizes[0].get(key)}, the model the adapter was trained on "
                             f"{sizes[1].get(key)}: give {option('base_model')} the model it was trained on")


def export_lora(ckpt_dir: str | Path, out_dir: str | Path, hf_config: str | Path | None = None,
                rank: int | None = None, alpha: float | None = None, base_model: str | None = None,
                merge_into: bool = False, dtype: torch.dtype | None = None, overwrite: bool = False,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, revision: str | None = None,
                progress: bool = True, quantize: str | None = None, fp8_scale: str | None = None) -> LoraExport:
    """Write the checkpoint's LoRA adapter as a HF PEFT adapter directory, or with `merge_into` a HF
    model: the base model `base_model` (a directory or hub name, at `revision`) with alpha/r * B @ A
    added. `hf_config` may be a hub name too; without `merge_into`, `base_model` is only recorded.
    `dtype` may be named as --dtype names it ("bfloat16"); `max_shard_bytes` may be a size string ("1GB").
    `quantize="fp8"` / `fp8_scale` (with `merge_into` only): merge first, then quantize the merged
    weights as `mcore2hf --quantize fp8` does; an FP8 base model is read dequantized (`dtype`, default
    bfloat16)."""
    dtype, max_shard_bytes = torch_dtype(dtype), shard_bytes(max_shard_bytes)
    if quantize is not None and not merge_into:
        raise MconvError(f"{option('quantize', quantize)} applies with {option('merge_into', True)} (an adapter "
                         "is not quantized)")
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):  # as run_config.yaml's is checked
        raise MconvError(f"{option('alpha')} must be a positive number (scale = alpha / r), got {alpha:g}")
    check_path(ckpt_dir, "ckpt_dir")
    location = mio.locate(ckpt_dir)
    if merge_into and not base_model:
        raise MconvError(f"{option('merge_into', True)} needs {option('base_model')}, the HF model (directory or hub "
                         "name) the adapter was trained on")
    check_revision(revision, hf_config, base_model if merge_into else None)
    if hf_config:  # the revision is for whichever of the two is a hub name
        hf_config = resolve_model(hf_config, None if is_local(hf_config) else revision, weights=False,
                                  progress=progress, parameter="hf_config")
    if merge_into:
        base_model = resolve_model(base_model, None if is_local(base_model) else revision, progress=progress,
                                   parameter="base_model")
    check_output_path(out_dir, overwrite, (location.save_dir,))
    adapter, layout, config_dir = read_adapter(location, hf_config)
    if not merge_into and base_model and is_local(base_model):
        _check_recorded_base(Path(base_model), adapter, config_dir)
    if rank is not None and rank != adapter.rank:
        raise MconvError(f"{location.iter_dir}: the adapters have rank {adapter.rank}, not {option('rank', rank)}")
    alpha = alpha if alpha is not None else run_config_alpha(location)
    if alpha is None:
        raise MconvError(f"{location.iter_dir}: LoRA's alpha is not stored with the weights (no run_config.yaml "
                         f"with peft.alpha); pass {option('alpha')} (scale = alpha / r)")
    result = LoraExport(adapter, alpha, layout, location.format)
    inputs = (location.save_dir, config_dir) + ((Path(base_model),) if merge_into else ())
    with staged_directory(Path(out_dir), overwrite, inputs=inputs) as staging:
        if merge_into:
            result.merged_tensors, notes = merge_adapter(adapter, alpha, base_model, staging, dtype, max_shard_bytes,
                                                         quantize, fp8_scale)
            result.notes += notes
        else:
            adapter.save(staging, alpha, base_model)
    return result
