"""Prefill ("normal") MoE dispatch and combine: CAM's `DispatchLayout`, `NotifyDispatch`,
`MoeDispatchNormal` and `MoeCombineNormal` kernels as four ops (docs/semantics.md §9).

1. `moe_dispatch_layout` (local): per-rank and per-expert token counts, the token-in-rank mask,
   and each (token, k) pair's index among the pairs sent to its expert.
2. `moe_notify_dispatch` (collective): exchanges the per-expert counts so every rank knows how
   many rows it receives, from whom, and where they sit.
3. `moe_dispatch_normal` (collective): every routed (token, k) pair arrives at the rank owning its
   expert, optionally quantised to int8; rows are packed by local expert, then source rank, then
   the source's t*K+k order, exactly `num_recv_tokens` of them.
4. `moe_combine_normal` (collective): the expert results go back to their tokens; each token's
   weighted sum runs over k ascending in float32 and is rounded once.

`cam_jit.moe_dispatch_prefill` / `moe_combine_prefill` chain them with a handle.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from cam_jit.ops import _checks as check
from cam_jit.ops import _exchange
from cam_jit.ops import _moe_normal_cpu as cpu
from cam_jit.ops._kernels import cpu_kernels
from cam_jit.ops._registry import OpInfo, define_op
from cam_jit.ops.groups import group_ep_name, resolve_group

LAYOUT = OpInfo(
    "moe_dispatch_layout",
    "(Tensor expert_ids, int moe_expert_num, int ep_rank_size) -> (Tensor num_tokens_per_rank, "
    "Tensor num_tokens_per_expert, Tensor is_token_in_rank, Tensor send_token_idx)",
)
NOTIFY = OpInfo(
    "moe_notify_dispatch",
    "(Tensor num_tokens_per_expert, int num_tokens, str group_ep, int ep_rank_size, int ep_rank_id) -> "
    "(Tensor send_offset, Tensor recv_offset, Tensor recv_count, Tensor total_recv_tokens, Tensor max_bs, "
    "Tensor recv_tokens_per_expert)",
)
DISPATCH = OpInfo(
    "moe_dispatch_normal",
    "(Tensor x, Tensor expert_ids, Tensor send_offset, Tensor send_token_idx, Tensor recv_offset, "
    "Tensor recv_count, str group_ep, int ep_rank_size, int ep_rank_id, int moe_expert_num, int quant_mode, "
    "int global_bs, int num_recv_tokens) -> (Tensor recv_x, Tensor recv_scales, Tensor assist_info_for_combine)",
)
COMBINE = OpInfo(
    "moe_combine_normal",
    "(Tensor recv_x, Tensor assist_info_for_combine, Tensor recv_count, Tensor expert_ids, "
    "Tensor expert_scales, str group_ep, int ep_rank_size, int ep_rank_id, int moe_expert_num, "
    "int global_bs) -> Tensor",
)
QUANT_MODES = {0: "no quantisation", 2: "dynamic per-token int8"}
ASSIST_FIELDS = 3  # per row: source rank, source token t, k
_ID_DTYPES = (torch.int32, torch.int64)
GroupEp = Union[str, "torch.distributed.ProcessGroup"]


# ------------------------------------------------------------------------------------------------
# moe_dispatch_layout
# ------------------------------------------------------------------------------------------------
def _validate_layout(op, expert_ids, moe_expert_num, ep_rank_size) -> None:
    check.expert_parallel(op, "ep_rank_size", ep_rank_size, 0, moe_expert_num, 0)
    check.ndim(op, "expert_ids", expert_ids, 2)
    check.dtype(op, "expert_ids", expert_ids, _ID_DTYPES)


def _layout_fake(expert_ids, moe_expert_num, ep_rank_size):
    _validate_layout(LAYOUT.name, expert_ids, moe_expert_num, ep_rank_size)
    batch, topk = expert_ids.shape
    return (expert_ids.new_empty((ep_rank_size,), dtype=torch.int32),
            expert_ids.new_empty((moe_expert_num,), dtype=torch.int32),
            expert_ids.new_empty((batch, ep_rank_size), dtype=torch.int32),
            expert_ids.new_empty((batch, topk), dtype=torch.int32))


def _layout_cpu(expert_ids, moe_expert_num, ep_rank_size):
    _validate_layout(LAYOUT.name, expert_ids, moe_expert_num, ep_rank_size)
    check.expert_ids_in_range(LAYOUT.name, expert_ids, moe_expert_num)
    return cpu.layout(expert_ids, moe_expert_num, ep_rank_size)


# ------------------------------------------------------------------------------------------------
# moe_notify_dispatch
# ------------------------------------------------------------------------------------------------
NOTIFY_AGREED = ("num_tokens_per_expert (length, moe_expert_num)",)


def _group(op, group_ep, ep_rank_size, ep_rank_id):
    """The process group of a collective op (None for one rank), after checking R and the rank."""
    if ep_rank_size <= 0:
        check.fail(op, "ep_rank_size", "> 0", ep_rank_size)
    if not 0 <= ep_rank_id < ep_rank_size:
        check.fail(op, "ep_rank_id", f"0 <= ep_rank_id < ep_rank_size ({ep_rank_size})", ep_rank_id)
    return resolve_group(op, group_ep, ep_rank_size, ep_rank_id) if ep_rank_size > 1 else None


def _validate_notify(op, num_tokens_per_expert, num_tokens, ep_rank_size, ep_rank_id) -> int:
    check.dtype(op, "num_tokens_per_expert", num_tokens_per_expert, (torch.int32,))
    check.ndim(op, "num_tokens_per_expert", num_tokens_per_expert, 1)
    if num_tokens < 0:
        check.fail(op, "num_tokens", ">= 0 (this rank's batch size)", num_tokens)
    experts = num_tokens_per_expert.shape[0]
    if ep_rank_size > 0 and (experts == 0 or experts % ep_rank_size):
        check.fail(op, "num_tokens_per_expert", f"length a positive multiple of ep_rank_size ({ep_rank_size}) "
                   "(moe_expert_num, from moe_dispatch_layout)", list(num_tokens_per_expert.shape))
    return check.expert_parallel(op, "ep_rank_size", ep_rank_size, ep_rank_id, experts, 0)


def _notify_fake(num_tokens_per_expert, num_tokens, group_ep, ep_rank_size, ep_rank_id):
    local_experts = _validate_notify(NOTIFY.name, num_tokens_per_expert, num_tokens, ep_rank_size, ep_rank_id)
    experts = num_tokens_per_expert.shape[0]
    new = num_tokens_per_expert.new_empty
    return (new((experts,)), new((experts,)), new((experts,)), new((1,)), new((1,)),
            new((local_experts,), dtype=torch.int64))


def _notify_cpu(num_tokens_per_expert, num_tokens, group_ep, ep_rank_size, ep_rank_id):
    op = NOTIFY.name
    group = _group(op, group_ep, ep_rank_size, ep_rank_id)
    try:
        local_experts = _validate_notify(op, num_tokens_per_expert, num_tokens, ep_rank_size, ep_rank_id)
        counts = num_tokens_per_expert.to(torch.int64)
        if counts.numel() and int(counts.min()) < 0:
            check.fail(op, "num_tokens_per_expert", "counts >= 0", f"min {int(counts.min())}")
    except (TypeError, ValueError) as err:
        cpu.refuse(op, group, NOTIFY_AGREED, 2, err)
    send_offset = torch.cumsum(counts, 0) - counts
    total_sent = int(counts.sum())
    # [R, E_loc, 2]: (count, offset) of each destination's experts
    outgoing = torch.stack([counts, send_offset], 1).view(ep_rank_size, local_experts, 2)
    if group is None:
        incoming, batches, totals = outgoing, [num_tokens], [total_sent]
    else:
        table = _exchange.agree(op, group, dict(zip(NOTIFY_AGREED, [counts.numel()])), [num_tokens, total_sent])
        batches, totals = [row[0] for row in table], [row[1] for row in table]
        incoming = cpu.all_to_all_fixed(op, "count exchange", group, outgoing.reshape(ep_rank_size, -1))
        incoming = incoming.view(ep_rank_size, local_experts, 2)
    recv_counts, recv_offsets = incoming[..., 0].t(), incoming[..., 1].t()  # [E_loc, R]
    source_totals = torch.tensor(totals, dtype=torch.int64)
    if bool(((recv_counts < 0) | (recv_offsets < 0) | (recv_counts + recv_offsets > source_totals)).any()):
        raise RuntimeError(f"{op}: a peer sent counts/offsets outside its own {totals} routed pairs: "
                           f"counts {recv_counts.tolist()}, offsets {recv_offsets.tolist()}")
    recv_count = torch.cumsum(recv_counts.reshape(-1), 0)
    total = int(recv_count[-1])
    if total >= 2 ** 31:
        raise RuntimeError(f"{op}: {total} received rows exceed the int32 row index of the kernels")
    return (send_offset.to(torch.int32), recv_offsets.reshape(-1).to(torch.int32), recv_count.to(torch.int32),
            torch.tensor([total], dtype=torch.int32), torch.tensor([max(batches)], dtype=torch.int32),
            recv_counts.sum(1))


# ------------------------------------------------------------------------------------------------
# moe_dispatch_normal
# ------------------------------------------------------------------------------------------------
def _check_global_bs(op, global_bs, batch, ranks) -> None:
    if global_bs and global_bs < batch * ranks:
        check.fail(op, "global_bs", f"0 or >= BS * ep_rank_size = {batch * ranks} (max_bs * ep_rank_size from "
                   "moe_notify_dispatch)", global_bs)


def _check_counts_arg(op, arg, t, experts, device) -> None:
    check.dtype(op, arg, t, (torch.int32,))
    check.shape(op, arg, t, [experts], "[moe_expert_num], from moe_notify_dispatch")
    check.device(op, arg, t, device)


def _validate_dispatch(x, expert_ids, send_offset, send_token_idx, recv_offset, recv_count, ep_rank_size,
                       ep_rank_id, moe_expert_num, quant_mode, global_bs, num_recv_tokens) -> int:
    op = DISPATCH.name
    local_experts = check.expert_parallel(op, "ep_rank_size", ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
    if quant_mode not in QUANT_MODES:
        check.fail(op, "quant_mode", " or ".join(f"{k} ({v})" for k, v in QUANT_MODES.items()), quant_mode)
    check.ndim(op, "x", x, 2)
    check.dtype(op, "x", x, (torch.bfloat16, torch.float16))
    batch = x.shape[0]
    check.ndim(op, "expert_ids", expert_ids, 2)
    check.dtype(op, "expert_ids", expert_ids, _ID_DTYPES)
    if expert_ids.shape[0] != batch:
        check.fail(op, "expert_ids", f"shape[0] == {batch} (the batch)", list(expert_ids.shape))
    check.device(op, "expert_ids", expert_ids, x.device)
    check.dtype(op, "send_token_idx", send_token_idx, (torch.int32,))
    check.shape(op, "send_token_idx", send_token_idx, list(expert_ids.shape), "the shape of expert_ids")
    check.device(op, "send_token_idx", send_token_idx, x.device)
    _check_counts_arg(op, "send_offset", send_offset, moe_expert_num, x.device)
    _check_counts_arg(op, "recv_offset", recv_offset, moe_expert_num, x.device)
    _check_counts_arg(op, "recv_count", recv_count, moe_expert_num, x.device)
    if num_recv_tokens < 0:
        check.fail(op, "num_recv_tokens", ">= 0 (total_recv_tokens from moe_notify_dispatch)", num_recv_tokens)
    _check_global_bs(op, global_bs, batch, ep_rank_size)
    return local_experts


def _dispatch_fake(x, expert_ids, send_offset, send_token_idx, recv_offset, recv_count, group_ep, ep_rank_size,
                   ep_rank_id, moe_expert_num, quant_mode, global_bs, num_recv_tokens):
    _validate_dispatch(x, expert_ids, send_offset, send_token_idx, recv_offset, recv_count, ep_rank_size,
                       ep_rank_id, moe_expert_num, quant_mode, global_bs, num_recv_tokens)
    rows = num_recv_tokens
    return (x.new_empty((rows, x.shape[1]), dtype=torch.int8 if quant_mode == 2 else x.dtype),
            x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows, ASSIST_FIELDS), dtype=torch.int32))


def _cumulative_counts(op, arg, recv_count, rows) -> torch.Tensor:
    """recv_count [E] int32 (inclusive prefix by (local expert, source rank)) -> [E] int64 counts."""
    total = recv_count.to(torch.int64)
    counts = torch.diff(total, prepend=total.new_zeros(1))
    if bool((counts < 0).any()) or int(total[-1]) != rows:
        check.fail(op, arg, f"a non-decreasing prefix sum ending at num_recv_tokens = {rows} (moe_notify_dispatch's "
                   "recv_count)", recv_count.tolist())
    return counts


DISPATCH_AGREED = ("x (hidden size H)", "x (dtype)", "expert_ids (top-k K)", "moe_expert_num", "quant_mode",
                   "global_bs")


def _check_dispatch_inputs(x, expert_ids, send_offset, send_token_idx, recv_offset, recv_count, ep_rank_size,
                           ep_rank_id, moe_expert_num, quant_mode, global_bs, num_recv_tokens):
    """This rank's own checks: the arguments, and the layout/notify outputs against expert_ids.
    Returns (is_token_in_rank [BS, R], received pairs [E_loc, R] by local expert and source)."""
    op = DISPATCH.name
    local_experts = _validate_dispatch(x, expert_ids, send_offset, send_token_idx, recv_offset, recv_count,
                                       ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs,
                                       num_recv_tokens)
    check.expert_ids_in_range(op, expert_ids, moe_expert_num)
    _, per_expert, in_rank, token_idx = cpu.layout(expert_ids, moe_expert_num, ep_rank_size)
    if not torch.equal(send_token_idx, token_idx):
        check.fail(op, "send_token_idx", "moe_dispatch_layout's send_token_idx for these expert_ids",
                   "different values")
    if not torch.equal(send_offset, (torch.cumsum(per_expert, 0) - per_expert).to(torch.int32)):
        check.fail(op, "send_offset", "moe_notify_dispatch's send_offset for these expert_ids", send_offset.tolist())
    return in_rank, _cumulative_counts(op, "recv_count", recv_count, num_recv_tokens).view(local_experts, ep_rank_size)


def _dispatch_cpu(x, expert_ids, send_offset, send_token_idx, recv_offset, recv_count, group_ep, ep_rank_size,
                  ep_rank_id, moe_expert_num, quant_mode, global_bs, num_recv_tokens):
    op, ranks = DISPATCH.name, ep_rank_size
    group = _group(op, group_ep, ranks, ep_rank_id)
    try:
        in_rank, counts = _check_dispatch_inputs(x, expert_ids, send_offset, send_token_idx, recv_offset,
                                                 recv_count, ranks, ep_rank_id, moe_expert_num, quant_mode,
                                                 global_bs, num_recv_tokens)
    except (TypeError, ValueError) as err:
        cpu.refuse(op, group, DISPATCH_AGREED, ranks, err)
    local_experts = moe_expert_num // ranks
    ids = expert_ids.to(torch.int64)
    batch, topk = ids.shape
    send_counts = in_rank.sum(0, dtype=torch.int64).tolist()
    tables = [int((ids >= 0).sum()), *send_offset.tolist(), *recv_offset.tolist(), *recv_count.tolist()]
    if group is None:
        token_table, routing_table = [send_counts], [tables]
    else:
        agreed = dict(zip(DISPATCH_AGREED, (x.shape[1], x.dtype, topk, moe_expert_num, quant_mode, global_bs)))
        token_table = _exchange.agree(op, group, agreed, send_counts)
        routing_table = cpu.gather_ints(op, group, tables).tolist()
    cpu.check_dispatch_tables(op, ep_rank_id, token_table, routing_table, local_experts)
    recv_tokens = [row[ep_rank_id] for row in token_table]
    # each token once per destination rank d, in (d, t) order, with its ids restricted to d's experts
    dest, token = torch.nonzero(in_rank.t(), as_tuple=True)
    own = (torch.div(ids[token], local_experts, rounding_mode="floor") == dest.unsqueeze(1)) & (ids[token] >= 0)
    local_ids = torch.where(own, ids[token].remainder(local_experts), -1).to(torch.int32)
    slot_idx = torch.where(own, send_token_idx[token], -1)
    if quant_mode == 2:
        q, scale = cpu.quantize_tokens(x)
        payload = [q[token], scale[token]]
    else:
        payload = [x[token]]
    columns = cpu.exchange(op, "token dispatch", group, payload + [token.to(torch.int32), local_ids, slot_idx],
                           send_counts, recv_tokens)
    rows, src_token, src_ids, src_slot = columns[:-3], *columns[-3:]
    source = torch.repeat_interleave(torch.arange(ranks), torch.tensor(recv_tokens))
    return _expand_pairs(op, rows, src_token, src_ids, src_slot, source, counts, num_recv_tokens, x.shape[1], topk)


def _expand_pairs(op, rows, src_token, src_ids, src_slot, source, counts, total, hidden, topk):
    """Received tokens (once per source and token) -> one output row per (token, k) pair at
    row start(local expert, source) + slot; every output row filled exactly once."""
    local_experts, ranks = counts.shape
    token_of_pair, k = torch.nonzero(src_ids >= 0, as_tuple=True)
    expert = src_ids[token_of_pair, k].to(torch.int64)
    slot = src_slot[token_of_pair, k].to(torch.int64)
    src = source[token_of_pair]
    bad_ids = bool((src_ids < -1).any() | (src_ids >= local_experts).any())
    expected = counts[expert.clamp(0, local_experts - 1), src] if expert.numel() else expert
    if bad_ids or bool(((slot < 0) | (slot >= expected)).any()) or token_of_pair.numel() != total:
        raise RuntimeError(f"{op}: the rows received ({token_of_pair.numel()} pairs) do not match recv_count "
                           f"(per local expert and source rank: {counts.tolist()}); every rank must pass the "
                           "outputs of moe_dispatch_layout and moe_notify_dispatch for the same expert_ids")
    start = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(local_experts, ranks)
    row = start[expert, src] + slot
    if row.numel() and int(torch.bincount(row).max()) > 1:
        raise RuntimeError(f"{op}: two received pairs claim the same row; send_token_idx differs between ranks' "
                           "layouts")
    pair_of_row = torch.empty(total, dtype=torch.int64)  # a permutation: every row filled exactly once
    pair_of_row[row] = torch.arange(total)
    token_of_row = token_of_pair[pair_of_row]
    recv_scales = rows[1][token_of_row] if len(rows) > 1 else torch.zeros(total, dtype=torch.float32)
    assist = torch.stack([src[pair_of_row], src_token[token_of_row].to(torch.int64), k[pair_of_row]], 1)
    return rows[0][token_of_row].view(total, hidden), recv_scales, assist.to(torch.int32)


# ------------------------------------------------------------------------------------------------
# moe_combine_normal
# ------------------------------------------------------------------------------------------------
def _validate_combine(recv_x, assist_info_for_combine, recv_count, expert_ids, expert_scales, ep_rank_size,
                      ep_rank_id, moe_expert_num, global_bs) -> None:
    op = COMBINE.name
    check.expert_parallel(op, "ep_rank_size", ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
    check.ndim(op, "recv_x", recv_x, 2)
    check.dtype(op, "recv_x", recv_x, (torch.bfloat16, torch.float16))
    rows = recv_x.shape[0]
    check.dtype(op, "assist_info_for_combine", assist_info_for_combine, (torch.int32,))
    check.shape(op, "assist_info_for_combine", assist_info_for_combine, [rows, ASSIST_FIELDS],
                "[rows of recv_x, 3], from moe_dispatch_normal")
    _check_counts_arg(op, "recv_count", recv_count, moe_expert_num, recv_x.device)
    check.ndim(op, "expert_ids", expert_ids, 2)
    check.dtype(op, "expert_ids", expert_ids, _ID_DTYPES)
    check.dtype(op, "expert_scales", expert_scales, (torch.float32,))
    check.shape(op, "expert_scales", expert_scales, list(expert_ids.shape), "the shape of expert_ids")
    for name, t in (("assist_info_for_combine", assist_info_for_combine), ("expert_ids", expert_ids),
                    ("expert_scales", expert_scales)):
        check.device(op, name, t, recv_x.device)
    _check_global_bs(op, global_bs, expert_ids.shape[0], ep_rank_size)


def _combine_fake(recv_x, assist_info_for_combine, recv_count, expert_ids, expert_scales, group_ep, ep_rank_size,
                  ep_rank_id, moe_expert_num, global_bs):
    _validate_combine(recv_x, assist_info_for_combine, recv_count, expert_ids, expert_scales, ep_rank_size,
                      ep_rank_id, moe_expert_num, global_bs)
    return recv_x.new_empty((expert_ids.shape[0], recv_x.shape[1]))


COMBINE_AGREED = ("recv_x (hidden size H)", "recv_x (dtype)", "expert_ids (top-k K)", "moe_expert_num", "global_bs")


def _combine_cpu(recv_x, assist_info_for_combine, recv_count, expert_ids, expert_scales, group_ep, ep_rank_size,
                 ep_rank_id, moe_expert_num, global_bs):
    op, ranks = COMBINE.name, ep_rank_size
    group = _group(op, group_ep, ranks, ep_rank_id)
    try:
        _validate_combine(recv_x, assist_info_for_combine, recv_count, expert_ids, expert_scales, ranks, ep_rank_id,
                          moe_expert_num, global_bs)
        _cumulative_counts(op, "recv_count", recv_count, recv_x.shape[0])
        check.expert_ids_in_range(op, expert_ids, moe_expert_num)
        batch, topk = expert_ids.shape
        assist = assist_info_for_combine.to(torch.int64)
        source, token, k = assist[:, 0], assist[:, 1], assist[:, 2]
        if assist.numel() and (int(source.min()) < 0 or int(source.max()) >= ranks or int(token.min()) < 0
                               or int(k.min()) < 0 or int(k.max()) >= topk):
            check.fail(op, "assist_info_for_combine", f"(source rank in [0, {ranks}), token >= 0, k in [0, {topk})) "
                       "per row, from moe_dispatch_normal", "rows outside those ranges")
    except (TypeError, ValueError) as err:
        cpu.refuse(op, group, COMBINE_AGREED, 2 * ranks, err)
    send_counts = torch.bincount(source, minlength=ranks).tolist()
    routed = expert_ids.reshape(-1).to(torch.int64)
    routed = routed[routed >= 0]
    dispatched = torch.bincount(torch.div(routed, moe_expert_num // ranks, rounding_mode="floor"),
                                minlength=ranks).tolist()
    if group is None:
        table = [send_counts + dispatched]
    else:
        agreed = (recv_x.shape[1], recv_x.dtype, topk, moe_expert_num, global_bs)
        table = _exchange.agree(op, group, dict(zip(COMBINE_AGREED, agreed)), send_counts + dispatched)
    cpu.check_returns(op, table)
    order = torch.sort(source, stable=True).indices if ranks > 1 else slice(None)  # rows grouped by destination
    rows, token, k = cpu.exchange(op, "result combine", group,
                                  [recv_x[order], token[order].to(torch.int32), k[order].to(torch.int32)],
                                  send_counts, [row[ep_rank_id] for row in table])
    slot = token.to(torch.int64) * topk + k.to(torch.int64)
    if slot.numel() and int(slot.max()) >= batch * topk:
        raise RuntimeError(f"{op}: a peer returned a result for token {int(token.max())}, but this rank has "
                           f"{batch} tokens; every rank must pass the handle of its own dispatch")
    hits = torch.bincount(slot, minlength=batch * topk)
    if not torch.equal(hits, (expert_ids >= 0).reshape(-1).to(hits.dtype)):
        raise RuntimeError(f"{op}: {slot.numel()} results came back for {routed.numel()} routed (token, k) pairs "
                           "of this rank, not one per pair; pass the expert_ids that were dispatched")
    pair_rows = torch.full((batch * topk,), -1, dtype=torch.int64)
    pair_rows[slot] = torch.arange(slot.numel())
    return cpu_kernels().combine(rows, pair_rows.view(batch, topk), expert_scales, batch)


define_op(LAYOUT, _layout_fake, _layout_cpu)
define_op(NOTIFY, _notify_fake, _notify_cpu)
define_op(DISPATCH, _dispatch_fake, _dispatch_cpu)
define_op(COMBINE, _combine_fake, _combine_cpu)


# ------------------------------------------------------------------------------------------------
# public functions
# ------------------------------------------------------------------------------------------------
def moe_dispatch_layout(expert_ids: torch.Tensor, *, moe_expert_num: int,
                        ep_rank_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dispatch layout of this rank's routing (no communication).

    Args:
        expert_ids: [BS, K] int32/int64, global expert ids in [-1, moe_expert_num); -1 skips a slot.
        moe_expert_num (E): a positive multiple of ep_rank_size (R); rank r owns experts
            [r * E/R, (r+1) * E/R).

    Returns:
        num_tokens_per_rank [R] int32: tokens with at least one expert on rank r;
        num_tokens_per_expert [E] int32: (token, k) pairs per expert;
        is_token_in_rank [BS, R] int32: 1 where token t has an expert on rank r;
        send_token_idx [BS, K] int32: pairs routed to the same expert before (t, k) in row-major
            order (-1 for skipped slots).
    """
    check.argument_types(LAYOUT.name, {"expert_ids": expert_ids}, {},
                         {"moe_expert_num": moe_expert_num, "ep_rank_size": ep_rank_size})
    return tuple(torch.ops.cam_jit.moe_dispatch_layout(expert_ids, moe_expert_num, ep_rank_size))


