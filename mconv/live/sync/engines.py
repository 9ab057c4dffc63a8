"""What `sync_weights` talks to: the Engine protocol (an adapter per inference engine), the flat
bucket it hands over, and the adapter for a plain callable."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import os
import threading
import weakref
from multiprocessing import AuthenticationError

import torch
import torch.distributed as dist

from mconv.errors import MconvError
from mconv.transport import shm
from mconv.transport.flat import Entry, dtype_of, unpack


@dataclass
class FlatBucket:
    """One bucket of a sync: `buffer` (1-D uint8) holds every tensor at its entry's offset (offsets
    aligned to each dtype). Iterating yields (HF name, view of `buffer`), valid until the engine call
    that received the bucket returns (the buffer is then reused), then the `written` pairs (an
    engine with `targets`: its own tensors, written already)."""

    version: str
    index: int
    buffer: torch.Tensor
    entries: list[Entry]
    # On a GPU, recorded on the packing stream after the bucket's copies: waiting on it (not on the
    # whole device) lets the next bucket's packing go on meanwhile. None: no event (a bucket made by
    # hand, or one `written` only, whose writes Engine.flush waits for): `wait` then waits for the
    # buffer's whole GPU, on whichever stream packed it.
    ready: "torch.cuda.Event | None" = None
    # For an engine whose parameters this process writes itself (`Engine.targets`): the (HF name,
    # engine parameter) pairs the sync copied straight into them, not packed into `buffer`.
    written: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def wait(self) -> None:
        """Return once the bucket's bytes are in `buffer`."""
        if self.ready is not None:
            self.ready.synchronize()
        elif self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every tensor of the bucket: views of `buffer`, then `written`."""
        return iter(unpack(self.buffer, self.entries) + self.written)

    @property
    def nbytes(self) -> int:
        """The bytes of the bucket's tensors, packed and written."""
        return self.buffer.numel() + sum(t.nbytes for _, t in self.written)


