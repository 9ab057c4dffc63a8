"""FP8 block quantization on a GPU (one run, ratios printed): (1) fp8.quantize on CUDA gives the CPU's
bytes (edge blocks, all-zero blocks, values beyond +-448, both scale formats); (2) quantization
throughput against the device's copy bandwidth, on Qwen3-30B-A3B-shaped expert weights (one
[1536, 2048] gate_up and one [2048, 768] down per expert, 128 experts; `--layer`: a layer's q, k,
v, o and each expert's gate, up and down, as the live export quantizes them): eager per tensor, and under
torch.compile, and batched (fp8.quantize_tensors: the Triton kernels of fp8_batch, a whole bucket
of weights per launch, as the live export quantizes; and that kernel's launches alone), whose
bytes are checked equal to the CPU's fp8.quantize of every weight (`--rows`: the kernel alone reading
that many rows of a block a step, each in turn). Copy floors: the same tensors
cloned one by one, copied in one launch (torch.cat), and their bytes as one flat buffer copied
(the device's copy rate). Each time is the fastest of --repeat calls. Prints one JSON line per
measurement.

    python bench/fp8_bench.py [--experts 128] [--repeat 5] [--layer] [--rows 32 64 32 64]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.live_bench import require_gpu  # noqa: E402
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
    """The fastest of `repeat` calls after a first (which compiles kernels and plans the batch), each
    timed to the device's end (a batched quantization waits for its kernels anyway: its finite check)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def batched_bytes_equal_cpu(weights: list[torch.Tensor], scale_fmt: str) -> dict:
    """fp8.quantize_tensors on the GPU (batched) against fp8.quantize on the CPU, every weight."""
    quantization = fp8.Quantization(lambda name: True, scale_fmt)
    out = fp8.quantize_tensors([(str(i), w) for i, w in enumerate(weights)], quantization)
    differing_bytes = differing_scales = 0
    for i, w in enumerate(weights):
        q, s = fp8.quantize(w.cpu(), scale_fmt)
        gq, gs = out[2 * i][1].cpu(), out[2 * i + 1][1].cpu()
        differing_bytes += int((gq.view(torch.uint8) != q.view(torch.uint8)).sum())
        differing_scales += int((gs.view(torch.int32) != s.view(torch.int32)).sum())
    return {"check": f"batched cuda quantize_tensors == cpu quantize ({scale_fmt})", "weights": len(weights),
            "differing bytes": differing_bytes, "differing scales": differing_scales}


def kernel_alone(weights: list[torch.Tensor], rows: int | None = None):
    """A call of fp8_batch's launches for `weights` (float scales), without the host's work around
    them (the plan, the addresses, the output views, the finite check), reading `rows` rows of a
    block per step (None: fp8_batch's choice); the bytes are checked equal to the default's."""
    from mconv.converter import fp8_batch

    plan = fp8_batch._plan(weights, [True] * len(weights))
    plan.table[:, 0].copy_(torch.tensor([weights[i].data_ptr() for i in plan.order], dtype=torch.int64))
    out = torch.empty(plan.out_numel, dtype=fp8.FP8, device="cuda")
    scale = torch.empty(plan.blocks, dtype=torch.float32, device="cuda")
    bad = torch.full((1,), len(weights), dtype=torch.int64, device="cuda")
    rows = rows or fp8_batch._ROWS
    fp8_batch._launch(plan, "float", scale, out, bad, rows)
    expected = torch.empty_like(out), torch.empty_like(scale)
    fp8_batch._launch(plan, "float", expected[1], expected[0], bad.clone())
    assert torch.equal(out.view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(scale, expected[1]), rows
    return lambda: fp8_batch._launch(plan, "float", scale, out, bad, rows)


def throughput(experts: int, repeat: int, compiled: bool, rows: list[int], layer: bool) -> list[dict]:
    shapes = ([(4096, 2048), (512, 2048), (512, 2048), (2048, 4096)] + [(768, 2048), (768, 2048), (2048, 768)] * experts
              if layer else [(1536, 2048), (2048, 768)] * experts)
    weights = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02 for shape in shapes]
    nbytes = sum(w.nbytes for w in weights)
    quantization = fp8.Quantization(lambda name: True)
    named = [(str(i), w) for i, w in enumerate(weights)]
    copy = timed(lambda: [w.clone() for w in weights], repeat)
    flat, into = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    flat_copy = timed(lambda: into.copy_(flat), repeat)
    del flat, into
    runs = [("copy one by one (clone)", copy),
            ("copy in one launch (torch.cat)", timed(lambda: torch.cat([w.view(-1) for w in weights]), repeat)),
            ("quantize eager, per tensor", timed(lambda: [fp8.quantize(w, check=False) for w in weights], repeat)),
            ("quantize batched (quantize_tensors)", timed(lambda: fp8.quantize_tensors(named, quantization), repeat)),
            ("quantize batched, the kernel alone", timed(kernel_alone(weights), repeat))]
    for count in rows:  # in the order given (32 64 32 64: a drift of the device's speed shows)
        runs.append((f"the kernel alone, {count} rows a step", timed(kernel_alone(weights, count), repeat)))
    if compiled:
        compiled_quantize = torch.compile(fp8.quantize, dynamic=False)
        runs.append(("quantize torch.compile, per tensor",
                     timed(lambda: [compiled_quantize(w, check=False) for w in weights], repeat)))
    return [{"what": name, "tensors": len(weights), "GB": round(nbytes / 1e9, 3),
             "GB/s": round(nbytes / seconds / 1e9, 1), "ratio to copy one by one": round(copy / seconds, 3),
             "ratio to copy in one launch": round(runs[1][1] / seconds, 3),
             "ratio to flat copy": round(flat_copy / seconds, 3)} for name, seconds in runs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--compiled", action="store_true", help="also time per-tensor torch.compile")
    parser.add_argument("--rows", type=int, nargs="*", default=[],
                        help="also time the kernel alone reading this many rows of a block a step, each in turn "
                             "(its bytes checked equal to the default's)")
    parser.add_argument("--layer", action="store_true",
                        help="a whole MoE layer's weights as the live export quantizes them (q, k, v, o; per expert "
                             "gate, up and down) instead of fused gate_up and down per expert")
    args = parser.parse_args()
    require_gpu("fp8_bench.py")
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    print(json.dumps(same_bytes_on_gpu()))
    torch.manual_seed(1)
    awkward = [torch.randn(shape, device="cuda") * 3 for shape in ((300, 200), (1536, 2048), (2048, 768), (130, 4100))]
    awkward[0][:128, :128] = 0
    awkward[0][200, 5] = 5000.0
    mixed = awkward + [w.bfloat16() for w in awkward] + [awkward[1].bfloat16().t(), awkward[2][100:1000, 3:700]]
    for scale_fmt in fp8.SCALE_FORMATS:
        print(json.dumps(batched_bytes_equal_cpu(mixed, scale_fmt)))
    for line in throughput(args.experts, args.repeat, args.compiled, args.rows, args.layer):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
