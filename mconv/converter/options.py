"""Choices and defaults shared by the command line and the library. This module imports nothing
heavy, so `mconv --help` and option parsing start without torch."""
import contextlib
import os

from mconv.errors import MconvError

SPECS = ("local", "te")  # megatron-core layer specs: local modules or Transformer Engine names
FORMATS = ("torch_dist", "torch")  # Megatron-LM checkpoint formats mconv writes and reads
DEFAULT_SHARD_BYTES = 3_000_000_000  # largest safetensors shard mcore2hf writes
DTYPES = ("float32", "bfloat16", "float16")  # the dtypes mconv casts to (--dtype, `dtype=`)
QUANTIZATIONS = ("fp8",)  # what mcore2hf --quantize writes: block-wise FP8 (converter/fp8.py)
FP8_SCALES = ("float", "ue8m0")  # --fp8-scale: float32 amax/448, or powers of two (DeepGEMM / SGLang)
MAX_ITERATION = 10**9  # iter_NNNNNNN/ has 7 digits; Megatron-LM pads to 7 and reads more, never a sign
MAX_SIZE = 2**63 - 1  # a shard size beyond this is no file size (and no int64 for safetensors)
MAX_PARALLEL_SIZE = 2**16  # the largest TP / PP / EP / ... size a layout takes (no job is near it)
MAX_WORKERS = 64  # --workers: each thread keeps up to two 32 MiB jobs in flight (parallel.run_ordered), so
# memory stays bounded; conversion is storage-bound (4 is the fastest measured, docs/performance.md)


def parse_size(size: str) -> int:
    """A shard size as transformers' `save_pretrained(max_shard_size=...)` reads it
    (transformers.utils.hub.convert_file_size_to_int, followed rule for rule: tests/test_cli_text.py
    compares the two over many strings): an integer followed by GiB/MiB/KiB (powers of 1024) or
    GB/MB/KB (powers of 1000), case-insensitive, except that a lower-case final `b` means bits
    (`100kb` is 12,500 bytes). Raises ValueError for anything else; positivity is the caller's rule.
    Reimplemented because the command line must not import transformers."""
    for suffix, scale in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10)):
        if size.upper().endswith(suffix):
            return int(size[:-3]) * scale
    for suffix, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size.upper().endswith(suffix):
            value = int(size[:-2]) * scale
            return value // 8 if size.endswith("b") else value
    raise ValueError(f"{size!r} is not an integer followed by a unit such as GB, MB, KB, GiB, MiB or KiB")


def shard_bytes(size, name: str = "max_shard_bytes") -> int:
    """A library's shard-size parameter: a positive int of bytes up to MAX_SIZE, or a string that
    parse_size reads ("3GB"). MconvError naming the parameter otherwise."""
    if isinstance(size, str):
        try:
            size = parse_size(size)
        except ValueError:
            raise MconvError(f"{option(name, size)} is not a size such as 3GB, 500MB or 1GiB") from None
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_SIZE:
        raise MconvError(f"{option(name, size)} is not a positive number of bytes")
    return size


def check_path(value, name: str) -> None:
    """MconvError unless `value` (library parameter `name`) is a path: a str or an os.PathLike, not
    the empty string (which os and pathlib read as the current directory)."""
    if not isinstance(value, (str, os.PathLike)):
        raise MconvError(f"{name} is {value!r} ({type(value).__name__}): give a path (a str or pathlib.Path)")
    if value == "":
        raise MconvError(f"{name} is empty: give a path (\".\" for the current directory)")


def check_count(value, name: str, low: int = 1, high: int | None = None) -> int:
    """An integer parameter of the library (`workers`, `iteration`) in low..high, as the command
    line's click.IntRange has it; MconvError naming the parameter otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bounds = f"an integer from {low} to {high}" if high is not None else f"an integer of at least {low}"
        raise MconvError(f"{option(name, value)} is not {bounds}")
    return value


def dtype_name(dtype) -> str:
    """"bfloat16" for torch.bfloat16: how --dtype, JSON summaries and the engines' update requests
    (vLLM's, SGLang's) name a dtype."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(dtype, name: str = "dtype"):
    """The torch dtype a `dtype` parameter asks for: None, one of DTYPES by name ("bfloat16", as
    --dtype takes them) or as a torch dtype. MconvError naming the parameter for anything else
    (torch.int8, "bf16"). Imports torch only when given a dtype, so the command line starts without it."""
    if dtype is None:
        return None
    import torch

    name_of = dtype if isinstance(dtype, str) else dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
    if name_of not in DTYPES:
        raise MconvError(f"{option(name, dtype)} is not a dtype mconv writes; available: {', '.join(DTYPES)}")
    return getattr(torch, name_of)


# The command line and the library share the checks, so a message names an option through
# `option()`: as the command's flag (`--format torch`) while a command runs, as the function's
# parameter (`fmt='torch'`) when a library call raised it.
FLAGS = {"fmt": "--format", "max_shard_bytes": "--max-shard-size", "merge_into": "--merge"}  # where the flag is not the parameter's name
_command_line = False


@contextlib.contextmanager
def command_line_names():
    """While inside, messages name the command line's flags (set for the length of one command)."""
    global _command_line
    before, _command_line = _command_line, True
    try:
        yield
    finally:
        _command_line = before


def option(name: str, value=None) -> str:
    """Option `name` (a library parameter) as a message names it: on the command line `--first-stage-layers`
    or `--tp 2` (a True value: the flag alone); in the library `first_stage_layers` or `tp=2`."""
    if _command_line:
        flag = FLAGS.get(name, "--" + name.replace("_", "-"))
        return flag if value is None or value is True else f"{flag} {value}"
    return name if value is None else f"{name}={value!r}"
