"""Colocated weight sync over CUDA IPC: a flat bucket's CUDA buffer crosses to the engine's process
on the same GPU as ONE CUDA IPC handle (torch.multiprocessing's reduce_tensor / rebuild_cuda_tensor,
carried as JSON: nothing is unpickled); mconv.transport.receiver.ParameterReceiver maps it and
copies every entry into parameters the engine's process preallocated. Imports torch only.

Lifetime and order: the sender's packing has finished on the GPU before it sends the handle (it
waits for an event recorded after its copies), and it keeps the buffer unchanged until the
receiver's copies out of it are done: the receiver replies only after a stream synchronize, or,
to a sender that says it orders by events, as soon as its copies are queued, with the handle of an
IPC event recorded after them, which the sender waits for (`wait`) before it packs into that
buffer again. Neither process's stream waits for the other's events: a process that dies or hangs
cannot block the other's GPU work, and a wait gives up after its timeout.

Each `share()` counts one more reference held by a receiver, released when that receiver's mapping
of it goes: a share sent once and kept is rebuilt once (IPCEngine, "kept"); one made at every
request must be rebuilt at every request (torch's cache then releases it), or the sender's memory
is never freed [read torch/multiprocessing/reductions.py: rebuild_cuda_tensor].

The direct route (ParameterReceiver(direct=True)) shares the other way: the receiver shares the
storages holding its parameters, once per connection, and the trainer maps them and writes into them.
"""
from __future__ import annotations

import time

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_BYTES = ("handle", "ref_counter_handle", "event_handle")


def share(buffer: torch.Tensor) -> dict:
    """One CUDA IPC handle for `buffer` (1-D uint8 on a CUDA device), as JSON; "uuid" names the GPU
    as every process sees it (vLLM's ipc backend looks its handle up by it). The caller keeps
    `buffer` alive and unchanged until the receiver has copied from it."""
    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"CUDA IPC shares a 1-D uint8 CUDA buffer, not {buffer.dtype} {list(buffer.shape)} "
                         f"on {buffer.device}")
    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    return {"numel": size[0], "offset": offset, "device": device, "size_bytes": size_bytes,
            "uuid": gpu_uuid(device),
            "offset_bytes": offset_bytes, "ref_counter_offset": ref_counter_offset,
            "event_sync_required": bool(event_sync_required),
            **{k: None if raw is None else bytes(raw).hex()
               for k, raw in zip(_BYTES, (handle, ref_counter_handle, event_handle))}}


def gpu_uuid(device: int | torch.device) -> str:
    """The UUID of CUDA `device`: the name every process gives that GPU, whatever index it sees it at."""
    return str(torch.cuda.get_device_properties(device).uuid)


def key(shared: dict) -> str:
    """What names a `share()` result's storage (its handle and the allocation offset), as receivers key their mappings."""
    return f"{shared['handle']}:{shared['offset_bytes']}"


def rebuild_args(shared: dict, device: int) -> tuple:
    """The arguments of torch's `rebuild_cuda_tensor` for a `share()` result on `device` (the
    sender's GPU as this process numbers it): what torch's own reduce_tensor gives, and what
    vLLM's ipc weight-transfer backend takes as a handle."""
    raw = {k: None if shared[k] is None else bytes.fromhex(shared[k]) for k in _BYTES}
    return (torch.Tensor, torch.Size([shared["numel"]]), (1,), shared["offset"], torch.UntypedStorage, torch.uint8,
            device, raw["handle"], shared["size_bytes"], shared["offset_bytes"], False, raw["ref_counter_handle"],
            shared["ref_counter_offset"], raw["event_handle"], shared["event_sync_required"])


def attach(shared: dict, device: int) -> torch.Tensor:
    """The uint8 CUDA tensor a `share()` result names, mapped into this process on `device`
    (the sender's GPU as this process numbers it)."""
    return rebuild_cuda_tensor(*rebuild_args(shared, device))


def share_event(event: "torch.cuda.Event") -> str:
    """The IPC handle of `event` (made with `interprocess=True` and recorded at least once), as hex."""
    return bytes(event.ipc_handle()).hex()


def open_event(handle: str, device: int) -> "torch.cuda.Event":
    """The event another process shared with `share_event`, opened on `device` (for `wait`)."""
    return torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(handle))


def wait(event: "torch.cuda.Event", timeout: float | None, what: str) -> None:
    """Return once the work `event` last recorded has finished, polling it from the host (an IPC
    event: no stream of this process waits for another process's GPU work). TimeoutError naming
    `what` after `timeout` seconds (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 1e-5
    while not event.query():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
