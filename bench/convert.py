"""Offline conversion benchmark (run by hand): mconv against the I/O floor and two peers.

    .venv/bin/python bench/convert.py                        # Qwen3-MoE-like, about 3 GB, fresh temp dir
    .venv/bin/python bench/convert.py --size-gb 11           # many cores: fixed costs become a small share
    .venv/bin/python bench/convert.py --size-gb 0.5          # quick debug run (smaller vocabulary / experts)
    .venv/bin/python bench/convert.py --workers 1,2,4,8 --formats torch --peers none   # choose a default
    .venv/bin/python bench/convert.py --model dense --workdir /data/b --reuse --json-out bench/convert.json
    .venv/bin/python bench/convert.py --size-gb 11 --formats torch --layouts TP1 --peers none --fp8   # FP8 writer and reader

In one run, on a synthetic HF checkpoint (random bf16 bits, transformers' on-disk names, written by
fixtures.make_fixtures.make_synthetic), it times and takes the peak RSS of:
  - the I/O floor: `cp` of the input .safetensors files to the output file system, then sync;
  - the same mconv commands on the tiny fixture: their fixed cost (imports, planning), beside the
    interpreter's own `python -c 'import torch'`;
  - `mconv hf2mcore` at TP1 and TP2/EP2 (TP2 for the dense model), formats torch_dist and torch,
    and `mconv mcore2hf` back from each output (`mconv verify` checks the TP2 legacy round trip, untimed);
  - a peer standing for the verl / Pai-Megatron-Patch approach (whole model in memory):
    transformers `from_pretrained` + `save_pretrained(max_shard_size="3GB")` (its output is verified too);
  - the mbridge peer (bench/peer_mbridge.py; on a GPU, or `--mbridge cpu`): AutoBridge.load_weights into a
    megatron-core GPTModel + dist_checkpointing.save, and dist_checkpointing.load + save_weights back
    (verified against the input).
Ratios printed: x the floor, the marginal cost (time minus the same command on the tiny fixture) x the
floor, and x each peer measured in the same run (mbridge: the same direction).
Each command is a child process; its time includes a `sync` afterwards (so written bytes reach the
disk, as the floor's do) and its peak RSS comes from `wait4` (the largest process of its tree). The
page cache cannot be dropped, so every command's input is read once just before it: all methods
read from the same warm cache. Prints a table and one JSON line (for the README).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Shapes of Qwen3-30B-A3B and Qwen3-8B; only the layer count is chosen to fit --size-gb.
MODELS = {
    "moe": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                   moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                   num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                   architectures=["Qwen3MoeForCausalLM"], norm_topk_prob=True)),
    "dense": ("Qwen3Config", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])),
}
FORMATS = ("torch_dist", "torch")
TINY = "tiny: "  # label of the rows measuring mconv's fixed cost on the tiny fixture
SHARD_BYTES = 1_000_000_000  # input shard size; make_synthetic holds one shard in memory while writing it
PEER = """import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
model.save_pretrained(sys.argv[2], max_shard_size="3GB")
"""


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def make_config(model: str, **kwargs):
    import transformers

    name, base = MODELS[model]
    return getattr(transformers, name)(**{**base, **kwargs})


def checkpoint_bytes(model: str, kwargs: dict, layers: int) -> int:
    """Bytes of the bf16 checkpoint, from the parameter shapes of the model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(make_config(model, **kwargs, num_hidden_layers=layers))
    return 2 * sum(t.numel() for t in net.state_dict().values())


def shrunk(model: str, halvings: int) -> dict:
    """Overrides halving the vocabulary and the expert count (MoE) or FFN width (dense) `halvings`
    times; TP2 and EP2 still divide everything."""
    if not halvings:
        return {}
    base, narrow = MODELS[model][1], "num_experts" if model == "moe" else "intermediate_size"
    kwargs = {"vocab_size": base["vocab_size"] >> halvings, narrow: base[narrow] >> halvings}
    if kwargs.get("num_experts", 8) < base.get("num_experts_per_tok", 8):
        raise SystemExit("--size-gb is too small for this model")
    return kwargs


