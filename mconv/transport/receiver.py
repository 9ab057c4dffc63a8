"""The engine's side of a weight sync, whatever the engine: `UpdateReceiver` serves a trainer's
requests (JSON over mconv.transport.shm) and keeps the update session safe (one update at a time,
`lock` held from `start` to `finish` / `abort`, an update whose trainer disappears is aborted);
`ParameterReceiver` is the receiver of an engine whose process owns its parameters as
{HF name: tensor}, on a GPU (CUDA IPC buckets) or on the CPU (shared-memory buckets). Imports
torch only, not megatron-core.

    from mconv.transport.receiver import ParameterReceiver
    receiver = ParameterReceiver(params, "/tmp/engine.sock", authkey=b"...")  # {HF name: tensor}
    receiver.start()              # threads; the trainer syncs with IPCEngine or SharedMemoryEngine
    with receiver.lock:           # generation never sees a half-updated model
        ...

Requests: `expected` ({"digest", "route"} -> the model's {HF name: shape} as that route sends it,
"tensors", and, from an engine that copies bytes and needs each tensor in its own dtype
(ParameterReceiver), {HF name: dtype name} as "dtypes"; sent only when the trainer's digest of them is
not current), `start` {"version"}, `update`
{"buffers": [{"ipc": cuda_ipc.share(...) | "path": shared-memory file, "entries": [Entry.to_json()],
"layout": n}]} (a bucket layout's entries travel once per connection: later buckets with the same
layout carry only its number `n`; a
receiver's `load` sees "entries" filled in and "layout" as a digest of them; an "ipc" item with
"kept": true names a share the trainer made once for this connection: its mapping is kept until an
item's "release" [cuda_ipc.key] names it or the connection ends, and `load` sees "kept" as the
connection's dict of such mappings), `finish` {"version"}
(a kept item may say "ordered": the trainer waits for the reply's "done" IPC event [cuda_ipc.share_event]
before reusing the buffer, so the reply need not wait for the copies),
`abort` {"version", "reason"}, `checksums` {"names"} (flat.checksums of what the engine holds),
and, to a receiver that shares its parameters (its `expected` reply says "direct": true),
`parameters` {} -> {"storages": [cuda_ipc.share of a whole storage], "params": {HF name: [storage
index, byte offset]}}, after which a trainer writes into them itself and an `update` item
{"written": true} with a layout's entries names what it wrote. Every request may carry the
trainer's "rank", used to name it in errors.
"""
from __future__ import annotations

import hashlib
import json
import operator
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from mconv.transport import cuda_ipc, shm
from mconv.transport.copies import CopyPlan
from mconv.transport.flat import Entry, checksums, dtype_name, unpack

DEFAULT_TIMEOUT = 600.0


