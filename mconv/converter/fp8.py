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

import torch

from mconv.errors import MconvError

BLOCK = 128
FP8_MAX = 448.0
FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # `<module>.weight` -> `<module>.weight_scale_inv`
SCALE_FORMATS = ("float", "ue8m0")
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the releases store (reference 1.2)
ZERO_BLOCK_SCALE = torch.finfo(torch.float32).eps


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def grid(shape, block=(BLOCK, BLOCK)) -> tuple[int, int]:
    """The scale grid of a 2-D weight: (ceil(out / block[0]), ceil(in / block[1]))."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """`w` [out, in] zero-padded to whole blocks, viewed as [rows, BLOCK, cols, BLOCK]."""
    rows, cols = grid(w.shape)
    padded = torch.nn.functional.pad(w, (0, cols * BLOCK - w.shape[1], 0, rows * BLOCK - w.shape[0]))
    return padded.view(rows, BLOCK, cols, BLOCK)


def quantize(w: torch.Tensor, scale_fmt: str = "float", name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)]) of a 2-D floating
    weight, on its device, by the module's rule. MconvError naming `name` where `w` holds inf or NaN
    (no finite scale exists: one host synchronisation per call) or `scale_fmt` is unknown."""
    if scale_fmt not in SCALE_FORMATS:
        raise MconvError(f"the FP8 scale format must be one of {', '.join(SCALE_FORMATS)}, got {scale_fmt!r}")
    blocks = _blocks(w.float())
    amax = blocks.abs().amax(dim=(1, 3))
    if not torch.isfinite(amax).all():
        raise MconvError(f"{name} holds inf or NaN values, which FP8 cannot quantize")
    if scale_fmt == "ue8m0":
        scale = torch.pow(2.0, torch.ceil(torch.log2(amax.clamp(min=1e-4) / FP8_MAX)))
    else:
        scale = amax / FP8_MAX
        scale = torch.where(scale == 0, torch.tensor(ZERO_BLOCK_SCALE, device=scale.device), scale)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(blocks.shape[0] * BLOCK, -1)[:w.shape[0], :w.shape[1]].contiguous(), scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, origin=(0, 0),
               block=(BLOCK, BLOCK)) -> torch.Tensor:
    """`float(q) * float(scale_inv)` block by block, cast to `dtype`. `q` [rows, cols] may be a window
    of a larger weight starting at element `origin` (row, column); `scale_inv` is then the window's
    scale rows and columns, from block (origin[0] // block[0], origin[1] // block[1]) on."""
    index = [(torch.arange(o, o + n, device=q.device) // b) - o // b
             for o, n, b in zip(origin, q.shape, block)]
    scale = scale_inv.float().index_select(0, index[0]).index_select(1, index[1])
    return (q.float() * scale).to(dtype)


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
