"""Block-wise FP8: mconv's quantization equals compressed-tensors' block quantization bit for bit (edge
blocks, all-zero blocks, values beyond +-448), UE8M0 scales equal SGLang's power-of-two rule, and the
dequantization of a window equals the formula over the whole tensor."""
import gc
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
def test_quantize_equals_compressed_tensors(dtype, monkeypatch):
    """Whole, and (as on a large weight) one window of block rows at a time into given tensors."""
    w = awkward_weight(dtype)
    q, scale = fp8.quantize(w)
    expected_q, expected_scale = reference_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (3, 2)
    assert scale.dtype == expected_scale.dtype == torch.float32
    assert torch.equal(bits(scale), bits(expected_scale))
    assert torch.equal(bits(q), bits(expected_q))
    assert scale[0, 0] == torch.finfo(torch.float32).eps and not q.float().isnan().any()
    assert q.float().abs().max() == 448
    monkeypatch.setattr(fp8, "WINDOW_ELEMENTS", 1)
    out = torch.empty_like(q), torch.empty_like(scale)
    assert all(a is b for a, b in zip(fp8.quantize(w, out=out), out))
    assert torch.equal(bits(out[0]), bits(expected_q)) and torch.equal(bits(out[1]), bits(expected_scale))


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


@pytest.mark.parametrize("dtype,block", [(torch.float32, (128, 128)), (torch.bfloat16, (128, 128)),
                                         (torch.float16, (128, 128)), (torch.bfloat16, (1, 128)),
                                         (torch.float32, (64, 32))])