def fit_config(model: str, size: float, layers: int | None) -> tuple[dict, str]:
    """Config overrides giving a checkpoint of about `size` bytes, and a note on its make-up.

    The layer count is the knob. At the real shapes the embeddings and one layer are already
    about 2.5 GB (both models), so a smaller target (a debug run) is met by shrinking the model's
    width with `shrunk` until one layer fits."""
    halvings, smallest_real = 0, checkpoint_bytes(model, {}, 1)
    while True:
        kwargs = shrunk(model, halvings)
        one, two = checkpoint_bytes(model, kwargs, 1), checkpoint_bytes(model, kwargs, 2)
        if layers or one <= size:
            break
        halvings += 1
    per_layer, fixed = two - one, 2 * one - two  # fixed: embeddings, lm_head, final norm
    kwargs["num_hidden_layers"] = layers or max(1, round((size - fixed) / per_layer))
    note = f"{fixed / 1e9:.2f} GB embeddings + {kwargs['num_hidden_layers']} x {per_layer / 1e9:.2f} GB layers"
    if halvings:
        note += f"; {kwargs} as one layer of the real shape is already {smallest_real / 1e9:.2f} GB"
    return kwargs, note


def prepare_input(workdir: Path, model: str, kwargs: dict, reuse: bool, finite: bool) -> Path:
    """The synthetic HF checkpoint; with --reuse, the one a previous run left in workdir if it was
    made with the same settings (recorded in a spec file beside it)."""
    from fixtures.make_fixtures import make_synthetic

    hf, spec_file = workdir / f"hf-{model}", workdir / f"hf-{model}.spec.json"
    spec = json.dumps(dict(model=model, kwargs=kwargs, shard_bytes=SHARD_BYTES, seed=0, finite=finite), sort_keys=True)
    if reuse and spec_file.exists() and spec_file.read_text() == spec:
        log(f"reusing {hf}")
        return hf
    shutil.rmtree(hf, ignore_errors=True)
    spec_file.unlink(missing_ok=True)
    log(f"writing synthetic checkpoint {hf}")
    make_synthetic(hf, make_config(model, **kwargs), shard_bytes=SHARD_BYTES, seed=0, finite=finite)
    spec_file.write_text(spec)  # written last: an interrupted generation is never reused
    return hf


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_of(path))


def warm(path: Path) -> None:
    """Read every file under `path` so the measured command finds it in the page cache (we cannot
    drop the cache, so instead every method starts from the same fully warm state)."""
    buffer = bytearray(64 * 2**20)
    for file in files_of(path):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


