"""SGLang's flattened-bucket payload of a FlatBucket: what `update_weights_from_tensor(
serialized_named_tensors=..., load_format="flattened_bucket")` reads (SGLang >= 0.5.21: between
`begin_weight_update()` and `end_weight_update()`). Checked against sglang 0.5.23's own
deserializer (MultiprocessingSerializer / SafeUnpickler) and FlattenedTensorBucket."""
from __future__ import annotations

import base64
import io
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch
import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler

from mconv.live.sync.engines import FlatBucket
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
