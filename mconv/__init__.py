"""mconv: exact, fast, bounded-memory weight conversion between Hugging Face and Megatron-Core."""
__version__ = "0.1.0"

from mconv.converter.layout import Layout  # noqa: E402
from mconv.converter.describe import inspect_path  # noqa: E402
from mconv.converter.pipelines import hf2mcore, mcore2hf  # noqa: E402
from mconv.errors import MconvError  # noqa: E402

__all__ = ["Layout", "MconvError", "hf2mcore", "inspect_path", "mcore2hf", "__version__"]