# Runs argv[2:], then reports its time (including a sync, so the written bytes reach the disk as the
# I/O floor's do) and its peak RSS into the file argv[1]. It exists because a child inherits the peak
# RSS of the process that spawns it: Linux records the spawner's high-water mark when the child
# execs (vfork shares the spawner's memory, fork copies it), so children of this benchmark, which
# has torch loaded, would all read >= its own peak. This small fresh interpreter spawns them instead.
TIMER = """import json, os, subprocess, sys, time
start = time.perf_counter()
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
os.sync()
seconds = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    json.dump(dict(seconds=seconds, maxrss_kb=usage.ru_maxrss), f)  # ru_maxrss is in KB on Linux
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measure(argv: list[str], warm_dir: Path, out: Path, repeat: int) -> tuple[float, int]:
    """Best wall time (command + sync) and largest peak RSS in bytes over `repeat` runs of `argv`."""
    best, peak = float("inf"), 0
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        warm(warm_dir)
        os.sync()  # flush earlier steps' writes so they are not billed to this one
        with tempfile.NamedTemporaryFile("r") as report, tempfile.TemporaryFile() as errors:
            done = subprocess.run([sys.executable, "-c", TIMER, report.name, *argv], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=errors)
            if done.returncode:
                errors.seek(0)
                raise SystemExit(f"failed ({done.returncode}): {' '.join(argv)}\n{errors.read().decode()[-3000:]}")
            result = json.load(report)
        best, peak = min(best, result["seconds"]), max(peak, result["maxrss_kb"] * 1024)
    return best, peak


def mbridge_mode(choice: str) -> tuple[list[str] | None, str]:
    """How to run the mbridge peer (bench/peer_mbridge.py), or why it is skipped. mbridge builds its
    model on CUDA: it runs on a GPU; `--mbridge cpu` runs the same steps on the CPU with the
    megatron-core CPU shims of mconv's tests (the model in host memory)."""
    probe = subprocess.run([sys.executable, "-c", "import mbridge, megatron.core, torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.returncode:
        return None, f"`import mbridge, megatron.core` fails: {probe.stderr.strip().splitlines()[-1]}"
    gpu = probe.stdout.strip() == "True"
    if choice == "off" or (choice == "auto" and not gpu):
        return None, "no GPU (mbridge's get_model moves the model to CUDA); --mbridge cpu runs it on the CPU"
    te = "" if importlib.util.find_spec("transformer_engine") else ", megatron-core local spec (no Transformer Engine)"
    on_cpu = choice == "cpu" or not gpu
    return ([sys.executable, str(ROOT / "bench" / "peer_mbridge.py")], ("cpu" if on_cpu else "gpu") + te)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="moe",
                        help="moe: Qwen3-30B-A3B shapes (128 experts, top-8); dense: Qwen3-8B shapes. Default moe.")
    parser.add_argument("--size-gb", type=float, default=3.0,
                        help="Target checkpoint size in GB (1e9 bytes); the layer count is chosen to come closest "
                             "(below about 2.5 GB the vocabulary and experts / FFN are halved too). Default 3; "
                             "use 10 or more on a many-core machine, so that fixed costs (imports, planning) are "
                             "a small share.")
    parser.add_argument("--layers", type=int, default=None, help="Use this many layers instead of fitting --size-gb.")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="Where the input checkpoint and the outputs go (the output file system is the one "
                             "measured). Default: a fresh temporary directory, removed at the end. A given "
                             "directory keeps the input for --reuse; outputs are always removed.")
    parser.add_argument("--reuse", action="store_true",
                        help="Reuse the synthetic checkpoint a previous run left in --workdir, if made with the "
                             "same settings.")
    parser.add_argument("--repeat", type=int, default=1,
                        help="Runs of each timed command; the fastest time and the largest peak RSS are kept. "
                             "Default 1.")
    parser.add_argument("--workers", default=None,
                        help="Comma-separated --workers values for the mconv commands, each timed (e.g. 1,2,4,8 "
                             "to choose a default). Default: mconv's own default only.")
    parser.add_argument("--formats", default=",".join(FORMATS), help="Formats to time (default: both).")
    parser.add_argument("--layouts", default="TP1,split",
                        help="TP1 and/or split (TP2/EP2 for MoE, TP2 for dense). Default both.")
    parser.add_argument("--peers", default="transformers,mbridge", help="Peers to time (default: both).")
    parser.add_argument("--mbridge", choices=("auto", "gpu", "cpu", "off"), default="auto",
                        help="auto: run the mbridge peer where a GPU is; cpu: on the CPU (model in host memory).")
    parser.add_argument("--fp8", action="store_true",
                        help="Also time mcore2hf --quantize fp8 after each mcore2hf (ratio to the plain one), and "
                             "hf2mcore of that FP8 output (ratios to copying its files, to reading them and writing as "
                             "many bytes as the bf16 checkpoint has, and to the plain hf2mcore of the bf16 input).")
    parser.add_argument("--json-out", type=Path, default=None, help="Also write the JSON line to this file.")
    args = parser.parse_args()

    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="mconv-bench-")) if own_workdir else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="outputs-", dir=workdir))
    try:
        run_benchmark(args, workdir, scratch)
    finally:
        shutil.rmtree(workdir if own_workdir else scratch, ignore_errors=True)


