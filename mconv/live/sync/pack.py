"""How a sync's bucket gets into the engine's memory on the sender: packed into one of the engine's
two flat buffers (`_pack`), or written straight into the engine's own tensors where it offers them
(`_write`, Engine.targets), FP8 weights quantized on the way in either case; the plans of both kept
per engine between syncs."""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass

import torch

from mconv.converter import fp8
from mconv.errors import MconvError
from mconv.transport.copies import CopyPlan
from mconv.transport.flat import layout, unpack


def _sent(named, picked, quantization, aliases) -> list[tuple[str, torch.Tensor]]:
    """A bucket written into the engine's tensors as what verify compares them with: the tensors
    copied, and its `picked` weights quantized apart (fp8.quantize_picked: the same rule into new
    tensors, so a weight written to the wrong place differs), aliases beside what they alias."""
    sent = fp8.quantize_picked(named, picked, quantization.scale_fmt) if picked else list(named)
    at = dict(sent)
    return sent + [(alias, at[of]) for alias, of in (aliases or {}).items() if of in at]


def _pack(engine, slot: int, named, aliases, device, picked=(), quantization=None,
          unchecked: list | None = None) -> tuple[list, torch.Tensor]:
    """Pack `named` into the engine's buffer for `slot`, the weights `picked` ((index, scale name),
    fp8.picked_weights) quantized by `quantization` on the way: its entries and the buffer. A
    bucket's layout is computed once per signature (names, dtypes, shapes), and its copies into the
    slot's buffer planned once while the engine keeps that buffer (copies.CopyPlan, taken from the
    first sync's tensors: later tensors of the same signature come from the same parameters, and
    the plan replans itself where one does not fit it), so a later sync's packing is one batched
    copy on a GPU. There, with float scales, the picked weights are quantized straight into the
    buffer (fp8_batch.quantize_batch(into=...)): no FP8 tensors made and copied per weight;
    elsewhere they are quantized first (fp8.quantize_picked), the same bytes. `unchecked`:
    quantize_batch's `pending` (None: checked here)."""
    layouts = engine.__dict__.setdefault("_mconv_layouts", {})  # signature -> _Layout (RemoteEngine has a _layouts)
    plans = engine.__dict__.setdefault(_COPY_PLANS, {})  # (slot, signature) -> (buffer, CopyPlan)
    signature = (tuple((name, t.dtype, t.shape) for name, t in named), tuple(sorted((aliases or {}).items())),
                 tuple(picked), quantization.scale_fmt if picked else None, device.type)
    known = layouts.get(signature)
    if known is None:
        known = layouts[signature] = _layout(named, aliases, picked, quantization, device)
    if picked and not known.places:  # quantized first: the bucket then as it would have come quantized
        named = fp8.quantize_picked(named, picked, quantization.scale_fmt)
        return _pack(engine, slot, named, aliases, device)
    buffer = engine.buffer(slot, known.nbytes, device)
    sources = [named[i][1] for i in known.copied]
    hit = plans.get((slot, signature))
    if hit is None or hit[0].data_ptr() != buffer.data_ptr() or hit[0].device != buffer.device:
        for key in [k for k, v in plans.items() if k[0] == slot and v[0].data_ptr() != buffer.data_ptr()]:
            del plans[key]  # plans into a buffer the engine replaced: they would keep it alive
        by_name = dict(unpack(buffer, known.entries))
        hit = plans[slot, signature] = (buffer, CopyPlan([by_name[named[i][0]] for i in known.copied], sources,
                                                         fixed_destinations=True))
    hit[1].run(sources)
    if known.places:
        from mconv.converter.fp8_batch import PlanKey, quantize_batch

        known.token = known.token or PlanKey()
        quantize_batch([named[i] for i, _ in picked], quantization.scale_fmt, into=(buffer, known.places),
                       pending=unchecked, key=known.token)
    return known.entries, buffer


_WRITES = "_mconv_writes"  # where _write keeps an engine's copy plans into its targets


