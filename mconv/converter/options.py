"""Choices and defaults shared by the command line and the library. This module imports nothing
heavy, so `mconv --help` and option parsing start without torch."""
import contextlib

SPECS = ("local", "te")  # megatron-core layer specs: local modules or Transformer Engine names
FORMATS = ("torch_dist", "torch")  # Megatron-LM checkpoint formats mconv writes and reads
DEFAULT_SHARD_BYTES = 3_000_000_000  # largest safetensors shard mcore2hf writes

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
