"""The cam_jit operators: public functions over `torch.ops.cam_jit.*`.

Importing this package defines the op schemas and registers their fake and CPU kernels; it
compiles nothing (the C++ kernels are built on the first call that needs them).
"""
from __future__ import annotations

import sys
from typing import Dict, List

import torch

from cam_jit.ops import _registry
from cam_jit.ops._strict import set_strict
from cam_jit.ops.a2e_e2a import a2e, e2a
from cam_jit.ops.comm import (cam_free_comm, cam_get_and_increase_magic, cam_get_comm, cam_get_magic,
                              cam_get_rank_size)
from cam_jit.ops.detour import all2_all_detour, reduce_scatter_detour
from cam_jit.ops.fused_deep_moe import fused_deep_moe
from cam_jit.ops.graph import ge_converter_status, register_ge_converters
from cam_jit.ops.groups import register_group
from cam_jit.ops.moe_lowlatency import moe_combine_lowlatency, moe_dispatch_lowlatency
from cam_jit.ops.moe_normal import moe_combine_normal, moe_dispatch_layout, moe_dispatch_normal, moe_notify_dispatch
from cam_jit.ops.moe_prefill import MoePrefillHandle, moe_combine_prefill, moe_dispatch_prefill
from cam_jit.ops.prepared_weights import clear_prepared_weights, prepare_expert_weights, prepared_weights_bytes
from cam_jit.ops.weights import (nd_to_nz, nz_to_nd, pack_int4, permute_gmm1_weight, unpack_int4,
                                 unpermute_gmm1_weight, w4a8_compensation_bias)

from cam_jit.ascend.npu_ops import register as _register_npu_kernels

_register_npu_kernels()  # PrivateUse1 kernels; need neither torch_npu nor a compiler until called
if "torchair" in sys.modules:  # Ascend graph mode in use (torch_npu provides torchair): its converters too
    register_ge_converters()

# backend name shown to users -> dispatch key (torch_npu registers the NPU as PrivateUse1)
_BACKEND_KEYS = {"CPU": "CPU", "Meta": "Meta", "NPU": "PrivateUse1"}


def describe_ops() -> List[Dict[str, object]]:
    """One entry per op: qualified name, schema, public function, the backends ("CPU", "Meta",
    "NPU": the dispatch keys CPU, Meta, PrivateUse1) that have a kernel right now (read from the dispatcher, not from a list; a composite kernel of a
    host-side op counts for every backend), and its TorchAir GE converter
    ("GE converter" or "no GE converter: <reason>", from ge_converters/)."""
    converters = ge_converter_status()
    return [
        {
            "name": info.qualname,
            "schema": info.name + info.schema,
            "python_api": f"cam_jit.{info.name}",
            "backends": [name for name, key in _BACKEND_KEYS.items()
                         if torch._C._dispatch_has_computed_kernel_for_dispatch_key(info.qualname, key)],
            "ge_converter": converters.get(info.name, "no GE converter: not listed in ge_converters/"),
        }
        for info in _registry.OPS
    ]


__all__ = [
    # ops
    "fused_deep_moe", "moe_dispatch_lowlatency", "moe_combine_lowlatency", "a2e", "e2a",
    "moe_dispatch_layout", "moe_notify_dispatch", "moe_dispatch_normal", "moe_combine_normal",
    "moe_dispatch_prefill", "moe_combine_prefill", "MoePrefillHandle",
    "all2_all_detour", "reduce_scatter_detour",
    "cam_get_comm", "cam_free_comm", "cam_get_rank_size", "cam_get_and_increase_magic", "cam_get_magic",
    # weight helpers
    "pack_int4", "unpack_int4", "w4a8_compensation_bias", "permute_gmm1_weight", "unpermute_gmm1_weight",
    "nd_to_nz", "nz_to_nd", "prepare_expert_weights", "prepared_weights_bytes", "clear_prepared_weights",
    # configuration and introspection
    "describe_ops", "register_ge_converters", "register_group", "set_strict",
]