@pytest.mark.parametrize("strip", [None, 2**12])  # mconv's strips, or strips of 16 to 4096 elements
def test_dequantize_every_e4m3_byte_as_torch_does(dtype, block, strip, monkeypatch):
    """Every e4m3 byte (zeros, subnormals, 448, the NaN codes) times scales of either sign from
    float32's smallest normal to past 2^119 (products subnormal, rounded, overflowing), whole and in
    windows starting inside a block, equal torch's own `float(q) * s` bit for bit; strips with and
    without the NaN code are both here, and block sizes that make many strips of a few rows."""
    if strip:
        monkeypatch.setattr(fp8, "_STRIP_ELEMENTS", strip)
    codes = torch.arange(256, dtype=torch.uint8)
    q = torch.stack([codes.roll(r) for r in range(0, 7 * 222, 7)])  # [222, 256], rows shifted by 7
    q[:128][q[:128] & 0x7F == 0x7F] = 0x3A  # the first 128 rows hold no NaN code
    q = q.view(torch.float8_e4m3fn)
    rows, cols = fp8.grid(q.shape, block)
    values = [2.0**-126, 2.0**-23, 1e-3, -0.7, 1.0, 3.0e30, 0.5, -2.0**-20]

    def expected(q, scale):  # torch's cast, each block's scale repeated over its elements
        per_element = scale.repeat_interleave(block[0], 0)[:q.shape[0]].repeat_interleave(block[1], 1)[:, :q.shape[1]]
        return (q.float() * per_element).to(dtype)

    without_nan = torch.where(q.view(torch.uint8) & 0x7F == 0x7F, 0x3A, q.view(torch.uint8)).view(q.dtype)
    for q in (q, without_nan):
        for extra in ([], [2.0**119], [-2.0**120], [1e38]):  # the last three: past the widened path's range
            scale = torch.tensor((values * (rows * cols))[:rows * cols - len(extra)] + extra).view(rows, cols)
            whole = expected(q, scale)
            assert torch.equal(bits(fp8.dequantize(q, scale, dtype, block=block)), bits(whole))
            first = (100 // block[0], 50 // block[1])
            window = fp8.dequantize(q[100:222, 50:200], scale[first[0]:, first[1]:], dtype, origin=(100, 50),
                                    block=block)
            assert torch.equal(bits(window), bits(whole[100:222, 50:200]))


def test_quantize_refuses_non_finite():
    w = awkward_weight()
    w[3, 3] = float("inf")
    with pytest.raises(MconvError, match="^model.x.weight holds inf or NaN"):
        fp8.quantize(w, name="model.x.weight")


# fp8_batch's Triton kernels under Triton's CPU interpreter (which must be chosen before triton is
# imported: a fresh interpreter). The interpreter's own float32 -> e4m3 cast is wrong (it rounds half
# up and loses the carry into the exponent: 127.35 becomes 64), so torch's cast stands in for the
# GPU's cvt.rn.satfinite, which tests/test_gpu.py checks on the GPU; everything else (block
# indexing, masks, strides, amax, scales, division, clamp) is the kernels' own.
BATCH_SCRIPT = """
import numpy as np, torch, triton.language as tl
from triton.runtime import interpreter
plain = interpreter._convert_float
def cast(values, src, dst, rounding):
    if dst == tl.float8e4nv:
        return torch.from_numpy(values.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return plain(values, src, dst, rounding)
interpreter._convert_float = cast
from mconv.converter import fp8_batch
from tests.test_fp8 import assert_batch_is_the_rule
print(assert_batch_is_the_rule())
print(len(fp8_batch._PLANS), "plans")
from tests.test_fp8 import assert_batch_into_is_the_rule
print(assert_batch_into_is_the_rule())
from tests.test_fp8 import assert_sync_packing_follows_the_scale_format
assert_sync_packing_follows_the_scale_format()
print("packed")
from tests.test_fp8 import assert_sync_writes_fp8_into_targets
print(assert_sync_writes_fp8_into_targets())
from tests.test_fp8 import assert_keyed_plans_follow_their_lists
print(assert_keyed_plans_follow_their_lists())
"""


def assert_batch_is_the_rule() -> str:
    """`fp8.quantize_all(named, scale_fmt, batched=True)` (fp8_batch's kernels where Triton imports)
    gives fp8.quantize's bytes and scales for float32 / bfloat16 / float16 weights, a transposed and
    a column-sliced view, edge and all-zero blocks, values beyond 448, blocks of subnormal values and
    scales (and one whose scale underflows to 0: eps), both scale formats, and again
    for other weights of the same shapes and strides (the batch's plan is reused: new addresses, new
    values); a NaN weight is refused by name. Returns the refusal's message."""
    def quantize_batch(named, fmt="float"):
        return fp8.quantize_all(named, fmt, batched=True)

    w = awkward_weight(torch.float32)
    big = (torch.randn(256, 256) * 0.02).bfloat16()
    # blocks whose amax / 448 is subnormal or underflows to 0 (eps then), and subnormal inputs: the
    # kernel's division must not flush them (float32: the interpreter converts bf16 subnormals wrongly)
    tiny = torch.randn(256, 130) * 1e-37
    tiny[128:, :128] = torch.tensor(2.0 ** -149) * torch.randint(-300, 300, (128, 128))
    tiny[:128, 128:] = torch.tensor(2.0 ** -149)
    for again in (False, True):
        if again:
            w, big = w.flip(0).contiguous() * 0.5, (torch.randn(256, 256) * 0.02).bfloat16()
        named = [("a", w.bfloat16()), ("b", w), ("c", big.t()), ("d", big[:, 100:300]), ("e", big.half()),
                 ("f", tiny)]
        for fmt in fp8.SCALE_FORMATS:
            for (name, x), (q, scale) in zip(named, quantize_batch(named, fmt)):
                expected_q, expected_scale = fp8.quantize(x, fmt)
                assert q.dtype == fp8.FP8 and torch.equal(bits(q), bits(expected_q)), (name, fmt, again)
                assert torch.equal(scale, expected_scale), (name, fmt, again)
    w[3, 3] = float("nan")
    with pytest.raises(MconvError) as refused:
        quantize_batch([("big", big), ("model.x.weight", w)])
    small = big[:128].clone()
    big[5, 5] = small[0, 0] = float("nan")  # the first in the caller's order is named, whatever the kernels' order
    with pytest.raises(MconvError, match="^big holds"):
        quantize_batch([("big", big), ("small", small)])
    return str(refused.value)


def assert_batch_into_is_the_rule() -> str:
    """fp8_batch.quantize_batch(into=...) (a sync's packing of FP8 buckets) writes fp8.quantize's
    bytes and float scales at the places given in a flat uint8 buffer, 16-byte aligned or not,
    and not one byte elsewhere (twice: the second call reuses the plan); a NaN weight is refused by
    name, and a NaN float32 value between the scales alone is not; UE8M0 is a ValueError. Returns
    the refusal's message."""
    from mconv.converter import fp8_batch

    w = awkward_weight(torch.float32)
    named = [("a", w.bfloat16()), ("b", (torch.randn(256, 256) * 0.02).bfloat16().t()), ("c", w[:, 50:])]
    expected = [fp8.quantize(x) for _, x in named]
    scale_bytes = [s.numel() * 4 for _, s in expected]
    # scales first (4-byte aligned, a float32 gap after the first), then the FP8 weights at odd places
    places, at = [], 0
    starts = [0, scale_bytes[0] + 8, scale_bytes[0] + 8 + scale_bytes[1]]
    at = starts[-1] + scale_bytes[2]
    for (_, x), extra in zip(named, (8, 0, 3)):  # b (256 columns) 16-byte aligned: the vectorised launch
        places.append([None, at + extra])
        at += extra + x.numel()
    places = [(q, s) for (_, q), s in zip(places, starts)]
    for again in (False, True):
        buffer = torch.full((at + 5,), 0xAB, dtype=torch.uint8)
        untouched = torch.ones_like(buffer, dtype=torch.bool)
        fp8_batch.quantize_batch(named, into=(buffer, places))
        for (q_at, s_at), (q, scale) in zip(places, expected):
            got_q = buffer[q_at:q_at + q.numel()]
            got_scale = buffer[s_at:s_at + scale.numel() * 4].view(torch.float32)
            assert torch.equal(got_q, bits(q).reshape(-1)) and torch.equal(got_scale, scale.reshape(-1)), again
            untouched[q_at:q_at + q.numel()] = untouched[s_at:s_at + scale.numel() * 4] = False
        assert (buffer[untouched] == 0xAB).all(), again
    buffer[scale_bytes[0]:scale_bytes[0] + 4] = torch.tensor([float("nan")]).view(torch.uint8)  # in the gap
    fp8_batch.quantize_batch(named, into=(buffer, places))  # the gap is not a scale: not refused
    with pytest.raises(ValueError, match="ue8m0"):
        fp8_batch.quantize_batch(named, "ue8m0", into=(buffer, places))
    with pytest.raises(ValueError, match="1-D uint8 buffer"):
        fp8_batch.quantize_batch(named, into=(buffer.view(torch.int8), places))
    with pytest.raises(ValueError, match="multiples of 4"):
        fp8_batch.quantize_batch(named, into=(buffer, [(q, s + 2) for q, s in places]))
    bad = named[2][1].clone()
    bad[7, 7] = float("nan")
    with pytest.raises(MconvError) as refused:
        fp8_batch.quantize_batch([*named[:2], ("model.y.weight", bad)], into=(buffer, places))
    return str(refused.value)


def assert_sync_packing_follows_the_scale_format() -> None:
    """sync_weights' packing of one bucket (pack._pack) into one engine, with float scales, then
    UE8M0, then float again, sends fp8.quantize_picked's bytes each time: the layout kept per
    bucket is keyed by the scale format too (a float layout quantizes into the buffer; reused for
    UE8M0 it sent float scales). A bucket whose weight holds NaN is packed unchecked and never
    handed to the engine: the sync's worker reads its check first (core._deliver) and names the
    weight. _pack is told the device is "cuda" (what makes it quantize into the buffer); the
    engine's buffers are CPU memory, for the interpreter."""
    from mconv.errors import MconvError
    from mconv.live.sync import core, pack
    from mconv.live.sync.engines import Engine, FlatBucket
    from mconv.transport.flat import unpack

    class CPUBuffers(Engine):
        updated = 0

        def buffer(self, slot, nbytes, device):
            return super().buffer(slot, nbytes, torch.device("cpu"))

        def update(self, bucket):
            self.updated += 1

    weight = "model.layers.0.mlp.down_proj.weight"
    named = [(weight, (torch.randn(256, 512) * 0.37).bfloat16()),
             ("model.layers.0.input_layernorm.weight", torch.randn(512).bfloat16())]
    picked = [(0, weight + "_scale_inv")]
    engine = CPUBuffers()
    for fmt in ("float", "ue8m0", "float"):
        entries, buffer = pack._pack(engine, 0, named, None, torch.device("cuda"), picked,
                                     fp8.Quantization(lambda name: True, fmt))
        sent = dict(unpack(buffer, entries))
        for name, expected in fp8.quantize_picked(named, picked, fmt):
            assert torch.equal(bits(sent[name]), bits(expected)), (fmt, name)
    core._deliver(engine, FlatBucket("v", 0, buffer, entries), [])
    named[0][1][3, 3] = float("nan")
    checks: list = []
    entries, buffer = pack._pack(engine, 0, named, None, torch.device("cuda"), picked, fp8.Quantization(
        lambda name: True), checks)
    with pytest.raises(MconvError, match=f"^{weight} holds inf or NaN"):
        core._deliver(engine, FlatBucket("v", 1, buffer, entries), checks)
    assert engine.updated == 1


def assert_sync_writes_fp8_into_targets() -> str:
    """sync_weights' direct route (pack._write into an engine's tensors) quantizes a bucket's FP8
    weights straight into the engine's float8_e4m3fn weights and float32 scale grids (separate
    tensors, one lying below the others in memory), copies the rest, and names every pair written:
    fp8.quantize_picked's bytes, twice (the second through the plans kept); nothing else written.
    With every tensor at the schedule's fixed positions (vouched for from the second call on), new
    values written in place are quantized, and so are other tensors once the model is planned anew. Targets it cannot quantize into (a bfloat16 weight)
    leave the bucket to packing (None). A NaN
    weight is written unchecked and named by fp8_batch.check_pending afterwards. Returns that
    refusal's message. As above, "cuda" is what makes it quantize so; the tensors are on the CPU."""
    from mconv.converter import fp8_batch
    from mconv.live.sync import pack
    from mconv.live.sync.engines import Engine

    class Live:  # what the copy plans are made for (a LiveModel: only its identity counts)
        pass

    down, up, norm = ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight",
                      "model.layers.0.input_layernorm.weight")
    named = [(down, (torch.randn(256, 300) * 0.37).bfloat16()), (norm, torch.randn(512).bfloat16()),
             (up, (torch.randn(200, 256) * 0.02).bfloat16().t())]
    picked = [(0, down + "_scale_inv"), (2, up + "_scale_inv")]
    quantization = fp8.Quantization(lambda name: True)
    expected = fp8.quantize_picked(named, picked)
    arena = torch.full((1 << 20,), 0xAB, dtype=torch.uint8)  # the engine's memory: its tensors at odd places
    targets, at = {}, 0
    for name, t in reversed(expected):
        at += 40 + (-at % 4)
        targets[name] = arena[at:at + t.nbytes].view(t.dtype).view(t.shape)
        at += t.nbytes
    untouched = torch.ones_like(arena, dtype=torch.bool)
    for t in targets.values():
        untouched[t.data_ptr() - arena.data_ptr():t.data_ptr() - arena.data_ptr() + t.nbytes] = False
    engine, live = Engine(), Live()
    for again in (False, True):
        unchecked: list = []
        _, written, nbytes = pack._write(engine, named, None, targets, torch.device("cuda"), [], live, picked,
                                         quantization, unchecked)
        assert [name for name, _ in written] == [name for name, _ in expected], again
        assert nbytes == sum(t.nbytes for _, t in expected)
        fp8_batch.check_pending(unchecked)
        for name, t in expected:
            assert torch.equal(bits(targets[name]), bits(t)), (name, again)
        assert (arena[untouched] == 0xAB).all(), again
    named[2] = (up, named[2][1].contiguous())  # (a transposed weight is copied at every call: never vouched for)
    for factor in (2.0, 3.0, 5.0):  # the bucket's tensors all the schedule's own (fixed): vouched for at the second
        named[0][1].mul_(factor)  # new values in place
        if factor == 5.0:  # the model planned anew (moved parameters): other tensors, not vouched for
            live, named = Live(), [(name, t.clone()) for name, t in named]
            named[0][1].mul_(factor)
        unchecked = []
        pack._write(engine, named, None, targets, torch.device("cuda"), [0, 1, 2], live, picked, quantization,
                    unchecked)
        fp8_batch.check_pending(unchecked)
        for name, t in fp8.quantize_picked(named, picked):
            assert torch.equal(bits(targets[name]), bits(t)), (name, factor)
    wrong = dict(targets, **{down: torch.zeros(256, 300, dtype=torch.bfloat16)})
    assert pack._write(Engine(), named, None, wrong, torch.device("cuda"), [], live, picked, quantization, []) is None
    named[2][1][5, 5] = float("nan")
    unchecked = []
    pack._write(engine, named, None, targets, torch.device("cuda"), [], live, picked, quantization, unchecked)
    with pytest.raises(MconvError) as refused:
        fp8_batch.check_pending(unchecked)
    return str(refused.value)


