"""GE converter of ``cam_jit::fused_deep_moe`` -> GE ``FusedDeepMoe`` (docs/semantics.md §7.3, §7.2, §8.1).

One torch schema serves three GE prototypes of the same op type:

* ``base`` (UMDK cam_feature, W8A8): 14 inputs; attributes ``group_ep`` then the Int attributes
  ``ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs, ext_info, shmem_workspace,
  shmem_workspace_size``, the last three 0 for the non-zero-buffer call (§7.2);
* ``w4a8``: the 14 inputs, then ``gmm1_bias_optional``, ``gmm2_bias_optional`` (dynamic) and
  ``share_gmm1_bias_optional``, ``share_gmm2_bias_optional``; ``group_ep`` and 5 Int attributes;
* ``master``: the 14 inputs; ``group_ep`` and 5 Int attributes.

int32 weights select ``w4a8``. int8 weights select the installed W8A8 prototype
(``cam_jit.ascend.opp.detect_fdm_abi``: ``$CAM_JIT_FDM_ABI`` or the vendor op-info JSON), ``base``
when none is installed where the graph is built. Outputs: ``output``, ``share_output``,
``expert_token_nums``. Weight formats (FRACTAL_NZ int8, §1.15) are the caller's tensors' own: the
converter adds no format cast.
"""
from __future__ import annotations

import torch
from torchair import register_fx_node_ge_converter
from torchair.ge import DataType

from cam_jit.ascend import discover, opp, registry
from cam_jit.ops import _checks as check

from ._common import group_attr, int_attr, node

OP = "fused_deep_moe"
OUTPUTS = ("output", "share_output", "expert_token_nums")
_INT_ATTRS = ("ep_rank_size", "ep_rank_id", "moe_expert_num", "quant_mode", "global_bs")
_BASE_EXTRA_ATTRS = ("ext_info", "shmem_workspace", "shmem_workspace_size")  # 0: not the SHMEM call


def installed_abi(weight_dtype: int) -> str:
    """The prototype for weights of GE dtype ``weight_dtype``: see the module docstring."""
    wanted = "w4a8" if weight_dtype == DataType.DT_INT32 else None
    found = opp.detect_fdm_abi(opp.find_vendors(discover.find_cann()))
    if found.abi is None:
        return wanted or "base"
    if (found.abi == "w4a8") != (wanted == "w4a8"):
        variant = "int32 (W4A8)" if wanted else "int8 (W8A8)"
        check.fail(OP, "gmm1_weight", f"weights of the installed FusedDeepMoe prototype {found.abi!r} "
                   f"({found.how})", f"{variant} weights", TypeError)
    return found.abi


def convert_fused_deep_moe(
    x, expert_ids, gmm1_weight, gmm1_weight_scale, gmm2_weight, gmm2_weight_scale, expert_scales,
    share_gmm1_weight, share_gmm1_weight_scale, share_gmm2_weight, share_gmm2_weight_scale,
    expert_smooth_scales, share_smooth_scales, x_active_mask, gmm1_bias, gmm2_bias, share_gmm1_bias,
    share_gmm2_bias, group_ep, ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs,
    meta_outputs=None,
):
    """The schema's 24 arguments in schema order (GE tensors, lists of GE tensors, None for absent
    optionals, Python str/int attributes) -> [output, share_output, expert_token_nums]."""
    abi = installed_abi(gmm1_weight[0].dtype)
    inputs = {
        "x": x, "expert_ids": expert_ids, "gmm1_weight": list(gmm1_weight),
        "gmm1_weight_scale": list(gmm1_weight_scale), "gmm2_weight": list(gmm2_weight),
        "gmm2_weight_scale": list(gmm2_weight_scale), "expert_scales": expert_scales,
        "share_gmm1_weight": share_gmm1_weight, "share_gmm1_weight_scale": share_gmm1_weight_scale,
        "share_gmm2_weight": share_gmm2_weight, "share_gmm2_weight_scale": share_gmm2_weight_scale,
        "expert_smooth_scales": expert_smooth_scales, "share_smooth_scales": share_smooth_scales,
        "x_active_mask": x_active_mask,
    }
    biases = {"gmm1_bias": gmm1_bias, "gmm2_bias": gmm2_bias, "share_gmm1_bias": share_gmm1_bias,
              "share_gmm2_bias": share_gmm2_bias}
    if abi == "w4a8":
        inputs.update({f"{name}_optional": list(value) if isinstance(value, (list, tuple)) else value
                       for name, value in biases.items()})
    else:
        for name, value in biases.items():
            if (len(value) if isinstance(value, (list, tuple)) else value is not None):
                check.fail(OP, name, f"empty/None with int8 (W8A8) weights: GE FusedDeepMoe ({abi}) has no "
                           "bias inputs", "a tensor")
    values = dict(zip(_INT_ATTRS, (ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs)))
    attrs = {"group_ep": group_attr(OP, group_ep)}
    attrs.update({name: int_attr(OP, name, value) for name, value in values.items()})
    if abi == "base":
        attrs.update({name: int_attr(OP, name, 0) for name in _BASE_EXTRA_ATTRS})
    op_type = registry.op(registry.fdm_abi().variant_ops[abi]).ge_op
    return node(op_type, inputs, attrs, OUTPUTS, meta_outputs)


def register() -> None:
    register_fx_node_ge_converter(torch.ops.cam_jit.fused_deep_moe.default)(convert_fused_deep_moe)
