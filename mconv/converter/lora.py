"""LoRA export: Megatron-Bridge LoRA adapters -> HF PEFT adapters (or HF weights with the delta merged).

The adapters of a Megatron model are gathered with the same plan as its base weights: the LoRA
table (`mconv.mappings.lora`) turns each target into planner rules whose HF tensors are PEFT's
`lora_A` / `lora_B`, so the planner says which rank file and model chunk holds which rows of each,
and `transforms.merge` rebuilds them. A fused adapter becomes one PEFT module per HF projection
with the same A (qkv -> q/k/v, fc1 -> gate/up). `adapter_to_peft` does this for tensors in memory
(a live model's per-rank adapter state); `export_lora` reads them from a checkpoint (legacy rank
files memory-mapped, or torch_dist boxes) and writes a PEFT directory vLLM and peft load.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from mconv.converter import megatron_io as mio
from mconv.converter import fp8
from mconv.converter.hf_config import read_config, side_files
from mconv.converter.hf_experts import fp8_per_expert, stacked_expert
from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.hf_write import ShardedSafetensorsWriter
from mconv.converter.hub import check_revision, is_local, resolve_model
from mconv.converter.layout import Layout, Rank
from mconv.converter.megatron_checkpoint import ADAPTER, _config_dir, check_args, embedding_key, legacy_padded_vocab
from mconv.converter.output import check_output_path, staged_directory
from mconv.converter.planner import ExportTask, ShardSource, make_plan
from mconv.converter.options import check_path, option, shard_bytes, torch_dtype
from mconv.converter.transforms import GATED_QKV, cast_dtype, checked_cast, fp32_note, merge, padded_vocab_size
from mconv.errors import MconvError
from mconv.mappings import architecture_for
from mconv.mappings.lora import Target, lora_architecture, targets
from mconv.mappings.schema import Architecture

PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the HF module names in saved keys
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
DEFAULT_SHARD_BYTES = 3_000_000_000

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
        return sorted({key.split(".")[-3] for key in self.tensors if not _expert_key(key)})

    @property
    def target_parameters(self) -> list[str]:
        return list(EXPERT_PARAMETERS) if any(_expert_key(key) for key in self.tensors) else []

    def deltas(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF base weight name -> (A, B) of its LoRA module; stacked experts per expert and module
        (`<p>.mlp.experts.{e}.gate_proj.weight`, as HFCheckpoint presents them)."""
        modules = {key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for key in self.tensors if not _expert_key(key)}
        deltas = {f"{m}.weight": (self.tensors[f"{PEFT_PREFIX}{m}.lora_A.weight"],
                                  self.tensors[f"{PEFT_PREFIX}{m}.lora_B.weight"]) for m in sorted(modules)}
        for key in sorted(k for k in self.tensors if _expert_key(k) and k.endswith(".lora_A.weight")):
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
    return _one_rank({name: tuple(t.shape) for chunks in states.values() for chunk in chunks
                      for name, t in chunk.items() if ADAPTER in name and name.endswith(".linear_out.weight")}, where)


def _one_rank(shapes: dict[str, tuple[int, ...]], where: str) -> int:
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


def _expert_key(key: str) -> bool:
    """A key of the 3-D (stacked experts) adapter form."""
    return key.endswith((".mlp.experts.lora_A.weight", ".mlp.experts.lora_B.weight",
                         ".mlp.experts.base_layer.lora_A.weight", ".mlp.experts.base_layer.lora_B.weight"))


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
                             f"{str(shard.dtype).removeprefix('torch.')}, not a floating-point tensor as LoRA's A and "
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
                    raise _not_exportable(f"{where}: {name} in {layout.rank_dir(rank)} (model chunk {v})", arch, name)


def _not_exportable(what: str, arch: Architecture, name: str) -> MconvError:
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


# ----------------------------------------------------------------------------- reading checkpoints

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
    rank = _one_rank({key: md.shape for key, md in stored.items() if key.endswith(".linear_out.weight")}, where)
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
        raise _not_exportable(f"{where}: {key}", arch, key)
    reader.read(requests)
    return {Rank(0, 0): [chunk]}, layout


def _run_config_alpha(location: mio.CheckpointLocation) -> float | None:
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


def read_adapter(location: mio.CheckpointLocation,
                 hf_config: str | Path | None = None) -> tuple[PeftAdapter, Layout, Path]:
    """A checkpoint's adapters (legacy or torch_dist), its layout, and the HF config directory used."""
    config_dir = _config_dir(location, hf_config)
    config = read_config(config_dir)
    states, layout = (_dist_states if location.format == "torch_dist" else _legacy_states)(location, config)
    return adapter_to_peft(states, config, layout, str(location.iter_dir)), layout, config_dir


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
    alpha = alpha if alpha is not None else _run_config_alpha(location)
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


