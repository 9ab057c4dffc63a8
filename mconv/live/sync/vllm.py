"""vLLM as a weight-sync engine, driven through vLLM's native weight-transfer API
(`start_weight_update` / `update_weights` / `finish_weight_update`) in vLLM's own process by
mconv.transport.vllm_receiver.Receiver: `VLLMEngine` hands each bucket over as a shared-memory file
(mconv's `mconv_shm` backend, or vLLM's layerwise `reload_weights`), `VLLMIPCEngine` as one CUDA IPC
handle that vLLM's own `ipc` backend opens (colocated on one GPU)."""
from __future__ import annotations

from mconv.live.sync.engines import RemoteEngine, SharedMemoryEngine
from mconv.live.sync.ipc import IPCEngine


class _VLLMUpdate(RemoteEngine):
    """The update session both vLLM engines ask of the Receiver: `start` names the route, `finish`
    sets the weight version and resets vLLM's prefix cache (`reset_prefix_cache=False` skips that:
    cached prefixes then keep the old weights' KV); `abort` ends the update as failed."""

    route = "transfer"

    def __init__(self, address: str, authkey: bytes, reset_prefix_cache: bool = True, timeout: float | None = 600.0):
        super().__init__(address, authkey, timeout)
        self.reset_prefix_cache = reset_prefix_cache

    def start(self, version: str, verify: bool = False) -> None:
        self._request({"op": "start", "version": version, "verify": verify, "route": self.route})

    def finish(self, version: str) -> None:
        self._request({"op": "finish", "version": version, "reset_prefix_cache": self.reset_prefix_cache})


class VLLMEngine(_VLLMUpdate, SharedMemoryEngine):
    """A vLLM `LLM` on this host, served by `mconv.transport.vllm_receiver.Receiver(llm, address,
    authkey)` in its process (a separate process, or another Python, is fine). Buckets travel as
    shared-memory files (SharedMemoryEngine); the engine's workers map them and load them through
    vLLM's layerwise reload. After an abort vLLM's weight version is "failed:<version>".
    Tied embeddings send lm_head.weight too (vLLM's CPU build packs its own copy).

    `route="transfer"` drives vLLM's native weight-transfer API (start_weight_update /
    update_weights per bucket / finish_weight_update) with mconv's `mconv_shm` backend (the `LLM`
    needs vllm_receiver.engine_args()); `route="reload"` runs `collective_rpc("reload_weights",
    weights_iterator=...)` once per sync on an in-process engine (its arguments pass by reference),
    fed bucket by bucket as they arrive; the version is set with vLLM's update_weight_version."""

    sends_tied_lm_head = True

    def __init__(self, address: str, authkey: bytes, reset_prefix_cache: bool = True, route: str = "transfer",
                 timeout: float | None = 600.0):
        if route not in ("transfer", "reload"):
            raise ValueError(f"VLLMEngine route must be 'transfer' or 'reload', not {route!r} (vLLM's ipc backend: "
                             "VLLMIPCEngine)")
        super().__init__(address, authkey, reset_prefix_cache, timeout)
        self.route = route


class VLLMIPCEngine(_VLLMUpdate, IPCEngine):
    """A vLLM `LLM` on the trainer's GPU built with `vllm_receiver.engine_args("ipc")` (vLLM's own
    `ipc` weight-transfer backend), served by `Receiver(llm, address, authkey)` in its process.
    Buckets are packed on the model's GPU into two reused buffers (IPCEngine); each bucket crosses
    as one CUDA IPC handle, named by the GPU's UUID, and vLLM's backend opens it, cuts it into
    tensors by their byte sizes (mconv's flat buckets are back to back, so the cuts fall on the
    entries) and loads them through its layerwise reload. Tied embeddings are not sent twice (on a
    GPU vLLM's lm_head is the embedding). vLLM must run on that one GPU (TP 1, PP 1: its ipc backend
    finds each worker's handle by the worker's GPU, and the trainer shares from one): `start` refuses
    another engine. Tested with vLLM 0.26.0 (CUDA) on an H200, the `LLM` in
    the Receiver's process with its engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): with
    an engine-core process vLLM would have to pickle the handle."""

    route = "ipc"
    keeps_shares = False  # vLLM's backend opens the handle at every bucket and drops it after

    def finish(self, version: str) -> None:
        try:
            super().finish(version)
        finally:
            self._fresh_buffers()

    def abort(self, version: str, reason: str) -> None:
        try:
            super().abort(version, reason)
        finally:
            self._fresh_buffers()

    def _fresh_buffers(self) -> None:
        """New bucket buffers at the next sync (the sender is rank 0 here: vLLM on one GPU): torch
        keeps a record per share with the shared storage for as long as it lives, and a buffer that
        vLLM never opened (a refused bucket) stays with torch's IPC limbo until the trainer exits."""
        self._buffers.clear()
        self.__dict__.pop("_views", None)  # sync_weights' packing views of them would keep them alive
