"""cam_jit.quantize_experts: float SwiGLU experts -> fused_deep_moe's W8A8 / W4A8 arguments.

The round-trip bound is checked in float64 on the stored values; the W4A8 packing and biases
against the independent helpers of cam_jit.reference; the layouts against the weight helpers."""
import pytest
import torch

import cam_jit
from cam_jit import reference
from cam_jit.ops.weights import nd_to_nz, nz_to_nd, permute_gmm1_weight, unpermute_gmm1_weight

E, H, I = 3, 64, 128
QMAX = {"w8a8": 127, "w4a8": 7}


def float_experts(seed=0, experts=E, hidden=H, inter=I, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(experts, inter, hidden, generator=gen) * 0.05
    up = torch.randn(experts, inter, hidden, generator=gen).pow(3) * 0.02  # heavy-tailed columns
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.05
    gate[0, 5] = 0.0  # an all-zero output column of gmm1
    return gate.to(dtype), up.to(dtype), down.to(dtype)


def int_values(q, scheme):
    """The integer weight values (int4 unpacked with the reference's helper) as float64."""
    return (reference.unpack_int4(q) if scheme == "w4a8" else q).to(torch.float64)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_error_bound(scheme, dtype):
    gate, up, down = float_experts(dtype=dtype)
    q = cam_jit.quantize_experts(gate, up, down, scheme)
    qmax = QMAX[scheme]
    for name, w, values, scale in (
            ("gmm1", torch.cat([gate, up], 1).transpose(1, 2), q.gmm1_weight, q.gmm1_weight_scale),
            ("gmm2", down.transpose(1, 2), q.gmm2_weight, q.gmm2_weight_scale)):
        assert scale.dtype == torch.float32
        ints = int_values(values, scheme)
        assert ints.abs().max() <= qmax
        s = scale.to(torch.float64).unsqueeze(1)
        err = (w.to(torch.float64) - ints * s).abs()
        bound = s * (0.5 + qmax * 2.0 ** -23)
        assert bool((err <= bound).all()), f"{name}: worst error {(err / bound).max():.4f} x the bound"
        amax = w.to(torch.float64).abs().amax(dim=1)
        assert torch.allclose(scale.to(torch.float64), amax / qmax, rtol=1e-6, atol=0)
        # the bound is tight: errors come close to half a step, and each column's largest weight maps to +-Q
        assert (err / s.clamp_min(1e-30)).max() > 0.45
        nonzero = amax > 0
        assert bool((ints.abs().amax(dim=1) == qmax)[nonzero].all())
    assert not bool(q.gmm1_weight_scale[0, 5]) and not int_values(q.gmm1_weight, scheme)[0, :, 5].any()


def test_layout_and_dtypes():
    gate, up, down = float_experts()
    w8 = cam_jit.quantize_experts(gate, up, down, "w8a8")
    assert (w8.gmm1_weight.shape, w8.gmm1_weight.dtype) == ((E, H, 2 * I), torch.int8)
    assert (w8.gmm2_weight.shape, w8.gmm2_weight.dtype) == ((E, I, H), torch.int8)
    assert w8.gmm1_weight_scale.shape == (E, 2 * I) and w8.gmm2_weight_scale.shape == (E, H)
    assert w8.gmm1_bias is None and w8.gmm2_bias is None
    # [gate | up], input-major: dequantized column j < I is gate row j, column I + j is up row j
    deq = w8.gmm1_weight.float() * w8.gmm1_weight_scale.unsqueeze(1)
    assert torch.allclose(deq[:, :, :I], gate.transpose(1, 2), atol=0.05 * 4 / 127)
    assert torch.allclose(deq[:, :, I:], up.transpose(1, 2), atol=float(up.abs().max()) / 127)
    w4 = cam_jit.quantize_experts(gate, up, down, "w4a8")
    assert (w4.gmm1_weight.shape, w4.gmm1_weight.dtype) == ((E, H, 2 * I // 8), torch.int32)
    assert (w4.gmm2_weight.shape, w4.gmm2_weight.dtype) == ((E, I, H // 8), torch.int32)
    assert torch.equal(w4.gmm1_bias, reference.w4a8_compensation_bias(w4.gmm1_weight, w4.gmm1_weight_scale))
    assert torch.equal(w4.gmm2_bias, reference.w4a8_compensation_bias(w4.gmm2_weight, w4.gmm2_weight_scale))


def test_lists_single_experts_and_slices():
    gate, up, down = float_experts()
    stacked = cam_jit.quantize_experts(gate, up, down, "w4a8")
    listed = cam_jit.quantize_experts(list(gate), list(up), list(down), "w4a8")
    one = cam_jit.quantize_experts(gate[1], up[1], down[1], "w4a8")
    part = stacked.experts(1, 3)
    assert stacked.num_experts == E and one.num_experts is None and part.num_experts == 2
    for name, t in stacked.tensors().items():
        assert torch.equal(t, listed.tensors()[name]), name
        assert torch.equal(t[1], one.tensors()[name]), name
        assert torch.equal(t[1:3], part.tensors()[name]), name


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_npu_layout_options(scheme):
    gate, up, down = float_experts()
    base = cam_jit.quantize_experts(gate, up, down, scheme)
    permuted = cam_jit.quantize_experts(gate, up, down, scheme, gmm1_layout="permuted")
    nz = cam_jit.quantize_experts(gate, up, down, scheme, weight_format="nz")
    assert (permuted.gmm1_layout, nz.weight_format) == ("permuted", "nz")
    for name in ("gmm1_weight", "gmm1_weight_scale") + (("gmm1_bias",) if scheme == "w4a8" else ()):
        t = getattr(permuted, name)
        assert torch.equal(t, permute_gmm1_weight(getattr(base, name)))
        assert torch.equal(unpermute_gmm1_weight(t), getattr(base, name))
    assert torch.equal(permuted.gmm2_weight, base.gmm2_weight)
    for name in ("gmm1_weight", "gmm2_weight"):
        assert torch.equal(getattr(nz, name), nd_to_nz(getattr(base, name)))
        assert torch.equal(nz_to_nd(getattr(nz, name)), getattr(base, name))
    assert not torch.equal(nz.gmm1_weight, base.gmm1_weight)  # several column fractals: a real reorder
    with pytest.raises(ValueError, match="gmm1_layout 'concat' and weight_format 'nd'"):
        nz.routed_arguments()


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_arguments_feed_fused_deep_moe(scheme):
    """routed_arguments / shared_arguments are fused_deep_moe's keywords; the op on them equals the
    reference on them."""
    gate, up, down = float_experts(experts=4)
    routed = cam_jit.quantize_experts(gate, up, down, scheme)
    shared = cam_jit.quantize_experts(gate[0], up[0], down[0], scheme)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)]).to(torch.int32)
    kw = dict(x=x, expert_ids=ids, expert_scales=torch.rand(6, 2, generator=gen), **routed.routed_arguments(),
              **shared.shared_arguments(), group_ep="", ep_rank_size=1, ep_rank_id=0, moe_expert_num=4)
    with torch.no_grad():
        got, want = cam_jit.fused_deep_moe(**kw), reference.fused_deep_moe(**kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[1].abs().sum() > 0


@pytest.mark.parametrize("call, error, match", [
    (lambda g, u, d: cam_jit.quantize_experts(g, u, d, "w2a8"), ValueError, "argument 'scheme'"),
    (lambda g, u, d: cam_jit.quantize_experts(g, u, d, gmm1_layout="zigzag"), ValueError, "argument 'gmm1_layout'"),
    (lambda g, u, d: cam_jit.quantize_experts(g, u, d, weight_format="nc1hwc0"), ValueError, "'weight_format'"),
    (lambda g, u, d: cam_jit.quantize_experts(g, u[:, :-1], d), ValueError, "argument 'up_proj'"),
    (lambda g, u, d: cam_jit.quantize_experts(g, u, d.transpose(1, 2)), ValueError, "argument 'down_proj'"),
    (lambda g, u, d: cam_jit.quantize_experts(g.to(torch.int8), u, d), TypeError, "floating-point"),
    (lambda g, u, d: cam_jit.quantize_experts(g[0, 0], u, d), ValueError, "argument 'gate_proj'"),
    (lambda g, u, d: cam_jit.quantize_experts([], u, d), TypeError, "argument 'gate_proj'"),
    (lambda g, u, d: cam_jit.quantize_experts(g, u, d.index_fill(2, torch.tensor([0]), float("nan"))),
     ValueError, "argument 'down_proj': expected finite values"),
    (lambda g, u, d: cam_jit.quantize_experts(g[:, :, :60], u[:, :, :60], d[:, :60], "w4a8"), ValueError,
     "multiples of 8 under W4A8"),
    (lambda g, u, d: cam_jit.quantize_experts(g[:, :32], u[:, :32], d[:, :, :32], gmm1_layout="permuted"),
     ValueError, "multiple of tile = 64"),
    (lambda g, u, d: cam_jit.quantize_experts(g, u, d).experts(2, 5), ValueError, "start < stop <= 3"),
])
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call(*float_experts())
