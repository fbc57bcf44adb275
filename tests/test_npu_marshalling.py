"""The aclnn exec helper and wrappers against a simulated opapi library, without an NPU.

``tests/npu_sim/sim_opapi.c`` stands in for a vendor's ``libcust_opapi.so`` (and CANN's tensor
API): it exports aclCreateTensor & co. and every op's ``aclnn*GetWorkspaceSize``/``aclnn*`` with
the C prototypes of SPEC.md §7.2, written from the SPEC independently of the wrappers, and logs
every argument it receives. The wrappers (``wrappers/*.cpp`` minus the torch_npu runtime) are
built with ``tests/npu_sim/test_runtime.cpp`` (CPU tensors, a sentinel stream) into the op
namespace ``_cam_jit_npu_test``, and driven through cam_jit.ascend.npu_ops' PrivateUse1 kernel
functions or the private ops directly. The assertions restate SPEC.md §7.1/§7.2 by hand.
"""
import ctypes

import pytest
import torch

from cam_jit.ascend import npu_ops, registry
from npu_sim.standin import STREAM, build_sims

BF16, F32, INT8, INT32, INT64, BOOL = 27, 0, 2, 3, 9, 12  # aclDataType, acl_base.h
ND, NZ = 2, 29  # aclFormat


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    variants = {"base": ["-DSIM_FDM_ABI=0"], "w4a8": ["-DSIM_FDM_ABI=1"],
                "master": ["-DSIM_FDM_ABI=2"], "api_only": ["-DSIM_TENSOR_API_ONLY"]}
    return build_sims(out, variants)


@pytest.fixture
def bound(sims, npu_harness):
    """Bind npu_ops to the harness; returns (bind(libraries, abi), the private ops, ctypes lib)."""
    ops, lib = npu_harness
    for sim in sims.values():
        sim.lib.sim_reset()

    def bind(libraries, abi="base"):
        npu_ops.bind(ops, [str(p) for p in libraries], abi, "set by the test")

    yield bind, ops, lib
    lib.cam_jit_test_set_storage_format(0, -1, None, 0)
    npu_ops._BINDING = None


