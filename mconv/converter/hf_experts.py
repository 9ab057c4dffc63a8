"""Stacked HF experts (Qwen3-VL-MoE, Qwen3.5-MoE): their per-expert names, their two orientations
(transformers 4.x and 5.x) and which one a writer uses, and a stacked tensor built from its experts.
`hf_io.expand_stacked_experts` presents stored ones per expert."""
from __future__ import annotations

import torch

from mconv.converter.options import option
from mconv.converter.planner import table_shape
from mconv.errors import MconvError

# transformers keeps the routed experts of some models (Qwen3-VL-MoE) stacked: one tensor per layer
# and projection, no `.weight` suffix, holding per expert these modules in order along the output
# dimension (gate first). transformers 5.x stores each expert as nn.Linear does, `[E, out, in]`;
# 4.57 transposed, `[E, in, out]` (reference qwen3-vl.md, section 1).
STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ORIENTATIONS = ("4.x", "5.x")  # "4.x": [E, in, out], which transformers 4.57 and 5.x both load unless square


def expert_orientation_for(arch, dims, value: str | None) -> str | None:
    """The orientation `arch`'s stacked HF experts are written in: `value`, else the architecture's
    default (`Architecture.expert_orientations`: "4.x", which transformers 4.57 and 5.x both load, but
    "5.x" for Qwen3.5-MoE, the only one transformers loads for it); None for architectures whose HF
    checkpoints keep experts per expert. `dims`: the model's (planner.model_dims). MconvError for an
    unknown `value`, a `value` given for such an architecture or one transformers does not load for it
    (an option that does not apply is refused, not ignored), and no `value` where a stacked tensor is
    square (hidden == 2 * moe_intermediate_size, or hidden == moe_intermediate_size) and the
    architecture has two orientations: transformers 5.x transposes a stacked tensor only where its
    shape differs from its own [E, 2I, h] / [E, h, I], so it reads a square 4.x tensor untransposed,
    silently wrong; 4.57 (and vLLM, which always transposes) read [E, h, 2I] / [E, I, h] as stored,
    so 4.57 refuses a 5.x file (its other tensor's shape mismatches). No orientation is read right by all of them."""
    if value is not None:
        if value not in ORIENTATIONS:
            raise MconvError(f"{option('expert_orientation')} must be one of {', '.join(ORIENTATIONS)}, got {value!r}")
        if not arch.stacked_experts:
            experts = any("{expert}" in rule.megatron for rule in arch.rules)
            raise MconvError(f"{option('expert_orientation')} applies to stacked HF experts (Qwen3-VL-MoE, Qwen3.5-MoE); " + (
                f"{arch.name} checkpoints keep their experts per expert" if experts else
                f"{arch.name} has no experts"))
        if value not in arch.expert_orientations:
            raise MconvError(f"{option('expert_orientation')} {value}: transformers loads {arch.name}'s stacked "
                             f"experts only in the {' or '.join(arch.expert_orientations)} orientation")
    if not arch.stacked_experts:
        return None
    square = None if value or len(arch.expert_orientations) == 1 else _square_stacked(arch, dims)
    if square:
        raise MconvError(f"the stacked experts {square} are square: transformers 5.x cannot tell their "
                         "orientation from the shape and reads the 4.x one (which transformers 4.57 and vLLM "
                         "read) wrongly, without an error, while 4.57 refuses the 5.x one; give "
                         f"{option('expert_orientation', '4.x')} for transformers 4.x or vLLM, or "
                         f"{option('expert_orientation', '5.x')} for transformers 5.x")
    return value or arch.expert_orientations[0]


def fp8_per_expert(arch, quantization, value: str | None) -> bool:
    """Whether a writer of `arch` writes its experts per expert (`<p>.mlp.experts.{e}.gate_proj.weight`
    and its `weight_scale_inv`, decoder and MTP layer alike) whatever form hf2mcore's input had: FP8
    (`quantization` not None) of the architectures whose experts transformers loads in either form
    (`Architecture.experts_as_input`: Qwen3.5/3.6-MoE, text and VL) when no orientation `value` is
    given. Qwen's FP8 releases of them hold the experts per expert (docs/fp8.md's tensor count of
    Qwen3.6-35B-A3B-FP8), and transformers 5.17 loads stacked FP8 experts of these models unscaled (it
    reports `experts.gate_up_proj_scale_inv` unexpected); an explicit `value` still stacks them (vLLM
    reads those). The one rule of mcore2hf, save_hf_weights and export-lora --merge; Qwen3-VL-MoE's
    stacked FP8 experts are left as they are (its checkpoints stack them)."""
    return quantization is not None and arch.experts_as_input and value is None


def _square_stacked(arch, dims) -> str | None:
    """The first of `arch`'s stacked expert tensors whose experts' matrices are square, named with its
    shape (`model.language_model.layers.*.mlp.experts.gate_up_proj [4, 64, 64]`); None if none is."""
    for rule in arch.rules:
        for template, shape in rule.hf.items():
            view = stacked_expert(template.replace("{expert}", "0"))
            if view is not None and view[2] == 0:
                out, fan_in = table_shape(shape, dims, template)
                if out * view[3] == fan_in:
                    return f"{view[0].replace('{layer}', '*')} {[dims.experts, fan_in, fan_in]}"
    return None


def stacked_expert(name: str) -> tuple[str, int, int, int] | None:
    """For a per-expert name of stacked experts, `<p>.mlp.experts.{e}.gate_proj.weight` (or up_proj,
    down_proj): (the stacked tensor `<p>.mlp.experts.gate_up_proj` / `down_proj`, e, the module's
    place in it along the output dimension, the number of modules in it); None for any other name."""
    prefix, _, rest = name.rpartition(".mlp.experts.")
    expert, _, module = rest.partition(".")
    module = module.removesuffix(".weight")
    for proj, parts in STACKED_EXPERTS.items():
        if prefix and expert.isdigit() and module in parts:
            return f"{prefix}.mlp.experts.{proj}", int(expert), parts.index(module), len(parts)
    return None


def stack_experts(modules: list[list[torch.Tensor]], transposed: bool) -> torch.Tensor:
    """One stacked expert tensor from its experts' modules (`modules[e]` = [gate, up] or [down], each
    `[out, in]`, nn.Linear's orientation, one dtype and device): `[E, sum(out), in]`, or
    `[E, in, sum(out)]` when `transposed` (4.x, see ORIENTATIONS); contiguous, on the modules' device,
    built by one concatenation (and one transposing copy for 4.x), not one copy per module."""
    flat = torch.cat([module for parts in modules for module in parts])
    stacked = flat.view(len(modules), -1, flat.shape[1])
    return stacked.transpose(1, 2).contiguous() if transposed else stacked
