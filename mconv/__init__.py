"""mconv: exact, fast, bounded-memory weight conversion between Hugging Face and Megatron-Core."""
__version__ = "0.1.0"

__all__ = ["Layout", "MconvError", "hf2mcore", "inspect_path", "mcore2hf", "__version__"]


def __getattr__(name: str):
    """Everything is loaded on first use: the conversions import torch, and the `mconv` program
    (`program.main`) must take its signals before anything else is imported."""
    if name == "Layout":
        from mconv.converter.layout import Layout

        return Layout
    if name == "MconvError":
        from mconv.errors import MconvError

        return MconvError
    if name == "hf2mcore":
        from mconv.converter.hf2mcore import hf2mcore

        return hf2mcore
    if name == "mcore2hf":
        from mconv.converter.mcore2hf import mcore2hf

        return mcore2hf
    if name == "inspect_path":
        from mconv.converter.describe import inspect_path

        return inspect_path
    raise AttributeError(f"module 'mconv' has no attribute {name!r}")
