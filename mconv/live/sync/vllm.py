"""vLLM as a weight-sync engine: `VLLMEngine` drives vLLM's native weight-transfer API
(`start_weight_update` / `update_weights` / `finish_weight_update`) in another process, through
mconv.transport.vllm_receiver.Receiver there, with each bucket in a shared-memory file."""
from __future__ import annotations

import torch

from mconv.live.sync.engines import FlatBucket, RemoteEngine
from mconv.transport import shm


class VLLMEngine(RemoteEngine):
    """A vLLM `LLM` on this host, served by `mconv.transport.vllm_receiver.Receiver(llm, address,
    authkey)` in its process (a separate process, or another Python, is fine). Each sender rank
    keeps two shared-memory bucket buffers (grown as needed, removed by `close()`); a bucket
    travels as its file's path and entries, the engine's workers map it and load it through
    vLLM's layerwise reload. `finish` sets vLLM's weight version and resets its prefix cache
    (`reset_prefix_cache=False` skips that: cached prefixes then keep the old weights' KV);
    `abort` ends the update as failed (vLLM's weight version becomes "failed:<version>").
    Tied embeddings send lm_head.weight too (vLLM's CPU build packs its own copy)."""

    sends_tied_lm_head = True

    def __init__(self, address: str, authkey: bytes, reset_prefix_cache: bool = True):
        super().__init__(address, authkey)
        self.reset_prefix_cache = reset_prefix_cache
        self._shared: dict[int, shm.SharedBuffer] = {}

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        current = self._shared.get(slot)
        if current is None or current.nbytes < nbytes:
            if current is not None:
                current.close()
            self._shared[slot] = current = shm.SharedBuffer.create(nbytes)
        return current.tensor[:nbytes]

    def update(self, bucket: FlatBucket) -> None:
        slot = next(s for s, b in self._shared.items() if b.tensor.data_ptr() == bucket.buffer.data_ptr())
        self._request({"op": "update", "path": self._shared[slot].path,
                       "entries": [e.to_json() for e in bucket.entries]})

    def finish(self, version: str) -> None:
        self._request({"op": "finish", "version": version, "reset_prefix_cache": self.reset_prefix_cache})

    def close(self) -> None:
        for buffer in self._shared.values():
            buffer.close()
        self._shared.clear()
        super().close()
