"""Hugging Face checkpoints, written: a streaming sharded safetensors writer whose shard headers
are known before any tensor is written, and the staging memory its batches go through."""
from __future__ import annotations

import bisect
import json
import os
import struct
from pathlib import Path
from typing import Callable

import torch

from mconv.converter import file_io, fp8
from mconv.converter.hf_experts import stacked_expert
from mconv.converter.hf_io import DTYPE_CODES, INDEX_NAME, SINGLE_NAME, _itemsize, _numel
from mconv.errors import MconvError


ALIGN = 64  # bytes: staged tensors keep their file offset's alignment up to this


class StagingBuffer:
    """A reusable block of host memory for one thread's batches. Fresh memory costs a page fault
    per 4 KiB page on first touch (measured on the 2-core VM: 4.2 s per GB, against 0.3 s to copy
    into memory already touched), so batch after batch goes through the same pages; a request
    larger than `keep` bytes (one huge tensor) gets memory of its own, released after the batch."""

    def __init__(self, keep: int = 256 * 2**20):
        self.keep, self.memory = keep, torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.keep:
            return torch.empty(nbytes, dtype=torch.uint8)
        if nbytes > self.memory.numel():
            self.memory = torch.empty(max(nbytes, min(self.keep, 2 * self.memory.numel())), dtype=torch.uint8)
        return self.memory[:nbytes]


def plan_shards(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_bytes: int) -> list[list[int]]:
    """Group tensors (in order) into shards of at most max_shard_bytes; a larger tensor gets its own."""
    shards, current, size = [], [], 0
    for i, (_, dtype, shape) in enumerate(entries):
        nbytes = _numel(shape) * _itemsize(dtype)
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        shards.append(current)
    return shards


