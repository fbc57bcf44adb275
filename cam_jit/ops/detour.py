"""`all2_all_detour` and `reduce_scatter_detour` over a CAM communicator (docs/semantics.md §3).

`commRankIds` lists the communicator ranks taking part (the members); its order is the chunk
order. The other ranks of the communicator are detour ranks: on the NPU their memory relays
pieces of the traffic, on CPU they do nothing and return zeros of the output shape. Every rank of
the communicator calls the op (each call takes one magic number, docs/semantics.md §3.1).

CPU transport: the members exchange chunks with tagged point-to-point sends on the
communicator's gloo group. A fixed-size header goes first (op, dtype, numel, reduce op, magic,
member list digest), so members that disagree raise a `ValueError` instead of corrupting or
killing a transfer. Waits use CAM_JIT_COMM_TIMEOUT; after a timeout, free and recreate the
communicator.

Choices where upstream leaves room (docs/semantics.md §3, §8):
* reduce_scatter_detour output shape: the wrapper's (dim 0 divided by G = len(commRankIds)),
  for the fake kernel too (§3.3, §8.10).
* op = 1 (MUL) raises NotImplementedError: upstream never implemented it and returns one
  member's chunk (§3.3).
* all2_all_detour: the tail [G*c, L) of the output is zero; strict mode rejects L % G != 0.
* Only float16/bfloat16/float32/int32 reach all2_all_detour (upstream runs its int32 kernel on any
  other dtype, which moves the wrong number of bytes); others raise TypeError.
* A rejected call does not take a magic number (upstream takes it before its tiling checks).
"""
from __future__ import annotations

import datetime
import time
import zlib
from typing import List, Optional, Sequence, Tuple

import torch

from cam_jit.ops import _checks as check
from cam_jit.ops import _exchange
from cam_jit.ops._registry import OpInfo, define_op
from cam_jit.ops._strict import strict_enabled
from cam_jit.ops.comm import (COMM_ARGS_NUMEL, Communicator, cam_get_and_increase_magic, check_comm_args,
                              check_comm_id, communicator)

ALL2ALL = OpInfo("all2_all_detour",
                 "(Tensor sendData, Tensor commRankIds, Tensor commArgs, int commId) -> Tensor")
REDUCE_SCATTER = OpInfo("reduce_scatter_detour",
                        "(Tensor sendData, Tensor commRankIds, Tensor commArgs, int commId, int op) -> Tensor")

ALL2ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32)
REDUCE_SCATTER_DTYPES = (torch.float16,)
SUM, MUL, MAX, MIN = 0, 1, 2, 3
_FOLD = {SUM: torch.add, MAX: torch.maximum, MIN: torch.minimum}
REDUCE_SCATTER_MAX_RANKS = 16  # tiling limit, strict mode (docs/semantics.md §3.3, §7.5)
# aclDataType numbers: the dtype field of the member header.
_ACL_DTYPE = {torch.float32: 0, torch.float16: 1, torch.int8: 2, torch.int32: 3, torch.uint8: 4, torch.int16: 6,
              torch.int64: 9, torch.float64: 11, torch.bool: 12, torch.bfloat16: 27}
_HEADER_FIELDS = ("op", "dtype", "numel", "reduce op", "magic", "member count", "member list digest")
_HEADER_TAG, _PAYLOAD_TAG = 0xCA0, 0xCA1


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def validate(info: OpInfo, sendData, commRankIds, commArgs, commId, op: Optional[int] = None) -> int:
    """Basic checks on metadata (works on fake tensors); returns G, the member count."""
    name = info.name
    check_comm_id(name, "commId", commId)
    check.ndim(name, "commRankIds", commRankIds, 1)
    check.dtype(name, "commRankIds", commRankIds, (torch.int32,))
    members = commRankIds.numel()
    if members == 0:
        check.fail(name, "commRankIds", "at least one member rank", "an empty tensor")
    check.dtype(name, "commArgs", commArgs, (torch.float16,))
    check.shape(name, "commArgs", commArgs, [COMM_ARGS_NUMEL], "the tensor returned by cam_get_comm")
    for arg, t in (("commRankIds", commRankIds), ("commArgs", commArgs)):
        if t.device != sendData.device:
            check.fail(name, arg, f"a tensor on {sendData.device} (the device of 'sendData')", t.device)
    if info is ALL2ALL:
        check.dtype(name, "sendData", sendData, ALL2ALL_DTYPES)
        return members
    check.dtype(name, "sendData", sendData, REDUCE_SCATTER_DTYPES)
    if op == MUL:
        raise NotImplementedError(f"{name}: argument 'op': 1 (MUL) is not implemented (upstream never implemented "
                                  "it); use 0 (SUM), 2 (MAX) or 3 (MIN)")
    if op not in _FOLD:
        check.fail(name, "op", "0 (SUM), 2 (MAX) or 3 (MIN)", op)
    if sendData.dim() == 0 or sendData.shape[0] % members:
        check.fail(name, "sendData", f"at least 1-D with shape[0] divisible by len(commRankIds) = {members}",
                   f"shape {list(sendData.shape)}")
    return members


