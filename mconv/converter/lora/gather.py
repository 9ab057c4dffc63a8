"""Megatron-Bridge adapters -> PEFT modules: the LoRA table's targets planned as base weights are,
gathered across the ranks that hold them and split where HF has one module per projection
(`adapter_to_peft`)."""
from __future__ import annotations

import re

import torch

from mconv.converter.layout import Layout, Rank
from mconv.converter.lora.peft import EXPERT_MODULES, MTP_ADAPTER, PEFT_PREFIX, PeftAdapter, RankStates, adapter_rank
from mconv.converter.megatron_checkpoint import ADAPTER
from mconv.converter.options import dtype_name
from mconv.converter.planner import ExportTask, ShardSource, make_plan
from mconv.converter.transforms import GATED_QKV, merge
from mconv.errors import MconvError
from mconv.mappings import architecture_for
from mconv.mappings.lora import Target, lora_architecture, targets
from mconv.mappings.schema import Architecture


def _shared_name(target: Target, rule_name: str, layer: int, layout: Layout, source: ShardSource, dims) -> str | None:
    """A TE grouped-GEMM expert adapter: one tensor for all of the rank's experts in that layer (a
    decoder layer, numbered within its chunk, or MTP layer `layer - dims.layers`)."""
    if target.shared_module is None:
        return None
    local_layer = layer - layout.chunk_layers(dims.layers)[source.rank.pp][source.chunk].start
    which = rule_name.rsplit(".", 2)[-2]  # linear_in / linear_out
    return target.tensor(target.shared_module.format(layer=local_layer, mtp=layer - dims.layers), which)


def adapter_to_peft(states: RankStates, config: dict, layout: Layout,
                    where: str = "the adapter tensors") -> PeftAdapter:
    """Gather Megatron-Bridge LoRA adapters (any TP/PP/VPP/EP/ETP layout) into PEFT LoRA tensors.

    `states[rank][chunk]` maps Megatron names to tensors as a model chunk of that legacy rank holds
    them (a live model's `named_parameters()` adapter entries, or a rank file's state dict); base
    weights beside them are ignored. Every adapter must have the same rank r; adapters on modules
    the architecture does not have, or missing on some ranks, are refused.
    """
    arch = architecture_for(config)
    rank = adapter_rank(states, where)
    all_targets = targets(arch)  # found by rule, not by name: rules may share a name (KDA in_proj, by no_kda_lora)
    # Adapters on megatron-core's MTP block (Megatron-Bridge wraps its layer's linear layers by name, and
    # eh_proj when targeted): planned with the model's MTP layers, under the HF names the base weights have.
    mtp = getattr(arch.dims(config), "hf_mtp_layers", 0) > 0 and any(
        MTP_ADAPTER.search(name) for chunks in states.values() for chunk in chunks for name in chunk)
    expected: set[tuple[Rank, int, str]] = set()
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}  # PEFT key -> the Megatron tensor it was gathered from
    merge_only: set[str] = set()
    for canonical in (False, True):
        plan = make_plan(lora_architecture(arch, rank, canonical), config, layout, "local", mtp=mtp)
        rule_of = {task.hf: task.rule for rp in plan.ranks for chunk in rp.chunks for task in chunk}
        expected |= {(rp.rank, v, task.megatron) for rp in plan.ranks for v, chunk in enumerate(rp.chunks)
                     for task in chunk}
        for export in plan.exports():
            rule = rule_of[export.hf]
            target = next(t for t in all_targets if rule in (t.a, t.b))
            merged = _gather(states, export, rule, target, plan, layout, where, expected)
            if merged is None:
                continue
            _, layer, expert, _ = export.order
            names = list(export.hf)
            if rule.megatron == target.a.megatron:  # a fused adapter's A is every split module's A
                index = dict(layer=layer, expert=expert, mtp=layer - plan.dims.layers)  # MTP layer j is layer L + j
                names += [f"{m.format(**index)}.lora_A.weight" for m in target.hf_modules[1:]]
                merged += [merged[0].clone() for _ in target.hf_modules[1:]]
            if target.a.megatron.partition(ADAPTER)[0].endswith(".eh_proj"):
                merge_only.update(name.rsplit(".", 2)[0] for name in names)
            for name, tensor in zip(names, merged):
                if PEFT_PREFIX + name in tensors:
                    raise MconvError(f"{where}: {name.rsplit('.', 2)[0]} has both a LoRA and a CanonicalLoRA adapter")
                tensors[PEFT_PREFIX + name] = tensor
                origin[PEFT_PREFIX + name] = export.sources[0].megatron
    _refuse_unknown(states, arch, expected, layout, where)
    _refuse_unpaired(tensors, origin, where)
    modules = {key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for key in tensors}
    modules = _target_modules(arch, {m for m in modules if not (arch.stacked_experts and ".mlp.experts." in m)})
    if arch.stacked_experts:
        tensors = _stack_experts(tensors, arch.dims(config).experts, rank, where)
    return PeftAdapter(arch.name, rank, tensors, modules, sorted(merge_only))