def tensor_arg(record, t, dtype, fmt=ND, storage=None):
    """Assert one logged tensor argument describes torch tensor ``t`` (SPEC.md §7.1)."""
    assert record["kind"] == "tensor", record
    assert record["dtype"] == dtype
    assert record["shape"] == list(t.shape)
    assert record["strides"] == list(t.stride())
    assert record["offset"] == t.storage_offset()
    assert record["format"] == fmt
    assert record["data"] == t.untyped_storage().data_ptr()
    expected = storage or [t.untyped_storage().nbytes() // t.element_size()]
    assert record["storage"] == expected


def ints(records):
    assert all(r["kind"] == "int" for r in records), records
    return [r["value"] for r in records]


def w8a8_case(shared=True, R=2, rank=1, E=4, H=32, inter=16, BS=3, K=2):
    g = torch.Generator().manual_seed(0)
    e_loc, n1, share_inter = E // R, 2 * inter, 8
    args = dict(
        x=torch.randn(BS, H, generator=g).to(torch.bfloat16),
        expert_ids=torch.randint(0, E, (BS, K), generator=g, dtype=torch.int32),
        gmm1_weight=[torch.randint(-5, 5, (H, n1), dtype=torch.int8, generator=g) for _ in range(e_loc)],
        gmm1_weight_scale=[torch.rand(n1, generator=g) for _ in range(e_loc)],
        gmm2_weight=[torch.randint(-5, 5, (inter, H), dtype=torch.int8, generator=g) for _ in range(e_loc)],
        gmm2_weight_scale=[torch.rand(H, generator=g) for _ in range(e_loc)],
        expert_scales=torch.rand(BS, K, generator=g),
        share_gmm1_weight=None, share_gmm1_weight_scale=None, share_gmm2_weight=None,
        share_gmm2_weight_scale=None, expert_smooth_scales=torch.rand(E, H, generator=g),
        share_smooth_scales=None, x_active_mask=None, gmm1_bias=[], gmm2_bias=[],
        share_gmm1_bias=None, share_gmm2_bias=None, group_ep="ep_group_7", ep_rank_size=R,
        ep_rank_id=rank, moe_expert_num=E, quant_mode=0, global_bs=BS * R)
    if shared:
        args.update(share_gmm1_weight=torch.randint(-5, 5, (H, 2 * share_inter), dtype=torch.int8, generator=g),
                    share_gmm1_weight_scale=torch.rand(2 * share_inter, generator=g),
                    share_gmm2_weight=torch.randint(-5, 5, (share_inter, H), dtype=torch.int8, generator=g),
                    share_gmm2_weight_scale=torch.rand(H, generator=g),
                    share_smooth_scales=torch.rand(H, generator=g))
    return args


def check_fdm_inputs(args, rec):
    """The 14 inputs of every FusedDeepMoe prototype, in SPEC.md §7.2 order."""
    tensor_arg(rec[0], args["x"], BF16)
    tensor_arg(rec[1], args["expert_ids"], INT32)
    for i, name in enumerate(("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale")):
        items = rec[2 + i]["items"]
        assert rec[2 + i]["kind"] == "list" and len(items) == len(args[name])
        for item, t in zip(items, args[name]):
            tensor_arg(item, t, INT8 if t.dtype == torch.int8 else INT32 if t.dtype == torch.int32 else F32)
    tensor_arg(rec[6], args["expert_scales"], F32)
    for i, name in enumerate(("share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight",
                              "share_gmm2_weight_scale", "expert_smooth_scales", "share_smooth_scales",
                              "x_active_mask")):
        t = args[name]
        if t is None:
            assert rec[7 + i] is None, name
        else:
            tensor_arg(rec[7 + i], t, {torch.int8: INT8, torch.int32: INT32, torch.float32: F32,
                                      torch.bool: BOOL}[t.dtype])


def check_outputs(rec, outputs, dtypes):
    for r, t, dtype in zip(rec, outputs, dtypes):
        tensor_arg(r, t, dtype)


def test_fused_deep_moe_base_abi_arrives_in_spec_order(sims, bound):
    """The base prototype as FusedDeepMoeBuffer calls it: the private op with the SHMEM attributes."""
    bind, ops, _ = bound
    sim = sims["base"]
    bind([sim.path], "base")
    sim.lib.sim_set_workspace(4096)
    args = w8a8_case()
    output, share_output = torch.zeros(3, 32, dtype=torch.bfloat16), torch.zeros(3, 32, dtype=torch.bfloat16)
    nums = torch.zeros(2, dtype=torch.int64)
    ops.fused_deep_moe(*args.values(), 0, 7, 8, 9, output, share_output, nums)
    ws, launch = sim.calls()
    assert ws["fn"] == "aclnnFusedDeepMoeGetWorkspaceSize"
    rec = ws["args"]
    assert len(rec) == 14 + 1 + 8 + 3
    check_fdm_inputs(args, rec)
    assert rec[14] == {"kind": "str", "value": "ep_group_7"}
    # epRankSize, epRankId, moeExpertNum, quantMode, globalBs, extInfo, shmemWorkspace, shmemWorkspaceSize
    assert ints(rec[15:23]) == [2, 1, 4, 0, 6, 7, 8, 9]
    check_outputs(rec[23:], (output, share_output, nums), (BF16, BF16, INT64))
    assert launch == {"fn": "aclnnFusedDeepMoe", "workspace_null": 0, "workspace_size": 4096,
                      "executor_ok": 1, "stream": STREAM}
    assert sim.live() == 0  # every tensor and list handle destroyed


def test_fused_deep_moe_master_abi_and_absent_optionals(sims, bound):
    bind, _, _ = bound
    sim = sims["master"]
    bind([sim.path], "master")
    args = w8a8_case(shared=False)
    args["x_active_mask"] = torch.tensor([True, True, False])
    args["expert_smooth_scales"] = None
    output, share_output, nums = npu_ops.fused_deep_moe(**args)
    ws, launch = sim.calls()
    rec = ws["args"]
    assert len(rec) == 14 + 1 + 5 + 3
    check_fdm_inputs(args, rec)
    assert all(rec[i] is None for i in range(7, 13))
    assert ints(rec[15:20]) == [2, 1, 4, 0, 6]
    check_outputs(rec[20:], (output, share_output, nums), (BF16, BF16, INT64))
    assert launch["workspace_null"] == 1 and launch["workspace_size"] == 0
    assert sim.live() == 0


def test_fused_deep_moe_w4a8_abi_passes_the_bias_lists(sims, bound):
    """Driven through the private op: cam_jit's W8A8-only validation does not take int32 weights."""
    bind, ops, _ = bound
    sim = sims["w4a8"]
    bind([sim.path], "w4a8")
    args = w8a8_case(shared=True)
    for name in ("gmm1_weight", "gmm2_weight"):
        args[name] = [torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32) for w in args[name]]
    args["share_gmm1_weight"] = torch.zeros(32, 2, dtype=torch.int32)
    args["share_gmm2_weight"] = torch.zeros(8, 4, dtype=torch.int32)
    args["gmm1_bias"] = [torch.rand(32) for _ in range(2)]
    args["gmm2_bias"] = [torch.rand(32) for _ in range(2)]
    args["share_gmm1_bias"] = torch.rand(16)
    outputs = [torch.zeros(3, 32, dtype=torch.bfloat16), torch.zeros(3, 32, dtype=torch.bfloat16),
               torch.zeros(2, dtype=torch.int64)]
    ops.fused_deep_moe(*args.values(), 1, 0, 0, 0, *outputs)
    rec = sim.calls()[0]["args"]
    assert len(rec) == 14 + 4 + 1 + 5 + 3
    check_fdm_inputs(args, rec)
    for i, name in ((14, "gmm1_bias"), (15, "gmm2_bias")):
        assert rec[i]["kind"] == "list" and len(rec[i]["items"]) == 2
        for r, t in zip(rec[i]["items"], args[name]):
            tensor_arg(r, t, F32)
    tensor_arg(rec[16], args["share_gmm1_bias"], F32)
    assert rec[17] is None
    assert rec[18]["value"] == "ep_group_7" and ints(rec[19:24]) == [2, 1, 4, 0, 6]
    check_outputs(rec[24:], outputs, (BF16, BF16, INT64))
    assert sim.live() == 0


