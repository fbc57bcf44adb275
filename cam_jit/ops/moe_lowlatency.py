"""Low-latency MoE dispatch and combine (DeepEP-like; the interface of CAM's zero-buffer ops
`MoeDispatchLowlatencyZeroBuffer` / `MoeCombineLowlatencyZeroBuffer`, docs/semantics.md §6).

`moe_dispatch_lowlatency` sends every routed (token, k) pair of the active tokens to the rank
owning its expert, optionally quantised to int8 with docs/semantics.md §1.8 step 1; each rank receives its
experts' rows packed by local expert, then source rank, then the source's t*K+k order (the NPU
kernel's order). The caller runs its experts on those rows; `moe_combine_lowlatency` sends the
results back and forms each token's weighted sum in ascending k (§1.8 step 5).
`fused_deep_moe` equals dispatch(quant_mode=2) -> expert FFN -> combine.

Output rows are sized for the worst case, as on the NPU: A = (global_bs / R) * R * min(K, E_loc)
rows (global_bs = 0 means BS * R); rows past the received count are zero.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from cam_jit.ops import _checks as check
from cam_jit.ops import _moe_cpu
from cam_jit.ops._kernels import cpu_kernels
from cam_jit.ops._registry import OpInfo, define_op
from cam_jit.ops.groups import group_ep_name, resolve_group

DISPATCH = OpInfo(
    "moe_dispatch_lowlatency",
    "(Tensor x, Tensor expert_ids, Tensor? scales, Tensor? x_active_mask, str group_ep, int ep_rank_size, "
    "int ep_rank_id, int moe_expert_num, int quant_mode, int global_bs) -> (Tensor expand_x, Tensor dynamic_scales, "
    "Tensor assist_info_for_combine, Tensor expert_token_nums, Tensor ep_recv_count)",
)
COMBINE = OpInfo(
    "moe_combine_lowlatency",
    "(Tensor expand_x, Tensor expert_ids, Tensor assist_info_for_combine, Tensor ep_send_counts, "
    "Tensor expert_scales, Tensor? x_active_mask, str group_ep, int ep_rank_size, int ep_rank_id, "
    "int moe_expert_num, int global_bs) -> Tensor",
)
DISPATCH_OP, COMBINE_OP = DISPATCH.name, COMBINE.name
QUANT_MODES = {0: "no quantisation", 2: "dynamic per-token int8"}
ASSIST_FIELDS = 3  # per row: source rank, source token t, k


def _check_routing(op: str, expert_ids, x_active_mask, batch: int, device) -> None:
    check.ndim(op, "expert_ids", expert_ids, 2)
    check.dtype(op, "expert_ids", expert_ids, (torch.int32,))
    if expert_ids.shape[0] != batch:
        check.fail(op, "expert_ids", f"shape[0] == {batch} (the batch)", list(expert_ids.shape))
    check.device(op, "expert_ids", expert_ids, device)
    if x_active_mask is not None:
        check.dtype(op, "x_active_mask", x_active_mask, (torch.bool,))
        check.shape(op, "x_active_mask", x_active_mask, [batch], "[BS], 1-D")
        check.device(op, "x_active_mask", x_active_mask, device)


def _rows_capacity(op: str, batch: int, topk: int, ranks: int, local_experts: int, global_bs: int) -> int:
    """A, the rows of expand_x; checks BS <= global_bs / R."""
    max_bs = global_bs // ranks if global_bs else batch
    if batch > max_bs:
        check.fail(op, "global_bs", f">= BS * ep_rank_size = {batch * ranks} (BS = {batch} tokens here)", global_bs)
    return max_bs * ranks * min(topk, local_experts)


def _validate_dispatch(x, expert_ids, scales, x_active_mask, group_ep, ep_rank_size, ep_rank_id, moe_expert_num,
                       quant_mode, global_bs) -> Tuple[int, int]:
    """Returns (E_loc, A)."""
    op = DISPATCH_OP
    local_experts = check.expert_parallel(op, "ep_rank_size", ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
    if quant_mode not in QUANT_MODES:
        check.fail(op, "quant_mode", " or ".join(f"{k} ({v})" for k, v in QUANT_MODES.items()), quant_mode)
    check.ndim(op, "x", x, 2)
    check.dtype(op, "x", x, (torch.bfloat16, torch.float16))
    batch, hidden = x.shape
    _check_routing(op, expert_ids, x_active_mask, batch, x.device)
    if scales is not None:
        if quant_mode != 2:
            check.fail(op, "scales", "None unless quant_mode == 2 (smooth scales feed the quantisation)", "a tensor")
        check.dtype(op, "scales", scales, (torch.float32,))
        check.shape(op, "scales", scales, [moe_expert_num, hidden], "[moe_expert_num, H] smooth scales")
        check.device(op, "scales", scales, x.device)
    capacity = _rows_capacity(op, batch, expert_ids.shape[1], ep_rank_size, local_experts, global_bs)
    return local_experts, capacity


def _dispatch_fake(x, expert_ids, scales, x_active_mask, group_ep, ep_rank_size, ep_rank_id, moe_expert_num,
                   quant_mode, global_bs):
    local_experts, capacity = _validate_dispatch(**locals())
    return (
        x.new_empty((capacity, x.shape[1]), dtype=torch.int8 if quant_mode == 2 else x.dtype),
        x.new_empty((capacity,), dtype=torch.float32),
        x.new_empty((capacity, ASSIST_FIELDS), dtype=torch.int32),
        x.new_empty((local_experts,), dtype=torch.int64),
        x.new_empty((local_experts * ep_rank_size,), dtype=torch.int32),
    )


DISPATCH_AGREED = ("x.shape[1]", "x.dtype", "expert_ids.shape[1]", "moe_expert_num", "quant_mode")
COMBINE_AGREED = ("expand_x.shape[1]", "expand_x.dtype", "expert_ids.shape[1]", "moe_expert_num")


def _dispatch_cpu(x, expert_ids, scales, x_active_mask, group_ep, ep_rank_size, ep_rank_id, moe_expert_num,
                  quant_mode, global_bs):
    op = DISPATCH_OP
    check.expert_parallel(op, "ep_rank_size", ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
    group = resolve_group(op, group_ep, ep_rank_size, ep_rank_id) if ep_rank_size > 1 else None
    try:
        local_experts, capacity = _validate_dispatch(x, expert_ids, scales, x_active_mask, group_ep, ep_rank_size,
                                                     ep_rank_id, moe_expert_num, quant_mode, global_bs)
        active = x.shape[0] if x_active_mask is None else int(x_active_mask.sum())
        check.expert_ids_in_range(op, expert_ids[:active], moe_expert_num)
    except (TypeError, ValueError) as err:
        _moe_cpu.refuse(op, group, DISPATCH_AGREED, err)
    agreed = dict(zip(DISPATCH_AGREED, (x.shape[1], x.dtype, expert_ids.shape[1], moe_expert_num, quant_mode)))
    route = _moe_cpu.plan_route(op, expert_ids, active, local_experts, group, agreed)
    if quant_mode == 2:
        rows, scale = cpu_kernels().quantize_rows(x, scales, route.token, route.expert if scales is not None else None)
    else:
        rows, scale = x[route.token], None
    received = _moe_cpu.send_rows(op, route, rows, scale, local_experts)
    count = received.local_expert.numel()
    if count > capacity:
        check.fail(op, "expert_ids", f"at most {capacity} routed pairs per rank (min(K, E_loc) per token and "
                   "source rank: no duplicate experts in a row)", f"{count} pairs for rank {ep_rank_id}")
    # received rows come grouped by source rank, so a stable sort by expert gives
    # (local expert, source rank, t*K+k) order
    order = torch.sort(received.local_expert, stable=True).indices
    expand_x = x.new_zeros((capacity, x.shape[1]), dtype=rows.dtype)
    expand_x[:count] = received.rows[order]
    dynamic_scales = torch.zeros(capacity, dtype=torch.float32)
    if scale is not None:
        dynamic_scales[:count] = received.scale[order]
    topk = expert_ids.shape[1]
    assist = torch.full((capacity, ASSIST_FIELDS), -1, dtype=torch.int32)
    assist[:count, 0] = received.source_rank[order].to(torch.int32)
    assist[:count, 1] = torch.div(received.source_pos[order], topk, rounding_mode="floor").to(torch.int32)
    assist[:count, 2] = received.source_pos[order].remainder(topk).to(torch.int32)
    expert_token_nums = torch.bincount(received.local_expert, minlength=local_experts)
    per_expert_source = torch.bincount(received.local_expert * ep_rank_size + received.source_rank,
                                       minlength=local_experts * ep_rank_size)
    return expand_x, dynamic_scales, assist, expert_token_nums, torch.cumsum(per_expert_source, 0).to(torch.int32)


def _validate_combine(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, x_active_mask,
                      group_ep, ep_rank_size, ep_rank_id, moe_expert_num, global_bs) -> None:
    op = COMBINE_OP
    local_experts = check.expert_parallel(op, "ep_rank_size", ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
    check.ndim(op, "expand_x", expand_x, 2)
    check.dtype(op, "expand_x", expand_x, (torch.bfloat16, torch.float16))
    check.ndim(op, "expert_ids", expert_ids, 2)
    batch, topk = expert_ids.shape
    _check_routing(op, expert_ids, x_active_mask, batch, expand_x.device)
    check.dtype(op, "expert_scales", expert_scales, (torch.float32,))
    check.shape(op, "expert_scales", expert_scales, [batch, topk], "the shape of expert_ids")
    capacity = _rows_capacity(op, batch, topk, ep_rank_size, local_experts, global_bs)
    check.shape(op, "expand_x", expand_x, [capacity, expand_x.shape[1]],
                f"[A, H], A = (global_bs / R) * R * min(K, E_loc) = {capacity}")
    check.dtype(op, "assist_info_for_combine", assist_info_for_combine, (torch.int32,))
    check.shape(op, "assist_info_for_combine", assist_info_for_combine, [capacity, ASSIST_FIELDS],
                "from moe_dispatch_lowlatency")
    check.dtype(op, "ep_send_counts", ep_send_counts, (torch.int32,))
    check.shape(op, "ep_send_counts", ep_send_counts, [local_experts * ep_rank_size],
                "[E_loc * R], ep_recv_count from moe_dispatch_lowlatency")
    for name, t in (("assist_info_for_combine", assist_info_for_combine), ("ep_send_counts", ep_send_counts),
                    ("expert_scales", expert_scales)):
        check.device(op, name, t, expand_x.device)


def _combine_fake(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, x_active_mask,
                  group_ep, ep_rank_size, ep_rank_id, moe_expert_num, global_bs):
    _validate_combine(**locals())
    return expand_x.new_empty((expert_ids.shape[0], expand_x.shape[1]))


def _combine_cpu(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, x_active_mask,
                 group_ep, ep_rank_size, ep_rank_id, moe_expert_num, global_bs):
    op = COMBINE_OP
    check.expert_parallel(op, "ep_rank_size", ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
    group = resolve_group(op, group_ep, ep_rank_size, ep_rank_id) if ep_rank_size > 1 else None
    try:
        _validate_combine(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                          x_active_mask, group_ep, ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
        batch, topk = expert_ids.shape
        count = int(ep_send_counts[-1]) if ep_send_counts.numel() else 0
        if not 0 <= count <= expand_x.shape[0]:
            check.fail(op, "ep_send_counts", f"a last (total) entry in [0, {expand_x.shape[0]}]", count)
        source = assist_info_for_combine[:count, 0].to(torch.int64)
        pos = (assist_info_for_combine[:count, 1].to(torch.int64) * topk
               + assist_info_for_combine[:count, 2].to(torch.int64))
        if count and (int(source.min()) < 0 or int(source.max()) >= ep_rank_size):
            check.fail(op, "assist_info_for_combine", f"source ranks in [0, {ep_rank_size})",
                       f"min {int(source.min())}, max {int(source.max())}")
    except (TypeError, ValueError) as err:
        _moe_cpu.refuse(op, group, COMBINE_AGREED, err)
    order = torch.sort(source, stable=True).indices
    rows, pos = expand_x[:count][order], pos[order]
    if group is not None:
        agreed = dict(zip(COMBINE_AGREED, (expand_x.shape[1], expand_x.dtype, topk, moe_expert_num)))
        send_counts = torch.bincount(source, minlength=ep_rank_size).tolist()
        recv_counts = _moe_cpu.exchange_counts(op, group, send_counts, count, agreed)
        rows, pos = _moe_cpu.exchange_columns(op, "result combine", group, [rows, pos], send_counts, recv_counts)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= batch * topk):
        check.fail(op, "assist_info_for_combine", f"(token, k) slots inside this rank's [{batch}, {topk}] routing",
                   f"slot {int(pos.max())}")
    pair_rows = torch.full((batch * topk,), -1, dtype=torch.int64)
    pair_rows[pos] = torch.arange(pos.numel())
    active = batch if x_active_mask is None else int(x_active_mask.sum())
    return cpu_kernels().combine(rows, pair_rows.view(batch, topk), expert_scales, active)


define_op(DISPATCH, _dispatch_fake, _dispatch_cpu)
define_op(COMBINE, _combine_fake, _combine_cpu)

GroupEp = Union[str, "torch.distributed.ProcessGroup"]


def moe_dispatch_lowlatency(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    scales: Optional[torch.Tensor] = None,
    x_active_mask: Optional[torch.Tensor] = None,
    *,
    group_ep: GroupEp,
    ep_rank_size: Optional[int] = None,
    ep_rank_id: int,
    moe_expert_num: int,
    quant_mode: int = 2,
    global_bs: int = 0,
    ep_world_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sends each routed (token, k) pair to the rank owning expert_ids[t, k].

    Args:
        x: [BS, H] bfloat16/float16 tokens. expert_ids: [BS, K] int32 in [-1, E); -1 skips.
        scales: optional [E, H] float32 smooth-quant factors by global expert (quant_mode 2).
        x_active_mask: optional [BS] bool; the first sum(mask) tokens are dispatched.
        group_ep, ep_rank_size (R), ep_rank_id, moe_expert_num (E): as fused_deep_moe.
        ep_world_size: torch_npu's name for ep_rank_size, accepted as a keyword alias.
        quant_mode: 2 quantises each row to int8 (docs/semantics.md §1.8 step 1), 0 sends x.dtype rows.
        global_bs: 0 (equal batches) or max_r(BS_r) * R; sizes the outputs.

    Returns (A = (global_bs / R) * R * min(K, E_loc) rows, received rows first):
        expand_x [A, H] int8 (quant_mode 2) or x.dtype: rows by local expert, source rank, t*K+k;
        dynamic_scales [A] float32: dequantisation scale per row (zeros for quant_mode 0);
        assist_info_for_combine [A, 3] int32: (source rank, token, k) per row, -1 past the rows;
        expert_token_nums [E_loc] int64: rows per local expert;
        ep_recv_count [E_loc * R] int32: cumulative rows per (local expert, source rank).
    """
    ep_rank_size = check.keyword_alias(DISPATCH_OP, "ep_rank_size", ep_rank_size, "ep_world_size", ep_world_size)
    check.argument_types(DISPATCH_OP, {"x": x, "expert_ids": expert_ids}, {"scales": scales, "x_active_mask": x_active_mask},
                 {"ep_rank_size": ep_rank_size, "ep_rank_id": ep_rank_id, "moe_expert_num": moe_expert_num,
                  "quant_mode": quant_mode, "global_bs": global_bs})
    return tuple(torch.ops.cam_jit.moe_dispatch_lowlatency(
        x, expert_ids, scales, x_active_mask, group_ep_name(DISPATCH_OP, group_ep), ep_rank_size, ep_rank_id,
        moe_expert_num, quant_mode, global_bs))


