"""The NPU path end to end against the executing stand-in: bit-identical to the CPU backend.

Each test calls cam_jit's NPU kernel functions (``cam_jit.ascend.npu_ops``: the PrivateUse1
kernels) with CPU tensors standing for NPU ones. They go through the real wrappers and exec helper
(``wrappers/*.cpp`` with the test runtime, tests/npu_sim/test_runtime.cpp) into the simulated
opapi (tests/npu_sim/sim_opapi.c), whose launches run the stand-in kernels of
tests/npu_sim/standin.py: those rebuild every operand from the ACL descriptors alone (address,
dtype, view shape, strides, storage offset, format, storage dims) and compute with the CPU
backend's op. Each result must equal the CPU backend's own call bit for bit; a wrong descriptor,
attribute or communicator name changes the result or makes the stand-in kernel fail.

What this proves: the marshalling of every argument kind (views, non-contiguous tensors, tensor
lists, absent optionals, FRACTAL_NZ weights), the three FusedDeepMoe prototypes, the launch
through the task queue, the communicator name, SHMEM bootstrap and the buffer's attributes. What
it cannot: the device kernels themselves, GE compilation, HCCL and real SHMEM.
"""
import pytest
import torch

import cam_jit
from cam_jit.ascend import hccl, npu_ops
from cam_jit.ops.weights import nd_to_nz
from cam_jit.zero_buffer import FusedDeepMoeBuffer, _npu
from moe_cases import make_rank_case
from npu_sim import standin

SOLO = "hccl_comm:solo"  # an HCCL communicator name of a one-rank group (passed through as is)


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    variants = {name: [f"-DSIM_FDM_ABI={code}"] for name, code in (("base", 0), ("w4a8", 1), ("master", 2))}
    return standin.build_sims(tmp_path_factory.mktemp("sim_e2e"), variants)


@pytest.fixture
def npu(sims, npu_harness, monkeypatch):
    """bind(variant) binds npu_ops to the harness and that sim, executing; yields (bind, lib)."""
    ops, lib = npu_harness
    monkeypatch.setitem(standin.COMMUNICATORS, SOLO, "")
    monkeypatch.setattr(hccl, "backend_comm_name", standin.hccl_comm_name)
    active = []

    def bind(variant):
        sim = sims[variant]
        sim.lib.sim_reset()
        npu_ops.bind(ops, [str(sim.path)], variant, "set by the test")
        context = standin.executing(sim)
        context.__enter__()
        active.append(context)
        return sim

    yield bind, lib
    for context in active:
        context.__exit__(None, None, None)
    lib.cam_jit_test_defer_launches(0)
    lib.cam_jit_test_set_storage_format(0, -1, None, 0)
    npu_ops._BINDING = None


def case(variant="w8a8", **overrides):
    params = dict(ranks=1, bs=5, hidden=32, inter=16, experts=2, topk=2, share_inter=16, smooth=True,
                  active_counts=[4], per_expert_lists=True, group_ep=SOLO)
    params.update(overrides)
    return make_rank_case(11, 0, variant=variant, **params)


def cpu(args):
    return torch.ops.cam_jit.fused_deep_moe(**{**args, "group_ep": ""})


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), (g, w)


def test_master_prototype_is_bit_identical_to_cpu(npu):
    bind, _ = npu
    sim = bind("master")
    args = case()
    want = cpu(args)
    assert want[0].any() and want[1].any() and want[2].any()
    assert_same(npu_ops.fused_deep_moe(**args), want)
    assert [c["fn"] for c in sim.calls()] == ["aclnnFusedDeepMoeGetWorkspaceSize", "aclnnFusedDeepMoe"]
    assert sim.live() == 0


def test_w4a8_prototype_with_bias_lists_is_bit_identical_to_cpu(npu):
    bind, _ = npu
    sim = bind("w4a8")
    args = case("w4a8", smooth=False)
    assert args["gmm1_bias"] and args["share_gmm1_bias"] is not None
    assert_same(npu_ops.fused_deep_moe(**args), cpu(args))
    assert len(sim.calls()[0]["args"]) == 27 and sim.live() == 0


def test_absent_optionals_are_null_and_the_result_still_matches(npu):
    bind, _ = npu
    sim = bind("master")
    args = case(share_inter=None, smooth=False, active_counts=None)
    assert_same(npu_ops.fused_deep_moe(**args), cpu(args))
    assert sim.calls()[0]["args"][7:14] == [None] * 7


def test_stacked_weights_as_one_list_item(npu):
    bind, _ = npu
    bind("master")
    args = case(per_expert_lists=False)
    assert len(args["gmm1_weight"]) == 1 and args["gmm1_weight"][0].dim() == 3
    assert_same(npu_ops.fused_deep_moe(**args), cpu(args))


