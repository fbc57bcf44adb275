"""The CPU data path of the prefill ("normal") dispatch and combine: the layout arithmetic, the
per-token int8 quantisation of the normal dispatch kernel, and the cross-rank exchanges
(`torch.distributed`, every wait bounded). Tokens travel once per destination rank with their
top-k ids restricted to that rank's experts; the receiver expands them into one row per
(token, k) pair, which is what the NPU kernel writes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from cam_jit.ops import _exchange, _moe_cpu
from cam_jit.ops._checks import dtype_name

_DTYPE_CODES = (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32, torch.int64)
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


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else len(_DTYPE_CODES)


def gather_ints(op: str, group: "dist.ProcessGroup", values: Sequence[int]) -> torch.Tensor:
    """All ranks' `values` as [R, len(values)] int64 (one all_gather)."""
    mine = torch.tensor(list(values), dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _exchange.wait(dist.all_gather(parts, mine, group=group, async_op=True), op, "argument agreement", group)
    return torch.stack(parts)


def require_agreement(op: str, group: "dist.ProcessGroup", shared: Dict[str, object]) -> None:
    """Raises on every rank, naming the argument and each rank's value, unless all ranks of the
    group passed the same `shared` values (ints or dtypes), before any row moves."""
    codes = [dtype_code(v) if isinstance(v, torch.dtype) else int(v) for v in shared.values()]
    table = gather_ints(op, group, codes)
    for column, (name, value) in enumerate(shared.items()):
        got = table[:, column].tolist()
        if len(set(got)) > 1:
            shown = [dtype_name(_DTYPE_CODES[c]) if isinstance(value, torch.dtype) and c < len(_DTYPE_CODES)
                     else c for c in got]
            raise ValueError(f"{op}: argument '{name}': expected the same value on every rank of the group, got "
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))


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


def raise_together(op: str, group: Optional["dist.ProcessGroup"], error: Optional[Exception]) -> None:
    """One flag per rank (all_gather): if any rank found an error before the rows move, every rank
    raises (its own error, or one naming the ranks that failed) instead of waiting for them."""
    if group is None:
        if error is not None:
            raise error
        return
    failed = [r for r, bad in enumerate(gather_ints(op, group, [error is not None])[:, 0].tolist()) if bad]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{op}: rank(s) {failed} of the group rejected their arguments (see their error); "
                           "this rank stops too")
