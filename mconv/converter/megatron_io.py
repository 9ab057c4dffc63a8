"""Megatron-LM checkpoints on disk: the directory conventions, mconv's metadata, and the legacy
`torch` format (one `model_optim_rng.pt` per model-parallel rank)."""
from __future__ import annotations

import argparse
import bisect
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mconv.converter import safe_load, torch_dist_io
from mconv.converter.hf_config import read_json
from mconv.converter.layout import Layout, Rank
from mconv.converter.saved_args import described, saved_args
from mconv.errors import MconvError

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
METADATA = "mconv.json"  # what mcore2hf needs to reverse a conversion, stored in the checkpoint
HF_CONFIG_DIR = "hf_config"  # config.json, generation config and tokenizer of the source model
CHECKPOINT_VERSION = 3.0


def iteration_dir_name(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def write_tracker(save_dir: Path, iteration: int | None) -> None:
    (save_dir / TRACKER).write_text("release" if iteration is None else str(iteration))


@dataclass
class CheckpointLocation:
    save_dir: Path  # the directory with the tracker file and mconv's metadata
    iter_dir: Path  # iter_XXXXXXX/ or release/
    iteration: int | None  # None for release
    format: str  # "torch" or "torch_dist"


def locate(path: str | Path) -> CheckpointLocation:
    """Accept either a save directory (with the tracker file) or an iteration directory."""
    path = Path(path)
    if not path.is_dir():
        raise MconvError(f"{path} {'is not a directory' if path.exists() else 'does not exist'}")
    if (path / TRACKER).is_file():
        try:
            text = (path / TRACKER).read_bytes()[:64].decode("utf-8").strip()
        except UnicodeDecodeError:
            raise MconvError(f"{path / TRACKER} is not text: it should hold an iteration number or 'release'") from None
        if text == "release":
            iteration = None
        elif text.isdigit():
            iteration = int(text)
        else:
            raise MconvError(f"{path / TRACKER} holds {text!r}, not an iteration number or 'release'")
        save_dir, iter_dir = path, path / iteration_dir_name(iteration)
        if not iter_dir.is_dir():
            raise MconvError(f"{path / TRACKER} points at {iter_dir.name}, which does not exist")
    elif path.name == "release" or (path.name.startswith("iter_") and path.name[5:].isdigit()):
        save_dir, iter_dir = path.parent, path
        iteration = None if path.name == "release" else int(path.name[5:])
    else:
        raise MconvError(f"{path} is not a Megatron checkpoint: no {TRACKER} and not an iter_*/release directory")
    if os.path.lexists(iter_dir / "metadata.json"):
        backend = read_json(iter_dir / "metadata.json", "megatron-core's description of a torch_dist checkpoint")
        if backend.get("sharded_backend") != "torch_dist":
            raise MconvError(f"{iter_dir / 'metadata.json'} gives sharded_backend {backend.get('sharded_backend')!r}; "
                             "mconv reads 'torch_dist' checkpoints")
        fmt = "torch_dist"
    elif any(iter_dir.glob(f"mp_rank_*/{RANK_FILE}")):
        fmt = "torch"
    else:
        raise MconvError(f"{iter_dir} holds neither mp_rank_*/{RANK_FILE} files nor a torch_dist metadata.json")
    return CheckpointLocation(save_dir, iter_dir, iteration, fmt)


def write_metadata(save_dir: Path, info: dict) -> None:
    (save_dir / METADATA).write_text(json.dumps(info, indent=2) + "\n")


def read_metadata(save_dir: Path) -> dict | None:
    """mconv.json (None if absent); its fields that mconv reads are checked."""
    path = save_dir / METADATA
    if not os.path.lexists(path):
        return None
    info = read_json(path, "mconv's record of how it wrote this checkpoint")
    for key, allowed in (("spec", ("local", "te")), ("format", ("torch", "torch_dist")),
                         ("hf_experts", ("stacked", "per_expert")), ("hf_mtp_experts", ("stacked", "per_expert"))):
        if key in info and info[key] not in allowed:
            raise MconvError(f"{path}: {key} is {info[key]!r}, not one of {', '.join(allowed)}")
    if not isinstance(info.get("mconv_version", ""), str):
        raise MconvError(f"{path}: mconv_version is {info['mconv_version']!r}, not a version string")
    return info


# ----------------------------------------------------------------------------- legacy torch format

def megatron_lm_args(layout: Layout, dims, arch_args: dict, spec: str, padded_vocab: int,
                     dtype: torch.dtype, fmt: str) -> argparse.Namespace:
    """The args Namespace Megatron-LM stores, with what its loader compares and reads back
    (`check_checkpoint_args`, `load_args_from_checkpoint`)."""
    args = dict(
        num_layers=dims.layers, hidden_size=dims.hidden, num_attention_heads=dims.heads,
        seq_length=min(getattr(dims, "max_positions", 4096), 4096),
        add_position_embedding=False, use_rotary_position_embeddings=True, rotary_interleaved=False,
        apply_layernorm_1p=False, squared_relu=False, attention_dropout=0.0, hidden_dropout=0.0,
        apply_query_key_layer_scaling=False,
        untie_embeddings_and_output_weights=not dims.tied, vocab_size=dims.vocab, padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=layout.vocab_divisor, tokenizer_type="HuggingFaceTokenizer",
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=layout.vpp if layout.vpp > 1 else None,
        decoder_first_pipeline_num_layers=layout.first_stage_layers,
        decoder_last_pipeline_num_layers=layout.last_stage_layers,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        num_experts=None, moe_ffn_hidden_size=None,
        transformer_impl="transformer_engine" if spec == "te" else "local", moe_grouped_gemm=spec == "te",
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        ckpt_format=fmt, consumed_train_samples=0, consumed_valid_samples=0,
        world_size=layout.tp * layout.pp * layout.ep, data_parallel_size=1,
    )
    args.update(arch_args)
    return argparse.Namespace(**args)


def rank_state(chunks: list[dict], args: argparse.Namespace, iteration: int | None) -> dict:
    state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0, "args": args}
    if len(chunks) == 1:
        state["model"] = chunks[0]
    else:
        state.update({f"model{v}": chunk for v, chunk in enumerate(chunks)})
    return state


