"""The prefill ops' NPU path end to end against the executing stand-in (tests/npu_sim): cam_jit's
PrivateUse1 kernels -> the real wrappers (wrappers/moe_normal.cpp) and exec helper -> the simulated
opapi, whose stand-in kernels rebuild every operand from the ACL descriptors and check what UMDK
master's kernels read (int64 layout ids, 1-D assist info, the scratch sizes, no -1). Results must
equal the CPU backend bit for bit, on one rank and on two.

The attributes follow UMDK master's own binding (src/cam/comm_operator/pybind/
get_dispatch_layout.cpp: localRankSize 8, the notifySendData size; moe_dispatch_prefill.cpp:
sendCount 3E, localRankSize R, TP size 1 with the EP group name, at least one output row;
moe_combine_prefill.cpp: a one-element tpRecvCounts, globalBs = BS * R).
"""
import pytest
import torch

from cam_jit.ascend import npu_ops
from test_npu_end_to_end import SOLO, _bind_in_worker, npu, sims  # noqa: F401  (fixtures)
from npu_sim import standin

E, H = 4, 16
IDS = torch.tensor([[0, 3], [1, 2], [3, 1], [2, 0], [1, 0]], dtype=torch.int32)


def _prefill(ops, x, ids, weights, group_ep, ranks, rank, quant_mode):
    """layout -> notify -> dispatch -> combine with `ops` (npu_ops or torch.ops.cam_jit)."""
    layout = ops.moe_dispatch_layout(ids, E, ranks)
    notify = ops.moe_notify_dispatch(layout[1], x.shape[0], group_ep, ranks, rank)
    global_bs = int(notify[4]) * ranks
    dispatched = ops.moe_dispatch_normal(x, ids, notify[0], layout[3], notify[1], notify[2], group_ep, ranks, rank, E,
                                         quant_mode, global_bs, int(notify[3]))
    results = dispatched[0] if quant_mode == 0 else (dispatched[0].float() * dispatched[1][:, None]).to(x.dtype)
    out = ops.moe_combine_normal(results, dispatched[2], notify[2], ids, weights, group_ep, ranks, rank, E, global_bs)
    return [*layout, *notify, *dispatched, out]


def _same(got, want):
    return [g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want, strict=True)]


@pytest.mark.parametrize("quant_mode", [0, 2])
def test_one_rank_is_bit_identical_to_cpu(npu, quant_mode):  # noqa: F811
    bind, _ = npu
    sim = bind("master")
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(4))
    got = _prefill(npu_ops, x, IDS, weights, SOLO, 1, 0, quant_mode)
    want = _prefill(torch.ops.cam_jit, x, IDS, weights, "", 1, 0, quant_mode)
    assert all(_same(got, want))
    calls = {c["fn"]: c["args"] for c in sim.calls() if c["fn"].endswith("GetWorkspaceSize")}
    layout = calls["aclnnDispatchLayoutGetWorkspaceSize"]
    assert [a["value"] for a in layout[1:6]] == [5, 1, E, 2, 8] and layout[0]["dtype"] == 9  # int64 ids
    notify = calls["aclnnNotifyDispatchGetWorkspaceSize"]
    assert [a["value"] for a in notify[2:9]] == [3 * E, 5, SOLO, 1, 0, 1, 0]
    dispatch = calls["aclnnMoeDispatchNormalGetWorkspaceSize"]
    assert [a["value"] for a in dispatch[6:15]] == [SOLO, 1, 0, SOLO, 1, 0, E, quant_mode, 5]
    assert dispatch[17]["shape"] == [30] and dispatch[18] is None  # flat assist info, no diagnostics
    combine = calls["aclnnMoeCombineNormalGetWorkspaceSize"]
    assert combine[4]["shape"] == [1] and [a["value"] for a in combine[5:13]] == [SOLO, 1, 0, SOLO, 1, 0, E, 5]
    assert sim.live() == 0


def test_ids_of_minus_one_are_refused_before_the_launch(npu):  # noqa: F811
    bind, _ = npu
    sim = bind("master")
    with pytest.raises(ValueError, match=r"moe_dispatch_layout on NPU: argument 'expert_ids'.*no -1 handling"):
        npu_ops.moe_dispatch_layout(torch.tensor([[0, -1]], dtype=torch.int32), E, 1)
    assert sim.calls() == []


def _two_ranks(sim_path, quant_mode):
    import torch.distributed as dist

    sim = _bind_in_worker(sim_path, "master")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    batch = (6, 3)[rank]
    x = torch.randn(batch, H, generator=g).to(torch.float16)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(batch)]).to(torch.int32)
    weights = torch.rand(batch, 3, generator=g)
    try:
        with standin.executing(sim):
            got = _prefill(npu_ops, x, ids, weights, "", 2, rank, quant_mode)
    finally:
        npu_ops._BINDING = None
    return _same(got, _prefill(torch.ops.cam_jit, x, ids, weights, "", 2, rank, quant_mode))


@pytest.mark.parametrize("quant_mode", [0, 2])
def test_two_ranks_are_bit_identical_to_cpu(sims, rank_pool, quant_mode):  # noqa: F811
    for same in rank_pool(2).run(_two_ranks, str(sims["master"].path), quant_mode):
        assert all(same), same


def test_a_rank_that_receives_nothing(npu):  # noqa: F811
    """No rows: the dispatch still hands the kernel one output row and the combine one input row
    (as UMDK's binding does), and the results are empty like the CPU backend's."""
    bind, _ = npu
    sim = bind("master")
    x, ids, weights = torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2)
    got = _prefill(npu_ops, x, ids, weights, SOLO, 1, 0, 2)
    assert all(_same(got, _prefill(torch.ops.cam_jit, x, ids, weights, "", 1, 0, 2)))
    calls = {c["fn"]: c["args"] for c in sim.calls() if c["fn"].endswith("GetWorkspaceSize")}
    assert calls["aclnnMoeDispatchNormalGetWorkspaceSize"][15]["shape"] == [1, H]
    assert calls["aclnnMoeCombineNormalGetWorkspaceSize"][0]["shape"] == [1, H]
