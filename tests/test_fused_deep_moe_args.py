"""Bad inputs to cam_jit.fused_deep_moe: each raises the right exception naming the argument,
the expected value and the actual value. Validation runs before any kernel is needed."""
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cam_jit
from cam_jit.ops.weights import pack_int4, w4a8_compensation_bias

BS, H, I, E, K = 4, 64, 32, 4, 2


def good_args():
    gen = torch.Generator().manual_seed(0)
    return dict(
        x=torch.randn(BS, H, generator=gen).to(torch.bfloat16),
        expert_ids=torch.tensor([[0, 1], [2, 3], [1, -1], [3, 2]], dtype=torch.int32),
        gmm1_weight=torch.randint(-127, 128, (E, H, 2 * I), dtype=torch.int8, generator=gen),
        gmm1_weight_scale=torch.full((E, 2 * I), 1e-3),
        gmm2_weight=torch.randint(-127, 128, (E, I, H), dtype=torch.int8, generator=gen),
        gmm2_weight_scale=torch.full((E, H), 1e-3),
        expert_scales=torch.full((BS, K), 0.5),
        group_ep="",
        ep_rank_size=1,
        ep_rank_id=0,
        moe_expert_num=E,
    )


def shared(**over):
    base = dict(
        share_gmm1_weight=torch.zeros(H, 2 * I, dtype=torch.int8),
        share_gmm1_weight_scale=torch.ones(2 * I),
        share_gmm2_weight=torch.zeros(I, H, dtype=torch.int8),
        share_gmm2_weight_scale=torch.ones(H),
    )
    base.update(over)
    return base


