"""moe_dispatch_lowlatency / moe_combine_lowlatency on real gloo groups: dispatch contents and
order against the reference's quantisation, combine against the reference's combine, and
fused_deep_moe == dispatch -> expert FFN -> combine."""
import pytest
import torch
import torch.distributed as dist

import cam_jit
from cam_jit.ops.moe_lowlatency import moe_combine_lowlatency, moe_dispatch_lowlatency
from cam_jit.reference import fused_deep_moe_steps as steps
from moe_cases import expert_results, make_rank_case
from test_fused_deep_moe import assert_matches

SMALL = dict(hidden=128, inter=64, experts=8, topk=4)


def _group_args(kw):
    return dict(group_ep=dist.group.WORLD if kw["ep_rank_size"] > 1 else "", ep_rank_size=kw["ep_rank_size"],
                ep_rank_id=kw["ep_rank_id"], moe_expert_num=kw["moe_expert_num"], global_bs=kw["global_bs"])


def dispatch_only(seed, params, quant_mode):
    kw = make_rank_case(seed, dist.get_rank(), **params)
    out = moe_dispatch_lowlatency(kw["x"], kw["expert_ids"], kw["expert_smooth_scales"], kw["x_active_mask"],
                                  quant_mode=quant_mode, **_group_args(kw))
    return kw["x"], kw["expert_ids"], kw["x_active_mask"], kw["expert_smooth_scales"], out


def test_dispatch_rows_order_and_counts(rank_pool):
    params = dict(ranks=4, bs=[5, 0, 7, 3], smooth=True, active_counts=[4, 0, 7, 1], minus_one_frac=0.2, **SMALL)
    results = rank_pool(4).run(dispatch_only, 31, params, 2)
    e_loc = SMALL["experts"] // 4
    capacity = 7 * 4 * min(SMALL["topk"], e_loc)
    for rank, (_, _, _, _, (expand_x, scales, assist, counts, recv_count)) in enumerate(results):
        assert expand_x.shape == (capacity, SMALL["hidden"]) and expand_x.dtype == torch.int8
        n = int(counts.sum())
        assert recv_count.dtype == torch.int32 and int(recv_count[-1]) == n
        assert not expand_x[n:].any() and (assist[n:] == -1).all()
        keys = []
        for row in range(n):
            src, t, k = assist[row].tolist()
            x, ids, mask, smooth, _ = results[src]
            g = int(ids[t, k])
            assert g // e_loc == rank and t < int(mask.sum())
            want_q, want_a = steps.quantize_rows(x[t:t + 1].float() * smooth[g])
            assert torch.equal(expand_x[row], want_q[0]) and torch.equal(scales[row:row + 1], want_a)
            keys.append((g % e_loc, src, t * SMALL["topk"] + k))
        assert keys == sorted(keys), "rows must be ordered by local expert, source rank, t*K+k"
        per_expert = torch.bincount(torch.tensor([key[0] for key in keys], dtype=torch.int64), minlength=e_loc)
        assert torch.equal(counts, per_expert)
    sent = sum(int(((ids[:int(m.sum())] >= 0)).sum()) for _, ids, m, _, _ in results)
    assert sent == sum(int(r[4][3].sum()) for r in results)


def combine_identity(seed, params):
    """quant_mode 0 dispatch, results = the rows themselves, combine: sum_k w_k * x[t]."""
    kw = make_rank_case(seed, dist.get_rank(), **params)
    args = _group_args(kw)
    expand_x, _, assist, _, recv_count = moe_dispatch_lowlatency(kw["x"], kw["expert_ids"], None,
                                                                 kw["x_active_mask"], quant_mode=0, **args)
    out = moe_combine_lowlatency(expand_x, kw["expert_ids"], assist, recv_count, kw["expert_scales"],
                                 kw["x_active_mask"], **args)
    active = kw["x"].shape[0] if kw["x_active_mask"] is None else int(kw["x_active_mask"].sum())
    k = kw["expert_ids"].shape[1]
    ids = kw["expert_ids"].clone()
    ids[active:] = -1
    want = steps.combine(kw["x"].unsqueeze(1).expand(-1, k, -1), ids, kw["expert_scales"], kw["x"].dtype)
    return out, want


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_combine_of_dispatched_rows(rank_pool, ranks):
    params = dict(ranks=ranks, bs=[6, 3, 0, 5][:ranks], active_counts=[5, 3, 0, 2][:ranks], minus_one_frac=0.25,
                  dtype=torch.float16, **SMALL)
    for out, want in rank_pool(ranks).run(combine_identity, 32, params):
        assert torch.equal(out, want)