def test_fused_deep_moe_variant_mismatches_are_refused(sims, bound):
    bind, ops, _ = bound
    bind([sims["w4a8"].path], "w4a8")
    with pytest.raises(RuntimeError, match=r"gmm1_weight.*w4a8 variant.*int32 \(W4A8\).*got int8"):
        npu_ops.fused_deep_moe(**w8a8_case())
    bind([sims["base"].path], None)
    with pytest.raises(RuntimeError, match="cannot tell which aclnnFusedDeepMoe prototype"):
        npu_ops.fused_deep_moe(**w8a8_case())
    bind([sims["base"].path], "base")
    args = w8a8_case(shared=False)
    args["gmm1_bias"] = [torch.rand(32)]
    outputs = [torch.zeros(3, 32, dtype=torch.bfloat16)] * 2 + [torch.zeros(2, dtype=torch.int64)]
    with pytest.raises(RuntimeError, match="base aclnnFusedDeepMoe takes no biases"):
        ops.fused_deep_moe(*args.values(), 0, 0, 0, 0, *outputs)
    with pytest.raises(RuntimeError, match="abi must be 0 \\(base\\), 1 \\(w4a8\\) or 2 \\(master\\), got 5"):
        ops.fused_deep_moe(*w8a8_case(shared=False).values(), 5, 0, 0, 0, *outputs)
    assert sims["base"].calls() == [] and sims["base"].live() == 0


def a2e_args(rank):
    g = torch.Generator().manual_seed(1)
    rows = 6 if rank == 0 else 3
    return dict(x=torch.randn(rows, 16, generator=g).to(torch.bfloat16),
                expert_ids=torch.randint(0, 8, (3, 2), dtype=torch.int32, generator=g) if rank else None,
                scales=torch.rand(3, 2, generator=g) if rank else None, batch_size=6, hidden_size=16,
                topk=2, expert_rank_size=1, atten_rank_size=2, rank=rank, group_ep="afd", aiv_num=8,
                compute_gate=1)


