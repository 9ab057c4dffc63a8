"""SGLang's two weight-update routes as engines of `sync_weights`, over one session protocol
(`begin_weight_update` / `end_weight_update`, which SGLang >= 0.5.21 requires, then the version and
one cache flush): `SGLangEngine`, colocated (`update_weights_from_tensor` with the flattened-bucket
payload of `sglang_payload`: one CUDA IPC handle per bucket), and `SGLangDistributedEngine`,
disaggregated (a process group and one broadcast per bucket). Checked against sglang 0.5.23's own
request types, deserializer (MultiprocessingSerializer / SafeUnpickler), FlattenedTensorBucket and
WeightUpdater."""
from __future__ import annotations

import base64
import io
import itertools
import os
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta
from functools import partial
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
from torch.multiprocessing import reductions  # also registers torch's tensor reductions with ForkingPickler

from mconv.errors import MconvError
from mconv.live.sync.engines import Engine, FlatBucket
from mconv.live.sync.http import call_json
from mconv.transport import cuda_ipc
from mconv.transport.flat import dtype_of


def sglang_payload(bucket: FlatBucket, tp_size: int = 1) -> list[str]:
    """`serialized_named_tensors` for an SGLang engine with `tp_size` TP ranks: one entry per rank
    (each rank deserializes only its own, for CUDA IPC reference counting), each the base64 of a
    ForkingPickler dump of {"flattened_tensor": bucket.buffer, "metadata": [...]}. The buffer
    pickles as one CUDA IPC handle naming its GPU by UUID, as SGLang's own sender does (on the CPU: a
    shared-memory storage); the metadata are
    `types.SimpleNamespace(name, shape, dtype, start_idx, end_idx, numel)` (byte offsets), a
    class SGLang's allow-listing unpickler accepts. Keep `bucket.buffer` unchanged until SGLang's
    call has returned and its copies are done."""
    metadata = [SimpleNamespace(name=e.name, shape=torch.Size(e.shape), dtype=dtype_of(e.dtype), start_idx=e.offset,
                                end_idx=e.offset + e.nbytes, numel=e.nbytes) for e in bucket.entries]
    payload = {"flattened_tensor": bucket.buffer, "metadata": metadata}
    entries = []
    for _ in range(tp_size):
        out = io.BytesIO()
        pickler = ForkingPickler(out)
        pickler.dispatch_table[torch.Tensor] = _reduce_by_device_uuid
        pickler.dump(payload)
        entries.append(base64.b64encode(out.getvalue()).decode())
    return entries


_DEVICE_ARG = 6  # the device in torch's rebuild_cuda_tensor arguments (SGLang's patch relies on it too)