def fused_and_composed(seed, params):
    """fused_deep_moe and dispatch(quant) -> per-expert FFN (reference steps) -> combine."""
    kw = make_rank_case(seed, dist.get_rank(), **params)
    args = _group_args(kw)
    fused = cam_jit.fused_deep_moe(**kw)
    expand_x, scales, assist, counts, recv_count = moe_dispatch_lowlatency(
        kw["x"], kw["expert_ids"], kw["expert_smooth_scales"], kw["x_active_mask"], quant_mode=2, **args)
    results = expert_results(kw, expand_x, scales, counts.tolist())
    out = moe_combine_lowlatency(results, kw["expert_ids"], assist, recv_count, kw["expert_scales"],
                                 kw["x_active_mask"], **args)
    return fused, (out, fused[1], counts)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_fused_equals_dispatch_ffn_combine(rank_pool, ranks):
    params = dict(ranks=ranks, bs=[8, 2, 5, 0][:ranks], smooth=True, active_counts=[6, 2, 5, 0][:ranks], **SMALL)
    for rank, (fused, composed) in enumerate(rank_pool(ranks).run(fused_and_composed, 33, params)):
        assert_matches(fused, composed, f"rank {rank} of {ranks}")


def _dispatch_args():
    gen = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(4, 32, generator=gen).to(torch.bfloat16),
                expert_ids=torch.tensor([[0, 1], [2, 3], [1, -1], [3, 2]], dtype=torch.int32),
                scales=None, x_active_mask=None, group_ep="", ep_rank_size=1, ep_rank_id=0, moe_expert_num=4,
                quant_mode=2, global_bs=0)


DISPATCH_CASES = [
    ("x-type", dict(x="x"), TypeError, ["'x'", "torch.Tensor"]),
    ("x-dtype", dict(x=torch.zeros(4, 32)), TypeError, ["'x'", "bfloat16 or float16", "float32"]),
    ("x-1d", dict(x=torch.zeros(32, dtype=torch.bfloat16)), ValueError, ["'x'", "2-D", "1-D"]),
    ("ids-dtype", dict(expert_ids=torch.zeros(4, 2, dtype=torch.int64)), TypeError, ["'expert_ids'", "int32"]),
    ("ids-batch", dict(expert_ids=torch.zeros(3, 2, dtype=torch.int32)), ValueError, ["'expert_ids'", "shape[0] == 4"]),
    ("ids-range", dict(expert_ids=torch.full((4, 2), 4, dtype=torch.int32)), ValueError,
     ["'expert_ids'", "[-1, 4)", "max 4"]),
    ("quant-mode", dict(quant_mode=1), ValueError, ["'quant_mode'", "0 (no quantisation)", "got 1"]),
    ("scales-without-quant", dict(scales=torch.ones(4, 32), quant_mode=0), ValueError, ["'scales'", "quant_mode == 2"]),
    ("scales-shape", dict(scales=torch.ones(4, 31)), ValueError, ["'scales'", "[4, 32]", "[4, 31]"]),
    ("mask-dtype", dict(x_active_mask=torch.ones(4)), TypeError, ["'x_active_mask'", "bool", "float32"]),
    ("rank-size", dict(ep_rank_size=0), ValueError, ["'ep_rank_size'", "> 0", "got 0"]),
    ("rank", dict(ep_rank_id=2), ValueError, ["'ep_rank_id'", "ep_rank_size (1)", "got 2"]),
    ("experts", dict(moe_expert_num=0), ValueError, ["'moe_expert_num'", "positive multiple"]),
    ("global-bs-small", dict(global_bs=2), ValueError, ["'global_bs'", ">= BS * ep_rank_size = 4", "got 2"]),
    ("group", dict(group_ep=3), TypeError, ["'group_ep'", "int"]),
]


@pytest.mark.parametrize("overrides,exc,fragments", [c[1:] for c in DISPATCH_CASES], ids=[c[0] for c in DISPATCH_CASES])
def test_dispatch_bad_argument(overrides, exc, fragments):
    args = _dispatch_args()
    args.update(overrides)
    x, ids, scales, mask = (args.pop(n) for n in ("x", "expert_ids", "scales", "x_active_mask"))
    with pytest.raises(exc) as info:
        moe_dispatch_lowlatency(x, ids, scales, mask, **args)
    assert str(info.value).startswith("moe_dispatch_lowlatency")
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def _combine_args():
    d = _dispatch_args()
    x, ids = d["x"], d["expert_ids"]
    expand_x, _, assist, _, recv_count = moe_dispatch_lowlatency(x, ids, None, None, group_ep="", ep_world_size=1,
                                                                 ep_rank_id=0, moe_expert_num=4, quant_mode=0)
    return dict(expand_x=expand_x, expert_ids=ids, assist_info_for_combine=assist, ep_send_counts=recv_count,
                expert_scales=torch.full((4, 2), 0.5), x_active_mask=None, group_ep="", ep_world_size=1,
                ep_rank_id=0, moe_expert_num=4, global_bs=0)


