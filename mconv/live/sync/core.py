"""sync_weights: every HF tensor of a live Megatron model into an inference engine, once per sync,
in flat buckets, with all ranks agreeing on the outcome."""
from __future__ import annotations

import itertools
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from mconv.converter import fp8
from mconv.errors import MconvError
from mconv.live.chunks import _config
from mconv.live.export import DEFAULT_BUCKET_BYTES, _attempt, _collective_device, _stage_buckets
from mconv.live.schedule import _bucket_layout, _checked, _prepared, _prepared_for_sync
from mconv.live.sync.agree import EMBEDDING, LM_HEAD, _agree_dtypes, _agree_models, _model_device, _sent_shapes
from mconv.live.sync.engines import FlatBucket, as_engine
from mconv.mappings import architecture_for
from mconv.live.sync.pack import _pack, _sent, _write
from mconv.transport.flat import checksums

_VERSIONS = itertools.count(1)
_RUNNING = threading.Lock()  # one sync at a time in a process: two would pair their collectives wrongly


@dataclass
class SyncResult:
    """What one sync sent from this rank (zero buckets on a rank that sends nothing) and where its
    time went: `seconds` = {"gather": in iter_hf_weights, "pack": copies into flat buffers (or,
    written directly, into the engine's tensors: Engine.targets), "engine": waiting for the engine
    beyond the gather and pack it overlapped}."""

    version: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: dict = field(default_factory=lambda: {"gather": 0.0, "pack": 0.0, "engine": 0.0})


def sync_weights(model_chunks: Sequence[torch.nn.Module], hf_config: str | Path | dict, engine, *,
                 version: str | int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: torch.dtype | None = None, revision: str | None = None, quantize: str | None = None,
                 fp8_scale: str | None = None, verify: bool = False) -> SyncResult:
    """Push the model's current weights into `engine`; call it on every rank of the trainer.

    `engine` is an `mconv.live.sync.Engine` (e.g. `VLLMEngine`) or a callable taking one
    `FlatBucket` per bucket (MconvError for anything else, on every rank: below). Each pipeline
    stage's sender (its TP/EP/ETP/DP rank 0) hands the engine its stage's buckets from
    `iter_hf_weights(model_chunks, hf_config, bucket_bytes, dtype)` (HF names and shapes), each
    packed into one contiguous uint8 buffer, on a background thread: the next bucket is gathered
    and packed while the engine loads the previous one (two buffers, at most two buckets in
    flight). With tied embeddings and an engine that asks for it (vLLM), `lm_head.weight` goes
    beside `model.embed_tokens.weight`, sharing its bytes. `quantize="fp8"` (`fp8_scale`) sends
    each weight iter_hf_weights quantizes as its FP8 weight and float32 `_scale_inv` (MconvError
    as iter_hf_weights raises it for other values).

    Every rank first checks its arguments and plans the sync (`engine` as above, `verify` a bool,
    `model_chunks` a non-empty list of modules, `bucket_bytes` a positive integer, `dtype` one
    mconv writes, by name or as a torch dtype, the HF config readable: a path missing on one
    node, a parameter replaced on one rank); a rank that fails there is one MconvError on every
    rank, before the engine is told anything (or, where rank 0 had started it, after its
    `abort`); so are ranks given different `bucket_bytes`, `dtype`, `quantize`, `fp8_scale` (None
    and "float" are the same) or `verify` (their collectives would not line up). MconvError at
    once before `torch.distributed.init_process_group`. A KeyboardInterrupt during the sync aborts
    the engine's update before it propagates (buckets still queued for the engine are not sent).
    One sync at a time per process: a second `sync_weights` while one runs (another thread, an
    engine calling it) is an MconvError at once.

    Before any bucket, rank 0 compares the names and shapes it will send with the engine's
    `expected()`, and every sender the dtype each tensor of its stage is sent in (`dtype`'s cast,
    else its Megatron parameter's; FP8 weights and float32 scales with `quantize`) with the
    engine's `dtypes()`, for an engine that needs exact dtypes (ParameterReceiver): names the
    engine does not know, names it expects and does not get, shapes and dtypes that differ are one
    MconvError on every rank, and no bucket is sent (a dtype refused on another sender than rank 0
    after rank 0 started the engine's update: after its `abort`). The parameters are checked for
    moves bucket by bucket (those of bucket 0 and one of each other bucket first): one found moved
    to another dtype, shape or device at a later bucket fails the sync then, aborted. Once started,
    the ranks agree after every bucket: if any rank raises (its gather, its packing or the engine),
    every rank raises one MconvError naming that rank and its error, the engine is told `abort`
    (never `finish`), and the next sync starts clean. `version` (default: "1", "2", ... counting
    the calls in this process, refused ones too) is given to the engine's `start` / `finish`: a
    str, or an int (a training step, given as its decimal string); another type, or a str
    beginning "failed:" (a receiver's mark of a failed update), is refused before any bucket.
    Returns this rank's SyncResult.

    A rank that dies mid-sync (the process group raises in a collective: gloo does at once, NCCL
    after its timeout) gives every surviving rank one MconvError saying so; rank 0 aborts the
    engine's update, or, if rank 0 is the one lost, the receiver does when its connection closes.

    `verify=True`: after `finish`, rank 0 asks the engine for a checksum of every tensor it now
    holds (`Engine.checksums`; refused before any bucket for an engine that cannot) and compares
    each with the checksum of what was sent: the names that differ are one MconvError on every
    rank (the engine has finished the update by then; sync again).
    """
    if not dist.is_initialized():
        raise MconvError("sync_weights runs on every rank of an initialized process group: call "
                         "torch.distributed.init_process_group and megatron.core.parallel_state."
                         "initialize_model_parallel first (one rank: world_size=1)")
    if version is None:
        version = str(next(_VERSIONS))
    elif isinstance(version, int) and not isinstance(version, bool):
        version = str(version)  # a training step
    if not _RUNNING.acquire(blocking=False):
        raise MconvError(f"weight sync {_shown(version)}: another sync_weights is running in this process "
                         "(another thread, or an engine that calls sync_weights); one sync at a time")
    try:
        return _sync(model_chunks, hf_config, engine, version, bucket_bytes, dtype, revision, quantize, fp8_scale,
                     verify)
    finally:
        _RUNNING.release()


