"""The CPU data path of the prefill ("normal") dispatch and combine: the layout arithmetic, the
per-token int8 quantisation of the normal dispatch kernel, and the cross-rank exchanges
(`torch.distributed`, every wait bounded). Tokens travel once per destination rank with their
top-k ids restricted to that rank's experts; the receiver expands them into one row per
(token, k) pair, which is what the NPU kernel writes.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from cam_jit.ops import _exchange, _moe_cpu

_EPS = torch.tensor(1e-12, dtype=torch.float32)
_C127 = torch.tensor(127.0, dtype=torch.float32)
_ONE = torch.tensor(1.0, dtype=torch.float32)


def layout(expert_ids: torch.Tensor, experts: int, ranks: int) -> Tuple[torch.Tensor, ...]:
    """expert_ids [BS, K] (values in [-1, E), validated) -> (num_tokens_per_rank [R] int32,
    num_tokens_per_expert [E] int32, is_token_in_rank [BS, R] int32, send_token_idx [BS, K] int32:
    the number of earlier pairs, in row-major (t, k) order, routed to the same expert; -1 for -1)."""
    batch, topk = expert_ids.shape
    flat = expert_ids.reshape(-1).to(torch.int64)
    pos = torch.nonzero(flat >= 0).squeeze(1)
    expert = flat[pos]
    per_expert = torch.bincount(expert, minlength=experts)
    in_rank = torch.zeros(batch, ranks, dtype=torch.int32)
    in_rank[torch.div(pos, max(topk, 1), rounding_mode="floor"), torch.div(expert, experts // ranks,
                                                                           rounding_mode="floor")] = 1
    sorted_expert, order = torch.sort(expert, stable=True)
    first_of_expert = torch.cumsum(per_expert, 0) - per_expert
    send_token_idx = torch.full((batch * topk,), -1, dtype=torch.int32)
    send_token_idx[pos[order]] = (torch.arange(pos.numel()) - first_of_expert[sorted_expert]).to(torch.int32)
    return (in_rank.sum(0, dtype=torch.int32), per_expert.to(torch.int32), in_rank,
            send_token_idx.view(batch, topk))


def quantize_tokens(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The normal dispatch kernel's dynamic int8 quantisation, per row of x [n, H] (float32 steps):
    s = 127 / (amax + 1e-12), q = rint(x * s) int8, scale = 1 / s. Returns (q [n, H] int8,
    scale [n] float32)."""
    v = x.to(torch.float32)
    amax = torch.amax(torch.abs(v), dim=1)
    s = torch.div(_C127, torch.add(amax, _EPS))
    q = torch.round(torch.mul(v, s.unsqueeze(1))).to(torch.int8)
    return q, torch.div(_ONE, s)


