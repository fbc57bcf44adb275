"""cam_jit.nn.FusedDeepMoE: against cam_jit.reference.fused_deep_moe on its own quantized weights
(bit for bit), against the float layer (the documented error), 1 vs 2 ranks, the zero-copy
transport, state_dict, torch.compile(fullgraph=True), extra_repr and bad arguments."""
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cam_jit
from cam_jit import reference
from cam_jit.nn import FusedDeepMoE, sigmoid_group_topk, softmax_topk
from dist_harness import free_port

E, H, I, IS, K, T = 8, 64, 32, 48, 2, 12


def float_layer(seed=0):
    """Float routed experts (gate [E, I, H], up, down [E, H, I]) and a shared expert."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, fan_in):
        return torch.randn(*shape, generator=gen) / fan_in ** 0.5

    experts = (w(E, I, H, fan_in=H), w(E, I, H, fan_in=H), w(E, H, I, fan_in=I))
    shared = (w(IS, H, fan_in=H), w(IS, H, fan_in=H), w(H, IS, fan_in=IS))
    return experts, shared


def tokens(seed=1, n=T):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=gen), torch.randn(n, E, generator=gen) * 2


def build(scheme, shared=True, **kwargs):
    experts, share = float_layer()
    return FusedDeepMoE.from_float(*experts, K, shared=share if shared else None, scheme=scheme, **kwargs)


def float_moe(x, ids, weights, experts, shared):
    """The float layer in float64: sum_k w_k * down(silu(gate x) * up x) + shared(x)."""
    def ffn(v, g, u, d):
        return (F.silu(v @ g.T) * (v @ u.T)) @ d.T

    x = x.double()
    gate, up, down = (t.double() for t in experts)
    out = ffn(x, *(t.double() for t in shared))
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            out[t] += float(weights[t, k]) * ffn(x[t], gate[e], up[e], down[e])
    return out


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
@pytest.mark.parametrize("routing", ["logits", "ids"])
def test_matches_reference_bitwise(scheme, routing):
    module = build(scheme)
    x, logits = tokens()
    ids, weights = softmax_topk(logits, K, True)
    with torch.no_grad():
        if routing == "logits":
            routed, shared = module(x, logits, return_parts=True)
        else:
            routed, shared = module(x, topk_ids=ids.long(), topk_weights=weights, return_parts=True)
        buffers = dict(module.named_buffers())
        args = {n: t for n, t in buffers.items() if not n.startswith("share_")}
        share = {n: t for n, t in buffers.items() if n.startswith("share_")}
        want = reference.fused_deep_moe(x.to(torch.bfloat16), ids, expert_scales=weights, **args, **share,
                                        moe_expert_num=E)
    assert routed.dtype == torch.float32 and routed.shape == x.shape
    assert torch.equal(routed, want[0].float()) and torch.equal(shared, want[1].float())
    assert routed.abs().sum() > 0 and shared.abs().sum() > 0
    with torch.no_grad():
        total = module(x, logits)
    assert torch.equal(total, (want[0].float() + want[1].float()))


@pytest.mark.parametrize("scheme, bound", [("w8a8", 0.03), ("w4a8", 0.3)])
def test_error_against_the_float_layer(scheme, bound):
    """The documented figures: relative RMS error ~1.7 % (W8A8) and ~19 % (W4A8) on random layers."""
    experts, shared = float_layer()
    module = build(scheme)
    x, logits = tokens(n=64)
    ids, weights = module.route(logits)
    with torch.no_grad():
        got = module(x, logits).double()
    want = float_moe(x, ids, weights, experts, shared)
    error = ((got - want).norm() / want.norm()).item()
    assert error < bound, f"relative error {error:.3%}"


def test_routing_matches_softmax_topk_semantics():
    _, logits = tokens()
    ids, weights = softmax_topk(logits, 3, norm_topk_prob=True)
    probs = torch.softmax(logits.double(), -1)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), probs.topk(3).indices)
    assert torch.allclose(weights.double(), probs.topk(3).values / probs.topk(3).values.sum(-1, keepdim=True))
    _, raw = softmax_topk(logits, 3, norm_topk_prob=False)
    assert torch.allclose(raw.double(), probs.topk(3).values)


def test_sigmoid_group_routing_semantics():
    """DeepSeek-V3 routing: experts only from the topk_group best groups (ranked by the sum of
    their two best biased scores), chosen by biased score, weighted by unbiased sigmoid scores."""
    _, logits = tokens(n=64)
    bias = torch.linspace(-0.3, 0.3, E)
    ids, weights = sigmoid_group_topk(logits, 2, True, correction_bias=bias, n_group=4, topk_group=2,
                                      routed_scaling_factor=2.5)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    scores = torch.sigmoid(logits)
    choice = scores + bias
    groups = choice.view(-1, 4, 2).sum(-1)  # two experts per group: their two best are both
    for t in range(logits.shape[0]):
        best_groups = set(groups[t].topk(2).indices.tolist())
        allowed = [e for e in range(E) if e // 2 in best_groups]
        want = sorted(allowed, key=lambda e: -float(choice[t, e]))[:2]
        assert sorted(ids[t].tolist()) == sorted(want)
        chosen = scores[t, ids[t].long()]
        assert torch.allclose(weights[t], chosen / chosen.sum() * 2.5)


def test_module_sigmoid_group_routing():
    module = build("w8a8", routing="sigmoid_group", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    with torch.no_grad():
        module.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E))
    x, logits = tokens()
    ids, weights = sigmoid_group_topk(logits, K, True, correction_bias=module.e_score_correction_bias, n_group=4,
                                      topk_group=2, routed_scaling_factor=2.5)
    with torch.no_grad():
        assert torch.equal(module(x, logits), module(x, topk_ids=ids, topk_weights=weights))
    assert torch.equal(module.state_dict()["e_score_correction_bias"], torch.linspace(-0.3, 0.3, E))
    assert "sigmoid group top-k (n_group=4, topk_group=2" in repr(module)


def test_inputs_of_any_shape_and_dtype():
    module = build("w8a8")
    x, logits = tokens()
    with torch.no_grad():
        flat = module(x, logits)
        batched = module(x.view(3, 4, H), logits.view(3, 4, E))
        bf16 = module(x.to(torch.bfloat16), logits)
    assert batched.shape == (3, 4, H) and torch.equal(batched.view(T, H), flat)
    assert bf16.dtype == torch.bfloat16


def _rank_outputs(scheme, tokens_per_rank, transport_port=None):
    """On each rank of the pool: the module (built from the same float weights) on this rank's
    share of the tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, logits = tokens(n=tokens_per_rank * world)
    mine = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    buffer = None
    if transport_port is not None:
        buffer = cam_jit.FusedDeepMoeBuffer()
        buffer.init(rank, world, 64 << 20, f"tcp://127.0.0.1:{transport_port}")
    try:
        module = build(scheme, group_ep=dist.group.WORLD, transport=buffer)
        with torch.no_grad():
            return module(x[mine], logits[mine]), module.first_expert, module.local_experts
    finally:
        if buffer is not None:
            buffer.close()


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_one_and_two_ranks_bit_identical(rank_pool, scheme):
    x, logits = tokens(n=2 * 5)
    with torch.no_grad():
        single = build(scheme)(x, logits)
    outs = rank_pool(2).run(_rank_outputs, scheme, 5)
    assert [(first, local) for _, first, local in outs] == [(0, E // 2), (E // 2, E // 2)]
    assert torch.equal(torch.cat([out for out, _, _ in outs]), single)


def test_zero_copy_transport_bit_identical(rank_pool):
    x, logits = tokens(n=2 * 4)
    with torch.no_grad():
        single = build("w8a8")(x, logits)
    outs = rank_pool(2).run(_rank_outputs, "w8a8", 4, free_port())
    assert torch.equal(torch.cat([out for out, _, _ in outs]), single)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_state_dict_round_trip(scheme):
    module = build(scheme)
    blob = io.BytesIO()
    torch.save(module.state_dict(), blob)
    blob.seek(0)
    fresh = FusedDeepMoE(H, I, E, K, shared_intermediate_size=IS, scheme=scheme)
    x, logits = tokens()
    with torch.no_grad():
        assert not torch.equal(fresh(x, logits), module(x, logits))  # zero weights until loaded
        fresh.load_state_dict(torch.load(blob))
        assert torch.equal(fresh(x, logits), module(x, logits))
    for name, t in module.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, fresh.state_dict()[name]), name


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_weights_are_prepacked_at_load(scheme):
    """Loading (from_float, load_state_dict) prepacks the weights for the CPU int8 kernels, under
    the keys the op's own calls use: a forward packs nothing more."""
    from cam_jit.ops._kernels import cpu_kernels

    if "gemm:vnni" not in cpu_kernels().kernel_variants():
        pytest.skip("this CPU has no packed int8 kernel (AVX512-VNNI)")
    cam_jit.clear_prepared_weights()
    module = build(scheme)
    weight_bytes = sum(t.numel() * t.element_size() for name, t in module.named_buffers() if name.endswith("weight"))
    packed = cam_jit.prepared_weights_bytes()
    assert packed >= weight_bytes
    x, logits = tokens()
    with torch.no_grad():
        module(x, logits)
    assert cam_jit.prepared_weights_bytes() == packed
    fresh = FusedDeepMoE(H, I, E, K, shared_intermediate_size=IS, scheme=scheme)
    cam_jit.clear_prepared_weights()
    fresh.load_state_dict(module.state_dict())
    assert cam_jit.prepared_weights_bytes() == packed


def test_state_dict_of_another_layout_is_refused():
    state = build("w8a8").state_dict()
    with pytest.raises(ValueError, match="argument 'state_dict'"):
        FusedDeepMoE(H, I, 2 * E, K, shared_intermediate_size=IS).load_state_dict(
            {**state, "_extra_state": {**state["_extra_state"], "num_experts": 2 * E}}, strict=False)
    with pytest.raises(ValueError, match="expected weights of .'scheme': 'w4a8'.*got .'scheme': 'w8a8'"):
        FusedDeepMoE(H, I, E, K, shared_intermediate_size=IS, scheme="w4a8").load_state_dict(state)
    other_rank = {**state, "_extra_state": {**state["_extra_state"], "experts": [4, 8]}}
    with pytest.raises(ValueError, match="'experts': \\[0, 8\\]"):
        FusedDeepMoE(H, I, E, K, shared_intermediate_size=IS).load_state_dict(other_rank)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_torch_compile_fullgraph(scheme):
    torch._dynamo.reset()
    module = build(scheme)
    x, logits = tokens()
    ids, weights = module.route(logits)
    with torch.no_grad():
        eager = module(x, logits)
        compiled = torch.compile(module, fullgraph=True)
        assert torch.equal(compiled(x, logits), eager)
        parts = torch.compile(lambda x, i, w: module(x, topk_ids=i, topk_weights=w, return_parts=True),
                              fullgraph=True)(x, ids, weights)
    assert torch.equal(parts[0] + parts[1], eager)


def test_torch_compile_dynamic_token_counts():
    """One graph for every batch size (decode steps change it), no recompilation."""
    torch._dynamo.reset()
    module = build("w8a8")
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for n in (5, 9, 2):
            x, logits = tokens(seed=n, n=n)
            assert torch.equal(compiled(x, logits), module(x, logits)), n


def test_extra_repr_is_readable():
    text = repr(build("w4a8"))
    for part in ("hidden_size=64", "intermediate_size=32", "experts 0..7 of 8 on one rank", "top_k=2", "W4A8",
                 "shared_intermediate_size=48", "norm_topk_prob=True", "activation_dtype=bfloat16"):
        assert part in text, (part, text)
    assert "no shared expert" in repr(build("w8a8", shared=False))


def test_from_quantized_takes_all_or_local_experts():
    experts, shared = float_layer()
    q = cam_jit.quantize_experts(*experts)
    qs = cam_jit.quantize_experts(*shared)
    whole = FusedDeepMoE.from_quantized(q, K, shared=qs)
    assert torch.equal(whole.gmm1_weight, q.gmm1_weight) and torch.equal(whole.share_gmm2_weight, qs.gmm2_weight)
    with pytest.raises(ValueError, match="argument 'experts': expected 16 experts .all. or 16"):
        FusedDeepMoE.from_quantized(q.experts(0, 4), K, shared=qs, num_experts=16)


@pytest.mark.parametrize("make, error, match", [
    (lambda: FusedDeepMoE(H, I, E, 0), ValueError, "argument 'top_k'"),
    (lambda: FusedDeepMoE(H, I, E, E + 1), ValueError, "argument 'top_k': expected <= num_experts"),
    (lambda: FusedDeepMoE(H, I, E, K, scheme="fp8"), ValueError, "argument 'scheme'"),
    (lambda: FusedDeepMoE(H, I, E, K, routing="hash"), ValueError, "argument 'routing'"),
    (lambda: FusedDeepMoE(H, I, E, K, routing="sigmoid_group", n_group=3), ValueError, "argument 'n_group'"),
    (lambda: FusedDeepMoE(H, I, E, 4, routing="sigmoid_group", n_group=4, topk_group=1), ValueError,
     "top_k <= topk_group"),
    (lambda: FusedDeepMoE(H, I, E, K, group_ep="world"), TypeError, "argument 'group_ep'"),
    (lambda: FusedDeepMoE(H, I, E, K, activation_dtype=torch.float32), TypeError, "'activation_dtype'"),
    (lambda: FusedDeepMoE(60, I, E, K, scheme="w4a8"), ValueError, "multiples of 8 under W4A8"),
    (lambda: FusedDeepMoE(H, I, E, K, scheme="w4a8", transport=cam_jit.FusedDeepMoeBuffer()), ValueError,
     "W8A8 only"),
    (lambda: FusedDeepMoE(H, I, E, K, transport=object()), TypeError, "argument 'transport'"),
    (lambda: FusedDeepMoE(H, I, E, K).load_quantized(cam_jit.quantize_experts(*float_layer()[0], "w4a8")),
     ValueError, "argument 'experts': expected scheme 'w8a8'"),
    (lambda: FusedDeepMoE(H, I, E, K).load_quantized(cam_jit.quantize_experts(*float_layer()[0]),
                                                     cam_jit.quantize_experts(*float_layer()[1])),
     ValueError, "argument 'shared': expected None"),
])
def test_bad_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_forward_arguments():
    module = build("w8a8")
    x, logits = tokens()
    ids, weights = module.route(logits)
    with pytest.raises(ValueError, match="either router_logits or"):
        module(x, logits, topk_ids=ids, topk_weights=weights)
    with pytest.raises(ValueError, match="got neither"):
        module(x)
    with pytest.raises(ValueError, match="got only one of the two"):
        module(x, topk_ids=ids)
    with pytest.raises(ValueError, match="argument 'hidden_states': expected a last dimension of 64"):
        module(x[:, :32], logits)
    with pytest.raises(ValueError, match="expert_ids"):
        module(x, topk_ids=ids + E, topk_weights=weights)