class Engine:
    """An inference engine as `sync_weights` drives it. On global rank 0: `expected()` (before
    anything is sent), `start(version)` (`start(version, verify=True)` when the sync verifies),
    then `finish(version)` once every rank's buckets were taken, or `abort(version, reason)` when
    any rank failed (never `finish` then), and with verify `checksums(names)`. On each sender rank
    (TP/EP/ETP/DP rank 0 of every pipeline stage): `check_device(device)` and `dtypes()` (before
    anything is sent, rank 0 included), then `buffer(slot, nbytes, device)` and `update(bucket)`,
    from one background thread, at most two buckets in flight (slots 0 and 1); rank 0 may be told
    `ask_expected()` first, as the sync begins; an engine whose
    parameters a sender can write itself says so by `targets`, and is then `flush`ed by each
    sender after its last bucket."""

    sends_tied_lm_head = False  # send lm_head.weight beside model.embed_tokens.weight for tied embeddings

    def __init__(self):
        self._buffers: dict[int, torch.Tensor] = {}

    def expected(self) -> dict[str, list[int]] | None:
        """{HF name: shape} of the engine's model, or None if the engine cannot tell. Returning the
        same dict object as at the last sync says the model is unchanged: the check is skipped."""
        return None

    def ask_expected(self) -> None:
        """On rank 0, as a sync begins, before its own planning: an engine whose `expected()` waits
        for another process may ask now, and read the answer when `expected()` is called (RemoteEngine
        does, on a connection already open: the trainer's planning then overlaps the receiver's
        answering). Nothing by default."""

    def dtypes(self) -> dict[str, torch.dtype] | None:
        """{HF name: dtype} in which the engine needs each tensor sent (an engine that copies the
        bytes into tensors of its own), or None (the default) where it casts what it is sent (vLLM,
        SGLang) or cannot tell. Asked on every sender rank before anything is sent: a tensor its
        stage would send in another dtype is an MconvError on every rank. Returning the same dict
        object as at the last sync says the engine is unchanged: the comparison is skipped."""
        return None

    def check_device(self, device: torch.device) -> None:
        """Raise MconvError if the engine cannot take buckets packed on `device` (the model's, on
        each sender rank): asked before the engine is told anything."""

    def start(self, version: str, verify: bool = False) -> None:
        """On rank 0, once every rank has planned and before any bucket is sent: begin the engine's
        update named `version` (the sync's version string), recording what it loads where `verify`
        (for `checksums`). An exception here stops the sync on every rank before anything is sent,
        with no `abort`. Nothing by default."""

    def targets(self, device: torch.device) -> dict[str, torch.Tensor] | None:
        """{HF name: the engine's own tensor}, for an engine whose parameters this process can write
        (another process's GPU memory mapped here: IPCEngine with a ParameterReceiver(direct=True)),
        or None (the default): buckets are packed into `buffer`s. With targets, a bucket is copied
        straight into them (one copy on the device, no buffer; FP8 weights quantized straight into
        their FP8 targets and scales where those are contiguous and the scales float: otherwise
        that bucket is packed) and handed to `update` as a FlatBucket with `written` only; `flush`
        follows the last one (`discard` where the sync failed).
        Asked per bucket on each sender: return the same dict while the engine is unchanged."""
        return None

    def flush(self) -> None:
        """On each sender, after its last bucket, when no rank failed: make the writes into `targets`
        complete and tell the engine which tensors they were."""

    def discard(self) -> None:
        """On each sender instead of `flush`, when the sync failed (on any rank) or was interrupted:
        let the writes already queued into `targets` finish and forget them, before rank 0 tells the
        engine to abort."""

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` for bucket slot 0 or 1, kept for the next buckets."""
        current = self._buffers.get(slot)
        if current is None or current.numel() < nbytes or current.device != device:
            self._buffers[slot] = current = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return current[:nbytes]

    def update(self, bucket: FlatBucket) -> None:
        """On each sender, from the sync's one background thread: load `bucket` (a FlatBucket: its
        tensors are views of the buffer `buffer(bucket.index % 2, ...)` returned, plus `written`;
        iterate it for (HF name, tensor)). Return once the engine no longer reads the bucket's
        buffer: the slot is packed again two buckets later. An exception fails the sync on every
        rank (rank 0 then calls `abort`, never `finish`). Every engine implements it."""
        raise NotImplementedError

    def _slot(self, buffers: dict, bucket: FlatBucket) -> int:
        """The slot of `buffers` ({slot: uint8 tensor}) whose memory holds `bucket` (packed into
        what `buffer(slot, ...)` returned). Raises ValueError for a bucket from elsewhere."""
        for slot, buffer in list(buffers.items()):  # (the packing thread may add a slot meanwhile)
            if buffer.data_ptr() == bucket.buffer.data_ptr():
                return slot
        raise ValueError(f"bucket {bucket.index} is not in a buffer this engine's buffer() gave")

    def finish(self, version: str) -> None:
        """On rank 0, once every sender's buckets were taken (`update` returned on every rank, and
        `flush` where there were `targets`): end the update `version`, so the engine serves the new
        weights (and drops what it cached of the old ones: vLLM's and SGLang's prefix caches). An
        exception fails the sync. Nothing by default."""

    def abort(self, version: str, reason: str) -> None:
        """On rank 0, instead of `finish`, when a rank failed, was lost or interrupted after `start`:
        end the update `version` as failed (`reason`: one line saying why), the engine's weights all
        old or reported as failed. An exception here is added to the sync's own error, which every
        rank raises either way. Nothing by default."""

    @property
    def verifiable(self) -> bool:
        """Whether `checksums` can read the engine's weights back (verify=True needs it)."""
        return type(self).checksums is not Engine.checksums

    def checksums(self, names: list[str]) -> dict[str, int]:
        """{name: mconv.transport.flat.checksums value of what the engine holds}, for `names` after
        a finished sync; a name it cannot read back is left out (verify reports it)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds for syncs (its bucket buffers); it is not used again."""
        self._buffers.clear()


class CallableEngine(Engine):
    """`engine=fn`: `fn(bucket)` on each sender rank, per bucket (a FlatBucket: iterate it for
    (name, tensor) views, or ship `bucket.buffer` and `bucket.entries` with your own transport).
    verify=True needs `checksums`: a function of a list of names returning {name:
    mconv.transport.flat.checksums value of what your engine holds}."""

    def __init__(self, fn: Callable[[FlatBucket], object],
                 checksums: Callable[[list[str]], dict[str, int]] | None = None):
        super().__init__()
        self.fn, self._checksums = fn, checksums

    def update(self, bucket: FlatBucket) -> None:
        bucket.wait()  # fn may run on another stream than the packing
        self.fn(bucket)

    @property
    def verifiable(self) -> bool:
        return self._checksums is not None

    def checksums(self, names: list[str]) -> dict[str, int]:
        return self._checksums(names)


_CONNECTING = 30.0  # seconds a connection and its handshake may take


class RemoteEngine(Engine):
    """An engine in another process that serves mconv's JSON requests (a
    mconv.transport.update_receiver.UpdateReceiver) on `address` (a Unix socket path or "host:port"),
    authenticated with `authkey` (bytes). Subclasses say how a bucket travels (`update`).

    Errors: MconvError, in one sentence, for an `address` that is no str or path or an `authkey`
    that is no bytes (here), nothing listening at the address, another key than the receiver's,
    and a request the receiver refused (naming the request and giving the receiver's error). A
    request unanswered within `timeout` seconds (connecting: 30 s at most) is a RuntimeError (and the
    connection is reopened at the next); a sync's first request on a connection an earlier sync
    left broken (the engine's process restarted) is sent once more on a new one."""

    route: str | None = None  # how its buckets reach a receiver that serves several ways (vLLM's Receiver)

    def __init__(self, address: str, authkey: bytes, timeout: float | None = 600.0):
        super().__init__()
        if not isinstance(address, (str, os.PathLike)):
            raise MconvError(f"address is a {type(address).__name__}; give the receiver's Unix socket path or "
                             "\"host:port\"")
        try:
            shm.check_authkey(authkey)
        except (TypeError, ValueError) as e:
            raise MconvError(f"{type(self).__name__}: {e}") from None
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or not timeout > 0):
            raise MconvError(f"{type(self).__name__}: timeout={timeout!r}; give the seconds to wait for the engine's "
                             "answers (a positive number) or None for no limit")
        self.address, self.authkey, self.timeout = os.fspath(address), authkey, timeout
        self._conn = None
        self._lock = threading.RLock()  # rank 0 talks from the caller's thread and the update thread
        # the receiver's model: its digest, {HF name: shape} and {HF name: dtype} (None: it casts)
        self._expected: tuple[str, dict, dict | None] | None = None
        # id(entries) -> (entries, its layout number); holding the list keeps its id from being reused
        self._layouts: dict[int, tuple[list, int]] = {}
        self._carried: dict = {}  # what this connection has carried (layout numbers; IPCEngine's shares)
        self._unanswered = False  # the last request timed out: the receiver hangs
        self._direct = False  # the receiver shares its parameters for the trainer to write (its `expected` reply)
        self._unread_dtypes = False  # expected() asked the receiver and dtypes() has not used the reply yet
        self._early: dict | None = None  # the `expected` request ask_expected sent, its reply unread

    def _connected(self) -> dict:
        """What the open connection has carried (the caller holds _lock); a new connection, and an
        empty record, where none is open. MconvError where nothing listens at the address or the
        receiver's key is another."""
        if self._conn is None:
            try:
                # (a receiver answers the handshake at once, busy or not: one that does not was made and
                # never started, or is no receiver)
                self._conn = shm.connect(self.address, self.authkey, min(self.timeout or _CONNECTING, _CONNECTING))
            except shm.Unreachable as e:
                raise MconvError(str(e)) from None
            except AuthenticationError:
                raise MconvError(f"the engine at {self.address} refused the connection: another authkey than its "
                                 "receiver's") from None
            self._carried = {}
        return self._carried

    def _request(self, message: dict) -> dict:
        with self._lock:
            if dist.is_initialized():
                message = {**message, "rank": dist.get_rank()}
            early, self._early = self._early, None  # a request sent ahead (ask_expected), its reply unread
            if early is not None and early != message:  # (a sync refused before it asked): that reply goes
                self._drop_connection()
                early = None
            if self._unanswered and message["op"] in ("update", "finish"):
                # A receiver that hangs holds a second request too: the sync fails now, not after
                # another timeout (its next "expected" or "start" tries the engine again).
                raise RuntimeError(f"the engine at {self.address}: {message['op']!r} not sent, an earlier request "
                                   f"of this update got no answer within {self.timeout:g} s")
            # A sync's first requests may find the connection of an earlier sync broken (the engine's
            # process restarted meanwhile): they are sent once more on a new connection.
            retry = message["op"] in ("expected", "start") and self._conn is not None
            while True:
                try:
                    self._connected()
                    reply = (shm.await_reply if early is not None else shm.request)(self._conn, message, self.timeout)
                    self._unanswered = False
                    return reply
                except shm.RemoteError as e:
                    self._unanswered = False
                    raise MconvError(f"the engine at {self.address} refused {message['op']!r}: {e}") from None
                except (TimeoutError, OSError, EOFError) as e:
                    self._drop_connection()
                    early = None
                    self._unanswered = isinstance(e, TimeoutError)
                    if retry and not isinstance(e, TimeoutError):
                        retry = False
                        continue
                    closed = isinstance(e, (EOFError, BrokenPipeError, ConnectionResetError))
                    raise RuntimeError(f"the engine at {self.address} did not answer {message['op']!r}: " + (
                        "the connection closed (its receiver was closed, or its process ended)" if closed
                        else str(e) if isinstance(e, TimeoutError) and str(e)  # (a sentence of shm's own)
                        else f"{type(e).__name__}: {e}")) from None
                except BaseException:  # (a KeyboardInterrupt): the reply would answer the next request instead
                    self._drop_connection()
                    raise

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None
        self._early = None  # (its reply went with the connection)
        self._carried = {}  # a new connection carries nothing over (IPCEngine's events: the receiver drops them)

    def _update(self, buffer: dict, entries: list[Entry], *more: tuple[dict, list[Entry]]) -> dict:
        """One `update` request for one bucket buffer ({"ipc": ...} or {"path": ...}), and the
        `more` (item, entries) pairs after it; its reply. A layout (the same entries list, as
        sync_weights reuses it) carries its entries once per connection, later only its number:
        the receiver keeps them (mconv.transport.receiver)."""
        numbers = []
        for _, listed in ((buffer, entries), *more):
            cached = self._layouts.get(id(listed))
            if cached is None:
                cached = self._layouts[id(listed)] = (listed, len(self._layouts))
            numbers.append(cached[1])
        with self._lock:  # the same connection from the request's sending to its marking
            carried = self._connected().setdefault("layouts", set())
            items = []
            for (item, listed), number in zip(((buffer, entries), *more), numbers):
                items.append({**item, "layout": number})
                if number not in carried:
                    items[-1]["entries"] = [e.to_json() for e in listed]
            reply = self._request({"op": "update", "buffers": items})
            carried.update(numbers)
            return reply

    def _expected_request(self) -> dict:
        message = {"op": "expected", "digest": self._expected and self._expected[0], "route": self.route}
        return {**message, "rank": dist.get_rank()} if dist.is_initialized() else message

    def ask_expected(self) -> None:
        """Send the `expected` request now; `expected()` reads its reply. Where the connection
        cannot send (or an earlier request went unanswered), nothing: `expected()` asks as ever."""
        with self._lock:
            if self._early is not None:  # a sync refused before it read the reply (an old answer): it goes
                try:
                    shm.await_reply(self._conn, self._early, 0)
                except shm.RemoteError:
                    pass
                except (TimeoutError, OSError, EOFError):  # (not there yet: the connection goes with it)
                    self._drop_connection()
                self._early = None
            if self._unanswered or self._conn is None:  # (connecting waits as long as the request: expected()'s)
                return
            message = self._expected_request()
            try:
                shm.send(self._conn, message)
            except (OSError, EOFError):
                self._drop_connection()
                return
            self._early = message

    def _model(self) -> tuple[str, dict, dict | None]:
        """The receiver's model (its digest, {HF name: shape}, {HF name: dtype} or None), asked anew
        at each call (one `expected` request, or the reply to the one ask_expected sent) and kept:
        while the receiver answers that its model is unchanged (the digest alone), the same dicts
        are returned."""
        reply = self._request(self._expected_request())
        if "tensors" in reply or self._expected is None:
            dtypes = reply.get("dtypes")
            try:
                dtypes = None if dtypes is None else {name: dtype_of(d) for name, d in dtypes.items()}
            except KeyError as e:
                name = next(n for n, d in reply["dtypes"].items() if d == e.args[0])
                raise MconvError(f"the engine at {self.address} holds {name} in {e.args[0]}, a dtype no bucket "
                                 "carries") from None
            self._expected = (reply["digest"], reply["tensors"], dtypes)
            self._direct = reply.get("direct") is not None
        return self._expected

    def expected(self) -> dict[str, list[int]]:
        model = self._model()
        self._unread_dtypes = True  # sync_weights asks dtypes() next, on rank 0: this reply answers it
        return model[1]

    def dtypes(self) -> dict[str, torch.dtype] | None:
        """The dtypes the receiver holds where it copies bytes into its own tensors
        (ParameterReceiver), None where it casts (vLLM's Receiver); from the reply to `expected()`
        where that came just before (rank 0), else asked (the other senders)."""
        if self._unread_dtypes:
            self._unread_dtypes = False
            return self._expected[2]
        return self._model()[2]

    def start(self, version: str, verify: bool = False) -> None:
        # (the digest of the model this sync checked: a receiver the trainer writes into fails the
        # update where its model is another by then)
        self._request({"op": "start", "version": version, "verify": verify, "route": self.route,
                       "digest": self._expected and self._expected[0]})

    def finish(self, version: str) -> None:
        self._request({"op": "finish", "version": version})

    def abort(self, version: str, reason: str) -> None:
        """Tell the receiver to abort update `version`. After a request that timed out, nothing is
        sent: its connection was closed, which aborts the update on the receiver's side as soon as
        it can notice, and a receiver that hangs would hold an abort for another `timeout`."""
        if self._unanswered:
            return
        self._request({"op": "abort", "version": version, "reason": reason})

    def checksums(self, names: list[str]) -> dict[str, int]:
        return self._request({"op": "checksums", "names": names})["checksums"]

    def close(self) -> None:
        super().close()
        self._drop_connection()
        self._carried = {}  # IPCEngine's shares hold their buffers


class SharedMemoryBuffers(Engine):
    """Bucket buffers as files in /dev/shm, for engines on this host whose processes map a bucket by
    its file's path: two per sender rank (grown as needed, removed by `close()`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._shared: dict[int, shm.SharedBuffer] = {}
        # A slot's buffer is replaced (grown) on the packing thread while the update thread looks up
        # the other slot's bucket among them (_path): a closed buffer has no tensor to compare.
        self._shared_lock = threading.Lock()

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        current = self._shared.get(slot)
        if current is None or current.nbytes < nbytes:
            grown = shm.SharedBuffer.create(nbytes)
            with self._shared_lock:
                self._shared[slot] = grown
                if current is not None:
                    current.close()
            current = grown
        return current.tensor[:nbytes]

    def _path(self, bucket: FlatBucket) -> str:
        """The file holding `bucket`."""
        with self._shared_lock:
            return self._shared[self._slot({s: b.tensor for s, b in self._shared.items()}, bucket)].path

    def close(self) -> None:
        for buffer in self._shared.values():
            buffer.close()
        self._shared.clear()
        super().close()


class SharedMemoryEngine(SharedMemoryBuffers, RemoteEngine):
    """An engine process on this host (mconv.transport.receiver.ParameterReceiver, or vLLM's
    Receiver) serving mconv's requests: each sender rank keeps two bucket buffers as files in
    /dev/shm (SharedMemoryBuffers), and a bucket crosses as its file's path and entries.
    `SharedMemoryEngine(address, authkey, timeout=600.0)`: as RemoteEngine."""

    def update(self, bucket: FlatBucket) -> None:
        self._update({"path": self._path(bucket)}, bucket.entries)


_CALLABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def as_engine(engine) -> Engine:
    """`engine` itself, or the CallableEngine of a callable: the same one for the same callable at
    every sync, so its buffers and bucket layouts are reused. MconvError saying what to pass for
    anything else (an address: which engine to make of it)."""
    if isinstance(engine, Engine):
        return engine
    if isinstance(engine, type):
        raise MconvError(f"engine is the class {engine.__name__}, not an engine: make one (e.g. "
                         f"{engine.__name__}(address, authkey)) and pass it")
    if callable(engine):
        try:
            return _CALLABLES.setdefault(engine, CallableEngine(engine))
        except TypeError:  # not weakly referenceable
            return CallableEngine(engine)
    if isinstance(engine, (str, os.PathLike)):
        address = os.fspath(engine)
        make = (f"VLLMServerEngine({address!r}) for a running vLLM server or SGLangEngine({address!r}) for SGLang"
                if address.startswith(("http://", "https://")) else
                f"SharedMemoryEngine({address!r}, authkey) for a ParameterReceiver on this host, "
                f"IPCEngine({address!r}, authkey) for one on this GPU, or VLLMEngine({address!r}, authkey) for "
                "vLLM's Receiver")
        raise MconvError(f"engine={address!r} is an address, not an engine: pass {make} (mconv.live.sync)")
    raise MconvError(f"engine is {'None' if engine is None else 'a ' + type(engine).__name__}: pass an "
                     "mconv.live.sync Engine (VLLMEngine, SharedMemoryEngine, IPCEngine, ...) or a callable taking "
                     "each FlatBucket")
