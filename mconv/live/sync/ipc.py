"""Colocated sync over CUDA IPC: `IPCEngine` hands each flat bucket's CUDA buffer to an engine's
process on the same GPU as one CUDA IPC handle (mconv.transport.cuda_ipc), whose receiver copies
the bucket's tensors into its own parameters; or, to a receiver that shares its parameters, writes
each bucket straight into them."""
from __future__ import annotations

import torch

from mconv.errors import MconvError
from mconv.live.sync.pack import _WRITES, forget_packing
from mconv.live.sync.engines import FlatBucket, RemoteEngine
from mconv.transport import cuda_ipc
from mconv.transport.flat import Entry, dtype_name


class IPCEngine(RemoteEngine):
    """An engine process on this GPU serving `mconv.transport.receiver.ParameterReceiver(params,
    address, authkey)`. Buckets are packed on the model's CUDA device into two reused buffers;
    each buffer is shared once per connection as one IPC handle, which the receiver keeps mapped
    (until the buffer is replaced, then released, or the connection ends), and each bucket crosses
    as that handle and its entries. Raises MconvError for a model that is not on CUDA.

    Each request says the trainer orders by events ("ordered"): the receiver then replies as soon
    as its copies are queued, with an IPC event recorded after them ("done"), and the trainer
    waits for that event (polling it from the host, for at most `timeout`) before it packs into
    that buffer again (`buffer`), while the receiver already takes the next bucket. A receiver
    that replies without an event has finished its copies when it replies (mconv.transport.cuda_ipc).

    To a receiver that shares its parameters (ParameterReceiver(..., direct=True)), buckets with no
    weight to quantize are not packed: `targets` maps the receiver's parameter storages (once per
    connection, again when its model changes), sync_weights copies each bucket straight into
    them, and `flush` names what was written in one request once those copies are done.

    A subclass whose receiver maps the buffer anew at every bucket (vLLM's ipc backend) sets
    `keeps_shares = False`: each bucket is then shared afresh, one share for one mapping, as
    torch's reference counting of shared CUDA memory requires (cuda_ipc)."""

    keeps_shares = True

    def __init__(self, address: str, authkey: bytes, timeout: float | None = 600.0):
        super().__init__(address, authkey, timeout)
        self._written: list[tuple[dict, list[Entry]]] = []  # this sync's `written` items, sent by flush
        self._written_device: torch.device | None = None
        self._written_entries: dict[int, tuple[list, list[Entry]]] = {}  # id(bucket.written) -> (it, its entries)

    def targets(self, device: torch.device) -> dict[str, torch.Tensor] | None:
        """The receiver's parameters mapped here, where it shares them (ParameterReceiver(...,
        direct=True)): each of its storages mapped once per connection, asked for again when its
        model changed (a new digest). None for a receiver that does not share them."""
        if not self._direct or self._expected is None:
            if _WRITES in self.__dict__:  # the receiver here now does not share them: let them go
                with self._lock:
                    forget_packing(self)
                    self._written_entries.clear()
            return None
        held = self._carried.get("targets")  # (without the lock, which a packed bucket's request holds)
        if held is not None and held[0] == self._expected[0]:
            return held[1]
        with self._lock:
            carried = self._connected()
            held = carried.get("targets")
            digest, shapes, dtypes = self._expected
            if held is None or held[0] != digest:
                if dtypes is None:
                    raise MconvError(f"the engine at {self.address} shares its parameters but not their dtypes")
                reply = self._request({"op": "parameters"})
                if reply.get("digest") != digest:  # the places are of another model than the one checked
                    raise MconvError(f"the engine at {self.address} changed its model after this sync checked it "
                                     "(parameters replaced mid-sync): sync again")
                mapped = carried.get("mapped", {})  # cuda_ipc.key -> the whole storage mapped here
                storages = [mapped.get(cuda_ipc.key(share)) for share in reply["storages"]]
                storages = [cuda_ipc.attach(share, device.index) if whole is None else whole
                            for share, whole in zip(reply["storages"], storages)]
                carried["mapped"] = {cuda_ipc.key(share): whole for share, whole in zip(reply["storages"], storages)}
                targets = {}
                for name, (index, offset) in reply["params"].items():
                    dtype, shape = dtypes[name], torch.Size(shapes[name])
                    nbytes = shape.numel() * dtype.itemsize
                    targets[name] = storages[index][offset:offset + nbytes].view(dtype).view(shape)
                held = carried["targets"] = (digest, targets)
                self._written_entries.clear()  # (they hold the old targets)
            return held[1]

    def flush(self) -> None:
        """After this sender's last bucket: wait for its copies into the receiver's parameters, then
        name them to the receiver (one request), which counts them as sent."""
        with self._lock:
            items, self._written = self._written, []
            if not items:
                return
            self._wait_for_writes()
            self._update(*items[0], *items[1:])

    def discard(self) -> None:
        """A sync that failed: wait for the copies already queued into the receiver's parameters (they
        land before rank 0 tells the receiver to abort), and forget what they wrote."""
        with self._lock:
            items, self._written = self._written, []
            if items:
                self._wait_for_writes()

    def _wait_for_writes(self) -> None:
        """Return once this process's copies into the receiver's parameters have finished."""
        if self._written_device is not None and self._written_device.type == "cuda":
            torch.cuda.synchronize(self._written_device)

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        done = self._carried.get("done", {}).get(slot)
        if done is not None:  # the receiver's copies out of this slot come first (and before a replacement's free)
            cuda_ipc.wait(done[1], self.timeout, f"the engine's copies out of bucket buffer {slot}")
        return super().buffer(slot, nbytes, device)

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise MconvError(f"{type(self).__name__} needs the model on a CUDA device; it is on {device}")

    def update(self, bucket: FlatBucket) -> None:
        if bucket.written and not bucket.entries:  # copied into the receiver's parameters already
            with self._lock:  # (targets() clears the cache when the receiver's model changes)
                cached = self._written_entries.get(id(bucket.written))
                if cached is None or cached[0] is not bucket.written:
                    cached = self._written_entries[id(bucket.written)] = (bucket.written, [
                        Entry(name, dtype_name(t.dtype), tuple(t.shape), t.storage_offset() * t.element_size(),
                              t.nbytes) for name, t in bucket.written])
                self._written.append(({"written": True}, cached[1]))
                self._written_device = bucket.buffer.device
            return
        if not bucket.buffer.is_cuda:
            raise MconvError(f"IPCEngine needs the model on a CUDA device; bucket {bucket.index} is on "
                             f"{bucket.buffer.device}")
        bucket.wait()
        slot = self._slot(self._buffers, bucket)
        if not self.keeps_shares:
            self._update({"ipc": cuda_ipc.share(bucket.buffer)}, bucket.entries)
            return
        buffer = self._buffers[slot]
        with self._lock:  # the connection's shares, from their making to the request
            # A share is made once per connection and buffer: sharing again at each bucket cost the
            # receiver a mapping (a reference count released) and the sender an event per request.
            carried = self._connected()
            shares = carried.setdefault("ipc", {})  # slot -> (buffer, its share)
            # Keys of replaced (grown) buffers' shares, named in every request until one is answered:
            # a request the receiver refuses (an aborted update) must not lose a release.
            released = carried.setdefault("release", [])
            held = shares.get(slot)
            known = carried.setdefault("done", {})  # slot -> (handle, the receiver's "done" event opened here)
            if held is not None and held[0] is not buffer:
                released.append(cuda_ipc.key(held[1]))
                known.pop(slot, None)  # the receiver drops the old buffer's event with its mapping
                held = None
            if held is None:
                held = shares[slot] = (buffer, cuda_ipc.share(buffer))
            item = {"kept": True, "ipc": held[1], "ordered": True}
            if released:
                item["release"] = list(released)
            done = self._update(item, bucket.entries).get("done")
            released.clear()
            if done is not None and known.get(slot, (None,))[0] != done:
                known[slot] = (done, cuda_ipc.open_event(done, bucket.buffer.device.index))

    def close(self) -> None:
        super().close()
        forget_packing(self)  # views of the receiver's parameters, mapped here: they go with the connection
        self._written_entries.clear()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees the shared buffers the receiver has let go of
