"""cam_jit: Ascend CAM MoE operators for PyTorch, JIT-compiled on first use.

Importing this package compiles nothing and needs no compiler, torch_npu or CANN. It defines the
ops (`torch.ops.cam_jit.*`); the subpackages `ascend`, `nn`, `reference` and `zero_buffer` (with
`FusedDeepMoeBuffer`) are imported on first access.
"""
import importlib as _importlib

from cam_jit._version import __version__
from cam_jit.jit import load
from cam_jit.ops import *  # noqa: F401,F403  (the public API; cam_jit.ops.__all__ lists it)
from cam_jit.ops import __all__ as _ops_all
from cam_jit.quantize import QuantizedExperts, quantize_experts

__all__ = ["__version__", "FusedDeepMoeBuffer", "QuantizedExperts", "load", "nn", "quantize_experts", *_ops_all]

_LAZY_SUBMODULES = ("ascend", "nn", "reference", "zero_buffer")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name == "FusedDeepMoeBuffer":
        from cam_jit.zero_buffer import FusedDeepMoeBuffer

        return FusedDeepMoeBuffer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_LAZY_SUBMODULES))
