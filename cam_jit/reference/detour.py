"""Golden reference of the detour collectives (docs/semantics.md §3.2, §3.3), in plain torch.

Independent of `cam_jit.ops.detour` (point-to-point chunk exchange among the members over a CAM
communicator): here every rank of a `torch.distributed` group all-gathers the whole `sendData` of
every rank, and each rank then evaluates the formulas of docs/semantics.md §3 for its own output. The group's ranks
play the communicator's ranks (rank r of the group = communicator rank r), so every rank of the
group calls the function, members and non-members alike, with the same sendData shape and dtype.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["all2_all_detour", "reduce_scatter_detour"]

_OPS = {0: torch.add, 2: torch.maximum, 3: torch.minimum}


def _gather_all(send: torch.Tensor, group: Optional["dist.ProcessGroup"]) -> List[torch.Tensor]:
    """Every rank's flat sendData, by group rank (gathered as bytes, so any dtype works)."""
    raw = send.reshape(-1).contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, raw, group=group)
    return [p.view(send.dtype) for p in parts]


def all2_all_detour(sendData: torch.Tensor, commRankIds: torch.Tensor,
                    group: Optional["dist.ProcessGroup"] = None) -> torch.Tensor:
    """docs/semantics.md §3.2: member i's output elements [p*c, (p+1)*c) = member p's input elements
    [i*c, (i+1)*c), c = numel // G; tail and non-member outputs zero. Same shape/dtype as sendData."""
    data = _gather_all(sendData, group)
    rank = dist.get_rank(group)
    members = [int(r) for r in commRankIds]
    out = torch.zeros(sendData.numel(), dtype=sendData.dtype)
    if rank in members:
        me = members.index(rank)
        c = sendData.numel() // len(members)
        for p, src in enumerate(members):
            out[p * c:(p + 1) * c] = data[src][me * c:(me + 1) * c]
    return out.view(sendData.shape)


def reduce_scatter_detour(sendData: torch.Tensor, commRankIds: torch.Tensor, op: int,
                          group: Optional["dist.ProcessGroup"] = None) -> torch.Tensor:
    """docs/semantics.md §3.3: member at position m returns fp16 of the float32 fold (SUM 0 / MAX 2 / MIN 3) of
    the members' elements [m*n, (m+1)*n), n = numel // G, starting with its own and continuing with
    members m+1, m+2, ... (mod G). Non-members return zeros. Shape [shape[0] // G, *shape[1:]]."""
    if op == 1:
        raise NotImplementedError("reduce_scatter_detour: op 1 (MUL) is not implemented")
    fold = _OPS[op]
    data = _gather_all(sendData, group)
    rank = dist.get_rank(group)
    members = [int(r) for r in commRankIds]
    groups = len(members)
    shape = (sendData.shape[0] // groups, *sendData.shape[1:])
    if rank not in members:
        return torch.zeros(shape, dtype=torch.float16)
    me = members.index(rank)
    n = sendData.numel() // groups
    order = [members[(me + i) % groups] for i in range(groups)]
    acc = data[order[0]][me * n:(me + 1) * n].float()
    for src in order[1:]:
        acc = fold(acc, data[src][me * n:(me + 1) * n].float())
    return acc.half().view(shape)
