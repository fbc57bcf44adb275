"""Graph mode on CPU: every cam_jit op passes torch.library.opcheck, compiles with
torch.compile(fullgraph=True) (zero graph breaks) to the eager result, exports with torch.export
(the graph holds the cam_jit op; a symbolic batch where the op allows one), and the GE-converter
bookkeeping (cam_jit.ops.graph) covers every op without importing torchair.

Single-rank ops run here with an EP group of 1; a2e/e2a need an expert and an attention rank and
run on a 2-rank pool.
"""
import sys

import pytest
import torch
import torch.distributed as dist
from torch.export import Dim

from cam_jit.ops import _registry
from cam_jit.ops.a2e_e2a import a2e, e2a
from cam_jit.ops.fused_deep_moe import fused_deep_moe
from cam_jit.ops.graph import ge_converter_status, register_ge_converters
from cam_jit.ops.moe_lowlatency import moe_combine_lowlatency, moe_dispatch_lowlatency
from cam_jit.reference import pack_int4, w4a8_compensation_bias

H, I, E, K = 64, 32, 4, 2


def _tokens(bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bs, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bs)]).to(torch.int32)
    scales = torch.rand(bs, K, generator=g)
    return x, ids, scales


def _weights(seed=1):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randint(-127, 128, (E, H, 2 * I), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (E, I, H), dtype=torch.int8, generator=g)
    return w1, torch.rand(E, 2 * I, generator=g) * 2e-3, w2, torch.rand(E, H, generator=g) * 2e-3


class FusedDeepMoe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name, t in zip(("w1", "s1", "w2", "s2"), _weights()):
            self.register_buffer(name, t)

    def forward(self, x, ids, scales, mask):
        out, share, nums = fused_deep_moe(x, ids, self.w1, self.s1, self.w2, self.s2, scales, x_active_mask=mask,
                                          group_ep="", ep_rank_size=1, ep_rank_id=0, moe_expert_num=E)
        return out.float() * 2, nums


class LowLatency(torch.nn.Module):
    """dispatch (no quantisation) -> an elementwise 'expert' -> combine."""

    def forward(self, x, ids, scales, mask):
        group = dict(group_ep="", ep_rank_size=1, ep_rank_id=0, moe_expert_num=E)
        expand_x, _, assist, _, recv = moe_dispatch_lowlatency(x, ids, None, mask, quant_mode=0, **group)
        return moe_combine_lowlatency(expand_x * 2, ids, assist, recv, scales, mask, **group)


def _inputs(bs, active):
    x, ids, scales = _tokens(bs)
    return x, ids, scales, torch.arange(bs) < active


SINGLE_RANK = {"fused_deep_moe": FusedDeepMoe, "moe_lowlatency": LowLatency}