def _reduce_by_device_uuid(tensor: torch.Tensor):
    """torch's reduction of a tensor, a CUDA one naming its GPU by UUID instead of this process's
    device index, as SGLang's own sender does (sglang/srt/utils/patch_torch.py: its receiver maps the
    UUID to its own index, so the two processes may number the GPUs differently)."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[_DEVICE_ARG], int):
        args = (*args[:_DEVICE_ARG], cuda_ipc.gpu_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return rebuild, args


class _SGLangServer(Engine):
    """What both routes share: SGLang's HTTP server or a function calling an in-process engine
    (`server`, see the engines' docstrings), its replies read as success or a RuntimeError, and the
    session around each sync."""

    def __init__(self, server: str | Callable[[str, dict], object], *, session: bool, timeout: float,
                 flush_timeout: float, api_key: str | None = None):
        super().__init__()
        self._post = server if callable(server) else partial(_post_json, server.rstrip("/"), timeout=timeout,
                                                             api_key=api_key)
        self.session, self.timeout, self.flush_timeout = session, timeout, flush_timeout

    def start(self, version: str, verify: bool = False) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise MconvError(f"{type(self).__name__} sends from trainer rank 0 only, and this trainer has "
                             f"{parallel_state.get_pipeline_model_parallel_world_size()} pipeline stages (PP > 1 is "
                             "not supported)")
        if self.session:
            try:
                self._call("begin_weight_update", {})
            except RuntimeError as e:
                if "already open" not in str(e):
                    raise
                self._call("end_weight_update", {})  # a session an earlier trainer left open
                self._call("begin_weight_update", {})

    def finish(self, version: str) -> None:
        if self.session:
            self._call("end_weight_update", {})
        self._call("update_weight_version", {"new_version": version, "abort_all_requests": False})
        self._call("flush_cache", {"timeout": self.flush_timeout})

    def abort(self, version: str, reason: str) -> None:
        if self.session:
            self._call("end_weight_update", {})

    def _call(self, route: str, payload: dict) -> object:
        reply = self._post(route, payload)
        if isinstance(reply, (tuple, list)) and reply and isinstance(reply[0], bool):  # sglang.Engine's methods
            success, message = reply[0], reply[1] if len(reply) > 1 else ""
        elif isinstance(reply, dict):
            success, message = reply.get("success"), reply.get("message")
        else:
            success, message = getattr(reply, "success", None), getattr(reply, "message", None)
        if success is False:
            raise RuntimeError(f"SGLang refused {route}: {message}")
        return reply


class SGLangEngine(_SGLangServer):
    """A running SGLang engine on the trainer's GPU, updated through `update_weights_from_tensor`
    (SGLang's colocated route): each bucket is one request whose `serialized_named_tensors` is
    `sglang_payload(bucket)`, the bucket's flat buffer as one CUDA IPC handle plus its entries
    (`load_format="flattened_bucket"`, no cache flush per bucket). SGLang copies the bucket into its
    parameters through its model's `load_weights` and answers; the buffer is reused two buckets
    later. (At TP 1 SGLang's process synchronizes its stream when it frees the
    tensors it mapped, before it answers: torch's deleter of a received CUDA storage does so, which
    is what makes reusing a shared buffer safe.)

    SGLang must run at TP 1: only its TP rank 0 answers, and its other ranks' copies from the shared
    buffer are not ordered before that answer, so the next packing could overwrite what they still
    read (`start` refuses a server whose `server_info` says otherwise). `server`: SGLang's HTTP
    address ("http://host:30000") or a function `(route, payload) -> reply` (routes as below;
    `server_info` may answer None); a reply is a dict, a `(success, message)` tuple or an object with
    `.success` / `.message`. The GPU is named by UUID in the payload, as SGLang's own sender does.
    Tested against sglang 0.5.23's own reading code on the CPU; on a GPU, the payload opened in
    another process (tests/test_gpu.py). `session=True` wraps each sync in
    `begin_weight_update` / `end_weight_update` (SGLang >= 0.5.21 requires them). At `finish` the
    version is set (`update_weight_version`, without aborting requests) and the radix cache flushed,
    waiting up to `flush_timeout` seconds for running requests to end.

    Failures: a request SGLang refuses is a RuntimeError naming the route and SGLang's message.
    SGLang cannot undo an update: `abort` ends its session, and the engine holds a mix of old and
    new weights until a sync finishes. `start` refuses a trainer with several pipeline stages
    (MconvError). verify=True is refused (SGLang cannot read its weights back in mconv's checksum).
    On the CPU the buffer crosses as a shared-memory storage, which a process outside this one's
    tree opens only under `torch.multiprocessing.set_sharing_strategy("file_system")`."""

    def __init__(self, server: str | Callable[[str, dict], object], *, session: bool = True,
                 timeout: float = 600.0, flush_timeout: float = 60.0, api_key: str | None = None):
        super().__init__(server, session=session, timeout=timeout, flush_timeout=flush_timeout, api_key=api_key)

    def start(self, version: str, verify: bool = False) -> None:
        info = self._post("server_info", {})
        tp = (info or {}).get("tp_size", 1) if isinstance(info, dict) else 1
        if tp != 1:
            raise MconvError(f"SGLangEngine needs SGLang at TP 1 (its server runs tp_size={tp}): its other TP ranks' "
                             "copies from the shared bucket would race the next bucket's packing")
        super().start(version, verify)

    def update(self, bucket: FlatBucket) -> None:
        bucket.wait()  # the packing's copies, before another process reads the buffer
        self._call("update_weights_from_tensor", {
            "serialized_named_tensors": sglang_payload(bucket), "load_format": "flattened_bucket",
            "flush_cache": False})


class SGLangDistributedEngine(_SGLangServer):
    """A running SGLang engine, updated by NCCL broadcast (SGLang's disaggregated route): the trainer
    joins a process group with the engine's workers as its rank 0 (`init_weights_update_group`),
    then each bucket is one `update_weights_from_distributed(load_format="flattened_bucket")`
    request and one broadcast of the bucket's flat buffer, which SGLang lays out again from the
    names, dtypes and shapes alone (back to back, in the order sent: mconv's layout, widest dtype
    first, is that order). The group opens at the first bucket and stays open until `close()`.

    `server`: SGLang's HTTP address ("http://host:30000") or a function `(route, payload) -> reply`
    that calls that route another way (for an in-process `sglang.Engine`: its method of the same
    name, minus the payload keys it does not take); a reply is a dict, a `(success, message)` tuple
    or an object with `.success` / `.message`. `master_address` / `master_port`: where the trainer's
    rank 0 hosts the group's TCPStore, which the engine's workers reach; `world_size`: SGLang's
    `tp_size` plus one (SGLang takes weights this way only at DP 1 and PP 1); `group_name`: unique
    per engine object (default: made from the process id and a counter); `backend`: "nccl" between
    GPUs ("gloo" on the CPU). `session=True` wraps each sync in `begin_weight_update` /
    `end_weight_update`, which SGLang >= 0.5.21 requires. At `finish` the version is set
    (`update_weight_version`, without aborting requests) and the radix cache flushed, waiting up to
    `flush_timeout` seconds for running requests to end.

    Failures: a request SGLang refuses is a RuntimeError naming the route and SGLang's message, at
    once (the trainer does not wait out its broadcast); the group is then dropped on both sides and
    made anew at the next bucket. SGLang cannot undo an update: `abort` ends its session (it would
    refuse the next one otherwise), and the engine holds a mix of old and new weights until a sync
    finishes. Only trainer rank 0 sends: `start` refuses a trainer with several pipeline stages
    (MconvError; SGLang would need one group per stage). SGLang cannot read its weights back in
    mconv's checksum, so verify=True is refused. Checked against sglang 0.5.23's own request types
    and receiving code (tests/test_weight_sync.py)."""

    _names = itertools.count(1)

    def __init__(self, server: str | Callable[[str, dict], object], *, master_address: str, master_port: int,
                 world_size: int, group_name: str | None = None, backend: str = "nccl", session: bool = True,
                 timeout: float = 600.0, flush_timeout: float = 60.0, api_key: str | None = None):
        super().__init__(server, session=session, timeout=timeout, flush_timeout=flush_timeout, api_key=api_key)
        self.master_address, self.master_port, self.world_size = master_address, int(master_port), int(world_size)
        self.group_name = group_name or f"mconv-{os.getpid()}-{next(self._names)}"
        self.backend = backend
        self._group = None
        self._store = None  # the groups' TCPStore, hosted here: it must live as long as they do
        self._joins = 0  # groups made so far: a group made anew after a failure gets a name of its own

    def update(self, bucket: FlatBucket) -> None:
        end = 0
        for entry in bucket.entries:
            if entry.offset != end:
                raise MconvError(f"bucket {bucket.index}: {entry.name} is not right after the tensor before it "
                                 "(SGLang lays a bucket out back to back; send tied lm_head.weight as a tensor of its own)")
            end += entry.nbytes
        bucket.wait()
        if self._group is None:
            self._joins += 1
            name = self.group_name if self._joins == 1 else f"{self.group_name}-{self._joins}"
            self._with_engine("init_weights_update_group", {
                "master_address": self.master_address, "master_port": self.master_port, "rank_offset": 1,
                "world_size": self.world_size, "group_name": name, "backend": self.backend},
                partial(self._join, name))
        name, group = self._group
        self._with_engine("update_weights_from_distributed", {
            "names": [e.name for e in bucket.entries], "dtypes": [e.dtype for e in bucket.entries],
            "shapes": [list(e.shape) for e in bucket.entries], "group_name": name,
            "load_format": "flattened_bucket", "flush_cache": False},
            lambda: dist.broadcast(bucket.buffer[:end], src=0, group=group))

    def close(self) -> None:
        super().close()
        self._drop_group()
        self._store = None

    def _with_engine(self, route: str, payload: dict, ours: Callable[[], object]) -> None:
        """Send `route` and do `ours` meanwhile: SGLang answers only once its side of the group
        operation (joining, receiving the broadcast) is done, which needs ours. A refusal or a
        failure of ours raises at once; the group is then dropped (SGLang's side too)."""
        pool = ThreadPoolExecutor(2)
        try:
            reply, done = pool.submit(self._call, route, payload), pool.submit(ours)
            finished, _ = wait([reply, done], timeout=self.timeout, return_when=FIRST_EXCEPTION)
            failed = [f for f in finished if f.exception() is not None]
            if failed or len(finished) < 2:
                self._drop_group(pending=not done.done())
                if failed:
                    raise failed[0].exception()
                raise RuntimeError(f"SGLang did not answer {route} within {self.timeout:g} s")
        finally:
            pool.shutdown(wait=False)  # after a failure, the other side is not awaited

    def _join(self, name: str) -> None:
        """The group SGLang's workers join as ranks 1..world_size-1, made as SGLang makes theirs
        (sglang.srt.utils.init_custom_process_group: a TCPStore at tcp://master_address:master_port
        prefixed by the group's name), with this process as rank 0 hosting the store."""
        from torch.distributed.distributed_c10d import _new_process_group_helper, _world

        if dist.is_initialized() and getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None):
            # torch would split the new group from the trainer's world communicator: a collective of
            # trainer ranks that never join, which hangs
            raise MconvError("SGLangDistributedEngine cannot make its group beside a default process group bound to "
                             "a device (init_process_group(device_id=...)); start the trainer's group without device_id")
        if self._store is None:  # one store for every group this engine makes, each under its own name
            self._store = dist.TCPStore(self.master_address, self.master_port, self.world_size, is_master=True,
                                        timeout=timedelta(seconds=self.timeout), wait_for_workers=False)
        group, _ = _new_process_group_helper(self.world_size, 0, [], dist.Backend(self.backend),
                                             dist.PrefixStore(name, self._store), group_name=name,
                                             timeout=timedelta(seconds=self.timeout))
        _world.pg_group_ranks[group] = {i: i for i in range(self.world_size)}
        self._group = (name, group)

    def _drop_group(self, pending: bool = False) -> None:
        """Leave the update group, SGLang's side too. Where our side's work is still `pending` on
        another thread (SGLang refused before receiving), an NCCL group is aborted and a gloo one
        left to time out (each group made has a name of its own; they share one store)."""
        held, self._group = self._group, None
        if held is not None:
            try:
                self._call("destroy_weights_update_group", {"group_name": held[0]})
            except RuntimeError:
                pass  # SGLang may never have made it, or already dropped it
            if not pending:
                dist.destroy_process_group(held[1])
            elif self.backend == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
                dist.distributed_c10d._abort_process_group(held[1])


def _post_json(base: str, route: str, payload: dict, timeout: float, api_key: str | None = None) -> dict:
    """SGLang's `route` (http.call_json): GET for `server_info`, `flush_cache`'s one argument as a
    query parameter. Returns SGLang's JSON reply ({"success", "message"} for the weight routes), or
    {} for a plain-text success (flush_cache); a refusal comes back as the reply, "success" False."""
    if route == "flush_cache":
        route, payload = f"flush_cache?timeout={float(payload.get('timeout', 0))!r}", {}
    return call_json(base, route, None if route == "server_info" else payload, timeout=timeout, api_key=api_key,
                     server=f"SGLang at {base}")
