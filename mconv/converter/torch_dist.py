"""Megatron-LM's `torch_dist` format for mconv's models: what a checkpoint holds, derived from the
architecture table, without megatron-core.

A torch_dist checkpoint holds global (layout-independent) tensors by key; the trainer reshards them
on load. The keys, global shapes and boxes are those megatron-core's `sharded_state_dict()` of the
TP1/PP1/EP1 local-spec model gives (tests/test_torch_dist_keys.py compares them, box by box, with
megatron-core's own for a sweep of models). They follow from the TP1 plan (every parameter's
local-spec name and shape) and megatron-core's conventions (megatron-core 0.19.2, read and run):

- a key is the parameter's name with the layer spec's `sharded_state_dict_keys_map` applied inside a
  decoder layer (`Architecture.torch_dist.keys_map`; the local GPT spec maps `input_layernorm.` to
  `self_attention.linear_qkv.layer_norm_`, ...);
- decoder layers are stacked on a leading axis (`decoder.layers.X` of shape `[L, ...]`,
  TransformerBlock.sharded_state_dict) unless they are heterogeneous: `moe_layer_freq` a list, or an
  architecture whose layers differ (`torch_dist.per_layer`), where keys are `decoder.layers.{i}.X`;
- tensors in numbered copies outside the layers (`Rule.repeat`: vision blocks, deepstack mergers) are
  stacked on their index when the layers are (mbridge's vision config is a copy of the language
  one, `moe_layer_freq` included);
- megatron-core's MTP layers (`mtp.layers.{j}.`, hf2mcore --mtp) keep per-depth keys, the inner
  layer under its old name `transformer_layer.` (MultiTokenPredictionLayer.sharded_state_dict);
- routed experts (SequentialMLP): `local_experts.{e}.` becomes `experts.` with an expert axis after
  the layer axis;
- a GLU `linear_fc1` is one tensor `[gate; up]` stored as two boxes (MLP's swiglu factory); a rule
  with `dist_sections` is one global tensor per section, its key suffixed with the section name (AReaL's
  KimiDeltaAttention splits `in_proj` and `conv1d` so);
- every linear's `_extra_state` is a ShardedObject over the prepended axes, unique key
  `{key}._extra_state/shard_{offsets}_{shape}`, holding None; GPTModel drops the output layer's;
- a TP1/DP1 writer holds the main replica of everything: replica id (0, 0, 0).
Only the bytes come from mconv's format-level reader and writer (`torch_dist_io`, `torch_dist_write`):
each box is built from the HF slices when the writer gets to it, one parameter per writer thread in
memory at a time.
"""
from __future__ import annotations

import functools
import re
from argparse import Namespace
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from mconv.converter import torch_dist_io
from mconv.converter.hf_io import check_convertible
from mconv.converter.planner import Plan, TensorTask
from mconv.converter.torch_dist_io import COMMON_KEY
from mconv.converter.torch_dist_write import DistEntry
from mconv.converter.transforms import GLU, VOCAB
from mconv.converter.options import dtype_name, option
from mconv.errors import MconvError
from mconv.mappings.schema import LAST, MTP_LAYER

MTP_INNER = MTP_LAYER + "mtp_model_layer."  # megatron-core's MTP layer's inner transformer layer

REPLICA = (0, 0, 0)  # megatron-core's replica id of the main copy (TP, PP-or-DP, DP ranks all 0)


@dataclass(frozen=True)
class DistBox:
    """One box of a global tensor a torch_dist checkpoint holds (or one object), and the rows
    [start, start + length) of the TP1 Megatron parameter `task` it holds.

    `global_shape`, `offsets`, `sizes` as megatron-core's ShardedTensor has them: `axes` prepended
    axes (layers, experts, repeat index) of size 1 in `sizes`, then the box. Objects (`_extra_state`)
    have `global_shape` None and `key` their unique key."""

    key: str
    task: TensorTask
    global_shape: tuple[int, ...] | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int = 0
    length: int = 0
    axes: int = 0
    replica_id: tuple[int, ...] = REPLICA


def check_model(plan: Plan) -> None:
    """Raises MconvError, naming the reason, if this model has no torch_dist checkpoint: its table
    says no torch_dist keys, or the trainer's model class cannot build it (`DistKeys.check`)."""
    if plan.arch.torch_dist is None:
        raise MconvError(f"{option('fmt', 'torch_dist')} is not available for {plan.arch.name}; use {option('fmt', 'torch')}")
    if plan.arch.torch_dist.check is not None:
        plan.arch.torch_dist.check(plan.dims)


def layers_stacked(plan: Plan, args: Namespace) -> bool:
    """Whether megatron-core stacks the decoder layers on one key (TransformerBlock.sharded_state_dict:
    not when `moe_layer_freq` is a list or above 1), here also not for heterogeneous architectures."""
    freq = getattr(args, "moe_layer_freq", None)
    return not plan.arch.torch_dist.per_layer and not isinstance(freq, list) and freq in (None, 1)


