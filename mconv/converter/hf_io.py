"""Hugging Face checkpoints, read: a lazy slice reader (safetensors, or `.bin` pickles through
`hf_bin`) presenting stacked experts per expert and FP8 weights dequantized. config.json and the
files beside the weights are `hf_config`; the writer is `hf_write`."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from mconv.converter import file_io, fp8
from mconv.converter.hf_bin import BIN_INDEX_NAME, BIN_SINGLE_NAME, read_bin
from mconv.converter.hf_config import read_config, read_json
from mconv.converter.hf_experts import STACKED_EXPERTS, stacked_expert
from mconv.converter.options import dtype_name
from mconv.converter.transforms import checked_cast
from mconv.errors import MconvError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}


def check_convertible(dtype: torch.dtype, where, name: str) -> None:
    """MconvError naming tensor `name` in `where` (a file or checkpoint directory) for a dtype no
    safetensors file holds (a checkpoint's pickles may carry complex64, uint16, ...)."""
    if dtype not in DTYPE_CODES:
        raise MconvError(f"{where}: tensor {name} has dtype {dtype_name(dtype)}, which mconv does "
                         "not convert")


class FP8Weight(NamedTuple):
    """Where a presented FP8 weight's bytes and scales are: its stored tensor and its scale's, both
    in the weight's [out, in] orientation (expert_views for an expert's module of stacked
    experts), the scale's name, the row of the scales' matrix the weight starts at (a module's place
    in its expert's matrix; 0 for a plain weight) and the block in the weight's orientation."""

    info: "TensorInfo"
    scale: "TensorInfo"
    scale_name: str
    row: int
    block: tuple[int, int]


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0  # where the tensor's bytes start in the file
    # Nonzero for one expert's module inside a transposed (4.x) stacked tensor: the [out, in] matrix
    # is stored as `in` rows of this many elements, of which it owns the first `out`.
    transposed_stride: int = 0
    # A tensor of a `.bin` file: its memory-mapped tensor (or view), read from instead of `offset`.
    mapped: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _unique_keys(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file and where their bytes start.

    The safetensors library itself validates the file first (its rules: a header under 100 MB,
    known dtypes, byte ranges that match dtype x shape and tile the data section exactly, with no
    overlap, gap or byte past the end); mconv then reads the same header for the offsets, since it
    reads slices with pread rather than through the library. Raises MconvError naming the file."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():  # safe_open would block on a FIFO
        raise MconvError(f"{path} is not a regular file, so not a safetensors file")
    def header() -> tuple[int, dict]:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            return header_len, json.loads(f.read(header_len), object_pairs_hook=_unique_keys)

    try:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except SafetensorError as e:
            if "incomplete metadata" in str(e):  # say which: a partial download, or bytes past the end
                header_len, entries = header()
                end = 8 + header_len + max((v["data_offsets"][1] for k, v in entries.items() if k != "__metadata__"),
                                           default=0)
                size = path.stat().st_size
                if end > size:
                    raise MconvError(f"{path} is truncated: its header describes {end} bytes, the file has {size}")
            raise
        header_len, entries = header()
    except (OSError, ValueError, SafetensorError, struct.error, KeyError, TypeError, IndexError) as e:
        raise MconvError(f"{path} is not a valid safetensors file ({str(e).splitlines()[0]})") from None
    infos = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise MconvError(f"{path}: tensor {name} has dtype {entry['dtype']}, which mconv does not convert")
        start, stop = entry["data_offsets"]
        info = TensorInfo(path.name, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + header_len + start)
        if stop - start != info.nbytes:  # the library checked this with its own dtype sizes
            raise MconvError(f"{path}: tensor {name} has {stop - start} bytes for shape {entry['shape']}")
        infos[name] = info
    return infos


def _stacked_orientation(where: str, prefix: str, gate_up: tuple[int, ...], down: tuple[int, ...]) -> bool:
    """True for the transposed (4.x) orientation. Decided from both tensors, never from one: with
    gate_up [E, a, b] and down [E, c, d], 5.x has a == 2d and b == c, 4.x b == 2c and a == d; both
    at once would need d == 0, so a consistent pair always decides, even where one of them is square
    (hidden == 2 * moe_intermediate_size or hidden == moe_intermediate_size)."""
    (e, a, b), (e2, c, d) = gate_up, down
    linear, transposed = e == e2 and a == 2 * d and b == c, e == e2 and b == 2 * c and a == d
    if linear == transposed:
        raise MconvError(f"{where}: cannot tell the orientation of the stacked experts {prefix}.gate_up_proj "
                         f"{list(gate_up)} and down_proj {list(down)}: they fit neither transformers 5.x "
                         "([E, 2I, h] / [E, h, I]) nor 4.x ([E, h, 2I] / [E, I, h])")
    return transposed


def expand_stacked_experts(tensors: dict[str, TensorInfo], where: str) -> dict[str, TensorInfo]:
    """Present stacked experts (`<p>.mlp.experts.gate_up_proj` / `down_proj`, either orientation) as
    the per-expert tensors `<p>.mlp.experts.{e}.gate_proj.weight` ... `[out, in]` that the tables use
    (and that AReaL sends to inference engines). Nothing is read: each is a byte range of its
    stacked tensor (5.x), or a strided, transposed one (4.x)."""
    plain, stacks = {}, {}
    for name, info in tensors.items():
        prefix, _, proj = name.rpartition(".")
        if proj in STACKED_EXPERTS and prefix.endswith(".mlp.experts") and len(info.shape) == 3:
            stacks.setdefault(prefix, {})[proj] = info
        else:
            plain[name] = info
    for prefix, pair in stacks.items():
        for proj in STACKED_EXPERTS:
            if proj not in pair:
                raise MconvError(f"{where}: tensor {prefix}.{proj} is missing (stacked experts need both "
                                 f"{' and '.join(STACKED_EXPERTS)})")
        transposed = _stacked_orientation(where, prefix, pair["gate_up_proj"].shape, pair["down_proj"].shape)
        for proj, info in pair.items():
            for e, modules in enumerate(expert_views(info, transposed, len(STACKED_EXPERTS[proj]))):
                for part, view in zip(STACKED_EXPERTS[proj], modules):
                    plain[f"{prefix}.{e}.{part}.weight"] = view
    return plain


def expert_views(info: TensorInfo, transposed: bool, parts: int) -> list[list[TensorInfo]]:
    """Each expert's `parts` modules (along its output dimension) of a stacked tensor `info` [E, rows,
    cols], `[out, in]` (nn.Linear's orientation): byte ranges of the 5.x tensor, strided transposed
    ones of the 4.x tensor (`transposed`), or views of a `.bin` tensor's mapping. Block scales of
    stacked FP8 experts (`parts` 1) are presented the same way, in their weight's orientation."""
    experts, rows, cols = info.shape
    out, fan_in = (cols, rows) if transposed else (rows, cols)
    section, size = out // parts, _itemsize(info.dtype)
    views = []
    for e in range(experts):
        base, modules = info.offset + e * rows * cols * size, []
        for i in range(parts):
            if info.mapped is not None:
                expert = info.mapped[e]
                view = expert.narrow(1, i * section, section).T if transposed else expert.narrow(0, i * section, section)
                modules.append(TensorInfo(info.file, info.dtype, (section, fan_in), 0, out if transposed else 0, view))
            else:
                modules.append(TensorInfo(info.file, info.dtype, (section, fan_in), base + i * section * size, out)
                               if transposed else
                               TensorInfo(info.file, info.dtype, (section, fan_in), base + i * section * fan_in * size))
        views.append(modules)
    return views


class HFCheckpoint:
    """A HF model directory, read lazily: headers up front, tensor bytes only when sliced.
    Stacked experts appear as per-expert tensors (see expand_stacked_experts). Safetensors files
    are preferred, as transformers prefers them; without them, `.bin` pickles (hf_bin). It holds
    a descriptor per file until `close` (or the end of a `with` block)."""

    def __init__(self, directory: str | Path, dequantize: torch.dtype | None = None):
        """`dequantize`: present a block-wise FP8 checkpoint's weights as tensors of that dtype, each
        read dequantized (fp8.dequantize; its `weight_scale_inv` tensors hidden), after checking the
        quantization_config and every scale (`dequantized`); None: tensors as stored."""
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise MconvError(f"{self.dir} is not a directory")
        self.config = read_config(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        index_name, weight_map = self._weight_map()
        for file in [index_name] if weight_map is None else sorted(set(weight_map.values())):
            if file.endswith(".safetensors"):
                infos = read_safetensors_header(self.dir / file)
            else:
                infos = {name: TensorInfo(file, t.dtype, tuple(t.shape), mapped=t)
                         for name, t in read_bin(self.dir / file, DTYPE_CODES).items()}
            for name, info in infos.items():
                if name in self.tensors:
                    raise MconvError(f"{self.dir}: tensor {name} is in both {self.tensors[name].file} and {file}")
                self.tensors[name] = info
        for name, file in (weight_map or {}).items():
            if name not in self.tensors or self.tensors[name].file != file:
                raise MconvError(f"{self.dir / index_name} says tensor {name} is in {file}, but it is not there")
        stored = self.tensors
        self.tensors = expand_stacked_experts(stored, str(self.dir))
        # the stacked expert tensors as stored, which `tensors` presents per expert
        self._stacked_infos = {name: info for name, info in stored.items() if name not in self.tensors}
        self.stacked = {name: info.shape for name, info in self._stacked_infos.items()}  # name -> shape
        self.quantized: dict[str, FP8Weight] = {}  # presented FP8 weight -> where its bytes and scales are
        self.block = None
        if dequantize is not None:
            self.block, self.quantized, self.tensors = self.dequantized(dequantize)
        self._handles: dict[str, int] = {}
        try:
            for file in {info.file for info in self.tensors.values() if info.mapped is None}:  # up front: readers
                self._fd(file)  # may be threads
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def dequantized(self, dtype: torch.dtype) -> tuple[tuple[int, int] | None, dict, dict[str, TensorInfo]]:
        """Check a block-wise FP8 checkpoint (config.json's quantization_config: fp8.block_size; every
        float8 weight with a `weight_scale_inv` of the block grid's shape and a dtype of
        fp8.SCALE_DTYPES, every scale with its weight; stacked experts `<p>.gate_up_proj` [E, rows,
        cols] with `<p>.gate_up_proj_scale_inv` [E, ceil(rows/b0), ceil(cols/b1)], the grid of each
        expert's stored matrix, transformers' form) from its headers, leaving this checkpoint as it
        is: (its block, None if not quantized; {presented weight (each expert's module of stacked
        experts): FP8Weight}; the tensors with each such weight presented as `dtype` and the scales
        hidden). MconvError naming the field or tensor at fault."""
        where = self.dir / "config.json"
        block = fp8.block_size(self.config, where)
        tensors, quantized = dict(self.tensors), {}
        scales = [name for name in tensors if name.endswith(fp8.SCALE_SUFFIX)]
        if block is None:
            if scales:
                raise MconvError(f"{self.dir}: tensor {scales[0]} is a block scale, but {where} has no "
                                 "quantization_config saying how the checkpoint is quantized")
            return None, quantized, tensors
        for name in scales:
            weight = name.removesuffix(fp8.SCALE_SUFFIX)
            info, scale = tensors.get(weight, self._stacked_infos.get(weight)), tensors[name]
            if info is None:
                raise MconvError(f"{self.dir}: tensor {name} is the block scale of {weight}, which the checkpoint "
                                 "does not hold")
            stacked = weight in self.stacked
            expected = fp8.grid(info.shape, block) if len(info.shape) == (3 if stacked else 2) else None
            if info.dtype != fp8.FP8 or expected is None:
                raise MconvError(f"{self.dir}: tensor {weight} has a block scale but is "
                                 f"{dtype_name(info.dtype)} {list(info.shape)}, not a 2-D "
                                 "float8_e4m3fn weight (or 3-D stacked experts)")
            if scale.dtype not in fp8.SCALE_DTYPES or scale.shape != expected:
                raise MconvError(f"{self.dir}: tensor {name} is {dtype_name(scale.dtype)} "
                                 f"{list(scale.shape)}; {weight} {list(info.shape)} in blocks of {list(block)} "
                                 f"needs a float32, bfloat16 or float16 scale of shape {list(expected)}")
            del tensors[name]
            if not stacked:
                quantized[weight] = FP8Weight(info, scale, name, 0, block)
                tensors[weight] = replace(info, dtype=dtype, mapped=None)
                continue
            # each expert's modules, read as 2-D weights from their rows of the expert's stored matrix
            prefix, _, proj = weight.rpartition(".")
            parts = STACKED_EXPERTS[proj]
            transposed = bool(tensors[f"{prefix}.0.{parts[0]}.weight"].transposed_stride)
            expert_block = block[::-1] if transposed else block
            for e, (expert_scale,) in enumerate(expert_views(scale, transposed, 1)):
                for i, part in enumerate(parts):
                    module = f"{prefix}.{e}.{part}.weight"
                    view = tensors[module]
                    quantized[module] = FP8Weight(view, expert_scale, name, i * view.shape[0], expert_block)
                    tensors[module] = replace(view, dtype=dtype, mapped=None)
        for name, info in tensors.items():
            if info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and name not in quantized:
                view = stacked_expert(name)
                name = view[0] if view and view[0] in self.stacked else name
                raise MconvError(f"{self.dir}: tensor {name} is {dtype_name(info.dtype)} but has "
                                 f"no block scale {name}{fp8.SCALE_SUFFIX}")
        return block, quantized, tensors

    def _weight_map(self) -> tuple[str, dict[str, str] | None]:
        """(the index's name, its tensor -> file map), or (the single file's name, None): transformers'
        order, model.safetensors, its index, pytorch_model.bin, its index (a single file is preferred
        to an index beside it)."""
        for single_name, index_name in ((SINGLE_NAME, INDEX_NAME), (BIN_SINGLE_NAME, BIN_INDEX_NAME)):
            index, single = self.dir / index_name, self.dir / single_name
            if os.path.lexists(single) and (single.is_file() or not os.path.lexists(index)):
                return single_name, None
            if os.path.lexists(index):
                break
        else:
            raise MconvError(f"{self.dir} has no {SINGLE_NAME} or {INDEX_NAME} (nor {BIN_SINGLE_NAME} or "
                             f"{BIN_INDEX_NAME})")
        weight_map = read_json(index, "the index of a sharded model").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise MconvError(f"{index} has no 'weight_map' object of tensor names and file names")
        for file in sorted(set(weight_map.values())):
            if Path(file).name != file or file in ("", ".", ".."):
                raise MconvError(f"{index} names {file!r}, which is not a file in {self.dir}")
            if not (self.dir / file).is_file():
                raise MconvError(f"{self.dir / file} is listed in {INDEX_NAME} but "
                                 f"{'is not a regular file' if os.path.lexists(self.dir / file) else 'does not exist'}")
        return index_name, weight_map

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Read the [start, stop) range of a tensor along dim 0 or 1 (the whole tensor by default).
        Thread-safe.

        Bytes are read with pread straight into the result, not memory-mapped, so what was read
        does not stay resident: memory holds the slices being converted, nothing else.
        """
        info = self.tensors[name]
        shape = list(info.shape)
        if start is None:
            start, stop = 0, (shape[dim] if shape else 1)
        out_shape = shape[:dim] + [stop - start] + shape[dim + 1:] if shape else []
        out = torch.empty(out_shape, dtype=info.dtype)
        self.read_into(name, dim, start, stop, out)
        return out

    def read_into(self, name: str, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
        """`read` into an existing contiguous CPU tensor of the slice's shape (and of the tensor's
        dtype, or another: then the slice is read and cast, torch's cast, as hf2mcore --dtype asks;
        MconvError where that turns finite values into inf, transforms.check_cast)."""
        if name in self.quantized:
            return self._dequantize_into(name, dim, start, stop, out)
        info = self.tensors[name]
        if out.dtype != info.dtype:
            out.copy_(checked_cast(name, self.read(name, dim, start, stop), out.dtype))
            return
        self._read_stored(info, dim, start, stop, out)

    def _dequantize_into(self, name: str, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
        """An FP8 weight's range, dequantized straight into `out`'s dtype from the FP8 bytes of the
        range and the scales of the blocks it touches (never the whole weight). MconvError naming the
        scale tensor where those scales are not finite, are negative, are zero for a block that is not
        all zeros, are positive but below float32's smallest normal, or make a weight overflow `out`'s
        dtype to inf (a corrupt file: no quantizer writes them)."""
        info, scale_info, scale_name, row, block = self.quantized[name]
        shape = list(info.shape)
        shape[dim] = stop - start
        q = torch.empty(shape, dtype=info.dtype)
        self._read_stored(info, dim, start, stop, q)
        # where the range lies in the matrix the blocks tile (an expert's module: from its row `row` on)
        origin = [row, 0]
        origin[dim] += start
        first = [o // b for o, b in zip(origin, block)]
        last = [-(-(o + n) // b) for o, n, b in zip(origin, shape, block)]
        scale_shape = list(scale_info.shape)
        scale_shape[dim] = last[dim] - first[dim]
        scale = torch.empty(scale_shape, dtype=scale_info.dtype)
        self._read_stored(scale_info, dim, first[dim], last[dim], scale)
        scale = scale.narrow(1 - dim, first[1 - dim], last[1 - dim] - first[1 - dim])
        where = self.dir / scale_info.file  # every refusal names the file holding the scale
        if not torch.isfinite(scale).all() or (scale < 0).any():
            raise MconvError(f"{where}: tensor {scale_name} holds inf, NaN or negative block scales")
        tiny = torch.finfo(torch.float32).tiny
        if ((scale > 0) & (scale.float() < tiny)).any():  # it would zero its block, or nearly
            raise MconvError(f"{where}: tensor {scale_name} holds a block scale below "
                             f"float32's smallest normal ({tiny:.3g}), which no FP8 quantizer writes (an all-zero "
                             "block's is 2^-23)")
        if (scale == 0).any():  # a zero scale is only what an all-zero block may have: elsewhere it zeroes weights
            per_element = fp8.dequantize(torch.ones(q.shape), scale, torch.float32, origin, block)
            if ((per_element == 0) & (q.float() != 0)).any():
                raise MconvError(f"{where}: tensor {scale_name} holds a zero block scale for a block of "
                                 f"{name} that is not all zeros")
        fp8.dequantize(q, scale, out.dtype, origin, block, out=out)
        # e4m3 holds no inf: a scale too large for the dtype made it. One reduction pass, no mask;
        # aminmax propagates NaN (e4m3's NaN code), and then the mask decides.
        low, high = torch.aminmax(out) if out.numel() else (out.new_zeros(()), out.new_zeros(()))
        if low.isinf() or high.isinf() or (low.isnan() and torch.isinf(out).any()):
            raise MconvError(f"{where}: tensor {scale_name} holds block scales so large "
                             f"that {name} dequantized into {dtype_name(out.dtype)} overflows to inf")

    def _read_stored(self, info: TensorInfo, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a stored tensor, into `out` of its dtype."""
        if info.mapped is not None:  # a .bin tensor: copied from its mapping
            whole = not info.shape or (start == 0 and stop == info.shape[dim])
            out.copy_(info.mapped if whole else info.mapped.narrow(dim, start, stop - start))
            return
        if info.transposed_stride:
            return self._read_transposed(info, dim, start, stop, out)
        shape = list(info.shape)
        inner = _numel(shape[dim + 1:]) * _itemsize(info.dtype)  # bytes of one step along dim
        buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        fd = self._fd(info.file)
        if dim == 0 or not shape or (start == 0 and stop == shape[dim]):  # one contiguous range
            self._pread(fd, buffer, info.offset + start * inner)
        else:
            row, piece = shape[dim] * inner, (stop - start) * inner
            for r in range(_numel(shape[:dim])):
                self._pread(fd, buffer[r * piece:(r + 1) * piece], info.offset + r * row + start * inner)

    def byte_range(self, name: str, start: int, stop: int) -> tuple[int, int, int, str] | None:
        """(open file descriptor, byte offset, bytes, path) of rows [start, stop) of tensor `name`,
        which are one contiguous range of its file; None for an expert of transposed stacked experts
        and for a `.bin` tensor."""
        info = self.tensors[name]
        if info.transposed_stride or info.mapped is not None or name in self.quantized:
            return None
        inner = _numel(info.shape[1:]) * _itemsize(info.dtype)
        return self._fd(info.file), info.offset + start * inner, (stop - start) * inner, str(self.dir / info.file)

    def _read_transposed(self, info: TensorInfo, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
        """One expert's module of a 4.x stacked tensor: the stored rows it needs (all of them for a
        range of output rows, else the range) are read in one pread, at most the expert's slice."""
        out_dim, fan_in = info.shape
        stride, size = info.transposed_stride, _itemsize(info.dtype)
        first, last = (start, stop) if dim == 1 else (0, fan_in)
        block = torch.empty((last - first - 1) * stride + out_dim, dtype=info.dtype)
        self._pread(self._fd(info.file), memoryview(block.view(torch.uint8).numpy()), info.offset + first * stride * size)
        stored = block.as_strided((last - first, out_dim), (stride, 1))
        out.copy_((stored[:, start:stop] if dim == 0 else stored).T)

    def _fd(self, file: str) -> int:
        if file not in self._handles:
            self._handles[file] = os.open(self.dir / file, os.O_RDONLY)
        return self._handles[file]

    def _pread(self, fd: int, buffer: memoryview, offset: int) -> None:
        file_io.pread_all(fd, buffer, offset, lambda: f"{self.dir}: a safetensors file ended early (changed while "
                                                      "reading?)")

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()


def tensor_difference(name: str, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """How two tensors of one name differ (dtype and shape, else bytes), or None if bit-identical."""
    if x.dtype != y.dtype or x.shape != y.shape:
        a, b = (f"{dtype_name(t.dtype)} {list(t.shape)}" for t in (x, y))
        return f"{name}: {a} vs {b}"
    if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
        return f"{name}: values differ"
    return None
