"""Many tensor copies planned once and run at every weight sync: a sync copies the same bucket entries
out of (the trainer's packing) or into (a receiver's loading) the same tensors every time.

On a GPU, the pairs whose sides are both contiguous are copied as bytes by one Triton kernel launch
per alignment class, whatever their number, from a table of addresses kept on the device.
torch._foreach_copy_, the plain choice, took 1.55x a flat copy's time for a 512 MiB bucket of 165
expert weights on an H200 (bench/results-sync-ipc-h200.log, "copy primitives"), with host work
growing with the number of tensors. Other pairs (non-contiguous, on the CPU, across devices) keep
torch._foreach_copy_, one call per dtype, devices and contiguity. Either way each copy is
`dst.copy_(src)` for tensors of one dtype and shape: the same bytes, outside autograd (a
destination may be a parameter that requires grad).
"""
from __future__ import annotations

import contextlib
import itertools
import operator
from collections import defaultdict
from typing import Sequence

import torch

from mconv.triton_support import launcher, triton_importable

_ALIGN = 16  # bytes: the widest load and store the kernel makes, where both addresses and the size allow
_CHUNK = 16384  # bytes a kernel program copies
_PART = 4096  # bytes it copies per step
_WARPS = 4
_KERNEL = None


def _kernel():
    """The Triton kernel, defined at first use: Triton is imported only where the kernel runs."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_chunks(table, chunk_pair, CHUNK: tl.constexpr, PART: tl.constexpr, ALIGNED: tl.constexpr):
            """Chunk `program id` of the launch: up to CHUNK bytes of one pair, whose row of `table`
            (int64) holds its source address, destination address, size in bytes, and its first
            chunk in the launch. ALIGNED: every address and size of the launch is a multiple of 16
            bytes (then loads and stores are vectorised; without the hint they go byte by byte)."""
            pid = tl.program_id(0).to(tl.int64)
            row = table + tl.load(chunk_pair + pid).to(tl.int64) * 4
            src = tl.load(row).to(tl.pointer_type(tl.uint8))
            dst = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
            nbytes = tl.load(row + 2)
            if ALIGNED:
                src, dst, nbytes = tl.multiple_of(src, 16), tl.multiple_of(dst, 16), tl.multiple_of(nbytes, 16)
            start = (pid - tl.load(row + 3)) * CHUNK
            for part in tl.static_range(CHUNK // PART):
                at = start + part * PART + tl.arange(0, PART)
                inside = at < nbytes
                tl.store(dst + at, tl.load(src + at, mask=inside), mask=inside)

        _KERNEL = copy_chunks
    return _KERNEL


def _held(t: torch.Tensor) -> bool:
    """Whether `t`'s storage still holds it (not freed in place by `untyped_storage().resize_(0)`:
    a copy into or out of it, torch's own included, would touch freed memory)."""
    if not t.numel():
        return True
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= (last + 1) * t.element_size()


