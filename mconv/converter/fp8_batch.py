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

# Per tensor, int64: address, rows, columns, row stride, column stride (elements), first block,
# scale-grid columns, offset of its FP8 output (elements).
_FIELDS = 8
_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _kernel(table, block_tensor, base, scale, out, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
            QUANTIZE: tl.constexpr):
    """Block `base + program id` of the batch (a launch's blocks start at `base`), zero outside its
    tensor: its amax into `scale` (not QUANTIZE), or its values divided by `scale` into `out`."""
    pid = tl.program_id(0).to(tl.int64)
    row = table + tl.load(block_tensor + pid).to(tl.int64) * 8
    rows, cols = tl.load(row + 1), tl.load(row + 2)
    b = base + pid - tl.load(row + 5)
    grid_cols = tl.load(row + 6)
    r = (b // grid_cols) * BLOCK + tl.arange(0, BLOCK)[:, None]
    c = (b % grid_cols) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (c < cols)
    src = tl.load(row).to(tl.pointer_type(DTYPE))
    x = tl.load(src + r * tl.load(row + 3) + c * tl.load(row + 4), mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        s = tl.full((BLOCK, BLOCK), 0.0, tl.float32) + tl.load(scale + base + pid)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)
        tl.store(out + tl.load(row + 7) + r * cols + c, q.to(tl.float8e4nv), mask=mask)
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
    device), bit for bit, in two kernel launches per dtype: (q float8_e4m3fn [out, in], scale float32
    [ceil(out/128), ceil(in/128)]) per weight, views of one flat FP8 buffer and one flat scale
    buffer. One host synchronisation: MconvError naming the first weight that holds inf or NaN."""
    weights = [w for _, w in named]
    device = weights[0].device
    order = sorted(range(len(weights)), key=lambda i: str(weights[i].dtype))  # a dtype's blocks together
    grids = {i: fp8.grid(weights[i].shape) for i in order}
    block_starts = torch.tensor([0] + [grids[i][0] * grids[i][1] for i in order]).cumsum(0).tolist()
    starts = dict(zip(order, block_starts))
    offsets = dict(zip(order, torch.tensor([0] + [weights[i].numel() for i in order]).cumsum(0).tolist()))
    out = torch.empty(sum(w.numel() for w in weights), dtype=fp8.FP8, device=device)
    amax = torch.empty(block_starts[-1], dtype=torch.float32, device=device)
    launches = []
    for dtype in dict.fromkeys(weights[i].dtype for i in order):
        members = [i for i in order if weights[i].dtype == dtype]
        table = torch.tensor([[weights[i].data_ptr(), *weights[i].shape, *weights[i].stride(), starts[i],
                               grids[i][1], offsets[i]] for i in members], dtype=torch.int64)
        counts = torch.tensor([grids[i][0] * grids[i][1] for i in members])
        if not counts.sum():
            continue  # empty weights only: nothing to launch
        block_tensor = torch.repeat_interleave(torch.arange(len(members), dtype=torch.int32), counts)
        launches.append((_DTYPES[dtype], table.to(device), block_tensor.to(device), starts[members[0]]))
    kernel = _launcher(device)
    for dtype, table, block_tensor, base in launches:
        kernel[(block_tensor.numel(),)](table, block_tensor, base, amax, out, dtype, fp8.BLOCK, False, num_warps=8)
    scale = fp8.scales(amax, scale_fmt)
    finite = torch.isfinite(scale)
    if not finite.all():
        first = int((~finite).nonzero()[0])
        raise fp8._not_finite(named[order[torch.searchsorted(torch.tensor(block_starts), first, right=True) - 1]][0])
    for dtype, table, block_tensor, base in launches:
        kernel[(block_tensor.numel(),)](table, block_tensor, base, scale, out, dtype, fp8.BLOCK, True, num_warps=8)
    qs = [out[offsets[i]:offsets[i] + w.numel()].view(w.shape) for i, w in enumerate(weights)]
    return [(q, scale[starts[i]:starts[i] + grids[i][0] * grids[i][1]].view(grids[i])) for i, q in enumerate(qs)]
