"""Flat buckets: the tensors of one weight-sync bucket laid out in one contiguous uint8 buffer, so a
bucket travels as one handle, one copy or one broadcast, never one per tensor.

Tensors are placed widest element first with no padding: every byte offset is then a multiple of
its tensor's element size (a `view(dtype)` of the buffer needs that), which is the layout vLLM's
packed tensors and SGLang's FlattenedTensorBucket read back without padding of their own.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from mconv.converter.options import dtype_name
from mconv.transport.copies import CopyPlan

_DTYPES = {dtype_name(d): d for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


def dtype_of(name: str) -> torch.dtype:
    """torch.bfloat16 for "bfloat16" (dtype_name's inverse; KeyError for a dtype a bucket cannot hold)."""
    return _DTYPES[name]


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
    one torch._foreach_copy_ per dtype, not one launch per tensor (a sync's packing, done again and
    again, plans its copies once: copies.CopyPlan)."""
    tensors = dict(named)
    views = [(view, tensors[entry.name]) for entry, view in _views(buffer, entries)
             if entry.name in tensors]  # an alias shares its target's bytes
    sources = [src for _, src in views]
    CopyPlan([view for view, _ in views], sources, kernel=False).run(sources)


def checksums(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """{name: checksum of the tensor's bytes}: the same integer for the same bytes whatever the
    device, torch version, process or memory layout (exact integer sums, no floating point), and
    position sensitive (bytes moved or changed almost surely change it).

    A tensor's checksum is the sum over its bytes, read as little-endian int16 words w[i] (a zero
    byte appended to an odd count), of w[i] * (i % 65521 + 1). The tensors of a device are summed
    together, a chunk of words at a time (small tensors concatenated into one chunk, large ones
    split), so the work is a few operators per chunk and two host transfers per device, not a few
    operators per tensor (on a GPU, each a kernel launch). The temporaries stay below 16 bytes per
    word of a chunk: about 130 MiB on a GPU, 1 MiB on the CPU (cache-sized, which is faster)."""
    by_device: dict[torch.device, list] = defaultdict(list)
    for name, tensor in named:
        by_device[tensor.device].append((name, tensor))
    out = {}
    for device, group in by_device.items():
        sums = _device_checksums([tensor for _, tensor in group], device).tolist()
        out.update((name, value) for (name, _), value in zip(group, sums))
    return out


_PERIOD = 65521  # of the position weights: |w[i]| * weight < 2**31, so a product fits in an int32
_CHUNK = {"cpu": 1 << 16}  # int16 words summed per chunk, by device type
_DEVICE_CHUNK = 1 << 23  # on an accelerator: few launches


def _device_checksums(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 [len(tensors)]: the checksums of `tensors` (all on `device`)."""
    data = []
    for tensor in tensors:
        raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
        data.append(torch.cat([raw, raw.new_zeros(1)]) if raw.numel() % 2 else raw)
    sums = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    words = sum(raw.numel() for raw in data) // 2
    if not words:
        return sums
    size = _CHUNK.get(device.type, _DEVICE_CHUNK)
    # the weight of word s of a tensor is weights[s % _PERIOD], so a piece's weights are a view
    weights = torch.arange(_PERIOD + min(size, words), dtype=torch.int32, device=device) % _PERIOD + 1
    chunks, chunk, room = [], [], size  # a chunk: [(tensor index, its first word, its bytes)]; room: words left
    for index, raw in enumerate(data):
        start = 0
        while start < raw.numel():
            stop = min(raw.numel(), start + 2 * room)
            chunk.append((index, start // 2, raw[start:stop]))
            room -= (stop - start) // 2
            start = stop
            if not room:
                chunks.append(chunk)
                chunk, room = [], size
    chunks += [chunk] if chunk else []
    # where each piece of a shared chunk ends, and its tensor: one host-to-device copy for all chunks
    shared = [chunk for chunk in chunks if len(chunk) > 1]
    ends = [end for chunk in shared for end in itertools.accumulate(raw.numel() // 2 for *_, raw in chunk)]
    places = torch.tensor([ends, [index for chunk in shared for index, *_ in chunk]], device=device)
    taken = 0
    for chunk in chunks:
        spans = [weights[first % _PERIOD:][:raw.numel() // 2] for _, first, raw in chunk]
        if len(chunk) == 1:
            index, _, raw = chunk[0]
            if raw.data_ptr() % 2:  # a 1-byte dtype at an odd offset (in a flat bucket) cannot be viewed as int16
                raw = raw.clone()
            sums[index] += (raw.view(torch.int16) * spans[0]).sum(dtype=torch.int64)  # int32 products: exact
            continue
        products = torch.cat([raw for *_, raw in chunk]).view(torch.int16) * torch.cat(spans)
        at_ends = products.cumsum(0, dtype=torch.int64)[places[0, taken:taken + len(chunk)] - 1]
        sums.index_add_(0, places[1, taken:taken + len(chunk)], torch.diff(at_ends, prepend=at_ends.new_zeros(1)))
        taken += len(chunk)
    return sums


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
