"""Megatron-LM checkpoints on disk: the directory conventions, mconv's metadata, and the legacy
`torch` format (one `model_optim_rng.pt` per model-parallel rank)."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mconv.converter import safe_load
from mconv.converter.hf_io import read_json
from mconv.converter.layout import Layout, Rank
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
        raise MconvError(f"{path} is not a directory")
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
    for key, allowed in (("spec", ("local", "te")), ("format", ("torch", "torch_dist"))):
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
    memory-mapped rather than read. Raises MconvError naming the file."""
    if not path.is_file():
        raise MconvError(f"{path} is missing from the checkpoint")
    state = safe_load.load_torch(path, mmap=True)
    if not isinstance(state, dict):
        raise MconvError(f"{path} holds a {type(state).__name__}, not a Megatron-LM checkpoint dict")
    return state


def rank_chunks(state: dict, path: Path) -> list[dict]:
    if "model" in state:
        return [state["model"]]
    chunks = [state[k] for k in sorted((k for k in state if k.startswith("model") and k[5:].isdigit()),
                                       key=lambda k: int(k[5:]))]
    if not chunks:
        raise MconvError(f"{path} has no 'model' or 'model0' entry")
    return chunks


def layout_from_args(args, path: Path) -> Layout:
    try:
        return Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                      vpp=getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
                      ep=getattr(args, "expert_model_parallel_size", 1) or 1,
                      etp=getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size,
                      first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers", None),
                      last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None),
                      vocab_divisor=getattr(args, "make_vocab_size_divisible_by", 128) or 128)
    except AttributeError as e:
        raise MconvError(f"{path}: the saved args lack {e.name}, so the parallel layout is unknown") from None
    except MconvError as e:
        raise MconvError(f"{path}: in the saved args, {e}") from None


def read_legacy_ranks(location: CheckpointLocation) -> tuple[argparse.Namespace, Layout, dict[Rank, list[dict]], Path]:
    """A legacy checkpoint's saved args, the layout they describe, and every rank file's model
    chunks (memory-mapped: tensors are read on access). Also returns the rank file the args came from."""
    first = sorted(location.iter_dir.glob(f"mp_rank_*/{RANK_FILE}"))[0]
    args = load_rank_file(first).get("args")
    if args is None:
        raise MconvError(f"{first} has no 'args', so its parallel layout is unknown")
    layout = layout_from_args(args, first)
    states = {}
    for rank in layout.ranks():
        path = rank_file(location.iter_dir, layout, rank)
        states[rank] = rank_chunks(load_rank_file(path), path)
    return args, layout, states, first
