"""FP8 block quantization on a GPU (one run, ratios printed): (1) fp8.quantize on CUDA gives the CPU's
bytes (edge blocks, all-zero blocks, values beyond +-448, both scale formats); (2) quantization
throughput against the device's copy bandwidth, on Qwen3-30B-A3B-shaped expert weights (one
[1536, 2048] gate_up and one [2048, 768] down per expert, 128 experts): eager per tensor, and under
torch.compile. Prints one JSON line per measurement.

    python bench/fp8_bench.py [--experts 128] [--repeat 5]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mconv.converter import fp8  # noqa: E402


def same_bytes_on_gpu() -> dict:
    torch.manual_seed(0)
    w = torch.randn(300, 200) * 3
    w[:128, :128] = 0
    w[200, 5], w[201, 6] = 5000.0, -70000.0
    checked = 0
    for dtype in (torch.bfloat16, torch.float32):
        for fmt in fp8.SCALE_FORMATS:
            for tensor in (w.to(dtype), (torch.randn(1536, 2048) * 0.02).to(dtype)):
                q, s = fp8.quantize(tensor, fmt)
                gq, gs = fp8.quantize(tensor.cuda(), fmt)
                assert gq.is_cuda and torch.equal(gq.cpu().view(torch.uint8), q.view(torch.uint8)), (dtype, fmt)
                assert torch.equal(gs.cpu(), s), (dtype, fmt)
                checked += 1
    return {"check": "cuda quantize == cpu quantize, bit for bit", "cases": checked}


def timed(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def throughput(experts: int, repeat: int) -> list[dict]:
    weights = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(experts) for shape in ((1536, 2048), (2048, 768))]
    nbytes = sum(w.nbytes for w in weights)
    copy = timed(lambda: [w.clone() for w in weights], repeat)
    eager = timed(lambda: [fp8.quantize(w, check=False) for w in weights], repeat)
    compiled_quantize = torch.compile(fp8.quantize, dynamic=False)
    compiled = timed(lambda: [compiled_quantize(w, check=False) for w in weights], repeat)
    results = []
    for name, seconds in (("copy (clone)", copy), ("quantize eager", eager), ("quantize torch.compile", compiled)):
        results.append({"what": name, "tensors": len(weights), "GB": round(nbytes / 1e9, 3),
                        "GB/s": round(nbytes / seconds / 1e9, 1), "ratio to copy": round(copy / seconds, 3)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    print(json.dumps(same_bytes_on_gpu()))
    for line in throughput(args.experts, args.repeat):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
