"""What upstream's own bindings pass to aclnn, restated by hand, against what cam_jit passes.

Each test names the upstream file and function it restates (UMDK = openeuler-mirror/umdk, branch
cam_feature unless said; sgl-kernel-npu = sgl-project/sgl-kernel-npu; op-plugin's
op_api_common.h as shipped in the torch-npu 2.13.0 wheel). cam_jit's side is what the wrapper
library hands the simulated opapi (tests/npu_sim/sim_opapi.c logs every argument), driven through
cam_jit's NPU kernel functions with CPU tensors. The stand-in for torch_npu's HCCL backend names a
group's communicator ``hccl_comm:<group name>`` (tests/npu_sim/standin.py).
"""
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from cam_jit.ascend import hccl, npu_ops, opp, opp_install, report
from moe_cases import make_rank_case
from npu_sim import standin

BF16, F16, F32, I32, I64, BOOL = 27, 1, 0, 3, 9, 12  # aclDataType


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim_conformance")
    variants = {"base": ["-DSIM_FDM_ABI=0"], "master": ["-DSIM_FDM_ABI=2"],
                "no_errmsg": ["-DSIM_FDM_ABI=2", "-DSIM_NO_ERRMSG"], "ascendcl": ["-DSIM_ERRMSG_ONLY"]}
    return standin.build_sims(out, variants)


@pytest.fixture
def bound(sims, npu_harness, monkeypatch):
    """bind(variant, *more) binds npu_ops to the harness and those sims (not executing)."""
    ops, lib = npu_harness
    monkeypatch.setattr(hccl, "backend_comm_name", standin.hccl_comm_name)

    def bind(*variants, abi="master"):
        for v in variants:
            sims[v].lib.sim_reset()
        npu_ops.bind(ops, [str(sims[v].path) for v in variants], abi, "set by the test")
        return sims[variants[0]]

    yield bind
    lib.cam_jit_test_defer_launches(0)
    npu_ops._BINDING = None


def arg(record, i):
    return record["args"][i]


def value(record, i):
    return arg(record, i)["value"]


# ---- 1. group_ep is the HCCL communicator name ---------------------------------------------------
def _group_names_in_worker(sim_path):
    import torch.distributed as dist

    from cam_jit import register_group

    ops, _ = standin.build_harness()
    saved = hccl.backend_comm_name
    asked = []

    def backend(group, rank):
        asked.append(rank)
        return standin.hccl_comm_name(group, rank)

    hccl.backend_comm_name = backend
    sim = standin.Sim(Path(sim_path))
    npu_ops.bind(ops, [sim_path], "master", "set by the test")
    rank = dist.get_rank()
    solo = dist.new_group([1])  # on rank 1: global rank 1, rank 0 in this group
    world = dist.group.WORLD
    register_group("moe_ep", world)
    given = [("", world), (world.group_name, world), ("moe_ep", world), ("hccl_already_a_name", None)]
    if rank == 1:
        given.append((solo.group_name, solo))
    seen = []
    try:
        for name, group in given:
            sim.lib.sim_reset()
            args = make_rank_case(1, 0, ranks=1, bs=2, hidden=32, inter=16, experts=2, topk=1, group_ep=name)
            npu_ops.fused_deep_moe(**args)
            got = value(sim.calls()[0], 14)
            seen.append((got, standin.hccl_comm_name(group, 0) if group is not None else name))
    finally:
        hccl.backend_comm_name = saved
        npu_ops._BINDING = None
    return seen, asked


def test_group_ep_arrives_as_the_hccl_communicator_name(sims, rank_pool):
    """UMDK src/cam/examples/fused_deep_moe_sample.py (main) and a2e_e2a_sample.py (main) pass
    ``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)`` as group_ep, and
    sgl-kernel-npu python/deep_ep/deep_ep/buffer.py (Buffer.__init__) asks
    ``get_hccl_comm_name(group.rank())``: the kernel's tiling finds the communicator by that string.
    A ProcessGroup's name, "" (default group) and a registered name all become the HCCL name (asked
    with the rank in that group); a string naming no torch group passes through."""
    for rank, (seen, asked) in enumerate(rank_pool(2).run(_group_names_in_worker, str(sims["master"].path))):
        assert all(got == want for got, want in seen), seen
        assert len(seen) == 4 + rank
        assert asked == [rank, rank, rank] + ([0] if rank == 1 else [])


