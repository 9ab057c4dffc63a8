"""Offline conversions: HF -> Megatron, Megatron -> HF, and inspection."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from mconv import __version__
from mconv.converter import megatron_io as mio
from mconv.converter.hf_io import (HFCheckpoint, ShardedSafetensorsWriter, copy_side_files, read_config)
from mconv.converter.layout import Layout, Rank
from mconv.converter.output import staged_directory
from mconv.converter.planner import Plan, make_plan
from mconv.converter.transforms import merge, split
from mconv.errors import MconvError
from mconv.mappings import architecture_for

FORMATS = ("torch",)
DEFAULT_SHARD_BYTES = 3_000_000_000


@dataclass
class Summary:
    """What a conversion did (or, for a dry run, would do)."""

    plan: Plan
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    lines: list[str] = field(default_factory=list)


def _bar(total: int, description: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not progress, leave=False)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def check_hf_tensors(plan: Plan, ckpt: HFCheckpoint) -> None:
    expected = plan.hf_shapes()
    for name, shape in expected.items():
        if name not in ckpt.tensors:
            raise MconvError(f"{ckpt.dir}: tensor {name} is missing from the checkpoint")
        if ckpt.tensors[name].shape != shape:
            raise MconvError(f"{ckpt.dir / ckpt.tensors[name].file}: tensor {name} has shape "
                             f"{list(ckpt.tensors[name].shape)}, but config.json implies {list(shape)}")
    for name, info in ckpt.tensors.items():
        if name not in expected:
            raise MconvError(f"{ckpt.dir / info.file}: unexpected tensor {name} "
                             f"(not part of {plan.arch.name} as described by config.json)")


def hf2mcore(hf_dir: str | Path, out_dir: str | Path, layout: Layout, spec: str = "local", fmt: str = "torch",
             iteration: int | None = None, overwrite: bool = False, dry_run: bool = False,
             progress: bool = True) -> Summary:
    if fmt not in FORMATS:
        raise MconvError(f"--format {fmt!r} is not supported yet; available: {', '.join(FORMATS)}")
    ckpt = HFCheckpoint(hf_dir)
    arch = architecture_for(ckpt.config)
    plan = make_plan(arch, ckpt.config, layout, spec)
    check_hf_tensors(plan, ckpt)
    dtypes = Counter(info.dtype for info in ckpt.tensors.values())
    dtype = dtypes.most_common(1)[0][0]
    summary = Summary(plan)
    for rank_plan in plan.ranks:
        rank_bytes = rank_tensors = 0
        for chunk in rank_plan.chunks:
            for task in chunk:
                if task.shape is not None:
                    rank_tensors += 1
                    rank_bytes += _nbytes(task.shape, ckpt.tensors[task.hf[0]].dtype)
        summary.files += 1
        summary.tensors += rank_tensors
        summary.bytes += rank_bytes
        summary.lines.append(f"{layout.rank_dir(rank_plan.rank)}: {len(rank_plan.chunks)} chunk(s), "
                             f"{rank_tensors} tensors, {rank_bytes:,} bytes")
    if dry_run:
        return summary

    args = mio.megatron_lm_args(layout, plan.dims, arch.megatron_args(plan.dims), spec, plan.padded_vocab,
                                dtype, fmt)
    with staged_directory(Path(out_dir), overwrite, inputs=(Path(hf_dir),)) as staging:
        iter_dir = staging / mio.iteration_dir_name(iteration)
        with _bar(summary.bytes, "hf2mcore", progress) as bar:
            for rank_plan in plan.ranks:
                chunks = []
                for chunk in rank_plan.chunks:
                    state = {}
                    for task in chunk:
                        if task.shard is None:
                            state[task.megatron] = None
                            continue
                        state[task.megatron] = split(
                            task.shard, lambda s, dim, a, b, hf=task.hf: ckpt.read(hf[s], dim, a, b))
                        bar.update(state[task.megatron].nbytes)
                    chunks.append(state)
                path = mio.rank_file(iter_dir, layout, rank_plan.rank)
                path.parent.mkdir(parents=True)
                torch.save(mio.rank_state(chunks, args, iteration), path)
                del chunks
        mio.write_tracker(staging, iteration)
        (staging / mio.HF_CONFIG_DIR).mkdir()
        copy_side_files(ckpt.dir, staging / mio.HF_CONFIG_DIR)
        mio.write_metadata(staging, {"mconv_version": __version__, "architecture": arch.name, "spec": spec,
                                     "format": fmt, "layout": layout.to_dict(),
                                     "dtype": str(dtype).removeprefix("torch.")})
    ckpt.close()
    return summary


def _detect_spec(chunks: list[dict]) -> str:
    te_marker = ".self_attention.linear_qkv.layer_norm_weight"
    return "te" if any(k.endswith(te_marker) for chunk in chunks for k in chunk) else "local"


def _check_args(args, plan: Plan, path: Path) -> None:
    d = plan.dims
    expected = {"num_layers": d.layers, "hidden_size": d.hidden, "num_attention_heads": d.heads,
                "num_query_groups": getattr(d, "groups", None), "ffn_hidden_size": getattr(d, "ffn", None),
                "untie_embeddings_and_output_weights": not d.tied,
                "num_experts": getattr(d, "experts", 0) or None, "moe_ffn_hidden_size": getattr(d, "moe_ffn", None)}
    for name, value in expected.items():
        saved = getattr(args, name, None)
        if (value is not None or name == "num_experts") and saved != value and (saved is not None or value):
            raise MconvError(f"{path}: the checkpoint's args say {name}={saved}, but the HF config implies "
                             f"{value}; pass the --hf-config of the model this checkpoint was made from")


class MegatronCheckpoint:
    """A legacy Megatron checkpoint, its rank files memory-mapped (tensors are read on access)."""

    def __init__(self, path: str | Path, hf_config: str | Path | None = None):
        self.location = loc = mio.locate(path)
        if loc.format != "torch":
            raise MconvError(f"{loc.iter_dir} is a {loc.format} checkpoint; mconv reads only the legacy "
                             "'torch' format so far")
        self.metadata = mio.read_metadata(loc.save_dir) or {}
        self.config_dir = Path(hf_config) if hf_config else loc.save_dir / mio.HF_CONFIG_DIR
        if not (self.config_dir / "config.json").is_file():
            raise MconvError(f"{loc.save_dir} stores no HF config (it was not written by mconv); "
                             "pass --hf-config DIR with the model's config.json")
        self.config = read_config(self.config_dir)
        first = sorted(loc.iter_dir.glob(f"mp_rank_*/{mio.RANK_FILE}"))[0]
        first_state = mio.load_rank_file(first)
        if "args" not in first_state:
            raise MconvError(f"{first} has no 'args', so its parallel layout is unknown")
        self.args = first_state["args"]
        self.layout = mio.layout_from_args(self.args, first)
        spec = self.metadata.get("spec") or _detect_spec(mio.rank_chunks(first_state, first))
        self.plan = make_plan(architecture_for(self.config), self.config, self.layout, spec)
        _check_args(self.args, self.plan, first)
        self.chunks: dict[Rank, list[dict]] = {}
        for rank_plan in self.plan.ranks:
            path = mio.rank_file(loc.iter_dir, self.layout, rank_plan.rank)
            chunks = mio.rank_chunks(mio.load_rank_file(path), path)
            self._check_rank(path, rank_plan, chunks)
            self.chunks[rank_plan.rank] = chunks

    def _check_rank(self, path: Path, rank_plan, chunks: list[dict]) -> None:
        if len(chunks) != len(rank_plan.chunks):
            raise MconvError(f"{path} holds {len(chunks)} model chunk(s), the layout needs {len(rank_plan.chunks)}")
        for chunk, tasks in zip(chunks, rank_plan.chunks):
            expected = {t.megatron: t for t in tasks}
            for name, task in expected.items():
                if task.shard is None:
                    continue
                if name not in chunk:
                    raise MconvError(f"{path}: tensor {name} is missing")
                if tuple(chunk[name].shape) != task.shape:
                    raise MconvError(f"{path}: tensor {name} has shape {list(chunk[name].shape)}, "
                                     f"expected {list(task.shape)} from the HF config and layout")
            for name in chunk:
                if name not in expected and not name.endswith("._extra_state"):
                    raise MconvError(f"{path}: unexpected tensor {name} (not part of "
                                     f"{self.plan.arch.name} as described by the HF config)")

    def shard(self, rank: Rank, chunk: int, name: str) -> torch.Tensor:
        return self.chunks[rank][chunk][name]


def mcore2hf(ckpt_dir: str | Path, out_dir: str | Path, hf_config: str | Path | None = None,
             max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, progress: bool = True) -> Summary:
    ckpt = MegatronCheckpoint(ckpt_dir, hf_config)
    exports = ckpt.plan.exports()
    entries = []
    for task in exports:
        dtype = ckpt.shard(task.sources[0].rank, task.sources[0].chunk, task.sources[0].megatron).dtype
        entries += [(name, dtype, shape) for name, shape in zip(task.hf, task.hf_shapes)]
    summary = Summary(ckpt.plan, tensors=len(entries), bytes=sum(_nbytes(s, d) for _, d, s in entries))
    inputs = (ckpt.location.save_dir, ckpt.config_dir)
    with staged_directory(Path(out_dir), overwrite, inputs=inputs) as staging:
        writer = ShardedSafetensorsWriter(staging, entries, max_shard_bytes)
        writer.create()
        with _bar(summary.bytes, "mcore2hf", progress) as bar:
            for task in exports:
                shards = [ckpt.shard(s.rank, s.chunk, s.megatron) for s in task.sources]
                for name, tensor in zip(task.hf, merge([s.shard for s in task.sources], shards, task.hf_shapes)):
                    writer.write(name, tensor)
                    bar.update(tensor.nbytes)
        writer.close()
        writer.write_index()
        copy_side_files(ckpt.config_dir, staging)
        summary.files = len(writer.files)
    return summary


def inspect_path(path: str | Path) -> dict:
    """Describe an HF directory or a Megatron checkpoint."""
    path = Path(path)
    if (path / "config.json").is_file() and not (path / mio.TRACKER).is_file():
        ckpt = HFCheckpoint(path)
        arch = architecture_for(ckpt.config)
        dims = arch.dims(ckpt.config)
        dtypes = Counter(str(i.dtype).removeprefix("torch.") for i in ckpt.tensors.values())
        return {"kind": "huggingface", "path": str(path), "architecture": arch.name, "dimensions": vars(dims),
                "files": len({i.file for i in ckpt.tensors.values()}), "tensors": len(ckpt.tensors),
                "bytes": sum(i.nbytes for i in ckpt.tensors.values()), "dtypes": dict(dtypes)}
    ckpt = MegatronCheckpoint(path)
    tensors = [t for chunks in ckpt.chunks.values() for chunk in chunks for t in chunk.values() if t is not None]
    args = ckpt.args
    moe = {}
    if getattr(args, "num_experts", None):
        router = ("softmax over all experts, then top-k (norm_topk_prob false)" if getattr(args, "moe_router_pre_softmax", False)
                  else "router softmax after top-k (norm_topk_prob)")
        layers = [i for i, flag in enumerate(getattr(args, "moe_layer_freq", []) or []) if flag]
        moe = {"moe": f"experts={args.num_experts}, top_k={getattr(args, 'moe_router_topk', '?')}, "
                      f"moe_ffn={getattr(args, 'moe_ffn_hidden_size', '?')}, {router}, MoE layers {layers}, "
                      f"{'grouped GEMM' if getattr(args, 'moe_grouped_gemm', False) else 'SequentialMLP'} experts"}
    return {"kind": "megatron", "path": str(path), "format": ckpt.location.format,
            "iteration": ckpt.location.iteration if ckpt.location.iteration is not None else "release",
            "architecture": ckpt.plan.arch.name, "spec": ckpt.plan.spec, "layout": ckpt.layout.describe(),
            "rank files": len(ckpt.chunks), "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors),
            "padded vocab": getattr(args, "padded_vocab_size", None), **moe,
            "written by": "mconv " + ckpt.metadata["mconv_version"] if ckpt.metadata else "another tool"}


def compare_hf(a: str | Path, b: str | Path, progress: bool = False) -> tuple[int, int, list[str]]:
    """Compare two HF directories tensor by tensor (names, dtypes, shapes, bytes), one tensor in
    memory at a time. Returns (tensors, bytes, differences)."""
    left, right = HFCheckpoint(a), HFCheckpoint(b)
    differences = [f"{name}: only in {left.dir}" for name in sorted(left.tensors.keys() - right.tensors.keys())]
    differences += [f"{name}: only in {right.dir}" for name in sorted(right.tensors.keys() - left.tensors.keys())]
    common = sorted(left.tensors.keys() & right.tensors.keys())
    total = 0
    with _bar(sum(left.tensors[n].nbytes for n in common), "verify", progress) as bar:
        for name in common:
            x, y = left.read(name), right.read(name)
            if x.dtype != y.dtype or x.shape != y.shape:
                differences.append(f"{name}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}")
            elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                differences.append(f"{name}: values differ")
            total += x.nbytes
            bar.update(x.nbytes)
    return len(common), total, differences
