"""fp8.quantize for many weights at once on a GPU: two Triton kernel launches per input dtype for a
whole bucket, whatever its number of tensors (per-tensor torch runs launch-bound at 6% of the copy
rate on an H200; reference fp8.md section 5, bench/fp8_bench.py).

Same rule, same bytes: the first kernel takes each 128x128 block's amax (edge blocks masked to zero,
NaN counted as inf so that it is refused); the scales are then computed from all the bucket's amax
values at once by fp8.scales, the very code the per-tensor path runs; the second kernel divides
each block by its scale with IEEE round-to-nearest division (div_rn: Triton's `/` is approximate),
clamps to +-448 and casts to e4m3 (round to nearest even, as torch's cast).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mconv.converter import fp8

# Per tensor, int64: address, rows, columns, row stride (elements; columns are contiguous), first
# block, scale-grid columns, offset of its FP8 output (elements), number of blocks.
_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _kernel(table, block_tensor, base, scale, out, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
            QUANTIZE: tl.constexpr, ALIGNED: tl.constexpr):
    """Block `base + program id` of the batch (a launch's blocks start at `base`), zero outside its
    tensor: its amax into `scale` (not QUANTIZE), or its values divided by `scale` into `out`.
    ALIGNED: every address, row stride and output offset of the launch is a multiple of 16 bytes
    (then loads and stores are vectorised; without the hint they go element by element)."""
    pid = tl.program_id(0).to(tl.int64)
    row = table + tl.load(block_tensor + pid).to(tl.int64) * 8
    rows, cols, stride = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    src, dst = tl.load(row).to(tl.pointer_type(DTYPE)), out + tl.load(row + 6)
    if ALIGNED:
        src, dst = tl.multiple_of(src, 16), tl.multiple_of(dst, 16)
        stride, cols = tl.multiple_of(stride, 16), tl.multiple_of(cols, 16)
    b = base + pid - tl.load(row + 4)
    grid_cols = tl.load(row + 5)
    r = (b // grid_cols) * BLOCK + tl.arange(0, BLOCK)[:, None]
    c = (b % grid_cols) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (c < cols)
    x = tl.load(src + r * stride + c, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        s = tl.full((BLOCK, BLOCK), 0.0, tl.float32) + tl.load(scale + base + pid)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)
        tl.store(dst + r * cols + c, q.to(tl.float8e4nv), mask=mask)
    else:
        magnitude = tl.where(x != x, float("inf"), tl.abs(x))
        tl.store(scale + base + pid, tl.max(tl.max(magnitude, axis=1), axis=0))


def _launcher(device: torch.device):
    """The kernel as compiled for a GPU, or run by Triton's interpreter for CPU tensors (tests)."""
    if device.type == "cuda":
        return _kernel
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_kernel.fn)


def quantize_batch(named: list[tuple[str, torch.Tensor]], scale_fmt: str = "float") -> list[tuple]:
    """fp8.quantize of each (name, 2-D weight) (bfloat16, float16 or float32; any strides; all on one
    device), bit for bit, in two kernel launches per dtype and alignment: (q float8_e4m3fn [out, in],
    scale float32 [ceil(out/128), ceil(in/128)]) per weight, views of one flat FP8 buffer and one flat
    scale buffer. One host synchronisation: MconvError naming the first weight that holds inf or NaN."""
    weights = [w if w.stride(-1) == 1 else w.contiguous() for _, w in named]  # (transposed views)
    device = weights[0].device
    aligned = [w.data_ptr() % 16 == 0 and w.stride(0) % 16 == 0 and w.shape[1] % 16 == 0 for w in weights]
    key = [(str(w.dtype), a) for w, a in zip(weights, aligned)]
    order = sorted(range(len(weights)), key=key.__getitem__)  # a launch's blocks are consecutive
    grids = {i: fp8.grid(weights[i].shape) for i in order}
    block_starts = torch.tensor([0] + [grids[i][0] * grids[i][1] for i in order]).cumsum(0).tolist()
    starts = dict(zip(order, block_starts))
    padded = [-(-weights[i].numel() // 16) * 16 for i in order]  # every output starts 16-byte aligned
    offsets = dict(zip(order, torch.tensor([0] + padded).cumsum(0).tolist()))
    out = torch.empty(sum(padded), dtype=fp8.FP8, device=device)
    amax = torch.empty(block_starts[-1], dtype=torch.float32, device=device)
    launches = []
    for group in dict.fromkeys(key[i] for i in order):
        members = [i for i in order if key[i] == group]
        rows = [[weights[i].data_ptr(), *weights[i].shape, weights[i].stride(0), starts[i], grids[i][1], offsets[i],
                 grids[i][0] * grids[i][1]] for i in members]
        blocks = sum(row[7] for row in rows)
        if not blocks:
            continue  # empty weights only: nothing to launch
        table = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        block_tensor = torch.repeat_interleave(torch.arange(len(members), dtype=torch.int32, device=device),
                                               table[:, 7], output_size=blocks)
        launches.append((table, block_tensor, starts[members[0]], _DTYPES[weights[members[0]].dtype], group[1]))
    kernel = _launcher(device)
    for table, block_tensor, base, dtype, aligned_ in launches:
        kernel[(block_tensor.numel(),)](table, block_tensor, base, amax, out, dtype, fp8.BLOCK, False, aligned_,
                                        num_warps=8)
    scale = fp8.scales(amax, scale_fmt)
    for table, block_tensor, base, dtype, aligned_ in launches:
        kernel[(block_tensor.numel(),)](table, block_tensor, base, scale, out, dtype, fp8.BLOCK, True, aligned_,
                                        num_warps=8)
    quantized = [(out.as_strided(w.shape, (w.shape[1], 1), offsets[i]),
                  scale.as_strided(grids[i], (grids[i][1], 1), starts[i])) for i, w in enumerate(weights)]
    finite = torch.isfinite(scale)  # checked once all is launched: the host waits for the GPU once
    if not finite.all():
        first = int((~finite).nonzero()[0])
        raise fp8._not_finite(named[order[torch.searchsorted(torch.tensor(block_starts), first, right=True) - 1]][0])
    return quantized
