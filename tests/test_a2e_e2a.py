"""cam_jit a2e / e2a (point-to-point CPU path) against cam_jit.reference.a2e_e2a (all_gather based,
written from SPEC.md §2) on real gloo groups of Er expert + Ar attention ranks, plus the argument
checks (basic and strict), the fake kernels and the positional (schema order) calling convention.

Layouts with 5 and 7 ranks run on subgroups of the 8-rank pool, so only pools of 2, 4 and 8
processes are started.
"""
import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from cam_jit.ops.a2e_e2a import a2e, e2a, validate_a2e, validate_e2a
from cam_jit.ops.groups import register_group
from cam_jit.reference.a2e_e2a import a2e as ref_a2e
from cam_jit.reference.a2e_e2a import e2a as ref_e2a

BF16, FP16 = torch.bfloat16, torch.float16
AIV = 8


def pool_size(world):
    return world if world in (2, 4, 8) else 8


# ----------------------------------------------------------------------------------------------
# worker side (module level: runs on every rank of a pool)
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def member_group(world, form):
    """(group_ep argument in the given form, the ProcessGroup) for a group of the first `world`
    pool ranks, None on the other ranks; a subgroup is created when the pool is larger, and
    destroyed afterwards."""
    sub = world != dist.get_world_size()
    group = dist.new_group(list(range(world))) if sub else dist.group.WORLD
    try:
        if dist.get_rank() >= world:
            yield None
        elif form == "":
            assert not sub
            yield "", group
        elif form == "object":
            yield group, group
        elif form == "name":
            yield group.group_name, group
        elif form == "registered":
            register_group("a2e-under-test", group)
            yield "a2e-under-test", group
        else:
            raise ValueError(form)
    finally:
        if sub and dist.get_rank() < world:
            dist.destroy_process_group(group)