def checkpoint_shapes(model: str, revision: str | None = None, tied_lm_head: bool = False) -> dict[str, list[int]]:
    """{HF name: shape} of the checkpoint `model`, a local directory or a hub repository id (at
    `revision`): its safetensors headers, read without loading a tensor. With `tied_lm_head`,
    lm_head.weight beside model.embed_tokens.weight (engines that are sent both for tied
    embeddings). A checkpoint that cannot be read raises its library's error (OSError, ...), one
    without safetensors files FileNotFoundError."""
    from safetensors import safe_open

    if Path(model).is_dir():
        shapes = {}
        for path in sorted(Path(model).glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                shapes.update((name, list(f.get_slice(name).get_shape())) for name in f.keys())
    else:
        from huggingface_hub import get_safetensors_metadata

        metadata = get_safetensors_metadata(model, revision=revision)
        shapes = {name: list(info.shape) for file in metadata.files_metadata.values()
                  for name, info in file.tensors.items()}
    if not shapes:
        raise FileNotFoundError(f"{model} holds no *.safetensors files")
    if tied_lm_head and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


class UpdateReceiver:
    """Serves a trainer's weight syncs on `address` (a Unix socket path or "host:port"),
    authenticated with `authkey` (bytes: TypeError otherwise; ValueError if empty); subclasses say
    what an engine does at each step (`expected`, `dtypes`, `changed`, `begin`, `load`, `complete`,
    `abandon`, `held_checksums`). An address it cannot listen at is an OSError in one sentence.

    An update in progress is aborted (`version` becomes "failed:<version>", `failure` says why,
    `lock` is released) when a connection that took part in it closes before `finish` (a trainer
    rank died, or `close()` ended it) or when no request comes for `timeout` seconds (a trainer
    rank hangs)."""

    def __init__(self, address: str, authkey: bytes, timeout: float = DEFAULT_TIMEOUT):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: give the seconds an update may stay silent before it is aborted "
                             "(a positive number)")
        self.lock = threading.Lock()
        self.version: str | None = None
        self.failure: str | None = None
        self.timeout = timeout
        self._listener = shm.listen(address, authkey)
        self._mutex = threading.Lock()  # one request, or the watchdog's abort, at a time
        self._session: str | None = None  # the version being updated
        self._peers: set[int] = set()  # the connections that took part in it
        self._last = 0.0
        self._digests: dict[str | None, tuple[str, dict]] = {}  # route -> the model's digest and expected reply
        self._generation = 0  # how many times the model changed (`changed()`)
        self._unsettled: tuple | None = None  # an update started, changed() not asked since: (digest, route) (_settled)
        self._doomed: str | None = None  # why the update in progress fails at its next request (_settled)
        self._stopped = threading.Event()  # close() was called
        self._started = False  # start() was called

    def start(self) -> threading.Thread:
        """Accept trainer connections on a daemon thread, each served on its own thread, and watch
        for updates that went silent. RuntimeError where it was started already, or closed (make
        another receiver: a closed one's address is let go)."""
        if self._stopped.is_set() or self._started:
            raise RuntimeError("this receiver " + ("was closed: make another (at the same address if you like)"
                                                   if self._stopped.is_set() else "is serving already: start() once"))
        self._started = True
        threading.Thread(target=self._watch, daemon=True, name="mconv-receiver-watchdog").start()
        return self._listener.serve(self.handle, self._closed)

    def handle(self, message: dict, peer: dict | None = None) -> dict:
        """Answer one request (`peer`: the connection's own dict, which remembers its rank). After a
        `start`, `peer["then"]` is the check to run once the reply is sent (shm.serve does; where
        nothing runs it, the next request makes it first)."""
        peer = {} if peer is None else peer
        if message.get("rank") is not None:
            peer["rank"] = message["rank"]
        op = message["op"]
        if op == "expected":
            with self._mutex:
                self._settled()
                digest, model = self._model(message.get("route"))
            return {"digest": digest} if message.get("digest") == digest else {"digest": digest, **model}
        if op == "start":
            # Waits for generation, or for an update in progress to end; close() ends the wait.
            while not self.lock.acquire(timeout=0.2):
                if self._stopped.is_set():
                    raise RuntimeError("the receiver was closed: start it again, or sync to the one now at its address")
            with self._mutex:
                self._session, self._peers, self._last = str(message["version"]), {id(peer)}, time.monotonic()
                try:
                    self.begin(message)
                except BaseException:
                    self._end()
                    raise
                # Whether the model changed since the trainer's `expected` is asked once the reply is
                # sent (about 3 ms for 19k tensors: not on the trainer's way), or by the next request
                # first, whichever comes first (_settled).
                self._unsettled = (message.get("digest"), message.get("route"))
                peer["then"] = self._settle
            return {}
        with self._mutex:
            self._settled()
            if self._doomed is not None and op in ("update", "finish"):
                self._fail(self._doomed)
            if op == "checksums":
                return {"checksums": self.held_checksums(list(message["names"]))}
            if op == "parameters":
                if not self.shares_parameters:
                    raise RuntimeError("this receiver does not share its parameters (ParameterReceiver(..., "
                                       "direct=True) does)")
                # the model the places are of: the trainer refuses them if it checked another
                return {"digest": self._model(message.get("route"))[0], **self.shared_parameters(peer)}
            if self._session is None:
                if op == "abort" and self.version == f"failed:{message.get('version')}":
                    return {"version": self.version}  # aborted here already (its trainer was told why)
                raise RuntimeError(f"{op} without a weight update in progress"
                                   + (f" (the last one was aborted: {self.failure})" if self.failure else ""))
            self._peers.add(id(peer))
            self._last = time.monotonic()
            if op == "update":
                reply = self.load(_with_entries(message["buffers"], peer))
                self._last = time.monotonic()  # the timeout counts the trainer's silence, not our loading
                return reply or {}
            if op == "finish":
                try:
                    self.complete(message)
                except BaseException as e:
                    self._fail(f"{type(e).__name__}: {e}")
                    raise
                self.version, self.failure = self._session, None
                self._end()
            elif op == "abort":
                self._fail(str(message["reason"]))
            else:
                raise ValueError(f"unknown request {json.dumps(op)}")
            return {"version": self.version}

    def _settle(self) -> None:
        """`start`'s work after its reply (shm.serve's `then`): _settled; what it raises fails the update."""
        with self._mutex:
            try:
                self._settled()
            except Exception as e:
                if self._session is not None:
                    self._fail(f"{type(e).__name__}: {e}")

    def _settled(self) -> None:
        """After a `start`, once (the caller holds _mutex): `changed()` (the copy plans made anew before
        the first bucket is loaded where it did). A receiver that shares its parameters dooms the
        update where its model is no longer the one the trainer checked (the digest `start` carries,
        or a change noticed now): the trainer writes into the storages it mapped for that one. The
        update fails at the trainer's next request (its writes are done by then: it keeps `lock`
        until they are)."""
        if self._unsettled is None:
            return
        (digest, route), self._unsettled = self._unsettled, None
        generation = self._generation
        self._noticed()
        if self._session is None or not self.shares_parameters:
            return
        described = self._digests.get(route)
        if self._generation != generation or (digest is not None and (described is None or described[0] != digest)):
            self._doomed = (f"the engine's model changed (a parameter replaced, moved, added or removed) after the "
                            f"trainer checked it, before update {self._session} began: sync again")

    def _noticed(self) -> None:
        """Ask `changed()`; if the model changed, it is described anew (the caller holds _mutex)."""
        if self.changed():
            self._digests.clear()
            self._generation += 1

    def _model(self, route: str | None) -> tuple[str, dict]:
        """The model's digest and `expected` reply for `route`, described anew where it changed (the
        caller holds _mutex). A receiver that shares its parameters says so ("direct") with a number
        that grows at every change, so that a trainer maps them again even when the names, shapes
        and dtypes stay the same (a parameter replaced by another of its kind, or moved)."""
        self._noticed()
        if route not in self._digests:
            model = {"tensors": {name: [int(n) for n in shape] for name, shape in self.expected(route).items()}}
            dtypes = self.dtypes(route)
            if dtypes is not None:
                model["dtypes"] = {name: dtype_name(dtype) for name, dtype in dtypes.items()}
            if self.shares_parameters:
                model["direct"] = self._generation
            self._digests[route] = (hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest(), model)
        return self._digests[route]

    # What an engine does; ParameterReceiver and vllm_receiver.Receiver fill these in.
    def expected(self, route: str | None = None) -> dict[str, list[int]]:
        """{HF name: shape} of the engine's model as a trainer using `route` (named in its `expected`
        request, where the engine serves several) sends it (asked once per route; the model must not
        change after)."""
        raise NotImplementedError

    def changed(self) -> bool:
        """Whether the engine's model changed since this was last asked, which makes it described
        anew (`expected`, `dtypes`); asked at each `expected` request, and once an update has
        started (a change then fails it where the trainer writes the parameters itself). False (the
        default): an engine whose model never changes."""
        return False

    def dtypes(self, route: str | None = None) -> dict[str, torch.dtype] | None:
        """{HF name: dtype} each tensor must arrive in, for an engine that copies the bytes sent into
        its own tensors (ParameterReceiver); None (the default) for one whose loader casts what it is
        sent (vLLM). Asked with `expected`, once per route; the trainer refuses a sync that would
        send another dtype before any bucket."""
        return None

    shares_parameters = False  # answers "parameters": the trainer writes into them itself (ParameterReceiver)

    def shared_parameters(self, peer: dict) -> dict:
        """The `parameters` request's reply, for a receiver that `shares_parameters`."""
        raise NotImplementedError

    def begin(self, message: dict) -> None:
        """An update starts: the `start` request ({"version", "verify": the trainer will ask for
        checksums after it, and whatever an engine's adapter adds})."""

    def load(self, buffers: list[dict]) -> dict | None:
        """Take one `update` request's buffers; what it returns (if anything) is the reply."""
        raise NotImplementedError

    def complete(self, message: dict) -> None:
        pass

    def abandon(self, version: str, reason: str) -> None:
        pass

    def held_checksums(self, names: list[str]) -> dict[str, int]:
        """{name: flat.checksum of what the engine holds} for the names it can read back."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop serving: no connection is accepted any more and the open ones are ended (an update
        in progress is aborted, as when its trainer disappears), so that a trainer's next request
        fails and its engine connects anew to whatever listens at the address then, never to this
        receiver. Returns once no request is being handled (one in progress is answered first)."""
        self._stopped.set()
        self._listener.close()

    def _fail(self, reason: str) -> None:
        """Abort the update in progress (the caller holds _mutex)."""
        try:
            self.abandon(self._session, reason)
        finally:
            self.version, self.failure = f"failed:{self._session}", reason
            self._end()

    def _end(self) -> None:
        self._session, self._peers, self._doomed = None, set(), None
        self.lock.release()

    def forget(self, kept: dict) -> None:
        """A connection ended: `kept` holds the mappings it asked to keep ("kept" items), which go."""

    def _closed(self, peer: dict) -> None:
        with self._mutex:
            self.forget(peer.get("kept", {}))
            if self._session is not None and id(peer) in self._peers:
                rank = "" if peer.get("rank") is None else f" (trainer rank {peer['rank']})"
                self._fail(f"the receiver was closed in the middle of update {self._session}" if self._stopped.is_set()
                           else f"the trainer's connection{rank} closed in the middle of update {self._session}")

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout / 4)):
            with self._mutex:
                if self._session is not None and time.monotonic() - self._last > self.timeout:
                    try:
                        self._fail(f"no request from the trainer for {self.timeout:g} s in the middle of update "
                                   f"{self._session}")
                    except Exception:
                        pass  # the update has ended as failed whatever the engine said; keep watching