def assert_keyed_plans_follow_their_lists() -> str:
    """quantize_batch's plans kept per caller key (a sync's or an export's bucket) give fp8.quantize's
    bytes for the same weights with new values, for other weights of the same shapes (other
    addresses, one of them not 16-byte aligned) and for weights of other shapes or dtypes under the
    same key: the plan is used only where it fits. Vouched for (`unchanged`: the key's last
    tensors), it follows their new values, and is used without looking at the list (given other
    tensors, it reads the last ones), but for a list holding a transposed weight (copied row-major
    at every call): that one follows the list. Returns how many keyed plans it added (two) and how
    many are left once their keys are gone (none)."""
    from mconv.converter import fp8_batch

    bucket_7, bucket_8 = fp8_batch.PlanKey(), fp8_batch.PlanKey()

    def check(named, key=bucket_7, unchanged=False, expected=None):
        out = fp8_batch.quantize_batch(named, key=key, unchanged=unchanged)
        for (name, x), (q, scale) in zip(expected or named, out):
            expected_q, expected_scale = fp8.quantize(x)
            assert torch.equal(bits(q), bits(expected_q)) and torch.equal(scale, expected_scale), name

    gc.collect()  # (the keys of the checks before, gone with their engines)
    before = len(fp8_batch._KEYED)
    weights = [(torch.randn(256, 384) * 0.1).bfloat16(), torch.randn(130, 200) * 3]
    named = [("a", weights[0]), ("b", weights[1])]
    check(named)
    for w in weights:
        w.mul_(-7)  # new values in place
    check(named)
    unaligned = torch.empty(256 * 384 + 1, dtype=torch.bfloat16)[1:].view(256, 384)
    unaligned.copy_(torch.randn(256, 384))
    check([("a", unaligned), ("b", torch.randn(130, 200))])
    check([("a", torch.randn(128, 384).half()), ("b", torch.randn(130, 200))])
    check(named)
    for w in weights:
        w.mul_(0.5)
    check(named, unchanged=True)
    check([("a", torch.zeros(256, 384).bfloat16()), ("b", torch.zeros(130, 200))], unchanged=True, expected=named)
    transposed = [("a", weights[0]), ("t", torch.randn(200, 130).t())]
    check(transposed, key=bucket_8)
    transposed[1][1].mul_(3)
    check(transposed, key=bucket_8, unchanged=True)
    added = len(fp8_batch._KEYED) - before
    del bucket_7, bucket_8, check  # (a key's plan goes with it)
    gc.collect()
    return f"{added} keyed, {len(fp8_batch._KEYED) - before} once their keys went"


