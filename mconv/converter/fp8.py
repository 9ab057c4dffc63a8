"""Block-wise FP8 (`quant_method: fp8`, float8_e4m3fn weights with `weight_scale_inv`), the one rule
every mconv path quantizes and dequantizes with (reference fp8.md, sections 1.2 and 1.5).

Quantization, per BLOCK x BLOCK block of a 2-D weight (edge blocks partial, as if padded with zeros):
`amax = max|w|` in float32, `s = amax / 448`, `q = e4m3(clamp(w / s, -448, 448))`, stored scale `s`
(float32). An all-zero block gets s = float32 eps (2^-23), so q = 0: compressed-tensors' rule, whose
bytes these are. The clamp matters: torch's cast to e4m3 does not saturate (480 becomes NaN).
With `scale_fmt="ue8m0"` (DeepGEMM / SGLang): `s = 2^ceil(log2(max(amax, 1e-4) / 448))`, a power of
two, SGLang's `per_block_cast_to_fp8`. Dequantization: `w = float(q) * float(s)`, cast to the dtype asked.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from mconv.converter.options import FP8_SCALES, dtype_name, option
from mconv.errors import MconvError
from mconv.triton_support import triton_importable

BLOCK = 128
FP8_MAX = 448.0
FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # `<module>.weight` -> `<module>.weight_scale_inv`
SCALE_FORMATS = FP8_SCALES
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the releases store (reference 1.2)
ZERO_BLOCK_SCALE = torch.finfo(torch.float32).eps
_BATCHED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp8_batch's kernels read these
WINDOW_ELEMENTS = 2**21  # quantized together: bounds `quantize`'s float32 temporaries (8 MiB each)


def scale_name(weight: str) -> str:
    """The name of `weight`'s block scales in an FP8 checkpoint: `<weight>_scale_inv` (float32, one
    per 128x128 block; the FP8 releases' and vLLM's name)."""
    return weight + SCALE_SUFFIX


def grid(shape, block=(BLOCK, BLOCK)) -> tuple[int, ...]:
    """The scale grid of a 2-D weight: (ceil(out / block[0]), ceil(in / block[1])); of 3-D stacked
    experts [E, rows, cols], each expert's stored matrix's: (E, ceil(rows / block[0]), ceil(cols / block[1]))."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """`w` [out, in] zero-padded to whole blocks, viewed as [rows, BLOCK, cols, BLOCK]."""
    rows, cols = grid(w.shape)
    padded = torch.nn.functional.pad(w, (0, cols * BLOCK - w.shape[1], 0, rows * BLOCK - w.shape[0]))
    return padded.view(rows, BLOCK, cols, BLOCK)


def quantize(w: torch.Tensor, scale_fmt: str = "float", name: str = "tensor", check: bool = True,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)]) of a 2-D floating
    weight, on its device, by the module's rule; written into `out` (q, scale_inv), contiguous
    tensors of those shapes and dtypes, where given. MconvError naming `name` where `w` holds inf
    or NaN (no finite scale exists: one host synchronisation per call; `check=False` leaves it to
    the caller, whose scales are then not finite) or `scale_fmt` is unknown.
    A window of block rows at a time (about WINDOW_ELEMENTS elements): each block lies in one
    window, so the bytes are the whole tensor's, and the float32 temporaries stay a few times
    WINDOW_ELEMENTS x 4 bytes whatever the weight's size.
    3-D stacked experts `w` [E, rows, cols] (transformers' fused form, as stored): each expert's
    matrix is quantized as a 2-D weight, one at a time; scale_inv [E, ceil(rows/128), ceil(cols/128)]."""
    _check_scale_fmt(scale_fmt)
    q, scale = out if out is not None else (torch.empty(w.shape, dtype=FP8, device=w.device),
                                            torch.empty(grid(w.shape), dtype=torch.float32, device=w.device))
    if w.dim() == 3:
        for expert, expert_q, expert_scale in zip(w, q, scale):
            quantize(expert, scale_fmt, name, False, (expert_q, expert_scale))
        if check and not torch.isfinite(scale).all():
            raise _not_finite(name)
        return q, scale
    rows, cols = grid(w.shape)
    step = BLOCK * max(1, WINDOW_ELEMENTS // (BLOCK * BLOCK * max(cols, 1)))
    for first in range(0, w.shape[0], step):
        window = w[first:first + step]
        blocks = _blocks(window.float())
        window_scale = scales(blocks.abs().amax(dim=(1, 3)), scale_fmt)
        scale[first // BLOCK:first // BLOCK + len(window_scale)] = window_scale
        window_q = (blocks / window_scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        q[first:first + len(window)] = window_q.view(-1, cols * BLOCK)[:len(window), :w.shape[1]]
    if check and not torch.isfinite(scale).all():
        raise _not_finite(name)
    return q, scale


def _check_scale_fmt(scale_fmt: str) -> None:
    if scale_fmt not in SCALE_FORMATS:
        raise MconvError(f"the FP8 scale format must be one of {', '.join(SCALE_FORMATS)}, got {scale_fmt!r}")


def scales(amax: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    """The float32 scales of blocks whose max |w| is `amax` (float32, any shape), by the module's rule."""
    # A tensor divisor, not the number: torch's CUDA kernels divide by a Python number as a multiply
    # by its reciprocal, one ulp off amax / 448 in a third of the blocks on the H200 (bench/fp8_bench.py).
    fp8_max = torch.full_like(amax, FP8_MAX)
    if scale_fmt == "ue8m0":
        return torch.pow(2.0, torch.ceil(torch.log2(amax.clamp(min=1e-4) / fp8_max)))
    scale = amax / fp8_max
    return torch.where(scale == 0, torch.tensor(ZERO_BLOCK_SCALE, device=scale.device), scale)


def _not_finite(name: str) -> MconvError:
    return MconvError(f"{name} holds inf or NaN values, which FP8 cannot quantize")


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, origin=(0, 0),
               block=(BLOCK, BLOCK), out: torch.Tensor | None = None) -> torch.Tensor:
    """`float(q) * float(scale_inv)` block by block (one float32 product, rounded once), cast to
    `dtype` (into `out`, of that dtype and q's shape, where given). `q` [rows, cols] may be a window
    of a larger weight starting at element `origin` (row, column); `scale_inv` is then the window's
    scale rows and columns, from block (origin[0] // block[0], origin[1] // block[1]) on.

    Computed a strip of whole block rows at a time (about 2^18 elements: its float32 temporaries stay
    in the CPU's cache) and, for float8_e4m3fn, through `_e4m3_scaled_down`: torch's own e4m3 ->
    float32 cast runs element by element at a fraction of the memory's speed."""
    rows, cols = q.shape
    out = torch.empty(q.shape, dtype=dtype, device=q.device) if out is None else out
    if not q.numel():
        return out
    scale = scale_inv.float()
    columns = (torch.arange(origin[1], origin[1] + cols, device=q.device) // block[1]) - origin[1] // block[1]
    # e4m3 values come scaled by 2^-8 and the scales by 2^8 (both exact), so each product is float(q) * s.
    # A scale of magnitude 2^119 or more would overflow (as would its block's values in every 16-bit dtype),
    # and a NaN scale fails the comparison: those take torch's cast.
    widen = q.dtype == FP8 and bool(scale.abs().max() < 2.0**119)
    if widen:
        scale = scale * _E4M3_DOWN
    # the window's rows of each block row (the first and last may be partial), taken a few block rows
    # at a time so that a strip holds about _STRIP_ELEMENTS
    starts = [0, *range(block[0] - origin[0] % block[0], rows, block[0])]
    stops = [*starts[1:], rows]
    per_strip = max(1, _STRIP_ELEMENTS // (block[0] * cols))
    for first in range(0, len(starts), per_strip):
        last = min(first + per_strip, len(starts))
        sizes = [stop - start for start, stop in zip(starts[first:last], stops[first:last])]
        strip = q[starts[first]:stops[last - 1]]
        row_scales = scale[first:last].index_select(1, columns)  # [block rows, cols]
        values = _e4m3_scaled_down(strip) if widen else None
        if values is None:
            values = strip.to(torch.float32, copy=True)
            if widen:  # this strip holds e4m3's NaN code: torch's cast, and the scales as stored
                row_scales = row_scales / _E4M3_DOWN
        if all(size == block[0] for size in sizes):  # whole block rows: each one's scales broadcast over it
            values.view(len(sizes), block[0], cols).mul_(row_scales[:, None, :])
        else:
            values.mul_(row_scales.repeat_interleave(torch.tensor(sizes, device=q.device), 0))
        out[starts[first]:stops[last - 1]].copy_(values)
    return out


_STRIP_ELEMENTS = 2**18  # float32 temporaries of 1 MiB
_E4M3_DOWN = 2.0**8
_E4M3_AS_HALF = -16512  # int16 0xBF80: the sign bit and e4m3's exponent and mantissa, shifted into a half's


def _e4m3_scaled_down(q: torch.Tensor) -> torch.Tensor | None:
    """float8_e4m3fn `q` as float32 values times 2^-8, exactly, or None where `q` holds e4m3's NaN code
    (0x7F, 0xFF; torch's cast then). An e4m3 byte s.eeee.mmm shifted into a float16's bits is
    s.0eeee.mmm0000000: the same value at exponent bias 15 instead of 7, so 2^-8 times it, subnormals
    included (a float16's smallest subnormal is 2^-24, e4m3's 2^-9). float16 -> float32 is exact."""
    magnitude = q.view(torch.uint8) & 0x7F
    if int(magnitude.max()) == 0x7F:
        return None
    half = q.view(torch.int8).to(torch.int16)
    return half.bitwise_left_shift_(7).bitwise_and_(_E4M3_AS_HALF).view(torch.float16).float()


def quantization_config(kept: list[str], scale_fmt: str = "float") -> dict:
    """config.json's `quantization_config` as the FP8 releases write it: the four keys vLLM, SGLang and
    AReaL read (`fmt` is required by AReaL), the modules kept in 16-bit by full name (`kept`: matched
    exactly by vLLM, on dotted boundaries by SGLang; reference 2.1), and `scale_fmt` for UE8M0."""
    config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": kept}
    if scale_fmt == "ue8m0":
        config["scale_fmt"] = "ue8m0"
    return config


def block_size(config: dict, where) -> tuple[int, int] | None:
    """The FP8 block of a config.json (None: not quantized). MconvError naming the field for a
    quantization method, `fmt`, `activation_scheme` or `weight_block_size` mconv does not read."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if method != "fp8":
        raise MconvError(f"{where} is a quantized checkpoint (quantization_config.quant_method is {method!r}); "
                         "mconv reads block-wise FP8 (quant_method 'fp8') only")
    for key, allowed in (("fmt", ("e4m3", None)), ("activation_scheme", ("dynamic", None)),
                         ("scale_fmt", ("float", "ue8m0", None))):
        if quantization.get(key) not in allowed:
            raise MconvError(f"{where}: quantization_config.{key} is {quantization.get(key)!r}; mconv reads "
                             f"{' or '.join(repr(a) for a in allowed if a)}")
    size = quantization.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in size)):
        raise MconvError(f"{where}: quantization_config.weight_block_size is {size!r}, not two positive block "
                         "sizes such as [128, 128] (per-tensor FP8 is not read)")
    return tuple(size)


@dataclass(frozen=True)
class Quantization:
    """What a writer quantizes: the HF weights `quantized(name)` picks (the architecture's
    `fp8`: 2-D weights, and 3-D stacked experts, quantized expert by expert), with scales in `scale_fmt`."""

    quantized: Callable[[str], bool]
    scale_fmt: str = "float"

    def applies(self, name: str, shape) -> bool:
        """Whether the HF tensor `name` of `shape` is written in FP8: a 2-D weight, or 3-D stacked
        experts, of a module this quantization quantizes (`quantized`: not kept in 16-bit)."""
        return len(shape) in (2, 3) and self.quantized(name)


def writer_quantization(arch, quantize: str | None, fp8_scale: str | None,
                        config: dict | None = None) -> Quantization | None:
    """The Quantization a writer's `quantize` / `fp8_scale` options ask for (None: write 16-bit).
    Without `fp8_scale`, the scale format of `config`'s quantization_config (the model's HF config:
    a checkpoint hf2mcore made of a UE8M0 FP8 model keeps its config.json, so the way back needs no
    `fp8_scale` again), else "float". MconvError naming the option for a method other than "fp8",
    a scale format other than SCALE_FORMATS, `fp8_scale` without `quantize`, or an architecture
    mconv writes no FP8 for."""
    if quantize is None:
        if fp8_scale is not None:
            raise MconvError(f"{option('fp8_scale', fp8_scale)} applies with {option('quantize', 'fp8')}")
        return None
    if quantize != "fp8":
        raise MconvError(f"{option('quantize', quantize)} is not a quantization mconv writes; available: fp8 "
                         "(block-wise, 128x128)")
    if fp8_scale not in (None, *SCALE_FORMATS):
        raise MconvError(f"{option('fp8_scale', fp8_scale)} is not an FP8 scale format; available: "
                         f"{', '.join(SCALE_FORMATS)}")
    if arch.fp8 is None:
        raise MconvError(f"{option('quantize', 'fp8')}: mconv does not write FP8 checkpoints of {arch.name} yet "
                         "(which of its weights the FP8 releases keep in 16-bit is not established)")
    source = (config or {}).get("quantization_config")
    source_scale = source.get("scale_fmt") if isinstance(source, dict) and source.get("quant_method") == "fp8" else None
    return Quantization(partial(arch.fp8, d=arch.dims(config or {})),
                        fp8_scale or (source_scale if source_scale in SCALE_FORMATS else "float"))


def block_note(config: dict | None, quantization: Quantization | None) -> str | None:
    """What a writer quantizing with `quantization` says where the model's HF `config` (an FP8 source's)
    had FP8 blocks other than BLOCK x BLOCK: they are written back in BLOCK x BLOCK; None otherwise."""
    source = (config or {}).get("quantization_config")
    size = source.get("weight_block_size") if isinstance(source, dict) else None
    if quantization is None or size in (None, [BLOCK, BLOCK]):
        return None
    return (f"the source model's FP8 blocks were {size}; mconv writes FP8 in {BLOCK}x{BLOCK} blocks only, "
            f"so the output's quantization_config says [{BLOCK}, {BLOCK}]")


def dequantized_note(where, block: tuple[int, int], dtype: torch.dtype, writer: str = "mcore2hf") -> str:
    """What hf2mcore (or `export-lora --merge`) says of the FP8 checkpoint `where` (blocks `block`)
    it reads dequantized into `dtype`; `writer`: the command that writes FP8 again."""
    return (f"{where} is FP8 (blocks {block[0]}x{block[1]}): its weights are dequantized into "
            f"{dtype_name(dtype)}; pass --quantize fp8 to {writer} to write FP8 again "
            f"(in {BLOCK}x{BLOCK} blocks)")


def quantized_entries(entries: list, quantization: Quantization) -> tuple[list, list[str]]:
    """The output entries (name, dtype, shape) with each weight to quantize replaced by its FP8
    weight and float32 `weight_scale_inv`; and the modules kept in 16-bit (full names of the other
    `.weight` tensors' modules), for `modules_to_not_convert`."""
    out, kept = [], []
    for name, dtype, shape in entries:
        if quantization.applies(name, shape):
            out += [(name, FP8, tuple(shape)), (scale_name(name), torch.float32, grid(shape))]
            continue
        out.append((name, dtype, shape))
        module = name.removesuffix(".weight")
        if module != name and module not in kept:
            kept.append(module)
    return out, kept


def output_config(config: dict, quantization: Quantization | None, kept: list[str]) -> dict:
    """config.json for written weights: the source's `quantization_config` (an FP8 model read
    dequantized) dropped, this writer's set where it quantizes."""
    config = {key: value for key, value in config.items() if key != "quantization_config"}
    if quantization is not None:
        config["quantization_config"] = quantization_config(kept, quantization.scale_fmt)
    return config


def quantize_all(named: list[tuple[str, torch.Tensor]], scale_fmt: str = "float",
                 batched: bool | None = None, key=None, unchanged: bool = False) -> list[tuple]:
    """(q, scale) of each (name, 2-D weight), by `quantize`, on the weights' device (one device); one
    host synchronisation for the list (MconvError naming the first weight holding inf or NaN).
    `batched` (default: on a GPU): all the weights together, in a few Triton kernel launches
    (fp8_batch), where Triton is importable and the list holds only 2-D bfloat16, float16 or
    float32 weights (no 3-D stacked experts); otherwise (and where Triton is not importable: a
    torch build without it), one by one: the same bytes either way. MconvError for a `scale_fmt`
    not in SCALE_FORMATS. `key`, `unchanged`: fp8_batch.quantize_batch's (a caller's name for a
    list it quantizes again and again, and its word that the list holds that key's last tensors)."""
    if not named:
        return []
    _check_scale_fmt(scale_fmt)
    if (named[0][1].is_cuda if batched is None else batched) and batchable([t for _, t in named]):
        from mconv.converter.fp8_batch import quantize_batch

        return quantize_batch(named, scale_fmt, key=key, unchanged=unchanged)
    quantized = [quantize(t, scale_fmt, name, check=False) for name, t in named]
    finite = torch.stack([torch.isfinite(scale).all() for _, scale in quantized])
    if not finite.all():
        raise _not_finite(named[int((~finite).nonzero()[0])][0])
    return quantized


def batchable(weights: list[torch.Tensor]) -> bool:
    """Whether fp8_batch's kernels take `weights`: Triton imports, and all are 2-D bfloat16, float16
    or float32 (no 3-D stacked experts)."""
    return (triton_importable() and set(map(torch.Tensor.dim, weights)) <= {2}
            and set(map(operator.attrgetter("dtype"), weights)) <= set(_BATCHED_DTYPES))  # (C-level maps: a bucket
    # holds hundreds of weights)


def quantize_tensors(tensors: list[tuple[str, torch.Tensor]], quantization: Quantization,
                     done: frozenset = frozenset(), picks: dict | None = None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with each weight to quantize (but those named in `done`, quantized
    already) replaced by (name, FP8 weight) and (name + "_scale_inv", float32 scale): `quantize_all`.
    `picks`: as `picked_weights`."""
    return quantize_picked(tensors, picked_weights(tensors, quantization, done, picks), quantization.scale_fmt)


def picked_weights(tensors: list[tuple[str, torch.Tensor]], quantization: Quantization,
                   done: frozenset = frozenset(), picks: dict | None = None) -> list[tuple[int, str]]:
    """(index in `tensors`, scale name) of each weight `quantization` quantizes, but those named in
    `done`. `picks`: a dict kept by a caller that quantizes lists of the same names again and again
    (a live export's buckets, one model): the answer is worked out once per list of names and
    `done` (the names fix the shapes for one model)."""
    key = (tuple(name for name, _ in tensors), done) if picks is not None else None
    picked = None if key is None else picks.get(key)
    if picked is None:
        picked = [(i, scale_name(name)) for i, (name, t) in enumerate(tensors)
                  if name not in done and quantization.applies(name, t.shape)]
        if key is not None:
            picks[key] = picked
    return picked


def quantize_picked(tensors: list[tuple[str, torch.Tensor]], picked: list[tuple[int, str]],
                    scale_fmt: str = "float") -> list[tuple[str, torch.Tensor]]:
    """`tensors` with each `picked` weight ((index, scale name), as picked_weights gives) replaced
    by (name, FP8 weight) and (scale name, float32 scale), quantized by `quantize_all`."""
    if not picked:
        return list(tensors)
    return with_scales(tensors, picked, quantize_all([tensors[i] for i, _ in picked], scale_fmt))


def with_scales(tensors: list[tuple[str, object]], picked: list[tuple[int, str]], pairs: list[tuple]) -> list[tuple]:
    """`tensors` with each `picked` weight ((index, scale name)) replaced by (name, q) and (scale
    name, scale) of its (q, scale) in `pairs`, in place: the order a quantized bucket comes in."""
    out, start = [], 0
    for (i, scale), (q, scale_inv) in zip(picked, pairs):
        out += tensors[start:i]
        out += ((tensors[i][0], q), (scale, scale_inv))
        start = i + 1
    out += tensors[start:]
    return out
