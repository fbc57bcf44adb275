"""Exchanges between the ranks of a process group (CPU path), each with a timeout so a missing
peer raises instead of hanging (docs/semantics.md §0.1): `agree`, the one place where a multi-rank
op checks that every rank passed what all must share (and learns the peers' counts), and
`all_to_all_rows`, the uneven row exchange."""
from __future__ import annotations

import datetime
import os
import time
import zlib
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from cam_jit.ops import _checks as check

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
    """Waits for `work` at most CAM_JIT_COMM_TIMEOUT; raises RuntimeError saying whether the
    time ran out or a peer dropped its connection (it died or left the group), and when."""
    limit = timeout_seconds()
    start = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=limit))
    except RuntimeError as err:
        raise RuntimeError(failure_text(op, f"{what} over process group {group.group_name!r} (rank "
                                            f"{dist.get_rank(group)} of {dist.get_world_size(group)})",
                                        start, limit, err)
                           + f"; every rank of the group must call {op} in the same order. Cause: {err}") from err


_DROPPED = ("Connection reset", "Connection closed", "Broken pipe", "EOF", "Connection refused", "closed by peer")


def failure_text(op: str, what: str, start: float, limit: float, err: BaseException) -> str:
    """'<op>: <what> ...' for a wait begun at monotonic `start` that failed with `err`: a peer
    that dropped its connection before the time limit is reported as such, with the time."""
    elapsed = time.monotonic() - start
    dropped = any(marker in str(err) for marker in _DROPPED)
    if dropped or elapsed < 0.9 * limit:
        cause = "a peer rank dropped its connection (it exited, crashed or left the group)" if dropped else \
            "the collective failed"
        return (f"{op}: {what} failed after {elapsed:.2f} s of its {limit:g} s limit, at "
                f"{time.strftime('%H:%M:%S')}: {cause}")
    return f"{op}: {what} did not complete within {limit:g} s (CAM_JIT_COMM_TIMEOUT)"


def all_to_all_rows(
    send: torch.Tensor, send_counts: List[int], recv_counts: List[int], group: "dist.ProcessGroup", op: str, what: str,
    meanwhile: Optional[Callable[[], None]] = None,
) -> torch.Tensor:
    """Send rows `send[sum(send_counts[:d]) : ...]` to rank d; returns the received rows, grouped
    by source rank in rank order. send: [sum(send_counts), *row]. `meanwhile` runs while the
    exchange is in flight (the exchange is waited for even if it raises)."""
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    work = dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group, async_op=True)
    try:
        if meanwhile is not None:
            meanwhile()
    finally:
        wait(work, op, what, group)
    return recv


# ---------------------------------------------------------------------------------------------
# rank agreement
# ---------------------------------------------------------------------------------------------
AGREE_MAX_FIELDS = 24  # per op; the vector has a fixed width so that any two ops' exchanges match
_NONE = -(2**62)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool)
_DTYPE_BASE = 2**40  # dtype i is encoded as _DTYPE_BASE + i


def encode_value(value: object) -> int:
    """An agreed value (int, bool, torch.dtype or None) as one int64."""
    if value is None:
        return _NONE
    if isinstance(value, torch.dtype):
        return _DTYPE_BASE + (_DTYPES.index(value) if value in _DTYPES else len(_DTYPES))
    return int(value)


def describe_value(code: int, like: object) -> str:
    """The text of an encoded value, given a value of the same field (`like`) to read it as."""
    if code == _NONE:
        return "None"
    if isinstance(like, torch.dtype) or (like is None and code >= _DTYPE_BASE):
        index = code - _DTYPE_BASE
        return str(_DTYPES[index]).replace("torch.", "") if 0 <= index < len(_DTYPES) else "another dtype"
    return str(bool(code)) if isinstance(like, bool) else str(code)


def _op_code(op: str) -> int:
    return zlib.crc32(op.encode())


def agree(op: str, group: "dist.ProcessGroup", values: Dict[str, object], payload: Sequence[int] = (),
          refused: Optional[BaseException] = None) -> List[List[int]]:
    """The argument agreement of a multi-rank op, in one all_gather over `group`.

    Every rank sends (its op, whether it refused the call, `values`, `payload`): `values` are
    what every rank must share (argument label -> int, bool, torch.dtype or None; at most
    AGREE_MAX_FIELDS, the same labels in the same order on every rank), `payload` the op's own
    per-rank integers (the same length on every rank, e.g. [R] send counts). A rank whose own
    checks failed passes `refused=` (its values may be None) so that its peers raise at once
    instead of waiting; it then raises `refused` itself.

    Returns every rank's payload, by group rank. Raises on every rank, before anything else is
    exchanged: ValueError naming the first label whose values differ and each rank's value, or
    naming the ranks that refused or that called another op; RuntimeError on a timeout.
    """
    if len(values) > AGREE_MAX_FIELDS:
        raise ValueError(f"{op}: {len(values)} agreed values, more than {AGREE_MAX_FIELDS}")
    codes = [encode_value(v) for v in values.values()]
    mine = torch.tensor([_op_code(op), int(refused is not None), *codes,
                         *[0] * (AGREE_MAX_FIELDS - len(codes)), *payload], dtype=torch.int64)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    wait(dist.all_gather(gathered, mine, group=group, async_op=True), op, "argument agreement", group)
    table = torch.stack(gathered).tolist()
    group_text = f"group_ep {group.group_name!r}"
    others = [r for r, row in enumerate(table) if row[0] != table[0][0] or row[0] != _op_code(op)]
    if others:
        raise ValueError(f"{op}: rank(s) {others} of {group_text} called another cam_jit op at this point; every rank "
                         "must call the same ops in the same order")
    if refused is not None:
        raise refused
    failed = [r for r, row in enumerate(table) if row[1]]
    if failed:
        raise ValueError(f"{op}: rank(s) {failed} of {group_text} rejected their arguments (see the error on those "
                         "ranks), so no rank runs the call")
    for column, (label, value) in enumerate(values.items(), start=2):
        by_rank = [row[column] for row in table]
        if len(set(by_rank)) > 1:
            shown = ", ".join(f"{r}: {describe_value(c, value)}" for r, c in enumerate(by_rank))
            check.fail(op, label, f"the same value on all {world} ranks of {group_text}", f"by rank {{{shown}}}")
    return [row[2 + AGREE_MAX_FIELDS:] for row in table]
