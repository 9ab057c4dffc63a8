"""Choices and defaults shared by the command line and the library. This module imports nothing
heavy, so `mconv --help` and option parsing start without torch."""
import contextlib

SPECS = ("local", "te")  # megatron-core layer specs: local modules or Transformer Engine names
FORMATS = ("torch_dist", "torch")  # Megatron-LM checkpoint formats mconv writes and reads
DEFAULT_SHARD_BYTES = 3_000_000_000  # largest safetensors shard mcore2hf writes


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