def test_views_with_storage_offsets(npu):
    """Operands that are slices of larger storages: the stand-in reads them from their base address
    at the storage offset the wrapper passed."""
    bind, _ = npu
    sim = bind("master")
    args = case()
    x = args["x"]
    big = torch.zeros(x.shape[0] + 3, x.shape[1], dtype=x.dtype)
    big[2:2 + x.shape[0]] = x
    stacked = {name: torch.stack(args[name]) for name in ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight",
                                                          "gmm2_weight_scale")}
    viewed = dict(args, x=big[2:2 + x.shape[0]], **{name: list(t.unbind(0)) for name, t in stacked.items()})
    assert viewed["x"].storage_offset() == 2 * x.shape[1] and viewed["gmm2_weight"][1].storage_offset() > 0
    assert_same(npu_ops.fused_deep_moe(**viewed), cpu(args))
    record = sim.calls()[0]["args"]
    assert record[0]["offset"] == 2 * x.shape[1] and record[4]["items"][1]["offset"] > 0


def test_non_contiguous_inputs(npu):
    bind, _ = npu
    sim = bind("master")
    args = case()

    def strided(t):  # same values, column-major (or every other element of a wider buffer)
        if t.dim() == 2:
            return t.t().contiguous().t()
        wide = torch.zeros(2 * t.numel(), dtype=t.dtype)
        wide[::2] = t
        return wide[::2]

    odd = dict(args, x=strided(args["x"]), expert_ids=strided(args["expert_ids"]),
               expert_scales=strided(args["expert_scales"]), expert_smooth_scales=strided(args["expert_smooth_scales"]),
               gmm1_weight_scale=[strided(t) for t in args["gmm1_weight_scale"]],
               share_smooth_scales=strided(args["share_smooth_scales"]))
    assert not odd["x"].is_contiguous() and not odd["gmm1_weight_scale"][0].is_contiguous()
    assert_same(npu_ops.fused_deep_moe(**odd), cpu(args))
    assert sim.calls()[0]["args"][0]["strides"] == [1, args["x"].shape[0]]


