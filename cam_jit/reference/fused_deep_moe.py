"""Golden "small ops" reference of ``fused_deep_moe`` (docs/semantics.md §1): the spec made executable.

Every numbered step of docs/semantics.md §1.8 is one float32 torch op, one rounding each, no fused ops:

* Step 1 (source rank)  ``v = f32(x) [* smooth[g]]``; ``amax = max|v|``; ``s_q = 127/amax``;
  ``q = rint(v*s_q)``; ``a = 1/s_q``.
* Step 2 (expert rank)  W8A8: ``d = (f32(q@W1) * s1) * a``;
  W4A8: ``d = (((f32(hi@W1)*s1)*16 + f32(lo@W1)*s1) + bias1) * a``;
  gate ``G = d / (exp(-d) + 1)`` (three ops), up ``U = d``.
* Step 3  ``h = G*U``; ``m = max|h|``; ``q2 = rint((h*127) * (1/m))``; ``b = m * f32(1/127)``.
* Step 4  ``y = cast_x((f32(q2@W2) * s2) * b)`` (W4A8: ``(((hi..)*s2)*16 + (lo..)*s2) + bias2``).
* Step 5 (source rank)  ``acc = 0; for k ascending, id >= 0: acc = acc + f32(y_k) * w_k``;
  ``out = cast_x(acc)``.

Integer GEMMs are computed exactly with float64 matmul (every partial sum < 2^53) and rounded once
to float32 (RNE, same as int32 -> float32). Degenerate ``amax == 0`` / ``m == 0`` rows quantize to
zeros with a zero scale (§1.11).

Cross-rank traffic deliberately uses a different scheme from the product (which uses
``all_to_all_single``): every rank all-gathers all ranks' quantized pairs, computes the expert
results ``y`` for the pairs that target its local experts, and an ``all_reduce(SUM)`` over a
zero-initialised ``[R, max_bs, K, H]`` float32 buffer (each pair written by exactly one rank, so
the sum is exact) brings every ``y`` back to its source rank, which combines its own rows.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from ._int4 import unpack_int4

__all__ = ["fused_deep_moe", "quantize_rows", "dequant_gemm", "gmm1_stage", "swiglu_requant",
           "gmm2_stage", "expert_ffn", "combine"]

F32 = torch.float32
_C127 = torch.tensor(127.0, dtype=F32)
_INV127 = torch.tensor(1.0 / 127.0, dtype=F32)  # f32(1/127) == 0.007874015718698502
_ONE = torch.tensor(1.0, dtype=F32)
_SIXTEEN = torch.tensor(16.0, dtype=F32)

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


# ----------------------------------------------------------------------------------------------
# argument normalisation
# ----------------------------------------------------------------------------------------------
def _stacked(arg: TensorOrList, e_loc: int, ndim: int, name: str) -> torch.Tensor:
    """Normalise a §1.3 weight container to one stacked tensor ``[E_loc, *per_expert]``.

    ``ndim`` is the per-expert rank (2 for weights, 1 for scales/biases).
    """
    items = [arg] if isinstance(arg, torch.Tensor) else list(arg)
    if len(items) == 1:
        t = items[0]
        if t.dim() == ndim + 1:
            stacked = t
        elif t.dim() == ndim and e_loc == 1:
            stacked = t.unsqueeze(0)
        else:
            raise ValueError(f"{name}: expected a {ndim + 1}-D stacked tensor for E_loc={e_loc}, "
                             f"got shape {tuple(t.shape)}")
    elif len(items) == e_loc:
        if any(t.dim() != ndim for t in items):
            raise ValueError(f"{name}: per-expert tensors must be {ndim}-D")
        stacked = torch.stack(list(items))
    else:
        raise ValueError(f"{name}: list of length {len(items)} does not match E_loc={e_loc}")
    if stacked.shape[0] != e_loc:
        raise ValueError(f"{name}: leading dim {stacked.shape[0]} != E_loc={e_loc}")
    return stacked


def _squeeze_lead(t: Optional[torch.Tensor], ndim: int) -> Optional[torch.Tensor]:
    """Drop ``[1, ...]`` leading dims of the shared tensors down to ``ndim`` dims."""
    while t is not None and t.dim() > ndim and t.shape[0] == 1:
        t = t[0]
    return t


def _absent(arg) -> bool:
    """A bias container is absent when None or an empty list."""
    return arg is None or (not isinstance(arg, torch.Tensor) and len(arg) == 0)


def _resolve_group(group_ep):
    import torch.distributed as dist

    if group_ep is None or (isinstance(group_ep, str) and group_ep in ("", "world", "default")):
        return dist.group.WORLD
    if isinstance(group_ep, dist.ProcessGroup):
        return group_ep
    raise ValueError(f"group_ep: expected a ProcessGroup or ''/'world'/'default', got {group_ep!r}")


# ----------------------------------------------------------------------------------------------
# the numbered steps of docs/semantics.md §1.8 (all float32, one rounding per op)
# ----------------------------------------------------------------------------------------------
def quantize_rows(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step 1.3-1.6: per-row dynamic int8 quantization.

    Args:
        v: float32 ``[n, H]`` (already smoothed if applicable).
    Returns:
        ``(q int8 [n, H], a float32 [n])`` with ``v ~= q * a``; rows with ``amax == 0`` give
        ``q = 0, a = 0`` (§1.11). So do rows whose ``s_q = 127/amax`` overflows to inf (subnormal
        ``amax``; upstream's ``a = 1/inf = 0`` zeroes them anyway, only ``q`` is made defined).
    """
    amax = torch.amax(torch.abs(v), dim=1) if v.shape[1] else torch.zeros(v.shape[0], dtype=F32)
    s_q = torch.div(_C127, amax)
    q = torch.round(torch.mul(v, s_q.unsqueeze(1)))
    a = torch.div(_ONE, s_q)
    zero = torch.isposinf(s_q)  # amax == 0 (or subnormal): zero row, zero scale
    q = torch.where(zero.unsqueeze(1), torch.zeros_like(q), q)
    a = torch.where(zero, torch.zeros_like(a), a)
    return q.to(torch.int8), a


