"""The CPU expert-parallel data path shared by fused_deep_moe and the low-latency
dispatch/combine ops: route (token, k) pairs to the ranks owning their experts, send their
(quantised) rows there, send expert results back, combine (docs/semantics.md §1.8 steps 1 and 5, §1.12).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from cam_jit.ops import _exchange
from cam_jit.ops._kernels import cpu_kernels


@dataclasses.dataclass
class Route:
    """The routed pairs of this rank's active tokens, sorted stably by global expert id (so by
    destination rank, then local expert, then t*K+k). P pairs, R ranks."""

    pos: torch.Tensor  # [P] int64, t*K + k
    token: torch.Tensor  # [P] int64, t
    expert: torch.Tensor  # [P] int64, global expert id
    expert_counts: torch.Tensor  # [E] int64, pairs per global expert
    pair_rows: torch.Tensor  # [BS, K] int64, the pair's index in route order, -1 if not routed
    send_counts: List[int]  # [R] pairs to each rank
    recv_counts: List[int]  # [R] pairs from each rank
    group: Optional["dist.ProcessGroup"]  # None: one rank, nothing leaves the process


@dataclasses.dataclass
class Received:
    """Rows that arrived at this rank's experts, grouped by source rank in rank order, each
    source's rows in its route order. M rows."""

    rows: torch.Tensor  # [M, H] int8 (quantised) or x.dtype
    scale: Optional[torch.Tensor]  # [M] float32 dequantisation scale, None if not quantised
    local_expert: torch.Tensor  # [M] int64
    source_rank: torch.Tensor  # [M] int64
    source_pos: torch.Tensor  # [M] int64, t*K + k on the source rank


def plan_route(op: str, expert_ids: torch.Tensor, active: int, local_experts: int,
               group: Optional["dist.ProcessGroup"], agreed: Optional[Dict[str, object]] = None,
               experts: Optional[int] = None) -> Route:
    """Routes the first `active` rows of expert_ids [BS, K] int32 (validated ids in [-1, E); -1 is
    skipped; E = `experts`, by default local_experts times the group's ranks) in one C++ pass, then
    :func:`exchange_route`."""
    ranks = 1 if group is None else dist.get_world_size(group)
    experts = local_experts * ranks if experts is None else experts
    pairs = cpu_kernels().route_pairs(expert_ids, active, experts)
    return exchange_route(op, pairs, active * expert_ids.shape[1], local_experts, group, agreed)


def exchange_route(op: str, pairs: Sequence[torch.Tensor], most: int, local_experts: int,
                   group: Optional["dist.ProcessGroup"], agreed: Optional[Dict[str, object]] = None) -> Route:
    """The Route of the C++ route_pairs' (pos, token, expert, counts, pair_rows) of at most `most`
    pairs. With a group, exchanges the per-rank pair counts together with `agreed` (what every rank
    must share, see `_exchange.agree`): every rank raises if a peer disagrees or announces
    impossible counts."""
    pos, token, expert, counts, rows = pairs
    if group is None:
        return Route(pos, token, expert, counts, rows, [pos.numel()], [pos.numel()], None)
    send = counts.view(dist.get_world_size(group), local_experts).sum(1).tolist()
    recv = exchange_counts(op, group, send, most, agreed or {})
    return Route(pos, token, expert, counts, rows, send, recv, group)


def exchange_counts(op: str, group: "dist.ProcessGroup", send: List[int], most: int,
                    agreed: Dict[str, object]) -> List[int]:
    """send: [R] rows for each destination rank, at most `most` in all -> [R] rows from each
    source, after `_exchange.agree` on `agreed`. A source whose counts are negative or exceed
    its own bound (a peer that does not follow the protocol) fails the call on every rank."""
    table = _exchange.agree(op, group, agreed, [most, *send])
    for source, (bound, *counts) in enumerate(table):
        if min(counts) < 0 or sum(counts) > bound:
            raise RuntimeError(f"{op}: rank {source} announced row counts {counts} for at most {bound} rows: a peer "
                               "that does not follow the protocol; no rank runs the call")
    me = dist.get_rank(group)
    return [counts[1 + me] for counts in table]


