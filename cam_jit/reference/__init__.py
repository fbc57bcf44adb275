"""Golden "small ops" reference implementations (docs/semantics.md made executable).

Independent of the product code (``cam_jit.ops`` / the C++ kernels); tests compare the two.

* :func:`fused_deep_moe` - the whole operator (docs/semantics.md §1), same signature as the public op.
* :func:`a2e`, :func:`e2a` - attention/expert transfer (docs/semantics.md §2), same signatures as the ops.
* ``moe_normal`` - the prefill layout / notify / dispatch / combine ops, over all-gathers.
* ``detour`` - all2_all_detour / reduce_scatter_detour (docs/semantics.md §3) over an all-gather.
* :func:`pack_int4`, :func:`unpack_int4`, :func:`w4a8_compensation_bias` - docs/semantics.md §1.5 helpers.
* ``fused_deep_moe_steps`` - the module holding the individual steps of docs/semantics.md §1.8 (``quantize_rows``,
  ``gmm1_stage``, ``swiglu_requant``, ``gmm2_stage``, ``expert_ffn``, ``combine``) for
  stage-by-stage comparisons. (The attribute ``fused_deep_moe`` of this package is the function,
  so ``import cam_jit.reference.fused_deep_moe as m`` would not give the module.)
"""
import importlib as _importlib

from ._int4 import pack_int4, unpack_int4, w4a8_compensation_bias
from . import detour, moe_normal
from .a2e_e2a import a2e, e2a

fused_deep_moe_steps = _importlib.import_module(".fused_deep_moe", __name__)
fused_deep_moe = fused_deep_moe_steps.fused_deep_moe

__all__ = ["a2e", "detour", "moe_normal", "e2a", "fused_deep_moe", "fused_deep_moe_steps", "pack_int4", "unpack_int4",
           "w4a8_compensation_bias"]
