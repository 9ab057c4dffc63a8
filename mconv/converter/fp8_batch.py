"""fp8.quantize for many weights at once on a GPU: one Triton kernel launch per input dtype and
alignment for a whole bucket (two for UE8M0 scales), whatever its number of tensors (per-tensor
torch runs launch-bound at 3-6% of the copy rate on an H200; reference fp8.md section 5,
bench/fp8_bench.py).

Same rule, same bytes. Each program takes one 128x128 block (edge blocks masked to zero). Float
scales (the default) are computed in the kernel from the block's amax (NaN counted as inf, so that
the scale is not finite and the weight refused): `amax / 448` by IEEE round-to-nearest division
(div_rn: Triton's `/` is approximate; torch divides by a tensor exactly so), float32 eps where that
is 0 (an all-zero block): fp8.scales' rule, one launch. UE8M0 scales need torch's log2 (a
libdevice log2 may round differently next to a power of two), so there the first launch stores the
amax, fp8.scales (the very code the per-tensor path runs) turns all the bucket's amax values into
scales at once, and a second launch quantizes. Quantizing divides the block by its scale (div_rn),
clamps to +-448 and casts to e4m3 (round to nearest even, as torch's cast).
"""
from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mconv.converter import fp8
from mconv.triton_support import launcher

_DTYPES = dict(zip(fp8._BATCHED_DTYPES, (tl.bfloat16, tl.float16, tl.float32)))  # the input dtypes quantize_all sends


AMAX, QUANTIZE, FUSED = (tl.constexpr(mode) for mode in range(3))  # what a launch does (_kernel's MODE)
_FP8_MAX, _ZERO_BLOCK_SCALE = tl.constexpr(fp8.FP8_MAX), tl.constexpr(fp8.ZERO_BLOCK_SCALE)  # the rule's, in the kernel
COLUMNS = tl.constexpr(10)  # of a weight's row in a launch table (_kernel)
# rows of a block a kernel step reads: on an H200 at 8 warps, 64 rows are 4-6% faster than 32 on Qwen3-30B-A3B's
# weights (bench/fp8_bench.py --rows, bench/results-fp8-h200.log), 16 and 128 (and 16 warps) slower
_ROWS = 64


