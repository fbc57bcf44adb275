"""``group_ep`` on the NPU: the HCCL communicator name the kernels look their communicator up by.

The CAM kernels' tiling finds the communicator by its HCCL name, which is what UMDK's samples pass
(``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)``) and what sgl-kernel-npu's
DeepEP binding passes (``get_hccl_comm_name(group.rank())``, or ``HcclGetCommName`` in C++). A
cam_jit call names its group like the CPU path does (a ProcessGroup, its ``group_name``, a name
given to ``cam_jit.register_group``, or ``""`` for the default group); the NPU kernels and the GE
converters turn that into the HCCL name here. A string that names no torch process group in this
process is taken to be an HCCL name already and passed through unchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cam_jit.ops import _checks as check
from cam_jit.ops.groups import find_group

NPU_DEVICE = "npu"


def backend_comm_name(group: "dist.ProcessGroup", rank: int) -> str:
    """torch_npu's HCCL communicator name of ``group`` (``rank``: this process's rank in it)."""
    return group._get_backend(torch.device(NPU_DEVICE)).get_hccl_comm_name(rank)


def comm_name(op: str, group_ep: str) -> str:
    """The HCCL communicator name for the ``group_ep`` string of an NPU call of ``op``; ValueError
    naming ``group_ep`` when the group has no HCCL communicator."""
    group = find_group(group_ep)
    if group is None:
        if group_ep == "":
            check.fail(op, "group_ep", "a process group with an HCCL backend on the NPU ('' names the "
                       "default group, but torch.distributed is not initialized)", repr(group_ep))
        return group_ep
    try:
        name = backend_comm_name(group, dist.get_rank(group))
    except (RuntimeError, AttributeError, ValueError) as e:
        check.fail(op, "group_ep", "a process group with an HCCL backend on the NPU (e.g. "
                   "torch.distributed.new_group(backend='hccl')), whose HCCL communicator name the kernel "
                   f"takes", f"group {group_ep!r} without one ({type(e).__name__}: {e})")
    if not isinstance(name, str) or not name:
        check.fail(op, "group_ep", "a non-empty HCCL communicator name from torch_npu",
                   f"{name!r} for group {group_ep!r}")
    return name