def _sync(model_chunks, hf_config, engine, version, bucket_bytes, dtype, revision, quantize, fp8_scale,
          verify) -> SyncResult:
    first = dist.get_rank() == 0
    shown = _shown(version)
    result = SyncResult(version)
    prepared: dict = {}

    def prepare() -> None:  # on every rank; what fails here (a path missing on one node) is agreed on below
        nonlocal engine
        _check_version(version)
        if not isinstance(verify, bool):
            raise MconvError(f"verify={verify!r}: give True or False")
        engine = as_engine(engine)
        if first:  # its reply is read in _agree_models: the planning below overlaps the engine's answering
            engine.ask_expected()
        chunks, cast = _checked(model_chunks, bucket_bytes, dtype)
        config = _config(hf_config, revision)
        quantization = fp8.writer_quantization(architecture_for(config), quantize, fp8_scale, config)
        live, schedule, unmoved = _prepared_for_sync(chunks, config, bucket_bytes)  # (checked per bucket: _buckets)
        tied = bool(config.get("tie_word_embeddings")) and engine.sends_tied_lm_head
        prepared.update(chunks=chunks, dtype=cast, config=config, quantization=quantization, live=live,
                        schedule=schedule, unmoved=unmoved, bucket_bytes=bucket_bytes, tied=tied,
                        sender=_is_sender(live))
        if prepared["sender"]:  # each stage's sender packs and sends its own stage's tensors
            engine.check_device(_model_device(live))
            if not first:  # (rank 0's names and shapes, all stages', are compared first: below)
                _agree_dtypes(engine, live, cast, quantization, tied)

    refused = _attempt(prepare)
    started = False  # this rank told the engine to start (rank 0)
    if first and refused is None:
        chunks, config, live, tied, quantization = (prepared[k] for k in ("chunks", "config", "live", "tied",
                                                                           "quantization"))
        if verify and not engine.verifiable:
            refused = MconvError(f"verify=True: {type(engine).__name__} cannot read the engine's weights back (give "
                                 "CallableEngine a checksums function)")
        refused = refused or _attempt(lambda: _agree_models(engine, lambda: _sent_shapes(
            live, config, tied, quantize, fp8_scale, quantization)))
        refused = refused or _attempt(lambda: _agree_dtypes(engine, live, prepared["dtype"], quantization, tied))
        refused = refused or _attempt(lambda: engine.start(version, verify=True) if verify else engine.start(version))
        started = refused is None
    sums: dict | None = {} if verify else None
    try:
        quantization = prepared.get("quantization")  # (fp8_scale None and "float" are the same)
        arguments = zlib.crc32(repr((bucket_bytes, str(prepared.get("dtype", dtype)), quantization and
                                     quantization.scale_fmt, verify)).encode())  # (paths may differ by node)
        # every rank agrees once per round
        rounds, held_back = _started(refused, len(prepared.get("schedule", ())), arguments)
        if held_back:
            reason = _shared(refused) if held_back == "refused" else (
                "the ranks called sync_weights with different bucket_bytes, dtype, quantize, fp8_scale or verify: "
                "pass the same on every rank")
            if started:  # another rank refused after this one started the engine's update
                _attempt(lambda: engine.abort(version, reason))
            raise MconvError(f"weight sync {shown} refused before any bucket was sent: {reason}")
        failure = _buckets(rounds=rounds, prepared=prepared, engine=engine, version=version, result=result,
                           sums=sums)
        reason = _shared(failure) if _any(failure) else None
        if reason is not None:
            aborted = _attempt(lambda: engine.abort(version, reason)) if first else None
            told = _shared(aborted)  # every rank says so, not rank 0 alone
            if told is not None:
                reason += f" (and telling the engine failed: {told})"
            raise MconvError(f"weight sync {shown} failed; its update was aborted: {reason}")
        finished = _attempt(lambda: engine.finish(version)) if first else None
        if _any(finished):
            raise MconvError(f"weight sync {shown}: the engine did not finish it: {_shared(finished)}")
        if verify:
            sent = _gathered(sums)
            differ = _attempt(lambda: _compare(engine, sent)) if first else None
            if _any(differ):
                raise MconvError(f"weight sync {shown} is not verified: {_shared(differ)}")
    except KeyboardInterrupt:
        if started:  # the engine's update ends now, not at its receiver's timeout
            _attempt(lambda: engine.abort(version, "the trainer was interrupted"))
        raise
    except _Lost as lost:
        if started:
            _attempt(lambda: engine.abort(version, f"a trainer rank was lost: {lost}"))
        raise MconvError(f"weight sync {shown} failed: a trainer rank was lost mid-sync ({lost}); the engine's "
                         "update was aborted (by rank 0, or by the receiver when rank 0's connection closed)") from None
    return result


