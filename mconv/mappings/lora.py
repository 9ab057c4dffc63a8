"""LoRA adapters, derived from an architecture's table.

Megatron-Bridge wraps a linear layer `<module>` with an adapter: `<module>.adapter.linear_in.weight`
(LoRA A, `[r, in]`) and `<module>.adapter.linear_out.weight` (LoRA B, `[out, r]`); CanonicalLoRA
gives each HF projection of a fused layer its own adapter (`<module>.adapter.adapter_q.linear_in.weight`).
Under TP, B is column-parallel in the base layer's own row layout (fused QKV groups, per-rank
`[gate_r; up_r]`), so it takes the base rule's kind; A is split on dim 0 for a column-parallel base
and on dim 1 for a row-parallel one. Expert adapters follow their expert rule's group (ETP) and EP.

Each target becomes planner rules whose HF tensors are the PEFT `lora_A` / `lora_B` weights, so the
planner places and gathers adapters exactly as it does base weights.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

from mconv.converter.transforms import COLUMN, GATED_QKV, GLU, QKV, ROW, SECTIONED, Kind
from mconv.mappings.schema import MTP_LAYER, Architecture, Rule

RANK = "lora_rank"  # the model dimension the adapter shapes use
# A sectioned projection (KDA and gated delta-net in_proj) is column-parallel: its B rows follow the
# per-rank sections; a gated linear_qkv's B rows are the base's [q heads; gate heads; k; v] per group.
A_KIND: dict[Kind, Kind] = {QKV: COLUMN, GATED_QKV: COLUMN, GLU: COLUMN, SECTIONED: COLUMN, COLUMN: COLUMN, ROW: ROW}
B_KIND: dict[Kind, Kind] = {QKV: QKV, GATED_QKV: GATED_QKV, GLU: GLU, SECTIONED: SECTIONED, COLUMN: COLUMN,
                            ROW: COLUMN}
CANONICAL: dict[Kind, tuple[str, ...]] = {QKV: ("adapter_q", "adapter_k", "adapter_v"),
                                          GLU: ("adapter_gate", "adapter_up")}
GROUPED_WEIGHT = ".weight{expert}"  # TE grouped-GEMM expert weights: one adapter shared by the rank's experts
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron-Bridge LoRA's target_modules


@dataclass(frozen=True)
class Target:
    """One Megatron adapter and the HF modules it becomes (all of them share its A)."""

    adapter: str  # "adapter", or "adapter.adapter_q" for CanonicalLoRA
    hf_modules: tuple[str, ...]  # HF module templates, e.g. q_proj, k_proj, v_proj
    a: Rule  # linear_in: its HF tensor is the first module's lora_A
    b: Rule  # linear_out: one lora_B per HF module
    shared_module: str | None = None  # TE grouped experts: the module whose one adapter serves every local expert

    @property
    def canonical(self) -> bool:
        return self.adapter != "adapter"

    def tensor(self, module: str, which: str) -> str:
        return f"{module}.{self.adapter}.{which}.weight"


def _target(base: Rule, adapter: str, hf: dict[str, str], a_kind: Kind, b_kind: Kind) -> Target:
    module = base.megatron.removesuffix(".weight")
    modules = tuple(name.removesuffix(".weight") for name in hf)
    fan_in = next(iter(hf.values())).split()[1]
    common = dict(when=base.when, group=base.group, stage=base.stage, repeat=base.repeat, qkv_dims=base.qkv_dims)
    a = Rule(f"{module}.{adapter}.linear_in.weight", {f"{modules[0]}.lora_A.weight": f"{RANK} {fan_in}"}, a_kind,
             **common)
    b = Rule(f"{module}.{adapter}.linear_out.weight",
             {f"{m}.lora_B.weight": f"{shape.split()[0]} {RANK}" for m, shape in zip(modules, hf.values())},
             b_kind, **common)
    # in a decoder layer or an MTP layer (Megatron-Bridge wraps both by name)
    grouped = (base.per_layer or MTP_LAYER in base.megatron) and base.te and base.te.endswith(GROUPED_WEIGHT)
    shared = base.te.removesuffix(GROUPED_WEIGHT) if grouped else None
    return Target(adapter, modules, a, b, shared)


def targets(arch: Architecture) -> tuple[Target, ...]:
    """Every adapter Megatron-Bridge's LoRA and CanonicalLoRA can put on the architecture's linear layers:
    those of the decoder layers and of other numbered blocks (a vision tower's blocks, deepstack
    mergers, MTP layers), and elsewhere those named like its default targets (a vision tower's patch
    merger): Megatron-Bridge matches target modules by name, in the whole model."""
    found = []
    for rule in arch.rules:
        linear = len(next(iter(rule.hf.values()), "").split()) == 2  # not a convolution (KDA conv1d)
        wrapped = rule.per_layer or rule.repeat is not None or rule.megatron.rsplit(".", 2)[-2] in DEFAULT_TARGETS
        if rule.kind not in A_KIND or not wrapped or not rule.megatron.endswith(".weight") or not linear:
            continue
        found.append(_target(rule, "adapter", rule.hf, A_KIND[rule.kind], B_KIND[rule.kind]))
        canonical = CANONICAL.get(rule.kind, ())
        if len(canonical) == len(rule.hf):  # a fused layer with one HF tensor (vision attn.qkv) has no per-part HF module
            for name, (hf, shape) in zip(canonical, rule.hf.items()):
                found.append(_target(rule, f"adapter.{name}", {hf: shape}, COLUMN, COLUMN))
    return tuple(found)


def lora_architecture(arch: Architecture, rank: int, canonical: bool) -> Architecture:
    """The planner's view of the adapters: a table whose rules are the A and B tensors of every LoRA
    target, or of every CanonicalLoRA one (planned apart: both give q_proj its lora_A)."""
    rules = tuple(rule for t in targets(arch) if t.canonical == canonical for rule in (t.a, t.b))
    return Architecture(arch.name, functools.partial(_dims, arch, rank), rules)


def _dims(arch: Architecture, rank: int, config: dict) -> SimpleNamespace:
    return SimpleNamespace(**vars(arch.dims(config)), **{RANK: rank})

