"""Reference prefill ("normal") dispatch and combine in plain torch, written from the kernels'
description (docs/semantics.md §9), independently of ``cam_jit.ops.moe_normal``.

Cross-rank traffic deliberately uses a different scheme from the product (which sends each token
once per destination rank and expands it there): every rank all-gathers every rank's tokens,
routing and results, and walks the (local expert, source rank, t, k) loops itself. Works for one
rank without torch.distributed. No argument validation beyond what the formulas need;
``group_ep`` is a ProcessGroup or ``""``/``"world"``/``"default"``.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from .a2e_e2a import _gather_rows
from .fused_deep_moe import _resolve_group, combine

__all__ = ["dispatch_layout", "notify_dispatch", "dispatch_normal", "combine_normal", "quantize_token"]

F32 = torch.float32


def _everyone(rows: torch.Tensor, group_ep, ranks: int) -> List[torch.Tensor]:
    return [rows] if ranks == 1 else _gather_rows(rows, _resolve_group(group_ep))


def dispatch_layout(expert_ids: torch.Tensor, moe_expert_num: int, ep_rank_size: int) -> Tuple[torch.Tensor, ...]:
    """(num_tokens_per_rank [R], num_tokens_per_expert [E], is_token_in_rank [BS, R],
    send_token_idx [BS, K]), all int32, by walking (t, k) in row-major order."""
    per_rank_experts = moe_expert_num // ep_rank_size
    batch, topk = expert_ids.shape
    seen = [0] * moe_expert_num
    in_rank = torch.zeros(batch, ep_rank_size, dtype=torch.int32)
    token_idx = torch.full((batch, topk), -1, dtype=torch.int32)
    for t in range(batch):
        for k in range(topk):
            g = int(expert_ids[t, k])
            if g < 0:
                continue
            token_idx[t, k] = seen[g]
            seen[g] += 1
            in_rank[t, g // per_rank_experts] = 1
    return (in_rank.sum(0).to(torch.int32), torch.tensor(seen, dtype=torch.int32), in_rank, token_idx)


def notify_dispatch(num_tokens_per_expert: torch.Tensor, num_tokens: int, group_ep, ep_rank_size: int,
                    ep_rank_id: int) -> Tuple[torch.Tensor, ...]:
    """(send_offset, recv_offset, recv_count, total_recv_tokens, max_bs, recv_tokens_per_expert)
    from every rank's counts (all-gathered)."""
    counts = num_tokens_per_expert.to(torch.int64)
    experts = counts.numel()
    local = experts // ep_rank_size
    mine = torch.cat([counts, torch.tensor([num_tokens])]).unsqueeze(0)
    table = torch.cat(_everyone(mine, group_ep, ep_rank_size))  # [R, E + 1]
    offsets = torch.zeros_like(table[:, :experts])
    for e in range(1, experts):
        offsets[:, e] = offsets[:, e - 1] + table[:, e - 1]
    recv_offset, recv_count, per_expert = [], [], []
    running = 0
    for e in range(local):
        g = ep_rank_id * local + e
        for s in range(ep_rank_size):
            running += int(table[s, g])
            recv_count.append(running)
            recv_offset.append(int(offsets[s, g]))
        per_expert.append(int(table[:, g].sum()))
    i32 = torch.int32
    return (offsets[ep_rank_id].to(i32), torch.tensor(recv_offset, dtype=i32), torch.tensor(recv_count, dtype=i32),
            torch.tensor([running], dtype=i32), torch.tensor([int(table[:, experts].max())], dtype=i32),
            torch.tensor(per_expert, dtype=torch.int64))


def quantize_token(row: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token [H] -> (q [H] int8, scale [] float32): s = 127 / (max|row| + 1e-12), q = rint(row * s),
    scale = 1 / s, every step in float32."""
    v = row.to(F32)
    s = torch.tensor(127.0, dtype=F32) / (v.abs().max() + torch.tensor(1e-12, dtype=F32))
    return torch.round(v * s).to(torch.int8), torch.tensor(1.0, dtype=F32) / s


def dispatch_normal(x: torch.Tensor, expert_ids: torch.Tensor, group_ep, ep_rank_size: int, ep_rank_id: int,
                    moe_expert_num: int, quant_mode: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(recv_x [N, H], recv_scales [N] float32, assist_info_for_combine [N, 3] int32): every pair
    routed to this rank, by local expert, then source rank, then t, then k."""
    local = moe_expert_num // ep_rank_size
    all_x = _everyone(x, group_ep, ep_rank_size)
    all_ids = _everyone(expert_ids.to(torch.int64), group_ep, ep_rank_size)
    rows, scales, assist = [], [], []
    for e in range(local):
        g = ep_rank_id * local + e
        for s in range(ep_rank_size):
            for t in range(all_ids[s].shape[0]):
                for k in range(all_ids[s].shape[1]):
                    if int(all_ids[s][t, k]) != g:
                        continue
                    if quant_mode == 2:
                        q, a = quantize_token(all_x[s][t])
                    else:
                        q, a = all_x[s][t], torch.tensor(0.0)
                    rows.append(q)
                    scales.append(a)
                    assist.append([s, t, k])
    out_dtype = torch.int8 if quant_mode == 2 else x.dtype
    recv_x = torch.stack(rows) if rows else torch.zeros(0, x.shape[1], dtype=out_dtype)
    return (recv_x, torch.stack(scales) if scales else torch.zeros(0),
            torch.tensor(assist, dtype=torch.int32).reshape(-1, 3))


def combine_normal(recv_x: torch.Tensor, assist_info_for_combine: torch.Tensor, expert_ids: torch.Tensor,
                   expert_scales: torch.Tensor, group_ep, ep_rank_size: int, ep_rank_id: int) -> torch.Tensor:
    """[BS, H]: each token's results (all-gathered from every rank, found by their assist triple)
    summed over k ascending with its weights (the float32 combine of fused_deep_moe)."""
    all_rows = _everyone(recv_x, group_ep, ep_rank_size)
    all_assist = _everyone(assist_info_for_combine, group_ep, ep_rank_size)
    batch, topk = expert_ids.shape
    results = torch.zeros(batch, topk, recv_x.shape[1], dtype=recv_x.dtype)
    for rows, assist in zip(all_rows, all_assist):
        for row, (source, t, k) in zip(rows, assist.tolist()):
            if source == ep_rank_id:
                results[t, k] = row
    return combine(results, expert_ids, expert_scales, recv_x.dtype)
