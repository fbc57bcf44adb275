"""PrivateUse1 (NPU) kernels of the cam_jit ops.

Each kernel runs the op's own fake kernel on the real arguments: that is the same metadata
validation the CPU kernel starts with, and it allocates the outputs with the right shapes on the
NPU (zero-filled here, docs/semantics.md §8.4: upstream leaves some outputs unwritten). It then calls the
private op ``torch.ops._cam_jit_npu.<op>`` of the JIT-compiled wrapper library (``wrappers/``),
which calls the vendor's aclnn kernel on the current stream. Data-dependent checks of the CPU
kernels (which would synchronise the device) are left to the device kernel.

The wrapper library is built or loaded on the first NPU call, then configured once with the aclnn
library search order (:func:`cam_jit.ascend.opp.library_search_order`, plus CANN's
``libnnopbase.so`` for the tensor API) and the op -> aclnn table of the operator registry. The
FusedDeepMoe prototype is detected then too (:func:`cam_jit.ascend.opp.detect_fdm_abi`).
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from cam_jit.ascend import hccl

# cam_jit.ascend's build, discover, opp and registry modules are imported where used: importing
# cam_jit registers these kernels, and only an NPU call needs the rest.

TENSOR_API_LIBS = ("lib64/libnnopbase.so", "lib/libnnopbase.so")  # under the CANN home
ERROR_TEXT_LIBS = ("lib64/libascendcl.so", "lib/libascendcl.so")  # aclGetRecentErrMsg's home


@dataclass
class Binding:
    """The configured wrapper library: its op namespace and the FusedDeepMoe ABI to call."""

    ops: Any  # torch.ops.<namespace>
    fdm_abi: Optional[str]
    fdm_how: str


_BINDING: Optional[Binding] = None
_LOCK = threading.Lock()


def search_libraries() -> List[str]:
    """The aclnn libraries to search, in order, then CANN's tensor-API library and the library
    defining aclGetRecentErrMsg (the opapi libraries need not export it)."""
    from cam_jit.ascend import discover, opp

    cann = discover.find_cann()
    libs = opp.library_search_order(opp.find_vendors(cann), cann)
    if cann.home is not None:
        for candidates in (TENSOR_API_LIBS, ERROR_TEXT_LIBS):
            libs += [cann.home / p for p in candidates if (cann.home / p).is_file()][:1]
    return [str(p) for p in libs]


def aclnn_table() -> Dict[str, str]:
    """torch op -> aclnn entry point stem, from the registry (variants of one op share it)."""
    from cam_jit.ascend import registry

    table: Dict[str, str] = {}
    for entry in registry.ops().values():
        if entry.torch_op and entry.aclnn:
            table.setdefault(entry.torch_op, entry.aclnn)
    return table


def bind(ops: Any, libraries: Sequence[str], fdm_abi: Optional[str], fdm_how: str = "") -> Binding:
    """Configure the wrapper library ``ops`` (a ``torch.ops`` namespace) and make the kernels use
    it. :func:`binding` does this with the discovered stack; tests bind a simulated opapi."""
    global _BINDING
    table = aclnn_table()
    ops.configure([str(p) for p in libraries], list(table), list(table.values()))
    _BINDING = Binding(ops, fdm_abi, fdm_how)
    return _BINDING


def binding() -> Binding:
    """The configured NPU wrapper library, building/loading and configuring it on first use."""
    if _BINDING is not None:
        return _BINDING
    with _LOCK:
        if _BINDING is None:
            from cam_jit import jit
            from cam_jit.ascend import build, discover, opp

            jit.load("npu")
            choice = opp.detect_fdm_abi(opp.find_vendors(discover.find_cann()))
            bind(getattr(torch.ops, build.NAMESPACE), search_libraries(), choice.abi, choice.how)
    return _BINDING


def _op_module(name: str):
    """The op module ``cam_jit.ops.<name>`` (the package re-exports functions of the same name)."""
    return importlib.import_module(f"cam_jit.ops.{name}")


def _zeroed(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.zero_()
    return [t.zero_() for t in outputs]


def _fdm_abi_code(b: Binding, weight: torch.Tensor) -> int:
    """The ABI code for this call; RuntimeError when the installed prototype cannot take it."""
    from cam_jit.ascend import registry

    facts = registry.fdm_abi()
    if b.fdm_abi is None:
        raise RuntimeError(f"fused_deep_moe on NPU: cannot tell which aclnnFusedDeepMoe prototype "
                           f"is installed ({b.fdm_how})")
    w4a8 = weight.dtype == torch.int32
    if w4a8 != (b.fdm_abi == "w4a8"):
        raise RuntimeError(
            f"fused_deep_moe on NPU: argument 'gmm1_weight': the installed aclnnFusedDeepMoe is the "
            f"{b.fdm_abi} variant ({b.fdm_how}), which takes "
            f"{'int32 (W4A8)' if b.fdm_abi == 'w4a8' else 'int8 (W8A8)'} weights, got "
            f"{'int32' if w4a8 else str(weight.dtype).replace('torch.', '')}; install the other "
            f"package (variants {', '.join(registry.fdm_abi().variant_ops.values())} exclude "
            f"each other) or set {facts.env} if detection is wrong")
    return facts.codes[b.fdm_abi]


FRACTAL_NZ = 29  # aclFormat of the W8A8 weights' required layout (docs/semantics.md §1.15)


def npu_format(t: torch.Tensor) -> Optional[int]:
    """The torch_npu storage format of ``t`` (None off the NPU, where there is none)."""
    if t.device.type != "npu":
        return None
    import torch_npu

    return int(torch_npu.get_npu_format(t))


def _check_nz_weights(args: Dict[str, Any]) -> None:
    """W8A8 int8 weights must be stored FRACTAL_NZ (docs/semantics.md §1.15); an ND weight would be read
    with the wrong layout by the kernel, so it is refused with the one-time conversion to do."""
    named = [(f"{n}[{i}]", t) for n in ("gmm1_weight", "gmm2_weight") for i, t in enumerate(args[n])]
    named += [(n, args[n]) for n in ("share_gmm1_weight", "share_gmm2_weight") if args[n] is not None]
    for name, t in named:
        fmt = npu_format(t)
        if fmt is not None and fmt != FRACTAL_NZ:
            raise ValueError(
                f"fused_deep_moe: argument '{name}': expected an int8 weight stored FRACTAL_NZ "
                f"(torch_npu format {FRACTAL_NZ}; convert it once with "
                f"torch_npu.npu_format_cast(weight, {FRACTAL_NZ})), got format {fmt}")


def fused_deep_moe(x, expert_ids, gmm1_weight, gmm1_weight_scale, gmm2_weight, gmm2_weight_scale,
                   expert_scales, share_gmm1_weight, share_gmm1_weight_scale, share_gmm2_weight,
                   share_gmm2_weight_scale, expert_smooth_scales, share_smooth_scales,
                   x_active_mask, gmm1_bias, gmm2_bias, share_gmm1_bias, share_gmm2_bias,
                   group_ep, ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs):
    """NPU kernel of cam_jit::fused_deep_moe: a plain (HCCL) call, ext_info = shmem_workspace =
    shmem_workspace_size = 0, with group_ep turned into the HCCL communicator name. The base
    (SHMEM) package serves FusedDeepMoeBuffer only and is refused here."""
    args = dict(locals())
    outputs = _zeroed(_op_module("fused_deep_moe")._fake(**args))
    b = binding()
    abi = _fdm_abi_code(b, gmm1_weight[0])
    if b.fdm_abi == "base":
        from cam_jit.ascend import opp

        raise RuntimeError(f"fused_deep_moe on NPU: the installed aclnnFusedDeepMoe is the base (SHMEM) "
                           f"package ({b.fdm_how}), which serves {opp.FDM_SERVES['base']}; "
                           f"{opp.PLAIN_CALL_PACKAGES}")
    if gmm1_weight[0].dtype == torch.int8:
        _check_nz_weights(args)
    args["group_ep"] = hccl.comm_name("fused_deep_moe", group_ep)
    b.ops.fused_deep_moe(*args.values(), abi, 0, 0, 0, *outputs)
    return outputs


def a2e(x, expert_ids, scales, batch_size, hidden_size, topk, expert_rank_size, atten_rank_size,
        rank, group_ep, aiv_num, compute_gate):
    """NPU kernel of cam_jit::a2e. The batch attribute is batch_size on expert ranks and
    x.shape[0] on attention ranks (the kernel copies batch * hidden_size elements of x there)."""
    outputs = _zeroed(_op_module("a2e_e2a")._a2e_fake(**locals()))
    batch = attention_side_batch(rank, expert_rank_size, batch_size, x.shape[0])
    binding().ops.a2e(x, expert_ids, scales, batch, hidden_size, topk, expert_rank_size,
                      atten_rank_size, rank, hccl.comm_name("a2e", group_ep), aiv_num, compute_gate,
                      *outputs)
    return outputs


def e2a(expand_x, atten_batch_size, batch_size, hidden_size, topk, expert_rank_size,
        attention_rank_size, rank, group_ep, aiv_num):
    """NPU kernel of cam_jit::e2a. The batch attribute is batch_size on expert ranks and
    expand_x.shape[0] on attention ranks (the kernel writes batch * hidden_size elements of out)."""
    out = _zeroed(_op_module("a2e_e2a")._e2a_fake(**locals()))
    batch = attention_side_batch(rank, expert_rank_size, batch_size, expand_x.shape[0])
    binding().ops.e2a(expand_x, atten_batch_size, batch, hidden_size, topk, expert_rank_size,
                      attention_rank_size, rank, hccl.comm_name("e2a", group_ep), aiv_num, out)
    return out


def attention_side_batch(rank: int, expert_rank_size: int, batch_size, rows):
    """The batch attribute of A2e/E2a: ``batch_size`` on expert ranks (rank < expert_rank_size),
    ``rows`` (the row count of the rank's own x / expand_x) on attention ranks. Shared with the
    GE converters, where ``rows`` may be a symbolic size."""
    return batch_size if rank < expert_rank_size else rows


DETOUR_ON_NPU = ("{op} has no NPU kernel in cam_jit: its aclnn kernel reads the peers' IPC addresses "
                 "from a device commArgs tensor, which cam_jit's host-only communicator "
                 "(cam_get_comm) does not build, so a launch would hand the kernel null peers. Run it on "
                 "CPU tensors (the CPU path over torch.distributed gloo)")


def all2_all_detour(sendData, commRankIds, commArgs, commId):
    """NPU kernel of cam_jit::all2_all_detour: refused (see :data:`DETOUR_ON_NPU`)."""
    raise NotImplementedError(DETOUR_ON_NPU.format(op="all2_all_detour"))


def reduce_scatter_detour(sendData, commRankIds, commArgs, commId, op):
    """NPU kernel of cam_jit::reduce_scatter_detour: refused (see :data:`DETOUR_ON_NPU`)."""
    raise NotImplementedError(DETOUR_ON_NPU.format(op="reduce_scatter_detour"))


KERNELS: Dict[str, Callable] = {
    "fused_deep_moe": fused_deep_moe, "a2e": a2e, "e2a": e2a,
    "all2_all_detour": all2_all_detour, "reduce_scatter_detour": reduce_scatter_detour,
}
_REGISTERED: List[str] = []


def register() -> List[str]:
    """Register the PrivateUse1 kernel of every op of KERNELS (the registry's ops with an NPU
    binding, a test checks they agree) that has a cam_jit schema defined (idempotent; needs
    neither torch_npu nor a compiler, reads no file). Returns the ops registered so far."""
    for name in KERNELS:
        qualname = f"cam_jit::{name}"
        if name in _REGISTERED or not _defined(qualname):
            continue
        torch.library.impl(qualname, "PrivateUse1", KERNELS[name])
        _REGISTERED.append(name)
    return list(_REGISTERED)


def _defined(qualname: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")
    except RuntimeError:  # no such op (its module is not imported, or not written yet)
        return False