def moe_notify_dispatch(num_tokens_per_expert: torch.Tensor, *, num_tokens: int, group_ep: GroupEp,
                        ep_rank_size: int, ep_rank_id: int) -> Tuple[torch.Tensor, ...]:
    """Exchanges per-expert counts so every rank can size and place what it receives.

    Args:
        num_tokens_per_expert: [E] int32, moe_dispatch_layout's count of this rank's pairs per expert.
        num_tokens: this rank's batch size BS.
        group_ep, ep_rank_size (R), ep_rank_id: the expert-parallel group, as fused_deep_moe.

    Returns (E_loc = E / R; entries indexed [e * R + s] are for local expert e and source rank s):
        send_offset [E] int32: exclusive prefix sum of num_tokens_per_expert;
        recv_offset [E] int32: source s's send_offset of this rank's expert e;
        recv_count [E] int32: inclusive prefix sum of the pairs received, by (e, s);
        total_recv_tokens [1] int32: pairs this rank receives (rows of moe_dispatch_normal);
        max_bs [1] int32: the largest batch size of the group;
        recv_tokens_per_expert [E_loc] int64: pairs received per local expert.
    """
    check.argument_types(NOTIFY.name, {"num_tokens_per_expert": num_tokens_per_expert}, {},
                         {"num_tokens": num_tokens, "ep_rank_size": ep_rank_size, "ep_rank_id": ep_rank_id})
    return tuple(torch.ops.cam_jit.moe_notify_dispatch(num_tokens_per_expert, num_tokens,
                                                       group_ep_name(NOTIFY.name, group_ep), ep_rank_size,
                                                       ep_rank_id))


