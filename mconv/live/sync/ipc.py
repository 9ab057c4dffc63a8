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
    as that handle and its entries; a buffer is reused only after the receiver has copied from it
    (its reply). Raises MconvError for a model that is not on CUDA.

    A subclass whose receiver maps the buffer anew at every bucket (vLLM's ipc backend) sets
    `keeps_shares = False`: each bucket is then shared afresh, one share for one mapping, as
    torch's reference counting of shared CUDA memory requires (cuda_ipc)."""

    keeps_shares = True

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
            if held is not None and held[0] is not buffer:
                released.append(cuda_ipc.key(held[1]))
                held = None
            if held is None:
                held = shares[slot] = (buffer, cuda_ipc.share(buffer))
            item = {"kept": True, "ipc": held[1]}
            if released:
                item["release"] = list(released)
            self._update(item, bucket.entries)
            released.clear()

    def close(self) -> None:
        super().close()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees the shared buffers the receiver has let go of