def make_inputs(seed, er, ar, rank, bs, hidden, topk, dtype, gate):
    """This rank's a2e inputs (attention: B_a = bs // ceil(ar / er) rows; expert: empty
    placeholders, as upstream's sample) and a stand-in expert output for an e2a-only check."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if rank < er:
        x = torch.empty(0, hidden, dtype=dtype)
        ids, scales = torch.empty(0, topk, dtype=torch.int32), torch.empty(0, topk)
        expert_out = torch.randn(bs, hidden, generator=gen).to(dtype)
        return x, ids, scales, expert_out
    rows = bs // math.ceil(ar / er)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, 256, (rows, topk), dtype=torch.int32, generator=gen)
    scales = torch.rand(rows, topk, generator=gen)
    if not gate and rank % 2:  # compute_gate=0: ids and scales may be None
        ids = scales = None
    return x, ids, scales, None


def run_layout(world, er, ar, bs, hidden, topk, gate, dtype, seed, form, strict=None):
    """a2e -> e2a (identity expert: the round trip), a second e2a on a stand-in expert output,
    and the reference of each, on the first er + ar pool ranks."""
    with member_group(world, form) as member, torch.no_grad():
        if member is None:
            return None
        group_ep, group = member
        rank = dist.get_rank(group)
        x, ids, scales, expert_out = make_inputs(seed, er, ar, rank, bs, hidden, topk, dtype, gate)
        common = (bs, hidden, topk, er, ar, rank)
        got = a2e(x, ids, scales, *common, group_ep, AIV, gate, strict=strict)
        want = ref_a2e(x, ids, scales, *common, group, AIV, gate)
        expert = rank < er
        back = e2a(got[0] if expert else x, got[3], *common, group_ep, AIV, strict=strict)
        want_back = ref_e2a(want[0] if expert else x, want[3], *common, group, AIV)
        y = e2a(expert_out if expert else x, got[3], *common, group_ep, AIV, strict=strict)
        want_y = ref_e2a(expert_out if expert else x, want[3], *common, group, AIV)
        return dict(rank=rank, x=x, a2e=list(got), ref_a2e=want, e2a=back, ref_e2a=want_back, e2a_y=y,
                    ref_e2a_y=want_y)


def call_in_pool(kind, case):
    """Calls a2e or e2a with per-rank arguments case(rank) on every pool rank and returns
    (type name, message) of what it raised, or None."""
    kw = dict(case(dist.get_rank()), group_ep=dist.group.WORLD)
    try:
        (a2e if kind == "a2e" else e2a)(**kw)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return None


# ----------------------------------------------------------------------------------------------
# checks on the parent side
# ----------------------------------------------------------------------------------------------
def served(er, ar, expert):
    return list(range(expert + er, er + ar, er))


def expected_shapes(er, ar, rank, bs, hidden, topk):
    """SPEC §2.3 output table."""
    blocks = math.ceil(ar / er)
    if rank < er:
        return [((bs, hidden), BF16), ((bs, topk), torch.int32), ((bs, topk), torch.float32),
                ((blocks,), torch.int32), ((bs,), torch.bool)]
    return [((1, 1), BF16), ((1, 1), torch.int32), ((1, 1), torch.float32), ((blocks,), torch.int32),
            ((1,), torch.bool)]


def round_trips(er, ar, rank, bs):
    """SPEC §2.4: slot i of expert e gets rows [i*Q, ...) back, a2e put them at [i*P, ...)."""
    expert, slot = rank % er, rank // er - 1
    return slot * (bs // math.ceil(ar / er)) == slot * (bs // len(served(er, ar, expert)))


def check_layout(results, er, ar, bs, hidden, topk, gate):
    blocks = math.ceil(ar / er)
    for res in results[: er + ar]:
        rank = res["rank"]
        where = f"rank {rank} of {er}+{ar}"
        for i, (t, want, (shape, t_dtype)) in enumerate(zip(res["a2e"], res["ref_a2e"],
                                                             expected_shapes(er, ar, rank, bs, hidden, topk))):
            assert tuple(t.shape) == shape and t.dtype == t_dtype, f"{where}: a2e output {i}: {t.shape} {t.dtype}"
            assert torch.equal(t, want), f"{where}: a2e output {i} differs from the reference"
        for name in ("e2a", "e2a_y"):
            t, want = res[name], res["ref_" + name]
            assert t.dtype == BF16 and t.shape == want.shape, f"{where}: {name}: {t.shape} {t.dtype}"
            assert torch.equal(t, want), f"{where}: {name} differs from the reference"
        # never-written outputs are zero (SPEC §2.3 proposal)
        expand_x, ids, scales, atten_bs, mask = res["a2e"]
        assert not atten_bs.any() and not mask.any(), where
        if rank < er:
            filled = len(served(er, ar, rank)) * (bs // blocks)
            assert not expand_x[filled:].any(), f"{where}: rows >= {filled} of expand_x are written"
            assert ids[:filled].any() == bool(gate and filled) and not ids[filled:].any(), where
            assert scales[:filled].any() == bool(gate and filled) and not scales[filled:].any(), where
            assert tuple(res["e2a"].shape) == (1, 1) and not res["e2a"].any(), where
        else:
            assert not any(t.any() for t in (expand_x, ids, scales)), where
            assert res["e2a"].shape == res["x"].shape, where
            if round_trips(er, ar, rank, bs):
                assert torch.equal(res["e2a"], res["x"].to(BF16)), f"{where}: the round trip does not return x"


LAYOUTS = [  # (Er, Ar, BE, group_ep form)
    pytest.param(1, 1, 6, "", id="1+1"),
    pytest.param(1, 3, 9, "object", id="1+3"),
    pytest.param(2, 2, 5, "name", id="2+2"),
    pytest.param(2, 6, 10, "registered", id="2+6"),
    pytest.param(3, 5, 8, "object", id="3+5-uneven"),
    pytest.param(2, 3, 7, "object", id="2+3-uneven-subgroup"),
    pytest.param(2, 5, 12, "name", id="2+5-uneven-subgroup"),
]


@pytest.mark.parametrize("gate", [1, 0], ids=["gate1", "gate0"])
@pytest.mark.parametrize("er,ar,bs,form", LAYOUTS)
def test_matches_reference_and_round_trips(rank_pool, er, ar, bs, form, gate):
    world = er + ar
    results = rank_pool(pool_size(world)).run(run_layout, world, er, ar, bs, 128, 3, gate, BF16, 1, form)
    check_layout(results, er, ar, bs, 128, 3, gate)


@pytest.mark.parametrize("er,ar,bs", [(2, 2, 4), (2, 6, 9)], ids=["2+2", "2+6"])
def test_float16_is_rounded_to_bfloat16(rank_pool, er, ar, bs):
    results = rank_pool(pool_size(er + ar)).run(run_layout, er + ar, er, ar, bs, 64, 2, 1, FP16, 2, "object")
    check_layout(results, er, ar, bs, 64, 2, 1)
    x = results[er]["x"]
    assert x.dtype == FP16 and not torch.equal(x.to(BF16).to(FP16), x)  # the rounding is visible


def test_uneven_ratio_follows_the_spec_formulas(rank_pool):
    """Er=2, Ar=5: expert 1 serves ranks 3 and 5 (n_1 = 2 < C = 3); a2e puts rank 5 at rows
    [P, 2P) = [4, 8), e2a sends it rows [Q, Q + 4) = [6, 10): half its own rows, half zeros."""
    results = rank_pool(8).run(run_layout, 7, 2, 5, 12, 32, 1, 1, BF16, 3, "object")
    check_layout(results, 2, 5, 12, 32, 1, 1)
    x5, back5 = results[5]["x"], results[5]["e2a"]
    assert torch.equal(back5[:2], x5[2:]) and not back5[2:].any()
    for rank in (2, 3, 4, 6):
        assert torch.equal(results[rank]["e2a"], results[rank]["x"]), f"rank {rank}"


def test_deepseek_hidden_strict(rank_pool):
    """H = 7168 under strict mode (bf16, limits satisfied) on 1 + 1 ranks."""
    results = rank_pool(2).run(run_layout, 2, 1, 1, 16, 7168, 8, 1, BF16, 4, "", True)
    check_layout(results, 1, 1, 16, 7168, 8, 1)


def run_positional(mode):
    """1 + 1 ranks: the public functions and torch.ops.cam_jit.* called positionally in schema
    order, and torch.ops with the schema's keyword names (upstream's sample style)."""
    rank = dist.get_rank()
    x, ids, scales, _ = make_inputs(5, 1, 1, rank, 4, 64, 2, BF16, 1)
    with torch.no_grad():
        if mode == "public":
            out = a2e(x, ids, scales, 4, 64, 2, 1, 1, rank, "", AIV, 1)
            back = e2a(out[0] if rank == 0 else x, out[3], 4, 64, 2, 1, 1, rank, "", AIV)
        elif mode == "torch.ops":
            out = torch.ops.cam_jit.a2e(x, ids, scales, 4, 64, 2, 1, 1, rank, "", AIV, 1)
            back = torch.ops.cam_jit.e2a(out[0] if rank == 0 else x, out[3], 4, 64, 2, 1, 1, rank, "", AIV)
        else:
            out = torch.ops.cam_jit.a2e(x=x, expert_ids=ids, scales=scales, batch_size=4, hidden_size=64, topk=2,
                                        expert_rank_size=1, atten_rank_size=1, rank=rank, group_ep="", aiv_num=AIV,
                                        compute_gate=1)
            back = torch.ops.cam_jit.e2a(expand_x=out[0] if rank == 0 else x, atten_batch_size=out[3], batch_size=4,
                                         hidden_size=64, topk=2, expert_rank_size=1, attention_rank_size=1, rank=rank,
                                         group_ep="", aiv_num=AIV)
    return x, ids, scales, list(out), back


@pytest.mark.parametrize("mode", ["public", "torch.ops", "torch.ops-keywords"])
def test_schema_order_calls(rank_pool, mode):
    (_, _, _, expert_out, expert_back), (x, ids, scales, atten_out, back) = rank_pool(2).run(run_positional, mode)
    assert torch.equal(expert_out[0], x) and torch.equal(expert_out[1], ids) and torch.equal(expert_out[2], scales)
    assert torch.equal(back, x) and expert_back.shape == (1, 1)
    assert [tuple(t.shape) for t in atten_out] == [(1, 1), (1, 1), (1, 1), (1,), (1,)]


def run_repeated_and_backward():
    """Ten alternating calls (tags must not collide), then backward through each op refused."""
    rank = dist.get_rank()
    x, ids, scales, _ = make_inputs(6, 1, 1, rank, 3, 32, 1, BF16, 1)
    for i in range(10):
        src = x * (i + 1) if rank else x
        out = a2e(src, ids, scales, 3, 32, 1, 1, 1, rank, "", AIV, 1)
        back = e2a(out[0] if rank == 0 else src, out[3], 3, 32, 1, 1, 1, rank, "", AIV)
        if rank == 1:
            assert torch.equal(back, src), i
    errors = []
    x = x.detach().requires_grad_(True)
    expand = torch.zeros(3, 32, dtype=BF16, requires_grad=rank == 0)
    out = a2e(x, ids, scales, 3, 32, 1, 1, 1, rank, "", AIV, 1)
    back = e2a(expand if rank == 0 else x, out[3], 3, 32, 1, 1, 1, rank, "", AIV)
    for t in (out[0], back):
        try:
            t.float().sum().backward()
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


def test_repeated_calls_and_backward_refused(rank_pool):
    for errors in rank_pool(2).run(run_repeated_and_backward):
        assert len(errors) == 2 and all("inference-only" in e for e in errors), errors


def test_fake_kernels_follow_the_role():
    with FakeTensorMode():
        placeholder = torch.empty(0, 64, dtype=BF16)
        ids, scales = torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2)
        expert = torch.ops.cam_jit.a2e(placeholder, ids, scales, 12, 64, 2, 2, 5, 1, "g", AIV, 1)
        x = torch.empty(4, 64, dtype=FP16)
        ids, scales = torch.empty(4, 2, dtype=torch.int32), torch.empty(4, 2)
        atten = torch.ops.cam_jit.a2e(x, ids, scales, 12, 64, 2, 2, 5, 5, "g", AIV, 1)
        back_attention = torch.ops.cam_jit.e2a(x, atten[3], 12, 64, 2, 2, 5, 5, "g", AIV)
        back_expert = torch.ops.cam_jit.e2a(expert[0], expert[3], 12, 64, 2, 2, 5, 1, "g", AIV)
    for got, want in ((expert, expected_shapes(2, 5, 1, 12, 64, 2)), (atten, expected_shapes(2, 5, 5, 12, 64, 2))):
        assert [(tuple(t.shape), t.dtype) for t in got] == want
    assert (tuple(back_attention.shape), back_attention.dtype) == ((4, 64), BF16)
    assert (tuple(back_expert.shape), back_expert.dtype) == ((1, 1), BF16)


def run_compiled():
    rank = dist.get_rank()
    x, ids, scales, _ = make_inputs(7, 1, 1, rank, 4, 32, 2, BF16, 1)

    def step(x, ids, scales):
        out = a2e(x, ids, scales, 4, 32, 2, 1, 1, rank, "", AIV, 1)
        return e2a(out[0] if rank == 0 else x, out[3], 4, 32, 2, 1, 1, rank, "", AIV)

    with torch.no_grad():
        return x, torch.compile(step, backend="aot_eager", fullgraph=True)(x, ids, scales)


def test_torch_compile(rank_pool):
    (_, expert_back), (x, back) = rank_pool(2).run(run_compiled)
    assert torch.equal(back, x) and expert_back.shape == (1, 1)


def run_opcheck():
    rank = dist.get_rank()
    x, ids, scales, _ = make_inputs(8, 1, 1, rank, 4, 32, 2, BF16, 1)
    a2e_call = (x, ids, scales, 4, 32, 2, 1, 1, rank, "", AIV, 1)
    out = torch.ops.cam_jit.a2e(*a2e_call)
    e2a_call = (out[0] if rank == 0 else x, out[3], 4, 32, 2, 1, 1, rank, "", AIV)
    return [torch.library.opcheck(torch.ops.cam_jit.a2e.default, a2e_call),
            torch.library.opcheck(torch.ops.cam_jit.e2a.default, e2a_call)]


def test_opcheck(rank_pool):
    """Schema, autograd registration, fake kernel and AOT dispatch (torch.library.opcheck)."""
    for reports in rank_pool(2).run(run_opcheck):
        for report in reports:
            assert set(report.values()) == {"SUCCESS"}, report


def run_missing_peer():
    """On a throw-away subgroup: rank 1 never calls a2e; rank 0 must raise, not hang."""
    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    saved = os.environ.get("CAM_JIT_COMM_TIMEOUT")
    os.environ["CAM_JIT_COMM_TIMEOUT"] = "2"
    try:
        if rank == 0:
            x = torch.empty(0, 32, dtype=BF16)
            a2e(x, None, None, 4, 32, 1, 1, 1, 0, group, AIV, 0)
        return None
    except RuntimeError as exc:
        return str(exc)
    finally:
        if saved is None:
            del os.environ["CAM_JIT_COMM_TIMEOUT"]
        else:
            os.environ["CAM_JIT_COMM_TIMEOUT"] = saved
        dist.destroy_process_group(group)


def test_missing_peer_times_out(rank_pool):
    message, _ = rank_pool(2).run_with_timeout(60, run_missing_peer)
    assert message is not None and "a2e: argument agreement" in message, message
    # rank 1 destroys the group at once: rank 0 says that a peer dropped out, not that time ran out
    assert "a peer rank dropped its connection" in message and "of its 2 s limit" in message, message


# ----------------------------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------------------------
BS, H, K = 4, 64, 2


def a2e_args(**over):
    """Valid a2e arguments of the attention rank of a 1 + 1 layout."""
    kw = dict(x=torch.zeros(BS, H, dtype=BF16), expert_ids=torch.zeros(BS, K, dtype=torch.int32),
              scales=torch.zeros(BS, K), batch_size=BS, hidden_size=H, topk=K, expert_rank_size=1,
              atten_rank_size=1, rank=1, group_ep="", aiv_num=AIV, compute_gate=1)
    kw.update(over)
    return kw


def e2a_args(**over):
    """Valid e2a arguments of the expert rank of a 1 + 1 layout."""
    kw = dict(expand_x=torch.zeros(BS, H, dtype=BF16), atten_batch_size=torch.zeros(1, dtype=torch.int32),
              batch_size=BS, hidden_size=H, topk=K, expert_rank_size=1, attention_rank_size=1, rank=0, group_ep="",
              aiv_num=AIV)
    kw.update(over)
    return kw


A2E_CASES = [  # (id, overrides, exception, fragments of the message)
    ("x-not-tensor", dict(x=[[1.0]]), TypeError, ["'x'", "torch.Tensor", "list"]),
    ("x-3d", dict(x=torch.zeros(BS, H, 1, dtype=BF16)), ValueError, ["'x'", "2-D", "3-D"]),
    ("x-float32", dict(x=torch.zeros(BS, H)), TypeError, ["'x'", "bfloat16 or float16", "float32"]),
    ("x-hidden", dict(x=torch.zeros(BS, H + 1, dtype=BF16)), ValueError, ["'x'", f"hidden_size ({H})", f"{H + 1}"]),
    ("expert-x-hidden", dict(rank=0, x=torch.zeros(0, H // 2, dtype=BF16)), ValueError, ["'x'", f"hidden_size ({H})"]),
    ("ids-int64", dict(expert_ids=torch.zeros(BS, K, dtype=torch.int64)), TypeError,
     ["'expert_ids'", "int32", "int64"]),
    ("ids-topk", dict(expert_ids=torch.zeros(BS, K + 1, dtype=torch.int32)), ValueError,
     ["'expert_ids'", str([BS, K]), str([BS, K + 1])]),
    ("ids-batch", dict(expert_ids=torch.zeros(BS - 1, K, dtype=torch.int32)), ValueError,
     ["'expert_ids'", str([BS, K]), str([BS - 1, K])]),
    ("ids-missing", dict(expert_ids=None), ValueError, ["'expert_ids'", "compute_gate=1", "None"]),
    ("ids-not-tensor", dict(expert_ids=[0, 1]), TypeError, ["'expert_ids'", "torch.Tensor", "list"]),
    ("ids-device", dict(expert_ids=torch.zeros(BS, K, dtype=torch.int32, device="meta")), ValueError,
     ["'expert_ids'", "cpu", "meta"]),
    ("scales-dtype", dict(scales=torch.zeros(BS, K, dtype=FP16)), TypeError, ["'scales'", "float32", "float16"]),
    ("scales-shape", dict(scales=torch.zeros(BS, 1)), ValueError, ["'scales'", str([BS, K]), str([BS, 1])]),
    ("scales-missing", dict(scales=None), ValueError, ["'scales'", "compute_gate=1", "None"]),
    ("expert-ids-dtype-unused", dict(rank=0, expert_ids=torch.zeros(0, K)), TypeError,
     ["'expert_ids'", "int32", "float32"]),
    ("batch-negative", dict(batch_size=-1), ValueError, ["'batch_size'", ">= 0", "got -1"]),
    ("batch-float", dict(batch_size=4.0), TypeError, ["'batch_size'", "an int", "float"]),
    ("hidden-zero", dict(hidden_size=0), ValueError, ["'hidden_size'", "> 0", "got 0"]),
    ("topk-zero", dict(topk=0), ValueError, ["'topk'", "> 0", "got 0"]),
    ("experts-zero", dict(expert_rank_size=0), ValueError, ["'expert_rank_size'", "> 0", "got 0"]),
    ("attention-fewer", dict(expert_rank_size=2, rank=2), ValueError,
     ["'atten_rank_size'", ">= expert_rank_size (2)", "got 1"]),
    ("rank-range", dict(rank=2), ValueError, ["'rank'", "0 <= rank < expert_rank_size + atten_rank_size (2)", "got 2"]),
    ("rank-negative", dict(rank=-1), ValueError, ["'rank'", "got -1"]),
    ("rank-bool", dict(rank=True), TypeError, ["'rank'", "an int", "bool"]),
    ("gate-two", dict(compute_gate=2), ValueError, ["'compute_gate'", "0 or 1", "got 2"]),
    ("aiv-str", dict(aiv_num="8"), TypeError, ["'aiv_num'", "an int", "str"]),
    ("group-int", dict(group_ep=3), TypeError, ["'group_ep'", "ProcessGroup", "int"]),
    ("group-unknown", dict(group_ep="no-such-group"), ValueError, ["'group_ep'", "process group", "'no-such-group'"]),
    ("strict-str", dict(strict="yes"), TypeError, ["'strict'", "bool", "str"]),
]

E2A_CASES = [
    ("expand-not-tensor", dict(expand_x=3), TypeError, ["'expand_x'", "torch.Tensor", "int"]),
    ("expand-1d", dict(expand_x=torch.zeros(BS * H, dtype=BF16)), ValueError, ["'expand_x'", "2-D", "1-D"]),
    ("expand-int8", dict(expand_x=torch.zeros(BS, H, dtype=torch.int8)), TypeError,
     ["'expand_x'", "bfloat16 or float16", "int8"]),
    ("expand-hidden", dict(expand_x=torch.zeros(BS, 2 * H, dtype=BF16)), ValueError,
     ["'expand_x'", f"hidden_size ({H})", str([BS, 2 * H])]),
    ("expand-rows-on-expert", dict(expand_x=torch.zeros(BS + 1, H, dtype=BF16)), ValueError,
     ["'expand_x'", f"[{BS}, {H}]", str([BS + 1, H])]),
    ("attention-hidden", dict(rank=1, expand_x=torch.zeros(2, H - 1, dtype=BF16)), ValueError,
     ["'expand_x'", f"hidden_size ({H})"]),
    ("atten-bs-not-tensor", dict(atten_batch_size=[1]), TypeError, ["'atten_batch_size'", "torch.Tensor", "list"]),
    ("atten-bs-int64", dict(atten_batch_size=torch.zeros(1, dtype=torch.int64)), TypeError,
     ["'atten_batch_size'", "int32", "int64"]),
    ("atten-bs-device", dict(atten_batch_size=torch.zeros(1, dtype=torch.int32, device="meta")), ValueError,
     ["'atten_batch_size'", "cpu", "meta"]),
    ("batch-negative", dict(batch_size=-5, expand_x=torch.zeros(0, H, dtype=BF16)), ValueError,
     ["'batch_size'", ">= 0", "got -5"]),
    ("hidden-negative", dict(hidden_size=-1), ValueError, ["'hidden_size'", "> 0", "got -1"]),
    ("topk-zero", dict(topk=0), ValueError, ["'topk'", "> 0", "got 0"]),
    ("experts-negative", dict(expert_rank_size=-1), ValueError, ["'expert_rank_size'", "> 0", "got -1"]),
    ("attention-fewer", dict(expert_rank_size=3, attention_rank_size=2), ValueError,
     ["'attention_rank_size'", ">= expert_rank_size (3)", "got 2"]),
    ("rank-range", dict(rank=5), ValueError, ["'rank'", "attention_rank_size (2)", "got 5"]),
    ("aiv-float", dict(aiv_num=8.0), TypeError, ["'aiv_num'", "an int", "float"]),
    ("group-none", dict(group_ep=None), TypeError, ["'group_ep'", "NoneType"]),
    ("strict-int", dict(strict=1), TypeError, ["'strict'", "bool", "int"]),
]


def assert_raises(fn, kw, exc, fragments, op):
    with pytest.raises(exc) as info:
        fn(**kw)
    message = str(info.value)
    assert message.startswith(op + ": "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("overrides,exc,fragments", [c[1:] for c in A2E_CASES], ids=[c[0] for c in A2E_CASES])
def test_a2e_bad_argument(overrides, exc, fragments):
    assert_raises(a2e, a2e_args(**overrides), exc, fragments, "a2e")


@pytest.mark.parametrize("overrides,exc,fragments", [c[1:] for c in E2A_CASES], ids=[c[0] for c in E2A_CASES])
def test_e2a_bad_argument(overrides, exc, fragments):
    assert_raises(e2a, e2a_args(**overrides), exc, fragments, "e2a")


def test_table_baselines_are_valid():
    """Each table case fails for its own override: the baselines pass basic validation (the
    full calls with these arguments run in test_schema_order_calls)."""
    kw = a2e_args()
    assert validate_a2e(**kw).rank == 1
    assert validate_a2e(**dict(kw, compute_gate=0, expert_ids=None, scales=None)).rank == 1
    assert validate_e2a(**e2a_args()).is_expert


def a2e_group_size_case(rank):
    return a2e_args(rank=rank, atten_rank_size=2)


def a2e_swapped_rank_case(rank):
    return a2e_args(rank=1 - rank, x=torch.zeros(0 if rank == 1 else BS, H, dtype=BF16))


def a2e_hidden_disagrees_case(rank):
    hidden = H if rank == 0 else 2 * H
    return a2e_args(rank=rank, hidden_size=hidden, x=torch.zeros(0 if rank == 0 else BS, hidden, dtype=BF16))


def a2e_gate_disagrees_case(rank):
    return a2e_args(rank=rank, compute_gate=rank % 2, x=torch.zeros(0 if rank == 0 else BS, H, dtype=BF16))


def a2e_batch_mismatch_case(rank):  # 1 + 3, BE = 9: P = 3, attention rank 2 has 4 rows
    rows = {0: 0, 1: 3, 2: 4, 3: 3}[rank]
    return a2e_args(rank=rank, atten_rank_size=3, batch_size=9, x=torch.zeros(rows, H, dtype=BF16),
                    expert_ids=torch.zeros(rows, K, dtype=torch.int32), scales=torch.zeros(rows, K))


def e2a_batch_too_big_case(rank):  # 1 + 3, BE = 9: Q = 3, attention rank 3 asks for 4 rows
    rows = {0: 9, 1: 3, 2: 3, 3: 4}[rank]
    return e2a_args(rank=rank, attention_rank_size=3, batch_size=9, expand_x=torch.zeros(rows, H, dtype=BF16))


GROUP_CASES = [  # (ranks, op, per-rank arguments, fragments, whether every rank raises the same message)
    (2, "a2e", a2e_group_size_case, ["'expert_rank_size' + 'atten_rank_size'", "expected 2", "got 3"], True),
    (2, "a2e", a2e_swapped_rank_case, ["'rank'", "this process's rank"], False),
    (2, "a2e", a2e_hidden_disagrees_case, ["'hidden_size'", "same value on all 2 ranks", "{0: 64, 1: 128}"], True),
    (2, "a2e", a2e_gate_disagrees_case, ["'compute_gate'", "{0: 0, 1: 1}"], True),
    (4, "a2e", a2e_batch_mismatch_case, ["'x'", "x.shape[0] == 3 on attention rank 2", "4 rows"], True),
    (4, "e2a", e2a_batch_too_big_case, ["'expand_x'", "at most 3 rows on attention rank 3", "4 rows"], True),
]


@pytest.mark.parametrize("world,op,case,fragments,same", GROUP_CASES, ids=[c[2].__name__ for c in GROUP_CASES])
def test_group_consistency_errors(rank_pool, world, op, case, fragments, same):
    """Every rank raises (none is left waiting for a peer); cross-rank checks agree."""
    results = rank_pool(world).run_with_timeout(60, call_in_pool, op, case)
    assert all(r is not None and r[0] == "ValueError" for r in results), results
    messages = {r[1] for r in results}
    assert len(messages) == 1 or not same, messages
    for message in messages:
        assert message.startswith(op + ": ") and all(f in message for f in fragments), message


# ----------------------------------------------------------------------------------------------
# strict mode (SPEC §2.5, §7.5)
# ----------------------------------------------------------------------------------------------
STRICT_A2E = [  # (overrides, argument, upstream text)
    (dict(rank=2), "rank", "rank must >= 0 and < expertRankSize + attentionRankSize"),
    (dict(rank=0, batch_size=0, x=torch.zeros(0, 1024, dtype=BF16)), "batch_size", "batchSize must >= 0 and <= 1024"),
    (dict(rank=0, batch_size=1025, x=torch.zeros(0, 1024, dtype=BF16)), "batch_size", "batchSize must"),
    (dict(x=torch.zeros(1025, 1024, dtype=BF16), expert_ids=torch.zeros(1025, K, dtype=torch.int32),
          scales=torch.zeros(1025, K)), "x.shape[0]", "batchSize must"),
    (dict(hidden_size=512, x=torch.zeros(BS, 512, dtype=BF16)), "hidden_size",
     "hiddenSize must >= 1024 and <= 7168 and be divisible by 256"),
    (dict(hidden_size=1100, x=torch.zeros(BS, 1100, dtype=BF16)), "hidden_size", "hiddenSize must"),
    (dict(hidden_size=7424, x=torch.zeros(BS, 7424, dtype=BF16)), "hidden_size", "hiddenSize must"),
    (dict(topk=9, expert_ids=torch.zeros(BS, 9, dtype=torch.int32), scales=torch.zeros(BS, 9)), "topk",
     "topk must >= 1 and <= 8"),
    (dict(expert_rank_size=2, rank=2), "expert_rank_size", "expertRankSize must > 0 and <= attentionRankSize"),
    (dict(aiv_num=3), "aiv_num", "aivAlgNum must >= 4 and <= 48"),
    (dict(aiv_num=49), "aiv_num", "aivAlgNum must"),
    (dict(compute_gate=2), "compute_gate", "computeGate must be 0 or 1"),
    (dict(rank=5, hidden_size=512, aiv_num=1), "rank", "rank must"),  # upstream order: rank first
]


@pytest.mark.parametrize("overrides,arg,text", STRICT_A2E, ids=[f"a2e-{c[1]}-{i}" for i, c in enumerate(STRICT_A2E)])
def test_strict_a2e_limits(overrides, arg, text):
    kw = a2e_args(x=torch.zeros(BS, 1024, dtype=BF16), hidden_size=1024)
    kw.update(overrides)
    assert_raises(a2e, dict(kw, strict=True), ValueError,
                  [f"'{arg}' = ", f"CAM A2E PARAMETER INVALID: {text}", "CheckData failed."], "a2e")


STRICT_E2A = [
    (dict(rank=-1), "rank", "rank must >= 0 and < expertRankSize + attentionRankSize"),
    (dict(batch_size=0, expand_x=torch.zeros(0, 1024, dtype=BF16)), "batch_size", "batchSize must >= 0 and <= 1024"),
    (dict(rank=1, expand_x=torch.zeros(0, 1024, dtype=BF16)), "expand_x.shape[0]", "batchSize must"),
    (dict(hidden_size=512, expand_x=torch.zeros(BS, 512, dtype=BF16)), "hidden_size", "hiddenSize must"),
    (dict(topk=0), "topk", "topk must >= 1 and <= 8"),
    (dict(expert_rank_size=2, attention_rank_size=1), "expert_rank_size", "expertRankSize must > 0"),
    (dict(aiv_num=50), "aiv_num", "aivAlgNum must >= 4 and <= 48"),
]


@pytest.mark.parametrize("overrides,arg,text", STRICT_E2A, ids=[f"e2a-{c[1]}-{i}" for i, c in enumerate(STRICT_E2A)])
def test_strict_e2a_limits(overrides, arg, text):
    kw = e2a_args(expand_x=torch.zeros(BS, 1024, dtype=BF16), hidden_size=1024)
    kw.update(overrides)
    assert_raises(e2a, dict(kw, strict=True), ValueError,
                  [f"'{arg}' = ", f"CAM E2A PARAMETER INVALID: {text}", "CheckData failed."], "e2a")


def test_strict_requires_bfloat16():
    assert_raises(a2e, a2e_args(x=torch.zeros(BS, 1024, dtype=FP16), hidden_size=1024, strict=True), TypeError,
                  ["'x'", "bfloat16", "strict mode", "float16"], "a2e")
    assert_raises(e2a, e2a_args(expand_x=torch.zeros(BS, 1024, dtype=FP16), hidden_size=1024, strict=True),
                  TypeError, ["'expand_x'", "bfloat16", "strict mode", "float16"], "e2a")


def test_strict_switches(monkeypatch):
    """CAM_JIT_STRICT turns the limits on; strict=False overrides it (then basic validation runs
    and, here, fails on the group instead)."""
    kw = a2e_args(x=torch.zeros(BS, 512, dtype=BF16), hidden_size=512, group_ep="no-such-group")
    monkeypatch.setenv("CAM_JIT_STRICT", "1")
    assert_raises(a2e, kw, ValueError, ["hiddenSize must"], "a2e")
    assert_raises(a2e, dict(kw, strict=False), ValueError, ["'group_ep'", "no-such-group"], "a2e")
    monkeypatch.setenv("CAM_JIT_STRICT", "0")
    assert_raises(a2e, kw, ValueError, ["'group_ep'"], "a2e")
    assert_raises(a2e, dict(kw, strict=True), ValueError, ["hiddenSize must"], "a2e")