def _check_params(params) -> None:
    """TypeError, in one sentence, for `params` that are no dict of HF name (str) -> tensor, hold a
    tensor on the meta device (nothing to write into) or two names at one address (one would hold
    the other's bytes)."""
    if not isinstance(params, dict):
        raise TypeError(f"params: give a dict of HF name (str) -> the engine's tensor, not {type(params).__name__}")
    named: dict[int, str] = {}
    for name, t in params.items():
        if not (isinstance(name, str) and isinstance(t, torch.Tensor)):
            raise TypeError(f"params: give a dict of HF name (str) -> the engine's tensor, not one with {name!r} -> "
                            f"{type(t).__name__}")
        if t.is_meta:
            raise TypeError(f"params: {name} is on the meta device (no memory to write into): give allocated tensors")
        if t.numel() and named.setdefault(t.data_ptr(), name) != name:
            raise TypeError(f"params: {named[t.data_ptr()]} and {name} lie at one address (one would hold the "
                            "other's bytes): give each name its own tensor")


def _check_shareable(params: dict[str, torch.Tensor]) -> None:
    """ValueError naming a parameter that is not a contiguous CUDA tensor (`direct=True` needs them all)."""
    for name, t in params.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"parameter {name} is a {type(t).__name__}, not a tensor")
        if not t.is_cuda or not t.is_contiguous():
            where = f"on {t.device}" if not t.is_cuda else "not contiguous"
            raise ValueError(f"direct=True: parameter {name} is {where}; a trainer writes only into contiguous CUDA "
                             "parameters")