class ShardedSafetensorsWriter:
    """Writes HF safetensors shards whose headers are known in advance.

    Every tensor's file and byte offset is fixed before any data is written, so tensors can be
    written in any order, by any process, one at a time: memory holds one tensor, not a shard.
    """

    def __init__(self, directory: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_bytes: int, stack_experts: str | None = None,
                 per_expert: Callable[[str], bool] | None = None, quantization: fp8.Quantization | None = None):
        """`entries`: the HF tensors (name, dtype, shape) to write. `stack_experts` ("4.x" or "5.x", see
        ORIENTATIONS): per-expert tensors `<p>.mlp.experts.{e}.gate_proj.weight` ... are written into
        stacked `<p>.mlp.experts.gate_up_proj` / `down_proj` tensors of that orientation, but those for
        whose name `per_expert` holds. `quantization`: the weights it picks are written in FP8 with
        their scales (fp8.quantized_entries; `kept`: the modules kept in 16-bit); those are given to
        `write` quantized, but for stacked experts, which `write` quantizes itself (`quantizes`), each
        expert's matrix as stored (gate and up together, in the output orientation) once its modules
        have come, by fp8.quantize: transformers' stacked FP8 form, scales `<stacked>_scale_inv`."""
        self.dir = Path(directory)
        self.plain = entries  # (as given: the unquantized dtypes config.json records)
        self.views: dict[str, tuple[str, int, int, int]] = {}  # per-expert name -> (stacked, expert, part, parts)
        self.experts: dict[str, int] = {}  # stacked name -> experts
        if stack_experts is not None:
            entries = self._stack(entries, stack_experts == "4.x", per_expert or (lambda name: False))
        self.quantization, self.kept = quantization, []
        if quantization is not None:
            entries, self.kept = fp8.quantized_entries(entries, quantization)
        self.transposed = stack_experts == "4.x"
        self._pending: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        self.entries = entries
        shards = plan_shards(entries, max_shard_bytes)
        # transformers' names: model.safetensors alone, or numbered shards and an index.
        self.files = ([SINGLE_NAME] if len(shards) == 1 else
                      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        self.location: dict[str, tuple[str, int, int]] = {}  # name -> (file, absolute offset, nbytes)
        self.headers: list[bytes] = []
        for file, members in zip(self.files, shards):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for i in members:
                name, dtype, shape = entries[i]
                nbytes = _numel(shape) * _itemsize(dtype)
                header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape),
                                "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
            self.headers.append(struct.pack("<Q", len(raw)) + raw)
            base = 8 + len(raw)
            for i in members:
                name = entries[i][0]
                start, stop = header[name]["data_offsets"]
                self.location[name] = (file, base + start, stop - start)
        self.total_size = sum(nbytes for _, _, nbytes in self.location.values())
        self._fds: dict[str, int] = {}

    def _stack(self, entries: list, transposed: bool, per_expert: Callable[[str], bool]) -> list:
        """The entries with per-expert tensors replaced by their stacked tensors (placed where the
        first expert's first module was)."""
        grouped: dict[str, list] = {}
        for name, dtype, shape in entries:
            view = None if per_expert(name) else stacked_expert(name)
            if view is not None:
                self.views[name] = view
                grouped.setdefault(view[0], []).append((dtype, shape))
        stacked_entries, done = [], set()
        for name, dtype, shape in entries:
            if name not in self.views:
                stacked_entries.append((name, dtype, shape))
                continue
            stacked, _, _, parts = self.views[name]
            if stacked not in done:
                done.add(stacked)
                (section, fan_in), experts = shape, len(grouped[stacked]) // parts
                self.experts[stacked] = experts
                stacked_entries.append((stacked, dtype, (experts, fan_in, section * parts) if transposed
                                        else (experts, section * parts, fan_in)))
        return stacked_entries

    def create(self) -> "ShardedSafetensorsWriter":
        """Create the shard files, each with its header. Returns the writer, which a `with` block
        closes (`close`; on an error, `abandon`)."""
        try:
            for file, header in zip(self.files, self.headers):
                fd = os.open(self.dir / file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
                self._fds[file] = fd
                file_io.pwrite_all(fd, memoryview(header), 0)
        except BaseException:
            self.abandon()
            raise
        return self

    def open_existing(self) -> "ShardedSafetensorsWriter":
        """Attach to shard files another process created (parallel writers); returns the writer, as
        `create` does."""
        try:
            for file in self.files:
                self._fds[file] = os.open(self.dir / file, os.O_RDWR)
        except BaseException:
            self.abandon()
            raise
        return self

    def __enter__(self) -> "ShardedSafetensorsWriter":
        return self

    def __exit__(self, error_type, *_) -> None:
        if error_type is None:
            self.close()
        else:
            self.abandon()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor (any order). A per-expert tensor of stacked experts goes into its stacked
        tensor; in the transposed orientation, and where they are quantized (`quantizes`), the
        modules of one expert (gate and up) are held until all have come (the exporter writes them
        together) and written as the expert's one range (and its scales')."""
        if name not in self.views:
            return self._write_at(name, tensor, *self.location[name])
        stacked, expert, part, parts = self.views[name]
        file, offset, nbytes = self.location[stacked]
        slice_bytes = nbytes // self.experts[stacked]
        quantized = self.quantizes(name)
        if not self.transposed and not quantized:
            section = slice_bytes // parts
            return self._write_at(name, tensor, file, offset + expert * slice_bytes + part * section, section)
        pending = self._pending.setdefault((stacked, expert), {})
        pending[part] = tensor
        if len(pending) < parts:
            return
        del self._pending[(stacked, expert)]
        whole = torch.cat([pending[i] for i in range(parts)])
        whole = whole.T if self.transposed else whole
        if quantized:
            whole, scale = fp8.quantize(whole, self.quantization.scale_fmt, f"tensor {stacked} (expert {expert})")
            scale_file, scale_offset, scale_bytes = self.location[fp8.scale_name(stacked)]
            scale_bytes //= self.experts[stacked]
            self._write_at(fp8.scale_name(stacked), scale, scale_file, scale_offset + expert * scale_bytes, scale_bytes)
        self._write_at(stacked, whole, file, offset + expert * slice_bytes, slice_bytes)

    def quantizes(self, name: str) -> bool:
        """Whether `name` is an expert's module of stacked experts written in FP8: `write` takes it
        unquantized, and quantizes its expert's matrix."""
        view = self.views.get(name)
        return view is not None and fp8.scale_name(view[0]) in self.location

    def _write_at(self, name: str, tensor: torch.Tensor, file: str, offset: int, nbytes: int) -> None:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise MconvError(f"internal: {name} has {data.nbytes} bytes, its header promised {nbytes}")
        self._pwrite(file, memoryview(data), offset)

    def _pwrite(self, file: str, view: memoryview, offset: int) -> None:
        file_io.pwrite_all(self._fds[file], view, offset)

    def place(self, name: str) -> tuple[str, int] | None:
        """(file, byte offset) where tensor `name` is one contiguous byte range of the output, or
        None where the writer rearranges it (an expert of transposed or quantized stacked experts)."""
        if name not in self.views:
            return self.location[name][:2]
        if self.transposed or self.quantizes(name):
            return None
        stacked, expert, part, parts = self.views[name]
        file, offset, nbytes = self.location[stacked]
        slice_bytes = nbytes // self.experts[stacked]
        return file, offset + expert * slice_bytes + part * (slice_bytes // parts)

    def stage(self, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], buffer: "StagingBuffer",
              first_row: int = 0) -> "StagedBatch":
        """Memory laid out as the output files' bytes for `tensors` (name, dtype, shape), in
        `buffer` (reused from batch to batch, so its pages are not faulted in again): see
        StagedBatch. A tensor that is not one aligned byte range of the output (transposed stacked
        experts) gets its own tensor, which `flush` hands to `write`. With `first_row`, `tensors`
        is one tensor's rows from that row on (`shape` those rows'), a window of a large tensor."""
        placed, loose = [], {}
        for name, dtype, shape in tensors:
            where = self.place(name)
            if where is not None and first_row:
                where = (where[0], where[1] + first_row * _numel(shape[1:]) * dtype.itemsize)
            if where is None or where[1] % dtype.itemsize:
                if first_row:
                    raise MconvError(f"internal: {name} is staged by rows but is not one byte range of the output")
                loose[name] = torch.empty(shape, dtype=dtype)
            else:
                placed.append((*where, _numel(shape) * dtype.itemsize, name, dtype, shape))
        placed.sort(key=lambda p: p[:2])
        runs: list[list] = []  # [file, first offset, end, members]
        for file, offset, nbytes, *member in placed:
            if runs and runs[-1][0] == file and runs[-1][2] == offset:
                runs[-1][2] += nbytes
                runs[-1][3].append((offset, nbytes, *member))
            else:
                runs.append([file, offset, offset + nbytes, [(offset, nbytes, *member)]])
        # Each run starts at its file offset modulo ALIGN, so a tensor aligned in the file is aligned in memory.
        starts, total = [], 0
        for _, first, end, _ in runs:
            total += (first - total) % ALIGN
            starts.append(total)
            total += end - first
        memory = buffer.take(total)
        views = dict(loose)
        for (file, first, end, members), start in zip(runs, starts):
            for offset, nbytes, name, dtype, shape in members:
                at = start + offset - first
                views[name] = memory[at:at + nbytes].view(dtype).view(shape)
        return StagedBatch(self, memory, [(start, start + end - first, file, first)
                                          for (file, first, end, _), start in zip(runs, starts)], views, loose)

    def copy_range(self, source: int, file: str, offset: int, at: int, nbytes: int) -> bool:
        """Copy `nbytes` bytes at `offset` of the open input file `source` to byte `at` of output
        `file`, file to file in the kernel (`file_io.copy_range`). False where the kernel does not
        copy between these files or the input ends early: the caller writes the bytes itself."""
        return file_io.copy_range(source, offset, self._fds[file], at, nbytes)

    def close(self) -> None:
        """fsync and close the shard files (MconvError, once they are closed, where stacked experts
        were left incomplete)."""
        if self._pending:
            self.abandon()
            raise MconvError(f"internal: stacked experts left incomplete: {sorted(self._pending)[:2]}")
        try:
            for fd in self._fds.values():
                os.fsync(fd)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close the shard files unsynced: the writing stopped, and the output is removed."""
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def finish(self, side_dir: Path, config: dict, original: dict) -> None:
        """What an HF output holds besides its shards, once they are written and closed: the index
        (`write_index`), the generation config and tokenizer files of `side_dir`, config.json
        (`config`, an architecture's rewrite of the input's `original`, with the quantization_config
        of what was written in FP8: fp8.output_config) and its dtype, the unquantized one, as the FP8
        releases' config.json has it (hf_config.write_config_dtype)."""
        from mconv.converter.hf_config import copy_side_files, write_config_dtype, write_hf_config

        self.write_index()
        copy_side_files(side_dir, self.dir)
        write_hf_config(self.dir, fp8.output_config(config, self.quantization, self.kept), original)
        write_config_dtype(self.dir, self.plain)

    def write_index(self) -> None:
        """The index of a sharded output, as transformers' save_pretrained writes it (a single
        model.safetensors has none)."""
        if len(self.files) == 1:
            return
        weight_map = {name: self.location[name][0] for name, _, _ in self.entries}
        parameters = sum(_numel(shape) for _, _, shape in self.entries)
        index = {"metadata": {"total_parameters": parameters, "total_size": self.total_size}, "weight_map": weight_map}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