def _indexes(template: str, name: str) -> dict[str, int]:
    """The values of a name template's fields (`{layer}`, `{expert}`, a repeat index) in `name`."""
    pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>\\d+)", re.escape(template))
    match = re.fullmatch(pattern, name)
    if match is None:
        raise MconvError(f"internal: {name} is not an instance of {template}")
    return {field: int(value) for field, value in match.groupdict().items()}


def _mapped(name: str, plan: Plan) -> str:
    """A name inside a decoder layer with the layer spec's keys map applied (the first matching
    prefix, as megatron-core does)."""
    for old, new in plan.arch.torch_dist.keys_map:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _key(task: TensorTask, plan: Plan, stacked: bool) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(key, offsets, sizes) of the prepended axes of a TP1 parameter (or `_extra_state`)."""
    rule, dims, keys = task.rule, plan.dims, plan.arch.torch_dist
    template, offsets, counts = rule.megatron, [], []
    index = _indexes(template, task.megatron)  # one TP1 chunk: layer and expert indexes are global
    tower = keys.tower is not None and template.startswith(keys.tower)
    if keys.te_names and rule.te and "{expert}" not in rule.te and not tower:
        template = rule.te
    layer, expert = index.get("layer"), index.get("expert")
    if rule.per_layer:
        head, rest = template.split("{layer}.", 1)
        template = head + ("" if stacked else "{layer}.") + _mapped(rest, plan)
        if stacked:
            offsets.append(layer)
            counts.append(dims.layers)
    model, mtp, inner = template.partition(MTP_INNER)  # `model`: the language model's prefix in a VL model
    if mtp:
        # MultiTokenPredictionLayer.sharded_state_dict keeps the old name of a GPT MTP layer's inner
        # layer (`transformer_layer.`); MTP layers are never stacked (no sharded offsets).
        template = model + MTP_LAYER + "transformer_layer." + _mapped(inner, plan)
    if "{expert}" in template:
        if ".local_experts.{expert}." not in template:
            raise MconvError(f"internal: expert tensor {rule.megatron} is not named as megatron-core's SequentialMLP")
        template = template.replace(".local_experts.{expert}.", ".experts.")
        offsets.append(expert)
        counts.append(dims.experts)
    if rule.repeat and (stacked or tower) and MTP_LAYER not in template:
        field, count = rule.repeat[:2]
        template = template.replace("{%s}." % field, "")
        offsets.append(index[field])
        counts.append(getattr(dims, count))
    return template.format(**index), tuple(offsets), tuple(counts)


def plan_boxes(plan: Plan, args: Namespace) -> list[DistBox]:
    """Every box (and object) of the torch_dist checkpoint of `plan` (a TP1/PP1/EP1 local-spec plan,
    vocabulary padded as the target layout pads it) for the Megatron-LM `args` it is stored with,
    in the plan's order. Raises MconvError as `check_model` does."""
    check_model(plan)
    stacked = layers_stacked(plan, args)
    output_layers = {r.megatron.removesuffix(".weight") for r in plan.arch.rules if r.kind is VOCAB and r.stage == LAST}
    boxes = []
    for task in plan.ranks[0].chunks[0]:
        key, axes, counts = _key(task, plan, stacked)
        ones = (1,) * len(axes)
        if task.shard is None:
            if key.removesuffix("._extra_state") in output_layers:  # GPTModel.sharded_state_dict pops it
                continue
            unique = f"{key}/shard_{'.'.join(map(str, axes or (0,)))}_{'.'.join(map(str, counts or (1,)))}"
            boxes.append(DistBox(unique, task, None, axes, ones, axes=len(axes)))
            continue
        shape, sections = task.shape, task.rule.dist_sections
        if task.rule.kind is not GLU and not sections:
            boxes.append(DistBox(key, task, counts + shape, axes + (0,) * len(shape), ones + shape, 0, shape[0],
                                 len(axes)))
            continue
        start = 0
        for i, length in enumerate(task.shard.sections or [piece.length for piece in task.shard.pieces]):
            box = (length,) + shape[1:]
            if sections:
                boxes.append(DistBox(f"{key}.{sections[i]}", task, counts + box, axes + (0,) * len(shape),
                                     ones + box, start, length, len(axes)))
            else:
                boxes.append(DistBox(key, task, counts + shape, axes + (start,) + (0,) * (len(shape) - 1),
                                     ones + box, start, length, len(axes)))
            start += length
    return boxes