def verify(a: Path, b: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "mconv.cli", "verify", str(a), str(b), "-q"], cwd=ROOT,
                            capture_output=True, text=True)
    return "exact" if result.returncode == 0 else (result.stderr.strip().splitlines() or ["differs"])[-1]


def run_benchmark(args, workdir: Path, scratch: Path) -> None:
    from mconv.cli import default_workers

    load_before = os.getloadavg()[0]  # other work on the machine skews the times; say how busy it was
    kwargs, note = fit_config(args.model, args.size_gb * 1e9, args.layers)
    hf = prepare_input(workdir, args.model, kwargs, args.reuse, finite=args.fp8)  # (FP8 quantizes finite values)
    size = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    tiny = ROOT / "fixtures" / ("qwen3-moe-tiny" if args.model == "moe" else "qwen3-tiny")
    mconv = [sys.executable, "-m", "mconv.cli"]
    worker_counts = [int(w) for w in args.workers.split(",")] if args.workers else [None]
    formats = [f for f in FORMATS if f in args.formats.split(",")]
    rows = []  # dicts: method, command (what it does, for the ratios), seconds, peak RSS, output bytes, check
    fixed = {}  # command -> seconds on the tiny fixture

    def timed(method: str, command: str, argv: list[str], warm_dir: Path, out: Path, **extra) -> dict:
        log(f"{method} ...")
        seconds, rss = measure(argv, warm_dir, out, args.repeat)
        row = dict(method=method, command=command, seconds=seconds, rss=rss, output_bytes=tree_bytes(out), **extra)
        rows.append(row)
        log(f"{method}: {seconds:.1f} s, peak RSS {rss / 2**20:.0f} MiB")
        return row

    floor_out = scratch / "floor"  # made inside the timed command, as measure() empties it before each run
    floor = timed("I/O floor (cp + sync)", "floor", ["sh", "-c", 'mkdir -p "$0" && cp "$@" "$0"', str(floor_out),
                                                     *map(str, sorted(hf.glob("*.safetensors")))], hf, floor_out)
    shutil.rmtree(floor_out)
    # The part of every fixed cost mconv cannot remove: the interpreter importing torch.
    timed(f"{TINY}python -c 'import torch'", "import torch", [sys.executable, "-c", "import torch"], tiny,
          scratch / "none")

    def round_trip(label: str, src: Path, flags: list[str], fmt: str, workers: int | None, check: bool) -> None:
        """Time hf2mcore of `src` and mcore2hf back (and verify the result when `check`)."""
        ckpt, back = scratch / "mcore", scratch / "hf-back"
        common = ["-q"] + (["--workers", str(workers)] if workers else [])
        suffix = f" w={workers}" if workers and len(worker_counts) > 1 else ""
        timings = {}
        for direction, argv, source, out in (("hf2mcore", [str(src), str(ckpt), *flags, "--format", fmt], src, ckpt),
                                             ("mcore2hf", [str(ckpt), str(back)], ckpt, back)):
            command = f"{direction} {fmt}"
            row = timings[direction] = timed(f"{label}{command}{suffix}", command, [*mconv, direction, *argv, *common],
                                             source, out, workers=workers or default_workers())
            if label == TINY:
                fixed[command] = row["seconds"]
        if check:
            rows[-1]["check"] = verify(src, back)
            if rows[-1]["check"] != "exact":
                raise SystemExit(f"round trip is not exact: {rows[-1]['method']}: {rows[-1]['check']}")
        if args.fp8:  # the same mcore2hf writing block-wise FP8, against the plain one just timed
            fp8_out = scratch / "hf-fp8"
            command = f"mcore2hf {fmt} --quantize fp8"
            row = timed(f"{label}{command}{suffix}", command, [*mconv, "mcore2hf", str(ckpt), str(fp8_out), "--quantize",
                                                              "fp8", *common], ckpt, fp8_out, workers=workers or default_workers())
            row["x plain mcore2hf"] = round(row["seconds"] / timings["mcore2hf"]["seconds"], 2)
            if label == TINY:
                fixed[command] = row["seconds"]
            else:  # hf2mcore reading that FP8 checkpoint (dequantized), against copying its files
                fp8_floor_out, fp8_ckpt = scratch / "fp8-floor", scratch / "mcore-from-fp8"
                fp8_floor = timed("I/O floor of the FP8 files (cp + sync)", "fp8 floor",
                                  ["sh", "-c", 'mkdir -p "$0" && cp "$@" "$0"', str(fp8_floor_out),
                                   *map(str, sorted(fp8_out.glob("*.safetensors")))], fp8_out, fp8_floor_out)
                shutil.rmtree(fp8_floor_out)
                # what hf2mcore of it must do at least: read the FP8 files and write the bf16 checkpoint's bytes
                read_write = timed("I/O floor: read FP8, write bf16 bytes", "read+write floor",
                                   ["sh", "-c", 'n=$1; shift; cat "$@" > /dev/null && mkdir -p "$0" && head -c "$n" /dev/zero > "$0/x"',
                                    str(fp8_floor_out), str(tree_bytes(ckpt)),
                                    *map(str, sorted(fp8_out.glob("*.safetensors")))], fp8_out, fp8_floor_out)
                shutil.rmtree(fp8_floor_out)
                row = timed(f"{label}hf2mcore {fmt} of the FP8 output{suffix}", f"hf2mcore {fmt} of FP8",
                            [*mconv, "hf2mcore", str(fp8_out), str(fp8_ckpt), *flags, "--format", fmt, *common],
                            fp8_out, fp8_ckpt, workers=workers or default_workers())
                row["x FP8 floor"] = round(row["seconds"] / fp8_floor["seconds"], 2)
                row["x read+write floor"] = round(row["seconds"] / read_write["seconds"], 2)
                row["x plain hf2mcore"] = round(row["seconds"] / timings["hf2mcore"]["seconds"], 2)
                if f"hf2mcore {fmt}" in fixed:  # less the same command's fixed cost (the tiny fixture's hf2mcore)
                    row["marginal x FP8 floor"] = round((row["seconds"] - fixed[f"hf2mcore {fmt}"]) / fp8_floor["seconds"], 2)
                shutil.rmtree(fp8_ckpt)
            shutil.rmtree(fp8_out)
        shutil.rmtree(ckpt)
        shutil.rmtree(back)

    # What each mconv command costs before it moves a byte (interpreter, torch, megatron-core,
    # planning): the same commands on the tiny fixture. At a few GB it is a large share of each time.
    for fmt in formats:
        round_trip(TINY, tiny, [], fmt, None, False)
    split = ("TP2/EP2", ["--tp", "2", "--ep", "2"]) if args.model == "moe" else ("TP2", ["--tp", "2"])  # dense: no EP
    layouts = [x for x in [("TP1", []), split] if ("TP1" if x[0] == "TP1" else "split") in args.layouts.split(",")]
    for name, flags in layouts:
        for fmt in formats:
            for workers in worker_counts:  # verified on the layout that splits the most (verify reads it all)
                round_trip(f"mconv {name} ", hf, flags, fmt, workers, check=bool(flags) or len(layouts) == 1)

    peers = args.peers.split(",")
    if "transformers" in peers:
        peer_out = scratch / "peer"
        row = timed("peer: transformers load+save", "transformers", [sys.executable, "-c", PEER, str(hf), str(peer_out)],
                    hf, peer_out)
        row["check"] = verify(hf, peer_out)  # the peer did the same work only if it wrote the same bytes
        shutil.rmtree(peer_out)
    mbridge, mbridge_note = mbridge_mode(args.mbridge) if "mbridge" in peers else (None, "not asked for")
    if mbridge:
        ckpt, back = scratch / "mbridge-ckpt", scratch / "mbridge-back"
        cpu = ["--cpu"] if mbridge_note.startswith("cpu") else []
        timed("peer: mbridge hf2mcore torch_dist", "hf2mcore torch_dist", [*mbridge, "hf2mcore", str(hf), str(ckpt), *cpu],
              hf, ckpt, peer="mbridge")
        shutil.rmtree(back, ignore_errors=True)
        timed("peer: mbridge mcore2hf torch_dist", "mcore2hf torch_dist",
              [*mbridge, "mcore2hf", str(hf), str(ckpt), str(back), *cpu], ckpt, back, peer="mbridge")
        rows[-1]["check"] = verify(hf, back)
        shutil.rmtree(ckpt)
        shutil.rmtree(back)

    load_after = os.getloadavg()[0]
    floor_s = floor["seconds"]
    transformers = next((r["seconds"] for r in rows if r["command"] == "transformers"), None)
    by_mbridge = {r["command"]: r["seconds"] for r in rows if r.get("peer") == "mbridge"}
    results = []
    for r in rows:
        mine = r["method"].startswith("mconv ")
        result = dict(method=r["method"], seconds=round(r["seconds"], 2), peak_rss_mib=round(r["rss"] / 2**20),
                      output_bytes=r["output_bytes"])
        if not r["method"].startswith(TINY):
            result["x_floor"] = round(r["seconds"] / floor_s, 2)
        if mine and r["command"] in fixed:  # its time above the same command on the tiny fixture
            result["marginal_x_floor"] = round((r["seconds"] - fixed[r["command"]]) / floor_s, 2)
        if mine and transformers:
            result["x_transformers"] = round(r["seconds"] / transformers, 2)
        if mine and r["command"] in by_mbridge:
            result["x_mbridge"] = round(r["seconds"] / by_mbridge[r["command"]], 2)
        for key in ("workers", "check", "x plain mcore2hf", "x FP8 floor", "marginal x FP8 floor", "x read+write floor",
                    "x plain hf2mcore"):
            if key in r:
                result[key] = r[key]
        results.append(result)
    stamp = ROOT / "COMMIT"  # a copy of the tree without git (the GPU machine) names its commit here
    commit = stamp.read_text().strip() if stamp.exists() else subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"\nmconv offline conversion benchmark: {args.model} model, {kwargs}")
    print(f"checkpoint {size / 1e9:.2f} GB in {len(list(hf.glob('*.safetensors')))} shard(s) "
          f"({note}), on {workdir}")
    print(f"{os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM, "
          f"load average {load_before:.1f} before / {load_after:.1f} after, python {platform.python_version()}, "
          f"torch {version('torch')}, transformers {version('transformers')}, mconv commit {commit or '?'}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("page cache: warm (each command's input is read just before it; the cache cannot be dropped); "
          f"times include a sync after the command; best of {args.repeat}; mconv default --workers {default_workers()}\n")
    columns = ("x_floor", "marginal_x_floor", "x_transformers", "x_mbridge")
    print(f"{'method':<40} {'seconds':>8} {'x floor':>8} {'marginal':>9} {'x transf.':>9} {'x mbridge':>9} "
          f"{'peak RSS MiB':>13}  check")
    for r in results:
        cells = [f"{r[k]:.2f}" if k in r else "-" for k in columns]
        print(f"{r['method']:<40} {r['seconds']:>8.1f} {cells[0]:>8} {cells[1]:>9} {cells[2]:>9} {cells[3]:>9} "
              f"{r['peak_rss_mib']:>13,}  {r.get('check', '')}")
    print(f"\n{TINY.strip()} the same command on {tiny.relative_to(ROOT)} ({tree_bytes(tiny) / 1e6:.1f} MB): "
          "the fixed cost of each mconv command (interpreter, imports, planning); marginal: (time - that) / floor")
    print(f"mbridge: {'ran on the ' + mbridge_note if mbridge else 'skipped (' + mbridge_note + ')'}\n")
    line = json.dumps(dict(bench="convert", model=args.model, config=kwargs, checkpoint_bytes=size,
                           cores=os.cpu_count(), load_average=[round(load_before, 2), round(load_after, 2)],
                           cache="warm", sync_included=True, repeat=args.repeat, default_workers=default_workers(),
                           commit=commit, date=time.strftime("%Y-%m-%d"), results=results, mbridge=mbridge_note))
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")


if __name__ == "__main__":
    main()