@pytest.mark.parametrize("rank", [0, 2])
def test_a2e_arrives_in_spec_order(sims, bound, rank):
    bind, _, _ = bound
    sim = sims["base"]
    bind([sim.path])
    args = a2e_args(rank)
    outputs = npu_ops.a2e(**args)
    rec = sim.calls()[0]["args"]
    assert sim.calls()[0]["fn"] == "aclnnA2eGetWorkspaceSize" and len(rec) == 3 + 9 + 5
    tensor_arg(rec[0], args["x"], BF16)
    if rank == 0:  # expert rank: no routing inputs; batch attribute = batch_size
        assert rec[1] is None and rec[2] is None
        batch = 6
    else:  # attention rank: the upstream wrapper passes x.shape[0] as the batch (SPEC §2.3)
        tensor_arg(rec[1], args["expert_ids"], INT32)
        tensor_arg(rec[2], args["scales"], F32)
        batch = 3
    # batchSize, hiddenSize, topk, expertRankSize, attentionRankSize, rank, groupEp, aivNum, computeGate
    assert ints(rec[3:9]) == [batch, 16, 2, 1, 2, rank]
    assert rec[9] == {"kind": "str", "value": "afd"} and ints(rec[10:12]) == [8, 1]
    check_outputs(rec[12:], outputs, (BF16, INT32, F32, INT32, BOOL))
    assert sim.live() == 0


def test_e2a_arrives_in_spec_order(sims, bound):
    bind, _, _ = bound
    sim = sims["base"]
    bind([sim.path])
    expand_x = torch.randn(3, 16).to(torch.bfloat16)
    batches = torch.zeros(2, dtype=torch.int32)
    out = npu_ops.e2a(expand_x, batches, 6, 16, 2, 1, 2, 2, "afd", 8)
    assert out.shape == (3, 16) and out.dtype == torch.bfloat16
    rec = sim.calls()[0]["args"]
    assert sim.calls()[0]["fn"] == "aclnnE2aGetWorkspaceSize" and len(rec) == 2 + 8 + 1
    tensor_arg(rec[0], expand_x, BF16)
    tensor_arg(rec[1], batches, INT32)
    # attention rank: the batch attribute is expand_x's row count (UMDK pybind/e2a.cpp E2aImplNpu)
    assert ints(rec[2:8]) == [3, 16, 2, 1, 2, 2] and rec[8]["value"] == "afd" and ints(rec[9:10]) == [8]
    tensor_arg(rec[10], out, BF16)


def test_detour_attributes_are_int64(sims, bound):
    """magic and rankSize were int32 locals upstream; cam_jit passes int64 (SPEC.md §7.1): a
    value above 2**32 must arrive unchanged."""
    bind, ops, _ = bound
    sim = sims["base"]
    bind([sim.path])
    send = torch.randn(4, 6).to(torch.float16)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    comm_args = torch.zeros(64, dtype=torch.float16)
    out = torch.zeros_like(send)
    big = 2**33 + 5
    ops.all2_all_detour(send, ids, comm_args, big, out)
    rs_out = torch.zeros(2, 6, dtype=torch.float16)
    ops.reduce_scatter_detour(send, ids, comm_args, big + 1, 2**40, 3, rs_out)
    a2a, _, rs, _ = sim.calls()
    assert a2a["fn"] == "aclnnAll2AllDetourGetWorkspaceSize"
    for r, t, dtype in zip(a2a["args"], (send, ids, comm_args), (1, INT32, 1)):
        tensor_arg(r, t, dtype)
    assert ints(a2a["args"][3:4]) == [big]
    tensor_arg(a2a["args"][4], out, 1)
    assert rs["fn"] == "aclnnReduceScatterDetourGetWorkspaceSize"
    assert ints(rs["args"][3:6]) == [big + 1, 2**40, 3]
    tensor_arg(rs["args"][6], rs_out, 1)
    assert sim.live() == 0


