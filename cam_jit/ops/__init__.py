"""The cam_jit operators: public functions over `torch.ops.cam_jit.*`.

Importing this package defines the op schemas and registers their fake and CPU kernels; it
compiles nothing (the C++ kernels are built on the first call that needs them).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from cam_jit.ops import fused_deep_moe as _fused_deep_moe_module
from cam_jit.ops import moe_lowlatency as _moe_lowlatency_module
from cam_jit.ops._strict import set_strict
from cam_jit.ops.fused_deep_moe import fused_deep_moe
from cam_jit.ops.groups import register_group
from cam_jit.ops.moe_lowlatency import moe_combine_lowlatency, moe_dispatch_lowlatency

# (qualified name, schema without the name, public function) of every op
_OPS = (
    (_fused_deep_moe_module.QUALNAME, _fused_deep_moe_module.SCHEMA, fused_deep_moe),
    (_moe_lowlatency_module.DISPATCH_QUALNAME, _moe_lowlatency_module.DISPATCH_SCHEMA, moe_dispatch_lowlatency),
    (_moe_lowlatency_module.COMBINE_QUALNAME, _moe_lowlatency_module.COMBINE_SCHEMA, moe_combine_lowlatency),
)
_DISPATCH_KEYS = ("CPU", "Meta", "PrivateUse1")


def describe_ops() -> List[Dict[str, object]]:
    """One entry per op: qualified name, schema, public function, and the dispatch keys that have
    a kernel right now (read from the dispatcher, not from a list)."""
    described = []
    for qualname, schema, function in _OPS:
        backends = [key for key in _DISPATCH_KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)]
        described.append({
            "name": qualname,
            "schema": qualname.split("::")[1] + schema,
            "python_api": f"cam_jit.{function.__name__}",
            "backends": backends,
        })
    return described


__all__ = ["describe_ops", "fused_deep_moe", "moe_combine_lowlatency", "moe_dispatch_lowlatency", "register_group",
           "set_strict"]
