"""Deterministic ``fused_deep_moe`` test cases.

Everything is derived from ``seed`` through per-purpose ``torch.Generator`` streams, so any process
(e.g. each rank of a :class:`dist_harness.RankPool`) regenerates exactly the same tensors on its
own. Weights of global expert ``g`` depend only on ``(seed, g)``, never on the rank count, and
tokens of rank ``r`` only on ``(seed, r)``; so a multi-rank case and its single-rank "all experts
local" equivalent (:func:`make_single_rank_case`) hold the same numbers.

Magnitudes are realistic: ``x ~ N(0, 1)``; int8 weights uniform in ``[-127, 127]`` (int4 in
``[-8, 7]``, packed per SPEC §1.5); per-column scales ``~ U(0.5, 1.5) / (sqrt(K_in) * std(W))``
(about 5e-4 .. 2e-3 for int8 at K_in = 128 .. 1024, about 1e-2 for int4), so every GEMM output is
O(1); softmax-like positive ``expert_scales``; distinct expert ids per row.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from cam_jit.reference import pack_int4, w4a8_compensation_bias

__all__ = ["make_case", "make_rank_case", "make_single_rank_case", "rank_rows"]

_W_RANGE = {"w8a8": (-127, 127), "w4a8": (-8, 7)}


def _gen(seed: int, *tags) -> torch.Generator:
    """A generator whose seed is a stable hash of ``(seed, *tags)`` (process independent)."""
    digest = hashlib.sha256(repr((int(seed),) + tuple(tags)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _int_weight(gen, k_in: int, n: int, variant: str) -> torch.Tensor:
    lo, hi = _W_RANGE[variant]
    return torch.randint(lo, hi + 1, (k_in, n), generator=gen, dtype=torch.int8)


def _col_scale(gen, k_in: int, n: int, variant: str) -> torch.Tensor:
    lo, hi = _W_RANGE[variant]
    w_std = math.sqrt(((hi - lo + 1) ** 2 - 1) / 12.0)
    return (torch.rand(n, generator=gen) + 0.5) / (math.sqrt(k_in) * w_std)


def _ffn_weights(seed, tag, hidden: int, inter: int, variant: str, scale_dtype):
    """One expert: (w1, s1, w2, s2, b1, b2); w* in the op's storage format."""
    g = _gen(seed, "ffn", tag)
    w1 = _int_weight(g, hidden, 2 * inter, variant)
    s1 = _col_scale(g, hidden, 2 * inter, variant).to(scale_dtype)
    w2 = _int_weight(g, inter, hidden, variant)
    s2 = _col_scale(g, inter, hidden, variant).to(scale_dtype)
    if variant == "w8a8":
        return w1, s1, w2, s2, None, None
    w1p, w2p = pack_int4(w1), pack_int4(w2)
    return (w1p, s1, w2p, s2, w4a8_compensation_bias(w1p, s1), w4a8_compensation_bias(w2p, s2))


def _bs_list(bs, ranks: int) -> List[int]:
    out = [int(bs)] * ranks if isinstance(bs, int) else [int(b) for b in bs]
    if len(out) != ranks:
        raise ValueError(f"bs: expected {ranks} per-rank sizes, got {out}")
    return out


def _tokens(seed, rank, bs, hidden, experts, topk, dtype, *, minus_one_frac, route_all_to,
            empty_experts):
    """Rank-local tokens: (x [bs,H], expert_ids [bs,K] int32, expert_scales [bs,K] f32)."""
    g = _gen(seed, "tokens", rank)
    x = torch.randn(bs, hidden, generator=g).to(dtype)
    allowed = torch.tensor([e for e in range(experts) if e not in set(empty_experts)],
                           dtype=torch.int64)
    need = topk - (1 if route_all_to is not None else 0)
    if route_all_to is not None:
        allowed = allowed[allowed != route_all_to]
    if need > len(allowed):
        raise ValueError(f"topk={topk} needs more routable experts than {allowed.tolist()}")
    ids = torch.empty(bs, topk, dtype=torch.int64)
    for t in range(bs):
        row = allowed[torch.randperm(len(allowed), generator=g)[:need]]
        if route_all_to is not None:
            pos = int(torch.randint(0, topk, (1,), generator=g))
            row = torch.cat([row[:pos], torch.tensor([route_all_to]), row[pos:]])
        ids[t] = row
    if minus_one_frac > 0 and ids.numel():
        ids[torch.rand(bs, topk, generator=g) < minus_one_frac] = -1
    scales = torch.softmax(torch.randn(bs, topk, generator=g) * 2.0, dim=1).to(torch.float32)
    return x, ids.to(torch.int32), scales


