"""GE converter of ``cam_jit::a2e`` -> GE ``A2e`` (docs/semantics.md §7.3, attribute order of §7.2).

Inputs ``x``, ``expert_ids`` (optional), ``scales`` (optional); Int attributes ``batch_size,
hidden_size, topk, expert_rank_size, attention_rank_size, rank``, String ``group_ep`` (the HCCL
communicator name), Int ``aiv_num, compute_gate`` (the schema's ``atten_rank_size`` is GE's
``attention_rank_size``). ``batch_size`` is the schema's on expert ranks and x's row count on
attention ranks, as UMDK's binding passes it (the kernel copies batch * hidden_size elements);
outputs ``expand_x, simulate_expert_ids, simulate_expert_scales, atten_batch_size,
x_active_mask``. Output shapes in torch follow the upstream wrapper (docs/semantics.md §8.9); GE's
own InferShape gives expert ranks more ``expand_x`` rows (§7.3), rows the kernel does not write.
"""
from __future__ import annotations

import torch
from torchair import register_fx_node_ge_converter

from cam_jit.ascend.npu_ops import attention_side_batch

from ._common import ge_op_type, group_attr, int_attr, node, rows

OP = "a2e"
OUTPUTS = ("expand_x", "simulate_expert_ids", "simulate_expert_scales", "atten_batch_size", "x_active_mask")


def convert_a2e(x, expert_ids, scales, batch_size, hidden_size, topk, expert_rank_size, atten_rank_size, rank,
                group_ep, aiv_num, compute_gate, meta_outputs=None):
    """The schema's 12 arguments in schema order -> the 5 outputs."""
    batch = attention_side_batch(rank, expert_rank_size, batch_size, rows(x))
    ints = {"batch_size": batch, "hidden_size": hidden_size, "topk": topk,
            "expert_rank_size": expert_rank_size, "attention_rank_size": atten_rank_size, "rank": rank}
    attrs = {name: int_attr(OP, "atten_rank_size" if name == "attention_rank_size" else name, value)
             for name, value in ints.items()}
    attrs["group_ep"] = group_attr(OP, group_ep)
    attrs["aiv_num"] = int_attr(OP, "aiv_num", aiv_num)
    attrs["compute_gate"] = int_attr(OP, "compute_gate", compute_gate)
    inputs = {"x": x, "expert_ids": expert_ids, "scales": scales}
    return node(ge_op_type(OP), inputs, attrs, OUTPUTS, meta_outputs)


def register() -> None:
    register_fx_node_ge_converter(torch.ops.cam_jit.a2e.default)(convert_a2e)
