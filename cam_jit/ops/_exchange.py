"""Row exchange between the ranks of a process group (CPU path): uneven `all_to_all_single`
with a timeout, so a missing peer raises instead of hanging (docs/semantics.md §0.1)."""
from __future__ import annotations

import datetime
import os
from typing import List

import torch
import torch.distributed as dist

_DEFAULT_TIMEOUT_S = 300.0


def timeout_seconds() -> float:
    """`CAM_JIT_COMM_TIMEOUT` (seconds), default 300."""
    raw = os.environ.get("CAM_JIT_COMM_TIMEOUT", "")
    if not raw:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"CAM_JIT_COMM_TIMEOUT: expected a positive number of seconds, got {raw!r}")
    return value


def wait(work: "dist.Work", op: str, what: str, group: "dist.ProcessGroup") -> None:
    limit = timeout_seconds()
    try:
        work.wait(timeout=datetime.timedelta(seconds=limit))
    except RuntimeError as err:
        raise RuntimeError(
            f"{op}: {what} over process group {group.group_name!r} (rank {dist.get_rank(group)} of "
            f"{dist.get_world_size(group)}) did not complete within {limit:g} s (CAM_JIT_COMM_TIMEOUT); every rank "
            f"of the group must call {op} in the same order. Cause: {err}"
        ) from err


def exchange_counts(send_counts: torch.Tensor, group: "dist.ProcessGroup", op: str) -> torch.Tensor:
    """send_counts: [R] int64, rows for each destination rank -> [R] int64 rows from each source."""
    recv_counts = torch.empty_like(send_counts)
    wait(dist.all_to_all_single(recv_counts, send_counts, group=group, async_op=True), op, "count exchange", group)
    return recv_counts


def all_to_all_rows(
    send: torch.Tensor, send_counts: List[int], recv_counts: List[int], group: "dist.ProcessGroup", op: str, what: str
) -> torch.Tensor:
    """Send rows `send[sum(send_counts[:d]) : ...]` to rank d; returns the received rows, grouped
    by source rank in rank order. send: [sum(send_counts), *row]."""
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    work = dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group, async_op=True)
    wait(work, op, what, group)
    return recv
