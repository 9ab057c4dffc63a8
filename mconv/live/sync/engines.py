"""What `sync_weights` talks to: the Engine protocol (an adapter per inference engine), the flat
bucket it hands over, and the adapter for a plain callable."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import threading

import torch

from mconv.transport import shm
from mconv.transport.flat import Entry, unpack


@dataclass
class FlatBucket:
    """One bucket of a sync: `buffer` (1-D uint8) holds every tensor at its entry's offset (offsets
    aligned to each dtype). Iterating yields (HF name, view of `buffer`); the views are valid until
    the engine call that received the bucket returns (the buffer is then reused)."""

    version: str
    index: int
    buffer: torch.Tensor
    entries: list[Entry]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(unpack(self.buffer, self.entries))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


class Engine:
    """An inference engine as `sync_weights` drives it. On global rank 0: `expected()` (before
    anything is sent), `start(version)`, then `finish(version)` once every rank's buckets were
    taken, or `abort(version, reason)` when any rank failed (never `finish` then). On each sender
    rank (TP/EP/ETP/DP rank 0 of every pipeline stage): `buffer(slot, nbytes, device)` and
    `update(bucket)`, from one background thread, at most two buckets in flight (slots 0 and 1)."""

    sends_tied_lm_head = False  # send lm_head.weight beside model.embed_tokens.weight for tied embeddings

    def __init__(self):
        self._buffers: dict[int, torch.Tensor] = {}

    def expected(self) -> dict[str, list[int]] | None:
        """{HF name: shape} of the engine's model, or None if the engine cannot tell."""
        return None

    def start(self, version: str) -> None:
        pass

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` for bucket slot 0 or 1, kept for the next buckets."""
        current = self._buffers.get(slot)
        if current is None or current.numel() < nbytes or current.device != device:
            self._buffers[slot] = current = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return current[:nbytes]

    def update(self, bucket: FlatBucket) -> None:
        raise NotImplementedError

    def finish(self, version: str) -> None:
        pass

    def abort(self, version: str, reason: str) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()


class CallableEngine(Engine):
    """`engine=fn`: `fn(bucket)` on each sender rank, per bucket (a FlatBucket: iterate it for
    (name, tensor) views, or ship `bucket.buffer` and `bucket.entries` with your own transport)."""

    def __init__(self, fn: Callable[[FlatBucket], object]):
        super().__init__()
        self.fn = fn

    def update(self, bucket: FlatBucket) -> None:
        self.fn(bucket)


class RemoteEngine(Engine):
    """An engine in another process that answers mconv's JSON requests (`expected`, `start`,
    `update`, `finish`, `abort`; mconv.transport.shm) on `address` (a Unix socket path or
    "host:port"), authenticated with `authkey`. Subclasses say how a bucket travels (`update`)."""

    def __init__(self, address: str, authkey: bytes):
        super().__init__()
        self.address, self.authkey = address, authkey
        self._conn = None
        self._lock = threading.Lock()  # rank 0 talks from the caller's thread and the update thread

    def _request(self, message: dict) -> dict:
        with self._lock:
            if self._conn is None:
                self._conn = shm.connect(self.address, self.authkey)
            return shm.request(self._conn, message)

    def expected(self) -> dict[str, list[int]]:
        return self._request({"op": "expected"})["tensors"]

    def start(self, version: str) -> None:
        self._request({"op": "start", "version": version})

    def finish(self, version: str) -> None:
        self._request({"op": "finish", "version": version})

    def abort(self, version: str, reason: str) -> None:
        self._request({"op": "abort", "version": version, "reason": reason})

    def close(self) -> None:
        super().close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def as_engine(engine) -> Engine:
    if isinstance(engine, Engine):
        return engine
    if callable(engine):
        return CallableEngine(engine)
    raise TypeError(f"engine must be an mconv.live.sync.Engine or a callable taking a bucket, not {type(engine).__name__}")