class StagedBatch:
    """A batch of output tensors staged by `ShardedSafetensorsWriter.stage`. `views`: each tensor's
    view into memory laid out as its range of the output files. Each view's bytes get to the
    output either through memory (fill the view; `flush` writes runs of adjacent tensors with one
    pwrite each) or, where they are bytes of an input file, by `copy`, file to file (those bytes
    are then left out of `flush`)."""

    def __init__(self, writer: ShardedSafetensorsWriter, memory: torch.Tensor, runs: list[tuple[int, int, str, int]],
                 views: dict[str, torch.Tensor], loose: dict[str, torch.Tensor]):
        self.writer, self.memory, self.views, self.loose = writer, memory, views, loose
        self.runs = runs  # (memory start, memory end, file, file offset), by memory start
        self.starts = [run[0] for run in runs]
        self.copied: list[tuple[int, int]] = []  # memory ranges whose bytes `copy` put in the output

    def copy(self, dest: torch.Tensor, ranges: list[tuple[int, int, int, int]]) -> bool:
        """Copy into the output, where `dest` (a contiguous part of a view) lands, the input file
        ranges `ranges` (file descriptor, file offset, byte offset in `dest`, bytes) that make up
        `dest`, file to file (`ShardedSafetensorsWriter.copy_range`). False where `dest` is not in
        the staged memory or the kernel does not copy: the caller fills `dest` instead."""
        lo = dest.data_ptr() - self.memory.data_ptr()
        hi = lo + dest.nbytes
        run = bisect.bisect_right(self.starts, lo) - 1
        if (not dest.is_contiguous() or run < 0 or hi > self.runs[run][1] or lo >= hi
                or sum(r[3] for r in ranges) != dest.nbytes):
            return False
        start, _, file, first = self.runs[run]
        for source, offset, at, nbytes in ranges:
            if not self.writer.copy_range(source, file, offset, first + lo - start + at, nbytes):
                return False
        self.copied.append((lo, hi))
        return True

    def flush(self) -> None:
        """Write what `copy` did not put in the output: the staged memory around the copied
        ranges, one pwrite per stretch, then the loose tensors."""
        copied = sorted(self.copied)
        for start, end, file, first in self.runs:
            at = start
            for lo, hi in copied[bisect.bisect_left(copied, (start,)):bisect.bisect_left(copied, (end,))]:
                self._write(file, first - start, at, lo)
                at = hi
            self._write(file, first - start, at, end)
        for name, tensor in self.loose.items():
            self.writer.write(name, tensor)

    def _write(self, file: str, shift: int, lo: int, hi: int) -> None:
        """pwrite memory [lo, hi) at file offset lo + shift."""
        if hi > lo:
            self.writer._pwrite(file, memoryview(self.memory[lo:hi].numpy()), lo + shift)