def test_an_empty_group_name_without_torch_distributed_is_refused(bound):
    """group_ep="" names the default group, which needs torch.distributed; without it there is no
    HCCL name to pass (UMDK's samples always pass get_hccl_comm_name's result)."""
    bound("master")
    args = make_rank_case(1, 0, ranks=1, bs=2, hidden=32, inter=16, experts=2, topk=1, group_ep="")
    with pytest.raises(ValueError, match="argument 'group_ep': expected a process group with an HCCL backend"):
        npu_ops.fused_deep_moe(**args)


# ---- 2. a2e / e2a batch and output shapes ----------------------------------------------------
def a2e_call(rank, rows=3, batch=6):
    g = torch.Generator().manual_seed(rank)
    attention = rank >= 1
    return dict(x=torch.randn(rows if attention else 0, 16, generator=g).to(torch.bfloat16),
                expert_ids=torch.zeros(rows, 2, dtype=torch.int32) if attention else None,
                scales=torch.zeros(rows, 2) if attention else None, batch_size=batch, hidden_size=16, topk=2,
                expert_rank_size=1, atten_rank_size=2, rank=rank, group_ep="hccl_afd", aiv_num=8, compute_gate=1)


@pytest.mark.parametrize("rank", [0, 2])
def test_a2e_batch_and_output_shapes_follow_the_binding(bound, rank):
    """UMDK src/cam/comm_operator/pybind/a2e.cpp, A2eImplNpu: baseBatchSize = x.size(0) when
    rank >= expertRankSize, else batchSize; outputs expandXOut [baseBatchSize, H] bf16 on expert
    ranks ([1, 1] elsewhere), simulateExpertIds / simulateExpertScales [baseBatchSize, topk] int32 /
    float32 and xActiveMaskOut [baseBatchSize] bool when rank < expertRankSize and rank <
    attentionRankSize ([1, 1], [1, 1], [1] elsewhere), attenBatchSize [ceil(Ar / Er)] int32."""
    sim = bound("master")
    npu_ops.a2e(**a2e_call(rank))
    record = sim.calls()[0]
    batch = 6 if rank == 0 else 3
    assert value(record, 3) == batch
    outs = [(a["shape"], a["dtype"]) for a in record["args"][12:]]
    if rank == 0:
        assert outs == [([6, 16], BF16), ([6, 2], I32), ([6, 2], F32), ([2], I32), ([6], BOOL)]
    else:
        assert outs == [([1, 1], BF16), ([1, 1], I32), ([1, 1], F32), ([2], I32), ([1], BOOL)]


@pytest.mark.parametrize("rank", [0, 2])
def test_e2a_batch_and_output_shape_follow_the_binding(bound, rank):
    """UMDK src/cam/comm_operator/pybind/e2a.cpp, E2aImplNpu: baseBatchSize = expandX.size(0) when
    rank >= expertRankSize, else batchSize; the output is [1, 1] bf16 on expert ranks and
    [baseBatchSize, H] bf16 on attention ranks (the kernel writes baseBatchSize * H elements)."""
    sim = bound("master")
    rows = 6 if rank == 0 else 3
    out = npu_ops.e2a(torch.zeros(rows, 16, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), 6, 16, 2, 1,
                      2, rank, "hccl_afd", 8)
    record = sim.calls()[0]
    assert value(record, 2) == rows
    assert (arg(record, 10)["shape"], arg(record, 10)["dtype"]) == ([1, 1] if rank == 0 else [3, 16], BF16)
    assert list(out.shape) == arg(record, 10)["shape"]


# ---- fused_deep_moe arguments ------------------------------------------------------------------
def test_fused_deep_moe_outputs_and_absent_optionals_follow_the_binding(bound):
    """UMDK src/cam/comm_operator/pybind/fused_deep_moe.cpp, FusedDeepMoeImplNpu: output and
    shareOutput [bs, h] with x's options, expertTokenNums [moeExpertNum / epRankSize] int64; an
    absent optional goes through op-plugin's ConvertType (op_api_common.h, torch-npu 2.13.0) as a
    null aclTensor*, a TensorList as one aclTensorList of all its tensors."""
    sim = bound("master")
    args = make_rank_case(2, 1, ranks=2, bs=3, hidden=32, inter=16, experts=4, topk=2, dtype=torch.float16,
                          per_expert_lists=True, group_ep="hccl_ep")
    npu_ops.fused_deep_moe(**args)
    record = sim.calls()[0]
    assert record["args"][7:14] == [None] * 7
    assert [len(arg(record, i)["items"]) for i in range(2, 6)] == [2, 2, 2, 2]
    assert [(a["shape"], a["dtype"]) for a in record["args"][20:]] == [([3, 32], F16), ([3, 32], F16), ([2], I64)]
    assert value(record, 14) == "hccl_ep" and [value(record, i) for i in range(15, 20)] == [2, 1, 4, 0, 6]