def _int_gemm(lhs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact integer ``lhs @ w`` rounded once to float32 (RNE)."""
    return torch.matmul(lhs.to(torch.float64), w.to(torch.float64)).to(F32)


def dequant_gemm(q: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """GMM + per-column dequant, before the per-token scale (Step 2.1-2.3 / 4.1-4.2, §1.9).

    Args:
        q: int8 ``[n, K_in]`` activations.
        w: int8 ``[K_in, N]`` (W8A8) or unpacked int4-valued int8 ``[K_in, N]`` (W4A8).
        s: float32 ``[N]`` per-column scale.
        bias: ``None`` for W8A8; float32 ``[N]`` compensation bias for W4A8.
    Returns:
        float32 ``[n, N]``: W8A8 ``f32(q@w) * s``;
        W4A8 ``((f32(hi@w)*s)*16 + f32(lo@w)*s) + bias`` with ``hi = floor(q/16)``,
        ``lo = (q & 15) - 8``.
    """
    if bias is None:
        return torch.mul(_int_gemm(q, w), s)
    hi = torch.div(q, 16, rounding_mode="floor")
    lo = torch.sub(torch.bitwise_and(q, 15), 8)
    part_hi = torch.mul(torch.mul(_int_gemm(hi, w), s), _SIXTEEN)
    part_lo = torch.mul(_int_gemm(lo, w), s)
    return torch.add(torch.add(part_hi, part_lo), bias)


def swiglu_requant(d: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step 2.5-2.6 and Step 3: SiLU(gate) * up, then per-row int8 requantization.

    Args:
        d: float32 ``[n, 2I]`` (token scale already applied); gate = columns ``< I``.
    Returns:
        ``(q2 int8 [n, I], b float32 [n])``; rows with ``m == 0`` give zeros and ``b = 0``
        (§1.11). So do rows whose ``1/m`` overflows to inf (subnormal ``m``, i.e. ``m == 0`` on
        flush-to-zero hardware); otherwise ``q2`` would be an undefined cast of inf.
    """
    inter = d.shape[1] // 2
    gate = d[:, :inter].contiguous()
    up = d[:, inter:].contiguous()
    u = torch.exp(torch.neg(gate).contiguous())
    u = torch.add(u, _ONE)
    g = torch.div(gate, u)
    h = torch.mul(g, up)
    m = torch.amax(torch.abs(h), dim=1) if inter else torch.zeros(h.shape[0], dtype=F32)
    inv_m = torch.div(_ONE, m)
    q2 = torch.round(torch.mul(torch.mul(h, _C127), inv_m.unsqueeze(1)))
    b = torch.mul(m, _INV127)
    zero = torch.isposinf(inv_m)  # m == 0 (or subnormal): zero row, zero scale
    q2 = torch.where(zero.unsqueeze(1), torch.zeros_like(q2), q2)
    b = torch.where(zero, torch.zeros_like(b), b)
    return q2.to(torch.int8), b


def gmm1_stage(q: torch.Tensor, a: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
               b1: Optional[torch.Tensor]) -> torch.Tensor:
    """Step 2.1-2.4 (§1.9 for W4A8): ``d = dequant_gemm(q, w1, s1, b1) * a`` per token.

    Args:
        q: int8 ``[n, H]``; a: float32 ``[n]``; w1: int-valued ``[H, 2I]``; s1: float32 ``[2I]``;
        b1: float32 ``[2I]`` (W4A8) or None (W8A8).
    Returns:
        float32 ``[n, 2I]``.
    """
    return torch.mul(dequant_gemm(q, w1, s1, b1), a.unsqueeze(1))


def gmm2_stage(q2: torch.Tensor, b: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
               b2: Optional[torch.Tensor]) -> torch.Tensor:
    """Step 4.1-4.2 before the cast: ``dequant_gemm(q2, w2, s2, b2) * b`` per token.

    Args:
        q2: int8 ``[n, I]``; b: float32 ``[n]``; w2: int-valued ``[I, H]``; s2: float32 ``[H]``;
        b2: float32 ``[H]`` (W4A8) or None (W8A8).
    Returns:
        float32 ``[n, H]`` (``y`` before ``cast_x``).
    """
    return torch.mul(dequant_gemm(q2, w2, s2, b2), b.unsqueeze(1))


def expert_ffn(q: torch.Tensor, a: torch.Tensor, w1, s1, b1, w2, s2, b2,
               out_dtype: torch.dtype) -> torch.Tensor:
    """Steps 2-4 for the rows of one expert: ``y = cast(gmm2_stage(swiglu_requant(gmm1_stage)))``.

    Args:
        q: int8 ``[n, H]``; a: float32 ``[n]``.
        w1: int-valued ``[H, 2I]``; s1: float32 ``[2I]``; b1: float32 ``[2I]`` or None.
        w2: int-valued ``[I, H]``;  s2: float32 ``[H]``;  b2: float32 ``[H]`` or None.
    Returns:
        ``y`` ``[n, H]`` in ``out_dtype`` (x.dtype).
    """
    q2, b = swiglu_requant(gmm1_stage(q, a, w1, s1, b1))
    return gmm2_stage(q2, b, w2, s2, b2).to(out_dtype)


def combine(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
    """Step 5: ``acc = 0; for k ascending (ids >= 0): acc = acc + f32(y_k) * w_k``.

    Args:
        y: ``[n, K, H]`` expert results (x.dtype values, any float dtype holding them exactly).
        ids: int ``[n, K]``; weights: float32 ``[n, K]``.
    Returns:
        ``[n, H]`` in ``out_dtype``.
    """
    n, k_num, hidden = y.shape
    acc = torch.zeros(n, hidden, dtype=F32)
    for k in range(k_num):
        p = torch.mul(y[:, k, :].to(F32), weights[:, k].to(F32).unsqueeze(1))
        acc = torch.where((ids[:, k] >= 0).unsqueeze(1), torch.add(acc, p), acc)
    return acc.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# the operator
# ----------------------------------------------------------------------------------------------
def _smooth_and_quantize(x: torch.Tensor, ids: torch.Tensor,
                         smooth: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step 1 for every (t, k) pair of ``x [n, H]`` / ``ids [n, K]`` -> ``q [n,K,H]``, ``a [n,K]``.

    Skipped pairs (``id < 0``) get ``q = 0, a = 0``.
    """
    n, k_num = ids.shape
    hidden = x.shape[1]
    v = x.to(F32)
    if smooth is None:
        q_t, a_t = quantize_rows(v)  # independent of k
        q = q_t.unsqueeze(1).expand(n, k_num, hidden).clone()
        a = a_t.unsqueeze(1).expand(n, k_num).clone()
    else:
        g = ids.clamp(min=0).to(torch.int64).reshape(-1)
        vv = torch.mul(v.unsqueeze(1).expand(n, k_num, hidden).reshape(n * k_num, hidden),
                       smooth.to(F32)[g])
        q, a = quantize_rows(vv)
        q, a = q.reshape(n, k_num, hidden), a.reshape(n, k_num)
    skip = ids < 0
    q = torch.where(skip.unsqueeze(2), torch.zeros_like(q), q)
    a = torch.where(skip, torch.zeros_like(a), a)
    return q, a


def _all_gather_padded(t: torch.Tensor, rows: int, pad_value, group, world: int) -> torch.Tensor:
    """Pad dim 0 of ``t`` to ``rows`` and all-gather: returns ``[world, rows, ...]``."""
    import torch.distributed as dist

    padded = torch.full((rows, *t.shape[1:]), pad_value, dtype=t.dtype)
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded.contiguous(), group=group)
    return torch.stack(out)


def fused_deep_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    gmm1_weight: TensorOrList,
    gmm1_weight_scale: TensorOrList,
    gmm2_weight: TensorOrList,
    gmm2_weight_scale: TensorOrList,
    expert_scales: torch.Tensor,
    *,
    share_gmm1_weight: Optional[torch.Tensor] = None,
    share_gmm1_weight_scale: Optional[torch.Tensor] = None,
    share_gmm2_weight: Optional[torch.Tensor] = None,
    share_gmm2_weight_scale: Optional[torch.Tensor] = None,
    expert_smooth_scales: Optional[torch.Tensor] = None,
    share_smooth_scales: Optional[torch.Tensor] = None,
    x_active_mask: Optional[torch.Tensor] = None,
    gmm1_bias: Optional[TensorOrList] = None,
    gmm2_bias: Optional[TensorOrList] = None,
    share_gmm1_bias: Optional[torch.Tensor] = None,
    share_gmm2_bias: Optional[torch.Tensor] = None,
    group_ep="",
    ep_rank_size: int = 1,
    ep_rank_id: int = 0,
    moe_expert_num: int,
    quant_mode: int = 0,
    global_bs: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference ``fused_deep_moe`` (docs/semantics.md §1), CPU, plain float32 torch.

    Args:
        x: ``[BS, H]`` bf16/fp16 local tokens (``BS`` may be 0, may differ per rank).
        expert_ids: int ``[BS, K]`` global expert ids in ``[-1, E)``; ``-1`` is skipped.
        gmm1_weight: §1.3 container of ``[H, 2I]`` int8 (W8A8) or ``[H, 2I/8]`` int32 (W4A8).
        gmm1_weight_scale: container of ``[2I]`` float32 or x.dtype.
        gmm2_weight: container of ``[I, H]`` int8 or ``[I, H/8]`` int32.
        gmm2_weight_scale: container of ``[H]`` float32 or x.dtype.
        expert_scales: float32 ``[BS, K]`` combine weights.
        share_gmm1_weight / _scale, share_gmm2_weight / _scale: optional shared expert
            (``[H, 2Is]``, ``[2Is]``, ``[Is, H]``, ``[H]``; leading ``[1, ...]`` dims allowed).
        expert_smooth_scales: float32 ``[E, H]`` indexed by global expert id; enables smooth quant
            for routed AND shared tokens (§1.2).
        share_smooth_scales: float32 ``[H]``; ignored without ``expert_smooth_scales``.
        x_active_mask: bool ``[BS]``; the first ``sum(mask)`` tokens are active (§1.7).
        gmm1_bias, gmm2_bias: W4A8 containers of float32 ``[2I]`` / ``[H]`` (empty for W8A8).
        share_gmm1_bias, share_gmm2_bias: W4A8 shared biases ``[2Is]`` / ``[H]``.
        group_ep: a ``torch.distributed.ProcessGroup`` or ``""``/``"world"``/``"default"``/None
            (WORLD); unused when ``ep_rank_size == 1``.
        ep_rank_size, ep_rank_id: ``R`` and ``r``; ``moe_expert_num``: ``E`` (``E % R == 0``).
        quant_mode, global_bs: no numerical effect.
    Returns:
        ``output [BS, H]`` x.dtype (inactive rows zero), ``share_output [BS, H]`` x.dtype (zeros
        without a shared expert), ``expert_token_nums [E_loc]`` int64 (plain counts over all
        ranks' active tokens).
    """
    del quant_mode, global_bs  # no numerical effect (§1.2, §1.7)
    world, rank, n_exp = int(ep_rank_size), int(ep_rank_id), int(moe_expert_num)
    if world < 1 or not 0 <= rank < world or n_exp <= 0 or n_exp % world:
        raise ValueError(f"bad ep_rank_size={world} / ep_rank_id={rank} / moe_expert_num={n_exp}")
    e_loc = n_exp // world
    bs, hidden = x.shape
    k_num = expert_ids.shape[1]
    xdt = x.dtype

    # ---- weights: stacked views; W4A8 unpacked to int4 values ---------------------------------
    w1 = _stacked(gmm1_weight, e_loc, 2, "gmm1_weight")
    w2 = _stacked(gmm2_weight, e_loc, 2, "gmm2_weight")
    s1 = _stacked(gmm1_weight_scale, e_loc, 1, "gmm1_weight_scale").to(F32)
    s2 = _stacked(gmm2_weight_scale, e_loc, 1, "gmm2_weight_scale").to(F32)
    w4a8 = w1.dtype == torch.int32
    if w4a8:
        if _absent(gmm1_bias) or _absent(gmm2_bias):
            raise ValueError("W4A8 (int32 weights) requires gmm1_bias and gmm2_bias")
        w1, w2 = unpack_int4(w1), unpack_int4(w2)
        b1 = _stacked(gmm1_bias, e_loc, 1, "gmm1_bias").to(F32)
        b2 = _stacked(gmm2_bias, e_loc, 1, "gmm2_bias").to(F32)
    else:
        if not (_absent(gmm1_bias) and _absent(gmm2_bias)
                and share_gmm1_bias is None and share_gmm2_bias is None):
            raise ValueError("W8A8 (int8 weights) takes no biases")
        b1 = b2 = None

    # ---- activity (§1.7): prefix of length sum(mask) --------------------------------------------
    active = bs if x_active_mask is None else int(x_active_mask.to(torch.int64).sum())
    ids = expert_ids.to(torch.int64).clone()
    if ids.numel() and int(ids.max()) >= n_exp:
        raise ValueError(f"expert_ids: values must be < moe_expert_num={n_exp}, got {int(ids.max())}")
    ids[active:] = -1  # inactive tokens are not dispatched
    smooth = expert_smooth_scales

    # ---- Step 1 on the source rank ------------------------------------------------------------
    q_src, a_src = _smooth_and_quantize(x, ids, smooth)  # [BS,K,H] int8, [BS,K] f32

    # ---- exchange: everyone sees every rank's pairs -----------------------------------------
    group = None
    if world == 1:
        max_bs = bs
        q_all, a_all, ids_all = q_src.unsqueeze(0), a_src.unsqueeze(0), ids.unsqueeze(0)
    else:
        import torch.distributed as dist

        group = _resolve_group(group_ep)
        if dist.get_world_size(group) != world or dist.get_rank(group) != rank:
            raise ValueError(f"ep_rank_size/ep_rank_id ({world}/{rank}) do not match the group "
                             f"({dist.get_world_size(group)}/{dist.get_rank(group)})")
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([bs], dtype=torch.int64), group=group)
        max_bs = max(int(s) for s in sizes)  # variable batches: pad to the largest
        rows = max(max_bs, 1)
        q_all = _all_gather_padded(q_src, rows, 0, group, world)[:, :max_bs]
        a_all = _all_gather_padded(a_src, rows, 0.0, group, world)[:, :max_bs]
        ids_all = _all_gather_padded(ids, rows, -1, group, world)[:, :max_bs]

    # ---- Steps 2-4 for the pairs that target this rank's experts ------------------------------
    y_buf = torch.zeros(world, max_bs, k_num, hidden, dtype=F32)
    counts = torch.zeros(e_loc, dtype=torch.int64)
    first = rank * e_loc
    for e in range(e_loc):
        sel = ids_all == first + e  # [R, max_bs, K]
        counts[e] = int(sel.sum())
        if counts[e] == 0:
            continue
        y = expert_ffn(q_all[sel], a_all[sel], w1[e], s1[e], None if b1 is None else b1[e],
                       w2[e], s2[e], None if b2 is None else b2[e], xdt)
        y_buf[sel] = y.to(F32)
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(y_buf, op=dist.ReduceOp.SUM, group=group)  # exact: one writer per pair

    # ---- Step 5 on the source rank -------------------------------------------------------------
    output = torch.zeros(bs, hidden, dtype=xdt)
    output[:active] = combine(y_buf[rank, :active], ids[:active], expert_scales[:active], xdt)

    # ---- shared expert (§1.10): all BS local tokens ------------------------------------------
    share_output = torch.zeros(bs, hidden, dtype=xdt)
    if share_gmm1_weight is not None:
        sw1 = _squeeze_lead(share_gmm1_weight, 2)
        sw2 = _squeeze_lead(share_gmm2_weight, 2)
        ss1 = _squeeze_lead(share_gmm1_weight_scale, 1).to(F32)
        ss2 = _squeeze_lead(share_gmm2_weight_scale, 1).to(F32)
        sb1 = sb2 = None
        if sw1.dtype == torch.int32:
            if share_gmm1_bias is None or share_gmm2_bias is None:
                raise ValueError("W4A8 shared expert requires share_gmm1_bias and share_gmm2_bias")
            sw1, sw2 = unpack_int4(sw1), unpack_int4(sw2)
            sb1 = _squeeze_lead(share_gmm1_bias, 1).to(F32)
            sb2 = _squeeze_lead(share_gmm2_bias, 1).to(F32)
        v = x.to(F32)
        if smooth is not None and share_smooth_scales is not None:
            v = torch.mul(v, _squeeze_lead(share_smooth_scales, 1).to(F32))
        q, a = quantize_rows(v)
        share_output = expert_ffn(q, a, sw1, ss1, sb1, sw2, ss2, sb2, xdt)
    return output, share_output, counts
