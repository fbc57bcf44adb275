"""`a2e` and `e2a`: attention <-> expert (AFD) token transfer (docs/semantics.md §2).

One process group of `Er + Ar` ranks: ranks `0 .. Er-1` are expert ranks, ranks `Er .. Er+Ar-1`
attention ranks. Attention rank `a` pairs with expert rank `a % Er` and occupies slot
`a // Er - 1` of it. `a2e` moves each attention rank's tokens (and, with `compute_gate=1`, its
routing ids and scales) into a block of its expert rank's `expand_x`; `e2a` sends blocks of the
expert rank's `expand_x` back.

Public functions, torch.library schemas, argument checks (basic and strict, docs/semantics.md §0.6 / §7.5),
fake kernels and the CPU implementation. The CPU path first all-gathers a few integers per rank
(the sizes every rank must agree on and each rank's batch), so a batch mismatch raises the same
error on every rank instead of corrupting or hanging a transfer; then it moves the rows with
tagged point-to-point sends on the group (docs/semantics.md §2.5, CPU transport), tag = (op, slot, field).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from cam_jit.ops import _checks as check
from cam_jit.ops import _exchange
from cam_jit.ops._registry import OpInfo, define_op
from cam_jit.ops._strict import strict_enabled
from cam_jit.ops.groups import group_ep_name, resolve_group


A2E = OpInfo(
    "a2e",
    "(Tensor x, Tensor? expert_ids, Tensor? scales, int batch_size, int hidden_size, int topk, "
    "int expert_rank_size, int atten_rank_size, int rank, str group_ep, int aiv_num, int compute_gate) -> Tensor[]",
)
E2A = OpInfo(
    "e2a",
    "(Tensor expand_x, Tensor atten_batch_size, int batch_size, int hidden_size, int topk, "
    "int expert_rank_size, int attention_rank_size, int rank, str group_ep, int aiv_num) -> Tensor",
)

OUT_DTYPE = torch.bfloat16  # the upstream wrapper forces bf16 token outputs (docs/semantics.md §2.3)
_TOKEN_DTYPES = (torch.bfloat16, torch.float16)
_TAG_FIELDS = 4  # x/expand_x, expert ids, scales


@dataclasses.dataclass(frozen=True)
class Roles:
    """Rank roles and block layout of one group (docs/semantics.md §2.2): `experts` = Er, `attention` = Ar."""

    experts: int
    attention: int
    rank: int

    @property
    def world(self) -> int:
        return self.experts + self.attention

    @property
    def is_expert(self) -> bool:
        return self.rank < self.experts

    @property
    def blocks(self) -> int:
        """C = ceil(Ar / Er): the block count an expert rank's a2e layout is cut into."""
        return -(-self.attention // self.experts)

    def sources(self, expert: int) -> List[int]:
        """Attention ranks served by `expert`, in slot order (their count is n_e)."""
        return list(range(expert + self.experts, self.world, self.experts))

    def expert_of(self, attention_rank: int) -> int:
        return attention_rank % self.experts

    def slot_of(self, attention_rank: int) -> int:
        return attention_rank // self.experts - 1


def _roles(op: str, expert_rank_size: int, atten_arg: str, atten_rank_size: int, rank: int) -> Roles:
    er, ar = expert_rank_size, atten_rank_size
    if er <= 0:
        check.fail(op, "expert_rank_size", "> 0", er)
    if ar < er:
        check.fail(op, atten_arg, f">= expert_rank_size ({er}): every expert rank serves at least one attention rank",
                   ar)
    if not 0 <= rank < er + ar:
        check.fail(op, "rank", f"0 <= rank < expert_rank_size + {atten_arg} ({er + ar})", rank)
    return Roles(er, ar, rank)


def _sizes(op: str, batch_size: int, hidden_size: int, topk: int) -> None:
    if batch_size < 0:
        check.fail(op, "batch_size", ">= 0", batch_size)
    if hidden_size <= 0:
        check.fail(op, "hidden_size", "> 0", hidden_size)
    if topk <= 0:
        check.fail(op, "topk", "> 0", topk)


def _tokens(op: str, arg: str, t: torch.Tensor, hidden_size: int) -> None:
    check.ndim(op, arg, t, 2)
    check.dtype(op, arg, t, _TOKEN_DTYPES)
    if t.shape[1] != hidden_size:
        check.fail(op, arg, f"shape[1] == hidden_size ({hidden_size})", list(t.shape))


def validate_a2e(x, expert_ids, scales, batch_size, hidden_size, topk, expert_rank_size, atten_rank_size, rank,
                 group_ep, aiv_num, compute_gate) -> Roles:
    """Basic validation of a2e (docs/semantics.md §0.6, §2) on metadata only (works on fake tensors).

    x: [rows, hidden_size] bf16/fp16 on every rank (rows = B_a on attention ranks, ignored on
    expert ranks). expert_ids (int32) / scales (float32): [B_a, topk] on attention ranks with
    compute_gate=1; elsewhere unused, so only their dtype is checked when given.
    """
    op = A2E.name
    roles = _roles(op, expert_rank_size, "atten_rank_size", atten_rank_size, rank)
    _sizes(op, batch_size, hidden_size, topk)
    if compute_gate not in (0, 1):
        check.fail(op, "compute_gate", "0 or 1", compute_gate)
    _tokens(op, "x", x, hidden_size)
    gated_source = compute_gate == 1 and not roles.is_expert
    for arg, t, dtype in (("expert_ids", expert_ids, torch.int32), ("scales", scales, torch.float32)):
        if t is None:
            if gated_source:
                check.fail(op, arg, f"a {check.dtype_name(dtype)} [B_a, topk] tensor on an attention rank with "
                           "compute_gate=1", None)
            continue
        check.dtype(op, arg, t, (dtype,))
        check.device(op, arg, t, x.device)
        if gated_source:
            check.shape(op, arg, t, [x.shape[0], topk], "[x.shape[0], topk]")
    return roles


def validate_e2a(expand_x, atten_batch_size, batch_size, hidden_size, topk, expert_rank_size, attention_rank_size,
                 rank, group_ep, aiv_num) -> Roles:
    """Basic validation of e2a (docs/semantics.md §0.6, §2.4) on metadata only (works on fake tensors).

    expand_x: [batch_size, hidden_size] on expert ranks; [B_a, hidden_size] (the rank's own x)
    on attention ranks; bf16/fp16. atten_batch_size: int32 (a2e's output 3), never read.
    """
    op = E2A.name
    roles = _roles(op, expert_rank_size, "attention_rank_size", attention_rank_size, rank)
    _sizes(op, batch_size, hidden_size, topk)
    _tokens(op, "expand_x", expand_x, hidden_size)
    if roles.is_expert and expand_x.shape[0] != batch_size:
        check.fail(op, "expand_x", f"shape [{batch_size}, {hidden_size}] ([batch_size, hidden_size] on an expert "
                   "rank)", list(expand_x.shape))
    check.dtype(op, "atten_batch_size", atten_batch_size, (torch.int32,))
    check.device(op, "atten_batch_size", atten_batch_size, expand_x.device)
    return roles


# ----------------------------------------------------------------------------------------------
# strict mode (docs/semantics.md §2.5, §7.5)
# ----------------------------------------------------------------------------------------------
def _strict_fail(op: str, arg: str, value: object, text: str) -> None:
    raise ValueError(
        f"{op}: argument '{arg}' = {value}: CAM {op.upper()} PARAMETER INVALID: {text}. CheckData failed. "
        "(strict mode: a limit of the NPU kernel)"
    )


def _strict_checks(op: str, dtype_arg: str, tokens: torch.Tensor, batch_size: int, hidden_size: int, topk: int,
                   expert_rank_size: int, atten_arg: str, atten_rank_size: int, rank: int, aiv_num: int,
                   compute_gate: Optional[int] = None) -> None:
    """The upstream tiling checks, in upstream order, then bf16. The batch checked is the one the
    op uses on this rank: batch_size on expert ranks, tokens.shape[0] on attention ranks."""
    check.ndim(op, dtype_arg, tokens, 2)
    er, ar = expert_rank_size, atten_rank_size
    if not 0 <= rank < er + ar:
        _strict_fail(op, "rank", f"{rank} (expert_rank_size + {atten_arg} = {er + ar})", "rank must >= 0 and < expertRankSize + attentionRankSize")
    if rank < er:
        batch_arg, batch = "batch_size", batch_size
    else:
        batch_arg, batch = f"{dtype_arg}.shape[0]", tokens.shape[0]
    if not 0 < batch <= 1024:
        _strict_fail(op, batch_arg, batch, "batchSize must >= 0 and <= 1024")
    if not (1024 <= hidden_size <= 7168 and hidden_size % 256 == 0):
        _strict_fail(op, "hidden_size", hidden_size, "hiddenSize must >= 1024 and <= 7168 and be divisible by 256")
    if not 1 <= topk <= 8:
        _strict_fail(op, "topk", topk, "topk must >= 1 and <= 8")
    if not 0 < er <= ar:
        _strict_fail(op, "expert_rank_size", f"{er} ({atten_arg} = {ar})",
                     "expertRankSize must > 0 and <= attentionRankSize")
    if not 4 <= aiv_num <= 48:
        _strict_fail(op, "aiv_num", aiv_num, "aivAlgNum must >= 4 and <= 48")
    if compute_gate is not None and compute_gate not in (0, 1):
        _strict_fail(op, "compute_gate", compute_gate, "computeGate must be 0 or 1")
    if tokens.dtype != torch.bfloat16:
        check.fail(op, dtype_arg, "dtype bfloat16 (strict mode: the NPU kernel runs only for bfloat16, float16 "
                   "runs nothing)", check.dtype_name(tokens.dtype), TypeError)


# ----------------------------------------------------------------------------------------------
# CPU transport
# ----------------------------------------------------------------------------------------------
def _group(op: str, name: str, roles: Roles, atten_arg: str) -> "dist.ProcessGroup":
    """The group named `name`, which must have Er + Ar ranks with this process at `rank`."""
    return resolve_group(op, name, roles.world, roles.rank, f"expert_rank_size' + '{atten_arg}", "rank")


def _agreed_batches(op: str, group: "dist.ProcessGroup", agreed: Dict[str, int], batch: int) -> List[int]:
    """`_exchange.agree` on `agreed` (argument -> value, the same on every rank) with this rank's
    batch; returns the batches by rank, each checked to be in [0, 2^31)."""
    batches = [row[0] for row in _exchange.agree(op, group, agreed, [batch])]
    bad = {r: b for r, b in enumerate(batches) if not 0 <= b < 2**31}
    if bad:
        raise RuntimeError(f"{op}: rank(s) {sorted(bad)} announced impossible batches {bad}: a peer that does not "
                           "follow the protocol")
    return batches


def _tag(op: OpInfo, slot: int, field: int) -> int:
    return ((0 if op is A2E else 1) << 24) | (slot * _TAG_FIELDS + field)


def _transfer(op: str, group: "dist.ProcessGroup", sends: Sequence[Tuple[torch.Tensor, int, int]],
              recvs: Sequence[Tuple[torch.Tensor, int, int]]) -> None:
    """Posts every (tensor, peer group rank, tag) send and receive, then waits (with the timeout)."""
    works = []
    for t, peer, tag in sends:
        if t.numel():
            works.append((dist.isend(t, dst=dist.get_global_rank(group, peer), group=group, tag=tag), peer))
    for t, peer, tag in recvs:
        if t.numel():
            works.append((dist.irecv(t, src=dist.get_global_rank(group, peer), group=group, tag=tag), peer))
    for work, peer in works:
        _exchange.wait(work, op, f"transfer with rank {peer}", group)


def _a2e_cpu(x, expert_ids, scales, batch_size, hidden_size, topk, expert_rank_size, atten_rank_size, rank,
             group_ep, aiv_num, compute_gate):
    roles = validate_a2e(**locals())
    group = _group(A2E.name, group_ep, roles, "atten_rank_size")
    agreed = dict(expert_rank_size=expert_rank_size, atten_rank_size=atten_rank_size, hidden_size=hidden_size,
                  topk=topk, compute_gate=compute_gate)
    batches = _agreed_batches(A2E.name, group, agreed, batch_size if roles.is_expert else x.shape[0])
    blocks = roles.blocks
    for a in range(roles.experts, roles.world):
        e = roles.expert_of(a)
        if batches[a] != batches[e] // blocks:
            check.fail(A2E.name, "x", f"x.shape[0] == {batches[e] // blocks} on attention rank {a} (batch_size "
                       f"{batches[e]} of its expert rank {e} // ceil(atten_rank_size / expert_rank_size) = {blocks})",
                       f"{batches[a]} rows")
    gate = compute_gate == 1
    if not roles.is_expert:
        e, slot = roles.expert_of(rank), roles.slot_of(rank)
        sends = [(x.to(OUT_DTYPE).contiguous(), e, _tag(A2E, slot, 0))]
        if gate:
            sends += [(expert_ids.contiguous(), e, _tag(A2E, slot, 1)), (scales.contiguous(), e, _tag(A2E, slot, 2))]
        _transfer(A2E.name, group, sends, [])
        return [torch.zeros(1, 1, dtype=OUT_DTYPE), torch.zeros(1, 1, dtype=torch.int32),
                torch.zeros(1, 1, dtype=torch.float32), torch.zeros(blocks, dtype=torch.int32),
                torch.zeros(1, dtype=torch.bool)]
    expand_x = torch.zeros(batch_size, hidden_size, dtype=OUT_DTYPE)
    ids = torch.zeros(batch_size, topk, dtype=torch.int32)
    weights = torch.zeros(batch_size, topk, dtype=torch.float32)
    block = batch_size // blocks  # P, with the undecremented C
    recvs = []
    for slot, a in enumerate(roles.sources(rank)):
        rows = slice(slot * block, (slot + 1) * block)
        recvs.append((expand_x[rows], a, _tag(A2E, slot, 0)))
        if gate:
            recvs += [(ids[rows], a, _tag(A2E, slot, 1)), (weights[rows], a, _tag(A2E, slot, 2))]
    _transfer(A2E.name, group, [], recvs)
    return [expand_x, ids, weights, torch.zeros(blocks, dtype=torch.int32), torch.zeros(batch_size, dtype=torch.bool)]


def _e2a_cpu(expand_x, atten_batch_size, batch_size, hidden_size, topk, expert_rank_size, attention_rank_size, rank,
             group_ep, aiv_num):
    roles = validate_e2a(**locals())
    group = _group(E2A.name, group_ep, roles, "attention_rank_size")
    agreed = dict(expert_rank_size=expert_rank_size, attention_rank_size=attention_rank_size,
                  hidden_size=hidden_size, topk=topk)
    batches = _agreed_batches(E2A.name, group, agreed, expand_x.shape[0])
    for a in range(roles.experts, roles.world):
        e = roles.expert_of(a)
        served = len(roles.sources(e))
        if batches[a] > batches[e] // served:
            check.fail(E2A.name, "expand_x", f"at most {batches[e] // served} rows on attention rank {a} (batch_size "
                       f"{batches[e]} of its expert rank {e} // the {served} attention rank(s) it serves)",
                       f"{batches[a]} rows")
    if not roles.is_expert:
        out = torch.empty(expand_x.shape[0], hidden_size, dtype=OUT_DTYPE)
        _transfer(E2A.name, group, [], [(out, roles.expert_of(rank), _tag(E2A, roles.slot_of(rank), 0))])
        return out
    sources = roles.sources(rank)
    block = batch_size // len(sources)  # Q, with the decremented n_e
    tokens = expand_x.to(OUT_DTYPE).contiguous()
    sends = [(tokens[slot * block: slot * block + batches[a]], a, _tag(E2A, slot, 0)) for slot, a in enumerate(sources)]
    _transfer(E2A.name, group, sends, [])
    return torch.zeros(1, 1, dtype=OUT_DTYPE)


def _a2e_fake(x, expert_ids, scales, batch_size, hidden_size, topk, expert_rank_size, atten_rank_size, rank,
              group_ep, aiv_num, compute_gate):
    roles = validate_a2e(**locals())
    if roles.is_expert:
        x_shape, ids_shape, mask_shape = (batch_size, hidden_size), (batch_size, topk), (batch_size,)
    else:
        x_shape, ids_shape, mask_shape = (1, 1), (1, 1), (1,)
    return [x.new_empty(x_shape, dtype=OUT_DTYPE), x.new_empty(ids_shape, dtype=torch.int32),
            x.new_empty(ids_shape, dtype=torch.float32), x.new_empty((roles.blocks,), dtype=torch.int32),
            x.new_empty(mask_shape, dtype=torch.bool)]


def _e2a_fake(expand_x, atten_batch_size, batch_size, hidden_size, topk, expert_rank_size, attention_rank_size, rank,
              group_ep, aiv_num):
    roles = validate_e2a(**locals())
    shape = (1, 1) if roles.is_expert else (expand_x.shape[0], hidden_size)
    return expand_x.new_empty(shape, dtype=OUT_DTYPE)


define_op(A2E, _a2e_fake, _a2e_cpu)
define_op(E2A, _e2a_fake, _e2a_cpu)


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def _check_python_types(op: str, tensors: Dict[str, object], optional: Dict[str, object], ints: Dict[str, object],
                        strict: object) -> None:
    check.argument_types(op, tensors, optional, ints)
    if strict is not None and not isinstance(strict, bool):
        check.fail(op, "strict", "None or a bool", type(strict).__name__, TypeError)


def a2e(
    x: torch.Tensor,
    expert_ids: Optional[torch.Tensor],
    scales: Optional[torch.Tensor],
    batch_size: int,
    hidden_size: int,
    topk: int,
    expert_rank_size: int,
    atten_rank_size: int,
    rank: int,
    group_ep: Union[str, "dist.ProcessGroup"],
    aiv_num: int,
    compute_gate: int,
    *,
    strict: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention -> expert transfer (docs/semantics.md §2.3). Every rank of the group calls it.

    The group (group_ep) has Er + Ar ranks: 0 .. Er-1 are expert ranks, Er .. Er+Ar-1 attention
    ranks. Attention rank a sends its tokens to expert rank a % Er, which stores them in block
    a // Er - 1 of its expand_x. With C = ceil(Ar / Er), BE = batch_size on the expert rank and
    P = BE // C, block i is rows [i*P, (i+1)*P); an expert rank e serves n_e attention ranks
    (e + Er, e + 2Er, ... < Er + Ar), so with Ar % Er != 0 some expert ranks serve C - 1 and their
    last block stays zero. Uneven ratios follow the formulas of docs/semantics.md §2.4 (see e2a for the way back).

    Args:
        x: [B_a, hidden_size] bfloat16 or float16 tokens on an attention rank, where B_a must be
            P of its expert rank (checked across ranks). On expert ranks it is not read (pass
            e.g. an empty [0, hidden_size] tensor). float16 values are rounded to bfloat16
            (round-half-to-even) before sending: expand_x is always bfloat16.
        expert_ids: [B_a, topk] int32 on attention ranks when compute_gate == 1; otherwise not
            read (None or any int32 tensor).
        scales: [B_a, topk] float32, as expert_ids.
        batch_size: BE on expert ranks; not used on attention ranks (they use x.shape[0]).
        hidden_size: H. topk: K (>= 1). expert_rank_size: Er. atten_rank_size: Ar >= Er.
        rank: this process's rank in group_ep (must equal it).
        group_ep: the process group, or its name (ProcessGroup.group_name, a name given to
            cam_jit.register_group, or "" for the default group); its size must be Er + Ar. On
            NPU tensors the kernel gets the group's HCCL communicator name.
        aiv_num: NPU vector cores; no numerical meaning (strict mode checks 4..48).
        compute_gate: 1 also sends expert_ids and scales; 0 sends only x.
        strict: apply the NPU kernel's limits (docs/semantics.md §2.5/§7.5: batch in (0, 1024], hidden_size in
            [1024, 7168] and % 256, topk in [1, 8], aiv_num in [4, 48], bfloat16 only); None uses
            cam_jit.set_strict / CAM_JIT_STRICT.

    Returns:
        (expand_x, simulate_expert_ids, simulate_expert_scales, atten_batch_size, x_active_mask).
        Expert rank: [BE, H] bfloat16 (blocks as above, other rows zero), [BE, topk] int32 and
        [BE, topk] float32 (the sources' ids and scales in the same blocks when compute_gate == 1,
        zeros otherwise), [C] int32 zeros, [BE] bool zeros (the last two are never written
        upstream). Attention rank: [1, 1] bfloat16, [1, 1] int32, [1, 1] float32, [C] int32,
        [1] bool placeholders, all zeros.
    """
    op = A2E.name
    _check_python_types(
        op, {"x": x}, {"expert_ids": expert_ids, "scales": scales},
        {"batch_size": batch_size, "hidden_size": hidden_size, "topk": topk, "expert_rank_size": expert_rank_size,
         "atten_rank_size": atten_rank_size, "rank": rank, "aiv_num": aiv_num, "compute_gate": compute_gate}, strict)
    name = group_ep_name(op, group_ep)
    if strict_enabled(strict):
        _strict_checks(op, "x", x, batch_size, hidden_size, topk, expert_rank_size, "atten_rank_size",
                       atten_rank_size, rank, aiv_num, compute_gate)
    result = torch.ops.cam_jit.a2e(x, expert_ids, scales, batch_size, hidden_size, topk, expert_rank_size,
                                   atten_rank_size, rank, name, aiv_num, compute_gate)
    return tuple(result)


def e2a(
    expand_x: torch.Tensor,
    atten_batch_size: torch.Tensor,
    batch_size: int,
    hidden_size: int,
    topk: int,
    expert_rank_size: int,
    attention_rank_size: int,
    rank: int,
    group_ep: Union[str, "dist.ProcessGroup"],
    aiv_num: int,
    *,
    strict: Optional[bool] = None,
) -> torch.Tensor:
    """Expert -> attention transfer (docs/semantics.md §2.4), the way back of a2e. Every rank calls it.

    Expert rank e serves n_e attention ranks (e + Er, e + 2Er, ... < Er + Ar) and sends the one
    in slot i rows [i*Q, i*Q + B_a) of its expand_x, where Q = BE // n_e. a2e placed that rank's
    tokens at [i*P, (i+1)*P) with P = BE // ceil(Ar / Er); the two agree when n_e == C or i == 0,
    so a2e followed by e2a on an unchanged expand_x returns every attention rank's x bitwise,
    except, when Ar % Er != 0, for slots i >= 1 of expert ranks serving fewer than C ranks (e.g.
    Er = 2, Ar = 5: rank 5) - which is what the NPU kernel does too.

    Args:
        expand_x: on expert ranks [batch_size, hidden_size] (normally a2e's expand_x after expert
            compute); on attention ranks the rank's own x, [B_a, hidden_size], of which only B_a
            is used (B_a <= Q of its expert rank, checked across ranks). bfloat16 or float16
            (float16 is rounded to bfloat16).
        atten_batch_size: int32 tensor (a2e's output 3); accepted, never read.
        batch_size: BE on expert ranks; not used on attention ranks.
        hidden_size: H. topk: K (>= 1, unused). expert_rank_size: Er.
        attention_rank_size: Ar >= Er. rank, group_ep, aiv_num: as in a2e.
        strict: as in a2e (the batch checked on attention ranks is expand_x.shape[0]).

    Returns:
        Attention rank: [B_a, hidden_size] bfloat16, the rows its expert rank sent. Expert rank:
        a [1, 1] bfloat16 zero placeholder.
    """
    op = E2A.name
    _check_python_types(
        op, {"expand_x": expand_x, "atten_batch_size": atten_batch_size}, {},
        {"batch_size": batch_size, "hidden_size": hidden_size, "topk": topk, "expert_rank_size": expert_rank_size,
         "attention_rank_size": attention_rank_size, "rank": rank, "aiv_num": aiv_num}, strict)
    name = group_ep_name(op, group_ep)
    if strict_enabled(strict):
        _strict_checks(op, "expand_x", expand_x, batch_size, hidden_size, topk, expert_rank_size,
                       "attention_rank_size", attention_rank_size, rank, aiv_num)
    return torch.ops.cam_jit.e2a(expand_x, atten_batch_size, batch_size, hidden_size, topk, expert_rank_size,
                                 attention_rank_size, rank, name, aiv_num)
