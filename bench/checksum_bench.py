"""Micro-benchmark of verify=True's checksums (mconv.transport.flat.checksums), CPU or GPU.

The tensors of a Qwen3-30B-A3B-shaped model's layers, scaled down (128 experts: per layer 384
expert matrices, 4 attention matrices and 4 norms; bf16), as a sync's sender sees them (views of
one flat buffer, what `sync_weights` checksums per bucket) and as a receiver holds them (separate
tensors, what `ParameterReceiver.held_checksums` reads back). Prints one JSON line: tensors, bytes,
the best of 3 times of each side, and the torch operators one call runs (views aside; each a kernel
launch on a GPU).

    PYTHONPATH=$PWD .venv/bin/python bench/checksum_bench.py [--device cuda] [--layers 6] [--scale 1]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mconv.transport.flat import checksums, layout, pack, unpack  # noqa: E402


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += not func.is_view  # views launch nothing
        return func(*args, **(kwargs or {}))


def model(layers: int, scale: int, device: str) -> list[tuple[str, torch.Tensor]]:
    hidden, expert, heads = 256 * scale, 96 * scale, 512 * scale
    named = []
    for layer in range(layers):
        p = f"model.layers.{layer}."
        named += [(p + n, torch.randn(*s, device=device).bfloat16()) for n, s in (
            ("self_attn.q_proj.weight", (heads, hidden)), ("self_attn.k_proj.weight", (heads // 8, hidden)),
            ("self_attn.v_proj.weight", (heads // 8, hidden)), ("self_attn.o_proj.weight", (hidden, heads)),
            ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,)),
            ("self_attn.q_norm.weight", (128,)), ("self_attn.k_norm.weight", (128,)))]
        named += [(f"{p}mlp.experts.{e}.{n}.weight", torch.randn(*s, device=device).bfloat16())
                  for e in range(128) for n, s in (("gate_proj", (expert, hidden)), ("up_proj", (expert, hidden)),
                                                   ("down_proj", (hidden, expert)))]
    return named


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--scale", type=int, default=1)
    options = parser.parse_args()
    named = model(options.layers, options.scale, options.device)
    entries, nbytes = layout(named)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=options.device)
    pack(named, entries, buffer)
    sides = {"sender": unpack(buffer, entries), "receiver": named}
    result = {"device": options.device, "tensors": len(named), "bytes": nbytes}
    for side, tensors in sides.items():
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            sums = checksums(tensors)  # ends with a host transfer: nothing left running
            best = min(best, time.perf_counter() - started)
        with _Count() as count:
            checksums(tensors)
        result[f"{side}_s"], result[f"{side}_ops"] = round(best, 4), count.calls
    assert sums == checksums(sides["sender"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
