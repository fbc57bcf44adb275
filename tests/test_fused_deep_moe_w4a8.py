"""W4A8 cam_jit.fused_deep_moe (int32-packed int4 weights + compensation biases, SPEC.md §1.5,
§1.9, §1.10) on the JIT-compiled C++ path against cam_jit.reference.fused_deep_moe (plain torch,
written from SPEC.md) on real gloo process groups of R = 1, 2, 4 ranks, plus two checks that do
not use the reference: W4A8 equals W8A8 math on the unpacked weights up to float32 rounding, and
the fake kernel's shapes."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cam_jit
from cam_jit import reference
from cam_jit.ops.weights import pack_int4, unpack_int4, w4a8_compensation_bias
from moe_cases import make_rank_case, make_single_rank_case
from test_fused_deep_moe import SMALL, check_case, op_only

W4A8 = dict(SMALL, variant="w4a8")


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(rank_pool, ranks, dtype):
    check_case(rank_pool, 31, ranks=ranks, bs=8, dtype=dtype, **W4A8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scales_in_activation_dtype(rank_pool, dtype):
    check_case(rank_pool, 32, ranks=2, bs=6, dtype=dtype, scale_dtype=dtype, **W4A8)


@pytest.mark.parametrize("leading_one", [False, True], ids=["2d", "leading-1"])
def test_shared_expert_with_biases(rank_pool, leading_one):
    """Shared W4A8 expert (Is != I) with share_gmm1_bias / share_gmm2_bias; inactive tokens too."""
    check_case(rank_pool, 33, ranks=2, bs=[6, 4], share_inter=96, share_leading_one=leading_one,
               active_counts=[4, 1], **W4A8)


def test_per_expert_lists_smooth_and_masks(rank_pool):
    """Per-expert weight, scale and bias lists, smooth scales and an active mask together."""
    check_case(rank_pool, 34, ranks=2, bs=[7, 5], per_expert_lists=True, smooth=True, share_inter=64,
               active_counts=[5, 0], **W4A8)


def test_one_local_expert_unstacked(rank_pool):
    """E_loc == 1: the single 2-D weight / 1-D scale and bias form of SPEC.md §1.3."""
    check_case(rank_pool, 35, ranks=2, bs=4, per_expert_lists=True, **dict(W4A8, experts=2, topk=2))


def test_variable_batches_and_skipped_slots(rank_pool):
    results = check_case(rank_pool, 36, ranks=4, bs=[5, 0, 9, 1], global_bs=36, minus_one_frac=0.25,
                         zero_rows=[0], **W4A8)
    for runs, _ in results:
        out = runs[0][0]
        assert out.shape[0] == 0 or not out[0].any()  # zero tokens give zero, not NaN


def test_wider_shapes(rank_pool):
    """H = 1024, I = 512 (several 64-column tiles and int32 words per row), top-8 of 16."""
    check_case(rank_pool, 37, ranks=2, bs=[3, 2], hidden=1024, inter=512, experts=16, topk=8, variant="w4a8")


def test_distributed_equals_single_process_bitwise(rank_pool):
    """SPEC.md §1.13: the result does not depend on how the W4A8 experts are spread over ranks."""
    params = dict(ranks=4, bs=[3, 6, 0, 4], minus_one_frac=0.2, share_inter=32, **W4A8)
    dist_out = rank_pool(4).run(op_only, 38, params)
    single_kw, rows = make_single_rank_case(38, **params)
    with torch.no_grad():
        single = cam_jit.fused_deep_moe(**single_kw)
    for rank, (out, share_out, _) in enumerate(dist_out):
        assert torch.equal(out, single[0][rows[rank]]), f"rank {rank}"
        assert torch.equal(share_out, single[1][rows[rank]]), f"rank {rank}"
    assert torch.equal(torch.cat([c for _, _, c in dist_out]), single[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rounding_sequence_bitwise_on_one_rank(dtype):
    """The kernel performs SPEC.md §1.9's float32 operations in the reference's order (and the
    same ATen exp on the same [rows, I] blocks), so on one rank the two agree bitwise. The 1-ulp
    bar above lets a reordered dequantisation through; this does not."""
    kw = make_rank_case(42, 0, ranks=1, bs=32, dtype=dtype, share_inter=128, smooth=True, hidden=1024,
                        inter=512, experts=4, topk=2, variant="w4a8")
    with torch.no_grad():
        got = cam_jit.fused_deep_moe(**kw)
        want = reference.fused_deep_moe(**kw)
    for name, a, b in zip(("output", "share_output", "expert_token_nums"), got, want):
        assert torch.equal(a, b), f"{name}: {(a != b).float().mean():.3%} of the elements differ"


def _as_w8a8(kw):
    """The same layer with the int4 values stored as int8 (W8A8) and no biases."""
    def unpacked(items):
        return [unpack_int4(t) for t in items]

    return dict(kw, gmm1_weight=unpacked(kw["gmm1_weight"]), gmm2_weight=unpacked(kw["gmm2_weight"]),
                gmm1_bias=[], gmm2_bias=[], share_gmm1_weight=unpack_int4(kw["share_gmm1_weight"]),
                share_gmm2_weight=unpack_int4(kw["share_gmm2_weight"]), share_gmm1_bias=None,
                share_gmm2_bias=None)


def test_equals_w8a8_math_on_unpacked_weights():
    """SPEC.md §1.9: with the §1.5 bias, W4A8 is W8A8 on the unpacked int4 values in exact
    arithmetic; only float32 rounding differs (an occasional requantisation step, at most)."""
    kw = make_rank_case(39, 0, ranks=1, bs=16, share_inter=64, **W4A8)
    with torch.no_grad():
        w4 = cam_jit.fused_deep_moe(**kw)
        w8 = cam_jit.fused_deep_moe(**_as_w8a8(kw))
    assert torch.equal(w4[2], w8[2])
    for name, a, b in (("output", w4[0], w8[0]), ("share_output", w4[1], w8[1])):
        diff = (a.float() - b.float()).abs()
        scale = b.float().abs().max()
        assert diff.max() <= 0.05 * scale, f"{name}: max diff {diff.max():.4g} vs max |value| {scale:.4g}"
        assert diff.mean() <= 0.002 * scale, f"{name}: mean diff {diff.mean():.4g}"


def test_bias_is_required_for_the_right_result():
    """Without the compensation bias (zeros instead) the result is far off: the bias is used."""
    kw = make_rank_case(40, 0, ranks=1, bs=8, **W4A8)
    zero_bias = dict(kw, gmm1_bias=[torch.zeros_like(kw["gmm1_bias"][0])])
    with torch.no_grad():
        good = cam_jit.fused_deep_moe(**kw)[0].float()
        bad = cam_jit.fused_deep_moe(**zero_bias)[0].float()
    assert (good - bad).abs().mean() > 0.1 * good.abs().mean()


def test_fake_kernel_shapes():
    """The fake kernel validates W4A8 metadata and gives the output shapes without data."""
    kw = make_rank_case(41, 0, ranks=1, bs=5, share_inter=32, per_expert_lists=True, **W4A8)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_kw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else
                   [mode.from_tensor(t) for t in v] if isinstance(v, list) else v for k, v in kw.items()}
        out, share_out, counts = torch.ops.cam_jit.fused_deep_moe(**fake_kw)
    assert out.shape == share_out.shape == (5, SMALL["hidden"]) and out.dtype == torch.bfloat16
    assert counts.shape == (SMALL["experts"],) and counts.dtype == torch.int64


def test_hand_packed_weights():
    """A hand-built 1-expert layer whose int4 weights are packed with pack_int4 gives the same
    result as the W8A8 op on the same int4 values to within the requantisation steps."""
    gen = torch.Generator().manual_seed(42)
    h, i = 64, 32
    w1 = torch.randint(-8, 8, (h, 2 * i), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-8, 8, (i, h), dtype=torch.int8, generator=gen)
    s1, s2 = torch.rand(2 * i, generator=gen) / 20 + 0.02, torch.rand(h, generator=gen) / 20 + 0.02
    p1, p2 = pack_int4(w1), pack_int4(w2)
    x = torch.randn(6, h, generator=gen).to(torch.bfloat16)
    common = dict(x=x, expert_ids=torch.zeros(6, 1, dtype=torch.int32), expert_scales=torch.ones(6, 1),
                  gmm1_weight_scale=s1, gmm2_weight_scale=s2, group_ep="", ep_rank_size=1, ep_rank_id=0,
                  moe_expert_num=1)
    w4 = cam_jit.fused_deep_moe(gmm1_weight=p1, gmm2_weight=p2, gmm1_bias=w4a8_compensation_bias(p1, s1),
                                gmm2_bias=w4a8_compensation_bias(p2, s2), **common)[0].float()
    w8 = cam_jit.fused_deep_moe(gmm1_weight=w1, gmm2_weight=w2, **common)[0].float()
    assert (w4 - w8).abs().max() <= 0.05 * w8.abs().max()