COMBINE_CASES = [
    ("expand-type", dict(expand_x=None), TypeError, ["'expand_x'", "torch.Tensor"]),
    ("expand-dtype", dict(expand_x=torch.zeros(8, 32, dtype=torch.int8)), TypeError, ["'expand_x'", "int8"]),
    ("expand-rows", dict(expand_x=torch.zeros(9, 32, dtype=torch.bfloat16)), ValueError,
     ["'expand_x'", "[8, 32]", "[9, 32]"]),
    ("ids-3d", dict(expert_ids=torch.zeros(4, 2, 1, dtype=torch.int32)), ValueError, ["'expert_ids'", "2-D", "3-D"]),
    ("scales-shape", dict(expert_scales=torch.ones(4, 3)), ValueError, ["'expert_scales'", "[4, 2]", "[4, 3]"]),
    ("scales-dtype", dict(expert_scales=torch.ones(4, 2, dtype=torch.float64)), TypeError,
     ["'expert_scales'", "float32", "float64"]),
    ("assist-dtype", dict(assist_info_for_combine=torch.zeros(8, 3, dtype=torch.int64)), TypeError,
     ["'assist_info_for_combine'", "int32", "int64"]),
    ("assist-shape", dict(assist_info_for_combine=torch.zeros(8, 2, dtype=torch.int32)), ValueError,
     ["'assist_info_for_combine'", "[8, 3]", "[8, 2]"]),
    ("assist-source", dict(assist_info_for_combine=torch.full((8, 3), 5, dtype=torch.int32)), ValueError,
     ["'assist_info_for_combine'", "source ranks in [0, 1)", "max 5"]),
    ("counts-shape", dict(ep_send_counts=torch.zeros(3, dtype=torch.int32)), ValueError,
     ["'ep_send_counts'", "[4]", "[3]"]),
    ("counts-total", dict(ep_send_counts=torch.tensor([0, 0, 0, 99], dtype=torch.int32)), ValueError,
     ["'ep_send_counts'", "[0, 8]", "got 99"]),
    ("mask-shape", dict(x_active_mask=torch.ones(5, dtype=torch.bool)), ValueError, ["'x_active_mask'", "[4]", "[5]"]),
    ("rank-type", dict(ep_rank_id="0"), TypeError, ["'ep_rank_id'", "an int", "str"]),
]


@pytest.mark.parametrize("overrides,exc,fragments", [c[1:] for c in COMBINE_CASES], ids=[c[0] for c in COMBINE_CASES])
def test_combine_bad_argument(overrides, exc, fragments):
    args = _combine_args()
    args.update(overrides)
    tensors = [args.pop(n) for n in ("expand_x", "expert_ids", "assist_info_for_combine", "ep_send_counts",
                                     "expert_scales", "x_active_mask")]
    with pytest.raises(exc) as info:
        moe_combine_lowlatency(*tensors, **args)
    assert str(info.value).startswith("moe_combine_lowlatency")
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_combine_good_arguments_baseline():
    args = _combine_args()
    tensors = [args.pop(n) for n in ("expand_x", "expert_ids", "assist_info_for_combine", "ep_send_counts",
                                     "expert_scales", "x_active_mask")]
    out = moe_combine_lowlatency(*tensors, **args)
    x = _dispatch_args()["x"]
    assert torch.equal(out[2], x[2].float().mul(0.5).to(torch.bfloat16))  # one routed slot


def test_one_name_for_the_ep_group_size():
    """ep_rank_size everywhere (schemas and functions); torch_npu's ep_world_size is a keyword alias
    of the low-latency ops only, and giving both is an error (docs/semantics.md §0.7)."""
    import inspect

    from cam_jit import FusedDeepMoeBuffer, fused_deep_moe
    from cam_jit.ops import describe_ops

    for fn in (fused_deep_moe, moe_dispatch_lowlatency, moe_combine_lowlatency, FusedDeepMoeBuffer.zb_fused_deep_moe):
        assert "ep_rank_size" in inspect.signature(fn).parameters, fn.__name__
    assert not [op["schema"] for op in describe_ops() if "ep_world_size" in op["schema"]]
    args = _dispatch_args()
    x, ids = args.pop("x"), args.pop("expert_ids")
    by_name = moe_dispatch_lowlatency(x, ids, **args)
    args["ep_world_size"] = args.pop("ep_rank_size")
    by_alias = moe_dispatch_lowlatency(x, ids, **args)
    assert all(torch.equal(a, b) for a, b in zip(by_name, by_alias))
    with pytest.raises(TypeError, match="got both 'ep_rank_size' and its alias 'ep_world_size'"):
        moe_dispatch_lowlatency(x, ids, ep_rank_size=1, **args)
    combine = _combine_args()
    combine.pop("ep_world_size")
    with pytest.raises(TypeError, match="missing required keyword argument 'ep_rank_size'"):
        moe_combine_lowlatency(**combine)
