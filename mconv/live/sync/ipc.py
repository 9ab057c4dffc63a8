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
    each bucket crosses as one IPC handle and its entries, and the buffer is reused only after the
    receiver has copied from it (its reply). Raises MconvError for a model that is not on CUDA."""

    def update(self, bucket: FlatBucket) -> None:
        if not bucket.buffer.is_cuda:
            raise MconvError(f"IPCEngine needs the model on a CUDA device; bucket {bucket.index} is on "
                             f"{bucket.buffer.device}")
        if bucket.ready is None:
            torch.cuda.synchronize(bucket.buffer.device)  # the packing copies, on whichever stream packed them
        else:
            bucket.wait()
        self._update({"ipc": cuda_ipc.share(bucket.buffer)}, bucket.entries)

    def close(self) -> None:
        super().close()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees the shared buffers the receiver has let go of
