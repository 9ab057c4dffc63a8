"""torch_dist reader/writer benchmark (CPU, run by hand): hf2mcore and mcore2hf in the torch_dist
format, for one or more mconv source trees (e.g. before and after a change), on the tiny fixture and
on a synthetic Qwen3-MoE-shaped checkpoint of a few hundred MB.

    .venv/bin/python bench/torch_dist_io.py --tree before=/path/to/old/checkout --tree after=.
    .venv/bin/python bench/torch_dist_io.py --tree after=. --workers 1 2 --layers 2

Each command is a child process run with PYTHONPATH=<tree> (its time includes imports and a `sync`
afterwards); the copy floor is `cp` of the input safetensors files, then sync. A second child per
tree counts how often one in-process mcore2hf (batches of 32 MB) parses `.metadata`. Prints a table
and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COUNT = """import sys
from pathlib import Path
calls = []
from torch.distributed.checkpoint.filesystem import FileSystemReader  # the reader before mconv had its own
real = FileSystemReader.read_metadata
FileSystemReader.read_metadata = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
try:
    from mconv.converter import safe_load
    load = safe_load.load_pickle
    safe_load.load_pickle = lambda path, *a: calls.append(1) or load(path, *a)
except ImportError:
    pass
from mconv import mcore2hf
mcore2hf(sys.argv[1], sys.argv[2], progress=False)
print(len(calls))
"""


class Rows(list):
    """The measured rows, each also printed to stderr as soon as it is measured."""

    def append(self, row) -> None:
        print("row:", json.dumps(row), file=sys.stderr, flush=True)
        super().append(row)


def timed(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    # cwd=/: `python -c` puts the working directory first on sys.path, before PYTHONPATH's tree
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, cwd="/")
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


def mconv(tree: Path, *args) -> tuple[list[str], dict]:
    return ([sys.executable, "-c", "from mconv.cli import main; main()", *map(str, args), "-q"],
            {**os.environ, "PYTHONPATH": str(tree)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of an mconv source tree")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[1])
    parser.add_argument("--workdir", type=Path, default=None)
    options = parser.parse_args()
    import transformers

    from fixtures.make_fixtures import make_synthetic

    work = Path(options.workdir or tempfile.mkdtemp(prefix="mconv-bench-td-"))
    config = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=options.experts, num_experts_per_tok=4, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_hidden_layers=options.layers, architectures=["Qwen3MoeForCausalLM"])
    big = work / "hf-big"
    if not big.is_dir():
        make_synthetic(big, config)
    inputs = {"tiny": ROOT / "fixtures" / "qwen3-moe-tiny", "synthetic": big}
    sizes = {k: sum(p.stat().st_size for p in v.glob("*.safetensors")) for k, v in inputs.items()}
    rows = Rows()
    floor = work / "floor"
    start = time.perf_counter()
    floor.mkdir(exist_ok=True)
    for path in big.glob("*.safetensors"):
        shutil.copy(path, floor / path.name)
    subprocess.run(["sync"], check=True)
    copy = time.perf_counter() - start
    shutil.rmtree(floor)
    rows.append(("copy floor", "synthetic", 1, copy, None))
    for spec in options.tree:
        name, tree = spec.split("=", 1)
        tree = Path(tree).resolve()
        for label, hf in inputs.items():
            for workers in options.workers:
                out = work / f"{name}-{label}-{workers}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(f"{out}-hf", ignore_errors=True)
                extra = ["--workers", workers] if workers > 1 else ["--workers", 1]
                rows.append((f"{name}: hf2mcore", label, workers, timed(*mconv(tree, "hf2mcore", hf, out, *extra)), None))
                seconds = timed(*mconv(tree, "mcore2hf", out, f"{out}-hf", "--workers", 1))
                rows.append((f"{name}: mcore2hf", label, 1, seconds, None))
        out = work / f"{name}-synthetic-1"
        shutil.rmtree(f"{out}-count", ignore_errors=True)
        count = subprocess.run([sys.executable, "-c", COUNT, str(out), f"{out}-count"], env=mconv(tree)[1],
                               check=True, capture_output=True, text=True, cwd="/").stdout.split()[-1]
        rows.append((f"{name}: .metadata parses in one mcore2hf", "synthetic", 1, None, int(count)))
    print(f"synthetic checkpoint: {sizes['synthetic'] / 1e6:.0f} MB, {options.layers} layers, "
          f"{options.experts} experts; tiny: {sizes['tiny'] / 1e6:.1f} MB")
    print(f"{'command':45} {'input':10} {'workers':>7} {'seconds':>8} {'x floor':>8} {'count':>6}")
    for command, label, workers, seconds, count in rows:
        ratio = f"{seconds / copy:8.2f}" if seconds is not None and label == "synthetic" else " " * 8
        print(f"{command:45} {label:10} {workers:7d} {seconds if seconds is not None else float('nan'):8.2f} "
              f"{ratio} {count if count is not None else '':>6}")
    print(json.dumps({"sizes": sizes, "rows": rows, "machine": os.uname().nodename, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
