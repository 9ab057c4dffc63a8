"""vLLM as a weight-sync engine: `VLLMEngine` drives vLLM's native weight-transfer API
(`start_weight_update` / `update_weights` / `finish_weight_update`) in another process, through
mconv.transport.vllm_receiver.Receiver there, with each bucket in a shared-memory file."""
from __future__ import annotations

from mconv.live.sync.engines import SharedMemoryEngine


class VLLMEngine(SharedMemoryEngine):
    """A vLLM `LLM` on this host, served by `mconv.transport.vllm_receiver.Receiver(llm, address,
    authkey)` in its process (a separate process, or another Python, is fine). Buckets travel as
    shared-memory files (SharedMemoryEngine); the engine's workers map them and load them through
    vLLM's layerwise reload. `finish` sets vLLM's weight version and resets its prefix cache
    (`reset_prefix_cache=False` skips that: cached prefixes then keep the old weights' KV);
    `abort` ends the update as failed (vLLM's weight version becomes "failed:<version>").
    Tied embeddings send lm_head.weight too (vLLM's CPU build packs its own copy).

    `route="transfer"` drives vLLM's native weight-transfer API (start_weight_update /
    update_weights per bucket / finish_weight_update: the `LLM` needs engine_args()'s backend);
    `route="reload"` runs `collective_rpc("reload_weights", weights_iterator=...)` once per sync
    on an in-process engine (its arguments pass by reference), fed bucket by bucket as they
    arrive; the version is set with vLLM's update_weight_version."""

    sends_tied_lm_head = True

    def __init__(self, address: str, authkey: bytes, reset_prefix_cache: bool = True, route: str = "transfer",
                 timeout: float | None = 600.0):
        super().__init__(address, authkey, timeout)
        self.reset_prefix_cache, self.route = reset_prefix_cache, route

    def start(self, version: str, verify: bool = False) -> None:
        self._request({"op": "start", "version": version, "verify": verify, "route": self.route})

    def finish(self, version: str) -> None:
        self._request({"op": "finish", "version": version, "reset_prefix_cache": self.reset_prefix_cache})