# (case id, overrides, exception, fragments the message must contain)
CASES = [
    ("x-not-tensor", dict(x=[[1.0]]), TypeError, ["'x'", "torch.Tensor", "list"]),
    ("x-3d", dict(x=torch.zeros(BS, H, 1, dtype=torch.bfloat16)), ValueError, ["'x'", "2-D", "3-D"]),
    ("x-float32", dict(x=torch.zeros(BS, H)), TypeError, ["'x'", "bfloat16 or float16", "float32"]),
    ("ids-int64", dict(expert_ids=torch.zeros(BS, K, dtype=torch.int64)), TypeError, ["'expert_ids'", "int32", "int64"]),
    ("ids-1d", dict(expert_ids=torch.zeros(BS, dtype=torch.int32)), ValueError, ["'expert_ids'", "2-D", "1-D"]),
    ("ids-batch", dict(expert_ids=torch.zeros(BS + 1, K, dtype=torch.int32)), ValueError,
     ["'expert_ids'", f"shape[0] == {BS}", str([BS + 1, K])]),
    ("ids-too-big", dict(expert_ids=torch.full((BS, K), E, dtype=torch.int32)), ValueError,
     ["'expert_ids'", f"[-1, {E})", f"a value {E}"]),
    ("ids-below-minus-one", dict(expert_ids=torch.full((BS, K), -2, dtype=torch.int32)), ValueError,
     ["'expert_ids'", f"[-1, {E})", "a value -2"]),
    ("scales-dtype", dict(expert_scales=torch.zeros(BS, K, dtype=torch.float16)), TypeError,
     ["'expert_scales'", "float32", "float16"]),
    ("scales-shape", dict(expert_scales=torch.zeros(BS, K + 1)), ValueError,
     ["'expert_scales'", str([BS, K]), str([BS, K + 1])]),
    ("w1-not-list", dict(gmm1_weight=3), TypeError, ["'gmm1_weight'", "tensor", "int"]),
    ("w1-dtype", dict(gmm1_weight=torch.zeros(E, H, 2 * I)), TypeError, ["'gmm1_weight'", "int8", "float32"]),
    ("w1-hidden", dict(gmm1_weight=torch.zeros(E, H + 1, 2 * I, dtype=torch.int8)), ValueError,
     ["'gmm1_weight'", str([E, H, 2 * I]), str([E, H + 1, 2 * I])]),
    ("w1-experts", dict(gmm1_weight=torch.zeros(E - 1, H, 2 * I, dtype=torch.int8)), ValueError,
     ["'gmm1_weight'", str([E, H, 2 * I]), str([E - 1, H, 2 * I])]),
    ("w1-odd-width", dict(gmm1_weight=torch.zeros(E, H, 2 * I + 1, dtype=torch.int8)), ValueError,
     ["'gmm1_weight'", "even", str(2 * I + 1)]),
    ("w1-2d-with-many-experts", dict(gmm1_weight=torch.zeros(H, 2 * I, dtype=torch.int8)), ValueError,
     ["'gmm1_weight'", "stacked 3-D", "2-D"]),
    ("w1-list-length", dict(gmm1_weight=[torch.zeros(H, 2 * I, dtype=torch.int8)] * (E - 1)), ValueError,
     ["'gmm1_weight'", f"{E} per-expert tensors", f"a list of {E - 1}"]),
    ("w1-list-item-shape",
     dict(gmm1_weight=[torch.zeros(H, 2 * I, dtype=torch.int8)] * (E - 1) + [torch.zeros(H, 2, dtype=torch.int8)]),
     ValueError, [f"'gmm1_weight[{E - 1}]'", str([H, 2 * I]), str([H, 2])]),
    ("w1-int16", dict(gmm1_weight=torch.zeros(E, H, 2 * I, dtype=torch.int16)), TypeError,
     ["'gmm1_weight'", "int8 (W8A8) or int32 (W4A8", "int16"]),
    ("s1-length", dict(gmm1_weight_scale=torch.ones(E, 2 * I - 1)), ValueError,
     ["'gmm1_weight_scale'", str([E, 2 * I]), str([E, 2 * I - 1])]),
    ("s1-dtype", dict(gmm1_weight_scale=torch.ones(E, 2 * I, dtype=torch.float16)), TypeError,
     ["'gmm1_weight_scale'", "float32 or bfloat16", "float16"]),
    ("s1-mode", dict(gmm1_weight=list(torch.zeros(E, H, 2 * I, dtype=torch.int8).unbind(0))), ValueError,
     ["'gmm1_weight_scale'", "same container mode", "a list of 1"]),
    ("w2-inter", dict(gmm2_weight=torch.zeros(E, I + 2, H, dtype=torch.int8)), ValueError,
     ["'gmm2_weight'", str([E, I, H]), str([E, I + 2, H])]),
    ("w2-dtype", dict(gmm2_weight=torch.zeros(E, I, H, dtype=torch.int32)), TypeError,
     ["'gmm2_weight'", "int8", "int32"]),
    ("s2-length", dict(gmm2_weight_scale=torch.ones(E, H + 1)), ValueError,
     ["'gmm2_weight_scale'", str([E, H]), str([E, H + 1])]),
    ("s2-mixed-dtypes", dict(gmm2_weight_scale=[torch.ones(H)] * (E - 1) + [torch.ones(H, dtype=torch.bfloat16)],
                             gmm2_weight=list(torch.zeros(E, I, H, dtype=torch.int8).unbind(0)),
                             gmm1_weight=list(torch.zeros(E, H, 2 * I, dtype=torch.int8).unbind(0)),
                             gmm1_weight_scale=list(torch.ones(E, 2 * I).unbind(0))),
     TypeError, ["'gmm2_weight_scale'", "one dtype", "bfloat16", "float32"]),
    ("bias-under-w8a8", dict(gmm1_bias=[torch.zeros(E, 2 * I)]), ValueError, ["'gmm1_bias'", "empty", "a list of 1"]),
    ("share-bias-under-w8a8", dict(share_gmm2_bias=torch.zeros(H)), ValueError, ["'share_gmm2_bias'", "None"]),
    ("share-partial", dict(share_gmm1_weight=torch.zeros(H, 2 * I, dtype=torch.int8)), ValueError,
     ["'share_gmm1_weight_scale'", "together", "None"]),
    ("share-w1-shape", shared(share_gmm1_weight=torch.zeros(2, H, 2 * I, dtype=torch.int8)), ValueError,
     ["'share_gmm1_weight'", str([1, H, 2 * I]), str([2, H, 2 * I])]),
    ("share-w2-shape", shared(share_gmm2_weight=torch.zeros(I + 1, H, dtype=torch.int8)), ValueError,
     ["'share_gmm2_weight'", str([I, H]), str([I + 1, H])]),
    ("share-scale-dtype", shared(share_gmm1_weight_scale=torch.ones(2 * I, dtype=torch.bfloat16)), TypeError,
     ["'share_gmm1_weight_scale'", "float32", "bfloat16"]),
    ("smooth-shape", dict(expert_smooth_scales=torch.ones(E, H + 1)), ValueError,
     ["'expert_smooth_scales'", str([E, H]), str([E, H + 1])]),
    ("smooth-dtype", dict(expert_smooth_scales=torch.ones(E, H, dtype=torch.float64)), TypeError,
     ["'expert_smooth_scales'", "float32", "float64"]),
    ("share-smooth-missing", dict(expert_smooth_scales=torch.ones(E, H), **shared()), ValueError,
     ["'share_smooth_scales'", "float32 [H]", "None"]),
    ("mask-dtype", dict(x_active_mask=torch.ones(BS, dtype=torch.int32)), TypeError,
     ["'x_active_mask'", "bool", "int32"]),
    ("mask-shape", dict(x_active_mask=torch.ones(BS, 1, dtype=torch.bool)), ValueError,
     ["'x_active_mask'", str([BS]), str([BS, 1])]),
    ("group-not-str", dict(group_ep=5), TypeError, ["'group_ep'", "int"]),
    ("rank-size-zero", dict(ep_rank_size=0), ValueError, ["'ep_rank_size'", "> 0", "got 0"]),
    ("rank-id-range", dict(ep_rank_id=1), ValueError, ["'ep_rank_id'", "ep_rank_size (1)", "got 1"]),
    ("rank-id-type", dict(ep_rank_id=0.0), TypeError, ["'ep_rank_id'", "an int", "float"]),
    ("experts-not-multiple", dict(ep_rank_size=3, ep_rank_id=0), ValueError,
     ["'moe_expert_num'", "multiple of ep_rank_size (3)", f"got {E}"]),
    ("global-bs-negative", dict(global_bs=-2), ValueError, ["'global_bs'", "multiple of ep_rank_size", "got -2"]),
    ("quant-mode-type", dict(quant_mode="0"), TypeError, ["'quant_mode'", "an int", "str"]),
    ("device", dict(expert_scales=torch.full((BS, K), 0.5, device="meta")), ValueError,
     ["'expert_scales'", "cpu", "meta"]),
    ("group-unknown", dict(group_ep="no-such-group", ep_rank_size=2, ep_rank_id=0, moe_expert_num=2 * E), ValueError,
     ["'group_ep'", "process group", "'no-such-group'"]),
]