def merge_adapter(adapter: PeftAdapter, alpha: float, base_dir: str | Path, out: Path,
                  dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  quantize: str | None = None, fp8_scale: str | None = None) -> tuple[int, list[str]]:
    """Write base + alpha/r * B @ A (in float32, then cast to `dtype`, default each tensor's own; see
    transforms.cast_dtype for those kept in float32) as HF safetensors into `out`, one tensor in
    memory at a time; with `quantize="fp8"` the weights the architecture's FP8 releases quantize are
    quantized from the float32 sum (fp8.quantize). An FP8 base is read dequantized into `dtype`
    (default bfloat16). Returns how many tensors changed and the notes for the user: the tensors the
    cast kept in float32 (transforms.fp32_note), an FP8 base read dequantized and written so (as
    hf2mcore says it: fp8.dequantized_note), unless `quantize` quantizes again.
    Raises MconvError where the cast turns finite values into inf (transforms.check_cast)."""
    with HFCheckpoint(base_dir, dequantize=dtype or torch.bfloat16) as base:
        side_files(base.dir)  # a bad tokenizer file stops the merge now, not after the weights
        arch = architecture_for(base.config, base.dir / "config.json")
        quantization = fp8.writer_quantization(arch, quantize, fp8_scale, base.config)
        if arch.name != adapter.arch:
            raise MconvError(f"{base.dir} is a {arch.name}, the adapter is for {adapter.arch}")
        deltas = adapter.deltas()
        for name, (a, b) in deltas.items():
            if name not in base.tensors or base.tensors[name].shape != (b.shape[0], a.shape[1]):
                found = f"has it as {list(base.tensors[name].shape)}" if name in base.tensors else "lacks it"
                raise MconvError(f"{base.dir}: the adapter changes {name} [{b.shape[0]}, {a.shape[1]}], the base model "
                                 f"{found}; is it the model the adapter was trained on?")
        plain = [(name, cast_dtype(dtype, arch.fp32_kind(name) is not None) or info.dtype, info.shape)
                 for name, info in base.tensors.items()]
        # Experts come back in the base model's form: stacked in its orientation, or per expert where the
        # base holds them so (Qwen3.5-MoE's MTP layer beside fused decoder experts); in FP8, Qwen3.5-MoE's
        # all per expert, as its FP8 releases (hf_experts.fp8_per_expert).
        stack = None
        if arch.stacked_experts and not fp8_per_expert(arch, quantization, None):
            stack = "4.x" if any(info.transposed_stride for info in base.tensors.values()) else "5.x"

        def per_expert(name: str) -> bool:
            view = stacked_expert(name)
            return view is not None and view[0] not in base.stacked

        writer = ShardedSafetensorsWriter(out, plain, max_shard_bytes, stack_experts=stack, per_expert=per_expert,
                                          quantization=quantization)
        with writer.create():
            _merge_weights(base, writer, plain, deltas, alpha, adapter.rank, quantization)
        writer.finish(base.dir, base.config, base.config)
        dequantized = (fp8.dequantized_note(base.dir, base.block, dtype or torch.bfloat16, "export-lora --merge")
                       if base.block is not None and quantization is None else None)
        return len(deltas), [note for note in (fp32_note(arch, base.tensors, dtype), dequantized) if note]


def _merge_weights(base: HFCheckpoint, writer: ShardedSafetensorsWriter, plain: list, deltas: dict, alpha: float,
                   rank: int, quantization) -> None:
    """Write every tensor of `base` (`plain`: name, dtype written, shape) into `writer`, the adapted
    ones (`deltas`: name -> (A, B)) with alpha/rank * B @ A added in float32."""
    scale = alpha / rank
    for name, out_dtype, shape in plain:
        tensor = base.read(name)
        if name in deltas:
            a, b = deltas[name]
            tensor = tensor.float() + scale * (b.float() @ a.float())
            if quantization is not None and not torch.isfinite(tensor).all() and (
                    writer.quantizes(name) or quantization.applies(name, shape)):
                raise MconvError(f"{name} with its adapter merged (the weight of {base.dir} + "
                                 f"{alpha:g}/{rank} * B @ A) holds inf or NaN values, which FP8 cannot "
                                 "quantize: check the adapter's A and B and that weight")
        if writer.quantizes(name):  # an expert's module of stacked experts: the writer quantizes its expert
            writer.write(name, tensor)
        elif quantization is not None and quantization.applies(name, shape):
            for written, quantized in fp8.quantize_tensors([(name, tensor)], quantization):
                writer.write(written, quantized)
        else:
            writer.write(name, checked_cast(name, tensor, out_dtype))
