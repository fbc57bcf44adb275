"""Prefill dispatch and combine in two calls, tied by a handle: `moe_dispatch_prefill` runs
layout -> notify -> dispatch (the four prefill ops of `cam_jit.ops.moe_normal`), and
`moe_combine_prefill` sends the expert results back with what the handle kept.

    recv_x, scales, per_expert, handle = cam_jit.moe_dispatch_prefill(x, ids, group_ep=..., ...)
    y = my_experts(recv_x, scales, per_expert)           # rows grouped by local expert
    out = cam_jit.moe_combine_prefill(y, handle, expert_scales)
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from cam_jit.ops import _checks as check
from cam_jit.ops.groups import group_ep_name
from cam_jit.ops.moe_normal import (GroupEp, moe_combine_normal, moe_dispatch_layout, moe_dispatch_normal,
                                    moe_notify_dispatch)


@dataclasses.dataclass(frozen=True)
class MoePrefillHandle:
    """What `moe_combine_prefill` needs from the dispatch it answers (N received rows, BS local
    tokens, E experts)."""

    expert_ids: torch.Tensor  # [BS, K] this rank's routing
    assist_info_for_combine: torch.Tensor  # [N, 3] int32 (source rank, token, k) per received row
    recv_count: torch.Tensor  # [E] int32 inclusive prefix of received rows by (local expert, source)
    num_tokens_per_rank: torch.Tensor  # [R] int32, from the layout
    is_token_in_rank: torch.Tensor  # [BS, R] int32, from the layout
    group_ep: str
    ep_rank_size: int
    ep_rank_id: int
    moe_expert_num: int
    global_bs: int  # max_bs * R


def moe_dispatch_prefill(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    group_ep: GroupEp,
    ep_rank_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    quant_mode: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, MoePrefillHandle]:
    """Dispatches a prefill batch: moe_dispatch_layout, moe_notify_dispatch, moe_dispatch_normal.

    Args:
        x: [BS, H] bfloat16/float16. expert_ids: [BS, K] int32/int64 in [-1, moe_expert_num).
        group_ep, ep_rank_size (R), ep_rank_id, moe_expert_num (E): as fused_deep_moe.
        quant_mode: 0 (x.dtype rows) or 2 (per-token int8, see moe_dispatch_normal).

    Returns:
        recv_x [N, H] (int8 or x.dtype), recv_scales [N] float32, recv_tokens_per_expert
        [E/R] int64 (rows per local expert, in row order), and the handle for moe_combine_prefill.
    """
    op = "moe_dispatch_prefill"
    check.argument_types(op, {"x": x, "expert_ids": expert_ids}, {}, {"ep_rank_size": ep_rank_size})
    group = group_ep_name(op, group_ep)
    per_rank, per_expert, in_rank, token_idx = moe_dispatch_layout(expert_ids, moe_expert_num=moe_expert_num,
                                                                   ep_rank_size=ep_rank_size)
    send_offset, recv_offset, recv_count, total, max_bs, per_local_expert = moe_notify_dispatch(
        per_expert, num_tokens=x.shape[0] if x.dim() else 0, group_ep=group, ep_rank_size=ep_rank_size,
        ep_rank_id=ep_rank_id)
    global_bs = int(max_bs) * ep_rank_size
    recv_x, recv_scales, assist = moe_dispatch_normal(
        x, expert_ids, send_offset, token_idx, recv_offset, recv_count, group_ep=group, ep_rank_size=ep_rank_size,
        ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num, num_recv_tokens=int(total), quant_mode=quant_mode,
        global_bs=global_bs)
    handle = MoePrefillHandle(expert_ids, assist, recv_count, per_rank, in_rank, group, ep_rank_size, ep_rank_id,
                              moe_expert_num, global_bs)
    return recv_x, recv_scales, per_local_expert, handle


def moe_combine_prefill(expert_out: torch.Tensor, handle: MoePrefillHandle,
                        expert_scales: torch.Tensor) -> torch.Tensor:
    """Combines the expert results of a moe_dispatch_prefill.

    Args:
        expert_out: [N, H] bfloat16/float16, one result per row of the dispatch's recv_x.
        handle: the dispatch's MoePrefillHandle.
        expert_scales: [BS, K] float32 combine weights of this rank's tokens.

    Returns:
        [BS, H] expert_out.dtype: per token, sum over k ascending of weight * result (float32,
        rounded once); tokens routed nowhere are zero.
    """
    if not isinstance(handle, MoePrefillHandle):
        check.fail("moe_combine_prefill", "handle", "the MoePrefillHandle returned by moe_dispatch_prefill",
                   type(handle).__name__, TypeError)
    return moe_combine_normal(expert_out, handle.assist_info_for_combine, handle.recv_count, handle.expert_ids,
                              expert_scales, group_ep=handle.group_ep, ep_rank_size=handle.ep_rank_size,
                              ep_rank_id=handle.ep_rank_id, moe_expert_num=handle.moe_expert_num,
                              global_bs=handle.global_bs)
