"""Choices and defaults shared by the command line and the library. This module imports nothing
heavy, so `mconv --help` and option parsing start without torch."""

SPECS = ("local", "te")  # megatron-core layer specs: local modules or Transformer Engine names
FORMATS = ("torch_dist", "torch")  # Megatron-LM checkpoint formats mconv writes and reads
DEFAULT_SHARD_BYTES = 3_000_000_000  # largest safetensors shard mcore2hf writes
