"""The engine's side of a weight sync, whatever the engine: `UpdateReceiver` serves a trainer's
requests (JSON over mconv.transport.shm) and keeps the update session safe (one update at a time,
`lock` held from `start` to `finish` / `abort`, an update whose trainer disappears is aborted).
Subclasses say what an engine does at each step: receiver.ParameterReceiver for an engine whose
process owns its parameters, vllm_receiver.Receiver for vLLM. Imports torch only, not megatron-core.

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
import threading
import time

import torch

from mconv.transport import shm
from mconv.transport.flat import dtype_name

DEFAULT_TIMEOUT = 600.0


class UpdateReceiver:
    """Serves a trainer's weight syncs on `address` (a Unix socket path or "host:port"),
    authenticated with `authkey` (bytes: TypeError otherwise; ValueError if empty); subclasses say
    what an engine does at each step (`expected`, `dtypes`, `changed`, `begin`, `load`, `complete`,
    `abandon`, `held_checksums`). An address it cannot listen at is an OSError in one sentence.

    An update in progress is aborted (`version` becomes "failed:<version>", `failure` says why,
    `lock` is released) when a connection that took part in it closes before `finish` (a trainer
    rank died, or `close()` ended it) or when no request comes for `timeout` seconds (a trainer
    rank hangs). `version` stays as it was where the update is aborted before any bucket reached
    an engine whose weights change only as buckets are loaded (`weights_change_only_in_load`): its
    weights are still that version's."""

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
        self._loaded = False  # whether an `update` request came in this session
        self._failed: str | None = None  # the version of the last update aborted here
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
                self._loaded = False
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
                if op == "abort" and self._failed == message.get("version"):
                    return {"version": self.version}  # aborted here already (its trainer was told why)
                raise RuntimeError(f"{op} without a weight update in progress"
                                   + (f" (the last one was aborted: {self.failure})" if self.failure else ""))
            self._peers.add(id(peer))
            self._last = time.monotonic()
            if op == "update":
                self._loaded = True
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
    weights_change_only_in_load = False  # an update that loaded nothing leaves the weights as they were

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
            if self._loaded or not self.weights_change_only_in_load:  # (else the weights are still self.version's)
                self.version = f"failed:{self._session}"
            self._failed, self.failure = self._session, reason
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