def moe_combine_lowlatency(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    x_active_mask: Optional[torch.Tensor] = None,
    *,
    group_ep: GroupEp,
    ep_rank_size: Optional[int] = None,
    ep_rank_id: int,
    moe_expert_num: int,
    global_bs: int = 0,
    ep_world_size: Optional[int] = None,
) -> torch.Tensor:
    """Sends expert results back to their tokens and combines them.

    Args:
        expand_x: [A, H] bfloat16/float16 expert outputs, row for row as moe_dispatch_lowlatency
            returned its expand_x. expert_ids: [BS, K] int32, this rank's routing (as dispatched).
        assist_info_for_combine: [A, 3] int32 and ep_send_counts: [E_loc * R] int32, the
            dispatch's assist_info_for_combine and ep_recv_count.
        expert_scales: [BS, K] float32 combine weights. x_active_mask: as dispatched.
        group_ep, ep_rank_size, ep_rank_id, moe_expert_num, global_bs: as dispatched
            (ep_world_size: a keyword alias of ep_rank_size).

    Returns:
        [BS, H] expand_x.dtype: sum over k ascending of expert_scales[t, k] * result, in float32,
        rounded once; inactive rows zero.
    """
    ep_rank_size = check.keyword_alias(COMBINE_OP, "ep_rank_size", ep_rank_size, "ep_world_size", ep_world_size)
    check.argument_types(COMBINE_OP, {"expand_x": expand_x, "expert_ids": expert_ids,
                              "assist_info_for_combine": assist_info_for_combine,
                              "ep_send_counts": ep_send_counts, "expert_scales": expert_scales},
                 {"x_active_mask": x_active_mask},
                 {"ep_rank_size": ep_rank_size, "ep_rank_id": ep_rank_id, "moe_expert_num": moe_expert_num,
                  "global_bs": global_bs})
    return torch.ops.cam_jit.moe_combine_lowlatency(
        expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, x_active_mask,
        group_ep_name(COMBINE_OP, group_ep), ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
