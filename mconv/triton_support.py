"""What mconv's Triton kernels (fp8_batch's quantization, transport.copies' batched copy) share:
whether Triton imports, and a kernel as a GPU runs it or, for CPU tensors (the tests), as Triton's
interpreter does."""
from __future__ import annotations

import torch


def triton_importable() -> bool:
    """Whether Triton imports (a torch build without it runs the kernels' plain-torch routes)."""
    try:
        import triton  # noqa: F401 (only whether it imports)
    except ImportError:
        return False
    return True


def launcher(kernel, device: torch.device):
    """`kernel` (a triton.jit function) as compiled for a GPU, or run by Triton's interpreter for
    CPU tensors (tests)."""
    if device.type == "cuda":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)