def _shown(version) -> str:
    """The version as error messages name it (quoted where it is not one: _check_version)."""
    if not isinstance(version, str):
        return repr(version)[:60]
    return version if version and len(version) <= 200 and version.isprintable() else repr(version[:60])


def _check_version(version) -> None:
    """MconvError for a version engines cannot carry: not a str (sync_weights has made an int one),
    empty, over 200 characters, or holding control characters (it goes into engines' logs, HTTP
    requests and `receiver.version`)."""
    if not isinstance(version, str):
        raise MconvError(f"version={_shown(version)} ({type(version).__name__}) is not a version: give a str (a "
                         "checkpoint name) or an int (a training step)")
    if _shown(version) != version:
        raise MconvError(f"version={version[:60]!r} is not a version: give a non-empty string of at most 200 "
                         "printable characters (a training step, a checkpoint name)")
    if version.startswith("failed:"):
        raise MconvError(f"version={version[:60]!r}: a receiver marks a failed update so (its `version`); give "
                         "another")


def _buckets(rounds, prepared, engine, version, result, sums) -> Exception | None:
    """The bucket rounds of one sync on this rank; returns this rank's first error (None if none)
    once the ranks have agreed that one failed, or after every round and the engine's last bucket.
    The buckets are iter_hf_weights' of the stage, the weights it quantizes last left to `_pack`."""
    schedule, sender, tied, quantization = (prepared[k] for k in ("schedule", "sender", "tied", "quantization"))
    buckets = _stage_buckets(prepared["live"], schedule, prepared["dtype"], quantization=quantization, deferred=True)

    def replanned(index: int) -> None:  # before bucket `index` reads a parameter (_prepared_for_sync)
        nonlocal buckets
        if prepared["unmoved"](index):
            return
        live, planned = _prepared(prepared["chunks"], prepared["config"], prepared["bucket_bytes"])
        cast = prepared["dtype"]
        if _bucket_layout(planned) != _bucket_layout(schedule):  # (the other ranks go on with the old buckets)
            raise MconvError("a parameter of the model was replaced by one of another dtype or shape since the last "
                             "sync: sync again (the next sync plans its buckets before it starts)")
        if sender:
            engine.check_device(_model_device(live))
            _agree_dtypes(engine, live, cast, quantization, tied)
        prepared.update(live=live, schedule=planned, unmoved=lambda _: True)
        buckets.close()
        buckets = _stage_buckets(live, planned[index:], cast, quantization=quantization, deferred=True)

    workers = ThreadPoolExecutor(1, thread_name_prefix="mconv-sync") if sender else None
    pending: list[Future] = []
    unchecked: list = []  # whether the FP8 weights written into the engine held inf or NaN: read after the last bucket
    failure = None
    flushed = failed = False  # flushed: told the engine what this sender wrote into its tensors (Engine.targets)
    try:
        for index in range(rounds):
            if index < len(schedule) and failure is None:
                failure = _attempt(lambda: _send(index, buckets, engine, sender, tied, version, pending, workers,
                                                 result, sums, quantization, prepared["live"], unchecked))
            if index + 1 < len(schedule) and failure is None:  # (bucket 0's: _prepared_for_sync)
                # before the ranks agree on this round: one that fails here stops them all before the
                # next bucket's collectives
                failure = _attempt(lambda: replanned(index + 1))
            if _any(failure):
                failed = True  # (on some rank)
                break
        if workers is not None:
            waited = time.perf_counter()
            failure = failure or next((e for e in (_attempt(f.result) for f in pending) if e is not None), None)
            if unchecked and not failed:  # (a weight held inf or NaN: the update is aborted, not finished)
                from mconv.converter.fp8_batch import check_pending

                failure = failure or _attempt(lambda: check_pending(unchecked))
            if failure is None and not failed:
                failure = _attempt(engine.flush)
                flushed = failure is None
            result.seconds["engine"] += time.perf_counter() - waited
    finally:
        buckets.close()
        if workers is not None:  # buckets still queued after a failure or an interrupt are not sent
            workers.shutdown(wait=True, cancel_futures=True)
            if not flushed:  # the writes queued land before the engine is told to abort
                _attempt(engine.discard)
    return failure


