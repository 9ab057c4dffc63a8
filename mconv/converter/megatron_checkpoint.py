"""Reading Megatron checkpoints for export: the legacy per-rank format and torch_dist.

Both readers expose the same thing: a plan whose export tasks name Megatron tensors, and a
session that loads those tensors in batches. Legacy rank files are memory-mapped; torch_dist
tensors are read as boxes of global tensors (megatron-core's model says which), only those a batch needs.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from mconv.converter import file_io
from mconv.converter import megatron_io as mio
from mconv.converter.hf_config import read_config
from mconv.converter.hf_io import check_convertible
from mconv.converter.layout import Layout, Rank, count
from mconv.converter.planner import ShardSource, make_plan
from mconv.converter.options import option
from mconv.converter.transforms import VOCAB, padded_vocab_size
from mconv.errors import MconvError
from mconv.mappings import architecture_for
from mconv.mappings.schema import FIRST, Architecture

Loader = Callable[[list[ShardSource]], list[torch.Tensor]]
DtypeOf = Callable[[ShardSource], torch.dtype]
# Reads rows [start, start + len(dest)) of each source's shard into `dest` (contiguous, the stored
# dtype): straight into the output's memory.
RowLoader = Callable[[list[tuple[ShardSource, int, torch.Tensor]]], None]
# Where rows [start, start + len(dest)) of a source's shard are stored, if they are bytes of input files:
# (file descriptor, file offset, byte offset in dest, bytes) ranges making up dest; None otherwise.
FileRows = Callable[[ShardSource, int, torch.Tensor], "list[tuple[int, int, int, int]] | None"]


class Session(NamedTuple):
    """How an export reads a checkpoint's tensors (see `LegacyCheckpoint.session`, `DistCheckpoint.session`)."""

    load: Loader
    dtype_of: DtypeOf
    load_rows: RowLoader
    file_rows: FileRows


def _config_dir(location: mio.CheckpointLocation, hf_config: str | Path | None) -> Path:
    config_dir = Path(hf_config) if hf_config else location.save_dir / mio.HF_CONFIG_DIR
    if hf_config and not (config_dir / "config.json").is_file():
        raise MconvError(f"{option('hf_config', hf_config)} has no config.json; it must be the HF model's directory "
                         "(or hub name)")
    if not (config_dir / "config.json").is_file():
        why = (f"its {mio.HF_CONFIG_DIR}/config.json is missing" if (location.save_dir / mio.METADATA).is_file()
               else "it was not written by mconv")
        raise MconvError(f"{location.save_dir} stores no HF config ({why}); "
                         f"pass {option('hf_config', 'DIR')} with the model's config.json")
    return config_dir


