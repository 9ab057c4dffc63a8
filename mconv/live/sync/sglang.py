"""SGLang: the flattened-bucket payload of a FlatBucket that `update_weights_from_tensor(
serialized_named_tensors=..., load_format="flattened_bucket")` reads (colocated, CUDA IPC; SGLang
>= 0.5.21: between `begin_weight_update()` and `end_weight_update()`), checked against sglang
0.5.23's own deserializer (MultiprocessingSerializer / SafeUnpickler) and FlattenedTensorBucket;
and `SGLangDistributedEngine`, the disaggregated route (a process group and one broadcast per
bucket)."""
from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler

from mconv.errors import MconvError
from mconv.live.sync.engines import Engine, FlatBucket
from mconv.transport.flat import _DTYPES


def sglang_payload(bucket: FlatBucket, tp_size: int = 1) -> list[str]:
    """`serialized_named_tensors` for an SGLang engine with `tp_size` TP ranks: one entry per rank
    (each rank deserializes only its own, for CUDA IPC reference counting), each the base64 of a
    ForkingPickler dump of {"flattened_tensor": bucket.buffer, "metadata": [...]}. The buffer
    pickles as one CUDA IPC handle on a GPU (a shared-memory storage on the CPU); the metadata are
    `types.SimpleNamespace(name, shape, dtype, start_idx, end_idx, numel)` (byte offsets), a
    class SGLang's allow-listing unpickler accepts. Keep `bucket.buffer` unchanged until SGLang's
    call has returned and its copies are done."""
    metadata = [SimpleNamespace(name=e.name, shape=torch.Size(e.shape), dtype=_DTYPES[e.dtype], start_idx=e.offset,
                                end_idx=e.offset + e.nbytes, numel=e.nbytes) for e in bucket.entries]
    payload = {"flattened_tensor": bucket.buffer, "metadata": metadata}
    entries = []
    for _ in range(tp_size):
        out = io.BytesIO()
        ForkingPickler(out).dump(payload)
        entries.append(base64.b64encode(out.getvalue()).decode())
    return entries


