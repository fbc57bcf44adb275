"""Access to the JIT-compiled kernel libraries, loaded on first use."""
from __future__ import annotations

import torch

from cam_jit.jit import load


def cpu_kernels():
    """`torch.ops._cam_jit_cpu`, building or loading the CPU library first (memoised)."""
    load("cpu")
    return torch.ops._cam_jit_cpu


def register_inference_only(qualname: str) -> None:
    """Give op `qualname` an autograd formula that raises: every CAM op is forward-only (upstream
    returned empty gradients silently)."""

    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise RuntimeError(
            f"{qualname} is inference-only and has no backward; call it under torch.no_grad() / "
            "torch.inference_mode(), or detach its inputs"
        )

    torch.library.register_autograd(qualname, backward, setup_context=setup_context)