def _write(engine, named, aliases, targets: dict, device, fixed, live, picked=(), quantization=None,
           unchecked: list | None = None) -> tuple[torch.Tensor, list, int] | None:
    """Copy `named` (and each alias, from the tensor it aliases) straight into the engine's
    `targets` ({HF name: its tensor}), on the current stream, and quantize its `picked` weights
    ((index, scale name), fp8.picked_weights) straight into their FP8 targets and their scales into
    theirs (fp8_batch.quantize_batch, `unchecked` its `pending`): (an empty buffer, the (name,
    target) pairs written, their bytes) for the bucket. None where the picked weights cannot be
    quantized so (not on a GPU, UE8M0 scales, targets not contiguous float8_e4m3fn weights and
    float32 scale grids): the caller packs the bucket.

    What a bucket's names write is worked out once per targets dict (the `written` list kept, which
    the engine's caches know it by), its copies planned once per LiveModel and `fixed` positions
    (copies.CopyPlan, as `_pack` plans them): those positions' sources, views `live`'s schedule
    keeps of parameters the sync checks, are read where they were planned, unchecked. MconvError
    for a name the engine has no tensor for."""
    cache = engine.__dict__.get(_WRITES)
    if cache is None or cache[0] is not targets:  # what writes into tensors the engine no longer offers goes
        # (the bucket's buffer: empty, on the device of the writes)
        cache = engine.__dict__[_WRITES] = (targets, {}, torch.empty(0, dtype=torch.uint8,
                                                                     device=named[0][1].device if named else device))
    # by names: they fix the shapes for one model (a new model: a new targets dict); the dtypes are checked by the
    # copy plan (a source's against its target's, which _agree_dtypes holds to first) and quantize_batch (its plan's)
    key = (tuple(map(operator.itemgetter(0), named)), tuple(picked), quantization.scale_fmt if picked else None)
    hit = cache[1].get(key)
    if hit is None:
        hit = cache[1][key] = _writes(named, aliases, targets, device, picked, quantization)
    if picked and hit.places is None:
        return None
    copied = [named[i][1] for i in hit.sources]
    planned = hit.plan is None or hit.live() is not live or hit.fixed != fixed  # (a model planned anew: moved)
    if picked:
        from mconv.converter.fp8_batch import PlanKey, quantize_batch
    if planned:
        kept = set(fixed)
        hit.plan = CopyPlan(hit.destinations, copied, fixed_destinations=True,
                            unchanged=[k for k, i in enumerate(hit.sources) if i in kept])
        hit.live, hit.fixed, hit.vouched = weakref.ref(live), fixed, all(i in kept for i, _ in picked)
        hit.token = PlanKey() if picked else None  # (a new model: the quantization's plan made anew)
    hit.plan.run(copied)
    if picked:  # (vouched for: the weights the schedule keeps views of, read where the last call read them)
        quantize_batch([named[i] for i, _ in picked], "float", into=(hit.base, hit.places), pending=unchecked,
                       key=hit.token, unchanged=hit.vouched)
    return cache[2], hit.written, hit.nbytes


def _writes(named, aliases, targets: dict, device, picked, quantization) -> "_Written":
    """_Written for a bucket's names: every (name, target) pair, FP8 weights and scales where
    `picked`, in fp8.quantize_picked's order, then the aliases; the copies; and the places of the
    quantized weights (None where they cannot be quantized into their targets: _write). MconvError
    for a name the engine has no tensor for."""
    names = [name for name, _ in named]
    at = {name: i for i, name in enumerate(names)}
    scales = dict(picked)
    sent = [name for name, _ in fp8.with_scales(named, picked, [(None, None)] * len(picked))]  # (its order)
    aliased = [(alias, of) for alias, of in (aliases or {}).items() if of in at]
    unknown = [name for name in sent + [alias for alias, _ in aliased] if name not in targets]
    if unknown:
        raise MconvError(f"the engine has no tensor {unknown[0]} to write into")
    written = [(name, targets[name]) for name in sent] + [(alias, targets[alias]) for alias, _ in aliased]
    sources = [i for i in range(len(names)) if i not in scales] + [at[of] for _, of in aliased]
    destinations = [targets[names[i]] for i in range(len(names)) if i not in scales] + [
        targets[alias] for alias, _ in aliased]
    base = places = None
    if picked and device.type == "cuda" and quantization.scale_fmt == "float" and fp8.batchable(
            [named[i][1] for i in scales]):
        pairs = [(targets[names[i]], targets[scale], named[i][1]) for i, scale in picked]
        if all(q.dtype == fp8.FP8 and q.shape == w.shape and q.is_contiguous() and q.device == w.device
               and s.dtype == torch.float32 and tuple(s.shape) == fp8.grid(w.shape) and s.is_contiguous()
               and s.device == w.device for q, s, w in pairs):
            # offsets from the lowest scale's address (4-byte aligned, as quantize_batch's scale offsets are)
            lowest = min((s for _, s, _ in pairs), key=torch.Tensor.data_ptr)
            base = lowest.view(-1).view(torch.uint8)
            places = [(q.data_ptr() - base.data_ptr(), s.data_ptr() - base.data_ptr()) for q, s, _ in pairs]
    return _Written(written, sources, destinations, sum(t.nbytes for _, t in written), base, places)