def make_rank_case(
    seed: int,
    rank: int,
    *,
    ranks: int,
    bs: Union[int, Sequence[int]],
    hidden: int,
    inter: int,
    experts: int,
    topk: int,
    dtype: torch.dtype = torch.bfloat16,
    scale_dtype: torch.dtype = torch.float32,
    variant: str = "w8a8",
    share_inter: Optional[int] = None,
    smooth: bool = False,
    share_smooth: Optional[bool] = None,
    active_counts: Optional[Sequence[int]] = None,
    minus_one_frac: float = 0.0,
    per_expert_lists: bool = False,
    route_all_to: Optional[int] = None,
    empty_experts: Sequence[int] = (),
    zero_rows: Sequence[int] = (),
    share_leading_one: bool = False,
    group_ep="",
    global_bs: Optional[int] = None,
) -> Dict:
    """kwargs for ``fused_deep_moe`` on one rank (see :func:`make_case` for the parameters)."""
    if variant not in _W_RANGE:
        raise ValueError(f"variant must be 'w8a8' or 'w4a8', got {variant!r}")
    if experts % ranks:
        raise ValueError(f"experts={experts} not divisible by ranks={ranks}")
    e_loc = experts // ranks
    bsl = _bs_list(bs, ranks)
    x, ids, scales = _tokens(seed, rank, bsl[rank], hidden, experts, topk, dtype,
                             minus_one_frac=minus_one_frac, route_all_to=route_all_to,
                             empty_experts=empty_experts)
    for t in zero_rows:
        if t < x.shape[0]:
            x[t] = 0
    mask = None
    if active_counts is not None:
        mask = torch.arange(bsl[rank]) < int(active_counts[rank])

    experts_w = [_ffn_weights(seed, ("routed", rank * e_loc + e), hidden, inter, variant,
                              scale_dtype) for e in range(e_loc)]
    cols = list(zip(*experts_w))  # w1s, s1s, w2s, s2s, b1s, b2s

    def container(items):
        if per_expert_lists:
            return list(items)  # E_loc 2-D/1-D tensors (E_loc == 1: the single 2-D special case)
        return [torch.stack(list(items))]

    kw = dict(
        x=x, expert_ids=ids,
        gmm1_weight=container(cols[0]), gmm1_weight_scale=container(cols[1]),
        gmm2_weight=container(cols[2]), gmm2_weight_scale=container(cols[3]),
        expert_scales=scales,
        share_gmm1_weight=None, share_gmm1_weight_scale=None,
        share_gmm2_weight=None, share_gmm2_weight_scale=None,
        expert_smooth_scales=None, share_smooth_scales=None,
        x_active_mask=mask,
        gmm1_bias=container(cols[4]) if variant == "w4a8" else [],
        gmm2_bias=container(cols[5]) if variant == "w4a8" else [],
        share_gmm1_bias=None, share_gmm2_bias=None,
        group_ep=group_ep, ep_rank_size=ranks, ep_rank_id=rank, moe_expert_num=experts,
        quant_mode=0, global_bs=max(bsl) * ranks if global_bs is None else global_bs,
    )
    if smooth:
        kw["expert_smooth_scales"] = torch.rand(experts, hidden,
                                                generator=_gen(seed, "smooth")) + 0.5
    if share_inter is not None:
        w1, s1, w2, s2, b1, b2 = _ffn_weights(seed, ("shared",), hidden, share_inter, variant,
                                              scale_dtype)
        if share_leading_one:
            w1, s1, w2, s2 = (t.unsqueeze(0) for t in (w1, s1, w2, s2))
        kw.update(share_gmm1_weight=w1, share_gmm1_weight_scale=s1,
                  share_gmm2_weight=w2, share_gmm2_weight_scale=s2,
                  share_gmm1_bias=b1, share_gmm2_bias=b2)
        if smooth if share_smooth is None else share_smooth:
            kw["share_smooth_scales"] = torch.rand(hidden, generator=_gen(seed, "ssmooth")) + 0.5
    return kw