def refuse(op: str, group: Optional["dist.ProcessGroup"], agreed_labels: Sequence[str], error: BaseException) -> None:
    """This rank's own checks failed with `error`: tell the peers in the exchange they are
    waiting in (`plan_route` / `exchange_counts` with the same labels), so they raise at once,
    then raise `error` (directly without a group)."""
    if group is None:
        raise error
    ranks = dist.get_world_size(group)
    try:
        _exchange.agree(op, group, dict.fromkeys(agreed_labels), [0] * (ranks + 1), refused=error)
    except BaseException as exchange_error:
        if exchange_error is error:
            raise
        raise error from exchange_error


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[P, ...] tensor -> [P, row bytes] int8 view."""
    row_elements = math.prod(t.shape[1:])
    return t.contiguous().view(t.shape[0], row_elements).view(torch.int8)


def exchange_columns(op: str, what: str, group: "dist.ProcessGroup", columns: Sequence[torch.Tensor],
                     send_counts: List[int], recv_counts: List[int],
                     meanwhile: Optional[Callable[[], None]] = None) -> List[torch.Tensor]:
    """One all_to_all of several per-row columns (each [P, ...], rows grouped by destination
    rank) packed side by side as bytes; returns the received columns, [M, ...] each. `meanwhile`
    runs while the exchange is in flight."""
    payload = torch.cat([_as_bytes(c) for c in columns], dim=1)
    recv = _exchange.all_to_all_rows(payload, send_counts, recv_counts, group, op, what, meanwhile)
    out, start = [], 0
    for c in columns:
        width = _as_bytes(c[:0]).shape[1]
        out.append(recv[:, start:start + width].contiguous().view(c.dtype).view(-1, *c.shape[1:]))
        start += width
    return out


def send_rows(op: str, route: Route, rows: torch.Tensor, scale: Optional[torch.Tensor],
              local_experts: int, meanwhile: Optional[Callable[[], None]] = None) -> Received:
    """Sends each pair's row (and scale) to the rank owning its expert. rows: [P, H] in route
    order (int8 quantised, or x.dtype); scale: [P] float32 or None. `meanwhile` (e.g. the shared
    expert) runs while the rows are in flight."""
    local = route.expert.remainder(local_experts)
    if route.group is None:
        if meanwhile is not None:
            meanwhile()
        return Received(rows, scale, local, torch.zeros_like(local), route.pos)
    columns = [rows, local.to(torch.int32), route.pos.to(torch.int32)] + ([scale] if scale is not None else [])
    recv = exchange_columns(op, "token dispatch", route.group, columns, route.send_counts, route.recv_counts,
                            meanwhile)
    check_local_experts(op, recv[1], local_experts, sources=route.recv_counts)
    sources = torch.repeat_interleave(torch.arange(len(route.recv_counts)), torch.tensor(route.recv_counts))
    return Received(recv[0], recv[3] if scale is not None else None, recv[1].to(torch.int64), sources,
                    recv[2].to(torch.int64))


def check_local_experts(op: str, local: torch.Tensor, local_experts: int, sources: Sequence[int]) -> None:
    """Local expert ids received from peers must lie in [0, E_loc) before they index weights."""
    if local.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(local))
    if low < 0 or high >= local_experts:
        bad = int(torch.nonzero((local < 0) | (local >= local_experts))[0])
        source = int(torch.searchsorted(torch.tensor(sources).cumsum(0), bad, right=True))
        raise RuntimeError(f"{op}: rank {source} sent a row for local expert {int(local[bad])}, outside [0, "
                           f"{local_experts}): the ranks disagree on moe_expert_num / ep_rank_size")


def return_rows(op: str, route: Route, y: torch.Tensor) -> torch.Tensor:
    """Sends expert results y [M, H] (in Received order) back to their sources; returns [P, H]
    in route order."""
    if route.group is None:
        return y
    return _exchange.all_to_all_rows(y, route.recv_counts, route.send_counts, route.group, op, "result combine")