class CopyPlan:
    """`dsts[i].copy_(srcs[i])` for every i (each pair of one dtype and shape), planned once; `run`
    copies, from the planned sources or from new ones of the same dtypes and shapes (a trainer's
    next sync), and replans itself where a source can no longer take the planned route (its address
    changed and it is not contiguous, on another device, or no longer 16-byte aligned) or a
    destination moved (its address changed: a storage freed in place and allocated again). The plan
    keeps the destinations, and the sources only with `fixed_sources` (a receiver copying out of
    the same mapped buffer every time: `run()` then takes none); a trainer's fresh tensors of one
    sync are not kept alive until the next. `fixed_destinations`: the caller vouches that the
    destinations never move (buffers and mapped memory it owns, whose plans it drops with them),
    and `run` does not check them (a sync's 19k address reads). `unchanged` (indices of pairs;
    all of them with `fixed_sources`): the caller vouches that those sources stay the tensors given
    to the run that made or last remade the plan, alive, in place and unchanged in layout (views a
    trainer keeps of parameters it checks itself, a receiver's mapped buffer), and `run` checks,
    follows and reads the addresses of the others only.

    `kernel` (default: destinations on a GPU and Triton importable): the pairs with both sides
    contiguous on the destinations' device go through the batched kernel, the others through
    torch._foreach_copy_; `kernel=True` on the CPU runs the kernel in Triton's interpreter (tests).
    Raises ValueError for a pair of differing dtypes or shapes (new sources are checked where their
    address changed), a tensor whose storage was freed in place when the plan is made or remade (a
    copy would touch freed memory: torch's own segfaults), or `run` given another number of
    sources. A source freed in place after that is the caller's to avoid, as with torch's copies."""

    def __init__(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], kernel: bool | None = None,
                 fixed_sources: bool = False, fixed_destinations: bool = False, unchanged: Sequence[int] = ()):
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(srcs)} sources for {len(dsts)} destinations")
        self._dsts = list(dsts)
        self._check(srcs)
        self._srcs = list(srcs) if fixed_sources else None
        self._fixed_destinations = fixed_destinations
        self._unchanged = frozenset(range(len(self._dsts)) if fixed_sources else unchanged)
        self._launched = False  # a launch went through (before it, a failing one falls back to torch's copies)
        self._device = self._dsts[0].device if self._dsts else torch.device("cpu")
        self._use_kernel = ((self._device.type == "cuda" if kernel is None else kernel) and triton_importable())
        self._plan(list(srcs))

    def _check(self, srcs: Sequence[torch.Tensor]) -> None:
        for dst, src in zip(self._dsts, srcs):
            if dst.dtype != src.dtype or dst.shape != src.shape:
                raise ValueError(f"a copy from {src.dtype} {list(src.shape)} into {dst.dtype} {list(dst.shape)}")

    def _plan(self, srcs: list[torch.Tensor]) -> None:
        batched, others = [], defaultdict(list)
        for i, (dst, src) in enumerate(zip(self._dsts, srcs)):
            for side, t in (("destination", dst), ("source", src)):
                if not _held(t):
                    raise ValueError(f"copy {i}'s {side} ({t.dtype} {list(t.shape)}) has had its storage freed in "
                                     "place")
            if not dst.numel():
                continue
            if (self._use_kernel and src.device == dst.device == self._device and dst.is_contiguous()
                    and src.is_contiguous() and not (src.is_neg() or src.is_conj())):
                batched.append(i)
            else:
                others[dst.dtype, dst.device, src.device, dst.is_contiguous() and src.is_contiguous()].append(i)
        self._others = list(others.values())
        aligned = {i: not (self._dsts[i].data_ptr() % _ALIGN or srcs[i].data_ptr() % _ALIGN
                           or self._dsts[i].numel() * self._dsts[i].element_size() % _ALIGN) for i in batched}
        self._batched = sorted(batched, key=lambda i: not aligned[i])  # the aligned launch's rows first
        # picks the batched pairs' sides out of a list (a plain slice where they are all of them, in order)
        self._pick = (operator.itemgetter(slice(None)) if self._batched == list(range(len(self._dsts)))
                      else (lambda items, rows=self._batched: [items[i] for i in rows]))
        self._batched_dsts = self._pick(self._dsts)
        self._needs_alignment = [aligned[i] for i in self._batched]
        # the batched pairs whose sources a run after the first checks (None: all of them)
        self._checked = ([k for k, i in enumerate(self._batched) if i not in self._unchanged]
                         if self._unchanged else None)
        self._addresses: list[int] = []
        self._targets = [dst.data_ptr() for dst in self._dsts]
        self._launches: list[tuple[torch.Tensor, bool]] = []
        if not batched:
            return
        sizes = [self._dsts[i].numel() * self._dsts[i].element_size() for i in self._batched]
        counts = [-(-size // _CHUNK) for size in sizes]
        rows = []
        for is_aligned in (True, False):
            members = [k for k, i in enumerate(self._batched) if aligned[i] == is_aligned]
            if not members:
                continue
            firsts = itertools.accumulate((counts[k] for k in members), initial=0)
            rows += [[0, self._dsts[self._batched[k]].data_ptr(), sizes[k], first] for k, first in zip(members, firsts)]
            chunk_pair = torch.repeat_interleave(torch.tensor(members, dtype=torch.int32),
                                                 torch.tensor([counts[k] for k in members]))
            self._launches.append((chunk_pair.to(self._device), is_aligned))
        self._table = torch.tensor(rows, dtype=torch.int64, device=self._device)

    @property
    def kernel_copies(self) -> int:
        """How many of the pairs the batched kernel copies (the others go through torch._foreach_copy_)."""
        return len(self._batched)

    def _fits(self, sources: list[torch.Tensor], rows: list[int] | None, addresses: list[int] | None) -> bool:
        """Whether the plan still holds for the batched pairs' `sources` (those of `rows`, positions
        among them; None: all): no destination moved, every source is contiguous without torch's
        negative bit and, where `addresses` (all the batched sources') are new (None: the last
        run's), on the plan's device, of its dtype and shape, and 16-byte aligned where planned so."""
        # (map over torch's methods: a sync runs this for every tensor it sends, 19k for a 30B MoE)
        if not self._fixed_destinations and list(map(torch.Tensor.data_ptr, self._dsts)) != self._targets:
            return False
        if not all(map(torch.Tensor.is_contiguous, sources)) or any(map(torch.Tensor.is_neg, sources)):
            return False
        rows = range(len(self._batched)) if rows is None else rows
        return addresses is None or not any(
            (self._needs_alignment[k] and addresses[k] % _ALIGN) or src.device != self._device
            or src.dtype != self._batched_dsts[k].dtype or src.shape != self._batched_dsts[k].shape or src.is_conj()
            for k, src in zip(rows, sources))

    def run(self, srcs: Sequence[torch.Tensor] | None = None) -> None:
        """Copy `srcs` (in the plan's order; with `fixed_sources`, none: the planned ones) into the
        destinations, on the current stream."""
        if srcs is None:
            if self._srcs is None:
                raise ValueError("this plan keeps no sources (fixed_sources=False): give them to run()")
            srcs = self._srcs
        if len(srcs) != len(self._dsts):
            raise ValueError(f"{len(srcs)} sources for a plan of {len(self._dsts)} copies")
        rows = self._checked if self._addresses else None  # (a first run checks every source)
        if rows is None:
            sources = self._pick(srcs)
            addresses = list(map(torch.Tensor.data_ptr, sources))
        else:  # the vouched sources keep the first run's addresses
            sources = [srcs[self._batched[k]] for k in rows]
            addresses = self._addresses.copy()
            for k, address in zip(rows, map(torch.Tensor.data_ptr, sources)):
                addresses[k] = address
        fresh = addresses != self._addresses
        if not self._fits(sources, rows, addresses if fresh else None):
            self._check(srcs)
            self._plan(list(srcs))
            return self.run(srcs)
        if fresh:
            # pinned and asynchronous: a pageable copy would wait for all the work queued on the device;
            # the stream's order keeps the last run's kernels reading the old addresses first
            self._table[:, 0].copy_(torch.tensor(addresses, dtype=torch.int64, pin_memory=self._device.type == "cuda")
                                    .to(self._device, non_blocking=True))
            self._addresses = addresses
        if self._others:
            with torch.no_grad():  # bytes copied, not a step of any graph (destinations may require grad)
                for group in self._others:
                    torch._foreach_copy_([self._dsts[i] for i in group], [srcs[i] for i in group])
        if not self._launches:
            return
        try:
            with torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
                kernel = launcher(_kernel(), self._device)  # (Triton launches on the current device)
                for chunk_pair, aligned in self._launches:
                    kernel[(chunk_pair.numel(),)](self._table, chunk_pair, _CHUNK, _PART, aligned, num_warps=_WARPS)
        except Exception:
            if self._launched:
                raise
            # The kernel does not build here (Triton without a compiler for this GPU): torch copies instead.
            self._use_kernel = False
            self._plan(list(srcs))
            return self.run(srcs)
        self._launched = True