def moe_dispatch_normal(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    send_offset: torch.Tensor,
    send_token_idx: torch.Tensor,
    recv_offset: torch.Tensor,
    recv_count: torch.Tensor,
    *,
    group_ep: GroupEp,
    ep_rank_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    num_recv_tokens: int,
    quant_mode: int = 0,
    global_bs: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sends every routed (token, k) pair to the rank owning expert_ids[t, k].

    Args:
        x: [BS, H] bfloat16/float16 tokens. expert_ids: [BS, K] int32/int64 in [-1, E).
        send_token_idx: [BS, K] int32 from moe_dispatch_layout. send_offset, recv_offset,
            recv_count: [E] int32 from moe_notify_dispatch.
        num_recv_tokens: int(total_recv_tokens) from moe_notify_dispatch (N below).
        quant_mode: 0 sends x.dtype rows; 2 quantises each token to int8 (float32 steps:
            s = 127 / (amax + 1e-12), q = rint(x * s), scale = 1 / s).
        global_bs: 0 or max_bs * R (sizes the NPU kernel's buffers).

    Returns (N rows, by local expert, then source rank, then the source's t*K+k order):
        recv_x [N, H] int8 (quant_mode 2) or x.dtype; recv_scales [N] float32 (dequantisation
        scale per row; zeros for quant_mode 0); assist_info_for_combine [N, 3] int32: (source
        rank, token, k) per row.
    """
    op = DISPATCH.name
    check.argument_types(op, {"x": x, "expert_ids": expert_ids, "send_offset": send_offset,
                              "send_token_idx": send_token_idx, "recv_offset": recv_offset,
                              "recv_count": recv_count}, {},
                         {"ep_rank_size": ep_rank_size, "ep_rank_id": ep_rank_id, "moe_expert_num": moe_expert_num,
                          "num_recv_tokens": num_recv_tokens, "quant_mode": quant_mode, "global_bs": global_bs})
    return tuple(torch.ops.cam_jit.moe_dispatch_normal(
        x, expert_ids, send_offset, send_token_idx, recv_offset, recv_count, group_ep_name(op, group_ep),
        ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs, num_recv_tokens))


def moe_combine_normal(
    recv_x: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    recv_count: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_scales: torch.Tensor,
    *,
    group_ep: GroupEp,
    ep_rank_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    global_bs: int = 0,
) -> torch.Tensor:
    """Sends expert results back to their tokens and forms each token's weighted sum.

    Args:
        recv_x: [N, H] bfloat16/float16 expert results, row for row as moe_dispatch_normal
            returned its recv_x. assist_info_for_combine: [N, 3] int32 and recv_count: [E] int32,
            as dispatched. expert_ids: [BS, K], this rank's routing as dispatched.
        expert_scales: [BS, K] float32 combine weights.
        group_ep, ep_rank_size, ep_rank_id, moe_expert_num, global_bs: as dispatched.

    Returns:
        [BS, H] recv_x.dtype: acc = 0; for k ascending (ids >= 0): acc += f32(result) * weight
        (two float32 roundings per step); rounded once to recv_x.dtype.
    """
    op = COMBINE.name
    check.argument_types(op, {"recv_x": recv_x, "assist_info_for_combine": assist_info_for_combine,
                              "recv_count": recv_count, "expert_ids": expert_ids, "expert_scales": expert_scales},
                         {}, {"ep_rank_size": ep_rank_size, "ep_rank_id": ep_rank_id,
                              "moe_expert_num": moe_expert_num, "global_bs": global_bs})
    return torch.ops.cam_jit.moe_combine_normal(recv_x, assist_info_for_combine, recv_count, expert_ids,
                                                expert_scales, group_ep_name(op, group_ep), ep_rank_size,
                                                ep_rank_id, moe_expert_num, global_bs)
