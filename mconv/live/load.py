"""load_hf_weights: an HF checkpoint into a trainer's sharded Megatron model, each rank reading only
the slices it owns."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.options import check_count
from mconv.converter.planner import TensorTask
from mconv.converter.transforms import split_into
from mconv.errors import MconvError
from mconv.live.chunks import LiveModel, _buckets, _model_dir
from mconv.live.schedule import _checked

STAGE_BYTES = 256 * 2**20  # pinned staging for loads to a GPU


def load_hf_weights(model_chunks: Sequence[torch.nn.Module], hf_dir: str | Path, threads: int = 8,
                    staged: bool | None = None, revision: str | None = None) -> None:
    """Copy the HF checkpoint into this rank's parameters. Each rank reads only the slices it owns
    (its TP/ETP shard, its PP stage's layers, its EP rank's experts), straight from the files:
    `threads` readers run ahead; for a model on a GPU (or with `staged=True`) they read into a
    staging buffer that reaches the device in large copies. `hf_dir` is a directory or a hub name
    (`Qwen/Qwen3-8B` at `revision`, fetched into the hub cache as transformers does)."""
    model_chunks, _ = _checked(model_chunks, 1, None)
    check_count(threads, "threads")
    dtype = next(p.dtype for chunk in model_chunks for p in chunk.parameters())
    with HFCheckpoint(_model_dir(hf_dir, revision, True), dequantize=dtype) as ckpt:
        live = LiveModel.of(model_chunks, ckpt.config)
        jobs = []
        for tasks, tensors in zip(live.plan.chunks, live.tensors):
            for task in tasks:
                if task.shard is None:
                    continue
                for name, shape in zip(task.hf, task.hf_shapes):
                    if name not in ckpt.tensors:
                        raise MconvError(f"{ckpt.dir}: tensor {name} is missing from the checkpoint")
                    if ckpt.tensors[name].shape != shape:
                        raise MconvError(f"{ckpt.dir}: tensor {name} has shape {list(ckpt.tensors[name].shape)}, "
                                         f"config.json implies {list(shape)}")
                jobs.append((task, tensors[task.megatron]))
        if staged if staged is not None else any(dest.is_cuda for _, dest in jobs):
            _load_staged(ckpt, jobs, threads)
        else:
            def load(task: TensorTask, dest: torch.Tensor) -> None:
                split_into(task.shard, lambda s, dim, a, b: ckpt.read(task.hf[s], dim, a, b), dest)

            with ThreadPoolExecutor(max(1, threads)) as pool:
                for future in [pool.submit(load, task, dest) for task, dest in jobs]:
                    future.result()


def _load_staged(ckpt: HFCheckpoint, jobs: list, threads: int) -> None:
    """Pieces are read by `threads` readers straight into a staging buffer (pinned when the model
    is on a GPU), which goes to the device in one copy per STAGE_BYTES; the pieces then move into
    the parameters device-side, cast to the parameters' dtype. (Copying many small host tensors
    one by one costs milliseconds each.) Two staging buffers alternate, so reading the next batch
    overlaps the copies of the last."""
    pieces = []  # (HF name, dim, piece, destination view of the parameter, dtype on disk)
    for task, dest in jobs:
        offset = 0
        for p in task.shard.pieces:
            name = task.hf[p.source]
            pieces.append((name, task.shard.dim, p, dest.narrow(task.shard.dim, offset, p.length),
                           ckpt.tensors[name].dtype))
            offset += p.length
        if task.shard.pad:
            dest.narrow(task.shard.dim, offset, task.shard.pad).zero_()

    def nbytes(piece) -> int:
        return -(-piece[3].numel() * piece[4].itemsize // 64) * 64  # 64-byte aligned slots

    device = jobs[0][1].device
    on_gpu = device.type == "cuda"
    stage = max([STAGE_BYTES] + [nbytes(piece) for piece in pieces])
    host = [torch.empty(stage, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(2)]
    staging = [torch.empty(stage, dtype=torch.uint8, device=device) for _ in range(2)]
    done = [None, None]

    def slot(buffer: torch.Tensor, start: int, piece) -> torch.Tensor:
        _, _, _, dest, dtype = piece
        return buffer[start:start + dest.numel() * dtype.itemsize].view(dtype).view(dest.shape)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for i, batch in enumerate(_buckets(pieces, nbytes, stage)):
            k = i % 2
            if done[k] is not None:
                done[k].synchronize()  # the previous copies out of this staging buffer have finished
            starts, futures, offset = [], [], 0
            for piece in batch:
                name, dim, p, _, _ = piece
                starts.append(offset)
                futures.append(pool.submit(ckpt.read_into, name, dim, p.start, p.stop, slot(host[k], offset, piece)))
                offset += nbytes(piece)
            for future in futures:
                future.result()
            staging[k][:offset].copy_(host[k][:offset], non_blocking=True)
            for start, piece in zip(starts, batch):
                piece[3].copy_(slot(staging[k], start, piece), non_blocking=True)
            if on_gpu:
                done[k] = torch.cuda.Event()
                done[k].record()
    for task, dest in jobs:
        if task.shard.offset:  # stream-ordered after the copies into it
            dest.add_(task.shard.offset)
    if on_gpu:
        torch.cuda.synchronize()