def _flat(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _assert_same(got, want):
    for a, b in zip(_flat(got), _flat(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _op_calls(graph_module):
    return sorted({str(n.target) for n in graph_module.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("cam_jit.")})


# ------------------------------------------------------------------------------------------------
# opcheck
# ------------------------------------------------------------------------------------------------
def _single_rank_calls():
    x, ids, scales, mask = _inputs(5, 4)
    w1, s1, w2, s2 = _weights()
    fdm = (x, ids, [w1], [s1], [w2], [s2], scales, None, None, None, None, None, None, mask, [], [], None, None,
           "", 1, 0, E, 0, 0)
    dispatch = (x, ids, None, mask, "", 1, 0, E, 0, 0)
    expand_x, _, assist, _, recv = torch.ops.cam_jit.moe_dispatch_lowlatency(*dispatch)
    combine = (expand_x, ids, assist, recv, scales, mask, "", 1, 0, E, 0)
    quantised = (x, ids, torch.rand(E, H) + 0.5, None, "", 1, 0, E, 2, 0)
    return {"fused_deep_moe": fdm, "fused_deep_moe (W4A8, shared expert, smooth scales)": _w4a8_call(x, ids, scales),
            "moe_dispatch_lowlatency": dispatch, "moe_combine_lowlatency": combine,
            "moe_dispatch_lowlatency (quant_mode 2)": quantised}


def _w4a8_call(x, ids, scales):
    """fused_deep_moe's schema arguments for W4A8 with every optional input given."""
    g = torch.Generator().manual_seed(2)

    def expert(*lead, k_in, n):
        w = pack_int4(torch.randint(-8, 8, (*lead, k_in, n), generator=g))
        s = torch.rand(*lead, n, generator=g) * 1e-2
        return w, s, w4a8_compensation_bias(w, s)

    w1, s1, b1 = expert(E, k_in=H, n=2 * I)
    w2, s2, b2 = expert(E, k_in=I, n=H)
    sw1, ss1, sb1 = expert(k_in=H, n=16)
    sw2, ss2, sb2 = expert(k_in=8, n=H)
    smooth, share_smooth = torch.rand(E, H, generator=g) + 0.5, torch.rand(H, generator=g) + 0.5
    return (x, ids, [w1], [s1], [w2], [s2], scales, sw1, ss1, sw2, ss2, smooth, share_smooth, None, [b1], [b2],
            sb1, sb2, "", 1, 0, E, 0, 0)


@pytest.mark.parametrize("case", ["fused_deep_moe", "fused_deep_moe (W4A8, shared expert, smooth scales)",
                                  "moe_dispatch_lowlatency", "moe_combine_lowlatency",
                                  "moe_dispatch_lowlatency (quant_mode 2)"])
def test_opcheck_single_rank_ops(case):
    args = _single_rank_calls()[case]
    op = getattr(torch.ops.cam_jit, case.split()[0]).default
    report = torch.library.opcheck(op, args)
    assert set(report.values()) == {"SUCCESS"}, report


def _afd_calls():
    rank = dist.get_rank()
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    if rank == 0:
        x = torch.empty(0, H, dtype=torch.bfloat16)
    a2e_args = (x, None, None, 4, H, K, 1, 1, rank, "", 8, 0)
    out = torch.ops.cam_jit.a2e(*a2e_args)
    e2a_args = (out[0] if rank == 0 else x, out[3], 4, H, K, 1, 1, rank, "", 8)
    return a2e_args, e2a_args


def run_afd_opcheck():
    a2e_args, e2a_args = _afd_calls()
    return [torch.library.opcheck(torch.ops.cam_jit.a2e.default, a2e_args),
            torch.library.opcheck(torch.ops.cam_jit.e2a.default, e2a_args)]


def test_opcheck_a2e_e2a(rank_pool):
    for reports in rank_pool(2).run(run_afd_opcheck):
        for report in reports:
            assert set(report.values()) == {"SUCCESS"}, report


# ------------------------------------------------------------------------------------------------
# torch.compile and torch.export
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SINGLE_RANK))
def test_compile_fullgraph_matches_eager(name):
    model = SINGLE_RANK[name]()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for bs, active in ((5, 4), (7, 7)):  # a second batch size reuses the dynamic graph
            inputs = _inputs(bs, active)
            _assert_same(compiled(*inputs), model(*inputs))


@pytest.mark.parametrize("name, ops", [
    ("fused_deep_moe", ["cam_jit.fused_deep_moe.default"]),
    ("moe_lowlatency", ["cam_jit.moe_combine_lowlatency.default", "cam_jit.moe_dispatch_lowlatency.default"]),
])
def test_export_with_a_symbolic_batch(name, ops):
    model = SINGLE_RANK[name]()
    batch = Dim("batch", min=2, max=64)
    shapes = {"x": {0: batch}, "ids": {0: batch}, "scales": {0: batch}, "mask": {0: batch}}
    program = torch.export.export(model, _inputs(5, 4), dynamic_shapes=shapes)
    assert _op_calls(program.graph_module) == ops
    with torch.no_grad():
        for bs, active in ((5, 4), (9, 3)):
            inputs = _inputs(bs, active)
            _assert_same(program.module()(*inputs), model(*inputs))


class Afd(torch.nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def forward(self, x):
        out = a2e(x, None, None, 4, H, K, 1, 1, self.rank, "", 8, 0)
        return e2a(out[0] if self.rank == 0 else x, out[3], 4, H, K, 1, 1, self.rank, "", 8)


def run_afd_graph_mode():
    rank = dist.get_rank()
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    model = Afd(rank)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        program = torch.export.export(model, (x,))
        exported = program.module()(x)
    return x, eager, compiled, exported, _op_calls(program.graph_module)


def test_a2e_e2a_compile_and_export(rank_pool):
    for rank, (x, eager, compiled, exported, ops) in enumerate(rank_pool(2).run(run_afd_graph_mode)):
        assert ops == ["cam_jit.a2e.default", "cam_jit.e2a.default"]
        _assert_same(compiled, eager)
        _assert_same(exported, eager)
        if rank == 1:  # the attention rank gets its tokens back
            assert torch.equal(eager, x)


# ------------------------------------------------------------------------------------------------
# GE converter bookkeeping (no torchair here)
# ------------------------------------------------------------------------------------------------
def test_every_op_says_whether_it_has_a_ge_converter():
    status = ge_converter_status()
    for info in _registry.OPS:
        assert info.name in status, f"{info.name}: add it to CONVERTERS or NO_CONVERTER in ge_converters/"
    assert status["fused_deep_moe"] == status["a2e"] == status["e2a"] == "GE converter"
    assert status["moe_dispatch_lowlatency"].startswith("no GE converter: no GE op of matching semantics")


def test_register_ge_converters_without_torchair_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchair", None)  # import torchair -> ImportError
    with pytest.raises(ImportError, match="register_ge_converters needs torchair.*torch-npu"):
        register_ge_converters()


def test_importing_cam_jit_does_not_import_torchair():
    import subprocess

    code = "import sys, cam_jit, cam_jit.ops.graph as g; g.ge_converter_status(); print('torchair' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr
