"""mconv: exact, fast, bounded-memory weight conversion between Hugging Face and Megatron-Core."""
__version__ = "0.1.0"

from mconv.converter.layout import Layout  # noqa: E402
from mconv.errors import MconvError  # noqa: E402

__all__ = ["Layout", "MconvError", "hf2mcore", "inspect_path", "mcore2hf", "__version__"]


def __getattr__(name: str):
    """The conversions import torch: load them on first use, so `import mconv.cli` (and `--help`)
    stays light."""
    if name in ("hf2mcore", "mcore2hf"):
        from mconv.converter import pipelines

        return getattr(pipelines, name)
    if name == "inspect_path":
        from mconv.converter.describe import inspect_path

        return inspect_path
    raise AttributeError(f"module 'mconv' has no attribute {name!r}")
