"""Colocated sync over CUDA IPC: `IPCEngine` hands each flat bucket's CUDA buffer to an engine's
process on the same GPU as one CUDA IPC handle (mconv.transport.cuda_ipc), whose receiver copies
the bucket's tensors into its own parameters before it replies. With `by_reference=True` the
tensors that are contiguous views of the model's parameters are not packed at all: the storages
holding them are shared once per connection, and the receiver copies straight out of them."""
from __future__ import annotations

import weakref

import torch

from mconv.errors import MconvError
from mconv.live.sync.engines import FlatBucket, RemoteEngine
from mconv.transport import cuda_ipc
from mconv.transport.flat import Entry, dtype_name

# Referenced tensors (no buffer: only a request's size) go in requests of at least this many bytes:
# few requests, while the receiver still copies as the trainer goes on exporting.
REFERENCE_REQUEST_BYTES = 4 << 30


class IPCEngine(RemoteEngine):
    """An engine process on this GPU serving `mconv.transport.receiver.ParameterReceiver(params,
    address, authkey)`. Buckets are packed on the model's CUDA device into two reused buffers;
    each buffer is shared once per connection as one IPC handle, which the receiver keeps mapped
    (until the buffer is replaced, then released, or the connection ends), and each bucket crosses
    as that handle and its entries; a buffer is reused only after the receiver has copied from it
    (its reply). Raises MconvError for a model that is not on CUDA.

    `by_reference=True`: the tensors that are contiguous views of the model's parameters (at TP1
    and EP1 all but the ones a dtype cast or FP8 quantization makes) are not packed: each storage
    holding parameters is shared once and kept mapped by the receiver, which copies those tensors
    straight out of it (one copy on the device instead of two), in requests of at least
    REFERENCE_REQUEST_BYTES. The storages are shared at a sync's first use and let go at its
    `finish` or `abort` (a storage stays allocated while another process maps it: the trainer may
    free or offload its parameters between syncs). Worth it where the parameters live in a few large
    storages (as Megatron's distributed optimizer keeps them, in its contiguous parameter buffers):
    one storage per parameter means one IPC handle each, at every sync. The model must not change
    until `sync_weights` returns (as ever).

    A subclass whose receiver maps the buffer anew at every bucket (vLLM's ipc backend) sets
    `keeps_shares = False`: each bucket is then shared afresh, one share for one mapping, as
    torch's reference counting of shared CUDA memory requires (cuda_ipc)."""

    keeps_shares = True

    def __init__(self, address: str, authkey: bytes, timeout: float | None = 600.0, by_reference: bool = False):
        super().__init__(address, authkey, timeout)
        self.by_reference = by_reference
        self._deferred: list[tuple[dict, list[Entry]]] = []  # referenced items not sent yet
        self._deferred_bytes = 0
        # ids of a bucket's referenced tensors -> (weak references to them, [(storage address, entries)]):
        # planned once, holding no tensor (the parameters may be freed or offloaded between syncs)
        self._reference_layouts: dict[tuple, tuple] = {}

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise MconvError(f"{type(self).__name__} needs the model on a CUDA device; it is on {device}")

    def update(self, bucket: FlatBucket) -> None:
        if not bucket.buffer.is_cuda:
            raise MconvError(f"IPCEngine needs the model on a CUDA device; bucket {bucket.index} is on "
                             f"{bucket.buffer.device}")
        bucket.wait()
        with self._lock:
            if bucket.references:
                self._defer(bucket.references)
            if bucket.entries:
                self._update_packed(bucket, self._take_deferred())
            elif self._deferred_bytes >= REFERENCE_REQUEST_BYTES:
                self._send_deferred()

    def finish(self, version: str) -> None:
        with self._lock:
            self._send_deferred()
            self._request({"op": "finish", "version": version, **self._release_references()})

    def abort(self, version: str, reason: str) -> None:
        with self._lock:
            self._deferred, self._deferred_bytes = [], 0
            if self._unanswered:  # (RemoteEngine.abort: the closed connection aborts it and drops its mappings)
                self._carried.pop("references", None)
                return
            self._request({"op": "abort", "version": version, "reason": reason, **self._release_references()})

    def _release_references(self) -> dict:
        """The request fields that let the receiver drop its mappings of the parameters' storages
        (made at this sync, let go at its end: a storage stays allocated while it is mapped)."""
        shares = self._carried.pop("references", {})
        return {"release": [cuda_ipc.key(share) for _, share in shares.values()]} if shares else {}

    def _defer(self, references: list) -> None:
        """Queue the items of a bucket's referenced tensors: one per storage, its entries' offsets
        into that storage (planned once per bucket: the export hands the same views every sync);
        each storage is shared at its first use in a sync."""
        key = tuple(id(t) for _, t in references)
        cached = self._reference_layouts.get(key)
        if cached is None or any(ref() is not t for ref, (_, t) in zip(cached[0], references)):
            groups: dict[int, list[Entry]] = {}
            for name, t in references:
                groups.setdefault(t.untyped_storage().data_ptr(), []).append(Entry(
                    name, dtype_name(t.dtype), tuple(t.shape), t.storage_offset() * t.element_size(), t.nbytes))
            cached = self._reference_layouts[key] = ([weakref.ref(t) for _, t in references], list(groups.items()))
        shares = self._connected().setdefault("references", {})  # storage address -> (whole storage, its share)
        first = {t.untyped_storage().data_ptr(): t for _, t in references}
        for address, entries in cached[1]:
            if address not in shares:
                whole = torch.empty(0, dtype=torch.uint8, device=first[address].device).set_(
                    first[address].untyped_storage())
                shares[address] = (whole, cuda_ipc.share(whole))
            self._deferred.append(({"kept": True, "ipc": shares[address][1]}, entries))
            self._deferred_bytes += sum(e.nbytes for e in entries)

    def _take_deferred(self) -> list:
        taken, self._deferred, self._deferred_bytes = self._deferred, [], 0
        return taken

    def _send_deferred(self) -> None:
        taken = self._take_deferred()
        if taken:
            torch.cuda.synchronize(taken[0][0]["ipc"]["device"])  # the parameters' last writes are done
            self._update(*taken[-1], before=taken[:-1])

    def _update_packed(self, bucket: FlatBucket, before: list) -> None:
        slot = self._slot(self._buffers, bucket)
        if not self.keeps_shares:
            self._update({"ipc": cuda_ipc.share(bucket.buffer)}, bucket.entries, before)
            return
        buffer = self._buffers[slot]
        # A share is made once per connection and buffer: sharing again at each bucket cost the
        # receiver a mapping (a reference count released) and the sender an event per request.
        carried = self._connected()
        shares = carried.setdefault("ipc", {})  # slot -> (buffer, its share)
        # Keys of replaced (grown) buffers' shares, named in every request until one is answered:
        # a request the receiver refuses (an aborted update) must not lose a release.
        released = carried.setdefault("release", [])
        held = shares.get(slot)
        if held is not None and held[0] is not buffer:
            released.append(cuda_ipc.key(held[1]))
            held = None
        if held is None:
            held = shares[slot] = (buffer, cuda_ipc.share(buffer))
        item = {"kept": True, "ipc": held[1]}
        if released:
            item["release"] = list(released)
        self._update(item, bucket.entries, before)
        released.clear()

    def close(self) -> None:
        super().close()
        self._deferred, self._deferred_bytes = [], 0
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees the shared buffers the receiver has let go of