def test_views_and_fractal_nz_storage(sims, bound):
    """A strided view passes its storage base, offset and strides; a tensor whose storage is
    FRACTAL_NZ passes format 29 and the NZ storage dims (SPEC.md §1.15: int8 [K, N] is stored
    as [N/32][K/16][16][32])."""
    bind, ops, lib = bound
    sim = sims["base"]
    bind([sim.path])
    base = torch.randn(8, 12).to(torch.float16)
    view = base[2:6, 1:7]  # offset 25, strides (12, 1)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    weight = torch.zeros(32, 64, dtype=torch.int8)  # stands in for an NZ-formatted weight
    nz_dims = (ctypes.c_int64 * 4)(2, 2, 16, 32)
    lib.cam_jit_test_set_storage_format(weight.untyped_storage().data_ptr(), NZ, nz_dims, 4)
    out = torch.zeros(4, 6, dtype=torch.float16)
    ops.all2_all_detour(view, ids, weight, 1, out)
    rec = sim.calls()[0]["args"]
    tensor_arg(rec[0], view, 1, storage=[96])
    assert rec[0]["offset"] == 25 and rec[0]["strides"] == [12, 1]
    tensor_arg(rec[2], weight, INT8, fmt=NZ, storage=[2, 2, 16, 32])


def test_error_status_names_op_function_status_and_libraries(sims, bound):
    bind, _, _ = bound
    sim = sims["base"]
    bind([sim.path])
    sim.lib.sim_set_status(561103, 0)
    with pytest.raises(RuntimeError) as e:
        npu_ops.a2e(**a2e_args(2))
    text = str(e.value)
    for part in ("cam_jit NPU op a2e", "aclnnA2eGetWorkspaceSize returned status 561103",
                 str(sim.path), "CANN says: simulated failure"):
        assert part in text, (part, text)
    assert sim.live() == 0  # released on the error path too
    sim.lib.sim_reset()
    sim.lib.sim_set_status(0, 7)
    with pytest.raises(RuntimeError, match="aclnn function aclnnA2e returned status 7"):
        npu_ops.a2e(**a2e_args(2))
    assert [c["fn"] for c in sim.calls()] == ["aclnnA2eGetWorkspaceSize", "aclnnA2e"]
    assert sim.live() == 0


def test_missing_symbols_name_the_libraries_searched(sims, bound, tmp_path):
    bind, ops, _ = bound
    missing = tmp_path / "vendors" / "gone" / "libcust_opapi.so"
    bind([missing, sims["api_only"].path])
    with pytest.raises(RuntimeError) as e:
        npu_ops.e2a(torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32),
                    6, 16, 2, 1, 2, 2, "afd", 8)
    text = str(e.value)
    for part in ("cam_jit NPU op e2a", "aclnn function aclnnE2aGetWorkspaceSize not found",
                 f"{missing} (cannot load", str(sims["api_only"].path)):
        assert part in text, (part, text)
    assert sims["api_only"].live() == 0
    bind([])
    with pytest.raises(RuntimeError, match="tensor API function aclCreateTensor was not found"):
        ops.all2_all_detour(torch.zeros(2), torch.zeros(2, dtype=torch.int32),
                            torch.zeros(64, dtype=torch.float16), 1, torch.zeros(2))


def test_search_order_first_library_wins(sims, bound):
    bind, _, _ = bound
    bind([sims["api_only"].path, sims["master"].path, sims["base"].path], "master")
    npu_ops.fused_deep_moe(**w8a8_case(shared=False))
    assert [c["fn"] for c in sims["master"].calls()] == ["aclnnFusedDeepMoeGetWorkspaceSize",
                                                         "aclnnFusedDeepMoe"]
    assert sims["base"].calls() == [] and sims["api_only"].calls() == []


def test_unsupported_dtype_names_the_argument_and_releases_handles(sims, bound):
    bind, ops, _ = bound
    sim = sims["base"]
    bind([sim.path])
    with pytest.raises(RuntimeError, match="all2_all_detour: argument 'commArgs': dtype ComplexFloat"):
        ops.all2_all_detour(torch.zeros(2), torch.zeros(2, dtype=torch.int32),
                            torch.zeros(4, dtype=torch.complex64), 1, torch.zeros(2))
    assert sim.live() == 0 and sim.calls() == []


