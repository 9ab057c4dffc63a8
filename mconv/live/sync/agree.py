"""What a weight sync checks against its engine before any bucket: the names, shapes and dtypes
each stage sends (worked out once per model) against the engine's, and the device the model's
tensors lie on."""
from __future__ import annotations

import torch

from mconv.converter import fp8
from mconv.converter.options import DTYPES
from mconv.converter.planner import make_plan
from mconv.converter.transforms import cast_dtype
from mconv.errors import MconvError
from mconv.live.schedule import _exported
from mconv.transport.flat import dtype_name

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _sent_shapes(live, config: dict, tied: bool, quantize, fp8_scale, quantization) -> dict[str, list[int]]:
    """{HF name: shape} of everything a sync sends, all stages together; planned once per model
    (the cache lives on the LiveModel, which _prepared replaces when the model's parameters change)."""
    cache = live.__dict__.setdefault("_mconv_sent_shapes", {})
    key = (tied, quantize, fp8_scale)
    if key not in cache:
        full = make_plan(live.arch, config, live.layout, live.spec, mtp=bool(live.dims.mtp_layers))
        shapes = {name: list(shape) for task in full.exports() for name, shape in zip(task.hf, task.hf_shapes)}
        if quantization is not None:
            shapes.update((fp8.scale_name(name), list(fp8.grid(shape))) for name, shape in list(shapes.items())
                          if quantization.applies(name, shape))
        if tied and EMBEDDING in shapes:
            shapes[LM_HEAD] = shapes[EMBEDDING]
        cache[key] = shapes
    return cache[key]


def _sent_dtypes(live, cast: torch.dtype | None, quantization, tied: bool) -> dict[str, torch.dtype]:
    """{HF name: dtype} of what this rank's stage sends (as iter_hf_weights makes its buckets): `cast`
    (sync_weights' dtype=) where given, but float32 for the tensors the model keeps in float32, else
    the dtype of the Megatron parameter each comes from; float8_e4m3fn for the weights `quantization`
    quantizes and float32 for their _scale_inv; lm_head.weight as the embedding where `tied`. Worked
    out once per model (cached on the LiveModel, which _prepared replaces when the parameters change)."""
    cache = live.__dict__.setdefault("_mconv_sent_dtypes", {})
    key = (cast, quantization is not None, tied)
    if key not in cache:
        tasks = _exported(live.plan)
        # each task's HF names on every EP rank of the stage (their experts, gathered by the sender)
        peers = [_exported(live.peer_plan(ep=r)) for r in range(live.layout.ep)] if live.layout.ep > 1 else [tasks]
        dtypes = {}
        for i, (v, task) in enumerate(tasks):
            held = live.tensors[v][task.megatron].dtype
            for _, peer in (peer_tasks[i] for peer_tasks in peers):
                for name, shape in zip(peer.hf, peer.hf_shapes):
                    if quantization is not None and quantization.applies(name, shape):
                        dtypes[name], dtypes[fp8.scale_name(name)] = fp8.FP8, torch.float32
                    else:
                        dtypes[name] = cast_dtype(cast, live.arch.fp32_kind(name) is not None) or held
        if tied and EMBEDDING in dtypes:
            dtypes[LM_HEAD] = dtypes[EMBEDDING]
        cache[key] = dtypes
    return cache[key]


