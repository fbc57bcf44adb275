"""Access to the JIT-compiled kernel libraries, loaded on first use."""
from __future__ import annotations

import torch

from cam_jit.jit import load


def cpu_kernels():
    """`torch.ops._cam_jit_cpu`, building or loading the CPU library first (memoised)."""
    load("cpu")
    return torch.ops._cam_jit_cpu


class _InferenceOnly(torch.autograd.Function):
    """Runs an op's kernels below autograd; its outputs get a backward that raises."""

    @staticmethod
    def forward(ctx, qualname, run, *tensors):
        ctx.qualname = qualname
        out = run()
        return tuple(out) if isinstance(out, list) else out

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.qualname} is inference-only and has no backward; call it under torch.no_grad() / "
            "torch.inference_mode(), or detach its inputs"
        )


def _tensors(values) -> list:
    """The tensors among `values`, including those inside Tensor[] arguments."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(t for t in value if isinstance(t, torch.Tensor))
    return found


def register_inference_only(library: "torch.library.Library", name: str) -> None:
    """Give op `<library namespace>::name` an autograd kernel whose backward raises: every CAM
    op is forward-only (upstream returned empty gradients silently). Without inputs that require
    grad it only redispatches (no autograd.Function, no dataclass: cheaper per call and to
    register than torch.library.register_autograd)."""
    qualname = f"{library.ns}::{name}"
    resolved = []  # [OpOverload, whether it returns Tensor[]], on the first call

    def autograd_kernel(keyset, *args, **kwargs):
        if not resolved:
            op = getattr(getattr(torch.ops, library.ns), name).default
            resolved[:] = [op, isinstance(op._schema.returns[0].type, torch.ListType)]
        op, returns_list = resolved
        below = keyset & torch._C._after_autograd_keyset

        def run():
            with torch._C._AutoDispatchBelowAutograd():
                return op.redispatch(below, *args, **kwargs)

        if not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args, **kwargs)):
            return run()
        out = _InferenceOnly.apply(qualname, run, *_tensors((*args, *kwargs.values())))
        return list(out) if returns_list else out

    library.impl(name, autograd_kernel, "Autograd", with_keyset=True)