def test_batched_quantize_kernels_give_the_same_bytes(tmp_path):
    """fp8_batch.quantize_batch (the GPU path of the live export: all a bucket's weights in one kernel
    launch sequence) gives fp8.quantize's bytes and scales, checked above against compressed-tensors',
    for float32/bfloat16/float16 weights, a transposed and a column-sliced view, edge and all-zero
    blocks, values beyond 448, both scale formats, and again for new weights of the same shapes
    through the plan kept from the first call (3 plans in all: the batches of those shapes, strides
    and alignments); a NaN weight is refused by name."""
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", BATCH_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:6] == ["model.x.weight holds inf or NaN values, which FP8 cannot quantize",
                                          "3 plans",
                                          "model.y.weight holds inf or NaN values, which FP8 cannot quantize",
                                          "packed",
                                          "model.layers.0.mlp.up_proj.weight holds inf or NaN values, which FP8 "
                                          "cannot quantize",
                                          "2 keyed, 0 once their keys went"]


def test_batched_quantize_without_triton_is_the_torch_rule(monkeypatch):
    """Where Triton is not importable, the batched path (what the live export runs on a GPU: here
    `batched=True` on CPU tensors) quantizes weight by weight with fp8.quantize, the same bytes."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "mconv.converter.fp8_batch", raising=False)
    said = assert_batch_is_the_rule()
    assert said == "model.x.weight holds inf or NaN values, which FP8 cannot quantize"
    assert "mconv.converter.fp8_batch" not in sys.modules


# ----------------------------------------------------------------------------- FP8 checkpoints
# Tiny models with every quantized dimension a multiple of 128 (transformers' dequantizing reader is
# exact only there: reference fp8.md, 3.1), quantized here by compressed-tensors.
ALIGNED = dict(tokenizer=False, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
               head_dim=128, num_hidden_layers=2)
MOE = dict(ALIGNED, moe_intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
TOKENS = list(range(3, 60, 4))
KEYS = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def sglang_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's `per_block_cast_to_fp8` (sglang 0.5.23 srt/layers/quantization/fp8_utils.py), written
    out: amax clamped at 1e-4, s = 2^ceil(log2(amax / 448)), q = e4m3(w * (1 / s)); zero-padded blocks."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    padded = torch.nn.functional.pad(w.float(), (0, cols * 128 - w.shape[1], 0, rows * 128 - w.shape[0]))
    blocks = padded.view(rows, 128, cols, 128)
    sf = torch.pow(2.0, torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)).clamp(1e-4) / 448.0)))
    q = (blocks * (1.0 / sf[:, None, :, None])).to(torch.float8_e4m3fn).view(rows * 128, -1)
    return q[:w.shape[0], :w.shape[1]].contiguous(), sf


def write_fp8(source: Path, out: Path, scale_dtype=torch.float32, quantizer=None, ue8m0=False) -> Path:
    """`source`'s `*_proj.weight` tensors quantized by `quantizer` (compressed-tensors by default),
    scales stored in `scale_dtype`, the rest as they are; config.json with the release's four keys
    (and Qwen3-30B-A3B-FP8's full-name skip list)."""
    import json

    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors, fp8_tensors, kept = load_file(source / "model.safetensors"), {}, []
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):
            q, scale = (quantizer or reference_quantize)(tensor)
            fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q, scale.to(scale_dtype)
        else:
            fp8_tensors[name] = tensor
            kept.append(name.removesuffix(".weight"))
    save_file(fp8_tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {**KEYS, "modules_to_not_convert": kept, **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"bf16": dense, "moe-bf16": MoE} and their FP8 checkpoints, quantized by compressed-tensors:
    "fp8" (fp32 scales), "fp8-bf16-scales", "moe-fp8" (bf16 scales, as Qwen's releases), "moe-fp8-fp32"."""
    from fixtures.make_fixtures import make_qwen3, make_qwen3_moe

    root = tmp_path_factory.mktemp("fp8")
    made = {"bf16": make_qwen3(root / "bf16", **ALIGNED), "moe-bf16": make_qwen3_moe(root / "moe-bf16", **MOE)}
    if (COMPRESSED_TENSORS / "compressed_tensors").is_dir() or os.environ.get("CI"):
        made["fp8"] = write_fp8(made["bf16"], root / "fp8")
        made["fp8-bf16-scales"] = write_fp8(made["bf16"], root / "fp8-bf16-scales", torch.bfloat16)
        made["moe-fp8"] = write_fp8(made["moe-bf16"], root / "moe-fp8", torch.bfloat16)
        made["moe-fp8-fp32"] = write_fp8(made["moe-bf16"], root / "moe-fp8-fp32")
    return made


def transformers_state(hf_dir: Path, dtype=torch.bfloat16) -> dict:
    """transformers' in-memory tensors of `hf_dir` (on a CPU it dequantizes FP8 itself), with the fused
    experts of transformers 5 split back into the per-expert names of the files."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).state_dict()
    out = {}
    for name, tensor in state.items():
        prefix, _, proj = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and proj in ("gate_up_proj", "down_proj"):
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            for e, expert in enumerate(tensor):
                for part, piece in zip(parts, expert.chunk(len(parts))):
                    out[f"{prefix}.{e}.{part}.weight"] = piece
        else:
            out[name] = tensor
    return out


@needs_compressed_tensors
@pytest.mark.parametrize("fixture,sizes", [("fp8-bf16-scales", dict(tp=2)), ("moe-fp8", dict(tp=2, ep=2))])
def test_hf2mcore_dequantizes_as_transformers(models, tmp_path, fixture, sizes):
    """hf2mcore of an FP8 checkpoint (bf16 scales, as Qwen's releases) writes the same Megatron rank
    files' tensors as hf2mcore of transformers' own dequantization of it (its bf16 parameters, saved
    with safetensors), whose forward test_oracle_megatron.py holds to transformers' logits; back to HF
    without --quantize every tensor equals transformers' dequantization bit for bit, and config.json
    has no quantization_config (transformers loads it as a plain model)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from mconv import Layout, hf2mcore, mcore2hf
    from mconv.converter import megatron_io as mio
    from tests.conftest import hf_tensors, load_rank_file

    expected = {k: v for k, v in transformers_state(models[fixture]).items() if not k.endswith("rotary_emb.inv_freq")}
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    save_file(expected, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((models[fixture] / "config.json").read_text())
    del config["quantization_config"]
    (dequantized / "config.json").write_text(json.dumps(config))
    layout = Layout(**sizes)
    for source, out in ((models[fixture], tmp_path / "m"), (dequantized, tmp_path / "m-plain")):
        hf2mcore(source, out, layout, fmt="torch", progress=False)
    for rank in layout.ranks():
        ours, theirs = (load_rank_file(mio.rank_file(d / "release", layout, rank))["model"] for d in
                        (tmp_path / "m", tmp_path / "m-plain"))
        assert ours.keys() == theirs.keys()
        for key, tensor in ours.items():
            assert tensor is None if theirs[key] is None else torch.equal(bits(tensor), bits(theirs[key])), key
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    written = hf_tensors(tmp_path / "back")
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    assert written.keys() == expected.keys()
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name
    shutil.rmtree(dequantized)


@needs_compressed_tensors
def test_round_trip_gives_the_input_bytes(models, tmp_path):
    """FP8 (quantized by compressed-tensors; UE8M0 by SGLang's rule) -> Megatron (bfloat16) ->
    `mcore2hf --quantize fp8` gives the input's tensors back bit for bit (`mconv verify`), dense at TP1
    (legacy format: read by pread) and MoE at TP2/EP2 (so the bytes do not depend on the layout); a bf16-scale input comes back with
    fp32 scales whose bf16 cast is the input's."""
    import json

    from mconv import Layout, hf2mcore, mcore2hf
    from mconv.converter.pipelines import compare_hf
    from tests.conftest import hf_tensors

    ue8m0 = write_fp8(models["bf16"], tmp_path / "ue8m0", quantizer=sglang_ue8m0, ue8m0=True)
    # UE8M0 comes back without fp8_scale: the checkpoint keeps the source's config.json, whose
    # quantization_config.scale_fmt says it
    for name, source, sizes, fmt in [("dense", models["fp8"], dict(), "torch"),
                                     ("moe", models["moe-fp8-fp32"], dict(tp=2, ep=2), "torch_dist"),
                                     ("ue8m0", ue8m0, dict(tp=2), "torch_dist"),
                                     ("bf16-scales", models["fp8-bf16-scales"], dict(), "torch_dist")]:
        hf2mcore(source, tmp_path / f"{name}-m", Layout(**sizes), fmt=fmt, progress=False)
        mcore2hf(tmp_path / f"{name}-m", tmp_path / f"{name}-back", progress=False, quantize="fp8")
        if name == "bf16-scales":
            expected, written = hf_tensors(source), hf_tensors(tmp_path / f"{name}-back")
            assert expected.keys() == written.keys()
            for key, tensor in written.items():
                assert torch.equal(bits(tensor.to(expected[key].dtype)), bits(expected[key])), key
            continue
        tensors, nbytes, differences = compare_hf(source, tmp_path / f"{name}-back")
        assert differences == [] and tensors > 20, name
        config = json.loads((tmp_path / f"{name}-back" / "config.json").read_text())
        written, given = config["quantization_config"], json.loads((source / "config.json").read_text())["quantization_config"]
        assert sorted(written.pop("modules_to_not_convert")) == sorted(given.pop("modules_to_not_convert"))
        assert written == given and config["dtype"] == "bfloat16"


@needs_compressed_tensors
def test_quantized_output_loads_in_transformers(models, tmp_path):
    """`mcore2hf --quantize fp8` of a bf16 model: transformers loads it with no missing or unexpected
    keys and its logits are within 0.1 of the bf16 model's (measured 0.064, the largest logit being 0.74:
    this random tiny MoE has weights of std 0.02, and e4m3 keeps 3 mantissa bits); its FP8 weights and
    scales are compressed-tensors' quantization of the bf16 weights, bit for bit; embeddings, lm_head,
    norms and the router stay bf16 and are named in full in modules_to_not_convert."""
    import json

    from transformers import AutoModelForCausalLM

    from mconv import Layout, hf2mcore, mcore2hf
    from tests.conftest import hf_tensors

    source = models["moe-bf16"]
    hf2mcore(source, tmp_path / "m", Layout(tp=2, ep=2), progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "fp8", progress=False, quantize="fp8")
    written, original = hf_tensors(tmp_path / "fp8"), hf_tensors(source)
    for name, tensor in original.items():
        if name.endswith("_proj.weight"):
            q, scale = reference_quantize(tensor)
            assert torch.equal(bits(written[name]), bits(q)) and torch.equal(written[name + "_scale_inv"], scale), name
        else:
            assert torch.equal(written[name], tensor), name
    assert len(written) == len(original) + sum(name.endswith("_proj.weight") for name in original)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert {k: config[k] for k in KEYS} == KEYS
    assert {"lm_head", "model.embed_tokens", "model.norm", "model.layers.0.mlp.gate", "model.layers.1.input_layernorm",
            "model.layers.0.self_attn.q_norm"} <= set(config["modules_to_not_convert"])
    assert not any(m.endswith("_proj") for m in config["modules_to_not_convert"])
    tokens = torch.tensor([list(range(3, 60, 4))])
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == set() or info["missing_keys"] == info["unexpected_keys"] == []
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        difference = (model(tokens).logits - plain(tokens).logits).abs().max().item()
    assert 0 < difference < 0.1, difference


@needs_compressed_tensors
def test_bad_fp8_checkpoints_are_refused_in_one_line(models, tmp_path):
    """A missing, mis-shaped, non-finite or negative scale, a zero one for a block that is not all
    zeros (an all-zero block's is read), one below float32's smallest normal, one so large the weight
    overflows to inf (bfloat16 and float32), an unknown quant_method / fmt / block size, and
    --fp8-scale without --quantize: one line naming the tensor or field, nothing written (inspect
    says a mis-shaped scale too). hf2mcore notes that it dequantizes; mcore2hf --quantize fp8 notes
    blocks other than 128x128 and names the checkpoint of a weight holding inf."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.test_errors import assert_refused, mconv

    weight = "model.layers.1.mlp.down_proj.weight"

    def variant(name, tensors=None, quantization=None) -> Path:
        hf = Path(shutil.copytree(models["fp8"], tmp_path / name))
        if tensors is not None:
            save_file(tensors(load_file(hf / "model.safetensors")), hf / "model.safetensors", metadata={"format": "pt"})
        if quantization is not None:
            config = json.loads((hf / "config.json").read_text())
            config["quantization_config"].update(quantization)
            (hf / "config.json").write_text(json.dumps(config))
        return hf

    def without_scale(t):
        del t[weight + "_scale_inv"]
        return t

    def reshaped(t):
        t[weight + "_scale_inv"] = t[weight + "_scale_inv"][:, :1].contiguous()
        return t

    def nan(t):
        t[weight + "_scale_inv"][0, 1] = float("nan")
        return t

    def negative(t):  # dequantized with it, the block's weights would flip sign
        t[weight + "_scale_inv"][0, 0] *= -1
        return t

    def zero(t):  # dequantized with it, the block's weights would all be zero
        t[weight + "_scale_inv"][0, 0] = 0
        return t

    def huge(t):  # finite, but 448 x 1e36 overflows float32 (and bfloat16): the weights would be inf
        t[weight + "_scale_inv"][0, 1] = 1e36
        return t

    def subnormal(t):  # 1e-45 is float32's smallest subnormal: the block's weights would be zero
        t[weight + "_scale_inv"][0, 0] = 1e-45
        return t

    def zero_block(t):  # an all-zero block may have a zero scale: it dequantizes to zeros either way
        t[weight][:128, :128] = 0
        t[weight + "_scale_inv"][0, 0] = 0
        return t

    unlabelled = variant("no-config")  # scales without a quantization_config: not "unexpected tensor ..."
    config = json.loads((unlabelled / "config.json").read_text())
    del config["quantization_config"]
    (unlabelled / "config.json").write_text(json.dumps(config))
    cases = [(unlabelled, ("_scale_inv is a block scale, but", "config.json has no quantization_config")),
             (variant("missing", without_scale), (weight, "no block scale")),
             (variant("shape", reshaped), (weight + "_scale_inv", "[1, 1]", "[1, 2]")),
             (variant("nan", nan), (weight + "_scale_inv", "inf, NaN or negative")),
             (variant("negative", negative), (weight + "_scale_inv", "inf, NaN or negative")),
             (variant("zero", zero), (weight + "_scale_inv", f"zero block scale for a block of {weight}")),
             (variant("huge", huge), ("huge/model.safetensors: tensor " + weight + "_scale_inv",
                                      f"so large that {weight} dequantized into bfloat16 overflows to inf")),
             (variant("subnormal", subnormal), ("subnormal/model.safetensors: tensor " + weight + "_scale_inv",
                                                "below float32's smallest normal", "no FP8 quantizer writes")),
             (variant("method", quantization={"quant_method": "gptq"}), ("quant_method is 'gptq'",)),
             (variant("fmt", quantization={"fmt": "e5m2"}), ("quantization_config.fmt is 'e5m2'",)),
             (variant("block", quantization={"weight_block_size": [128]}), ("quantization_config.weight_block_size",))]
    for hf, fragments in cases:
        assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", *fragments)
    assert mconv("hf2mcore", variant("zero-block", zero_block), tmp_path / "zero-block-out", "-q").exit_code == 0
    assert_refused(mconv("hf2mcore", tmp_path / "huge", tmp_path / "out", "--dtype", "float32"), tmp_path / "out",
                   "dequantized into float32 overflows to inf")
    result = mconv("hf2mcore", models["fp8"], tmp_path / "dry", "--dry-run")  # says it dequantizes, and how back
    assert result.exit_code == 0 and (f"mconv: note: {models['fp8']} is FP8 (blocks 128x128): its weights are "
                                      "dequantized into bfloat16; pass --quantize fp8 to mcore2hf") in result.stderr
    assert mconv("hf2mcore", models["fp8"], tmp_path / "m", "-q").exit_code == 0
    # blocks other than 128x128 are read, but written back in 128x128: the note says so; config.json's
    # dtype is the weights' unquantized dtype (docs/fp8.md)
    result = mconv("mcore2hf", tmp_path / "m", tmp_path / "b64-out", "--quantize", "fp8", "--dtype", "float32",
                   "--hf-config", variant("b64", quantization={"weight_block_size": [64, 64]}))
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "b64-out" / "config.json").read_text())["dtype"] == "float32"
    assert "FP8 blocks were [64, 64]; mconv writes FP8 in 128x128 blocks" in result.stderr
    # a weight holding inf cannot be quantized: refused naming the Megatron checkpoint and the tensor
    infinite = Path(shutil.copytree(models["bf16"], tmp_path / "inf-hf"))
    tensors = load_file(infinite / "model.safetensors")
    tensors[weight][3, 3] = float("inf")
    save_file(tensors, infinite / "model.safetensors", metadata={"format": "pt"})
    assert mconv("hf2mcore", infinite, tmp_path / "inf-m", "-q").exit_code == 0
    assert_refused(mconv("mcore2hf", tmp_path / "inf-m", tmp_path / "out", "--quantize", "fp8"), tmp_path / "out",
                   f"{tmp_path / 'inf-m'}: tensor {weight} holds inf or NaN values, which FP8 cannot quantize")
    for command in ("mcore2hf", "export-lora"):  # --help says the real defaults and which models are written
        said = " ".join(mconv(command, "--help").output.split())
        assert "Default: the" in said and "quantization_config.scale_fmt" in said and "(default, amax" not in said
        assert "Qwen3, Qwen3-MoE, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5/3.6 (text and VL" in said and "Qwen3-Next" in said
    for command in ("mcore2hf", "export-lora"):  # a usage error, click's exit status 2
        result = mconv(command, tmp_path / "m", tmp_path / "out", "--fp8-scale", "ue8m0")
        assert result.exit_code == 2 and not (tmp_path / "out").exists(), result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "mconv: error: --fp8-scale ue8m0 applies with --quantize fp8 (see '"), result.stderr
    result = mconv("inspect", models["fp8"])
    assert result.exit_code == 0 and "block-wise FP8" in result.stdout and "14 weights" in " ".join(result.stdout.split())
    # equal bytes under another scale format are other weights: verify says so
    result = mconv("verify", models["fp8"], variant("scale-fmt", quantization={"scale_fmt": "ue8m0"}))
    assert result.exit_code == 1 and 'quantization_config.scale_fmt: null vs "ue8m0"' in result.output, result.output
    said = " ".join(mconv("inspect", tmp_path / "fmt").stdout.split())  # what hf2mcore refuses, inspect says so
    assert "quantization_config.fmt is 'e5m2'" in said and "refuse it" in said and "dequantize them" not in said
    said = " ".join(mconv("inspect", tmp_path / "shape").stdout.split())  # scale shapes are checked from the headers
    assert f"tensor {weight}_scale_inv is float32 [1, 1]" in said and "refuse it" in said, said


@pytest.mark.slow
@needs_compressed_tensors
def test_live_fp8_load_and_export(models, tmp_path):
    """megatron-core's MoE model at TP2/EP2 (gloo, CPU): load_hf_weights of an FP8 checkpoint gives
    transformers' logits (its own dequantization, float32); iter_hf_weights(quantize="fp8") yields every
    tensor of `mcore2hf --quantize fp8`'s output once per stage, bit for bit, each scale in its weight's
    bucket, the attention weights (block-aligned TP shards) and the experts (over EP) quantized before
    their gathers (the live model is float32: its FP8 bytes equal those quantized from the bfloat16 checkpoint,
    the other tensors are compared by value); save_hf_weights(quantize="fp8") writes the same values."""
    from mconv import Layout, hf2mcore, mcore2hf
    from mconv.converter.transforms import padded_vocab_size
    from tests.megatron_oracle import MegatronRun, hf_logits, megatron_logits, read_config

    source, sizes = models["moe-fp8-fp32"], dict(tp=2, ep=2)
    config, out = read_config(source), tmp_path / "live"
    out.mkdir()
    run = MegatronRun(tmp_path / "unused", config, **sizes, tokens=TOKENS, live_hf=source, live_out=out,
                      live_quantize="fp8", padded_vocab=padded_vocab_size(config["vocab_size"], 128, 2))
    assert (megatron_logits(run, tmp_path) - hf_logits(source, TOKENS)).abs().max().item() < 1e-4
    hf2mcore(source, tmp_path / "m", Layout(**sizes), progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "offline", progress=False, quantize="fp8")
    # quantized before the gathers: attention over TP (128-row / 128-column shards), experts over EP
    assert_live_fp8_is_offline(out, run.world, tmp_path / "offline", {"tp", "ep"},
                               "model.layers.0.self_attn.q_proj.weight")


def assert_live_fp8_is_offline(out, world: int, offline_dir, fp8_gathers: set[str],
                               nan_weight: str | None = None) -> None:
    """What tests/megatron_oracle.py's worker wrote to `out` from iter_hf_weights(quantize="fp8") (one
    pipeline stage): on every rank each tensor of the offline `mcore2hf --quantize fp8` output once,
    bit for bit (the live model is float32, the offline checkpoint bfloat16: values are compared),
    each scale in its weight's bucket, FP8 sent over at least the `fp8_gathers` groups;
    save_hf_weights(quantize="fp8") wrote the same values; and, given `nan_weight` (layer 0's query
    weight), a NaN there was refused by name before the bucket holding it was yielded."""
    from tests.conftest import hf_tensors

    offline = hf_tensors(offline_dir)
    for rank in range(world):
        buckets, gathers = (torch.load(out / f"rank{rank}.pt")[key] for key in ("buckets", "gathers"))
        assert {kind for kind, dtypes in gathers if "torch.float8_e4m3fn" in dtypes} >= fp8_gathers, gathers
        names = [name for bucket in buckets for name, _ in bucket]
        assert sorted(names) == sorted(offline), rank
        for bucket in buckets:
            held = {name for name, _ in bucket}
            for name, tensor in bucket:
                assert name.removesuffix("_scale_inv") in held
                assert (tensor.dtype == torch.float8_e4m3fn) == (offline[name].dtype == torch.float8_e4m3fn), name
                assert torch.equal(bits(tensor.to(offline[name].dtype)), bits(offline[name])), name
    saved = hf_tensors(out / "saved")
    assert saved.keys() == offline.keys()
    assert all(torch.equal(bits(saved[name].to(t.dtype)), bits(t)) for name, t in offline.items())
    # A NaN weight is refused by name on every rank (each rank's shard holds one) before its bucket
    for rank in range(world if nan_weight else 0):
        buckets, nan = torch.load(out / f"rank{rank}.pt")["buckets"], torch.load(out / f"nan{rank}.pt")
        assert nan["refused"] == f"{nan_weight} holds inf or NaN values, which FP8 cannot quantize", nan
        holding = next(i for i, bucket in enumerate(buckets) if nan_weight in dict(bucket))
        assert nan["yielded"] == holding, (nan, holding, len(buckets))


