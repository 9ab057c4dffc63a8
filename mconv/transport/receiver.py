"""The receiver of an engine whose process owns its parameters as {HF name: tensor}, on a GPU
(CUDA IPC buckets) or on the CPU (shared-memory buckets): `ParameterReceiver` maps the buckets a
trainer sends, copies them into the parameters and, with `direct=True`, shares its parameters for
the trainer to write into itself; `checkpoint_shapes` reads a checkpoint's {HF name: shape}. The
requests and the update session's safety (`lock`, aborts) are update_receiver.UpdateReceiver's.
Imports torch only, not megatron-core.

    from mconv.transport.receiver import ParameterReceiver
    receiver = ParameterReceiver(params, "/tmp/engine.sock", authkey=b"...")  # {HF name: tensor}
    receiver.start()              # threads; the trainer syncs with IPCEngine or SharedMemoryEngine
    with receiver.lock:           # generation never sees a half-updated model
        ...
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from pathlib import Path

import torch

from mconv.transport import cuda_ipc, shm
from mconv.transport.copies import CopyPlan
from mconv.transport.flat import Entry, checksums, unpack
# (UpdateReceiver and DEFAULT_TIMEOUT are imported from here too: vllm_receiver does)
from mconv.transport.update_receiver import DEFAULT_TIMEOUT, UpdateReceiver


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
        self.weights_change_only_in_load = not direct  # (direct: the trainer writes without a request)
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