# Saved args that set the rotary embedding, compared where the checkpoint's args use one.
_ROTARY = {"rope": ("rotary_base",),
           "yarn": ("rotary_base", "rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                    "yarn_beta_slow", "mscale", "mscale_all_dim", "yarn_correction_range_round_to_int")}


def check_args(args, arch: Architecture, dims, path: Path, padded_vocab: int | None = None) -> None:
    """The saved Megatron-LM args must describe the model the HF config describes: its shapes, its
    vocabulary and, where the args use rotary embeddings, its rope settings (a model trained with
    other ones is another model). Only values both sides state are compared, as older Megatron-LM
    versions lack fields, except experts: a MoE checkpoint is not a dense model. Megatron-LM stores
    `num_query_groups` (default 1) even without `group_query_attention`, where each head is its own
    group. `padded_vocab`: the rows of the word embedding the checkpoint stores (all TP ranks'), if
    it stores one; it must be `padded_vocab_size` and Megatron's padding of the HF `vocab_size`
    for the saved `make_vocab_size_divisible_by` and TP (a larger trained vocabulary would be cut).
    Raises MconvError naming the first arg that differs."""
    saved = dict(vars(args))
    if saved.get("group_query_attention") is False:
        saved["num_query_groups"] = saved.get("num_attention_heads")
    expected = {"num_layers": dims.layers, "hidden_size": dims.hidden, "num_attention_heads": dims.heads,
                "vocab_size": dims.vocab,
                "num_query_groups": getattr(dims, "groups", None), "kv_channels": getattr(dims, "head_dim", None),
                "ffn_hidden_size": getattr(dims, "ffn", None), "untie_embeddings_and_output_weights": not dims.tied,
                "num_experts": getattr(dims, "experts", 0) or None, "moe_ffn_hidden_size": getattr(dims, "moe_ffn", None)}
    if saved.get("position_embedding_type") in _ROTARY:
        ours = arch.megatron_args(dims)
        expected["position_embedding_type"] = ours.get("position_embedding_type")
        if saved["position_embedding_type"] == expected["position_embedding_type"]:
            expected.update({name: ours.get(name) for name in _ROTARY[saved["position_embedding_type"]]})
    if saved.get("mtp_num_layers"):  # MTP layers kept (hf2mcore --mtp): all of the HF model's
        expected["mtp_num_layers"] = getattr(dims, "hf_mtp_layers", 0) or "none"
    for name, value in expected.items():
        found = saved.get(name)
        if found != value and (name == "num_experts" or None not in (found, value)):
            raise MconvError(f"{path}: the checkpoint's args say {name}={_arg_text(name, found)}, but the HF config "
                             f"implies {_arg_text(name, value)}; pass the {option('hf_config')} of the model this checkpoint "
                             "was made from")
    if padded_vocab is not None:
        check_padded_vocab(saved, dims.vocab, padded_vocab, path)


def check_padded_vocab(saved: dict, vocab: int, padded_vocab: int, path: Path) -> None:
    """The stored word embedding's `padded_vocab` rows against the saved args (`saved`) and the HF
    config's `vocab`: see check_args. Raises MconvError naming the arg or the padding that differs."""
    stated = saved.get("padded_vocab_size")
    if stated is not None and stated != padded_vocab:
        raise MconvError(f"{path}: the checkpoint's args say padded_vocab_size={stated}, but its word embedding "
                         f"has {padded_vocab} rows")
    divisor, tp = saved.get("make_vocab_size_divisible_by"), saved.get("tensor_model_parallel_size")
    if isinstance(divisor, int) and isinstance(tp, int) and divisor > 0 and tp > 0:
        expected = padded_vocab_size(vocab, divisor, tp)
        if expected != padded_vocab:
            raise MconvError(f"{path}: the checkpoint's padded vocabulary has {padded_vocab} rows, but the HF config's "
                             f"vocab_size={vocab} pads to {expected} (make_vocab_size_divisible_by={divisor} x "
                             f"tensor_model_parallel_size={tp}); pass the {option('hf_config')} of the model this checkpoint "
                             "was made from")


def _arg_text(name: str, value) -> str:
    return "none (a dense model)" if name == "num_experts" and value is None else str(value)


def _detect_spec(chunks: list[dict]) -> str:
    # Norms fused into a linear (linear_qkv, MLA up projections, dense fc1) exist only under TE.
    return "te" if any(k.endswith(".layer_norm_weight") for chunk in chunks for k in chunk) else "local"


def embedding_key(arch: Architecture) -> str:
    """The word embedding's parameter name (`language_model.`-prefixed in a vision-language model):
    its rows are the padded vocabulary."""
    return next(r.megatron for r in arch.rules if r.kind is VOCAB and r.stage == FIRST)


def legacy_padded_vocab(arch: Architecture, first_rank: list[dict], layout: Layout) -> int | None:
    """The padded vocabulary a legacy checkpoint stores (the first rank's embedding rows x TP),
    None where it stores no embedding (adapters only). `first_rank`: rank (0, 0)'s model chunks."""
    found = first_rank[0].get(embedding_key(arch)) if first_rank else None
    return found.shape[0] * layout.tp if isinstance(found, torch.Tensor) and found.dim() else None


ADAPTER = ".adapter."  # every Megatron-Bridge adapter tensor's name has it


def refuse_adapters(names, where) -> None:
    """A checkpoint with LoRA adapters (with or without its base weights) is export-lora's input:
    MconvError saying so, rather than an unexpected or missing tensor."""
    adapter = next((name for name in names if ADAPTER in name), None)
    if adapter is not None:
        raise MconvError(f"{where} holds LoRA adapters ({adapter}); `mconv export-lora` exports them as a PEFT "
                         "adapter, or with --merge and --base-model as a merged HF model")


class LegacyCheckpoint:
    """A legacy `torch` checkpoint: rank files memory-mapped, tensors read on access."""

    def __init__(self, location: mio.CheckpointLocation, hf_config: str | Path | None = None):
        self.location = loc = location
        self.metadata = mio.read_metadata(loc.save_dir) or {}
        self.config_dir = _config_dir(loc, hf_config)
        self.config = read_config(self.config_dir)
        self.args, self.layout, self.chunks, first = mio.read_legacy_ranks(loc)
        spec = self.metadata.get("spec") or _detect_spec(self.chunks[Rank(0, 0)])
        arch = architecture_for(self.config, self.config_dir / "config.json")
        check_args(self.args, arch, arch.dims(self.config), first,
                   legacy_padded_vocab(arch, self.chunks[Rank(0, 0)], self.layout))
        mtp = bool(getattr(self.args, "mtp_num_layers", None))  # hf2mcore --mtp
        self.plan = make_plan(arch, self.config, self.layout, spec, mtp)
        for rank_plan in self.plan.ranks:
            path = mio.rank_file(loc.iter_dir, self.layout, rank_plan.rank)
            self._check_rank(path, rank_plan, self.chunks[rank_plan.rank])

    def _check_rank(self, path: Path, rank_plan, chunks: list[dict]) -> None:
        refuse_adapters((name for chunk in chunks for name in chunk), path)
        if len(chunks) != len(rank_plan.chunks):
            raise MconvError(f"{path} holds {count(len(chunks), 'model chunk')}, the layout needs {len(rank_plan.chunks)}")
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
                check_convertible(chunk[name].dtype, path, name)
            for name in chunk:
                if name not in expected and not name.endswith("._extra_state"):
                    raise MconvError(f"{path}: unexpected tensor {name} (not part of "
                                     f"{self.plan.arch.name} as described by the HF config)")

    def _tensor(self, source: ShardSource) -> torch.Tensor:
        return self.chunks[source.rank][source.chunk][source.megatron]

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """The rank files are memory-mapped, so `load` costs no copy; `file_rows` gives rows of a
        tensor as bytes of its rank file, found by `megatron_io.MappedRankFiles` (checked against
        the file's zip records; None where not), and `load_rows` preads those bytes into `dest` (the
        mapping is not touched, so it does not stay resident) or, where they are not found, copies
        them from the mapping."""
        files = mio.MappedRankFiles({rank: mio.rank_file(self.location.iter_dir, self.layout, rank)
                                     for rank in self.chunks})

        def load_rows(parts: list[tuple[ShardSource, int, torch.Tensor]]) -> None:
            for source, start, dest in parts:
                ranges = file_rows(source, start, dest)
                if ranges is None or not dest.is_contiguous():
                    dest.copy_(self._tensor(source).narrow(0, start, dest.shape[0]))
                else:
                    file_io.pread_into(ranges, dest, mio.rank_file(self.location.iter_dir, self.layout, source.rank))

        def file_rows(source: ShardSource, start: int, dest: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
            tensor = self._tensor(source)
            found = files.locate(source.rank, tensor)
            if (found is None or not tensor.dim() or dest.dtype != tensor.dtype or dest.shape[1:] != tensor.shape[1:]
                    or start + dest.shape[0] > tensor.shape[0]):
                return None
            fd, offset = found
            return [(fd, offset + start * (tensor.nbytes // tensor.shape[0]), 0, dest.nbytes)]
        try:
            yield Session(lambda sources: [self._tensor(s) for s in sources], lambda source: self._tensor(source).dtype,
                          load_rows, file_rows)
        finally:
            files.close()


class DistCheckpoint:
    """A torch_dist checkpoint. Its keys are layout-independent, so it is read as if it were a
    TP1/PP1/EP1 checkpoint; only the vocabulary padding is taken from the stored embedding."""

    def __init__(self, location: mio.CheckpointLocation, hf_config: str | Path | None = None):
        from mconv.converter.torch_dist import check_stored
        from mconv.converter.torch_dist_io import TorchDistReader

        self.location = location
        self.metadata = mio.read_metadata(location.save_dir) or {}
        self.config_dir = _config_dir(location, hf_config)
        self.config = read_config(self.config_dir)
        self.reader = TorchDistReader.open(location.iter_dir)
        refuse_adapters(self.reader.tensors, location.iter_dir)
        self.args = self.reader.args
        arch = architecture_for(self.config, self.config_dir / "config.json")
        dims = arch.dims(self.config)
        key = embedding_key(arch)
        embedding = self.reader.global_shape(key)
        if embedding is None or embedding[0] < dims.vocab:
            found = "there is none" if embedding is None else f"it has {embedding[0]} rows"
            raise MconvError(f"{location.iter_dir}: the HF config needs {key} with at least {dims.vocab} rows, "
                             f"{found}; is this checkpoint of the model in the HF config?")
        self.padded_vocab = embedding[0]
        self.layout = Layout(vocab_divisor=self.padded_vocab)
        if self.args is not None:  # before the plan, which needs what they are checked against
            check_args(self.args, arch, dims, location.iter_dir, self.padded_vocab)
        mtp = bool(getattr(self.args, "mtp_num_layers", None))  # hf2mcore --mtp
        self.plan = make_plan(arch, self.config, self.layout, "local", mtp)
        self.load_args = mio.megatron_lm_args(self.layout, dims, arch.megatron_args(dims), "local",
                                              self.padded_vocab, torch.bfloat16, "torch_dist")
        if getattr(self.load_args, "moe_layer_freq", None) == 1 and any(
                key.startswith("decoder.layers.0.") for key in self.reader.tensors):
            # An all-MoE model trained with --moe-layer-freq given as a list stores per-layer keys.
            self.load_args.moe_layer_freq = [1] * dims.layers
        check_stored(self.reader, self.plan, self.load_args)

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """Reads boxes of the stored tensors by their TP1 parameter names (torch_dist.parameter_session)."""
        from mconv.converter.torch_dist import parameter_session

        load, dtype_of, load_rows, file_rows = parameter_session(self.reader, self.plan, self.load_args)

        def load_sources(sources: list[ShardSource]) -> list[torch.Tensor]:
            loaded = load(sorted({s.megatron for s in sources}))
            return [loaded[s.megatron] for s in sources]
        yield Session(load_sources, lambda source: dtype_of(source.megatron),
                      lambda parts: load_rows([(s.megatron, start, dest) for s, start, dest in parts]),
                      lambda source, start, dest: file_rows(source.megatron, start, dest))


def open_checkpoint(path: str | Path, hf_config: str | Path | None = None) -> LegacyCheckpoint | DistCheckpoint:
    """The Megatron checkpoint at `path` (a save directory or one iteration's), opened by its
    format: torch_dist (DistCheckpoint) or legacy rank files (LegacyCheckpoint), with the HF config
    stored in it or `hf_config`'s. MconvError naming the file for a checkpoint mconv cannot read."""
    location = mio.locate(path)
    return (DistCheckpoint if location.format == "torch_dist" else LegacyCheckpoint)(location, hf_config)
