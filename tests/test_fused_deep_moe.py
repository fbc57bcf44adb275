"""cam_jit.fused_deep_moe (JIT-compiled C++ path) against cam_jit.reference.fused_deep_moe (plain
torch, written from SPEC.md) on real gloo process groups of R = 1, 2, 4 ranks."""
import pytest
import torch
import torch.distributed as dist

import cam_jit
from cam_jit import reference
from moe_cases import make_rank_case, make_single_rank_case

SMALL = dict(hidden=256, inter=128, experts=8, topk=4)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable bf16/fp16 values between a and b (0 = bitwise equal; +0 == -0)."""

    def ordinal(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordinal(a) - ordinal(b)).abs()


def _group_ep(kind):
    if kind == "":
        return ""
    if kind == "object":
        return dist.group.WORLD
    if kind == "name":
        return dist.group.WORLD.group_name
    if kind == "new_group":
        return dist.new_group(list(range(dist.get_world_size())))
    if kind == "registered":
        cam_jit.register_group("ep-under-test", dist.group.WORLD)
        return "ep-under-test"
    raise ValueError(kind)


def op_and_reference(seed, params, group="", repeat=1):
    """On each rank: the op (repeat times) and the reference on the same inputs."""
    kw = make_rank_case(seed, dist.get_rank(), **params)
    kw["group_ep"] = _group_ep(group)
    with torch.no_grad():
        runs = [cam_jit.fused_deep_moe(**kw) for _ in range(repeat)]
        ref_kw = dict(kw, group_ep=dist.group.WORLD if params["ranks"] > 1 else "")
        ref = reference.fused_deep_moe(**ref_kw)
    return runs, ref


def op_only(seed, params):
    kw = make_rank_case(seed, dist.get_rank(), **params)
    with torch.no_grad():
        return cam_jit.fused_deep_moe(**kw)


def assert_matches(got, ref, context):
    out, share_out, counts = got
    r_out, r_share, r_counts = ref
    assert out.dtype == r_out.dtype and out.shape == r_out.shape, context
    assert torch.equal(counts, r_counts), f"{context}: expert_token_nums {counts.tolist()} != {r_counts.tolist()}"
    assert counts.dtype == torch.int64
    for name, a, b in (("output", out, r_out), ("share_output", share_out, r_share)):
        if a.numel() == 0:
            continue
        dist_ulp = ulp_distance(a, b)
        within = (dist_ulp <= 1).double().mean().item()
        assert within >= 0.999, (
            f"{context}: {name}: only {within:.4%} of elements within 1 ulp of the reference "
            f"(max distance {int(dist_ulp.max())} ulp, max abs diff {(a.float() - b.float()).abs().max():.4g})"
        )
        assert not torch.isnan(a).any(), f"{context}: {name} has NaN"


def check_case(rank_pool, seed, group="", **params):
    results = rank_pool(params["ranks"]).run(op_and_reference, seed, params, group)
    for rank, (runs, ref) in enumerate(results):
        assert_matches(runs[0], ref, f"rank {rank} of {params['ranks']} {params}")
    return results


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(rank_pool, ranks, dtype):
    check_case(rank_pool, 11, ranks=ranks, bs=8, dtype=dtype, **SMALL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scales_in_activation_dtype(rank_pool, dtype):
    check_case(rank_pool, 12, ranks=2, bs=6, dtype=dtype, scale_dtype=dtype, **SMALL)


def test_deepseek_sized_hidden_small_batch(rank_pool):
    """H = 7168, I = 2048 (DeepSeek-V3 expert shapes) at a decode-sized batch."""
    check_case(rank_pool, 13, ranks=2, bs=[3, 2], hidden=7168, inter=2048, experts=4, topk=2)


@pytest.mark.parametrize("shape", [dict(hidden=512, inter=384, experts=16, topk=8),
                                   dict(hidden=96, inter=32, experts=4, topk=1)], ids=["k8", "k1"])
def test_other_shapes(rank_pool, shape):
    check_case(rank_pool, 14, ranks=4, bs=5, **shape)


def test_variable_and_zero_batches(rank_pool):
    results = check_case(rank_pool, 15, ranks=4, bs=[5, 0, 9, 1], global_bs=36, **SMALL)
    out, share_out, _ = results[1][0][0]
    assert out.shape == (0, SMALL["hidden"]) and share_out.shape == (0, SMALL["hidden"])


def test_all_tokens_to_one_rank(rank_pool):
    """Every token routes to rank 0's experts; ranks 1..3 receive nothing."""
    results = check_case(rank_pool, 16, ranks=4, bs=6, hidden=128, inter=64, experts=8, topk=2,
                         empty_experts=list(range(2, 8)))
    counts = [runs[0][2] for runs, _ in results]
    assert counts[0].sum() == 4 * 6 * 2 and all(int(c.sum()) == 0 for c in counts[1:])


def test_expert_without_tokens_and_skipped_slots(rank_pool):
    results = check_case(rank_pool, 17, ranks=2, bs=8, empty_experts=[3, 6], minus_one_frac=0.3, **SMALL)
    for rank, (runs, _) in enumerate(results):
        for local, count in enumerate(runs[0][2].tolist()):
            if rank * 4 + local in (3, 6):
                assert count == 0


def test_topk_zero_gives_zero_output(rank_pool):
    results = check_case(rank_pool, 18, ranks=2, bs=3, hidden=64, inter=32, experts=4, topk=0)
    for runs, _ in results:
        assert not runs[0][0].any() and not runs[0][2].any()


def test_zero_activation_rows_are_zero_not_nan(rank_pool):
    results = check_case(rank_pool, 19, ranks=2, bs=4, zero_rows=[0, 2], **SMALL)
    for runs, _ in results:
        assert not runs[0][0][0].any() and not runs[0][0][2].any()


@pytest.mark.parametrize("group", ["object", "name", "registered", "new_group"])
def test_group_ep_forms(rank_pool, group):
    check_case(rank_pool, 20, group=group, ranks=2, bs=4, **SMALL)


def test_options(rank_pool):
    """Shared expert (Is != I), smooth scales, active mask and per-expert weight lists together."""
    check_case(rank_pool, 21, ranks=2, bs=[6, 4], share_inter=96, smooth=True, active_counts=[4, 0],
               per_expert_lists=True, **SMALL)


def test_distributed_equals_single_process_bitwise(rank_pool):
    """SPEC.md §1.13: the result does not depend on how experts are spread over ranks."""
    params = dict(ranks=4, bs=[3, 7, 0, 5], minus_one_frac=0.2, **SMALL)
    dist_out = rank_pool(4).run(op_only, 22, params)
    single_kw, rows = make_single_rank_case(22, **params)
    with torch.no_grad():
        single = cam_jit.fused_deep_moe(**single_kw)
    for rank, (out, _, counts) in enumerate(dist_out):
        assert torch.equal(out, single[0][rows[rank]]), f"rank {rank}"
    assert torch.equal(torch.cat([c for _, _, c in dist_out]), single[2])


def test_repeatable(rank_pool):
    results = rank_pool(2).run(op_and_reference, 23, dict(ranks=2, bs=8, **SMALL), "", 2)
    for runs, _ in results:
        for a, b in zip(runs[0], runs[1]):
            assert torch.equal(a, b)
