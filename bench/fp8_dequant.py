"""FP8 dequantization on the CPU (what hf2mcore and load_hf_weights do to every block-FP8 weight they
read; one run, ratios printed): `fp8.dequantize` of float8_e4m3fn weights with float32 block scales
into bfloat16, against (1) the plain formula with torch's own cast, `(q.float() * s).to(bfloat16)`
with the scales repeated over their blocks (the baseline), and (2) a bfloat16 -> bfloat16 copy of
the same output (the floor: the output's bytes written once; at these sizes largely in the CPU's cache,
so a floor no eager torch code reaches). Both results are checked equal
bit for bit. Each time is the fastest of --repeat calls, torch's default thread count.

    .venv/bin/python bench/fp8_dequant.py [--repeat 5]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mconv.converter import fp8  # noqa: E402

SHAPES = ((768, 2048), (2048, 768), (4096, 2048), (6144, 4096))  # experts' gate / down, attention, dense MLP


def fastest(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    for shape in SHAPES:
        q, scale = fp8.quantize(torch.randn(shape, dtype=torch.bfloat16))
        out, copy_source = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
        per_element = scale.repeat_interleave(fp8.BLOCK, 0)[:shape[0]].repeat_interleave(fp8.BLOCK, 1)[:, :shape[1]]

        def plain():
            return (q.float() * per_element).to(torch.bfloat16)

        assert torch.equal(fp8.dequantize(q, scale, torch.bfloat16, out=out).view(torch.int16),
                           plain().view(torch.int16)), shape
        mconv_s = fastest(lambda: fp8.dequantize(q, scale, torch.bfloat16, out=out), args.repeat)
        plain_s = fastest(plain, args.repeat)
        floor_s = fastest(lambda: out.copy_(copy_source), args.repeat)
        print(json.dumps({"shape": list(shape), "threads": torch.get_num_threads(), "dequantize_ms": round(mconv_s * 1e3, 2),
                          "plain_ms": round(plain_s * 1e3, 2), "copy_floor_ms": round(floor_s * 1e3, 2),
                          "x_plain": round(mconv_s / plain_s, 2), "x_floor": round(mconv_s / floor_s, 2),
                          "ns_per_element": round(mconv_s / q.numel() * 1e9, 2), "check": "bit for bit"}))


if __name__ == "__main__":
    main()