def _done_key(share: str) -> str:
    """Where a connection's `kept` dict holds the "done" IPC event of the share keyed `share`."""
    return f"done:{share}"


def _with_entries(buffers: list[dict], peer: dict) -> list[dict]:
    """`buffers` with every item's "entries" filled in from the layouts this connection sent before,
    "kept" (if true) replaced by the connection's dict of kept mappings, and its "layout" replaced
    by a digest of those entries (computed once per layout and connection):
    the same layout gets the same key on any connection, so a receiver's plans keyed by it do not
    pile up as trainers reconnect. Raises ValueError for a layout number never sent."""
    known = peer.setdefault("layouts", {})  # number -> (entries, digest)
    out = []
    for item in buffers:
        number = item.get("layout")
        if number is None or "entries" in item:
            entries = item["entries"]
            known_entry = (entries, hashlib.sha256(json.dumps(entries).encode()).hexdigest())
            if number is not None:
                known[number] = known_entry
        elif number in known:
            known_entry = known[number]
        else:
            raise ValueError(f"bucket layout {number} was never sent on this connection")
        out.append({**item, "entries": known_entry[0], "layout": known_entry[1]})
        if item.get("kept"):
            out[-1]["kept"] = peer.setdefault("kept", {})
    return out


class ParameterReceiver(UpdateReceiver):
    """The receiver of an engine that owns `params` ({HF name: tensor}, preallocated, as an engine's
    model does; all on one CUDA device, or on the CPU): each bucket entry is copied into its
    parameter as bytes (same dtype and shape, else the update fails naming it; the trainer, told the
    names, shapes and dtypes by `expected`, refuses such a sync before any bucket); `finish` fails if
    a parameter got nothing since `start`; `held_checksums` reads the parameters back. `authkey`
    must be bytes (TypeError otherwise, as for UpdateReceiver).

    A bucket arrives as one CUDA IPC handle (from IPCEngine) or one shared-memory file (from
    SharedMemoryEngine). IPCEngine shares each of its two reused buffers once per connection
    ("kept"): those are mapped once and stay mapped until released or the connection ends. Of other
    buffers the two most recent mappings stay open (a handle shared anew at each request is
    rebuilt each time, from torch's cache). Each (mapping, layout) pair's copy plan is built once:
    a later sync of the same model is one batched copy per bucket on a GPU (copies.CopyPlan). The
    receiver replies once its copies finished; to IPCEngine's "ordered" items, once they are queued,
    with the handle of an IPC event recorded after them ("done"), which the trainer waits for before
    it reuses the buffer. `finish` is answered, and a mapping released, only once every copy is
    done.

    `params` may change between syncs, not during one: an entry replaced, added or removed, or a
    parameter given another storage (`param.data = ...`), is noticed at the next sync's first
    request (`changed`): the trainer is told the new names, shapes and dtypes (and refuses a sync
    that no longer fits before any bucket), and the copy plans are made anew from the dict (also for
    a change between that request and the update's `start`, asked once `start` is answered, before
    anything else; with `direct=True` such a change fails the update).

    `direct=True` (TypeError for a non-bool): the receiver shares its parameters' storages with
    each trainer connection (`shared_parameters`; every parameter a contiguous CUDA tensor), and
    IPCEngine then copies the buckets straight into them, one device copy instead of two, naming
    what it wrote after its copies finished; `finish` fails as ever if a parameter got nothing.
    The trainer then writes into this process's memory itself: the receiver's lock and abort no
    longer fence those writes (docs/weight-sync.md, "Written straight into the engine's
    parameters")."""

    def __init__(self, params: dict[str, torch.Tensor], address: str, authkey: bytes,
                 timeout: float = DEFAULT_TIMEOUT, direct: bool = False):
        if not isinstance(direct, bool):
            raise TypeError(f"direct={direct!r}: give True or False")
        _check_params(params)
        if direct:  # (before listening)
            _check_shareable(params)
        super().__init__(address, authkey, timeout)
        self.params = params
        self.shares_parameters = direct
        self._cuda = any(t.is_cuda for t in params.values())
        self._received: set[str] = set()
        self._mapped: OrderedDict[str, object] = OrderedDict()  # key -> (tensor, SharedBuffer or None)
        self._plans: dict[tuple, tuple[list, list[str]]] = {}  # (mapping, start, stop, entries) -> plan
        self._written_names: dict[str, list[str]] = {}  # layout digest -> the names a trainer wrote (direct)
        self._seen = self._described()  # what `params` held when the plans and `expected` were made of it

    def expected(self, route: str | None = None) -> dict[str, list[int]]:
        if self.shares_parameters:  # params changed since: refused before the trainer starts an update
            _check_shareable(self.params)
        return {name: list(t.shape) for name, t in self.params.items()}

    def dtypes(self, route: str | None = None) -> dict[str, torch.dtype]:
        return {name: t.dtype for name, t in self.params.items()}

    def begin(self, message: dict) -> None:
        self._received = set()
        if self.shares_parameters and self._cuda:
            # The trainer's writes are ordered after nothing of this process's: the work the engine
            # queued reading its parameters (generation it did not wait for) ends first.
            torch.cuda.synchronize()

    def changed(self) -> bool:
        """Whether `params` holds other tensors, or other storages, than when last asked: if so the
        copy plans, which hold its tensors (and on a GPU their addresses), are dropped, to be made
        anew from the dict (checking each tensor's dtype and shape again). About 1.5 ms for 19k tensors:
        identities and addresses only, no tensor's metadata."""
        names, tensors, addresses = self._seen
        params = self.params
        if (len(params) == len(tensors) and all(map(operator.is_, params.values(), tensors))
                and list(map(torch.Tensor.data_ptr, tensors)) == addresses and list(params) == names):
            return False
        self._seen = self._described()
        self._plans.clear()  # (the mappings they copy out of stay)
        self._written_names.clear()
        self._cuda = any(t.is_cuda for t in params.values())
        return True

    def _described(self) -> tuple[list[str], list[torch.Tensor], list[int]]:
        """`params`' names, tensors and their addresses, for `changed` to compare."""
        tensors = list(self.params.values())
        return list(self.params), tensors, list(map(torch.Tensor.data_ptr, tensors))

    def load(self, buffers: list[dict]) -> dict | None:
        # every item a kept CUDA share from a trainer that orders by events: reply before the copies finish
        ordered = self._cuda and bool(buffers) and all(item.get("ipc") and item.get("kept") is not None
                                                       and item.get("ordered") for item in buffers)
        try:
            for item in buffers:
                if item.get("written"):  # a trainer that wrote these parameters itself (direct)
                    self._received.update(self._written(item["layout"], item["entries"]))
                    continue
                ipc = item.get("ipc")
                key = cuda_ipc.key(ipc) if ipc else item["path"]
                start, stop = (ipc["offset"], ipc["offset"] + ipc["numel"]) if ipc else (0, None)
                mapped = self._map(key, item)
                layout = item["layout"]  # a digest of the entries (_with_entries)
                plan = self._plans.get((key, start, stop, layout))
                if plan is None:
                    plan = self._plans[key, start, stop, layout] = self._plan(mapped[start:stop], [
                        Entry.from_json(e) for e in item["entries"]])
                plan[0].run()
                self._received.update(plan[1])
        except BaseException:
            if self._cuda:  # the trainer reuses the buffers once we reply, an error too
                torch.cuda.current_stream().synchronize()
            raise
        if not ordered:
            if self._cuda:
                torch.cuda.current_stream().synchronize()  # the sender reuses the buffer once we reply
            return None
        # The trainer waits for this event before it packs into the buffer again.
        kept, done = buffers[0]["kept"], _done_key(cuda_ipc.key(buffers[0]["ipc"]))
        if done not in kept:
            event = torch.cuda.Event(interprocess=True)
            event.record()
            kept[done] = (event, cuda_ipc.share_event(event))
        kept[done][0].record()
        return {"done": kept[done][1]}

    def shared_parameters(self, peer: dict) -> dict:
        """`direct=True`'s reply to a trainer's `parameters` request: {"storages": [cuda_ipc.share of
        a whole storage holding parameters], "params": {HF name: [index into storages, byte offset]}}.
        Each storage is shared once per connection (torch counts one reference per share, released
        when the trainer's one mapping of it goes) and held while a parameter lies in it. ValueError
        naming a parameter that is not a contiguous CUDA tensor (the trainer writes bytes)."""
        _check_shareable(self.params)
        shared = peer.setdefault("shared", {})  # storage address -> (the whole storage as uint8, its share)
        used, params = {}, {}
        for name, t in self.params.items():
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if address not in shared:
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                shared[address] = (whole, cuda_ipc.share(whole))
            index = used.setdefault(address, len(used))
            params[name] = [index, t.storage_offset() * t.element_size()]
        gone = [a for a in shared if a not in used]
        for address in gone:
            del shared[address]  # a storage no parameter lies in any more: the trainer lets its mapping go too
        if gone and self._cuda:
            torch.cuda.ipc_collect()  # frees those the trainer has let go of already
        return {"storages": [shared[address][1] for address in used], "params": params}


    def _written(self, layout: str, entries: list) -> list[str]:
        """The names of a `written` item's entries (its layout's digest: read and checked once per
        layout while `params` is unchanged). ValueError where this receiver does not share its
        parameters or a name is none of them."""
        if not self.shares_parameters:
            raise ValueError("the trainer says it wrote parameters itself, but this receiver does not share them "
                             "(ParameterReceiver(..., direct=True))")
        names = self._written_names.get(layout)
        if names is None:
            names = [Entry.from_json(e).name for e in entries]
            unknown = [name for name in names if name not in self.params]
            if unknown:
                raise ValueError(f"weight update tensor {unknown[0]} does not match the engine's model: no such "
                                 "parameter")
            self._written_names[layout] = names
        return names

    def complete(self, message: dict) -> None:
        if self._cuda:
            torch.cuda.current_stream().synchronize()  # the parameters are whole when `finish` is answered
        # (every name received is one of params': checked when its plan or written layout was made)
        missing = [] if len(self._received) == len(self.params) else sorted(set(self.params) - self._received)
        if missing:
            raise RuntimeError(f"weight update {message['version']} did not send {', '.join(missing[:3])}"
                               + (" ..." if len(missing) > 3 else ""))

    def held_checksums(self, names: list[str]) -> dict[str, int]:
        return checksums([(name, self.params[name]) for name in names if name in self.params])

    def close(self) -> None:
        super().close()
        self._plans.clear()  # views of the mappings
        for _, shared in self._mapped.values():
            if shared is not None:
                shared.close()
        self._mapped.clear()

    def forget(self, kept: dict) -> None:
        if self._cuda:
            torch.cuda.current_stream().synchronize()  # copies out of the mappings may still run
        for key in kept:
            self._drop_plans(key)
        kept.clear()
        if self._cuda and self.shares_parameters:
            torch.cuda.ipc_collect()  # the storages shared with the connection that ended, once it let them go

    def _drop_plans(self, key: str) -> None:
        self._plans = {k: v for k, v in self._plans.items() if k[0] != key}  # they hold views of its mapping

    def _map(self, key: str, item: dict) -> torch.Tensor:
        """The whole buffer `item` names (a CUDA storage or a shared-memory file), mapped once. A kept
        CUDA share is rebuilt once per connection. Another CUDA handle is rebuilt at every request
        even so: torch then finds the storage in its cache and releases the sender's reference count
        for that share (the sender's memory leaks otherwise)."""
        if "ipc" in item:
            whole = {**item["ipc"], "numel": item["ipc"]["size_bytes"], "offset": 0}  # the sender's whole storage
            kept = item.get("kept")
            if kept is not None:
                for old in item.get("release", ()):
                    if old in kept:
                        torch.cuda.current_stream().synchronize()  # copies out of it may still run
                        self._drop_plans(old)
                        kept.pop(old)
                        kept.pop(_done_key(old), None)
                if key not in kept:
                    kept[key] = cuda_ipc.attach(whole, torch.cuda.current_device())
                return kept[key]
            mapped = (cuda_ipc.attach(whole, torch.cuda.current_device()), None)
            if key in self._mapped:
                self._mapped.move_to_end(key)
                return self._mapped[key][0]
        elif key in self._mapped:
            self._mapped.move_to_end(key)
            return self._mapped[key][0]
        else:
            shared = shm.SharedBuffer.attach(item["path"])
            mapped = (shared.tensor, shared)
        self._mapped[key] = mapped
        while len(self._mapped) > 2:
            old, (_, shared) = self._mapped.popitem(last=False)
            self._drop_plans(old)
            if shared is not None:
                shared.close()
        return mapped[0]

    def _plan(self, storage: torch.Tensor, entries: list[Entry]) -> tuple[CopyPlan, list[str]]:
        pairs, names = [], []
        for name, view in unpack(storage, entries):
            target = self.params.get(name)
            if target is None or target.shape != view.shape or target.dtype != view.dtype:
                raise ValueError(f"weight update tensor {name} ({view.dtype} {list(view.shape)}) does not match the "
                                 f"engine's " + ("model: no such parameter" if target is None else
                                                 f"{target.dtype} {list(target.shape)}"))
            pairs.append((target, view))
            names.append(name)
        # (the sources: views of a mapping dropped with its plans; the destinations: params, whose plans
        # `changed` drops when a parameter moved, asked before an update's first bucket)
        return CopyPlan([dst for dst, _ in pairs], [src for _, src in pairs], fixed_sources=True,
                        fixed_destinations=True), names
