"""Colocated weight sync over CUDA IPC: a flat bucket's CUDA buffer crosses to the engine's process
on the same GPU as ONE CUDA IPC handle (torch.multiprocessing's reduce_tensor / rebuild_cuda_tensor,
carried as JSON: nothing is unpickled), and `ParameterReceiver` copies every entry into parameters
the engine's process preallocated. This module imports torch only, not megatron-core.

    from mconv.transport.cuda_ipc import ParameterReceiver
    receiver = ParameterReceiver(params, "/tmp/engine.sock", authkey=b"...")  # {HF name: CUDA tensor}
    receiver.start()              # a thread; the trainer syncs with mconv.live.sync.IPCEngine

Lifetime and order: the sender's packing has finished on the GPU before it sends the handle (a
device synchronize), it keeps the buffer unchanged until the receiver's reply, and the receiver
replies only after its copies have finished on the GPU (a stream synchronize).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from mconv.transport import shm
from mconv.transport.flat import Entry, unpack

_BYTES = ("handle", "ref_counter_handle", "event_handle")


def share(buffer: torch.Tensor) -> dict:
    """One CUDA IPC handle for `buffer` (1-D uint8 on a CUDA device), as JSON. The caller keeps
    `buffer` alive and unchanged until the receiver has copied from it."""
    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"CUDA IPC shares a 1-D uint8 CUDA buffer, not {buffer.dtype} {list(buffer.shape)} "
                         f"on {buffer.device}")
    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    return {"numel": size[0], "offset": offset, "device": device, "size_bytes": size_bytes,
            "offset_bytes": offset_bytes, "ref_counter_offset": ref_counter_offset,
            "event_sync_required": bool(event_sync_required),
            **{k: None if raw is None else bytes(raw).hex()
               for k, raw in zip(_BYTES, (handle, ref_counter_handle, event_handle))}}


def attach(shared: dict, device: int) -> torch.Tensor:
    """The uint8 CUDA tensor a `share()` result names, mapped into this process on `device`
    (the sender's GPU as this process numbers it)."""
    raw = {k: None if shared[k] is None else bytes.fromhex(shared[k]) for k in _BYTES}
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([shared["numel"]]), (1,), shared["offset"],
                               torch.UntypedStorage, torch.uint8, device, raw["handle"], shared["size_bytes"],
                               shared["offset_bytes"], False, raw["ref_counter_handle"],
                               shared["ref_counter_offset"], raw["event_handle"], shared["event_sync_required"])


class ParameterReceiver:
    """An engine's side of a colocated sync: owns `params` ({HF name: CUDA tensor}, preallocated,
    as an engine's model does) and serves a trainer's requests (JSON, from IPCEngine) on `address`.

    `update` carries {"buffers": [{"ipc": share(...), "entries": [Entry.to_json()]}]}: each entry is
    copied into its parameter (same dtype and shape, else the update fails naming it). `finish`
    fails if any parameter got nothing since `start`; after it `version` is the sync's version,
    after `abort` "failed:<version>". `lock` is held from `start` to `finish` / `abort`.
    The two most recent mappings are kept open, so a sender's two reused buffers are opened once
    (torch's rebuild_cuda_tensor then finds them in its cache and releases the sender's counter).
    """

    def __init__(self, params: dict[str, torch.Tensor], address: str, authkey: bytes):
        self.params = params
        self.lock = threading.Lock()
        self.version: str | None = None
        self._listener = shm.listen(address, authkey)
        self._updating = False
        self._received: set[str] = set()
        self._mapped: OrderedDict[str, torch.Tensor] = OrderedDict()

    def start(self) -> threading.Thread:
        """Accept trainer connections on a daemon thread, each served on its own thread."""
        return shm.serve(self._listener, self.handle)

    def handle(self, message: dict) -> dict:
        op = message["op"]
        if op == "expected":
            return {"tensors": {name: list(t.shape) for name, t in self.params.items()}}
        if op == "start":
            self.lock.acquire()
            self._updating, self._received = True, set()
            return {}
        if not self._updating:
            raise RuntimeError(f"{op} without a weight update in progress")
        if op == "update":
            for item in message["buffers"]:
                self._copy(self._map(item["ipc"]), [Entry.from_json(e) for e in item["entries"]])
            torch.cuda.current_stream().synchronize()  # the sender reuses the buffer once we reply
            return {}
        try:
            if op == "finish":
                missing = sorted(set(self.params) - self._received)
                if missing:
                    raise RuntimeError(f"weight update {message['version']} did not send {', '.join(missing[:3])}"
                                       + (" ..." if len(missing) > 3 else ""))
                self.version = message["version"]
            elif op == "abort":
                self.version = f"failed:{message['version']}"
            else:
                raise ValueError(f"unknown request {op!r}")
        finally:
            self._updating = False
            self.lock.release()
        return {"version": self.version}

    def _map(self, shared: dict) -> torch.Tensor:
        key = f"{shared['handle']}:{shared['offset_bytes']}"
        self._mapped[key] = tensor = attach(shared, torch.cuda.current_device())
        self._mapped.move_to_end(key)
        while len(self._mapped) > 2:
            self._mapped.popitem(last=False)
        return tensor

    def _copy(self, storage: torch.Tensor, entries: list[Entry]) -> None:
        for name, view in unpack(storage, entries):
            target = self.params.get(name)
            if target is None or target.shape != view.shape or target.dtype != view.dtype:
                raise ValueError(f"weight update tensor {name} ({view.dtype} {list(view.shape)}) does not match the "
                                 f"engine's " + ("model: no such parameter" if target is None else
                                                 f"{target.dtype} {list(target.shape)}"))
            target.copy_(view)
            self._received.add(name)

    def close(self) -> None:
        self._mapped.clear()
        self._listener.close()
