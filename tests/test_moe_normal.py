"""Prefill ("normal") layout / notify / dispatch / combine on real gloo groups: every output
bit-identical to cam_jit.reference.moe_normal (all-gather scheme), the dispatch -> identity
experts -> combine round trip, the prefill handle API, fused_deep_moe's routed output, ranks that
disagree, bad arguments and opcheck."""
import pytest
import torch
import torch.distributed as dist

import cam_jit
from cam_jit.ops.moe_normal import (moe_combine_normal, moe_dispatch_layout, moe_dispatch_normal,
                                    moe_notify_dispatch)
from cam_jit.reference import moe_normal as ref
from moe_cases import expert_results, make_rank_case

SMALL = dict(hidden=64, inter=32, experts=8, topk=3)
CASES = {1: dict(bs=[6]), 2: dict(bs=[7, 0], dtype=torch.float16), 4: dict(bs=[5, 0, 9, 3])}


def _identity_results(recv_x, recv_scales, dtype):
    """What an identity expert returns: the row itself, dequantised when it arrived as int8."""
    if recv_x.dtype == torch.int8:
        return (recv_x.float() * recv_scales.unsqueeze(1)).to(dtype)
    return recv_x


def _weighted_inputs(x, ids, weights):
    """sum over k ascending of weight * x[t] (float32, rounded once), skipping ids of -1."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(ids.shape[1]):
        acc = torch.where((ids[:, k] >= 0).unsqueeze(1), acc + x.float() * weights[:, k:k + 1], acc)
    return acc.to(x.dtype)


def all_ops_against_reference(seed, params):
    rank, ranks = dist.get_rank(), params["ranks"]
    kw = make_rank_case(seed, rank, **params)
    x, ids, weights, experts = kw["x"], kw["expert_ids"], kw["expert_scales"], kw["moe_expert_num"]
    group = dict(group_ep="", ep_rank_size=ranks, ep_rank_id=rank)
    layout = moe_dispatch_layout(ids, moe_expert_num=experts, ep_rank_size=ranks)
    notify = moe_notify_dispatch(layout[1], num_tokens=x.shape[0], **group)
    got = {"layout": layout, "notify": notify}
    want = {"layout": ref.dispatch_layout(ids, experts, ranks),
            "notify": ref.notify_dispatch(layout[1], x.shape[0], "", ranks, rank)}
    for quant_mode in (0, 2):
        dispatched = moe_dispatch_normal(x, ids, notify[0], layout[3], notify[1], notify[2], moe_expert_num=experts,
                                         num_recv_tokens=int(notify[3]), quant_mode=quant_mode,
                                         global_bs=int(notify[4]) * ranks, **group)
        results = _identity_results(dispatched[0], dispatched[1], x.dtype)
        combined = moe_combine_normal(results, dispatched[2], notify[2], ids, weights, moe_expert_num=experts,
                                      global_bs=int(notify[4]) * ranks, **group)
        recv_x, recv_scales, per_expert, handle = cam_jit.moe_dispatch_prefill(
            x, ids, moe_expert_num=experts, quant_mode=quant_mode, **group)
        got[f"dispatch {quant_mode}"] = dispatched
        got[f"combine {quant_mode}"] = combined
        got[f"prefill {quant_mode}"] = (recv_x, recv_scales, per_expert,
                                        cam_jit.moe_combine_prefill(results, handle, weights))
        ref_dispatched = ref.dispatch_normal(x, ids, "", ranks, rank, experts, quant_mode)
        want[f"dispatch {quant_mode}"] = ref_dispatched
        want[f"combine {quant_mode}"] = ref.combine_normal(
            _identity_results(ref_dispatched[0], ref_dispatched[1], x.dtype), ref_dispatched[2], ids, weights, "",
            ranks, rank)
        want[f"prefill {quant_mode}"] = (dispatched[0], dispatched[1], notify[5], combined)
    return got, want, _weighted_inputs(x, ids, weights)


def _assert_identical(got, want, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (what, i)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_every_op_matches_the_reference(rank_pool, ranks):
    params = dict(ranks=ranks, minus_one_frac=0.25, **CASES[ranks], **SMALL)
    routed = 0
    for rank, (got, want, weighted) in enumerate(rank_pool(ranks).run(all_ops_against_reference, 41, params)):
        for what in want:
            _assert_identical(got[what] if isinstance(got[what], tuple) else (got[what],),
                              want[what] if isinstance(want[what], tuple) else (want[what],), f"rank {rank} {what}")
        assert torch.equal(got["combine 0"], weighted), "round trip must return the weighted inputs"
        routed += got["dispatch 0"][0].shape[0]
    assert routed > 0


ROUTING = [[0, 1, 2, 3], [3, 2, -1, 0], [1, -1, -1, -1]]


def routing_with_shared_ranks(seed):
    """Tokens with several experts on one rank travel once to it and still give one row per pair."""
    rank = dist.get_rank()
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed + rank)).to(torch.bfloat16)
    recv_x, _, per_expert, handle = cam_jit.moe_dispatch_prefill(
        x, torch.tensor(ROUTING, dtype=torch.int32), group_ep="", ep_rank_size=2, ep_rank_id=rank, moe_expert_num=4)
    return x, recv_x, per_expert, handle.assist_info_for_combine


def test_tokens_with_several_experts_on_one_rank(rank_pool):
    results = rank_pool(2).run(routing_with_shared_ranks, 5)
    for rank, (_, recv_x, per_expert, assist) in enumerate(results):
        local = (2 * rank, 2 * rank + 1)  # rank r owns experts 2r and 2r+1; both ranks route alike
        want = [(e, s, t, k) for e in local for s in range(2) for t, row in enumerate(ROUTING)
                for k, g in enumerate(row) if g == e]
        assert [tuple(a) for a in assist.tolist()] == [w[1:] for w in want]
        assert per_expert.tolist() == [sum(1 for w in want if w[0] == e) for e in local]
        for row, (_, s, t, _) in zip(recv_x, want):
            assert torch.equal(row, results[s][0][t])


def fused_and_prefill(seed, params):
    """fused_deep_moe's routed output and: prefill dispatch (int8) -> the reference expert FFN of
    each local expert -> prefill combine."""
    kw = make_rank_case(seed, dist.get_rank(), **params)
    fused = cam_jit.fused_deep_moe(**kw)
    group = dict(group_ep="", ep_rank_size=kw["ep_rank_size"], ep_rank_id=kw["ep_rank_id"],
                 moe_expert_num=kw["moe_expert_num"])
    recv_x, scales, per_expert, handle = cam_jit.moe_dispatch_prefill(kw["x"], kw["expert_ids"], quant_mode=2, **group)
    results = expert_results(kw, recv_x, scales, per_expert.tolist())
    amax = kw["x"].float().abs().amax(1)
    return fused[0], cam_jit.moe_combine_prefill(results, handle, kw["expert_scales"]), amax


@pytest.mark.parametrize("ranks", [1, 2])
def test_prefill_equals_fused_deep_moe_routed_output(rank_pool, ranks):
    params = dict(ranks=ranks, bs=[9, 4][:ranks], minus_one_frac=0.2, **SMALL)
    for fused, composed, amax in rank_pool(ranks).run(fused_and_prefill, 43, params):
        # the prefill quantisation adds 1e-12 to amax: the same numbers whenever that addition is exact
        assert bool((amax + 1e-12 == amax).all())
        assert torch.equal(fused, composed)


def disagreeing_hidden_size(hidden_by_rank):
    rank = dist.get_rank()
    x = torch.zeros(2, hidden_by_rank[rank], dtype=torch.bfloat16)
    ids = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    try:
        cam_jit.moe_dispatch_prefill(x, ids, group_ep="", ep_rank_size=2, ep_rank_id=rank, moe_expert_num=4)
    except ValueError as err:
        return str(err)
    return None


def test_ranks_that_disagree_fail_on_every_rank(rank_pool):
    for message in rank_pool(2).run(disagreeing_hidden_size, [32, 16]):
        assert message is not None and "'x (hidden size H)'" in message and "by rank {0: 32, 1: 16}" in message


def mismatched_notify(rank1_quant_mode):
    """Rank 1 dispatches with notify outputs computed for a different routing (and a given quant_mode)."""
    rank = dist.get_rank()
    ids = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    group = dict(group_ep="", ep_rank_size=2, ep_rank_id=rank)
    layout = moe_dispatch_layout(ids, moe_expert_num=4, ep_rank_size=2)
    notify = moe_notify_dispatch(layout[1], num_tokens=2, **group)
    recv_count = notify[2]
    if rank == 1:
        recv_count = torch.tensor([0, 1, 2, 2], dtype=torch.int32)  # claims fewer rows than arrive
    try:
        moe_dispatch_normal(x, ids, notify[0], layout[3], notify[1], recv_count, moe_expert_num=4,
                            num_recv_tokens=int(recv_count[-1]), quant_mode=rank1_quant_mode if rank else 0, **group)
    except (RuntimeError, ValueError) as err:
        return str(err)
    return None


def test_dispatch_rejects_counts_that_do_not_match_the_rows(rank_pool):
    messages = rank_pool(2).run(mismatched_notify, 0)
    assert messages[1] is not None and "argument 'recv_count'" in messages[1], messages
    assert messages[0] is not None and "rank(s) [1] passed a recv_count" in messages[0], messages


def test_a_rank_that_rejects_its_arguments_stops_the_others(rank_pool):
    messages = rank_pool(2).run_with_timeout(30, mismatched_notify, 1)
    assert messages[1] is not None and "argument 'quant_mode'" in messages[1], messages
    assert messages[0] is not None and "rank(s) [1]" in messages[0] and "rejected" in messages[0], messages


# ------------------------------------------------------------------------------------------------
# bad arguments (one rank)
# ------------------------------------------------------------------------------------------------
IDS = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 2]], dtype=torch.int32)
X = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
ONE = dict(group_ep="", ep_rank_size=1, ep_rank_id=0)


def _raises(exc, fragments, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("ids, kwargs, exc, fragments", [
    (IDS.float(), {}, TypeError, ["moe_dispatch_layout", "'expert_ids'", "int32 or int64", "float32"]),
    (IDS[0], {}, ValueError, ["'expert_ids'", "2-D", "1-D"]),
    (IDS + 4, {}, ValueError, ["'expert_ids'", "[-1, 4)", "max 7"]),
    (IDS, {"moe_expert_num": 3, "ep_rank_size": 2}, ValueError, ["'moe_expert_num'", "multiple of ep_rank_size"]),
    (IDS, {"ep_rank_size": 0}, ValueError, ["'ep_rank_size'", "> 0"]),
    (IDS, {"moe_expert_num": 4.0}, TypeError, ["'moe_expert_num'", "an int", "float"]),
])
def test_layout_bad_arguments(ids, kwargs, exc, fragments):
    _raises(exc, fragments, moe_dispatch_layout, ids, **{"moe_expert_num": 4, "ep_rank_size": 1, **kwargs})


@pytest.mark.parametrize("counts, kwargs, exc, fragments", [
    (torch.ones(4), {}, TypeError, ["moe_notify_dispatch", "'num_tokens_per_expert'", "int32", "float32"]),
    (torch.ones(0, dtype=torch.int32), {}, ValueError, ["'num_tokens_per_expert'", "multiple of ep_rank_size (1)",
                                                         "[0]"]),
    (torch.tensor([1, -1, 0, 0], dtype=torch.int32), {}, ValueError, ["'num_tokens_per_expert'", ">= 0", "-1"]),
    (torch.ones(4, dtype=torch.int32), {"num_tokens": -1}, ValueError, ["'num_tokens'", ">= 0"]),
    (torch.ones(4, dtype=torch.int32), {"ep_rank_id": 1}, ValueError, ["'ep_rank_id'", "got 1"]),
])
def test_notify_bad_arguments(counts, kwargs, exc, fragments):
    _raises(exc, fragments, moe_notify_dispatch, counts, **{"num_tokens": 4, **ONE, **kwargs})


def _dispatch_args():
    layout = moe_dispatch_layout(IDS, moe_expert_num=4, ep_rank_size=1)
    notify = moe_notify_dispatch(layout[1], num_tokens=4, **ONE)
    return dict(x=X, expert_ids=IDS, send_offset=notify[0], send_token_idx=layout[3], recv_offset=notify[1],
                recv_count=notify[2], moe_expert_num=4, num_recv_tokens=int(notify[3]), **ONE)


@pytest.mark.parametrize("overrides, exc, fragments", [
    (dict(x=X.float()), TypeError, ["'x'", "bfloat16 or float16", "float32"]),
    (dict(x=X[:3]), ValueError, ["'expert_ids'", "shape[0] == 3"]),
    (dict(send_token_idx=torch.zeros(4, 2, dtype=torch.int32)), ValueError, ["'send_token_idx'", "moe_dispatch_layout"]),
    (dict(send_token_idx=torch.zeros(4, 3, dtype=torch.int32)), ValueError, ["'send_token_idx'", "[4, 2]"]),
    (dict(send_offset=torch.zeros(4, dtype=torch.int32)), ValueError, ["'send_offset'", "moe_notify_dispatch"]),
    (dict(recv_offset=torch.zeros(4, dtype=torch.int32)), ValueError, ["'recv_offset'", "moe_notify_dispatch"]),
    (dict(recv_count=torch.zeros(3, dtype=torch.int32)), ValueError, ["'recv_count'", "[4]", "[3]"]),
    (dict(recv_count=torch.tensor([2, 1, 5, 7], dtype=torch.int32)), ValueError, ["'recv_count'", "non-decreasing"]),
    (dict(num_recv_tokens=6), ValueError, ["'recv_count'", "ending at num_recv_tokens = 6"]),
    (dict(num_recv_tokens=-1), ValueError, ["'num_recv_tokens'", ">= 0"]),
    (dict(quant_mode=1), ValueError, ["'quant_mode'", "0 (no quantisation) or 2", "got 1"]),
    (dict(global_bs=2), ValueError, ["'global_bs'", ">= BS * ep_rank_size = 4", "got 2"]),
    (dict(group_ep=3), TypeError, ["'group_ep'", "int"]),
])
def test_dispatch_bad_arguments(overrides, exc, fragments):
    args = {**_dispatch_args(), **overrides}
    tensors = [args.pop(n) for n in ("x", "expert_ids", "send_offset", "send_token_idx", "recv_offset", "recv_count")]
    _raises(exc, ["moe_dispatch_normal"] + fragments, moe_dispatch_normal, *tensors, **args)


def _combine_args():
    d = _dispatch_args()
    tensors = [d.pop(n) for n in ("x", "expert_ids", "send_offset", "send_token_idx", "recv_offset", "recv_count")]
    recv_x, _, assist = moe_dispatch_normal(*tensors, **d)
    return dict(recv_x=recv_x, assist_info_for_combine=assist, recv_count=_dispatch_args()["recv_count"],
                expert_ids=IDS, expert_scales=torch.full((4, 2), 0.5), moe_expert_num=4, **ONE)


@pytest.mark.parametrize("overrides, exc, fragments", [
    (dict(recv_x=torch.zeros(7, 32, dtype=torch.int8)), TypeError, ["'recv_x'", "int8"]),
    (dict(recv_x=torch.zeros(6, 32, dtype=torch.bfloat16)), ValueError, ["'assist_info_for_combine'", "[6, 3]"]),
    (dict(assist_info_for_combine=torch.full((7, 3), 5, dtype=torch.int32)), ValueError,
     ["'assist_info_for_combine'", "source rank in [0, 1)"]),
    (dict(expert_scales=torch.ones(4, 3)), ValueError, ["'expert_scales'", "[4, 2]", "[4, 3]"]),
    (dict(expert_scales=torch.ones(4, 2, dtype=torch.float64)), TypeError, ["'expert_scales'", "float32"]),
    (dict(expert_ids=IDS.flip(0)), RuntimeError, ["not one per pair"]),
    (dict(recv_count=torch.tensor([1, 2, 3, 4], dtype=torch.int32)), ValueError, ["'recv_count'", "= 7"]),
])
def test_combine_bad_arguments(overrides, exc, fragments):
    args = {**_combine_args(), **overrides}
    tensors = [args.pop(n) for n in ("recv_x", "assist_info_for_combine", "recv_count", "expert_ids",
                                     "expert_scales")]
    _raises(exc, ["moe_combine_normal"] + fragments, moe_combine_normal, *tensors, **args)


def test_combine_prefill_needs_a_handle():
    _raises(TypeError, ["moe_combine_prefill", "'handle'", "MoePrefillHandle", "tuple"], cam_jit.moe_combine_prefill,
            X, (1, 2), torch.ones(4, 2))


def test_opcheck():
    d = _dispatch_args()
    layout_args = (IDS, 4, 1)
    notify_args = (moe_dispatch_layout(IDS, moe_expert_num=4, ep_rank_size=1)[1], 4, "", 1, 0)
    dispatch_args = (X, IDS, d["send_offset"], d["send_token_idx"], d["recv_offset"], d["recv_count"], "", 1, 0, 4,
                     2, 0, d["num_recv_tokens"])
    c = _combine_args()
    combine_args = (c["recv_x"], c["assist_info_for_combine"], c["recv_count"], IDS, c["expert_scales"], "", 1, 0,
                    4, 0)
    for op, args in (("moe_dispatch_layout", layout_args), ("moe_notify_dispatch", notify_args),
                     ("moe_dispatch_normal", dispatch_args), ("moe_combine_normal", combine_args)):
        report = torch.library.opcheck(getattr(torch.ops.cam_jit, op).default, args)
        assert set(report.values()) == {"SUCCESS"}, (op, report)
