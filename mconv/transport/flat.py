"""Flat buckets: the tensors of one weight-sync bucket laid out in one contiguous uint8 buffer, so a
bucket travels as one handle, one copy or one broadcast, never one per tensor.

Tensors are placed widest element first with no padding: every byte offset is then a multiple of
its tensor's element size (a `view(dtype)` of the buffer needs that), which is the layout vLLM's
packed tensors and SGLang's FlattenedTensorBucket read back without padding of their own.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the form vLLM's and SGLang's update requests carry."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Entry:
    """One tensor of a flat bucket: its bytes are buffer[offset:offset + nbytes]."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_json(cls, item: Sequence) -> "Entry":
        name, dtype, shape, offset, nbytes = item
        if dtype not in _DTYPES:
            raise ValueError(f"flat bucket entry {name}: unknown dtype {dtype!r}")
        return cls(str(name), dtype, tuple(int(s) for s in shape), int(offset), int(nbytes))


def layout(named: Sequence[tuple[str, torch.Tensor]], aliases: dict[str, str] | None = None) -> tuple[list[Entry], int]:
    """The entries of a flat bucket holding `named` ([(name, tensor)]) and its size in bytes.

    Widest dtype first (stable otherwise), back to back. `aliases` {new name: name in `named`} adds
    entries that share an existing tensor's bytes (e.g. lm_head.weight for tied embeddings).
    """
    order = sorted(range(len(named)), key=lambda i: -named[i][1].element_size())
    entries, offset, by_name = [], 0, {}
    for i in order:
        name, tensor = named[i]
        nbytes = tensor.numel() * tensor.element_size()
        by_name[name] = Entry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes)
        entries.append(by_name[name])
        offset += nbytes
    for alias, name in (aliases or {}).items():
        if name in by_name:
            entries.append(Entry(alias, *[getattr(by_name[name], f) for f in ("dtype", "shape", "offset", "nbytes")]))
    return entries, offset


def pack(named: Sequence[tuple[str, torch.Tensor]], entries: Sequence[Entry], buffer: torch.Tensor) -> None:
    """Copy `named` into `buffer` (uint8, at least the layout's size) at their entries' offsets:
    a few batched copies (copy_all), not one launch per tensor."""
    tensors = dict(named)
    copy_all([(view, tensors[entry.name]) for entry, view in _views(buffer, entries)
              if entry.name in tensors])  # an alias shares its target's bytes


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for every (dst, src) pair (same shapes and dtypes), as one torch._foreach_copy_
    per dtype and device: on a GPU a multi-tensor kernel copies many tensors per launch where both
    sides are contiguous (each group of non-contiguous sources takes torch's per-tensor route)."""
    groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    for dst, src in pairs:
        dsts, srcs = groups[dst.dtype, dst.device, src.device, src.is_contiguous() and dst.is_contiguous()]
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)


def checksums(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """{name: checksum of the tensor's bytes}: the same integer for the same bytes whatever the
    device, torch version or process (exact integer sums, no floating point), and position
    sensitive (bytes moved or changed almost surely change it). One host transfer for all."""
    if not named:
        return {}
    sums = [_checksum(tensor) for _, tensor in named]
    values = torch.stack([s.to(sums[0].device) for s in sums]).tolist()
    return {name: value for (name, _), value in zip(named, values)}


_CHUNK = 1 << 22  # 16-bit words per partial sum: each stays below 2**53, and the int64 temporaries small


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """sum over the tensor's bytes, read as little-endian int16 words w[i] (a zero byte appended to
    an odd count), of w[i] * (i % 65521 + 1), as an int64 tensor on the tensor's device."""
    data = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    if data.numel() % 2:
        data = torch.cat([data, data.new_zeros(1)])
    words = data.view(torch.int16)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=data.device) % 65521 + 1
        total += (part * weights).sum()
    return total


def unpack(buffer: torch.Tensor, entries: Sequence[Entry]) -> list[tuple[str, torch.Tensor]]:
    """[(name, view of `buffer`)] of a flat bucket: no copy."""
    return [(entry.name, view) for entry, view in _views(buffer, entries)]


def _views(buffer: torch.Tensor, entries: Sequence[Entry]) -> Iterator[tuple[Entry, torch.Tensor]]:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"a flat bucket buffer is 1-D uint8, not {buffer.dtype} {list(buffer.shape)}")
    typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer viewed as each dtype once: two ops per entry
    for entry in entries:
        if entry.offset < 0 or entry.offset + entry.nbytes > buffer.numel():
            raise ValueError(f"flat bucket entry {entry.name}: bytes {entry.offset}..{entry.offset + entry.nbytes} "
                             f"outside the {buffer.numel()}-byte buffer")
        dtype = _DTYPES[entry.dtype]
        numel = math.prod(entry.shape)
        if numel * dtype.itemsize != entry.nbytes or entry.offset % dtype.itemsize:
            raise ValueError(f"flat bucket entry {entry.name}: {entry.nbytes} bytes at offset {entry.offset} do not "
                             f"hold {entry.dtype} {list(entry.shape)}")
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer[:buffer.numel() - buffer.numel() % dtype.itemsize].view(dtype)
        start = entry.offset // dtype.itemsize
        yield entry, whole[start:start + numel].view(entry.shape)