def _agree_dtypes(engine, live, cast: torch.dtype | None, quantization, tied: bool) -> None:
    """MconvError naming the tensors (up to 3) this rank's stage sends (_sent_dtypes, worked out
    only for an engine that tells) in another dtype than the engine's `dtypes()` holds them in, and
    the `dtype=` under which they would all agree, if one does. Compared only when either dict is
    not the one agreed on at the last sync."""
    held = engine.dtypes()
    if held is None:
        return
    dtypes = _sent_dtypes(live, cast, quantization, tied)
    agreed = engine.__dict__.get("_agreed_dtypes")
    if agreed is not None and agreed[0] is held and agreed[1] is dtypes:
        return
    differ = sorted(name for name in dtypes.keys() & held.keys() if dtypes[name] != held[name])
    if differ:
        fits = [c for c in (None, *(getattr(torch, name) for name in DTYPES)) if c != cast and all(
            held.get(name, dt) == dt for name, dt in _sent_dtypes(live, c, quantization, tied).items())]
        hint = ("no dtype= sends them all as the engine holds them: give the engine's parameters the dtypes sent"
                if not fits else "leave dtype= out (the model's own dtypes are the engine's)" if fits[0] is None
                else f"pass sync_weights(dtype=torch.{dtype_name(fits[0])})")
        raise MconvError("the trainer's model does not match the engine's: " + "; ".join(
            f"{name} is sent as {dtype_name(dtypes[name])}, the engine holds {dtype_name(held[name])}"
            for name in differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
            + f": {hint} (the engine copies the bytes it gets, uncast)")
    engine.__dict__["_agreed_dtypes"] = (held, dtypes)


def _model_device(live) -> torch.device:
    """The one device of the tensors this rank sends from (the CPU for none). MconvError naming a
    tensor on each where they lie on several (a model built on a GPU outside `torch.device("cuda")`
    keeps megatron-core's local norms on the CPU): a bucket would mix them mid-sync. Worked out once
    per model (the LiveModel is replaced when its parameters move)."""
    if "_mconv_device" not in live.__dict__:
        found: dict[torch.device, str] = {}
        for tensors in live.tensors:
            for name, tensor in tensors.items():
                found.setdefault(tensor.device, name)
        if len(found) > 1:
            raise MconvError("the model's tensors lie on " + " and ".join(
                f"{device} ({name}, ...)" for device, name in found.items()) + ": move the whole model to one device "
                "(model.cuda(), or build it under `with torch.device('cuda'):`)")
        live.__dict__["_mconv_device"] = next(iter(found), torch.device("cpu"))
    return live.__dict__["_mconv_device"]


def _agree_models(engine, sent) -> None:
    """_check the engine's expected() against `sent()` (a callable: planned only when the engine can
    tell), skipped when the engine returns the very dict it returned last time for the same sent
    shapes (RemoteEngine does when the receiver reports its model unchanged)."""
    expected = engine.expected()
    if expected is None:
        return
    shapes = sent()
    agreed = engine.__dict__.get("_agreed")
    if agreed is not None and agreed[0] is expected and agreed[1] is shapes:
        return
    _check(expected, shapes)
    engine.__dict__["_agreed"] = (expected, shapes)


def _check(expected: dict | None, sent: dict) -> None:
    if expected is None:
        return
    unknown = sorted(set(sent) - set(expected))
    missing = sorted(set(expected) - set(sent))
    shapes = sorted(n for n in set(sent) & set(expected) if list(expected[n]) != list(sent[n]))
    more = lambda names: f" and {len(names) - 3} more" if len(names) > 3 else ""  # noqa: E731
    problems = ([f"the engine's model has no {', '.join(unknown[:3])}{more(unknown)}"] if unknown else []) + \
               ([f"the trainer does not send {', '.join(missing[:3])}{more(missing)}"] if missing else []) + \
               [f"{n} is {sent[n]} in the trainer, {list(expected[n])} in the engine" for n in shapes[:3]]
    scales = [n for n in unknown if n.endswith(fp8.SCALE_SUFFIX)]
    if scales and len(scales) * 2 >= len(unknown):  # an FP8 sync into an engine without FP8 weights
        problems.append("with quantize=\"fp8\" the engine holds each quantized weight as float8_e4m3fn with a float32 "
                        f"{fp8.SCALE_SUFFIX} beside it (the tensors iter_hf_weights(quantize=\"fp8\") yields): give it "
                        "those, or sync without quantize")
    if problems:
        raise MconvError("the trainer's model does not match the engine's: " + "; ".join(problems))