def test_the_base_package_serves_the_buffer_only(bound, monkeypatch):
    """UMDK cam_feature src/cam/comm_operator/ascend_kernels/fused_deep_moe/op_host/fused_deep_moe.cpp
    (class FusedDeepMoe, the OpDef) declares the SHMEM attributes but no ``MC2().HcclGroup``, while
    UMDK master's declares ``MC2().HcclGroup({"group_ep"})``: outside the SHMEM branch the base
    kernel has no communicator. A plain call with the base package is refused naming the package to
    install, and doctor says which package serves what."""
    sim = bound("base", abi="base")
    args = make_rank_case(1, 0, ranks=1, bs=2, hidden=32, inter=16, experts=2, topk=1, group_ep="hccl_x")
    with pytest.raises(RuntimeError, match=r"base \(SHMEM\) package .* serves FusedDeepMoeBuffer only.*install "
                       r"UMDK master's FusedDeepMoe package for plain W8A8 calls \(for int4 weights: the w4a8"):
        npu_ops.fused_deep_moe(**args)
    assert sim.calls() == []
    stack = report.discover_stack(runtime_soc=False)
    text = "\n".join(report.lines(dataclasses.replace(stack, fdm=opp.FdmChoice("base", "test"))))
    assert "serves FusedDeepMoeBuffer only" in text and "UMDK master's FusedDeepMoe package" in text
    text = "\n".join(report.lines(dataclasses.replace(stack, fdm=opp.FdmChoice("master", "test"))))
    assert "serves plain W8A8 fused_deep_moe calls" in text


# ---- 3. detour ops -----------------------------------------------------------------------------
def test_detour_ops_have_no_npu_kernel(bound):
    """UMDK src/cam/comm_operator/pybind/ext_utils.cpp (cam_get_comm) returns the device commArgs
    tensor that src/cam/comm_operator/cam_api.cpp (CamGetCommArgs) wraps around the communicator's
    IPC peer addresses; cam_jit's communicator is host-only, so its NPU kernels refuse instead of
    launching the kernel with null peers."""
    sim = bound("master")
    t = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="all2_all_detour has no NPU kernel.*null peers.*CPU tensors"):
        npu_ops.all2_all_detour(t, torch.zeros(2, dtype=torch.int32), t, 0)
    with pytest.raises(NotImplementedError, match="reduce_scatter_detour has no NPU kernel"):
        npu_ops.reduce_scatter_detour(t, torch.zeros(2, dtype=torch.int32), t, 0, 0)
    assert sim.calls() == []


# ---- 5. SHMEM bootstrap ------------------------------------------------------------------------
def test_shmem_tls_is_set_before_the_bootstrap(npu_harness):
    """UMDK src/cam/comm_operator/pybind/buffer.cpp (Buffer::init) calls
    ``aclshmemx_set_conf_store_tls(false, nullptr, 0)`` before ``aclshmemx_init_attr``: SHMEM
    releases before Feb 2026 otherwise demand TLS certificates (the stand-in's bootstrap fails
    then). With CAM_JIT_SHMEM_TLS_INFO set, TLS is turned on with that text instead."""
    ops, _ = npu_harness
    shmem = standin.SHMEM[0]
    shmem.sim_shmem_reset()
    ext, work = ops.zb_shmem_init(0, 1, 4 << 20, "tcp://127.0.0.1:1", "")
    ops.zb_shmem_finalize(ext, work)
    calls = standin.shmem_calls()
    assert [c["fn"] for c in calls[:2]] == ["aclshmemx_set_conf_store_tls", "aclshmemx_init_attr"]
    assert calls[0] == {"fn": "aclshmemx_set_conf_store_tls", "enable": 0, "info_null": 1, "len": 0}
    assert shmem.sim_shmem_live() == 0
    shmem.sim_shmem_reset()
    tls = "tlsCaPath: /etc/ssl/certs/"
    with pytest.raises(RuntimeError, match="shmem_init_attr failed"):  # the stand-in has no certificates
        ops.zb_shmem_init(0, 1, 4 << 20, "tcp://127.0.0.1:1", tls)
    assert standin.shmem_calls()[0] == {"fn": "aclshmemx_set_conf_store_tls", "enable": 1, "info_null": 0,
                                        "len": len(tls)}


