"""GE converter of ``cam_jit::e2a`` -> GE ``E2a`` (docs/semantics.md §7.3, attribute order of §7.2).

Inputs ``expand_x``, ``atten_batch_size``; Int attributes ``batch_size, hidden_size, topk,
expert_rank_size, attention_rank_size, rank``, String ``group_ep`` (the HCCL communicator name),
Int ``aiv_num``; output ``x``. ``batch_size`` is the schema's on expert ranks and expand_x's row
count on attention ranks, as UMDK's binding passes it (the kernel writes batch * hidden_size
elements of x there).
Output shape in torch follows the upstream wrapper (docs/semantics.md §8.9).
"""
from __future__ import annotations

import torch
from torchair import register_fx_node_ge_converter

from cam_jit.ascend.npu_ops import attention_side_batch

from ._common import ge_op_type, group_attr, int_attr, node, rows

OP = "e2a"


def convert_e2a(expand_x, atten_batch_size, batch_size, hidden_size, topk, expert_rank_size, attention_rank_size,
                rank, group_ep, aiv_num, meta_outputs=None):
    """The schema's 10 arguments in schema order -> the output ``x`` (one GE tensor)."""
    batch = attention_side_batch(rank, expert_rank_size, batch_size, rows(expand_x))
    ints = {"batch_size": batch, "hidden_size": hidden_size, "topk": topk,
            "expert_rank_size": expert_rank_size, "attention_rank_size": attention_rank_size, "rank": rank}
    attrs = {name: int_attr(OP, name, value) for name, value in ints.items()}
    attrs["group_ep"] = group_attr(OP, group_ep)
    attrs["aiv_num"] = int_attr(OP, "aiv_num", aiv_num)
    inputs = {"expand_x": expand_x, "atten_batch_size": atten_batch_size}
    return node(ge_op_type(OP), inputs, attrs, ("x",), meta_outputs)[0]


def register() -> None:
    register_fx_node_ge_converter(torch.ops.cam_jit.e2a.default)(convert_e2a)
