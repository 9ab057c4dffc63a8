"""The training arguments Megatron-LM saves in a checkpoint (a legacy rank file's `args`, or
torch_dist's common state), checked to be what mconv computes with before it reads a size from them."""
from __future__ import annotations

import argparse
from pathlib import Path

from mconv.errors import MconvError


def described(value) -> str:
    """What an unpickled value is, for a message: 'None', 'a str', 'an int'."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


# The saved args that mconv computes with or prints as the model's sizes, with what Megatron-LM's
# parser stores in them (or None). Other args are only compared, printed as flags or checked by
# megatron_io.layout_from_args.
SAVED_ARG_TYPES = {
    **{name: (int, "a whole number") for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by", "num_experts", "moe_router_topk",
        "moe_ffn_hidden_size", "mtp_num_layers")},
    "moe_layer_freq": ((int, list, tuple), "a whole number or a list of 0/1 per layer"),
    "position_embedding_type": (str, "a name"),
}


def saved_args(state: dict, where: Path | str) -> argparse.Namespace | None:
    """The training arguments Megatron-LM saved in `state` (a legacy rank file's or torch_dist's common
    state), None where it saved none; MconvError naming `where` for anything else under 'args', or
    for an arg of SAVED_ARG_TYPES of another type."""
    args = state.get("args")
    if args is None:
        return None
    if not isinstance(args, argparse.Namespace):
        raise MconvError(f"{where}: 'args' is {described(args)}, not the training arguments (argparse.Namespace)")
    for name, (types, what) in SAVED_ARG_TYPES.items():
        value = getattr(args, name, None)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise MconvError(f"{where}: the saved args give {name}={value!r:.40}, not {what}")
    return args