def make_case(seed: int, *, ranks: int, **params) -> List[Dict]:
    """Per-rank kwargs dicts for ``fused_deep_moe(**case[r])``.

    Args:
        seed: everything is a pure function of it.
        ranks: ``R``; ``experts % ranks == 0``; rank ``r`` gets global experts
            ``r*E_loc .. (r+1)*E_loc - 1``.
        bs: int, or a per-rank list (0 allowed).
        hidden, inter, experts, topk: ``H``, ``I``, ``E``, ``K`` (``K`` may be 0).
        dtype: ``x.dtype`` (bf16/fp16); scale_dtype: float32 or ``dtype`` for all weight scales.
        variant: ``"w8a8"`` (int8 weights) or ``"w4a8"`` (packed int32 + compensation biases).
        share_inter: ``Is`` of a shared expert, None for none; share_leading_one: give the shared
            weights/scales a ``[1, ...]`` leading dim.
        smooth: routed smooth scales ``[E, H]`` (+ shared ``[H]`` when there is a shared expert);
            share_smooth: override whether ``share_smooth_scales`` is passed (default = smooth).
        active_counts: per-rank active-token counts -> prefix ``x_active_mask``; None -> no mask.
        minus_one_frac: fraction of ``(t, k)`` entries replaced by ``-1``.
        per_expert_lists: weight containers as ``E_loc`` per-expert tensors instead of one stacked.
        route_all_to: a global expert that every token selects (in a random column).
        empty_experts: global experts that no token selects.
        zero_rows: local row indices whose ``x`` is all zeros (on every rank that has them).
        group_ep, global_bs: passed through (global_bs default ``max(bs) * ranks``).
    """
    return [make_rank_case(seed, r, ranks=ranks, **params) for r in range(ranks)]


def rank_rows(bs: Union[int, Sequence[int]], ranks: int) -> List[slice]:
    """Row slice of each rank inside the concatenation used by :func:`make_single_rank_case`."""
    bsl = _bs_list(bs, ranks)
    starts = [sum(bsl[:r]) for r in range(ranks)]
    return [slice(s, s + b) for s, b in zip(starts, bsl)]


def make_single_rank_case(seed: int, *, ranks: int, **params) -> Tuple[Dict, List[slice]]:
    """The ``R = 1``, all-experts-local equivalent of ``make_case(seed, ranks=ranks, ...)``.

    Tokens of all ranks are concatenated in rank order; tokens that are inactive on their rank get
    ``expert_ids = -1`` and no mask is passed (same routed result, and the shared expert still sees
    every token). Returns ``(kwargs, rank_rows)`` where ``rank_rows[r]`` slices rank ``r``'s rows.
    """
    cases = make_case(seed, ranks=ranks, **params)
    e_total = params["experts"]
    one = make_rank_case(seed, 0, ranks=1, **{**params, "bs": sum(_bs_list(params["bs"], ranks)),
                                               "active_counts": None})
    ids = []
    for c in cases:
        i = c["expert_ids"].clone()
        if c["x_active_mask"] is not None:
            i[int(c["x_active_mask"].sum()):] = -1
        ids.append(i)
    one.update(
        x=torch.cat([c["x"] for c in cases]),
        expert_ids=torch.cat(ids),
        expert_scales=torch.cat([c["expert_scales"] for c in cases]),
        x_active_mask=None, moe_expert_num=e_total, global_bs=0,
    )
    return one, rank_rows(params["bs"], ranks)


def expert_results(kw: Dict, rows: torch.Tensor, scales: torch.Tensor, per_expert: Sequence[int]) -> torch.Tensor:
    """The reference W8A8 expert FFN of ``kw``'s local experts on received int8 ``rows`` [N, H]
    (``scales`` [N] dequantisation scales), grouped by local expert with ``per_expert[e]`` rows
    each (rows past their sum stay zero); returns [N, H] in ``kw["x"].dtype``."""
    from cam_jit.reference import fused_deep_moe_steps as steps

    w1, s1, w2, s2 = (kw[n][0] for n in ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale"))
    results = torch.zeros(rows.shape, dtype=kw["x"].dtype)
    start = 0
    for e, n in enumerate(per_expert):
        block = slice(start, start + n)
        results[block] = steps.expert_ffn(rows[block], scales[block], w1[e], s1[e], None, w2[e], s2[e], None,
                                          kw["x"].dtype)
        start += n
    return results
