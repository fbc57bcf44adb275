"""FusedDeepMoeBuffer's NPU path (SPEC.md §5.1, §7.2) without an NPU: the wrapper library is a
recording stand-in bound in place of the real one (``npu_ops.binding``), so these tests check
what the buffer asks of SHMEM and of the NPU kernel (argument order, the base ABI, the heap's
addresses, memsize - 2 MiB), not the device. The wrapper's C++ is compile-checked in
tests/test_npu_compile.py."""
from types import SimpleNamespace

import pytest
import torch

from cam_jit.ascend import npu_ops, registry
from cam_jit.zero_buffer import FusedDeepMoeBuffer
from cam_jit.zero_buffer import _npu
from moe_cases import make_rank_case

MEMSIZE = 64 << 20
EXT_INFO, WORKSPACE = 0x12340000, 0x56780000  # the device addresses the stand-in SHMEM returns
ADDRESS = "tcp://127.0.0.1:29999"
NO_SHMEM = "SHMEM is not enabled. Please set SHMEM_HOME_PATH and recompile."  # SPEC.md §5.1 text
POSITIONAL = ("x", "expert_ids", "gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale",
              "expert_scales", "share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight",
              "share_gmm2_weight_scale", "expert_smooth_scales", "share_smooth_scales", "x_active_mask")


class WrapperLibrary:
    """Stands in for torch.ops._cam_jit_npu: records every call; fused_deep_moe writes marks
    into its outputs so the test sees that the buffer returns them."""

    def __init__(self, shmem: bool):
        self.calls = []
        if shmem:
            self.zb_shmem_init = lambda *a: self.calls.append(("init", a)) or [EXT_INFO, WORKSPACE]
            self.zb_shmem_finalize = lambda *a: self.calls.append(("finalize", a))

    def fused_deep_moe(self, *args):
        self.calls.append(("fused_deep_moe", args))
        output, share_output, expert_token_nums = args[-3:]
        output.fill_(3)
        share_output.fill_(5)
        expert_token_nums.fill_(7)


@pytest.fixture
def library(monkeypatch, request):
    """A bound stand-in library (params: shmem ops present, installed FusedDeepMoe variant)."""
    shmem, abi = getattr(request, "param", (True, "base"))
    lib = WrapperLibrary(shmem)
    monkeypatch.setattr(npu_ops, "binding", lambda: SimpleNamespace(ops=lib, fdm_abi=abi, fdm_how="test"))
    return lib


def case():
    kw = make_rank_case(5, 0, ranks=2, bs=3, hidden=32, inter=16, experts=4, topk=2, share_inter=16)
    return kw, [kw[k] for k in POSITIONAL] + ["", 2, 0, kw["moe_expert_num"], kw["quant_mode"], kw["global_bs"]]


def test_init_call_and_close_go_through_shmem_and_the_base_kernel(library, monkeypatch):
    monkeypatch.setattr(_npu, "NPU_DEVICE", "cpu")  # lets CPU tensors stand for NPU ones
    buf = FusedDeepMoeBuffer()
    buf.init(0, 2, MEMSIZE, ADDRESS, device="npu")
    buf.init(0, 2, MEMSIZE, ADDRESS, device="npu")  # silent no-op
    assert library.calls == [("init", (0, 2, MEMSIZE, ADDRESS, ""))]
    assert buf.is_initialized() and (buf.get_ext_info(), buf.get_shmem_workspace()) == (EXT_INFO, WORKSPACE)

    kw, positional = case()
    output, share_output, expert_token_nums = buf.zb_fused_deep_moe(*positional)
    name, args = library.calls[-1]
    assert name == "fused_deep_moe" and len(args) == 31
    # SPEC.md §7.2 base order: 14 inputs, 4 (absent) biases, group_ep, 5 int attributes,
    # abi, ext_info, shmem_workspace, shmem_workspace_size, 3 outputs
    for i, key in enumerate(POSITIONAL):
        got, want = args[i], kw[key]
        assert got is want or (isinstance(want, torch.Tensor) and list(got) == [want]) or got == want, key
    assert args[14:19] == ([], [], None, None, "")
    assert args[19:24] == (2, 0, kw["moe_expert_num"], kw["quant_mode"], kw["global_bs"])
    assert args[24:28] == (registry.fdm_abi().codes["base"], EXT_INFO, WORKSPACE, MEMSIZE - 2 * 1024 * 1024)
    assert args[28] is output and args[29] is share_output and args[30] is expert_token_nums
    bs, hidden = kw["x"].shape
    assert output.shape == (bs, hidden) and output.dtype == kw["x"].dtype and bool((output == 3).all())
    assert bool((share_output == 5).all()) and expert_token_nums.tolist() == [7, 7]

    buf.close()
    buf.close()  # idempotent
    assert library.calls[-1] == ("finalize", (EXT_INFO, WORKSPACE)) and len(library.calls) == 3
    assert not buf.is_initialized() and buf.get_ext_info() == 0 and buf.get_shmem_workspace() == 0


@pytest.mark.parametrize("library", [(False, "base")], indirect=True)
def test_library_built_without_shmem_raises_the_upstream_text(library):
    buf = FusedDeepMoeBuffer()
    with pytest.raises(RuntimeError) as err:
        buf.init(0, 2, MEMSIZE, ADDRESS, device="npu")
    assert str(err.value) == NO_SHMEM and not buf.is_initialized()


@pytest.mark.parametrize("library", [(True, "w4a8")], indirect=True)
def test_zero_buffer_needs_the_base_prototype(library, monkeypatch):
    monkeypatch.setattr(_npu, "NPU_DEVICE", "cpu")
    buf = FusedDeepMoeBuffer()
    buf.init(0, 2, MEMSIZE, ADDRESS, device="npu")
    with pytest.raises(RuntimeError, match=r"needs the base \(SHMEM\).*installed one is w4a8"):
        buf.zb_fused_deep_moe(*case()[1])
    assert [name for name, _ in library.calls] == ["init"]
    buf.close()


def test_npu_buffer_refuses_cpu_tensors_and_mismatched_ranks(library, monkeypatch):
    buf = FusedDeepMoeBuffer()
    buf.init(0, 2, MEMSIZE, ADDRESS, device="npu")
    positional = case()[1]
    with pytest.raises(ValueError, match=r"argument 'x': expected a tensor on the npu.*got cpu"):
        buf.zb_fused_deep_moe(*positional)
    buf.close()
    buf.init(1, 2, MEMSIZE, ADDRESS, device="npu")
    with monkeypatch.context() as patch:
        patch.setattr(_npu, "NPU_DEVICE", "cpu")
        with pytest.raises(ValueError, match=r"argument 'ep_rank_id': expected 1 \(init's rank\), got 0"):
            buf.zb_fused_deep_moe(*positional)
    assert [name for name, _ in library.calls] == ["init", "finalize", "init"]
    buf.close()


def test_device_argument():
    buf = FusedDeepMoeBuffer()
    with pytest.raises(ValueError, match=r"argument 'device': expected None or one of \('cpu', 'npu'\), got 'gpu'"):
        buf.init(0, 2, MEMSIZE, ADDRESS, device="gpu")
    with pytest.raises(TypeError, match="argument 'device'"):
        buf.init(0, 2, MEMSIZE, ADDRESS, device=1)
    with pytest.raises(RuntimeError, match="torch_npu"):  # no NPU backend on this machine
        buf.init(0, 2, MEMSIZE, ADDRESS, device="npu")
    assert not buf.is_initialized()
