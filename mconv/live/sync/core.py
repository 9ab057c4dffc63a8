"""sync_weights: every HF tensor of a live Megatron model into an inference engine, once per sync,
in flat buckets, with all ranks agreeing on the outcome."""
from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from mconv.converter import fp8
from mconv.converter.planner import make_plan
from mconv.errors import MconvError
from mconv.live.chunks import _config
from mconv.live.export import DEFAULT_BUCKET_BYTES, _attempt, _prepared, iter_hf_weights
from mconv.live.sync.engines import FlatBucket, as_engine
from mconv.mappings import architecture_for
from mconv.transport.flat import layout, pack

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_VERSIONS = itertools.count(1)


@dataclass
class SyncResult:
    """What one sync sent from this rank (zero buckets on a rank that sends nothing) and where its
    time went: `seconds` = {"gather": in iter_hf_weights, "pack": copies into flat buffers,
    "engine": waiting for the engine beyond the gather and pack it overlapped}."""

    version: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: dict = field(default_factory=lambda: {"gather": 0.0, "pack": 0.0, "engine": 0.0})


def sync_weights(model_chunks: Sequence[torch.nn.Module], hf_config: str | Path | dict, engine, *,
                 version: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: torch.dtype | None = None, revision: str | None = None, quantize: str | None = None,
                 fp8_scale: str | None = None) -> SyncResult:
    """Push the model's current weights into `engine`; call it on every rank of the trainer.

    `engine` is an `mconv.live.sync.Engine` (e.g. `VLLMEngine`) or a callable taking one
    `FlatBucket` per bucket. Each pipeline stage's sender (its TP/EP/ETP/DP rank 0) hands the
    engine its stage's buckets from `iter_hf_weights(model_chunks, hf_config, bucket_bytes, dtype)`
    (HF names and shapes), each packed into one contiguous uint8 buffer, on a background thread:
    the next bucket is gathered and packed while the engine loads the previous one (two buffers,
    at most two buckets in flight). With tied embeddings and an engine that asks for it (vLLM),
    `lm_head.weight` goes beside `model.embed_tokens.weight`, sharing its bytes. `quantize="fp8"`
    (`fp8_scale`) sends each weight iter_hf_weights quantizes as its FP8 weight and float32
    `_scale_inv` (MconvError as iter_hf_weights raises it for other values).

    Before any bucket, rank 0 compares the names and shapes it will send with the engine's
    `expected()`: names the engine does not know, names it expects and does not get, and shapes
    that differ are one MconvError on every rank, and nothing is sent. Once started, the ranks
    agree after every bucket: if any rank raises (its gather, its packing or the engine), every
    rank raises one MconvError naming that rank and its error, the engine is told `abort` (never
    `finish`), and the next sync starts clean. `version` (default: "1", "2", ... per process) is
    given to the engine's `start` / `finish`. Returns this rank's SyncResult.
    """
    engine = as_engine(engine)
    version = str(next(_VERSIONS)) if version is None else str(version)
    config = _config(hf_config, revision)
    quantization = fp8.writer_quantization(architecture_for(config), quantize, fp8_scale, config)
    chunks = list(model_chunks)
    live, schedule = _prepared(chunks, config, bucket_bytes)
    tied = bool(config.get("tie_word_embeddings")) and engine.sends_tied_lm_head
    first = dist.get_rank() == 0
    sender = _is_sender(live)
    result = SyncResult(version)

    refused = None
    if first:
        refused = _attempt(lambda: _check(engine.expected(), _sent_shapes(live, config, tied, quantization)))
        refused = refused or _attempt(lambda: engine.start(version))
    refused = _shared(refused)
    if refused is not None:
        raise MconvError(f"weight sync {version} refused before any bucket was sent: {refused}")

    rounds = torch.tensor([len(schedule)], device=_collective_device())
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX)  # every rank agrees once per round, stage or not
    buckets = iter_hf_weights(chunks, config, bucket_bytes=bucket_bytes, dtype=dtype, quantize=quantize,
                              fp8_scale=fp8_scale)
    workers = ThreadPoolExecutor(1, thread_name_prefix="mconv-sync") if sender else None
    pending: list[Future] = []
    failure = None
    try:
        for index in range(int(rounds)):
            if index < len(schedule) and failure is None:
                failure = _attempt(lambda: _send(index, buckets, engine, sender, tied, version, pending, workers,
                                                 result))
            if _any(failure):
                break
        if workers is not None:
            waited = time.perf_counter()
            failure = failure or next((e for e in (_attempt(f.result) for f in pending) if e is not None), None)
            result.seconds["engine"] += time.perf_counter() - waited
    finally:
        buckets.close()
        if workers is not None:
            workers.shutdown(wait=True)
    reason = _shared(failure)
    if reason is not None:
        if first:
            aborted = _attempt(lambda: engine.abort(version, reason))
            if aborted is not None:
                reason += f" (and telling the engine failed: {aborted})"
        raise MconvError(f"weight sync {version} failed; the engine was told to abort it: {reason}")
    finished = _shared(_attempt(lambda: engine.finish(version)) if first else None)
    if finished is not None:
        raise MconvError(f"weight sync {version}: the engine did not finish it: {finished}")
    return result