@dataclass
class _Written:
    """What a bucket's names write (_write): the (name, target) pairs, kept while the engine offers
    the same targets (its caches know the bucket by this list), the position in the bucket each
    copied target copies from and the target, their bytes, where its picked weights are quantized
    (quantize_batch's `into`: a base tensor and places; None: not into targets), and the copy plan
    with the LiveModel and fixed positions it was made for (and whether they hold all its picked
    weights: then quantize_batch's plan, under its token, is vouched for while they stand)."""

    written: list[tuple[str, torch.Tensor]]
    sources: list[int]
    destinations: list[torch.Tensor]
    nbytes: int
    base: torch.Tensor | None
    places: list[tuple[int, int]] | None
    plan: CopyPlan | None = None
    live: "weakref.ref | None" = None
    fixed: list[int] | None = None
    vouched: bool = False  # its picked weights are all at `fixed` positions
    token: object = None  # its fp8_batch.PlanKey for quantize_batch's plans, new with each plan


@dataclass
class _Layout:
    """A bucket signature's flat layout as `_pack` fills it."""

    entries: list  # flat.Entry of every tensor sent (FP8 weights and scales where picked)
    nbytes: int
    copied: list[int]  # indices of the bucket's tensors copied as they are
    places: list[tuple[int, int]] | None  # (FP8 weight, scale) byte offsets of each picked weight quantized
    # into the buffer
    token: object = None  # its fp8_batch.PlanKey for quantize_batch's plans (made at its first quantization)


def _layout(named, aliases, picked, quantization, device) -> _Layout:
    """_Layout of `named` with the `picked` weights quantized (FP8 weight, float32 scale grid, in
    fp8.quantize_picked's order) where they can be quantized into the buffer (a GPU, float scales,
    fp8_batch's weights). Otherwise an empty _Layout with no places: _pack then quantizes them
    first and lays out that bucket instead."""
    scales = dict(picked)
    if picked and not (device.type == "cuda" and quantization.scale_fmt == "float"
                       and fp8.batchable([named[i][1] for i in scales])):
        return _Layout([], 0, [], None)
    shapes = [named[i][1].shape for i, _ in picked]  # what the quantization makes, on no device
    entries, nbytes = layout(fp8.with_scales(named, picked, [
        (torch.empty(s, dtype=fp8.FP8, device="meta"), torch.empty(fp8.grid(s), dtype=torch.float32, device="meta"))
        for s in shapes]), aliases)
    at = {entry.name: entry.offset for entry in entries}
    places = [(at[named[i][0]], at[scale]) for i, scale in picked] if picked else None
    return _Layout(entries, nbytes, [i for i in range(len(named)) if i not in scales], places)


_COPY_PLANS = "_mconv_copy_plans"  # where _pack keeps an engine's copy plans (views of its buffers)


def forget_packing(engine) -> None:
    """Drop `_pack`'s copy plans into `engine`'s buffers and `_write`'s into its targets, which hold
    views of them: for an engine that replaces its buffers at every sync (the old ones must go), or
    lets the targets it mapped go."""
    engine.__dict__.pop(_COPY_PLANS, None)
    engine.__dict__.pop(_WRITES, None)
