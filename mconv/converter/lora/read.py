"""Reading a checkpoint's adapters: legacy rank files (memory-mapped) or torch_dist boxes, and
Megatron-Bridge's run_config.yaml for alpha."""
from __future__ import annotations

from pathlib import Path

import torch

from mconv.converter import megatron_io as mio
from mconv.converter.hf_config import read_config
from mconv.converter.layout import Layout, Rank
from mconv.converter.lora.gather import adapter_to_peft, not_exportable
from mconv.converter.lora.peft import PeftAdapter, RankStates, one_rank
from mconv.converter.megatron_checkpoint import ADAPTER, _config_dir, check_args, embedding_key, legacy_padded_vocab
from mconv.converter.options import option
from mconv.converter.planner import make_plan
from mconv.converter.transforms import padded_vocab_size
from mconv.errors import MconvError
from mconv.mappings import architecture_for
from mconv.mappings.lora import lora_architecture


def _legacy_states(location: mio.CheckpointLocation, config: dict) -> tuple[RankStates, Layout]:
    """Every rank file of a legacy checkpoint, memory-mapped (only the adapter bytes are read)."""
    args, layout, states, first = mio.read_legacy_ranks(location)
    arch = architecture_for(config)
    check_args(args, arch, arch.dims(config), first, legacy_padded_vocab(arch, states[Rank(0, 0)], layout))
    return states, layout


def _dist_states(location: mio.CheckpointLocation, config: dict) -> tuple[RankStates, Layout]:
    """A torch_dist checkpoint's adapters as one TP1/PP1/EP1 model chunk.

    Adapter keys are the base layer's key with `weight` replaced by the adapter's suffix, stacked
    over layers (and experts) like it; the base model's torch_dist boxes (torch_dist.plan_boxes) say
    where each base weight lives, so each adapter tensor is read as that layer's (and expert's) box of
    its global tensor.
    """
    from mconv.converter.torch_dist import plan_boxes
    from mconv.converter.torch_dist_io import TorchDistReader

    reader = TorchDistReader.open(location.iter_dir)
    stored = {key: md for key, md in reader.tensors.items() if ADAPTER in key}
    where = str(location.iter_dir)
    arch = architecture_for(config)
    dims = arch.dims(config)
    layout = Layout()
    args = mio.megatron_lm_args(layout, dims, arch.megatron_args(dims), "local", padded_vocab_size(dims.vocab, 128, 1),
                                torch.bfloat16, "torch_dist")
    if reader.args is not None:
        embedding = reader.global_shape(embedding_key(arch))
        check_args(reader.args, arch, dims, location.iter_dir, embedding[0] if embedding else None)
    rank = one_rank({key: md.shape for key, md in stored.items() if key.endswith(".linear_out.weight")}, where)
    names = {t.megatron for canonical in (False, True)
             for t in make_plan(lora_architecture(arch, rank, canonical), config, layout, "local").ranks[0].chunks[0]}
    suffixes = {name.split(ADAPTER)[1] for name in names}
    chunk, requests, found = {}, [], set()
    for box in plan_boxes(make_plan(arch, config, layout, "local"), args):
        if box.global_shape is None or not box.key.endswith(".weight"):
            continue
        module = box.task.megatron.removesuffix("weight")
        prefix = box.key.removesuffix("weight")
        offsets = box.offsets[:box.axes]
        for suffix in suffixes:
            name, key = f"{module}adapter.{suffix}", f"{prefix}adapter.{suffix}"
            if name not in names or key not in stored or name in chunk:
                continue
            shape = stored[key].shape[len(offsets):]
            chunk[name] = torch.empty(shape, dtype=stored[key].dtype)
            requests.append((key, offsets + (0,) * len(shape), chunk[name].view((1,) * len(offsets) + shape)))
            found.add(key)
    for key in sorted(stored.keys() - found):
        raise not_exportable(f"{where}: {key}", arch, key)
    reader.read(requests)
    return {Rank(0, 0): [chunk]}, layout


def run_config_alpha(location: mio.CheckpointLocation) -> float | None:
    """LoRA alpha from Megatron-Bridge's run_config.yaml (`peft.alpha`), beside the weights or one level up."""
    import yaml

    for path in (location.iter_dir / "run_config.yaml", location.save_dir / "run_config.yaml"):
        if path.is_file():
            try:
                peft = (yaml.safe_load(path.read_bytes().decode("utf-8")) or {}).get("peft") or {}
            except (yaml.YAMLError, AttributeError, UnicodeDecodeError) as e:
                raise MconvError(f"{path} is not readable YAML ({str(e).splitlines()[0]}); pass {option('alpha')}") from None
            alpha = peft.get("alpha") if isinstance(peft, dict) else None
            if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < float("inf"):
                return float(alpha)
            if alpha is not None or not isinstance(peft, dict):
                raise MconvError(f"{path}: peft.alpha is {alpha!r}, not a positive number; pass {option('alpha')}")
    return None


def read_adapter(location: mio.CheckpointLocation,
                 hf_config: str | Path | None = None) -> tuple[PeftAdapter, Layout, Path]:
    """A checkpoint's adapters (legacy or torch_dist), its layout, and the HF config directory used."""
    config_dir = _config_dir(location, hf_config)
    config = read_config(config_dir)
    states, layout = (_dist_states if location.format == "torch_dist" else _legacy_states)(location, config)
    return adapter_to_peft(states, config, layout, str(location.iter_dir)), layout, config_dir
