"""cam_jit: Ascend CAM MoE operators for PyTorch, JIT-compiled on first use.

Importing this package compiles nothing and needs no compiler, torch_npu or CANN.
"""
from cam_jit._version import __version__
from cam_jit.jit import load
from cam_jit.ops import *  # noqa: F401,F403  (the public API; cam_jit.ops.__all__ lists it)
from cam_jit.ops import __all__ as _ops_all
from cam_jit.quantize import QuantizedExperts, quantize_experts
from cam_jit.zero_buffer import FusedDeepMoeBuffer

__all__ = ["__version__", "FusedDeepMoeBuffer", "QuantizedExperts", "load", "nn", "quantize_experts", *_ops_all]

_SUBMODULES = ("nn", "reference")  # loaded on first attribute access: `cam_jit.reference.fused_deep_moe`


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"cam_jit.{name}")
    raise AttributeError(f"module 'cam_jit' has no attribute {name!r}")
