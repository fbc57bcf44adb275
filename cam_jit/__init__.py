"""cam_jit: Ascend CAM MoE operators for PyTorch, JIT-compiled on first use.

Importing this package compiles nothing and needs no compiler, torch_npu or CANN.
"""
from cam_jit._version import __version__
from cam_jit.jit import load
from cam_jit.ops import (a2e, all2_all_detour, cam_free_comm, cam_get_and_increase_magic, cam_get_comm, cam_get_magic,
                         cam_get_rank_size, describe_ops, e2a, fused_deep_moe, moe_combine_lowlatency,
                         moe_dispatch_lowlatency, nd_to_nz, nz_to_nd, pack_int4, permute_gmm1_weight,
                         reduce_scatter_detour, register_group, set_strict, unpack_int4, unpermute_gmm1_weight,
                         w4a8_compensation_bias)

__all__ = ["__version__", "a2e", "all2_all_detour", "cam_free_comm", "cam_get_and_increase_magic", "cam_get_comm",
           "cam_get_magic", "cam_get_rank_size", "describe_ops", "e2a", "fused_deep_moe", "load",
           "moe_combine_lowlatency", "moe_dispatch_lowlatency", "nd_to_nz", "nz_to_nd", "pack_int4",
           "permute_gmm1_weight", "reduce_scatter_detour", "register_group", "set_strict", "unpack_int4",
           "unpermute_gmm1_weight", "w4a8_compensation_bias"]