class SGLangDistributedEngine(Engine):
    """A running SGLang engine, updated by NCCL broadcast (SGLang's disaggregated route): the trainer
    joins a process group with the engine's workers as its rank 0 (`init_weights_update_group`),
    then each bucket is one `update_weights_from_distributed(load_format="flattened_bucket")`
    request and one broadcast of the bucket's flat buffer, which SGLang lays out again from the
    names, dtypes and shapes alone (back to back, in the order sent: mconv's layout, widest dtype
    first, is that order). The group opens at the first bucket and stays open until `close()`.

    `server`: SGLang's HTTP address ("http://host:30000") or a function `(route, payload) -> dict`
    that calls that route another way (an in-process `sglang.Engine`'s method of the same name; a
    (success, message) tuple is read as SGLang's reply). Raises RuntimeError naming the route
    SGLang refuses or does not answer.
    `master_address` / `master_port`: where the trainer's rank 0 hosts the group's TCPStore, which
    the engine's workers reach; `world_size`: the engine's workers (GPUs) plus one; `backend`:
    "nccl" between GPUs ("gloo" on the CPU). `session=True` wraps each sync in
    `begin_weight_update` / `end_weight_update`, which SGLang >= 0.5.21 requires. The radix cache is
    flushed once, at `finish`.

    SGLang has no way to abort an update: after a failed sync `end_weight_update` is not sent and
    the engine holds a mix of old and new weights until the next sync finishes. Only trainer rank
    0 sends: `start` refuses a trainer with several pipeline stages (MconvError; SGLang would need
    one group per stage). SGLang cannot read its weights back in mconv's checksum, so verify=True is
    refused. Checked against sglang 0.5.23's own request types and receiving code
    (tests/test_weight_sync.py)."""

    def __init__(self, server: str | Callable[[str, dict], dict], *, master_address: str, master_port: int,
                 world_size: int, group_name: str = "mconv_weight_update", backend: str = "nccl",
                 session: bool = True, timeout: float = 600.0):
        super().__init__()
        self._post = server if callable(server) else partial(_post_json, server.rstrip("/"), timeout=timeout)
        self.master_address, self.master_port, self.world_size = master_address, int(master_port), int(world_size)
        self.group_name, self.backend, self.session, self.timeout = group_name, backend, session, timeout
        self._group = None
        self._store = None  # the group's TCPStore, hosted here: it must live as long as the group
        self._version: str | None = None

    def start(self, version: str, verify: bool = False) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise MconvError("SGLangDistributedEngine sends from trainer rank 0 only, and this trainer has "
                             f"{parallel_state.get_pipeline_model_parallel_world_size()} pipeline stages (PP > 1 is "
                             "not supported)")
        self._version = version
        if self.session:
            self._call("begin_weight_update", {})

    def update(self, bucket: FlatBucket) -> None:
        end = 0
        for entry in bucket.entries:
            if entry.offset != end:
                raise MconvError(f"bucket {bucket.index}: {entry.name} is not right after the tensor before it "
                                 "(SGLang lays a bucket out back to back; send tied lm_head.weight as a tensor of its own)")
            end += entry.nbytes
        bucket.wait()
        if self._group is None:
            self._group = self._with_engine("init_weights_update_group", {
                "master_address": self.master_address, "master_port": self.master_port, "rank_offset": 1,
                "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend},
                self._join)
        self._with_engine("update_weights_from_distributed", {
            "names": [e.name for e in bucket.entries], "dtypes": [e.dtype for e in bucket.entries],
            "shapes": [list(e.shape) for e in bucket.entries], "group_name": self.group_name,
            "load_format": "flattened_bucket", "flush_cache": False, "weight_version": self._version},
            lambda: dist.broadcast(bucket.buffer[:end], src=0, group=self._group))

    def finish(self, version: str) -> None:
        if self.session:
            self._call("end_weight_update", {})
        self._call("flush_cache", {})

    def close(self) -> None:
        super().close()
        if self._group is not None:
            group, self._group = self._group, None
            try:
                self._call("destroy_weights_update_group", {"group_name": self.group_name})
            finally:
                dist.destroy_process_group(group)
                self._store = None

    def _call(self, route: str, payload: dict) -> dict:
        reply = self._post(route, payload)
        if isinstance(reply, (tuple, list)) and reply and isinstance(reply[0], bool):  # sglang.Engine's methods
            reply = {"success": reply[0], "message": reply[1] if len(reply) > 1 else ""}
        if isinstance(reply, dict) and reply.get("success") is False:
            raise RuntimeError(f"SGLang refused {route}: {reply.get('message')}")
        return reply

    def _with_engine(self, route: str, payload: dict, ours: Callable[[], object]):
        """Send `route` and do `ours` meanwhile: SGLang answers only once its side of the group
        operation (joining, receiving the broadcast) is done, which needs ours."""
        pool = ThreadPoolExecutor(1)
        try:
            reply = pool.submit(self._call, route, payload)
            result = ours()
            reply.result(timeout=self.timeout)
            return result
        finally:
            pool.shutdown(wait=False)  # after a failure of ours, SGLang's reply is not awaited

    def _join(self):
        """The group SGLang's workers join as ranks 1..world_size-1, made as SGLang makes theirs
        (sglang.srt.utils.init_custom_process_group: a TCPStore at tcp://master_address:master_port
        prefixed by the group's name), with this process as rank 0 hosting the store."""
        from torch.distributed.distributed_c10d import _new_process_group_helper, _world

        self._store = store = dist.TCPStore(self.master_address, self.master_port, self.world_size, is_master=True,
                              timeout=timedelta(seconds=self.timeout))
        group, _ = _new_process_group_helper(self.world_size, 0, [], dist.Backend(self.backend),
                                             dist.PrefixStore(self.group_name, store), group_name=self.group_name,
                                             timeout=timedelta(seconds=self.timeout))
        _world.pg_group_ranks[group] = {i: i for i in range(self.world_size)}
        return group


def _post_json(base: str, route: str, payload: dict, timeout: float) -> dict:
    """POST `payload` as JSON to `base`/`route`. Returns SGLang's JSON reply ({"success", "message"}
    for the weight routes), or {} for a plain-text success (flush_cache). A refusal (HTTP 400 with
    JSON) comes back as the reply; anything else is a RuntimeError naming the route."""
    request = urllib.request.Request(f"{base}/{route}", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return dict(json.loads(body), success=False)
        except (ValueError, TypeError):
            raise RuntimeError(f"SGLang at {base} answered {route} with HTTP {e.code}: "
                               f"{body[:200].decode(errors='replace').strip()}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"SGLang at {base} did not answer {route}: {e}") from None
    try:
        return json.loads(body)
    except ValueError:
        return {}
