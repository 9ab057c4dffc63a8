"""The HF PEFT LoRA adapter mconv writes (`PeftAdapter`: its tensors, adapter_config.json, the
saved keys peft and vLLM load) and the one rank r of a checkpoint's adapters."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from mconv.converter.layout import Rank
from mconv.converter.megatron_checkpoint import ADAPTER
from mconv.converter.options import option
from mconv.errors import MconvError


PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the HF module names in saved keys
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"

# Per legacy rank file (as `Layout.ranks()` names them), per model chunk: adapter tensors by their
# Megatron name in that chunk (local layer and expert indices). Other tensors (base weights) may be there.
RankStates = Mapping[Rank, Sequence[Mapping[str, torch.Tensor]]]


# Stacked HF experts (transformers' Qwen3-VL-MoE `mlp.experts.gate_up_proj` / `down_proj`, no `.weight`)
# take LoRA as peft's `target_parameters` do (peft 0.21 ParamWrapper, which vLLM's 3-D MoE LoRA loader
# reads, vllm/lora/model_manager.py `_stack_moe_lora_weights`): one adapter per layer and parameter,
# the parameter named first wrapped innermost. Its keys: `<p>.mlp.experts.base_layer.lora_A/B.weight`
# for gate_up_proj, `<p>.mlp.experts.lora_A/B.weight` for down_proj; A `[E*r, in]` (expert e's A in rows
# e*r..e*r+r-1), B `[out, r*E]` (expert e's column j at j*E + e: peft reshapes B to [out, r, E]).
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MTP_ADAPTER = re.compile(r"(^|\.)mtp\.layers\.\d+\..*\.adapter\.")  # an adapter in megatron-core's MTP block
EXPERT_MODULES = {"base_layer.": ("gate_proj", "up_proj"), "": ("down_proj",)}  # 3-D key infix -> per-expert modules


def expert_key(key: str) -> bool:
    """A key of the 3-D (stacked experts) adapter form."""
    return key.endswith((".mlp.experts.lora_A.weight", ".mlp.experts.lora_B.weight",
                         ".mlp.experts.base_layer.lora_A.weight", ".mlp.experts.base_layer.lora_B.weight"))


@dataclass(repr=False)
class PeftAdapter:
    """A HF PEFT LoRA adapter: tensors under their saved keys, one rank for every module.

    `tensors` hold `base_model.model.<HF module>.lora_A.weight` `[r, in]` / `lora_B.weight` `[out, r]`,
    and for stacked experts the 3-D form above. `modules`: peft's target_modules (name suffixes)."""

    arch: str
    rank: int
    tensors: dict[str, torch.Tensor]
    modules: list[str] | None = None
    # HF modules whose adapters only --merge can apply (an MTP eh_proj's `mtp.fc`: see save)
    merge_only: list[str] = field(default_factory=list)

    def __repr__(self) -> str:  # not the tensors
        return (f"PeftAdapter({self.arch}, r={self.rank}, {len(self.tensors)} tensors, "
                f"target_modules {', '.join(self.target_modules)})")

    @property
    def target_modules(self) -> list[str]:
        if self.modules is not None:
            return self.modules
        return sorted({key.split(".")[-3] for key in self.tensors if not expert_key(key)})

    @property
    def target_parameters(self) -> list[str]:
        return list(EXPERT_PARAMETERS) if any(expert_key(key) for key in self.tensors) else []

    def deltas(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF base weight name -> (A, B) of its LoRA module; stacked experts per expert and module
        (`<p>.mlp.experts.{e}.gate_proj.weight`, as HFCheckpoint presents them)."""
        modules = {key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for key in self.tensors if not expert_key(key)}
        deltas = {f"{m}.weight": (self.tensors[f"{PEFT_PREFIX}{m}.lora_A.weight"],
                                  self.tensors[f"{PEFT_PREFIX}{m}.lora_B.weight"]) for m in sorted(modules)}
        for key in sorted(k for k in self.tensors if expert_key(k) and k.endswith(".lora_A.weight")):
            infix = "base_layer." if key.endswith(".base_layer.lora_A.weight") else ""
            prefix = key.removeprefix(PEFT_PREFIX).removesuffix(f".{infix}lora_A.weight")
            a, b = self.tensors[key], self.tensors[key.replace(".lora_A.", ".lora_B.")]
            experts = a.shape[0] // self.rank
            a_of = a.reshape(experts, self.rank, a.shape[1])
            b_of = b.reshape(b.shape[0], self.rank, experts).permute(2, 0, 1)  # [E, out, r]
            parts = EXPERT_MODULES[infix]
            for e in range(experts):
                for module, rows in zip(parts, b_of[e].chunk(len(parts))):  # gate_up: [gate; up] rows
                    deltas[f"{prefix}.{e}.{module}.weight"] = (a_of[e], rows)
        return deltas

    def config(self, alpha: float, base_model: str | None) -> dict:
        """adapter_config.json as vLLM accepts it: one r and alpha, no modules_to_save, no DoRA, no bias."""
        alpha = int(alpha) if float(alpha).is_integer() else alpha
        parameters = {"target_parameters": self.target_parameters} if self.target_parameters else {}
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": self.rank, "lora_alpha": alpha, "target_modules": self.target_modules, **parameters,
                "bias": "none",
                "lora_dropout": 0.0, "fan_in_fan_out": False, "use_dora": False, "use_rslora": False,
                "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True}

    def save(self, directory: Path, alpha: float, base_model: str | None) -> None:
        """Write adapter_config.json and adapter_model.safetensors into `directory`. Raises MconvError for
        an adapter on an MTP layer's eh_proj: vLLM (0.32, vllm/lora/lora_model.py check_unexpected_modules)
        refuses a whole adapter with a module (`mtp.fc`) whose last name is none of the served model's LoRA
        modules, and transformers has no MTP module for peft to adapt."""
        from safetensors.torch import save

        if self.merge_only:
            raise MconvError(f"{self.merge_only[0]} (an MTP layer's eh_proj) has a LoRA adapter, which a PEFT adapter "
                             "cannot carry: vLLM refuses a whole adapter naming a module fc, none of the served model's "
                             f"LoRA modules, and transformers has no MTP module; {option('merge_into', True)} merges it")
        # written by us, not save_file, which makes its file 0600 whatever the umask
        data = save({k: t.contiguous() for k, t in self.tensors.items()}, metadata={"format": "pt"})
        (Path(directory) / ADAPTER_WEIGHTS).write_bytes(data)
        (Path(directory) / ADAPTER_CONFIG).write_text(json.dumps(self.config(alpha, base_model), indent=2) + "\n")


def adapter_rank(states: RankStates, where: str) -> int:
    """The one LoRA rank of all adapters: the width of every B (`linear_out`, `[out, r]` on every rank)."""
    return one_rank({name: tuple(t.shape) for chunks in states.values() for chunk in chunks
                      for name, t in chunk.items() if ADAPTER in name and name.endswith(".linear_out.weight")}, where)


def one_rank(shapes: dict[str, tuple[int, ...]], where: str) -> int:
    """The one rank r of the adapters whose B (`linear_out`) tensors have these shapes ([..., r])."""
    if not shapes:
        raise MconvError(f"{where} holds no LoRA adapter tensors (Megatron-Bridge names: "
                         "<module>.adapter.linear_in.weight / .adapter.linear_out.weight)")
    for name, shape in shapes.items():
        if not shape or shape[-1] < 1:  # peft refuses r = 0, and merging divides by it
            raise MconvError(f"{where}: {name} has shape {list(shape)}, not a LoRA B's [out, r] with r at least 1")
    (first, rank), *others = ((name, shape[-1]) for name, shape in shapes.items())
    for name, other in others:
        if other != rank:
            raise MconvError(f"{where}: the adapters have different ranks ({first} has {rank}, {name} has {other}); "
                             "a PEFT adapter that vLLM loads has one r for every module")
    return rank
