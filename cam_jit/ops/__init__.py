"""The cam_jit operators: public functions over `torch.ops.cam_jit.*`.

Importing this package defines the op schemas and registers their fake and CPU kernels; it
compiles nothing (the C++ kernels are built on the first call that needs them).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from cam_jit.ops import fused_deep_moe as _fused_deep_moe_module
from cam_jit.ops.fused_deep_moe import fused_deep_moe
from cam_jit.ops.groups import register_group

_OP_MODULES = (_fused_deep_moe_module,)
_DISPATCH_KEYS = ("CPU", "Meta", "PrivateUse1")


def describe_ops() -> List[Dict[str, object]]:
    """One entry per op: qualified name, schema, public function, and the dispatch keys that have
    a kernel right now (read from the dispatcher, not from a list)."""
    described = []
    for module in _OP_MODULES:
        backends = [key for key in _DISPATCH_KEYS
                    if torch._C._dispatch_has_kernel_for_dispatch_key(module.QUALNAME, key)]
        described.append({
            "name": module.QUALNAME,
            "schema": module.QUALNAME.split("::")[1] + module.SCHEMA,
            "python_api": f"cam_jit.{module.OP}",
            "backends": backends,
        })
    return described


__all__ = ["describe_ops", "fused_deep_moe", "register_group"]
