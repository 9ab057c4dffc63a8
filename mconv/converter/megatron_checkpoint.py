"""Reading Megatron checkpoints for export: the legacy per-rank format and torch_dist.

Both readers expose the same thing: a plan whose export tasks name Megatron tensors, and a
session that loads those tensors in batches. Legacy rank files are memory-mapped; torch_dist
tensors are read as boxes of global tensors (megatron-core's model says which), only those a batch needs.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import torch

from mconv.converter import megatron_io as mio
from mconv.converter.hf_io import read_config
from mconv.converter.layout import Layout, Rank
from mconv.converter.planner import Plan, ShardSource, make_plan
from mconv.errors import MconvError
from mconv.mappings import architecture_for

Loader = Callable[[list[ShardSource]], list[torch.Tensor]]
DtypeOf = Callable[[ShardSource], torch.dtype]


def _config_dir(location: mio.CheckpointLocation, hf_config: str | Path | None) -> Path:
    config_dir = Path(hf_config) if hf_config else location.save_dir / mio.HF_CONFIG_DIR
    if not (config_dir / "config.json").is_file():
        raise MconvError(f"{location.save_dir} stores no HF config (it was not written by mconv); "
                         "pass --hf-config DIR with the model's config.json")
    return config_dir


def check_args(args, plan: Plan, path: Path) -> None:
    """The saved Megatron-LM args must describe the model the HF config describes."""
    d = plan.dims
    expected = {"num_layers": d.layers, "hidden_size": d.hidden, "num_attention_heads": d.heads,
                "num_query_groups": getattr(d, "groups", None), "ffn_hidden_size": getattr(d, "ffn", None),
                "untie_embeddings_and_output_weights": not d.tied,
                "num_experts": getattr(d, "experts", 0) or None, "moe_ffn_hidden_size": getattr(d, "moe_ffn", None)}
    for name, value in expected.items():
        saved = getattr(args, name, None)
        # Only values both sides state are compared, except experts: a MoE checkpoint is not a dense model.
        if saved != value and (name == "num_experts" or None not in (saved, value)):
            raise MconvError(f"{path}: the checkpoint's args say {name}={saved}, but the HF config implies "
                             f"{value}; pass the --hf-config of the model this checkpoint was made from")


def _detect_spec(chunks: list[dict]) -> str:
    te_marker = ".self_attention.linear_qkv.layer_norm_weight"
    return "te" if any(k.endswith(te_marker) for chunk in chunks for k in chunk) else "local"


class LegacyCheckpoint:
    """A legacy `torch` checkpoint: rank files memory-mapped, tensors read on access."""

    def __init__(self, location: mio.CheckpointLocation, hf_config: str | Path | None = None):
        self.location = loc = location
        self.metadata = mio.read_metadata(loc.save_dir) or {}
        self.config_dir = _config_dir(loc, hf_config)
        self.config = read_config(self.config_dir)
        self.args, self.layout, self.chunks, first = mio.read_legacy_ranks(loc)
        spec = self.metadata.get("spec") or _detect_spec(self.chunks[Rank(0, 0)])
        self.plan = make_plan(architecture_for(self.config), self.config, self.layout, spec)
        check_args(self.args, self.plan, first)
        for rank_plan in self.plan.ranks:
            path = mio.rank_file(loc.iter_dir, self.layout, rank_plan.rank)
            self._check_rank(path, rank_plan, self.chunks[rank_plan.rank])

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

    def _tensor(self, source: ShardSource) -> torch.Tensor:
        return self.chunks[source.rank][source.chunk][source.megatron]

    def tensor_bytes(self) -> tuple[int, int]:
        tensors = [t for chunks in self.chunks.values() for chunk in chunks for t in chunk.values()
                   if isinstance(t, torch.Tensor)]
        return len(tensors), sum(t.nbytes for t in tensors)

    @contextlib.contextmanager
    def session(self) -> Iterator[tuple[Loader, DtypeOf]]:
        yield (lambda sources: [self._tensor(s) for s in sources]), (lambda source: self._tensor(source).dtype)


class DistCheckpoint:
    """A torch_dist checkpoint. Its keys are layout-independent, so it is read as if it were a
    TP1/PP1/EP1 checkpoint; only the vocabulary padding is taken from the stored embedding."""

    def __init__(self, location: mio.CheckpointLocation, hf_config: str | Path | None = None):
        from mconv.converter.torch_dist_io import TorchDistReader

        self.location = location
        self.metadata = mio.read_metadata(location.save_dir) or {}
        self.config_dir = _config_dir(location, hf_config)
        self.config = read_config(self.config_dir)
        self.reader = TorchDistReader.open(location.iter_dir)
        self.args = self.reader.args
        arch = architecture_for(self.config)
        dims = arch.dims(self.config)
        embedding = self.reader.global_shape("embedding.word_embeddings.weight")
        if embedding is None or embedding[0] < dims.vocab:
            raise MconvError(f"{location.iter_dir}: no embedding of at least {dims.vocab} rows "
                             f"(found {embedding}); is this checkpoint of the model in the HF config?")
        self.padded_vocab = embedding[0]
        self.layout = Layout(vocab_divisor=self.padded_vocab)
        self.plan = make_plan(arch, self.config, self.layout, "local")
        if self.args is not None:
            check_args(self.args, self.plan, location.iter_dir)
        self.load_args = mio.megatron_lm_args(self.layout, dims, arch.megatron_args(dims), "local",
                                              self.padded_vocab, torch.bfloat16, "torch_dist")
        if getattr(self.load_args, "moe_layer_freq", None) == 1 and any(
                key.startswith("decoder.layers.0.") for key in self.reader.tensors):
            # An all-MoE model trained with --moe-layer-freq given as a list stores per-layer keys.
            self.load_args.moe_layer_freq = [1] * dims.layers

    def tensor_bytes(self) -> tuple[int, int]:
        return len(self.reader.tensors), self.reader.nbytes()

    @contextlib.contextmanager
    def session(self) -> Iterator[tuple[Loader, DtypeOf]]:
        from mconv.converter.torch_dist import parameter_session

        load, dtype_of = parameter_session(self.reader, self.load_args, torch.bfloat16)

        def load_sources(sources: list[ShardSource]) -> list[torch.Tensor]:
            loaded = load(sorted({s.megatron for s in sources}))
            return [loaded[s.megatron] for s in sources]
        yield load_sources, (lambda source: dtype_of(source.megatron))


def open_checkpoint(path: str | Path, hf_config: str | Path | None = None) -> LegacyCheckpoint | DistCheckpoint:
    location = mio.locate(path)
    return (DistCheckpoint if location.format == "torch_dist" else LegacyCheckpoint)(location, hf_config)