def _members(name: str, commRankIds: torch.Tensor, comm: Communicator) -> List[int]:
    """The member list: unique communicator ranks."""
    members = commRankIds.tolist()
    bad = [r for r in members if not 0 <= r < comm.size]
    if bad:
        check.fail(name, "commRankIds", f"ranks of communicator {comm.comm_id}, in [0, {comm.size})",
                   f"{members} (out of range: {bad})")
    if len(set(members)) != len(members):
        dups = sorted({r for r in members if members.count(r) > 1})
        check.fail(name, "commRankIds", "distinct ranks", f"{members} (repeated: {dups})")
    return members


def _strict_fail(name: str, arg: str, text: str, got: object) -> None:
    raise ValueError(f"{name}: strict: argument '{arg}': {text} (got {got})")


def _check_strict(info: OpInfo, sendData: torch.Tensor, members: int, commId: int) -> None:
    """Strict limits (docs/semantics.md §7.5), after basic validation: reduce_scatter_detour's tiling checks in
    upstream order with upstream texts (its float16 check is basic validation's TypeError);
    all2_all_detour's proposed L % G == 0."""
    numel = sendData.numel()
    if info is ALL2ALL:
        if numel % members:
            _strict_fail(info.name, "sendData", f"numel divisible by len(commRankIds) = {members} (the tail "
                         f"{numel - numel % members}..{numel - 1} would be left unwritten on NPU)", numel)
        return
    size = communicator(info.name, commId, "commId").size
    if numel <= 0:
        _strict_fail(info.name, "sendData", f"sendCount is invalid, only support >=0, but got sendCount={numel}.",
                     f"numel {numel}")
    if not 0 < size <= REDUCE_SCATTER_MAX_RANKS:
        _strict_fail(info.name, "commId", f"rankSize is invalid, only support (0, {REDUCE_SCATTER_MAX_RANKS}], but got "
                     f"rankSize={size}.", f"communicator {commId} of {size} ranks")
    if numel % size:
        _strict_fail(info.name, "sendData", f"inputSize is invalid, inputSize {numel}, rankSize {size}.",
                     f"numel {numel}, not a multiple of the communicator size {size}")


# ----------------------------------------------------------------------------------------------
# CPU transport
# ----------------------------------------------------------------------------------------------
def _wait_all(name: str, comm: Communicator, works: Sequence[Tuple[object, int]], what: str) -> None:
    limit = _exchange.timeout_seconds()
    start = time.monotonic()
    for work, peer in works:
        remaining = max(start + limit - time.monotonic(), 1e-3)
        try:
            work.wait(datetime.timedelta(seconds=remaining))
        except RuntimeError as err:
            raise RuntimeError(
                _exchange.failure_text(name, f"{what} with rank {peer} of communicator {comm.comm_id} (this is rank "
                                             f"{comm.rank} of {comm.size})", start, limit, err)
                + "; every rank must call the detour ops on the communicator in the same order. Free and recreate "
                f"the communicator. Cause: {err}"
            ) from err


def _transfer(name: str, comm: Communicator, members: List[int], me: int, sends: Sequence[torch.Tensor],
              recvs: Sequence[torch.Tensor], tag: int, what: str) -> None:
    """Sends sends[p] to and receives recvs[p] from member p, for every member p != me."""
    works = []
    for p, rank in enumerate(members):
        if p != me and sends[p].numel():
            works.append((comm.group.send([sends[p]], rank, tag), rank))
    for p, rank in enumerate(members):
        if p != me and recvs[p].numel():
            works.append((comm.group.recv([recvs[p]], rank, tag), rank))
    _wait_all(name, comm, works, what)