def good_w4a8_args():
    """good_args() with W4A8 weights: packed int4 in int32 words, plus the compensation biases."""
    gen = torch.Generator().manual_seed(1)
    args = good_args()
    w1 = pack_int4(torch.randint(-8, 8, (E, H, 2 * I), dtype=torch.int8, generator=gen))
    w2 = pack_int4(torch.randint(-8, 8, (E, I, H), dtype=torch.int8, generator=gen))
    s1, s2 = torch.full((E, 2 * I), 1e-2), torch.full((E, H), 1e-2)
    args.update(gmm1_weight=w1, gmm1_weight_scale=s1, gmm2_weight=w2, gmm2_weight_scale=s2,
                gmm1_bias=w4a8_compensation_bias(w1, s1), gmm2_bias=w4a8_compensation_bias(w2, s2))
    return args


def shared_w4a8(**over):
    base = dict(
        share_gmm1_weight=torch.zeros(H, 2 * I // 8, dtype=torch.int32),
        share_gmm1_weight_scale=torch.ones(2 * I),
        share_gmm2_weight=torch.zeros(I, H // 8, dtype=torch.int32),
        share_gmm2_weight_scale=torch.ones(H),
        share_gmm1_bias=torch.zeros(2 * I),
        share_gmm2_bias=torch.zeros(H),
    )
    base.update(over)
    return base


def per_expert_w4a8(**over):
    """good_w4a8_args()' containers as E per-expert lists, then `over`."""
    args = good_w4a8_args()
    lists = {name: list(args[name].unbind(0)) for name in ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight",
                                                            "gmm2_weight_scale", "gmm1_bias", "gmm2_bias")}
    lists.update(over)
    return lists


# The same, on top of good_w4a8_args().
W4A8_CASES = [
    ("gmm1-bias-missing", dict(gmm1_bias=None), ValueError,
     ["'gmm1_bias'", "W4A8 compensation bias", "[E_loc, 2I]", f"2I = {2 * I}", "an empty list"]),
    ("gmm2-bias-empty", dict(gmm2_bias=[]), ValueError, ["'gmm2_bias'", "compensation bias", "an empty list"]),
    ("gmm1-bias-shape", dict(gmm1_bias=torch.zeros(E, 2 * I - 8)), ValueError,
     ["'gmm1_bias'", str([E, 2 * I]), str([E, 2 * I - 8]), "8 x the 8 int32 words"]),
    ("gmm2-bias-packed-width", dict(gmm2_bias=torch.zeros(E, H // 8)), ValueError,
     ["'gmm2_bias'", str([E, H]), str([E, H // 8]), "unpacked column"]),
    ("gmm1-bias-experts", dict(gmm1_bias=torch.zeros(E - 1, 2 * I)), ValueError,
     ["'gmm1_bias'", str([E, 2 * I]), str([E - 1, 2 * I])]),
    ("gmm1-bias-dtype", dict(gmm1_bias=torch.zeros(E, 2 * I, dtype=torch.bfloat16)), TypeError,
     ["'gmm1_bias'", "float32", "bfloat16"]),
    ("gmm2-bias-list-length", dict(gmm2_bias=[torch.zeros(H)] * (E - 1)), ValueError,
     ["'gmm2_bias'", f"{E} per-expert tensors", f"a list of {E - 1}"]),
    ("bias-container-mode", per_expert_w4a8(gmm1_bias=[torch.zeros(E, 2 * I)]), ValueError,
     ["'gmm1_bias'", "same container mode as gmm1_weight", f"a list of {E}", "got a list of 1"]),
    ("bias-item-shape", per_expert_w4a8(gmm2_bias=[torch.zeros(H)] * (E - 1) + [torch.zeros(H + 8)]), ValueError,
     [f"'gmm2_bias[{E - 1}]'", str([H]), str([H + 8])]),
    ("gmm2-int8-mixed", dict(gmm2_weight=torch.zeros(E, I, H, dtype=torch.int8)), TypeError,
     ["'gmm2_weight'", "dtype int32", "W4A8", "one variant", "got int8"]),
    ("gmm1-mixed-in-list", per_expert_w4a8(gmm1_weight=[torch.zeros(H, 2 * I // 8, dtype=torch.int32)] * (E - 1)
                                          + [torch.zeros(H, 2 * I // 8, dtype=torch.int8)]), TypeError,
     ["'gmm1_weight'", "one dtype", "int32", "int8"]),
    ("share-int8-mixed", shared_w4a8(share_gmm1_weight=torch.zeros(H, 2 * I, dtype=torch.int8)), TypeError,
     ["'share_gmm1_weight'", "dtype int32", "one variant", "got int8"]),
    ("share-gmm2-int8-mixed", shared_w4a8(share_gmm2_weight=torch.zeros(I, H, dtype=torch.int8)), TypeError,
     ["'share_gmm2_weight'", "dtype int32", "got int8"]),
    ("gmm1-int8-gmm2-int32", dict(gmm1_weight=torch.zeros(E, H, 2 * I, dtype=torch.int8)), TypeError,
     ["'gmm2_weight'", "dtype int8", "W8A8", "got int32"]),
    ("packed-width-vs-scale", dict(gmm1_weight=torch.zeros(E, H, 2 * I // 4, dtype=torch.int32)), ValueError,
     ["'gmm1_weight'", f"last dimension of {2 * I // 8} int32 words (2I = {2 * I} int4 columns)",
      str([E, H, 2 * I // 4])]),
    ("gmm1-unpacked-int32", dict(gmm1_weight=torch.zeros(E, H, 2 * I, dtype=torch.int32)), ValueError,
     ["'gmm1_weight'", f"last dimension of {2 * I // 8} int32 words", str([E, H, 2 * I])]),
    ("gmm2-unpacked-width", dict(gmm2_weight=torch.zeros(E, I, H, dtype=torch.int32)), ValueError,
     ["'gmm2_weight'", str([E, I, H // 8]), str([E, I, H]), f"H / 8 = {H // 8}"]),
    ("gmm2-inter", dict(gmm2_weight=torch.zeros(E, I + 1, H // 8, dtype=torch.int32)), ValueError,
     ["'gmm2_weight'", str([E, I, H // 8]), str([E, I + 1, H // 8])]),
    ("hidden-not-multiple-of-8", dict(x=torch.zeros(BS, H - 4, dtype=torch.bfloat16)), ValueError,
     ["'x'", "multiple of 8", f"H = {H - 4}"]),
    ("share-bias-missing", shared_w4a8(share_gmm1_bias=None), ValueError,
     ["'share_gmm1_bias'", "compensation bias of the shared expert", f"2Is = {2 * I}", "got None"]),
    ("share-gmm2-bias-missing", shared_w4a8(share_gmm2_bias=None), ValueError,
     ["'share_gmm2_bias'", "float32 [H]", "got None"]),
    ("share-bias-shape", shared_w4a8(share_gmm2_bias=torch.zeros(H // 8)), ValueError,
     ["'share_gmm2_bias'", str([H]), str([H // 8])]),
    ("share-bias-dtype", shared_w4a8(share_gmm1_bias=torch.zeros(2 * I, dtype=torch.float16)), TypeError,
     ["'share_gmm1_bias'", "float32", "float16"]),
    ("share-bias-without-shared", dict(share_gmm1_bias=torch.zeros(2 * I)), ValueError,
     ["'share_gmm1_bias'", "None without a shared expert", "a tensor"]),
    ("share-gmm2-unpacked", shared_w4a8(share_gmm2_weight=torch.zeros(I, H, dtype=torch.int32)), ValueError,
     ["'share_gmm2_weight'", str([I, H // 8]), str([I, H])]),
    ("share-scale-packed-width", shared_w4a8(share_gmm1_weight_scale=torch.ones(2 * I // 8)), ValueError,
     ["'share_gmm1_weight_scale'", str([2 * I]), str([2 * I // 8])]),
]


class SeenOps(TorchDispatchMode):
    """Runs every op that reaches the dispatcher, recording its name: under it the public function
    must call the registered op, as under torch.compile, export, fake tensors or opcheck."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _expect_error(args, exc, fragments, path="direct"):
    seen = SeenOps()
    with pytest.raises(exc) as info:
        if path == "dispatcher":
            with seen:
                cam_jit.fused_deep_moe(**args)
        else:
            cam_jit.fused_deep_moe(**args)
    message = str(info.value)
    assert message.startswith("fused_deep_moe"), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return seen.seen


@pytest.mark.parametrize("path", ["direct", "dispatcher"])
@pytest.mark.parametrize("overrides,exc,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument(overrides, exc, fragments, path):
    """Each bad input fails alike whether the public call runs the CPU implementation directly or
    through the registered op."""
    args = good_args()
    args.update(overrides)
    _expect_error(args, exc, fragments, path)


@pytest.mark.parametrize("overrides,exc,fragments", [c[1:] for c in W4A8_CASES], ids=[c[0] for c in W4A8_CASES])
def test_bad_w4a8_argument(overrides, exc, fragments):
    args = good_w4a8_args()
    args.update(overrides)
    _expect_error(args, exc, fragments)


def test_good_arguments_pass_validation():
    """The baseline of the table is valid, so each case above fails for its own override only."""
    out, share_out, counts = cam_jit.fused_deep_moe(**good_args())
    assert out.shape == (BS, H) and share_out.shape == (BS, H) and counts.tolist() == [1, 2, 2, 2]


@pytest.mark.parametrize("variant", ["stacked", "per-expert", "shared"])
def test_good_w4a8_arguments_pass_validation(variant):
    """The W4A8 baselines (and their per-expert and shared forms) are valid."""
    args = good_w4a8_args()
    args.update({"stacked": {}, "per-expert": per_expert_w4a8(), "shared": shared_w4a8()}[variant])
    out, share_out, counts = cam_jit.fused_deep_moe(**args)
    assert out.shape == (BS, H) and share_out.shape == (BS, H) and counts.tolist() == [1, 2, 2, 2]


def test_the_cpu_implementation_is_called_directly_only_where_nothing_could_tell(monkeypatch):
    """The public call skips the dispatcher hop for plain CPU tensors without autograd to record,
    with the dispatcher's result; any mode, the profiler, a tensor subclass or an input that
    requires grad sends it through the registered op."""
    fdm = sys.modules["cam_jit.ops.fused_deep_moe"]
    direct = []
    real = fdm._cpu  # the registered kernel keeps the original: only direct calls are counted
    monkeypatch.setattr(fdm, "_cpu", lambda *args: direct.append(1) or real(*args))
    args = good_args()
    with torch.inference_mode():
        first = cam_jit.fused_deep_moe(**args)
    with torch.no_grad():
        cam_jit.fused_deep_moe(**dict(args, gmm1_weight=torch.nn.Parameter(args["gmm1_weight"], requires_grad=False)))
    cam_jit.fused_deep_moe(**args)  # grad mode, but nothing requires grad
    assert len(direct) == 3

    class Marked(torch.Tensor):
        pass

    seen = SeenOps()
    with seen:
        via_op = cam_jit.fused_deep_moe(**args)
    with torch.profiler.profile() as prof:
        cam_jit.fused_deep_moe(**args)
    cam_jit.fused_deep_moe(**dict(args, expert_scales=args["expert_scales"].as_subclass(Marked)))
    cam_jit.fused_deep_moe(**dict(args, gmm2_weight_scale=[args["gmm2_weight_scale"].requires_grad_(True)]))
    assert len(direct) == 3 and "cam_jit.fused_deep_moe.default" in seen.seen
    assert "cam_jit::fused_deep_moe" in {event.name for event in prof.events()}
    assert all(torch.equal(a, b) for a, b in zip(first, via_op))


def test_a_torch_without_the_interception_probes_always_takes_the_dispatcher_hop(monkeypatch):
    """On a torch lacking any internal that tells whether a mode, trace or profiler would see the
    op, every call goes through the registered op."""
    fdm = sys.modules["cam_jit.ops.fused_deep_moe"]
    monkeypatch.delattr(torch._C, "_any_requires_grad")
    assert fdm._interception_probes() is None
    monkeypatch.setattr(fdm, "_PROBES", None)
    direct = []
    real = fdm._cpu
    monkeypatch.setattr(fdm, "_cpu", lambda *args: direct.append(1) or real(*args))
    args = good_args()
    with torch.inference_mode():
        via_op = cam_jit.fused_deep_moe(**args)
        monkeypatch.undo()
        assert not direct
        assert all(torch.equal(a, b) for a, b in zip(via_op, cam_jit.fused_deep_moe(**args)))


def test_backward_is_refused():
    args = good_args()
    args["x"] = args["x"].requires_grad_(True)
    out, _, _ = cam_jit.fused_deep_moe(**args)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.float().sum().backward()


def test_backward_through_a_weight_list_is_refused_and_no_grad_records_nothing():
    args = good_args()
    args["gmm1_weight_scale"] = [args["gmm1_weight_scale"].requires_grad_(True)]  # inside a Tensor[] argument
    out, share_out, counts = cam_jit.fused_deep_moe(**args)
    assert out.requires_grad and not counts.requires_grad
    with pytest.raises(RuntimeError, match="cam_jit::fused_deep_moe is inference-only"):
        out.float().sum().backward()
    with torch.no_grad():
        again = cam_jit.fused_deep_moe(**args)
    assert not any(t.requires_grad for t in again) and torch.equal(again[0], out.detach())


def test_the_validation_verdict_is_reused_per_argument_signature(monkeypatch):
    fdm = sys.modules["cam_jit.ops.fused_deep_moe"]
    monkeypatch.setattr(fdm, "_VERDICTS", {})
    calls = []
    real = fdm.validate
    monkeypatch.setattr(fdm, "validate", lambda **args: calls.append(1) or real(**args))
    args = good_args()
    first = cam_jit.fused_deep_moe(**args)
    again = cam_jit.fused_deep_moe(**dict(args, x=args["x"] * 2))  # other data, same signature
    assert len(calls) == 1 and not torch.equal(first[0], again[0])
    cam_jit.fused_deep_moe(**dict(args, x=args["x"][:2], expert_ids=args["expert_ids"][:2],
                                  expert_scales=args["expert_scales"][:2]))  # another batch: validated
    assert len(calls) == 2


@pytest.mark.parametrize("bad, error, match", [
    (dict(x=torch.zeros(BS, H)), TypeError, "'x': expected dtype bfloat16 or float16, got float32"),
    (dict(expert_scales=torch.zeros(BS, K + 1)), ValueError, "'expert_scales': expected shape"),
    (dict(gmm2_weight_scale=torch.zeros(E, H + 1)), ValueError, "gmm2_weight_scale"),
    (dict(expert_ids=torch.tensor([[0, 1], [2, 9], [1, -1], [3, 2]], dtype=torch.int32)), ValueError,
     "'expert_ids': expected values in \\[-1, 4\\)"),  # the same signature as the good call: data is checked
    (dict(moe_expert_num=8), ValueError, "gmm1_weight.*expected shape \\[8, 64, 64\\]"),
    (dict(gmm2_weight_scale=torch.full((E, H), 1e-3, device="meta")), ValueError,
     "'gmm2_weight_scale': expected a tensor on cpu"),  # the good call's dtype and shape, another device
    # the good call's weight and scale in one list: its signature but for the lists' lengths
    (dict(gmm1_weight=[torch.zeros(E, H, 2 * I, dtype=torch.int8), torch.full((E, 2 * I), 1e-3)],
          gmm1_weight_scale=[]), ValueError, "'gmm1_weight': expected a list of 1 stacked tensor or 4"),
])
def test_a_cached_signature_never_lets_a_bad_call_through(bad, error, match):
    args = good_args()
    cam_jit.fused_deep_moe(**args)  # its signature's verdict is now cached
    with pytest.raises(error, match=match):
        cam_jit.fused_deep_moe(**dict(args, **bad))
    with pytest.raises(error, match=match):  # and again: failures are never cached
        cam_jit.fused_deep_moe(**dict(args, **bad))
    cam_jit.fused_deep_moe(**args)
