"""Colocated sync over CUDA IPC: `IPCEngine` hands each flat bucket's CUDA buffer to an engine's
process on the same GPU as one CUDA IPC handle (mconv.transport.cuda_ipc), whose receiver copies
the bucket's tensors into its own parameters before it replies."""
from __future__ import annotations

import torch

from mconv.errors import MconvError
from mconv.live.sync.engines import FlatBucket, RemoteEngine
from mconv.transport import cuda_ipc


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

    A subclass whose receiver maps the buffer anew at every bucket (vLLM's ipc backend) sets
    `keeps_shares = False`: each bucket is then shared afresh, one share for one mapping, as
    torch's reference counting of shared CUDA memory requires (cuda_ipc)."""

    keeps_shares = True

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        done = self._carried.get("done", {}).get(slot)
        if done is not None:  # the receiver's copies out of this slot come first (and before a replacement's free)
            cuda_ipc.wait(done[1], self.timeout, f"the engine's copies out of bucket buffer {slot}")
        return super().buffer(slot, nbytes, device)

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise MconvError(f"{type(self).__name__} needs the model on a CUDA device; it is on {device}")

    def update(self, bucket: FlatBucket) -> None:
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
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees the shared buffers the receiver has let go of