def _agree(name: str, comm: Communicator, members: List[int], me: int, header: List[int]) -> None:
    """All members must send the same header; every member raises the same kind of error if not."""
    mine = torch.tensor(header, dtype=torch.int64)
    theirs = [torch.empty_like(mine) for _ in members]
    _transfer(name, comm, members, me, [mine] * len(members), theirs, _HEADER_TAG, "header exchange")
    for p, rank in enumerate(members):
        if p != me and not torch.equal(theirs[p], mine):
            got = theirs[p].tolist()
            diff = [f"{field} {a} vs {b}" for field, a, b in zip(_HEADER_FIELDS, header, got) if a != b]
            raise ValueError(
                f"{name}: the members of communicator {comm.comm_id} disagree (this rank {comm.rank} vs rank {rank}: "
                f"{', '.join(diff)}); every rank must call {name} with the same commRankIds, sendData dtype and "
                f"numel, in the same order")


def _prepare(info: OpInfo, sendData, commRankIds, commArgs, commId, op: int = -1):
    """Data checks, then the magic; returns (comm, members, my position or -1, flat sendData)."""
    name = info.name
    comm = communicator(name, commId, "commId")
    check_comm_args(name, "commArgs", comm, commArgs)
    members = _members(name, commRankIds, comm)
    magic = cam_get_and_increase_magic(commId)
    if comm.rank not in members:
        return comm, members, -1, None
    me = members.index(comm.rank)
    flat = sendData.detach().reshape(-1).contiguous()
    digest = zlib.crc32(torch.tensor(members, dtype=torch.int32).numpy().tobytes())
    if len(members) > 1:
        header = [0 if info is ALL2ALL else 1, _ACL_DTYPE[flat.dtype], flat.numel(), op, magic, len(members), digest]
        _agree(name, comm, members, me, header)
    return comm, members, me, flat


def _all2all_cpu(sendData, commRankIds, commArgs, commId):
    validate(ALL2ALL, sendData, commRankIds, commArgs, commId)
    comm, members, me, flat = _prepare(ALL2ALL, sendData, commRankIds, commArgs, commId)
    out = torch.zeros_like(sendData, memory_format=torch.contiguous_format)
    if me < 0:
        return out
    groups = len(members)
    chunk = flat.numel() // groups
    out_flat = out.view(-1)
    sends = [flat[p * chunk:(p + 1) * chunk] for p in range(groups)]
    recvs = [out_flat[p * chunk:(p + 1) * chunk] for p in range(groups)]
    recvs[me].copy_(sends[me])
    _transfer(ALL2ALL.name, comm, members, me, sends, recvs, _PAYLOAD_TAG, "chunk exchange")
    return out


