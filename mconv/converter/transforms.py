"""The closed set of transform kinds between HF tensors and one Megatron rank's shard.

Every kind is described the same way: for a given rank of a parallel group, the Megatron shard
is the concatenation, along one dimension, of pieces (row or column ranges) of the rule's HF
tensors, optionally followed by zero padding. One description serves both directions, so
`split` and `merge` are exact inverses by construction, and the planner can compute shapes and
byte ranges without touching any tensor. The same functions run on files (the reader slices
safetensors lazily) and on in-memory tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from mconv.converter.options import MAX_PARALLEL_SIZE, dtype_name, option
from mconv.errors import MconvError


@dataclass(frozen=True)
class Piece:
    source: int  # index of the HF tensor within the rule
    start: int  # range along ShardLayout.dim of that HF tensor
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardLayout:
    """How one rank's Megatron shard is made of HF tensor pieces."""

    dim: int
    pieces: tuple[Piece, ...]
    pad: int = 0  # zero entries appended along dim (vocab padding)
    # Megatron's value is the HF value plus this (a plain norm weight w kept as a zero-centred
    # norm's w - 1): the pieces are then built in memory, never copied as bytes.
    offset: float = 0.0
    sections: tuple[int, ...] = ()  # a sectioned kind's sections, their lengths along dim in order

    def shape(self, hf_shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        shape = list(hf_shapes[self.pieces[0].source])
        shape[self.dim] = sum(p.length for p in self.pieces) + self.pad
        return tuple(shape)


@dataclass(frozen=True)
class Kind:
    """A transform kind: `layout(hf_shapes, rank, size, params)` gives one rank's ShardLayout."""

    name: str
    layout: Callable[..., ShardLayout]
    replicated: bool = False  # every rank holds the same tensor; export reads rank 0 only
    sources: int | None = 1  # how many HF tensors the kind takes (None: one or more)


def _even_range(name: str, length: int, rank: int, size: int) -> tuple[int, int]:
    if length % size:
        raise MconvError(f"{name}: dimension {length} is not divisible by the parallel size {size}")
    step = length // size
    return rank * step, (rank + 1) * step


def _whole(shapes, rank, size, params) -> ShardLayout:
    return ShardLayout(0, (Piece(0, 0, shapes[0][0]),))


def _column(shapes, rank, size, params) -> ShardLayout:
    return ShardLayout(0, (Piece(0, *_even_range(params["name"], shapes[0][0], rank, size)),))


def _row(shapes, rank, size, params) -> ShardLayout:
    return ShardLayout(1, (Piece(0, *_even_range(params["name"], shapes[0][1], rank, size)),))


def padded_vocab_size(vocab: int, divisor: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp."""
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


def tp_sizes_for_padded_vocab(padded: int, vocab: int | None, divisor: int) -> list[int]:
    """The TP sizes at which Megatron pads `vocab` (with make_vocab_size_divisible_by `divisor`) to
    exactly `padded` rows (`padded_vocab_size`), ascending; with `vocab` None (unknown), every TP
    size whose multiple divides `padded`. Empty where none does. Sizes up to MAX_PARALLEL_SIZE (a
    checkpoint's padded vocabulary may be anything: 2**40 rows took the loop forever)."""
    if padded % divisor:
        return []
    steps = padded // divisor
    return [tp for tp in range(1, min(steps, MAX_PARALLEL_SIZE) + 1)
            if steps % tp == 0 and (vocab is None or padded_vocab_size(vocab, divisor, tp) == padded)]


def _vocab(shapes, rank, size, params) -> ShardLayout:
    vocab = shapes[0][0]
    per_rank = padded_vocab_size(vocab, params["vocab_divisor"], size) // size
    start = min(rank * per_rank, vocab)
    stop = min((rank + 1) * per_rank, vocab)
    pieces = (Piece(0, start, stop),) if stop > start else ()
    return ShardLayout(0, pieces or (Piece(0, 0, 0),), pad=per_rank - (stop - start))


def _sectioned(shapes, rank, size, params) -> ShardLayout:
    # GLU fc1 [gate; up] and other fused projections: each section is split on its own and the
    # rank's pieces are concatenated, so a rank holds [gate_r; up_r], not a slice of [gate; up].
    # An HF tensor may hold several sections (`params["sections"]`: per tensor, its number of
    # groups and the sections' rows within a group, see `Rule` shapes `a+b` and `n*(a+b)`): rows
    # [groups x [s0; s1; ...]]. Megatron's section s is then that section of every group in order,
    # split on its own: at TP rank r, the rows [r/size, (r+1)/size) of it, as pieces of the groups.
    sections = params.get("sections") or [(1, (shape[0],)) for shape in shapes]
    pieces, spans = [], []
    for i, (groups, lengths) in enumerate(sections):
        block = sum(lengths)
        for s, length in enumerate(lengths):
            lo, hi = _even_range(params["name"], groups * length, rank, size)
            spans.append(hi - lo)
            while lo < hi:  # the rows of section s in groups lo // length .. (hi - 1) // length
                group, within = divmod(lo, length)
                step = min(hi - lo, length - within)
                start = group * block + sum(lengths[:s]) + within
                pieces.append(Piece(i, start, start + step))
                lo += step
    return ShardLayout(0, tuple(pieces), sections=tuple(spans))


def _qkv(shapes, rank, size, params) -> ShardLayout:
    # Megatron groups rows by KV group: the group's query heads, then its key, then its value.
    # The HF side is q, k, v apart, or one packed tensor [Q_all; K_all; V_all] (Qwen3-VL's vision
    # `attn.qkv`, where groups == heads: Megatron's per-head [q_h; k_h; v_h], as mbridge and
    # Megatron-Bridge view it: hf.view(3, heads, head_dim, -1).transpose(0, 1)).
    # With `gated` (attention_output_gate: Qwen3.5, Qwen3-Next), HF q_proj holds per head
    # [q_h; gate_h] and Megatron's group is [its q heads; their gates; k; v].
    heads, groups, head_dim = params["heads"], params["groups"], params["head_dim"]
    if groups % size:
        raise MconvError(f"{params['name']}: {groups} query groups are not divisible by tensor parallel size {size}")
    q_rows = heads // groups * head_dim
    if len(shapes) == 1:
        (q, k, v), (q0, k0, v0) = (0, 0, 0), (0, heads * head_dim, (heads + groups) * head_dim)
    else:
        (q, k, v), (q0, k0, v0) = (0, 1, 2), (0, 0, 0)
    pieces = []
    per_rank = groups // size
    for g in range(rank * per_rank, (rank + 1) * per_rank):
        if params.get("gated"):
            group_heads = range(g * heads // groups, (g + 1) * heads // groups)
            pieces += [Piece(q, (2 * h + gate) * head_dim, (2 * h + gate + 1) * head_dim)
                       for gate in (0, 1) for h in group_heads]
        else:
            pieces.append(Piece(q, q0 + g * q_rows, q0 + (g + 1) * q_rows))
        pieces += [Piece(k, k0 + g * head_dim, k0 + (g + 1) * head_dim),
                   Piece(v, v0 + g * head_dim, v0 + (g + 1) * head_dim)]
    return ShardLayout(0, tuple(pieces))


def _gated_qkv(shapes, rank, size, params) -> ShardLayout:
    return _qkv(shapes, rank, size, {**params, "gated": True})


def _zero_centred(shapes, rank, size, params) -> ShardLayout:
    return ShardLayout(0, (Piece(0, 0, shapes[0][0]),), offset=-1.0)


REPLICATED = Kind("replicated", _whole, replicated=True)
DUPLICATED = Kind("duplicated", _whole, replicated=True)  # a linear layer kept whole on every rank
COLUMN = Kind("column", _column)
ROW = Kind("row", _row)
VOCAB = Kind("vocab", _vocab)
GLU = Kind("glu", _sectioned, sources=2)
SECTIONED = Kind("sectioned", _sectioned, sources=None)
QKV = Kind("qkv", _qkv, sources=None)  # q, k, v or one packed qkv
GATED_QKV = Kind("gated_qkv", _gated_qkv, sources=3)  # q_proj [q_h; gate_h], k, v
# A plain RMSNorm weight w (y = x/rms * w) as a zero-centred one's (y = x/rms * (1 + w')): w' = w - 1.
ZERO_CENTRED = Kind("zero_centred", _zero_centred, replicated=True)
EXTRA_STATE = Kind("extra_state", _whole, replicated=True, sources=0)  # TE/linear `_extra_state`: None


Reader = Callable[[int, int, int, int], torch.Tensor]  # (source, dim, start, stop) -> tensor


def _read_pieces(layout: ShardLayout, read: Reader) -> list[torch.Tensor]:
    """The layout's pieces, in order. Each source is read once, as the range its pieces span."""
    spans: dict[int, tuple[int, int]] = {}
    for p in layout.pieces:
        lo, hi = spans.get(p.source, (p.start, p.stop))
        spans[p.source] = (min(lo, p.start), max(hi, p.stop))
    blocks = {s: read(s, layout.dim, lo, hi) for s, (lo, hi) in spans.items()}
    return [blocks[p.source].narrow(layout.dim, p.start - spans[p.source][0], p.length) for p in layout.pieces]


def split_into(layout: ShardLayout, read: Reader, dest: torch.Tensor) -> None:
    """`split` straight into an existing shard (a live parameter, maybe on a GPU): no concatenated
    copy on the host; host-to-device copies are asynchronous when the pieces are pinned."""
    offset = 0
    for piece in _read_pieces(layout, read):
        dest.narrow(layout.dim, offset, piece.shape[layout.dim]).copy_(piece, non_blocking=True)
        offset += piece.shape[layout.dim]
    if layout.pad:
        dest.narrow(layout.dim, offset, layout.pad).zero_()
    if layout.offset:
        dest.add_(layout.offset)


def split(layout: ShardLayout, read: Reader) -> torch.Tensor:
    """Build one rank's Megatron shard."""
    parts = _read_pieces(layout, read)
    if layout.pad:
        pad_shape = list(parts[0].shape)
        pad_shape[layout.dim] = layout.pad
        parts.append(torch.zeros(pad_shape, dtype=parts[0].dtype, device=parts[0].device))
    shard = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=layout.dim)
    return shard + layout.offset if layout.offset else shard


def split_tensors(layout: ShardLayout, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`split` for in-memory HF tensors."""
    return split(layout, lambda s, dim, a, b: tensors[s].narrow(dim, a, b - a))


def merge(layouts: Sequence[ShardLayout], shards: Sequence[torch.Tensor],
          hf_shapes: Sequence[tuple[int, ...]], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Rebuild the HF tensors from the shards of every rank (padding is dropped), into `out` if
    given (tensors of `hf_shapes`, any dtype: copies cast). Pieces of one source that repeat at a
    regular stride in a shard (fused QKV groups) are moved in one copy."""
    if out is None:
        out = [torch.empty(shape, dtype=shards[0].dtype, device=shards[0].device) for shape in hf_shapes]
    for layout, shard in zip(layouts, shards):
        by_source: dict[int, list[tuple[Piece, int]]] = {}
        offset = 0
        for p in layout.pieces:
            by_source.setdefault(p.source, []).append((p, offset))
            offset += p.length
        for source, items in by_source.items():
            _copy_pieces(out[source], shard, layout.dim, items)
    for offset in {layout.offset for layout in layouts} - {0.0}:  # every rank's layout has the same
        for tensor in out:
            tensor.sub_(offset)
    return out


def _copy_pieces(dst: torch.Tensor, shard: torch.Tensor, dim: int, items: list[tuple[Piece, int]]) -> None:
    (first, first_offset), n = items[0], len(items)
    length = first.length
    step = items[1][1] - first_offset if n > 1 else 0
    regular = n > 1 and all(p.length == length and p.start == first.start + k * length
                            and offset == first_offset + k * step for k, (p, offset) in enumerate(items))
    if regular and step >= length:
        src = shard.narrow(dim, first_offset, (n - 1) * step + length).unfold(dim, length, step).movedim(-1, dim + 1)
        dst.narrow(dim, first.start, n * length).unflatten(dim, (n, length)).copy_(src)
        return
    for p, offset in items:
        dst.narrow(dim, p.start, p.length).copy_(shard.narrow(dim, offset, p.length))


def merge_single(layout: ShardLayout, shard: torch.Tensor, hf_shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """`merge` for a group of one rank, without copying where an HF tensor is one contiguous piece
    of the shard (GLU halves, vocabulary without its padding, whole tensors): those come back as
    views of the shard."""
    sources = [p.source for p in layout.pieces]
    whole = all(p.start == 0 and p.stop == hf_shapes[p.source][layout.dim] for p in layout.pieces)
    if (sorted(sources) != list(range(len(hf_shapes))) or not whole or (layout.dim != 0 and len(sources) > 1)
            or layout.offset):
        return merge([layout], [shard], hf_shapes)
    out, offset = [None] * len(hf_shapes), 0
    for p in layout.pieces:
        out[p.source] = shard.narrow(layout.dim, offset, p.length)
        offset += p.length
    return out


def check_cast(tensors: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Raise MconvError, naming the first of the (name, tensor) pairs with the largest magnitude
    of its finite values, where casting it to `dtype` would turn a finite value into inf (torch
    rounds the values beyond `dtype`'s largest to inf, silently). Checked only where `dtype`'s
    range is narrower than a tensor's (float32 or bfloat16 to float16, float32 to bfloat16): one
    pass (torch.aminmax) per tensor, on its device, and one host synchronisation for the list."""
    narrowed = [(name, t) for name, t in tensors if t.numel() and t.dtype.is_floating_point and dtype.is_floating_point
                and torch.finfo(dtype).max < torch.finfo(t.dtype).max]
    if not narrowed:
        return
    peaks = torch.stack([torch.stack(torch.aminmax(t)).abs().amax().float() for _, t in narrowed]).tolist()
    for (name, t), peak in zip(narrowed, peaks):
        if peak != peak or peak == float("inf"):  # a NaN or inf the tensor holds: its finite values decide
            finite = t[t.isfinite()]
            peak = finite.abs().amax().float().item() if finite.numel() else 0.0
        if torch.tensor(peak).to(dtype).isinf():  # the peak as float32 is exact (float32 or bfloat16 data)
            to = dtype_name(dtype)
            raise MconvError(f"cannot cast {name} to {to}: values up to {peak:.4g} are beyond {to}'s range "
                             f"({torch.finfo(dtype).max:g})")


def checked_cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)`, refused (MconvError naming `name`) where it would turn finite values
    into inf: see check_cast."""
    check_cast([(name, tensor)], dtype)
    return tensor.to(dtype)


def cast_dtype(dtype: torch.dtype | None, fp32: bool) -> torch.dtype | None:
    """The dtype a cast to `dtype` (--dtype, `dtype=`; None: no cast) writes a tensor in: float32 for
    one the model keeps in float32 (`fp32`: the table's Rule.fp32, as transformers'
    `_keep_in_fp32_modules_strict` keeps it whatever `dtype` from_pretrained is given), else `dtype`."""
    return None if dtype is None else torch.float32 if fp32 else dtype


def fp32_note(arch, names: Iterable[str], dtype: torch.dtype | None) -> str | None:
    """The line saying which of the HF tensors `names` of `arch` a cast to `dtype` left in float32
    (see cast_dtype): how many, and of which kinds (Architecture.fp32_kind). None when none was,
    or nothing is cast to another dtype."""
    kept = [kind for name in names if (kind := arch.fp32_kind(name))]
    if dtype is None or dtype == torch.float32 or not kept:
        return None
    return (f"kept {len(kept)} tensor{'s' if len(kept) > 1 else ''} in float32, as the model keeps them "
            f"({', '.join(sorted(set(kept)))}); {option('dtype', dtype_name(dtype))} cast the others")
