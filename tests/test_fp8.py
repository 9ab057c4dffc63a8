"""Block-wise FP8: mconv's quantization equals compressed-tensors' block quantization bit for bit (edge
blocks, all-zero blocks, values beyond +-448), UE8M0 scales equal SGLang's power-of-two rule, and the
dequantization of a window equals the formula over the whole tensor."""
import os
import sys
from pathlib import Path

import pytest
import torch

from mconv.converter import fp8
from mconv.errors import MconvError

# scripts/install.sh installs compressed-tensors 0.20.0 (and loguru) into this directory, not the venv;
# a checkout sharing another's venv names its own copy with MCONV_COMPRESSED_TENSORS.
COMPRESSED_TENSORS = Path(os.environ.get("MCONV_COMPRESSED_TENSORS", Path(sys.prefix) / "compressed-tensors"))
# Skipped only outside CI: in CI its absence is a failure, not a skip.
needs_compressed_tensors = pytest.mark.skipif(
    not (COMPRESSED_TENSORS / "compressed_tensors").is_dir() and not os.environ.get("CI"),
    reason=f"no compressed-tensors at {COMPRESSED_TENSORS} (scripts/install.sh installs it there)")


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' FP8 block quantization (the FP8_BLOCK scheme's args): its
    `calculate_qparams` on each 128x128 block's min and max (taken here, zero-padded as its
    `maybe_pad_tensor_for_block_quant` pads), then its `quantize` of the weight."""
    if str(COMPRESSED_TENSORS) not in sys.path:
        sys.path.insert(0, str(COMPRESSED_TENSORS))
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams, maybe_pad_tensor_for_block_quant

    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True)
    padded = maybe_pad_tensor_for_block_quant(w.float(), (128, 128))
    blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scale, zero_point = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
    return quantize(w, scale, zero_point, args, dtype=torch.float8_e4m3fn), scale


def awkward_weight(dtype=torch.bfloat16) -> torch.Tensor:
    """[300, 200] (edge blocks on both sides), an all-zero block, a zero edge block, values far beyond
    448 and tiny negative ones (which round to -0)."""
    torch.manual_seed(0)
    w = torch.randn(300, 200) * 3
    w[:128, :128] = 0
    w[256:, 128:] = 0
    w[200, 5], w[201, 6] = 5000.0, -70000.0
    w[130, :10] = -1e-7
    return w.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@needs_compressed_tensors
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_equals_compressed_tensors(dtype):
    w = awkward_weight(dtype)
    q, scale = fp8.quantize(w)
    expected_q, expected_scale = reference_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (3, 2)
    assert scale.dtype == expected_scale.dtype == torch.float32
    assert torch.equal(bits(scale), bits(expected_scale))
    assert torch.equal(bits(q), bits(expected_q))
    assert scale[0, 0] == torch.finfo(torch.float32).eps and not q.float().isnan().any()
    assert q.float().abs().max() == 448


def test_ue8m0_scales_are_sglangs_power_of_two_rule():
    """SGLang's `per_block_cast_to_fp8` (sglang 0.5.23 srt/layers/quantization/fp8_utils.py, written
    out here): amax clamped at 1e-4, s = 2^ceil(log2(amax / 448)), q = e4m3(w * (1 / s))."""
    w = awkward_weight()
    q, scale = fp8.quantize(w, "ue8m0")
    padded = torch.nn.functional.pad(w.float(), (0, 56, 0, 84)).view(3, 128, 2, 128)
    sf = torch.pow(2.0, torch.ceil(torch.log2(padded.abs().amax(dim=(1, 3)).clamp(1e-4) / 448.0)))
    expected = (padded * (1.0 / sf[:, None, :, None])).to(torch.float8_e4m3fn).view(384, 256)[:300, :200]
    assert torch.equal(scale, sf) and torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))
    assert torch.equal(bits(q), bits(expected))


def test_dequantize_window_equals_whole():
    """A window of rows and columns (not block-aligned) dequantizes as the same elements of the whole
    tensor's `float(q) * s`, written with plain repeat_interleave; bf16 scales are read as well."""
    q, scale = fp8.quantize(awkward_weight())
    scale = scale.bfloat16()
    whole = (q.float() * scale.float().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200])
    assert torch.equal(fp8.dequantize(q, scale, torch.float32), whole)
    window = fp8.dequantize(q[100:290, 130:170], scale[0:3, 1:2], torch.bfloat16, origin=(100, 130))
    assert torch.equal(window, whole[100:290, 130:170].bfloat16())


def test_quantize_refuses_non_finite():
    w = awkward_weight()
    w[3, 3] = float("inf")
    with pytest.raises(MconvError, match="^model.x.weight holds inf or NaN"):
        fp8.quantize(w, name="model.x.weight")