def entries(plan: Plan, args: Namespace, common: dict,
            windows: Callable[[TensorTask, int, int], Iterable[torch.Tensor]],
            dtypes: dict[str, torch.dtype]) -> list[DistEntry]:
    """The writer's entries for the torch_dist checkpoint of `plan` (see `plan_boxes`), then the
    `common` state (as Megatron-LM's: args, checkpoint_version, iteration). `windows(task, start,
    stop)` gives rows [start, stop) of a parameter's full TP1 tensor as consecutive windows of its
    bytes (DistEntry.produce), `dtypes` each parameter's dtype by its local-spec name."""
    out, first = [], {}  # first: key -> the first task stored under it (its layers share one tensor)
    for box in plan_boxes(plan, args):
        if box.global_shape is None:
            out.append(DistEntry(box.key, None, None, lambda: None))
        else:
            other = first.setdefault(box.key, box.task)
            if dtypes[other.megatron] != dtypes[box.task.megatron]:
                a, b = (dtype_name(dtypes[t.megatron]) for t in (other, box.task))
                raise MconvError(f"{other.hf[0]} is {a} and {box.task.hf[0]} is {b}, but torch_dist stores them as "
                                 f"one tensor of one dtype ({box.key}); pass {option('dtype')} to cast every tensor "
                                 f"to one dtype, or {option('fmt', 'torch')}, whose rank files keep each tensor's own")
            out.append(DistEntry(box.key, box.global_shape, dtypes[box.task.megatron],
                                 functools.partial(windows, box.task, box.start, box.start + box.length),
                                 box.offsets, box.sizes, group=box.task.megatron))
    out.append(DistEntry(COMMON_KEY, None, None, lambda: common))
    return out


def check_stored(reader: torch_dist_io.TorchDistReader, plan: Plan, args: Namespace) -> None:
    """Every global tensor `plan` (TP1 local-spec, see plan_boxes) needs is in the checkpoint with
    the global shape the HF config implies, in a dtype mconv converts. Raises MconvError naming the
    first key missing or of another shape."""
    for box in plan_boxes(plan, args):
        if box.global_shape is None:
            continue
        stored = reader.tensors.get(box.key)
        if stored is None:
            raise MconvError(f"{reader.iter_dir}: tensor {box.key} (for {box.task.megatron}) is missing from the "
                             "checkpoint")
        if stored.shape != box.global_shape:
            raise MconvError(f"{reader.iter_dir}: tensor {box.key} has shape {list(stored.shape)}, "
                             f"the HF config implies {list(box.global_shape)}")
        check_convertible(stored.dtype, reader.iter_dir, box.key)


def parameter_session(reader: torch_dist_io.TorchDistReader, plan: Plan, args: Namespace):
    """(load, dtype_of, load_rows, file_rows) for a torch_dist checkpoint read by the TP1 local-spec
    parameter names of `plan`: load(names) -> {name: tensor}; dtype_of(name) is the stored dtype of
    that parameter; load_rows([(name, start, dest)]) reads rows [start, start + len(dest)) of each
    parameter into `dest` (a contiguous tensor of the stored dtype: the output's own memory);
    file_rows(name, start, dest) says where those rows are stored, as (file descriptor, file
    offset, byte offset in dest, bytes) ranges making up `dest`, or None where they are not
    contiguous bytes of the stored chunks (TorchDistReader.file_ranges).
    The reader reads each parameter's boxes (ranges of its rows), whatever chunking was written.
    The stored keys and shapes are those `check_stored` accepts (MconvError for a missing key)."""
    boxes: dict[str, list[DistBox]] = {}
    for box in plan_boxes(plan, args):
        if box.global_shape is not None:
            boxes.setdefault(box.task.megatron, []).append(box)
    where = reader.iter_dir

    def stored_dtype(name: str) -> torch.dtype:
        if name not in boxes:
            raise MconvError(f"internal: the torch_dist plan has no parameter {name}")
        key = boxes[name][0].key
        if key not in reader.tensors:
            raise MconvError(f"{where}: tensor {key} (for {name}) is missing from the checkpoint")
        return reader.tensors[key].dtype

    def requests(name: str, start: int, dest: torch.Tensor) -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
        """The reader's (key, offsets, destination) boxes holding rows [start, start + len(dest))."""
        stored_dtype(name)
        stop, out = start + dest.shape[0], []
        for box in boxes[name]:
            lo, hi = max(start, box.start), min(stop, box.start + box.length)
            if lo >= hi:
                continue
            offsets, sizes = list(box.offsets), list(box.sizes)
            offsets[box.axes] += lo - box.start  # the parameter's rows are axis `axes` of the box
            sizes[box.axes] = hi - lo
            out.append((box.key, tuple(offsets), dest.narrow(0, lo - start, hi - lo).view(sizes)))
        return out

    def load_rows(parts: list[tuple[str, int, torch.Tensor]]) -> None:
        reader.read([request for part in parts for request in requests(*part)])

    def file_rows(name: str, start: int, dest: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
        ranges = []
        for key, offsets, view in requests(name, start, dest):
            found = reader.file_ranges(key, offsets, view)
            if found is None:
                return None
            shift = view.data_ptr() - dest.data_ptr()
            ranges += [(fd, offset, shift + at, nbytes) for fd, offset, at, nbytes in found]
        return ranges

    def load(wanted: list[str]) -> dict[str, torch.Tensor]:
        out = {name: torch.empty(boxes[name][0].task.shape, dtype=stored_dtype(name)) for name in wanted}
        load_rows([(name, 0, buffer) for name, buffer in out.items()])
        return out

    return load, stored_dtype, load_rows, file_rows