def _target_modules(arch: Architecture, adapted: set[str]) -> list[str]:
    """peft's target_modules for these HF modules: each one's last name component, or more of its name
    where the last one also ends a module of the model without an adapter (a vision tower's attn.proj
    beside its patch_embed.proj, a Conv3d) and a longer suffix (without an index) tells them apart."""
    templates = {name.rsplit(".", 1)[0] for rule in arch.rules for name in rule.hf}
    patterns = {t: re.compile(re.sub(r"\\\{\w+\\\}", r"\\d+", re.escape(t))) for t in templates}
    others = {t for t in templates if not any(patterns[t].fullmatch(m) for m in adapted)}
    found = set()
    for module in adapted:
        parts, n = module.split("."), 1
        while (any(o == ".".join(parts[-n:]) or o.endswith("." + ".".join(parts[-n:])) for o in others)
               and n < len(parts) and not parts[-n - 1].isdigit()):
            n += 1
        found.add(".".join(parts[-n:]))
    return sorted(found)


def _stack_experts(tensors: dict[str, torch.Tensor], experts: int, rank: int, where: str) -> dict[str, torch.Tensor]:
    """Per-expert adapters (`<p>.mlp.experts.{e}.gate_proj` ...) in the 3-D form of stacked HF experts
    (see EXPERT_PARAMETERS). A layer with adapters on only one of fc1 / fc2 gets a zero adapter
    (no change to the weights) on the other: vLLM's loader needs both."""
    stacked, layers = {}, {}
    for key, tensor in tensors.items():
        prefix, sep, rest = key.partition(".mlp.experts.")
        if not sep:
            stacked[key] = tensor
            continue
        expert, module, which, _ = rest.split(".")
        layers.setdefault(prefix + ".mlp.experts", {})[(int(expert), module, which)] = tensor
    for prefix, found in layers.items():
        present = {e for e, _, _ in found}
        if present != set(range(experts)):
            raise MconvError(f"{where}: {prefix} has LoRA adapters on experts {sorted(present)} only; the stacked "
                             f"HF experts take one adapter form for all {experts} experts")
        pairs = {}  # infix -> (A [E*r, in], B [out, r*E])
        for infix, parts in EXPERT_MODULES.items():
            if (0, parts[0], "lora_A") not in found:
                continue
            a_list, b_list = [], []
            for e in range(experts):
                a = [found[(e, m, "lora_A")] for m in parts]
                if any(not torch.equal(a[0], other) for other in a[1:]):
                    raise MconvError(f"{where}: {prefix}.{e} has separate gate and up adapters (CanonicalLoRA), which "
                                     "the stacked HF experts' single gate_up_proj adapter cannot express")
                a_list.append(a[0])
                b_list.append(torch.cat([found[(e, m, "lora_B")] for m in parts]))
            b = torch.stack(b_list, dim=-1)  # [out, r, E]
            pairs[infix] = torch.cat(a_list), b.reshape(b.shape[0], rank * experts)
        if len(pairs) == 1:  # vLLM's loader needs both: a zero adapter (no change) on the other projection
            (infix, (a, b)), = pairs.items()
            hidden, fc1_out = (a.shape[1], b.shape[0]) if infix else (b.shape[0], 2 * a.shape[1])
            other = "" if infix else "base_layer."
            pairs[other] = ((a.new_zeros(a.shape[0], fc1_out // 2), b.new_zeros(hidden, b.shape[1])) if infix else
                            (a.new_zeros(a.shape[0], hidden), b.new_zeros(fc1_out, b.shape[1])))
        for infix, (a, b) in pairs.items():
            stacked[f"{prefix}.{infix}lora_A.weight"], stacked[f"{prefix}.{infix}lora_B.weight"] = a, b
    return stacked


def _gather(states: RankStates, export: ExportTask, rule, target: Target, plan, layout: Layout, where: str,
            expected: set) -> list[torch.Tensor] | None:
    """The HF tensors of one adapter tensor, from its shard on each group rank (None if it has no adapter)."""
    layer = export.order[1]
    shards, names = [], []
    for source in export.sources:
        chunks = states.get(source.rank, ())
        chunk = chunks[source.chunk] if source.chunk < len(chunks) else {}
        name = source.megatron
        if name not in chunk:
            name = _shared_name(target, rule.megatron, layer, layout, source, plan.dims) or name
        expected.add((source.rank, source.chunk, name))
        names.append(name)
        shards.append(chunk.get(name))
    present = [s is not None for s in shards]
    if not any(present):
        return None
    if not all(present):
        missing = export.sources[present.index(False)]
        raise MconvError(f"{where}: {names[present.index(False)]} is missing from {layout.rank_dir(missing.rank)} "
                         f"(model chunk {missing.chunk}), but other ranks hold shards of it")
    for source, name, shard in zip(export.sources, names, shards):
        if not shard.is_floating_point():
            raise MconvError(f"{where}: {name} in {layout.rank_dir(source.rank)} is "
                             f"{dtype_name(shard.dtype)}, not a floating-point tensor as LoRA's A and "
                             "B are")
        want = source.shard.shape(export.hf_shapes)
        if tuple(shard.shape) != want:
            raise MconvError(f"{where}: {name} in {layout.rank_dir(source.rank)} has shape {list(shard.shape)}, "
                             f"expected {list(want)} for a rank-{plan.dims.lora_rank} adapter at {layout.describe()}")
    return merge([s.shard for s in export.sources], shards, export.hf_shapes)


def _refuse_unpaired(tensors: dict[str, torch.Tensor], origin: dict[str, str], where: str) -> None:
    """Every adapter's A beside its B and B beside its A: peft loads an adapter lacking one (a missing
    A initialised at random), so the model it serves would be silently wrong."""
    for key in sorted(tensors):
        for have, lacks, what in ((".lora_A.weight", ".lora_B.weight", "linear_out (its LoRA B)"),
                                  (".lora_B.weight", ".lora_A.weight", "linear_in (its LoRA A)")):
            if key.endswith(have) and key.removesuffix(have) + lacks not in tensors:
                raise MconvError(f"{where}: {origin[key]} has no {what} beside it; a LoRA adapter needs both "
                                 "its linear_in and linear_out tensors")


def _refuse_unknown(states: RankStates, arch: Architecture, expected: set, layout: Layout, where: str) -> None:
    for rank, chunks in states.items():
        for v, chunk in enumerate(chunks):
            for name in chunk:
                if ADAPTER in name and (rank, v, name) not in expected:
                    raise not_exportable(f"{where}: {name} in {layout.rank_dir(rank)} (model chunk {v})", arch, name)


def not_exportable(what: str, arch: Architecture, name: str) -> MconvError:
    if ".linear_qkv.adapter.adapter_" in name and any(rule.kind is GATED_QKV for rule in arch.rules):
        # Megatron-Bridge 0.6.2 (and main) sizes CanonicalLoRA's adapter_q kv_channels * num_attention_heads and
        # interleaves [q; k; v] per group (peft/canonical_lora.py:385, 90-143), so it adds a tensor narrower
        # than a gated linear_qkv's output (per group [q; gate; k; v]) to it (line 156): no run saves one.
        return MconvError(f"{what} is a CanonicalLoRA adapter on a gated linear_qkv (attention_output_gate), which "
                          "Megatron-Bridge's CanonicalLoRA does not support (its adapter_q has no gate rows, so its "
                          "output does not fit linear_qkv's); use LoRA on linear_qkv")
    modules = sorted({t.a.megatron.partition(".adapter")[0].rsplit(".", 1)[-1] for t in targets(arch)})
    return MconvError(f"{what} is not a LoRA A or B tensor mconv can export: {arch.name} (as the HF config and layout "
                      f"describe it) has LoRA or CanonicalLoRA adapters on {', '.join(modules)} only; other modules, "
                      "layers the model lacks and other adapter kinds (DoRA) have no form a vLLM PEFT adapter can "
                      "express")