def rank_file(iter_dir: Path, layout: Layout, rank: Rank) -> Path:
    return iter_dir / layout.rank_dir(rank) / RANK_FILE


def load_rank_file(path: Path) -> dict:
    """Load a legacy rank file through mconv's restricted unpickler (`safe_load`: tensors, the args
    Namespace, Megatron's enums, optimizer/RNG/scheduler state; no arbitrary code), tensors
    memory-mapped rather than read (read whole from a file in torch's older pre-zip format, which
    cannot be mapped: safe_load.load_torch). Raises MconvError naming the file."""
    if not path.is_file():
        raise MconvError(f"{path} is missing from the checkpoint")
    state = safe_load.load_torch(path, mmap=True)
    if not isinstance(state, dict):
        raise MconvError(f"{path} holds a {type(state).__name__}, not a Megatron-LM checkpoint dict")
    return state


def _file_mappings() -> dict[tuple[int, str], list[tuple[int, int, int]]]:
    """This process's file mappings (/proc/self/maps): (inode, path) -> [(first address, end address,
    file offset)], adjacent mappings that continue each other merged; empty where there is no such file."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return {}
    found: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 6 or "-" not in fields[0]:
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        offset, spans = int(fields[2], 16), found.setdefault((int(fields[4]), fields[5]), [])
        if spans and spans[-1][1] == lo and spans[-1][2] + spans[-1][1] - spans[-1][0] == offset:
            spans[-1] = (spans[-1][0], hi, spans[-1][2])
        else:
            spans.append((lo, hi, offset))
    return found


def _descriptors_to_spare() -> int:
    """Half the file descriptors this process may still open (RLIMIT_NOFILE less those open now)."""
    try:
        import resource

        return max(0, (resource.getrlimit(resource.RLIMIT_NOFILE)[0] - len(os.listdir("/proc/self/fd"))) // 2)
    except (ImportError, OSError, ValueError):
        return 0


class MappedRankFiles:
    """Where the memory-mapped tensors of legacy rank files (`load_rank_file`) lie in their files,
    so that their bytes can be copied file to file. A tensor's file offset is its address within
    torch's mapping of the file (/proc/self/maps, matched by inode and path to a descriptor opened
    here), accepted only when the tensor's bytes lie inside one uncompressed storage record
    (`.../data/<key>`) of the zip directory read from that descriptor
    (torch_dist_io.stored_records). Nothing else in the file is trusted: wherever anything
    disagrees or cannot be read, `locate` says None and the tensor is read through the mapping.
    One descriptor is held per rank file, for at most half the descriptors the process may still
    open (the mappings hold none): rank files past that are read through their mapping."""

    def __init__(self, paths: dict[Rank, Path]):
        mappings = _file_mappings()
        self._files: dict[Rank, tuple[int, list, list[int], list]] = {}  # fd, spans, record starts, records
        for rank, path in list(paths.items())[:_descriptors_to_spare()]:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            spans, records = [], []
            try:
                stat = os.fstat(fd)
                spans = mappings.get((stat.st_ino, os.path.realpath(path)), [])
                if spans:
                    records = torch_dist_io.stored_records(stat.st_size, lambda at, n: os.pread(fd, n, at)) or []
            except (OSError, ValueError, struct.error):
                pass
            records = [r for r in records if r[2].split("/")[-2:-1] == ["data"]]  # storages, not data.pkl
            if not records:
                os.close(fd)
                continue
            self._files[rank] = (fd, spans, [r[0] for r in records], records)

    def locate(self, rank: Rank, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(file descriptor, byte offset) of the bytes of `tensor`, a contiguous tensor loaded from
        rank `rank`'s file, in that file; None where they are not found as above."""
        if rank not in self._files or tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.nbytes:
            return None
        fd, spans, starts, records = self._files[rank]
        address, nbytes = tensor.data_ptr(), tensor.nbytes
        at = next((offset + address - lo for lo, hi, offset in spans if lo <= address and address + nbytes <= hi), None)
        record = -1 if at is None else bisect.bisect_right(starts, at) - 1
        if record < 0 or at + nbytes > starts[record] + records[record][1]:
            return None
        return fd, at

    def close(self) -> None:
        for fd, *_ in self._files.values():
            os.close(fd)
        self._files.clear()


