"""Strict mode of fused_deep_moe (SPEC.md §0.6, §1.2, §1.7, §7.5): each upstream limit raises the
upstream text with the real numbers and names the argument; valid inputs pass; the switch
(argument, set_strict, CAM_JIT_STRICT) works; all ranks of a group reach the same verdict.

The expected texts below are written from SPEC.md §7.5, not read from the module under test.
Strict-valid sizes are large (H >= 1024, 2I >= 1024), so weights are zeros (cheap) and batches tiny.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

from cam_jit.ops import _strict
from cam_jit.ops import fused_deep_moe_strict as strict
from cam_jit.ops.fused_deep_moe import Layout, fused_deep_moe


def make_args(bs=2, hidden=1024, width=1024, experts=4, topk=2, ranks=1, rank=0, per_expert=False,
              shared_width=None, **overrides):
    """A basic-valid W8A8 call (strict-valid with the defaults): zero weights, distinct ids per row."""
    e_loc = experts // ranks
    x = torch.randn(bs, hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    ids = [[(t + j) % experts if j < experts else -1 for j in range(topk)] for t in range(bs)]
    args = dict(
        x=x,
        expert_ids=torch.tensor(ids, dtype=torch.int32).view(bs, topk),
        gmm1_weight=torch.zeros(e_loc, hidden, width, dtype=torch.int8),
        gmm1_weight_scale=torch.ones(e_loc, width),
        gmm2_weight=torch.zeros(e_loc, width // 2, hidden, dtype=torch.int8),
        gmm2_weight_scale=torch.ones(e_loc, hidden),
        expert_scales=torch.full((bs, topk), 0.5),
        group_ep="ep",
        ep_rank_size=ranks,
        ep_rank_id=rank,
        moe_expert_num=experts,
    )
    if per_expert:
        for name in ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale"):
            args[name] = list(args[name].unbind(0))
    if shared_width is not None:
        args.update(
            share_gmm1_weight=torch.zeros(1, hidden, shared_width, dtype=torch.int8),
            share_gmm1_weight_scale=torch.ones(shared_width),
            share_gmm2_weight=torch.zeros(shared_width // 2, hidden, dtype=torch.int8),
            share_gmm2_weight_scale=torch.ones(1, hidden),
        )
    args.update(overrides)
    return args


def op_args(**kw):
    """make_args normalised as the public function hands them to check_strict (lists, defaults)."""
    args = dict(share_gmm1_weight=None, share_gmm1_weight_scale=None, share_gmm2_weight=None,
                share_gmm2_weight_scale=None, expert_smooth_scales=None, share_smooth_scales=None,
                x_active_mask=None, gmm1_bias=[], gmm2_bias=[], share_gmm1_bias=None, share_gmm2_bias=None,
                quant_mode=0, global_bs=0)
    args.update(make_args(**kw))
    for name in ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale"):
        if isinstance(args[name], torch.Tensor):
            args[name] = [args[name]]
    return args


@pytest.fixture(autouse=True)
def _clean_switches(monkeypatch):
    monkeypatch.delenv("CAM_JIT_STRICT", raising=False)
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    monkeypatch.setattr(_strict, "_process_default", None)


HCCL_TEXT = ("HCCL_BUFFSIZE is too SMALL, globalBatchSize = {gbs}, h = {h}, moeExpertNumPerRank = {e}, "
             "NEEDED_HCCL_BUFFSIZE(moeExpertNumPerRank * globalBatchSize * h * TOKEN_DTYPE_BYTE_SIZE * doubleBuffer) "
             "B={need}MB, HCCL_BUFFSIZE={have}MB.")

# (id, make_args keywords, HCCL_BUFFSIZE or None, argument named, upstream text expected in the message)
CASES = [
    ("experts-over-512", dict(experts=516, ranks=129), None, "moe_expert_num", "moeExpertNum must <= 512."),
    ("quant-mode", dict(quant_mode=1), None, "quant_mode", "[doc] quantMode must be 0"),
    # the name only matters with several ranks (one rank communicates with nobody)
    ("group-name-empty", dict(group_ep="", ranks=2), None, "group_ep", "[doc] the group name length must be in (0, 128)"),
    ("group-name-128", dict(group_ep="g" * 128, ranks=2), None, "group_ep", "[doc] the group name length must be in (0, 128)"),
    # 4 experts * 256 tokens * 1024 * 2 B * 2 = 4 MiB > 3 MiB
    ("hccl-window", dict(global_bs=256), "3", "global_bs", HCCL_TEXT.format(gbs=256, h=1024, e=4, need=4, have=3)),
    # 4 * 12804 * 1024 * 4 B = 200.06 MiB > the default 200 MiB
    ("hccl-window-default", dict(global_bs=12804), None, "global_bs",
     HCCL_TEXT.format(gbs=12804, h=1024, e=4, need=201, have=200)),
    # global_bs = 0 is evaluated as BS * R = 65: 4 * 65 * 1024 * 4 B = 1.02 MiB > 1 MiB
    ("hccl-window-defaulted-global-bs", dict(bs=65), "1", "global_bs",
     HCCL_TEXT.format(gbs=65, h=1024, e=4, need=2, have=1)),
    ("batch-over-256", dict(bs=257), None, "x", "batchSize(bs) must <= 256."),
    ("hidden-below-512", dict(hidden=256), None, "x", "tokenLength(h) is invalid. Only support [512, 7168]."),
    ("hidden-above-7168", dict(hidden=7424, experts=1, topk=1), None, "x",
     "tokenLength(h) is invalid. Only support [512, 7168]."),
    ("hidden-below-1024", dict(hidden=768), None, "x",
     "[doc] tokenLength(h) must be in [1024, 7168] and divisible by 256."),
    ("hidden-not-256-aligned", dict(hidden=1152), None, "x",
     "[doc] tokenLength(h) must be in [1024, 7168] and divisible by 256."),
    ("gmm1-width-below-1024", dict(width=512), None, "gmm1_weight",
     "gmm1 hidden size is invalid. Only support [1024, 6144]."),
    ("gmm1-width-above-6144", dict(width=7168, experts=1, topk=1), None, "gmm1_weight",
     "gmm1 hidden size is invalid. Only support [1024, 6144]."),
    ("gmm1-width-not-1024-aligned", dict(width=1536), None, "gmm1_weight",
     "gmm1 hidden size must be divisible by 1024, but got 1536."),
    ("topk-over-12", dict(topk=13), None, "expert_ids", "topK(k) must <= 12."),
    ("topk-over-experts", dict(topk=6), None, "expert_ids", "topK(k) must <= moeExpertNum(4)."),
    ("batch-over-global-bs", dict(global_bs=1), None, "global_bs",
     "[doc] batchSize(bs) must <= globalBatchSize / epRankSize (1 / 1 = 1)."),
    ("shared-width-below-1024", dict(shared_width=512), None, "share_gmm1_weight",
     "shareGmm1 hidden size is invalid. Only support [1024, 6144]."),
    ("shared-width-not-1024-aligned", dict(shared_width=1536), None, "share_gmm1_weight",
     "shareGmm1 hidden size must be divisible by 1024, but got 1536."),
    ("mask-not-prefix", dict(x_active_mask=torch.tensor([False, True])), None, "x_active_mask",
     "[doc] xActiveMask True values must precede False values."),
    ("duplicate-expert-in-row", dict(expert_ids=torch.tensor([[0, 2], [1, 1]], dtype=torch.int32)), None,
     "expert_ids", "[doc] A token cannot be sent to an expert beyond one time"),
]


@pytest.mark.parametrize("kw,buffsize,arg,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_strict_limit(monkeypatch, kw, buffsize, arg, text):
    if buffsize is not None:
        monkeypatch.setenv("HCCL_BUFFSIZE", buffsize)
    args = make_args(**kw)
    with pytest.raises(ValueError) as info:
        fused_deep_moe(**args, strict=True)
    message = str(info.value)
    assert message.startswith(f"fused_deep_moe: strict: argument '{arg}': "), message
    assert text in message, f"{text!r} not in {message!r}"
    assert ("[doc]" in message) == text.startswith("[doc]"), message
    if kw.get("ranks", 1) == 1 and kw.get("hidden", 0) < 2048 and kw.get("width", 0) < 2048:  # cheap to run
        fused_deep_moe(**make_args(**kw), strict=False)  # basic validation accepts it: only strict refuses


@pytest.mark.parametrize("kw,arg,text", [
    (dict(quant_mode=1, hidden=256), "quant_mode", "quantMode"),  # item 3 before item 6
    (dict(bs=257, topk=13), "x", "batchSize(bs) must <= 256."),  # within item 6
    (dict(width=512, topk=13), "gmm1_weight", "gmm1 hidden size is invalid"),
    (dict(topk=13, shared_width=512), "expert_ids", "topK(k) must <= 12."),  # item 6 before item 8
    (dict(global_bs=256, bs=257, hccl="3"), "global_bs", "HCCL_BUFFSIZE is too SMALL"),  # item 5 before item 6
    (dict(topk=13, x_active_mask=torch.tensor([False, True])), "expert_ids", "topK(k)"),  # limits before data
], ids=["attributes-first", "batch-before-topk", "width-before-topk", "routed-before-shared", "hccl-before-data",
        "limits-before-data"])
def test_upstream_order(monkeypatch, kw, arg, text):
    if "hccl" in kw:
        monkeypatch.setenv("HCCL_BUFFSIZE", kw.pop("hccl"))
    with pytest.raises(ValueError, match=f"argument '{arg}'") as info:
        fused_deep_moe(**make_args(**kw), strict=True)
    assert text in str(info.value)


def test_basic_validation_runs_first():
    args = make_args(quant_mode=1, expert_scales=torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(TypeError, match="argument 'expert_scales'.*float32"):
        fused_deep_moe(**args, strict=True)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(per_expert=True, global_bs=2),
    dict(shared_width=2048, expert_smooth_scales=torch.ones(4, 1024), share_smooth_scales=torch.ones(1024)),
    # Only active rows matter for duplicates; -1 placeholders may repeat; K = 0 is allowed.
    dict(x_active_mask=torch.tensor([True, False]), expert_ids=torch.tensor([[3, 0], [1, 1]], dtype=torch.int32)),
    dict(expert_ids=torch.tensor([[-1, -1], [2, -1]], dtype=torch.int32)),
    dict(topk=0),
    dict(bs=0),
], ids=["stacked", "per-expert", "shared-and-smooth", "inactive-duplicates", "minus-one", "topk-0", "bs-0"])
def test_strict_valid_inputs_pass(kw):
    args = make_args(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, share_out, counts = fused_deep_moe(**args, strict=True)
    assert out.shape == args["x"].shape and share_out.shape == args["x"].shape and counts.shape == (4,)


def test_deepseek_sized_call_passes():
    """DeepSeek-V3-like sizes at the limits' edges: H = 7168, 2I = 4096, E = 256, K = 8, BS = 256
    (zero-stride weights: check_strict reads only shapes of the weights)."""
    bs, h, n1, e = 256, 7168, 4096, 256
    zero = torch.zeros((), dtype=torch.int8)
    args = op_args(bs=bs, hidden=16, width=16, experts=e, topk=8)
    args.update(x=torch.zeros(bs, h, dtype=torch.bfloat16), gmm1_weight=[zero.expand(e, h, n1)],
                gmm1_weight_scale=[torch.ones(()).expand(e, n1)], gmm2_weight=[zero.expand(e, n1 // 2, h)],
                gmm2_weight_scale=[torch.ones(()).expand(e, h)], global_bs=bs)
    # 256 experts * 256 tokens * 7168 * 4 B = 1792 MiB: needs a bigger HCCL window than the default.
    with pytest.raises(ValueError, match="HCCL_BUFFSIZE is too SMALL.*B=1792MB, HCCL_BUFFSIZE=200MB"):
        strict.check_strict(args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HCCL_BUFFSIZE", "1792")
        strict.check_strict(args)


def test_hccl_buffsize_must_be_a_positive_integer(monkeypatch):
    monkeypatch.setenv("HCCL_BUFFSIZE", "lots")
    with pytest.raises(ValueError, match="HCCL_BUFFSIZE: expected a positive number of MiB, got 'lots'"):
        fused_deep_moe(**make_args(), strict=True)


def test_share_smooth_scales_without_routed_ones_warns_and_runs():
    args = make_args(shared_width=1024, share_smooth_scales=torch.ones(1024))
    with pytest.warns(UserWarning, match="'share_smooth_scales' is ignored") as record:
        out, share_out, _ = fused_deep_moe(**args, strict=True)
    [warning] = [w for w in record if "share_smooth_scales" in str(w.message)]
    assert "'expert_smooth_scales' is None" in str(warning.message)
    assert warning.filename == __file__  # points at the caller of fused_deep_moe
    assert share_out.shape == args["x"].shape


# strict switch: (CAM_JIT_STRICT, set_strict(...) or None, strict= argument, strict mode expected)
SWITCHES = [
    (None, None, None, False),
    ("1", None, None, True),
    ("0", None, None, False),
    ("1", None, False, False),
    (None, None, True, True),
    (None, True, None, True),
    (None, True, False, False),
    ("1", False, None, False),
    ("0", True, None, True),
]


@pytest.mark.parametrize("env,process,explicit,on", SWITCHES)
def test_strict_switch(monkeypatch, env, process, explicit, on):
    if env is not None:
        monkeypatch.setenv("CAM_JIT_STRICT", env)
    if process is not None:
        _strict.set_strict(process)
    args = make_args(hidden=64, width=64)  # basic-valid, H below the strict minimum
    if on:
        with pytest.raises(ValueError, match=r"strict: argument 'x': tokenLength\(h\) is invalid"):
            fused_deep_moe(**args, strict=explicit)
    else:
        out, _, _ = fused_deep_moe(**args, strict=explicit)
        assert out.shape == (2, 64)


# ---- W4A8 checks, called directly (basic validation does not accept W4A8 yet) ----------------
H, N1, E_LOC = 1024, 1024, 4


def w4a8_args(e_loc=E_LOC, n1=N1, per_expert=False, **overrides):
    args = op_args(experts=e_loc, width=16)  # the W8A8 weights are replaced below
    args.update(
        gmm1_weight=[torch.zeros(e_loc, H, n1 // 8, dtype=torch.int32)],
        gmm2_weight=[torch.zeros(e_loc, n1 // 2, H // 8, dtype=torch.int32)],
        gmm1_weight_scale=[torch.ones(e_loc, n1)],
        gmm1_bias=[torch.zeros(e_loc, n1)],
        gmm2_bias=[torch.zeros(e_loc, H)],
    )
    if per_expert:
        for name in ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale", "gmm1_bias",
                     "gmm2_bias"):
            args[name] = list(args[name][0].unbind(0))
    args.update(overrides)
    return args


def w4a8_layout(e_loc=E_LOC, n1=N1, shared=False, share_n1=0):
    return Layout(batch=2, hidden=H, topk=2, local_experts=e_loc, inter=n1 // 2, shared=shared,
                  share_inter=share_n1 // 2)


W4A8_BIAS_CASES = [
    ("gmm1-null", dict(gmm1_bias=[]), "gmm1_bias", "gmm1Bias is null."),
    ("gmm2-null", dict(gmm2_bias=[]), "gmm2_bias", "gmm2Bias is null."),
    ("gmm1-listlen", dict(per_expert=True, gmm1_bias=[torch.zeros(N1)] * 3), "gmm1_bias",
     "gmm1Bias listlen does not equals to localExpertNum."),
    ("gmm2-listlen", dict(per_expert=True, gmm2_bias=[torch.zeros(H)] * 2), "gmm2_bias",
     "gmm2Bias listlen does not equals to localExpertNum."),
    # the packed width instead of the logical N1
    ("gmm1-width", dict(gmm1_bias=[torch.zeros(E_LOC, N1 // 8)]), "gmm1_bias",
     "gmm1Bias length does not equals to gmm1 hidden size."),
    ("gmm2-width", dict(gmm2_bias=[torch.zeros(E_LOC, H + 8)]), "gmm2_bias",
     "gmm2Bias does not match token hidden size."),
    ("gmm2-per-expert-width", dict(per_expert=True, gmm2_bias=[torch.zeros(H)] * 3 + [torch.zeros(8)]), "gmm2_bias",
     "gmm2Bias does not match token hidden size."),
    ("gmm1-experts", dict(gmm1_bias=[torch.zeros(E_LOC - 1, N1)]), "gmm1_bias",
     "gmm1Bias does not match local expert number perRank."),
    ("gmm2-experts-1d", dict(gmm2_bias=[torch.zeros(H)]), "gmm2_bias",
     "gmm2Bias does not match local expert number perRank."),
    ("gmm2-experts-3d", dict(gmm2_bias=[torch.zeros(1, E_LOC, H)]), "gmm2_bias",
     "gmm2Bias does not match local expert number perRank."),
    ("gmm1-listflag", dict(gmm1_bias=list(torch.zeros(E_LOC, N1).unbind(0))), "gmm1_bias",
     "gmm1Bias listFlag does not match gmm1Weight listFlag."),
    ("gmm2-listflag", dict(per_expert=True, gmm2_bias=[torch.zeros(E_LOC, H)]), "gmm2_bias",
     "gmm2Bias listFlag does not match gmm1Weight listFlag."),
]


@pytest.mark.parametrize("kw,arg,text", [c[1:] for c in W4A8_BIAS_CASES], ids=[c[0] for c in W4A8_BIAS_CASES])
def test_w4a8_bias_lists(kw, arg, text):
    with pytest.raises(ValueError) as info:
        strict.check_bias_lists(w4a8_args(**kw), w4a8_layout())
    message = str(info.value)
    assert message.startswith(f"fused_deep_moe: strict: argument '{arg}': {text}"), message


@pytest.mark.parametrize("per_expert", [False, True])
def test_w4a8_valid_biases_pass(per_expert):
    strict.check_bias_lists(w4a8_args(per_expert=per_expert), w4a8_layout())
    one = dict(gmm1_bias=[torch.zeros(N1)], gmm2_bias=[torch.zeros(H)])  # E_loc == 1 may drop the leading 1
    strict.check_bias_lists(w4a8_args(e_loc=1, **one), w4a8_layout(e_loc=1))


def test_w4a8_gmm1_width_is_the_unpacked_width():
    strict.check_data_limits(w4a8_args(), w4a8_layout())  # stored 128 words = 1024 int4 columns
    with pytest.raises(ValueError, match="argument 'gmm1_weight': gmm1 hidden size must be divisible by 1024, but got "
                                         "1536."):
        strict.check_data_limits(w4a8_args(n1=1536), w4a8_layout(n1=1536))


def test_w4a8_local_experts_limit():
    strict.check_data_limits(w4a8_args(e_loc=24), w4a8_layout(e_loc=24))
    args = w4a8_args(e_loc=25)
    with pytest.raises(ValueError) as info:
        strict.check_data_limits(args, w4a8_layout(e_loc=25))
    assert str(info.value).startswith(
        "fused_deep_moe: strict: argument 'moe_expert_num': moeExpertNumPerRank must <= (aivNum/2)(24), but got 25")
    # W8A8 has no such limit.
    w8a8 = op_args(experts=25, width=16)
    w8a8["gmm1_weight"] = [torch.zeros((), dtype=torch.int8).expand(25, 1024, 1024)]
    strict.check_data_limits(w8a8, Layout(2, 1024, 2, 25, 512, False, 0))


def test_w4a8_shared_expert():
    shared = dict(share_gmm1_weight=torch.zeros(H, 2048 // 8, dtype=torch.int32),
                  share_gmm2_weight=torch.zeros(1024, H // 8, dtype=torch.int32))
    layout = w4a8_layout(shared=True, share_n1=2048)
    strict.check_shared_expert(w4a8_args(**shared), layout)
    with pytest.raises(ValueError, match="argument 'share_gmm1_weight': shareGmm1 hidden size must be divisible by "
                                         "1024, but got 1536."):
        strict.check_shared_expert(w4a8_args(**dict(shared, share_gmm1_weight=torch.zeros(
            H, 1536 // 8, dtype=torch.int32))), w4a8_layout(shared=True, share_n1=1536))
    three_d = dict(shared, share_gmm2_weight=torch.zeros(1, 1024, H // 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"argument 'share_gmm2_weight': shareGmm2Weight dim2 should be h\(1024\), "
                                         r"but got 128\."):
        strict.check_shared_expert(w4a8_args(**three_d), layout)


# ---- every rank reaches the same verdict (SPEC.md §1.7 proposal) -------------------------------
def _strict_on_rank(scenario):
    rank = dist.get_rank()
    kw = dict(ranks=2, rank=rank, group_ep=dist.group.WORLD)
    if scenario == "global-bs-disagrees":
        kw["global_bs"] = (0, 4)[rank]
    elif scenario == "unequal-batches-global-bs-0":
        kw["bs"] = (2, 1)[rank]
    elif scenario == "unequal-batches-global-bs-4":
        kw.update(bs=(2, 1)[rank], global_bs=4)
    elif scenario == "strict-failure-on-rank-1":
        kw["quant_mode"] = rank
    elif scenario == "basic-failure-on-rank-1":
        kw["expert_scales"] = torch.zeros(2, 2, dtype=(torch.float32, torch.float16)[rank])
    try:
        out = fused_deep_moe(**make_args(**kw), strict=True)
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)
    return "ok", [tuple(t.shape) for t in out]


PEER = "fused_deep_moe: strict: rank(s) [1] of EP group"
RANK_CASES = [
    ("equal-batches", [("ok", None), ("ok", None)]),
    ("unequal-batches-global-bs-4", [("ok", None), ("ok", None)]),
    ("global-bs-disagrees", [("ValueError", "argument 'global_bs': [doc] globalBatchSize must be the same on every "
                                            "rank of the EP group. (got global_bs = [0, 4] on ranks 0..1)")] * 2),
    ("unequal-batches-global-bs-0", [("ValueError", "argument 'global_bs': [doc] globalBatchSize = 0 needs the same "
                                                    "batch on every rank; pass max_r(BS_r) * epRankSize = 4")] * 2),
    ("strict-failure-on-rank-1", [("ValueError", PEER), ("ValueError", "argument 'quant_mode': [doc] quantMode")]),
    ("basic-failure-on-rank-1", [("ValueError", PEER), ("TypeError", "argument 'expert_scales'")]),
]


@pytest.mark.parametrize("scenario,expected", RANK_CASES, ids=[c[0] for c in RANK_CASES])
def test_ranks_agree(rank_pool, scenario, expected):
    results = rank_pool(2).run_with_timeout(90, _strict_on_rank, scenario)
    for rank, ((kind, detail), (want_kind, fragment)) in enumerate(zip(results, expected)):
        assert kind == want_kind, f"rank {rank}: {kind}: {detail}"
        if fragment is not None:
            assert fragment in detail, f"rank {rank}: {fragment!r} not in {detail!r}"
