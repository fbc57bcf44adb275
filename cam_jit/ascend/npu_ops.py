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


# ---- prefill ("normal") dispatch and combine: UMDK master's kernels, called as its pybind
# (get_dispatch_layout.cpp, moe_dispatch_prefill.cpp, moe_combine_prefill.cpp) calls them.
LAYOUT_LOCAL_RANK_SIZE = 8  # get_dispatch_layout.cpp's LOCAL_RANK_SIZE
LAYOUT_MAX_BATCH = 4096  # its MAX_BATCH_SIZE, in the size of the layout kernel's scratch output
NOTIFY_FIELDS = 3  # notify's per-expert (count, offset, num_tokens) send groups


def _routed_everywhere(op: str, expert_ids: torch.Tensor) -> None:
    """UMDK's prefill kernels index by every id (the combine waits for all K results of a token):
    an id of -1 would read out of bounds or hang, so it is refused before the launch."""
    if expert_ids.numel() and bool((expert_ids < 0).any()):
        raise ValueError(f"{op} on NPU: argument 'expert_ids': expected every id in [0, moe_expert_num) (UMDK's "
                         "prefill kernels have no -1 handling; the CPU path skips -1), got ids of -1")


def moe_dispatch_layout(expert_ids, moe_expert_num, ep_rank_size):
    """NPU kernel of cam_jit::moe_dispatch_layout: aclnnDispatchLayout on int64 ids, with the
    scratch output sized as UMDK's binding sizes it."""
    outputs = _zeroed(_op_module("moe_normal")._layout_fake(expert_ids, moe_expert_num, ep_rank_size))
    _routed_everywhere("moe_dispatch_layout", expert_ids)
    batch, topk = expert_ids.shape
    servers = ep_rank_size // LAYOUT_LOCAL_RANK_SIZE
    scratch = expert_ids.new_zeros((moe_expert_num * (1 + LAYOUT_MAX_BATCH) + servers
                                    + LAYOUT_MAX_BATCH * (1 + 2 * servers + moe_expert_num),), dtype=torch.int32)
    binding().ops.moe_dispatch_layout(expert_ids.to(torch.int64).contiguous(), batch, ep_rank_size, moe_expert_num,
                                      topk, LAYOUT_LOCAL_RANK_SIZE, outputs[0], outputs[1], outputs[2], scratch,
                                      outputs[3])
    return outputs


def moe_notify_dispatch(num_tokens_per_expert, num_tokens, group_ep, ep_rank_size, ep_rank_id):
    """NPU kernel of cam_jit::moe_notify_dispatch: aclnnNotifyDispatch with its send and receive
    scratch (3 ints per expert), local rank size = R and local rank = ep_rank_id (UMDK's binding)."""
    outputs = _zeroed(_op_module("moe_normal")._notify_fake(num_tokens_per_expert, num_tokens, group_ep,
                                                            ep_rank_size, ep_rank_id))
    send_offset, recv_offset, recv_count, total, max_bs, per_expert = outputs
    experts = num_tokens_per_expert.shape[0]
    send_data = num_tokens_per_expert.new_zeros((NOTIFY_FIELDS * experts,))
    recv_data = num_tokens_per_expert.new_zeros((NOTIFY_FIELDS * experts,))
    binding().ops.moe_notify_dispatch(send_data, num_tokens_per_expert, NOTIFY_FIELDS * experts, num_tokens,
                                      hccl.comm_name("moe_notify_dispatch", group_ep), ep_rank_size, ep_rank_id,
                                      ep_rank_size, ep_rank_id % ep_rank_size, send_offset, recv_data, total,
                                      recv_count, recv_offset, max_bs, per_expert)
    return outputs


def moe_dispatch_normal(x, expert_ids, send_offset, send_token_idx, recv_offset, recv_count, group_ep,
                        ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs, num_recv_tokens):
    """NPU kernel of cam_jit::moe_dispatch_normal: aclnnMoeDispatchNormal with int32 ids, no TP
    (tp_world_size 1), global_bs 0 read as BS * R, and at least one output row (the kernel's
    buffers are never empty, as in UMDK's binding); assist info is the kernel's flat [N * 3]."""
    fake = _op_module("moe_normal")._dispatch_fake(x, expert_ids, send_offset, send_token_idx, recv_offset,
                                                   recv_count, group_ep, ep_rank_size, ep_rank_id,
                                                   moe_expert_num, quant_mode, global_bs, num_recv_tokens)
    _routed_everywhere("moe_dispatch_normal", expert_ids)
    rows = max(num_recv_tokens, 1)
    recv_x = fake[0].new_zeros((rows, x.shape[1]))
    scales = fake[1].new_zeros((rows,))
    assist = fake[2].new_zeros((rows * 3,))
    name = hccl.comm_name("moe_dispatch_normal", group_ep)
    binding().ops.moe_dispatch_normal(x, expert_ids.to(torch.int32).contiguous(), send_offset, send_token_idx,
                                      recv_offset, recv_count, name, ep_rank_size, ep_rank_id, name, 1, 0,
                                      moe_expert_num, quant_mode, global_bs or x.shape[0] * ep_rank_size, recv_x,
                                      scales, assist)
    n = num_recv_tokens
    return recv_x[:n], scales[:n], assist.view(rows, 3)[:n]


def moe_combine_normal(recv_x, assist_info_for_combine, recv_count, expert_ids, expert_scales, group_ep,
                       ep_rank_size, ep_rank_id, moe_expert_num, global_bs):
    """NPU kernel of cam_jit::moe_combine_normal: aclnnMoeCombineNormal (no TP: a one-element
    tp_recv_counts, tp_world_size 1), global_bs 0 read as BS * R as in UMDK's binding, and never an
    empty recv_x (the kernel reads recv_count[-1] rows of it)."""
    out = _zeroed(_op_module("moe_normal")._combine_fake(recv_x, assist_info_for_combine, recv_count, expert_ids,
                                                         expert_scales, group_ep, ep_rank_size, ep_rank_id,
                                                         moe_expert_num, global_bs))
    _routed_everywhere("moe_combine_normal", expert_ids)
    assist = assist_info_for_combine.reshape(-1)
    if recv_x.shape[0] == 0:  # the dispatch's buffers have at least one row: hand the kernel one too
        recv_x, assist = recv_x.new_zeros((1, recv_x.shape[1])), assist.new_zeros((3,))
    name = hccl.comm_name("moe_combine_normal", group_ep)
    binding().ops.moe_combine_normal(recv_x, assist, recv_count, expert_scales,
                                     recv_count.new_zeros((1,)), name, ep_rank_size, ep_rank_id, name, 1, 0,
                                     moe_expert_num, global_bs or expert_ids.shape[0] * ep_rank_size, out)
    return out


KERNELS: Dict[str, Callable] = {
    "fused_deep_moe": fused_deep_moe, "a2e": a2e, "e2a": e2a,
    "all2_all_detour": all2_all_detour, "reduce_scatter_detour": reduce_scatter_detour,
    "moe_dispatch_layout": moe_dispatch_layout, "moe_notify_dispatch": moe_notify_dispatch,
    "moe_dispatch_normal": moe_dispatch_normal, "moe_combine_normal": moe_combine_normal,
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