def test_every_registry_op_has_a_private_op(npu_harness):
    ops, _ = npu_harness
    for name in registry.torch_ops():
        assert hasattr(ops, name), name
    assert set(registry.torch_ops()) == set(npu_ops.KERNELS)
    assert npu_ops.aclnn_table() == {"fused_deep_moe": "aclnnFusedDeepMoe", "a2e": "aclnnA2e",
                                     "e2a": "aclnnE2a", "all2_all_detour": "aclnnAll2AllDetour",
                                     "reduce_scatter_detour": "aclnnReduceScatterDetour",
                                     "moe_dispatch_layout": "aclnnDispatchLayout",
                                     "moe_notify_dispatch": "aclnnNotifyDispatch",
                                     "moe_dispatch_normal": "aclnnMoeDispatchNormal",
                                     "moe_combine_normal": "aclnnMoeCombineNormal"}


def test_fused_deep_moe_w4a8_through_the_kernel(sims, bound):
    """W4A8 weights through the PrivateUse1 kernel function (needs the op's W4A8 validation)."""
    bind, _, _ = bound
    sim = sims["w4a8"]
    bind([sim.path], "w4a8")
    args = w8a8_case(shared=True)
    for name in ("gmm1_weight", "gmm2_weight"):
        args[name] = [torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32) for w in args[name]]
    args.update(share_gmm1_weight=torch.zeros(32, 2, dtype=torch.int32),
                share_gmm2_weight=torch.zeros(8, 4, dtype=torch.int32),
                gmm1_bias=[torch.rand(32) for _ in range(2)], gmm2_bias=[torch.rand(32) for _ in range(2)],
                share_gmm1_bias=torch.rand(16), share_gmm2_bias=torch.rand(32))
    try:
        outputs = npu_ops.fused_deep_moe(**args)
    except NotImplementedError as e:
        pytest.skip(f"the op's validation does not take W4A8 weights yet: {e}")
    rec = sim.calls()[0]["args"]
    assert len(rec) == 14 + 4 + 1 + 5 + 3
    check_fdm_inputs(args, rec)
    tensor_arg(rec[16], args["share_gmm1_bias"], F32)
    tensor_arg(rec[17], args["share_gmm2_bias"], F32)
    assert ints(rec[19:24]) == [2, 1, 4, 0, 6]
    check_outputs(rec[24:], outputs, (BF16, BF16, INT64))
    bind([sims["base"].path], "base")
    with pytest.raises(RuntimeError, match=r"base variant.*takes int8 \(W8A8\) weights, got int32"):
        npu_ops.fused_deep_moe(**args)


def test_failed_workspace_allocation_releases_the_executor(sims, bound):
    bind, ops, _ = bound
    sim = sims["base"]
    bind([sim.path])
    sim.lib.sim_set_workspace(1 << 62)  # no allocator can give this
    with pytest.raises(RuntimeError):
        ops.all2_all_detour(torch.zeros(2), torch.zeros(2, dtype=torch.int32),
                            torch.zeros(64, dtype=torch.float16), 1, torch.zeros(2))
    assert [c["fn"] for c in sim.calls()] == ["aclnnAll2AllDetourGetWorkspaceSize",
                                              "aclDestroyAclOpExecutor"]
    assert sim.calls()[1]["executor_ok"] == 1 and sim.live() == 0


def test_w8a8_weights_must_be_fractal_nz_on_the_npu(sims, bound, monkeypatch):
    """SPEC.md §1.15: the kernel reads int8 weights as FRACTAL_NZ; an ND one is refused with the
    conversion to make (the format is read from torch_npu, faked here)."""
    bind, _, _ = bound
    sim = sims["master"]
    bind([sim.path], "master")
    args = w8a8_case(shared=False)
    nz_storage = {t.untyped_storage().data_ptr() for t in args["gmm1_weight"] + args["gmm2_weight"]}
    monkeypatch.setattr(npu_ops, "npu_format",
                        lambda t: 29 if t.untyped_storage().data_ptr() in nz_storage else 2)
    npu_ops.fused_deep_moe(**args)
    assert sim.calls()[0]["fn"] == "aclnnFusedDeepMoeGetWorkspaceSize"
    nz_storage.discard(args["gmm2_weight"][1].untyped_storage().data_ptr())
    sim.lib.sim_reset()
    with pytest.raises(ValueError, match=r"argument 'gmm2_weight\[1\]': expected an int8 weight stored "
                       r"FRACTAL_NZ .*npu_format_cast\(weight, 29\)\), got format 2"):
        npu_ops.fused_deep_moe(**args)
    assert sim.calls() == []