# ---- 6. task queue -----------------------------------------------------------------------------
def test_the_launch_is_queued_after_the_workspace_query(bound, npu_harness):
    """op-plugin's EXEC_NPU_CMD_V1 (third_party/op-plugin/op_plugin/utils/op_api_common.h in the
    torch-npu 2.13.0 wheel): aclnnXGetWorkspaceSize and the workspace allocation run on the calling
    thread with the stream taken without draining the queue (stream(false)); aclnnX and
    ReleaseConvertTypes run in the lambda given to OpCommand::RunOpApiV2, i.e. on the task queue,
    in order with torch_npu's own ops."""
    _, lib = npu_harness
    sim = bound("master")
    sim.lib.sim_set_workspace(4096)
    lib.cam_jit_test_defer_launches(1)
    npu_ops.e2a(torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), 6, 16, 2, 1, 2, 2,
                "hccl_afd", 8)
    npu_ops.e2a(torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), 6, 16, 2, 1, 2, 2,
                "hccl_afd", 8)
    assert [c["fn"] for c in sim.calls()] == ["aclnnE2aGetWorkspaceSize"] * 2 and sim.live() > 0
    assert lib.cam_jit_test_run_queue() == 2
    launches = [c for c in sim.calls() if c["fn"] == "aclnnE2a"]
    assert [(c["workspace_size"], c["workspace_null"], c["executor_ok"], c["stream"]) for c in launches] == \
        [(4096, 0, 1, standin.STREAM)] * 2
    assert sim.live() == 0


# ---- 7. opp build ------------------------------------------------------------------------------
def test_opp_build_runs_umdks_script_and_finds_its_run_package(tmp_path, monkeypatch):
    """UMDK build/cam/build.sh (print_help: ``-r`` builds the run package alone, ``-p`` the pybind
    wheel alone) forwards to build/cam/comm_operator/build.sh, which writes the .run under
    output/cam/comm_operator/run/. cam_jit runs that script, finds the .run there (not an older one
    elsewhere in the tree) and suggests -r."""
    tree = tmp_path / "umdk"
    (tree / "build" / "cam").mkdir(parents=True)
    (tree / "third_party").mkdir()
    (tree / "third_party" / "old.run").write_text("stale")
    (tree / "build" / "cam" / "build.sh").write_text(
        "#!/bin/bash\nset -e\nROOT=$(cd \"$(dirname \"$0\")/../..\" && pwd)\necho \"$@\" > \"$ROOT/args.txt\"\n"
        "mkdir -p \"$ROOT/output/cam/comm_operator/run\"\n"
        "echo pkg > \"$ROOT/output/cam/comm_operator/run/CANN-custom_ops-linux.x86_64.run\"\n")
    monkeypatch.setattr(opp_install, "require_cann", lambda what: None)
    old = os.stat(tree / "third_party" / "old.run")
    os.utime(tree / "third_party" / "old.run", ns=(old.st_atime_ns, old.st_mtime_ns + 10**12))  # newest of all
    runs = opp_install.build_from_source(tree, ["-r"])
    assert runs == [tree / "output" / "cam" / "comm_operator" / "run" / "CANN-custom_ops-linux.x86_64.run"]
    assert (tree / "args.txt").read_text().strip() == "-r"
    assert "-- -r` builds the .run package alone" in opp_install.run_only_hint(tree, [])
    assert opp_install.run_only_hint(tree, ["-r"]) is None


# ---- 8. error details --------------------------------------------------------------------------
def test_the_error_text_comes_from_libascendcl(sims, bound, tmp_path, monkeypatch):
    """torch_npu reports an aclnn failure with CANN's aclGetRecentErrMsg (acl/acl_rt.h in the
    torch-npu 2.13.0 wheel; torch_npu/csrc/core/npu/interface/AclInterface.h AclGetErrMsg), which
    libascendcl defines and the opapi libraries need not export: the search order ends with CANN's
    libascendcl.so, and the helper finds the function there."""
    home = tmp_path / "cann"
    for lib in ("libnnopbase.so", "libascendcl.so"):
        (home / "lib64").mkdir(parents=True, exist_ok=True)
        (home / "lib64" / lib).write_bytes(b"")
    (home / "set_env.sh").write_text("")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "ASCEND_CUSTOM_OPP_PATH"):
        monkeypatch.delenv(var, raising=False)
    assert npu_ops.search_libraries()[-2:] == [str(home / "lib64" / "libnnopbase.so"),
                                               str(home / "lib64" / "libascendcl.so")]
    sim = bound("no_errmsg", "ascendcl")
    sim.lib.sim_set_status(0, 507011)
    sims["ascendcl"].lib.sim_set_status(0, 507011)
    with pytest.raises(RuntimeError, match="aclnnE2a returned status 507011.*CANN says: simulated failure"):
        npu_ops.e2a(torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), 6, 16, 2, 1, 2, 2,
                    "hccl_afd", 8)
    sims["ascendcl"].lib.sim_reset()

