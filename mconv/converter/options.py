"""Choices and defaults shared by the command line and the library. This module imports nothing
heavy, so `mconv --help` and option parsing start without torch."""

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