def nz(lib, weight):
    """``weight`` [K, N] int8 as a tensor of the same shape whose storage holds its FRACTAL_NZ
    bytes, tagged so the runtime reports format 29 with the NZ storage dims (as torch_npu does for
    a tensor after npu_format_cast(weight, 29))."""
    k, n = weight.shape
    tagged = nd_to_nz(weight)  # [K, N] shape, NZ byte order
    standin.tag_format(lib, tagged, standin.NZ, [n // 32, k // 16, 16, 32])
    return tagged


def test_fractal_nz_weights_are_read_through_their_storage_dims(npu):
    bind, lib = npu
    sim = bind("master")
    args = case(hidden=64, inter=32, share_inter=32)  # N >= 64: NZ bytes differ from row-major ones
    blocked = dict(args, gmm1_weight=[nz(lib, w) for w in args["gmm1_weight"]],
                   gmm2_weight=[nz(lib, w) for w in args["gmm2_weight"]],
                   share_gmm1_weight=nz(lib, args["share_gmm1_weight"]),
                   share_gmm2_weight=nz(lib, args["share_gmm2_weight"]))
    assert not torch.equal(blocked["gmm1_weight"][0], args["gmm1_weight"][0])  # the bytes really differ
    assert_same(npu_ops.fused_deep_moe(**blocked), cpu(args))
    w1 = sim.calls()[0]["args"][2]["items"][0]
    assert w1["format"] == standin.NZ and w1["storage"] == [2, 4, 16, 32]


def test_the_launch_runs_on_the_task_queue_and_releases_the_handles_there(npu):
    """op-plugin's EXEC_NPU_CMD (op_api_common.h, torch-npu 2.13.0): workspace size and workspace on
    the calling thread, the aclnn launch and the handle release in the lambda queued with
    OpCommand::RunOpApiV2. The test runtime holds queued launches until it is told to run them."""
    bind, lib = npu
    sim = bind("master")
    args = case()
    lib.cam_jit_test_defer_launches(1)
    outputs = npu_ops.fused_deep_moe(**args)
    assert [c["fn"] for c in sim.calls()] == ["aclnnFusedDeepMoeGetWorkspaceSize"]
    assert sim.live() > 0 and not outputs[0].any()  # handles alive until the launch; nothing ran
    assert lib.cam_jit_test_run_queue() == 1
    assert [c["fn"] for c in sim.calls()][-1] == "aclnnFusedDeepMoe" and sim.live() == 0
    assert_same(outputs, cpu(args))


def test_a_failing_queued_launch_reports_the_kernel_error_and_still_releases(npu):
    bind, lib = npu
    sim = bind("master")
    lib.cam_jit_test_defer_launches(1)
    npu_ops.fused_deep_moe(**case(group_ep="hccl_comm:nobody"))
    assert lib.cam_jit_test_run_queue() == -1
    text = lib.cam_jit_test_queue_error().decode()
    assert "aclnn function aclnnFusedDeepMoe returned status 561103" in text
    assert "CANN says: stand-in aclnnFusedDeepMoe: StandinError: aclnnFusedDeepMoe: no HCCL communicator " \
           "named 'hccl_comm:nobody'" in text
    assert sim.live() == 0


def test_a_torch_group_name_that_is_no_hccl_name_fails_in_the_kernel(npu):
    """A string naming no torch group passes through as an HCCL name: the kernel's communicator
    lookup then fails, and its message reaches the caller."""
    bind, _ = npu
    bind("master")
    with pytest.raises(RuntimeError, match="no HCCL communicator named 'my_group'"):
        npu_ops.fused_deep_moe(**case(group_ep="my_group"))


def test_zero_buffer_through_shmem_and_the_base_prototype_is_bit_identical(sims, npu_harness, monkeypatch):
    """The buffer path: UMDK cam_feature src/cam/comm_operator/pybind/buffer.cpp (Buffer::init,
    zb_fused_deep_moe) -> SHMEM heap, then aclnnFusedDeepMoe's base prototype with ext_info,
    shmem_workspace and memsize - 2 MiB; the stand-in kernel accepts only this PE's live SHMEM
    allocations."""
    ops, _ = npu_harness
    shmem = standin.SHMEM[0]
    shmem.sim_shmem_reset()
    sim = sims["base"]
    sim.lib.sim_reset()
    monkeypatch.setattr(_npu, "NPU_DEVICE", "cpu")
    npu_ops.bind(ops, [str(sim.path)], "base", "set by the test")
    args = case(group_ep="")
    buf = FusedDeepMoeBuffer()
    try:
        with standin.executing(sim):
            buf.init(0, 1, 8 << 20, "tcp://127.0.0.1:1", device="npu")
            names = ("x", "expert_ids", "gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale",
                     "expert_scales", "share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight",
                     "share_gmm2_weight_scale", "expert_smooth_scales", "share_smooth_scales", "x_active_mask")
            got = buf.zb_fused_deep_moe(*[args[n] for n in names], "", 1, 0, args["moe_expert_num"], 0,
                                        args["global_bs"])
        assert_same(got, cpu(args))
        assert sim.calls()[0]["args"][20:23] == [{"kind": "int", "value": v} for v in
                                                 (buf.get_ext_info(), buf.get_shmem_workspace(), (8 << 20) - (2 << 20))]
    finally:
        buf.close()
        npu_ops._BINDING = None
    assert shmem.sim_shmem_live() == 0 and sim.live() == 0


# ---- several ranks: real processes over gloo, the stand-in kernels' transport -------------------
def _bind_in_worker(sim_path, variant):
    from pathlib import Path

    ops, _ = standin.build_harness()
    hccl.backend_comm_name = standin.hccl_comm_name
    sim = standin.Sim(Path(sim_path))
    npu_ops.bind(ops, [sim_path], variant, "set by the test")
    return sim


def _fused_deep_moe_two_ranks(sim_path):
    import torch.distributed as dist

    sim = _bind_in_worker(sim_path, "master")
    args = make_rank_case(21, dist.get_rank(), ranks=2, bs=[3, 4], hidden=32, inter=16, experts=4, topk=2,
                          share_inter=16, smooth=True, per_expert_lists=True, group_ep="")
    try:
        with standin.executing(sim):
            got = npu_ops.fused_deep_moe(**args)
        want = torch.ops.cam_jit.fused_deep_moe(**args)
        group = sim.calls()[0]["args"][14]["value"]
    finally:
        npu_ops._BINDING = None
    return [torch.equal(g, w) for g, w in zip(got, want)], group, dist.group.WORLD.group_name


def test_two_ranks_of_fused_deep_moe_are_bit_identical_to_cpu(sims, rank_pool):
    for same, group, world in rank_pool(2).run(_fused_deep_moe_two_ranks, str(sims["master"].path)):
        assert same == [True, True, True]
        assert group == f"hccl_comm:{world}"  # "" resolved to the default group's HCCL name


def _a2e_e2a_two_ranks(sim_path):
    import torch.distributed as dist

    sim = _bind_in_worker(sim_path, "master")
    rank, batch, hidden, topk = dist.get_rank(), 4, 16, 2
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(batch if rank else 0, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 8, (batch, topk), dtype=torch.int32, generator=g) if rank else None
    scales = torch.rand(batch, topk, generator=g) if rank else None
    a2e_args = (x, ids, scales, batch, hidden, topk, 1, 1, rank, dist.group.WORLD.group_name, 8, 1)
    try:
        with standin.executing(sim):
            got = npu_ops.a2e(*a2e_args)
            back_in = got[0] if rank == 0 else x
            got_back = npu_ops.e2a(back_in, got[3], batch, hidden, topk, 1, 1, rank, "", 8)
    finally:
        npu_ops._BINDING = None
    want = torch.ops.cam_jit.a2e(*a2e_args)
    want_back = torch.ops.cam_jit.e2a(want[0] if rank == 0 else x, want[3], batch, hidden, topk, 1, 1, rank, "", 8)
    same = [torch.equal(a, b) for a, b in zip([*got, got_back], [*want, want_back])]
    return same, bool(want[0].any()) if rank == 0 else bool(want_back.any())


def test_a2e_then_e2a_on_two_ranks_are_bit_identical_to_cpu(sims, rank_pool):
    for same, nonzero in rank_pool(2).run(_a2e_e2a_two_ranks, str(sims["master"].path)):
        assert same == [True] * 6 and nonzero
