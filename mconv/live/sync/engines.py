"""What `sync_weights` talks to: the Engine protocol (an adapter per inference engine), the flat
bucket it hands over, and the adapter for a plain callable."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

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


def as_engine(engine) -> Engine:
    if isinstance(engine, Engine):
        return engine
    if callable(engine):
        return CallableEngine(engine)
    raise TypeError(f"engine must be an mconv.live.sync.Engine or a callable taking a bucket, not {type(engine).__name__}")