def gather_ints(op: str, group: "dist.ProcessGroup", values: Sequence[int]) -> torch.Tensor:
    """All ranks' `values` (the same length on every rank) as [R, len(values)] int64."""
    mine = torch.tensor(list(values), dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _exchange.wait(dist.all_gather(parts, mine, group=group, async_op=True), op, "count exchange", group)
    return torch.stack(parts)


def refuse(op: str, group: Optional["dist.ProcessGroup"], labels: Sequence[str], payload: int,
           error: BaseException) -> None:
    """This rank's own checks failed: joins the peers' `_exchange.agree` (same labels, a payload
    of `payload` ints) as a refusal, so they raise at once, and raises `error`."""
    if group is None:
        raise error
    try:
        _exchange.agree(op, group, dict.fromkeys(labels), [0] * payload, refused=error)
    except BaseException as exchange_error:
        if exchange_error is error:
            raise
        raise error from exchange_error


def check_dispatch_tables(op: str, me: int, tokens: List[List[int]], routing: List[List[int]],
                          local_experts: int) -> None:
    """Raises the same error on every rank unless every rank's notify outputs match what the
    sources send. tokens[s][r]: tokens source s sends to rank r; routing[r]: rank r's [pairs it
    sends, send_offset (E), recv_offset (E), recv_count (E)]."""
    ranks = len(routing)
    experts = ranks * local_experts
    table = torch.tensor(routing, dtype=torch.int64)
    send_offset = table[:, 1:1 + experts]
    per_expert = torch.diff(send_offset, append=table[:, :1])  # [s, g] pairs of source s for expert g
    want_counts = per_expert.view(ranks, ranks, local_experts).permute(1, 2, 0)  # [r, e, s]
    want_offsets = send_offset.view(ranks, ranks, local_experts).permute(1, 2, 0)
    recv_count = table[:, 1 + 2 * experts:]
    got_counts = torch.diff(recv_count, prepend=recv_count.new_zeros(ranks, 1)).view(ranks, local_experts, ranks)
    got_offsets = table[:, 1 + experts:1 + 2 * experts].view(ranks, local_experts, ranks)
    for name, start, bad in (("recv_count", 1 + 2 * experts, (got_counts != want_counts).flatten(1).any(1)),
                             ("recv_offset", 1 + experts, (got_offsets != want_offsets).flatten(1).any(1))):
        if bool(bad[me]):
            raise ValueError(f"{op}: argument '{name}': expected moe_notify_dispatch's {name} for the group's "
                             f"routing, got {routing[me][start:start + experts]}")
        if bool(bad.any()):
            raise ValueError(f"{op}: rank(s) {torch.nonzero(bad).flatten().tolist()} passed a {name} that does not "
                             "match the group's routing (see the error on those ranks), so no rank runs the call")
    sent = torch.tensor(tokens, dtype=torch.int64)  # [s, r]
    pairs = want_counts.sum(1).t()  # [s, r]
    liars = ((sent < 0) | (sent > pairs) | ((pairs > 0) & (sent == 0))).any(1)
    if bool(liars.any()):
        raise RuntimeError(f"{op}: rank(s) {torch.nonzero(liars).flatten().tolist()} announced token counts "
                           f"{tokens} that do not fit their routed pairs {pairs.tolist()}: a peer that does not "
                           "follow the protocol; no rank runs the call")


def check_returns(op: str, table: List[List[int]]) -> None:
    """Raises the same error on every rank unless every rank returns to each source exactly the
    pairs that source dispatched to it. table[r] = [results r returns to each rank (R), pairs r
    dispatched to each rank (R)]."""
    ranks = len(table)
    returned = torch.tensor(table, dtype=torch.int64)[:, :ranks]  # [r, s]
    dispatched = torch.tensor(table, dtype=torch.int64)[:, ranks:]  # [s, r]
    wrong = returned != dispatched.t()
    if bool(wrong.any()):
        raise RuntimeError(f"{op}: rank(s) {sorted(set(torch.nonzero(wrong)[:, 0].tolist()))} would return results "
                           f"{returned.tolist()} for the pairs dispatched to them {dispatched.t().tolist()}; every "
                           "rank must pass its own dispatch's outputs and the expert_ids it dispatched")


def all_to_all_fixed(op: str, what: str, group: "dist.ProcessGroup", send: torch.Tensor) -> torch.Tensor:
    """send [R, n] int64, row d for rank d -> [R, n], row s from rank s."""
    recv = torch.empty_like(send)
    _exchange.wait(dist.all_to_all_single(recv, send.contiguous(), group=group, async_op=True), op, what, group)
    return recv


def exchange(op: str, what: str, group: Optional["dist.ProcessGroup"], columns: List[torch.Tensor],
             send_counts: List[int], recv_counts: List[int]) -> List[torch.Tensor]:
    """Per-row columns grouped by destination rank -> the received columns grouped by source rank
    (unchanged without a group: one rank)."""
    if group is None:
        return columns
    return _moe_cpu.exchange_columns(op, what, group, columns, send_counts, recv_counts)