def _reduce_scatter_cpu(sendData, commRankIds, commArgs, commId, op):
    groups = validate(REDUCE_SCATTER, sendData, commRankIds, commArgs, commId, op)
    out_shape = (sendData.shape[0] // groups, *sendData.shape[1:])
    comm, members, me, flat = _prepare(REDUCE_SCATTER, sendData, commRankIds, commArgs, commId, op)
    if me < 0:
        return sendData.new_zeros(out_shape)
    length = flat.numel() // groups
    sends = [flat[p * length:(p + 1) * length] for p in range(groups)]
    recvs = [sends[me] if p == me else torch.empty_like(sends[me]) for p in range(groups)]
    _transfer(REDUCE_SCATTER.name, comm, members, me, sends, recvs, _PAYLOAD_TAG, "chunk exchange")
    fold = _FOLD[op]
    acc = recvs[me].to(torch.float32)  # own chunk first, then members me+1, me+2, ... (mod G)
    for i in range(1, groups):
        acc = fold(acc, recvs[(me + i) % groups].to(torch.float32))
    return acc.to(torch.float16).view(out_shape)


def _all2all_fake(sendData, commRankIds, commArgs, commId):
    validate(ALL2ALL, sendData, commRankIds, commArgs, commId)
    return torch.empty_like(sendData, memory_format=torch.contiguous_format)


def _reduce_scatter_fake(sendData, commRankIds, commArgs, commId, op):
    groups = validate(REDUCE_SCATTER, sendData, commRankIds, commArgs, commId, op)
    return sendData.new_empty((sendData.shape[0] // groups, *sendData.shape[1:]))


for _info, _fake, _cpu in ((ALL2ALL, _all2all_fake, _all2all_cpu),
                           (REDUCE_SCATTER, _reduce_scatter_fake, _reduce_scatter_cpu)):
    define_op(_info, _fake, _cpu)


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def _check_types(name: str, sendData, commRankIds, commArgs, ints, strict) -> None:
    for arg, value in (("sendData", sendData), ("commRankIds", commRankIds), ("commArgs", commArgs)):
        check.tensor(name, arg, value)
    for arg, value in ints:
        check.integer(name, arg, value)
    if strict is not None and not isinstance(strict, bool):
        check.fail(name, "strict", "None or a bool", type(strict).__name__, TypeError)


def all2_all_detour(sendData: torch.Tensor, commRankIds: torch.Tensor, commArgs: torch.Tensor, commId: int, *,
                    strict: Optional[bool] = None) -> torch.Tensor:
    """All-to-all with equal splits among the members `commRankIds` of CAM communicator `commId`.

    Every rank of the communicator calls it, members and detour (non-member) ranks alike. With
    G = len(commRankIds), L = sendData.numel() and c = L // G, member i's output elements
    [p*c, (p+1)*c) are member p's sendData elements [i*c, (i+1)*c) (flat, row-major); the tail
    [G*c, L) is zero. Non-members return zeros.

    Args:
        sendData: any shape, float16, bfloat16, float32 or int32; the same numel and dtype on
            every member.
        commRankIds: [G] int32, distinct communicator ranks; their order is the chunk order.
        commArgs: the [597740] float16 tensor cam_get_comm(commId, ...) returned.
        commId: the communicator slot, 0 .. 63.
        strict: also apply the NPU limits (L % G == 0); None follows cam_jit.set_strict /
            CAM_JIT_STRICT.

    Returns:
        A tensor of sendData's shape and dtype.
    """
    _check_types(ALL2ALL.name, sendData, commRankIds, commArgs, (("commId", commId),), strict)
    if strict_enabled(strict):
        members = validate(ALL2ALL, sendData, commRankIds, commArgs, commId)
        _check_strict(ALL2ALL, sendData, members, commId)
    return torch.ops.cam_jit.all2_all_detour(sendData, commRankIds, commArgs, commId)


def reduce_scatter_detour(sendData: torch.Tensor, commRankIds: torch.Tensor, commArgs: torch.Tensor, commId: int,
                          op: int, *, strict: Optional[bool] = None) -> torch.Tensor:
    """Reduce-scatter among the members `commRankIds` of CAM communicator `commId`.

    Every rank of the communicator calls it. With G = len(commRankIds) and n = numel / G, the
    member at position m returns fp16(acc), where acc = f32(own elements [m*n, (m+1)*n)) folded in
    float32, in this order, with the same elements of member (m+1) % G, (m+2) % G, ..., (m+G-1) % G.
    Non-members return zeros.

    Args:
        sendData: [S, ...] float16 with S divisible by G; the same numel on every member.
        commRankIds: [G] int32, distinct communicator ranks; their order is the chunk order.
        commArgs: the [597740] float16 tensor cam_get_comm(commId, ...) returned.
        commId: the communicator slot, 0 .. 63.
        op: 0 SUM, 2 MAX, 3 MIN (1 MUL raises NotImplementedError).
        strict: also apply the NPU tiling limits (numel > 0, communicator size <= 16, numel
            divisible by the communicator size); None follows cam_jit.set_strict / CAM_JIT_STRICT.

    Returns:
        [S // G, ...] float16.
    """
    _check_types(REDUCE_SCATTER.name, sendData, commRankIds, commArgs, (("commId", commId), ("op", op)), strict)
    if strict_enabled(strict):
        members = validate(REDUCE_SCATTER, sendData, commRankIds, commArgs, commId, op)
        _check_strict(REDUCE_SCATTER, sendData, members, commId)
    return torch.ops.cam_jit.reduce_scatter_detour(sendData, commRankIds, commArgs, commId, op)