def _send(index, buckets, engine, sender, tied, version, pending, workers, result, sums, quantization, live,
          unchecked) -> None:
    """Gather bucket `index` (every rank of the stage takes part) and, on the sender, write it into
    the engine's tensors (Engine.targets) or pack it into slot index % 2 once the bucket that used
    that slot is loaded, and queue it for the engine. Whether its FP8 weights held inf or NaN
    (fp8_batch.quantize_batch's `pending`) is read on the worker before a packed bucket goes to
    the engine, and for a written one (in the engine's memory already) added to `unchecked`, read
    once after the last bucket."""
    started = time.perf_counter()
    named, picked, fixed = next(buckets)
    packed = time.perf_counter()
    result.seconds["gather"] += packed - started
    if not sender:
        return
    if len(pending) >= 2:
        pending[-2].result()  # the engine is done with this slot's previous bucket (raises its error)
    waited = time.perf_counter()
    device = named[0][1].device if named else torch.device("cpu")
    aliases = {LM_HEAD: EMBEDDING} if tied else None
    targets = engine.targets(device)
    done = None if targets is None else _write(engine, named, aliases, targets, device, fixed, live, picked,
                                               quantization, unchecked)
    checks: list = []  # a packed bucket's finite checks
    if done is not None:
        buffer, written, nbytes = done
        bucket = FlatBucket(version, index, buffer, [], written=written)
    else:
        entries, buffer = _pack(engine, index % 2, named, aliases, device, picked, quantization, checks)
        bucket, nbytes = FlatBucket(version, index, buffer, entries), buffer.numel()
    result.seconds["engine"] += waited - packed
    result.seconds["pack"] += time.perf_counter() - waited
    result.buckets += 1
    result.tensors += len(bucket.entries) + len(bucket.written)
    result.bytes += nbytes
    if buffer.is_cuda and not bucket.written:  # (written ones: Engine.flush waits for the writes)
        bucket.ready = torch.cuda.Event()
        bucket.ready.record(torch.cuda.current_stream(buffer.device))
    if sums is not None:
        # the tensors copied from, and the FP8 weights quantized again apart from the bucket's (fp8.quantize_picked:
        # a weight quantized to the wrong place differs); a packed bucket without them: its views
        sums.update(checksums(_sent(named, picked, quantization, aliases) if bucket.written or picked
                              else list(bucket)))
    pending.append(workers.submit(_deliver, engine, bucket, checks))


