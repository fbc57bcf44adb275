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
    out = tmp_path_factory.mktemp("sim_e2e")
    return {name: standin.Sim(standin.build_sim(out, name, f"-DSIM_FDM_ABI={code}"))
            for name, code in (("base", 0), ("w4a8", 1), ("master", 2))}


@pytest.fixture(scope="module")
def harness():
    return standin.build_harness()


@pytest.fixture
def npu(sims, harness, monkeypatch):
    """bind(variant) binds npu_ops to the harness and that sim, executing; yields (bind, lib)."""
    ops, lib = harness
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
    assert_same(npu_ops.fused_deep_moe(**args), cpu(args))
    assert [c["fn"] for c in sim.calls()] == ["aclnnFusedDeepMoeGetWorkspaceSize", "aclnnFusedDeepMoe"]
    assert sim.live() == 0
