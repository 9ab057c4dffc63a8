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

    Order on the GPU, without the host waiting for it: once the receiver has said it orders by
    events (its reply carries a "done" event), each request names the slot's IPC event recorded
    after the bucket's packing ("ready"), which the receiver's stream waits for before its copies,
    and the receiver replies once its copies are queued, with an IPC event recorded after them,
    which the trainer's stream waits for before it packs into that buffer again (`buffer`). Until
    then (a connection's first bucket, or a receiver that does not), the trainer waits for each
    bucket's packing on the host and the receiver for its copies (mconv.transport.cuda_ipc).

    A subclass whose receiver maps the buffer anew at every bucket (vLLM's ipc backend) sets
    `keeps_shares = False`: each bucket is then shared afresh, one share for one mapping, as
    torch's reference counting of shared CUDA memory requires (cuda_ipc)."""

    keeps_shares = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ready: dict[int, tuple[torch.cuda.Event, str]] = {}  # slot -> its IPC event and handle

    def ready_event(self, slot: int, device: torch.device) -> torch.cuda.Event:
        if not self.keeps_shares:
            return super().ready_event(slot, device)
        if slot not in self._ready:
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(device))  # (an IPC handle needs the event made on the device)
            self._ready[slot] = (event, cuda_ipc.share_event(event))
        return self._ready[slot][0]

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        done = self._carried.get("done", {}).get(slot)
        if done is not None:  # the receiver's copies out of this slot come first (and before a replacement's free)
            torch.cuda.current_stream(device).wait_event(done[1])
        return super().buffer(slot, nbytes, device)

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise MconvError(f"{type(self).__name__} needs the model on a CUDA device; it is on {device}")

    def update(self, bucket: FlatBucket) -> None:
        if not bucket.buffer.is_cuda:
            raise MconvError(f"IPCEngine needs the model on a CUDA device; bucket {bucket.index} is on "
                             f"{bucket.buffer.device}")
        slot = self._slot(self._buffers, bucket)
        if not self.keeps_shares:
            bucket.wait()
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
            if held is not None and held[0] is not buffer:
                released.append(cuda_ipc.key(held[1]))
                held = None
            if held is None:
                held = shares[slot] = (buffer, cuda_ipc.share(buffer))
            item = {"kept": True, "ipc": held[1], "ordered": True}
            ready = self._ready.get(slot)
            if carried.get("ordered") and ready is not None and bucket.ready is ready[0]:
                item["ready"] = ready[1]
            else:
                bucket.wait()
            if released:
                item["release"] = list(released)
            done = self._update(item, bucket.entries).get("done")
            released.clear()
            if done is not None:
                carried["ordered"] = True
                known = carried.setdefault("done", {})  # slot -> (handle, the receiver's event opened here)
                if known.get(slot, (None,))[0] != done:
                    known[slot] = (done, cuda_ipc.open_event(done, bucket.buffer.device.index))

    def close(self) -> None:
        super().close()
        self._ready.clear()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees the shared buffers the receiver has let go of