def _deliver(engine, bucket: FlatBucket, checks: list) -> None:
    """engine.update(bucket), on the sync's worker thread; where the bucket holds FP8 weights
    quantized into it, once its quantization is done and none held inf or NaN (MconvError naming
    it: the engine never gets the bucket)."""
    if checks:
        from mconv.converter.fp8_batch import check_pending

        check_pending(checks)
    engine.update(bucket)


def _is_sender(live) -> bool:
    from megatron.core import parallel_state as ps

    return (live.rank.tp == 0 and live.rank.ep == 0 and live.rank.etp == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0)


class _Lost(Exception):
    """A collective of the sync failed: the process group lost a rank (its message: torch's)."""


def _collective(fn):
    def wrapped(*args):
        try:
            return fn(*args)
        except MconvError:
            raise
        except RuntimeError as e:  # (torch.distributed's errors: DistError and its kinds; a bug's other errors
            # are not a lost rank, and go up as they are)
            raise _Lost(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from e
    wrapped.__doc__ = fn.__doc__
    return wrapped


@_collective
def _any(failure: Exception | None) -> bool:
    """A collective: whether any rank has failed (alone, no collective: with NCCL its flag's `item()`
    waited for all the work queued on the GPU, once per bucket)."""
    if dist.get_world_size() == 1:
        return failure is not None
    flag = torch.tensor([failure is not None], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@_collective
def _started(refused: Exception | None, rounds: int, arguments: int) -> tuple[int, str | None]:
    """A collective: (the number of bucket rounds, the largest stage's; what holds the sync back:
    None, "refused" if any rank refused, or "arguments" if the ranks' `arguments` (a digest of what
    shapes the buckets) differ: their collectives would not line up, and gloo aborts the process on
    such a mismatch)."""
    if dist.get_world_size() == 1:
        return rounds, "refused" if refused is not None else None
    flags = torch.tensor([refused is not None, rounds, arguments, -arguments], dtype=torch.int64,
                         device=_collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the digests differ where their max is not minus the min
    return int(flags[1]), "refused" if flags[0] else "arguments" if flags[2] != -flags[3] else None


@_collective
def _gathered(sums: dict) -> dict:
    """A collective: every sender's {name: checksum}, merged."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sums)
    return {name: value for part in parts for name, value in part.items()}


def _compare(engine, sent: dict[str, int]) -> None:
    try:
        held = engine.checksums(sorted(sent))
    except MconvError:
        raise
    except Exception as e:
        raise MconvError(f"reading the engine's checksums back failed: {type(e).__name__}: {e}") from None
    if not isinstance(held, dict):
        raise MconvError(f"the engine's checksums() returned {type(held).__name__}, not a dict of name -> checksum; "
                         "nothing was compared")
    differ = sorted(name for name, value in sent.items() if held.get(name) != value)
    if differ:
        raise MconvError(f"the engine holds other bytes than were sent for {', '.join(differ[:5])}"
                         + (" ..." if len(differ) > 5 else "") + f" ({len(differ)} of {len(sent)} tensors)")


@_collective
def _shared(failure: Exception | None) -> str | None:
    """A collective: the first failing rank's error as one line ("rank R: ..."), on every rank."""
    mine = None if failure is None else (str(failure) if isinstance(failure, MconvError)
                                         else f"{type(failure).__name__}: {failure}")
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    return next((f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None), None)