@triton.jit
def _kernel(table, block_tensor, base, scale, out, bad, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
            MODE: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr):
    """Block `base + program id` of the batch (a launch's blocks start at `base`), zero outside its
    tensor. MODE AMAX: its amax into its scale; QUANTIZE: its values divided by its scale into `out`;
    FUSED: its float scale (fp8.scales' rule) into its scale and its values divided by it into `out`.
    Where the amax is inf (the block holds inf or NaN: its scale is not finite), AMAX and FUSED
    lower `bad` (one int64) to the tensor's index in the caller's list.
    `table` holds a row of _COLUMNS int64 per tensor: address, rows, columns, row stride (elements;
    columns are contiguous), first block, scale-grid columns, offset of its FP8 output (elements),
    number of blocks, offset of its scale grid in `scale` (elements), index in the caller's list.
    The offsets may reach beyond `out` and `scale` into other tensors on the device (an engine's
    parameters: quantize_batch's `into`). ALIGNED: every address of the launch is
    a multiple of 16 bytes and every row stride, column count and output offset a multiple of 16
    elements (then loads and stores are vectorised; without the hint they go element by element).

    The block is read ROWS rows at a time, twice where it is quantized (first its amax, then its
    values, the second read mostly from the cache): a whole 128x128 block held at once took so many
    registers that too few blocks were in flight per SM (0.73 of a flat copy's rate on an H200
    against 0.91 at 32 rows and 0.96 at 64, bench/results-fp8-h200.log)."""
    pid = tl.program_id(0).to(tl.int64)
    row = table + tl.load(block_tensor + pid).to(tl.int64) * COLUMNS
    rows, cols, stride = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    src, dst = tl.load(row).to(tl.pointer_type(DTYPE)), out + tl.load(row + 6)
    if ALIGNED:
        src, dst = tl.multiple_of(src, 16), tl.multiple_of(dst, 16)
        stride, cols = tl.multiple_of(stride, 16), tl.multiple_of(cols, 16)
    b = base + pid - tl.load(row + 4)
    scale_at = scale + tl.load(row + 8) + b
    grid_cols = tl.load(row + 5)
    first_row = (b // grid_cols) * BLOCK
    c = (b % grid_cols) * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MODE == QUANTIZE:
        s = tl.load(scale_at)
    else:
        amax = 0.0
        for part in tl.static_range(BLOCK // ROWS):
            r = first_row + part * ROWS + tl.arange(0, ROWS)[:, None]
            x = tl.load(src + r * stride + c, mask=(r < rows) & (c < cols), other=0.0).to(tl.float32)
            magnitude = tl.where(x != x, float("inf"), tl.abs(x))
            amax = tl.maximum(amax, tl.max(tl.max(magnitude, axis=1), axis=0))
        tl.atomic_min(bad, tl.load(row + 9), mask=amax == float("inf"))
        if MODE == AMAX:
            tl.store(scale_at, amax)
        else:
            s = tl.math.div_rn(amax, _FP8_MAX)
            s = tl.where(s == 0.0, _ZERO_BLOCK_SCALE, s)
            tl.store(scale_at, s)
    if MODE != AMAX:
        for part in tl.static_range(BLOCK // ROWS):
            r = first_row + part * ROWS + tl.arange(0, ROWS)[:, None]
            mask = (r < rows) & (c < cols)
            x = tl.load(src + r * stride + c, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.full((ROWS, BLOCK), 0.0, tl.float32) + s), -_FP8_MAX),
                           _FP8_MAX)
            tl.store(dst + r * cols + c, q.to(tl.float8e4nv), mask=mask)


@dataclass
class _Plan:
    """The host-side work of a batch of weights of given dtypes, shapes, strides and alignments, done
    once: the launches (their tables hold every field but the weights' addresses, written at each
    call), the output sizes, and how to cut the flat outputs into the weights' views."""

    table: torch.Tensor  # int64 [weights, COLUMNS], in `order` (`_kernel`'s rows; addresses written per call)
    launches: list[tuple]  # (its rows of `table`, block tensor, base, Triton dtype, aligned)
    out_numel: int
    blocks: int  # 128x128 blocks of all the weights
    order: list[int]
    runs: list[tuple]  # (indices, FP8 element offset, weight shape, first block, scale grid): consecutive
    # outputs of one shape, cut apart by one view and unbind each
    addresses: list[int] | None = None  # the weights' addresses in `table`, in the caller's order (None: not yet)
    signature: tuple = ()  # what quantize_batch made it for
    home: "torch.cuda.Stream | None" = None  # the stream its tables were made on
    copied: bool = False  # some weights are copied row-major first (new tensors at every call: never vouched for)
    done: "torch.cuda.Event | None" = None  # recorded after the last call's launches (on a GPU)
    stream: "torch.cuda.Stream | None" = None  # where they were launched


class PlanKey:
    """A caller's name for one list of weights it quantizes again and again (quantize_batch's `key`):
    its plan lives as long as the key does (a weak reference), so a caller lets its plans go by
    letting its keys go."""

    __slots__ = ("__weakref__",)


_PLANS: "OrderedDict[tuple, _Plan]" = OrderedDict()  # by signature: shared by the calls of one
_KEYED: "weakref.WeakKeyDictionary[PlanKey, _Plan]" = weakref.WeakKeyDictionary()  # by a caller's key: its own
# More than a sync's buckets of a large model on one rank (114 for Qwen3-30B-A3B at 512 MiB); a rank
# with more distinct buckets plans again at every call (about 500 GB of weights at 512 MiB buckets).
_MAX_PLANS = 1024
_DTYPE_OF, _SHAPE_OF, _LAST = operator.attrgetter("dtype"), operator.attrgetter("shape"), operator.itemgetter(-1)
_LOCK = threading.Lock()  # a plan's table serves one call at a time, from its addresses to its launches


def _plan(weights: list[torch.Tensor], aligned: list[bool], into: list[tuple[int, int]] | None = None) -> _Plan:
    """`into`: (FP8 output offset, scale offset) of each weight, in elements (quantize_batch's);
    otherwise the outputs go back to back in `order`, each FP8 weight 16-byte aligned, and the
    scales in block order."""
    device = weights[0].device
    key = [(str(w.dtype), a) for w, a in zip(weights, aligned)]
    # a launch's blocks are consecutive; within a launch, weights of one shape are (fewer views to cut)
    order = sorted(range(len(weights)), key=lambda i: (key[i], tuple(weights[i].shape)))
    grids = {i: fp8.grid(weights[i].shape) for i in order}
    block_starts = list(itertools.accumulate((grids[i][0] * grids[i][1] for i in order), initial=0))
    starts = dict(zip(order, block_starts))
    padded = [-(-weights[i].numel() // 16) * 16 for i in order]  # every output starts 16-byte aligned
    offsets = dict(zip(order, itertools.accumulate(padded, initial=0)))
    placed = {i: into[i] if into is not None else (offsets[i], starts[i]) for i in order}
    rows = [[0, *weights[i].shape, weights[i].stride(0), starts[i], grids[i][1], placed[i][0],
             grids[i][0] * grids[i][1], placed[i][1], i] for i in order]
    table = torch.tensor(rows, dtype=torch.int64, device=device)  # in `order`; a launch's rows are a slice
    launches, first = [], 0
    for group in dict.fromkeys(key[i] for i in order):
        count = sum(1 for i in order if key[i] == group)
        blocks = sum(row[7] for row in rows[first:first + count])
        rows_, first = table[first:first + count], first + count
        if not blocks:
            continue  # empty weights only: nothing to launch
        block_tensor = torch.repeat_interleave(torch.arange(count, dtype=torch.int32, device=device), rows_[:, 7],
                                               output_size=blocks)
        member = order[first - count]
        launches.append((rows_, block_tensor, starts[member], _DTYPES[weights[member].dtype], group[1]))
    runs: list[tuple] = []
    for i, size in zip(order, padded):
        shape = tuple(weights[i].shape)
        last = runs[-1] if runs else None
        if last and last[2] == shape and size == weights[i].numel():
            last[0].append(i)
        else:
            runs.append(([i], offsets[i], shape, starts[i], grids[i]))
    return _Plan(table, launches, sum(padded), block_starts[-1], order, runs)


def quantize_batch(named: list[tuple[str, torch.Tensor]], scale_fmt: str = "float",
                   into: tuple[torch.Tensor, list[tuple[int, int]]] | None = None,
                   pending: list | None = None, key=None, unchanged: bool = False) -> list[tuple] | None:
    """fp8.quantize of each (name, 2-D weight) (bfloat16, float16 or float32; any strides; all on one
    device), bit for bit, in one kernel launch per dtype and alignment (two for UE8M0 scales):
    (q float8_e4m3fn [out, in], scale float32 [ceil(out/128), ceil(in/128)]) per weight, views of one
    flat FP8 buffer and one flat scale buffer. One host synchronisation: MconvError naming the first
    weight of `named` that holds inf or NaN.

    `into` = (buffer, places): the FP8 weights and float scales go straight to `buffer`'s device
    memory instead (`buffer` 1-D uint8, e.g. a sync's flat bucket), each weight's q row-major at its
    place's first byte offset from `buffer`'s first byte and its scale grid (float32, row-major) at
    the second (a multiple of 4); returns None. The places may lie beyond `buffer`'s end, in other
    tensors of its device (a sync writing into an engine's parameters): the caller vouches for them.
    Float scales only (ValueError for "ue8m0", whose scales are computed between two launches over
    one flat scale buffer).

    `pending` (a list): no host synchronisation; what tells whether a weight held inf or NaN is
    appended to `pending` instead, for `check_pending` to read once for many calls (a sync, before
    it finishes). The outputs must not be used as valid before then.

    The launch tables are planned once per list of dtypes, shapes, strides and alignments (and
    places) (a sync quantizes the same buckets every time) and kept for the next call (the last
    1024 such lists, 4 bytes per 128x128 block on the device); a call then writes the weights'
    addresses into them where they changed. `key` (a PlanKey: a caller's name for one of the
    lists it quantizes again and again, e.g. a bucket of a sync): the plan is kept for that key
    alone, while the key lives (its own table: the addresses of a list of parameters are written
    once, not at every call of the lists of the same shapes), and found without hashing the list;
    it is used only where that list's dtypes, shapes, strides, alignments and places are the
    plan's. With `unchanged` the caller vouches that `named` holds the very tensors of that key's
    last call, unmoved, and `into` its places (a sync's or an export's bucket of parameters, while
    its plan stands): the plan is used without looking at them (nothing per weight on the host).
    A caller whose tensors may have changed since takes a new key."""
    if into is not None and scale_fmt != "float":
        raise ValueError(f"quantize_batch(into=...) writes float scales, not {scale_fmt!r}")
    if into is not None and (into[0].dtype != torch.uint8 or into[0].dim() != 1):
        raise ValueError(f"quantize_batch(into=(buffer, places)) writes into a 1-D uint8 buffer, not a "
                         f"{into[0].dim()}-D {into[0].dtype} one")
    device = named[0][1].device
    with _LOCK:
        plan = _KEYED.get(key) if key is not None else None
        if plan is not None and unchanged and not plan.copied and plan.addresses is not None:  # vouched for:
            addresses, read = plan.addresses, None  # the same tensors as the plan's (whose addresses it holds)
        else:  # `read`: the tensors the kernels read (row-major copies of transposed weights), kept until launched
            plan, addresses, read = _planned(named, into, key, plan)
        cuda = device.type == "cuda"
        stream = torch.cuda.current_stream(device) if cuda else None
        if plan.done is not None and plan.stream != stream:  # its last launches, unsynchronised, came on another
            stream.wait_event(plan.done)  # stream: they read the table first (no host wait)
        if addresses is not plan.addresses:  # (a sync's buckets of parameters: the same addresses every time)
            # Pinned and asynchronous: a pageable copy would wait for all the work queued on the device;
            # stream-ordered after the last call's launches, which read the old ones.
            plan.addresses = None  # (until written: a plan whose write failed is not vouched for)
            plan.table[:, 0].copy_(torch.tensor([addresses[i] for i in plan.order], dtype=torch.int64,
                                                pin_memory=cuda).to(device, non_blocking=True))
            plan.addresses = addresses
        if cuda and stream != plan.home:  # its tables, freed with it, are reused only after these launches
            for t in (plan.table, *(launch[1] for launch in plan.launches)):
                t.record_stream(stream)
        if into is None:
            out = torch.empty(plan.out_numel, dtype=fp8.FP8, device=device)
            scale = torch.empty(plan.blocks, dtype=torch.float32, device=device)  # amax values first, for UE8M0
        else:
            out, scale = into[0].view(fp8.FP8), into[0][:into[0].numel() // 4 * 4].view(torch.float32)
        bad = torch.full((1,), len(named), dtype=torch.int64, device=device)
        scale = _launch(plan, scale_fmt, scale, out, bad)
        del read  # (launched: on a GPU, their memory is reused only after the kernels, stream-ordered)
        if cuda:  # (a call on another stream waits for these launches, which read the table: above)
            plan.done, plan.stream = plan.done or torch.cuda.Event(), stream
            plan.done.record(stream)
        check = (*_flag_on_host(bad, stream), [name for name, _ in named])
        if pending is not None:
            pending.append(check)
        quantized = None if into is not None else _cut(plan, out, scale, len(named))
    if pending is None:
        check_pending([check])  # checked once all is launched: the host waits once
    return quantized


def _flag_on_host(bad: torch.Tensor, stream) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """`bad` as check_pending reads it: on a GPU, copied into pinned host memory after the launches,
    with an event recorded after the copy, so that its reader waits for these launches alone (a
    read of the device tensor from another thread, e.g. a sync's worker, would wait for everything
    queued on the stream since: the next buckets' packing)."""
    if stream is None:
        return bad, None
    flag = torch.empty(1, dtype=torch.int64, pin_memory=True)
    flag.copy_(bad, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(stream)
    return flag, copied


def _planned(named: list[tuple[str, torch.Tensor]], into, key, plan: _Plan | None) -> tuple[_Plan, list[int], list]:
    """quantize_batch's plan for `named` (key's `plan` where it fits, else one from _PLANS, else a
    new one, kept), the weights' addresses (the same list as the plan's where they are its) and the
    tensors at those addresses."""
    weights = [w for _, w in named]
    strides = tuple(map(torch.Tensor.stride, weights))
    copied = set(map(_LAST, strides)) != {1}
    if copied:  # transposed views: copied row-major (new addresses at every call)
        weights = [w if stride[-1] == 1 else w.contiguous() for w, stride in zip(weights, strides)]
        strides = tuple(map(torch.Tensor.stride, weights))
    addresses = list(map(torch.Tensor.data_ptr, weights))
    # all that _plan reads (the alignments: of the addresses, row strides, columns and outputs), in C-level maps,
    # and whether the weights read are copies (a plan for them is never vouched for)
    signature = (weights[0].device, tuple(map(_DTYPE_OF, weights)), tuple(map(_SHAPE_OF, weights)), strides,
                 tuple(map(operator.mod, addresses, itertools.repeat(16))),
                 None if into is None else (into[0].data_ptr() % 16, tuple(into[1])), copied)
    if plan is None or plan.signature != signature:  # (compared, not hashed)
        plan = _PLANS.get(signature) if key is None else None
        if plan is None:
            plan = _plan_for(weights, addresses, strides, into, signature)
            plan.copied = copied
            _kept(_KEYED if key is not None else _PLANS, signature if key is None else key, plan)
        elif key is None:
            _PLANS.move_to_end(signature)
    return plan, (plan.addresses if addresses == plan.addresses else addresses), weights


def _plan_for(weights: list[torch.Tensor], addresses: list[int], strides, into, signature: tuple) -> _Plan:
    """A new _Plan for quantize_batch's call (`signature`: what it was made for)."""
    places = None if into is None else [(q, s // 4) for q, s in into[1]]
    if into is not None and any(s % 4 for _, s in into[1]):
        raise ValueError("quantize_batch(into=(buffer, places)): scale offsets must be multiples of 4 bytes")
    aligned = [a % 16 == 0 and stride[0] % 16 == 0 and w.shape[1] % 16 == 0
               for w, a, stride in zip(weights, addresses, strides)]
    if into is not None:
        aligned = [a and not (into[0].data_ptr() + q) % 16 for a, (q, _) in zip(aligned, places)]
    plan = _plan(weights, aligned, places)
    plan.signature = signature
    if weights[0].is_cuda:
        plan.home = torch.cuda.current_stream(weights[0].device)
    return plan


def _kept(plans, key, plan: _Plan) -> None:
    """`plan` kept under `key` in `plans` (_PLANS: the least recently used dropped beyond _MAX_PLANS;
    _KEYED: while the key lives)."""
    plans[key] = plan
    while plans is _PLANS and len(plans) > _MAX_PLANS:
        plans.popitem(last=False)


def _launch(plan: _Plan, scale_fmt: str, scale: torch.Tensor, out: torch.Tensor, bad: torch.Tensor,
            rows: int = _ROWS) -> torch.Tensor:
    """The plan's kernel launches, its table's addresses written: FP8 weights into `out`, float
    scales into `scale`, the first weight holding inf or NaN into `bad`, reading `rows` rows of a
    block per step (the same bytes for any power of two up to 128: bench/fp8_bench.py --rows).
    Returns the scales (for UE8M0: `scale` holds the amax values, made into a new tensor of scales
    between the launches)."""
    kernel = launcher(_kernel, out.device)
    for mode in ((FUSED,) if scale_fmt == "float" else (AMAX, QUANTIZE)):
        if mode == QUANTIZE:
            scale = fp8.scales(scale, scale_fmt)
        for table, block_tensor, base, dtype, aligned in plan.launches:
            kernel[(block_tensor.numel(),)](table, block_tensor, base, scale, out, bad, dtype, fp8.BLOCK, mode.value,
                                            aligned, rows, num_warps=8)
    return scale


def _cut(plan: _Plan, out: torch.Tensor, scale: torch.Tensor, count: int) -> list[tuple]:
    """(q, scale) of each of the plan's `count` weights, in the caller's order: views of `out` and
    `scale`."""
    quantized: list = [None] * count
    for indices, offset, (rows, cols), first, grid in plan.runs:
        n = len(indices)
        qs = out[offset:offset + n * rows * cols].view(n, rows, cols).unbind(0)
        scales = scale[first:first + n * grid[0] * grid[1]].view(n, *grid).unbind(0)
        for i, q, s in zip(indices, qs, scales):
            quantized[i] = (q, s)
    return quantized


def check_pending(pending: list) -> None:
    """MconvError naming the first weight (of the first call) that held inf or NaN, which FP8 cannot
    quantize, of the quantize_batch calls that left their check in `pending`: the host waits for
    each call's launches (not for later work on their stream)."""
    for flag, copied, names in pending:
        if copied is not None:
            copied.synchronize()
        index = int(flag[0])
        if index < len(names):
            raise fp8._not_finite(names[index])