def rank_chunks(state: dict, path: Path) -> list[dict[str, torch.Tensor]]:
    """A rank file's model chunks ('model', or 'model0', 'model1', ... with virtual pipeline stages),
    each checked here, where it is read, to be a dict of tensors by name: the restricted unpickler
    lets through any shape of allowed objects. `_extra_state` entries (Transformer Engine's state
    beside a weight: None, a BytesIO or a tensor) may hold anything; nothing reads them."""
    names = ["model"] if "model" in state else sorted(
        (k for k in state if isinstance(k, str) and k.startswith("model") and k[5:].isdecimal()),
        key=lambda k: int(k[5:]))
    if not names:
        raise MconvError(f"{path} has no 'model' or 'model0' entry")
    for name in names:
        chunk = state[name]
        if not isinstance(chunk, dict):
            raise MconvError(f"{path}: {name!r} is {described(chunk)}, not a dict of tensors")
        for key, value in chunk.items():
            if not isinstance(key, str):
                raise MconvError(f"{path}: entry {key!r:.80} of {name!r} is not a tensor name")
            if key.endswith("._extra_state"):
                continue
            if not isinstance(value, torch.Tensor):
                raise MconvError(f"{path}: {key:.200} in {name!r} is {described(value)}, not a tensor")
            if not safe_load.is_dense(value):
                raise MconvError(f"{path}: {key:.200} in {name!r} is a sparse, quantized, nested or meta tensor, "
                                 "not a dense one as Megatron-LM saves weights")
    return [state[name] for name in names]


# Saved-args switches that place layers or experts in ways a Layout cannot describe (Megatron-LM
# versions in brackets); each refuses the checkpoint by name.
_UNSUPPORTED_LAYOUT_ARGS = {
    "pipeline_model_parallel_layout": "an explicit per-stage layer layout",  # 0.13+
    "account_for_embedding_in_pipeline_split": "the embedding counted as a pipeline layer",  # 0.11+
    "account_for_loss_in_pipeline_split": "the loss counted as a pipeline layer",  # 0.11+
    "standalone_embedding_stage": "a pipeline stage holding only the embedding",  # up to 0.9
    "encoder_pipeline_model_parallel_size": "encoder pipeline stages",  # 0.9-0.14
    "pipeline_model_parallel_split_rank": "an encoder-decoder pipeline split",  # up to 0.10
}