def _send(index, buckets, engine, sender, tied, version, pending, workers, result) -> None:
    """Gather bucket `index` (every rank of the stage takes part) and, on the sender, pack it into
    slot index % 2 once the bucket that used that slot is loaded, and queue it for the engine."""
    started = time.perf_counter()
    named = next(buckets)
    packed = time.perf_counter()
    result.seconds["gather"] += packed - started
    if not sender:
        return
    if len(pending) >= 2:
        pending[-2].result()  # the engine is done with this slot's previous bucket (raises its error)
    waited = time.perf_counter()
    entries, nbytes = layout(named, {LM_HEAD: EMBEDDING} if tied else None)
    device = named[0][1].device if named else torch.device("cpu")
    buffer = engine.buffer(index % 2, nbytes, device)
    pack(named, entries, buffer)
    result.seconds["engine"] += waited - packed
    result.seconds["pack"] += time.perf_counter() - waited
    result.buckets += 1
    result.tensors += len(entries)
    result.bytes += nbytes
    bucket = FlatBucket(version, index, buffer, entries)
    pending.append(workers.submit(engine.update, bucket))


def _is_sender(live) -> bool:
    from megatron.core import parallel_state as ps

    return (live.rank.tp == 0 and live.rank.ep == 0 and live.rank.etp == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0)


def _sent_shapes(live, config: dict, tied: bool, quantization) -> dict[str, list[int]]:
    """{HF name: shape} of everything a sync sends, all stages together."""
    full = make_plan(live.arch, config, live.layout, live.spec, mtp=bool(live.dims.mtp_layers))
    shapes = {name: list(shape) for task in full.exports() for name, shape in zip(task.hf, task.hf_shapes)}
    if quantization is not None:
        shapes.update((fp8.scale_name(name), list(fp8.grid(shape))) for name, shape in list(shapes.items())
                      if quantization.applies(name, shape))
    if tied and EMBEDDING in shapes:
        shapes[LM_HEAD] = shapes[EMBEDDING]
    return shapes


def _check(expected: dict | None, sent: dict) -> None:
    if expected is None:
        return
    unknown = sorted(set(sent) - set(expected))
    missing = sorted(set(expected) - set(sent))
    shapes = sorted(n for n in set(sent) & set(expected) if list(expected[n]) != list(sent[n]))
    problems = ([f"the engine's model has no {', '.join(unknown[:3])}" + (" ..." if len(unknown) > 3 else "")]
                if unknown else []) + \
               ([f"the trainer does not send {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "")]
                if missing else []) + \
               [f"{n} is {sent[n]} in the trainer, {list(expected[n])} in the engine" for n in shapes[:3]]
    if problems:
        raise MconvError("the trainer's model does not match the engine's: " + "; ".join(problems))


def _any(failure: Exception | None) -> bool:
    """A collective: whether any rank has failed."""
    flag = torch.tensor([failure is not None], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _collective_device() -> torch.device:
    """Where the agreement tensors live: the CPU with gloo, the current GPU with NCCL alone (which
    has no CPU tensors)."""
    if "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _shared(failure: Exception | None) -> str | None:
    """A collective: the first failing rank's error as one line ("rank R: ..."), on every rank."""
    mine = None if failure is None else (str(failure) if isinstance(failure, MconvError)
                                         else f"{type(failure).__name__}: {failure}")
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    return next((f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None), None)
