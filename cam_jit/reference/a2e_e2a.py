"""Reference ``a2e`` / ``e2a`` (docs/semantics.md §2.2-§2.4) in plain torch: the spec made executable.

Written from the formulas of docs/semantics.md §2, independently of ``cam_jit.ops.a2e_e2a``:

* ``C = ceil(Ar / Er)``; expert rank ``e`` serves ``n_e = C`` attention ranks when
  ``Ar % Er == 0`` or ``e < Ar % Er``, else ``floor(Ar / Er)``; attention rank ``a`` pairs with
  expert ``a % Er`` in slot ``a // Er - 1``.
* a2e: block ``i`` of expert ``e`` is rows ``[i*P, (i+1)*P)``, ``P = BE // C``.
* e2a: attention rank ``a`` in slot ``i`` gets rows ``[i*Q, i*Q + B_a)`` of its expert's
  ``expand_x``, ``Q = BE // n_e``.

Cross-rank traffic deliberately uses a different scheme from the product (which sends point to
point): every rank all-gathers every rank's rows (padded to the largest) and picks its own.
No argument validation beyond what the formulas need; ``group_ep`` is a ProcessGroup or
``""``/``"world"``/``"default"``.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist

from .fused_deep_moe import _resolve_group

__all__ = ["a2e", "e2a"]

BF16 = torch.bfloat16


def _served(expert: int, experts: int, attention: int) -> int:
    """n_e of docs/semantics.md §2.2."""
    blocks = math.ceil(attention / experts)
    if attention % experts == 0 or expert < attention % experts:
        return blocks
    return attention // experts


def _gather_rows(rows: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's ``rows`` ([n_r, ...]), via one all_gather of the sizes and one of the rows
    zero-padded to the largest n_r."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([rows.shape[0]], dtype=torch.int64), group=group)
    sizes = [int(s) for s in sizes]
    padded = torch.zeros((max(max(sizes), 1), *rows.shape[1:]), dtype=rows.dtype)
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [g[:n] for g, n in zip(gathered, sizes)]


def a2e(x: torch.Tensor, expert_ids: Optional[torch.Tensor], scales: Optional[torch.Tensor], batch_size: int,
        hidden_size: int, topk: int, expert_rank_size: int, atten_rank_size: int, rank: int, group_ep,
        aiv_num: int, compute_gate: int) -> List[torch.Tensor]:
    """Reference a2e; arguments and results as ``cam_jit.a2e`` (results as a list)."""
    er, ar = expert_rank_size, atten_rank_size
    group = _resolve_group(group_ep)
    blocks = math.ceil(ar / er)
    attention_side = rank >= er
    n = x.shape[0] if attention_side else 0
    all_x = _gather_rows(x[:n].to(BF16), group)
    if compute_gate:
        all_ids = _gather_rows(expert_ids[:n] if attention_side else torch.zeros(0, topk, dtype=torch.int32), group)
        all_scales = _gather_rows(scales[:n] if attention_side else torch.zeros(0, topk), group)
    if attention_side:
        return [torch.zeros(1, 1, dtype=BF16), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1),
                torch.zeros(blocks, dtype=torch.int32), torch.zeros(1, dtype=torch.bool)]
    bs = batch_size
    p = bs // blocks
    expand_x = torch.zeros(bs, hidden_size, dtype=BF16)
    ids = torch.zeros(bs, topk, dtype=torch.int32)
    weights = torch.zeros(bs, topk)
    for i in range(_served(rank, er, ar)):
        source = rank + (i + 1) * er
        expand_x[i * p:(i + 1) * p] = all_x[source][:p]
        if compute_gate:
            ids[i * p:(i + 1) * p] = all_ids[source][:p]
            weights[i * p:(i + 1) * p] = all_scales[source][:p]
    return [expand_x, ids, weights, torch.zeros(blocks, dtype=torch.int32), torch.zeros(bs, dtype=torch.bool)]


def e2a(expand_x: torch.Tensor, atten_batch_size: torch.Tensor, batch_size: int, hidden_size: int, topk: int,
        expert_rank_size: int, attention_rank_size: int, rank: int, group_ep, aiv_num: int) -> torch.Tensor:
    """Reference e2a; arguments and result as ``cam_jit.e2a``."""
    er, ar = expert_rank_size, attention_rank_size
    group = _resolve_group(group_ep)
    attention_side = rank >= er
    all_expand = _gather_rows((expand_x[:0] if attention_side else expand_x).to(BF16), group)
    if not attention_side:
        return torch.zeros(1, 1, dtype=BF16)
    expert, slot = rank % er, rank // er - 1
    q = all_expand[expert].shape[0] // _served(expert, er, ar)
    return all_expand[expert][slot * q: slot * q + expand_x.shape[0]].clone()