def layout_from_args(args, path: Path) -> Layout:
    """The parallel layout of a legacy checkpoint, read from the args Namespace Megatron-LM saved
    in it, for every Megatron-LM version:

    - TP from `tensor_model_parallel_size` (`model_parallel_size` before checkpoint version 3.0, as
      Megatron-LM's `load_args_from_checkpoint` reads it); PP, VPP and the first/last stage layer
      counts where stored (absent in older versions: 1, 1, even stages).
    - Experts only when `num_experts` is set. Megatron-LM's `validate_args` stores
      `expert_tensor_parallel_size = tensor_model_parallel_size` for every run since 0.10, dense
      ones too, and `expert_model_parallel_size` (default 1) since 0.4; a dense model has no
      expert layout, so both are ignored there. For MoE, ETP absent (before 0.10, when experts
      were split like the dense layers) or None means ETP = TP, as `validate_args` sets it.
    - Switches that place layers or experts in ways mconv does not lay out (`--moe-extended-tp`,
      explicit pipeline layouts, embedding/loss stages, encoder stages) raise MconvError naming them.
    """
    def value(name, default=None):
        found = getattr(args, name, None)
        return default if found is None else found

    for name, what in _UNSUPPORTED_LAYOUT_ARGS.items():
        if value(name, False) not in (False, 0):
            raise MconvError(f"{path}: the saved args set {name}={value(name)!r} ({what}); "
                             "mconv reads only layouts of even or first/last-adjusted decoder stages")
    tp = value("tensor_model_parallel_size", value("model_parallel_size"))
    if tp is None:
        raise MconvError(f"{path}: the saved args lack tensor_model_parallel_size, so the parallel layout is unknown")
    ep = etp = 1
    if value("num_experts"):
        if getattr(args, "expert_tensor_parallel_size", None) is None and value("moe_extended_tp", False):
            raise MconvError(f"{path}: the saved args set moe_extended_tp (experts split over TP x EP, "
                             "Megatron-LM 0.8-0.9), an expert layout mconv does not read")
        ep, etp = value("expert_model_parallel_size", 1), value("expert_tensor_parallel_size", tp)
    try:
        layout = Layout(tp=tp, pp=value("pipeline_model_parallel_size", 1),
                        vpp=value("virtual_pipeline_model_parallel_size", 1), ep=ep, etp=etp,
                        first_stage_layers=value("decoder_first_pipeline_num_layers"),
                        last_stage_layers=value("decoder_last_pipeline_num_layers"),
                        vocab_divisor=value("make_vocab_size_divisible_by", 128))
        layout.check_sizes()
        layout.check_pipeline()
        return layout
    except MconvError as e:  # sizes of the wrong type or range, a pipeline no job can have
        raise MconvError(f"{path}: in the saved args, {e}") from None


def read_legacy_ranks(location: CheckpointLocation) -> tuple[argparse.Namespace, Layout, dict[Rank, list[dict]], Path]:
    """A legacy checkpoint's saved args, the layout they describe, and every rank file's model
    chunks (memory-mapped: tensors are read on access). Also returns the rank file the args came from."""
    first = sorted(location.iter_dir.glob(f"mp_rank_*/{RANK_FILE}"))[0]
    args = saved_args(load_rank_file(first), first)
    if args is None:
        raise MconvError(f"{first} has no 'args', so its parallel layout is unknown")
    layout = layout_from_args(args, first)
    expected = {rank_file(location.iter_dir, layout, rank) for rank in layout.ranks()}
    stray = sorted(set(location.iter_dir.glob(f"mp_rank_*/{RANK_FILE}")) - expected)
    if stray:  # another layout's files beside these: which of them were trained together is unknown
        raise MconvError(f"{stray[0]} is not a rank file of the layout {first}'s args give ({layout.describe()}): "
                         "rank files of another layout are mixed in; remove them")
    states = {}
    for rank in layout.ranks():
        path = rank_file(location.iter_dir, layout, rank)
        states[rank] = rank_chunks(load_rank_file(path), path)
    return args, layout, states, first
