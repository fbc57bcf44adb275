"""FusedDeepMoeBuffer on the NPU (docs/semantics.md §5.1, §7.2): the symmetric heap is Ascend SHMEM's,
created and freed by the wrapper library's ``zb_shmem_init`` / ``zb_shmem_finalize`` ops
(``wrappers/zb_shmem.cpp``, built only when ``SHMEM_HOME_PATH`` holds SHMEM, see
:func:`cam_jit.ascend.build.shmem_part`), and a call is the wrapper's ``fused_deep_moe`` with the
base (SHMEM) prototype, ``ext_info``, ``shmem_workspace`` and ``memsize - 2 MiB``.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Dict, List

import torch

from cam_jit.ops import _checks as check
from cam_jit.zero_buffer._heap import EXT_INFO_BYTES

NPU_DEVICE = "npu"  # torch_npu's name for the PrivateUse1 device
NO_SHMEM = "SHMEM is not enabled. Please set SHMEM_HOME_PATH and recompile."  # docs/semantics.md §5.1
TLS_ENV = "CAM_JIT_SHMEM_TLS_INFO"  # SHMEM's TLS settings for the bootstrap; unset: TLS off
BASE_ABI = "base"  # the only aclnnFusedDeepMoe prototype with the SHMEM attributes (§7.2)


def npu_present() -> bool:
    """Whether torch_npu is loaded and sees an NPU (then ``init`` builds the SHMEM heap)."""
    module = getattr(torch, NPU_DEVICE, None)
    return module is not None and bool(module.is_available())


class NpuHeap:
    """This PE's SHMEM heap: ``ext_info`` (2 MiB) and ``workspace`` (memsize - 2 MiB) are device
    addresses (int). One per process (SHMEM is process-global; a second is refused)."""

    def __init__(self, rank: int, num_ranks: int, memsize: int, ip_port: str) -> None:
        from cam_jit.ascend import npu_ops

        self._ops = npu_ops.binding().ops  # builds/loads the wrapper library on first use
        if not hasattr(self._ops, "zb_shmem_init"):
            raise RuntimeError(NO_SHMEM)
        self.rank, self.num_ranks, self.memsize = rank, num_ranks, memsize
        tls_info = os.environ.get(TLS_ENV, "")
        self.ext_info, self.workspace = self._ops.zb_shmem_init(rank, num_ranks, memsize, ip_port, tls_info)

    def check_device(self, where: str, x: torch.Tensor) -> None:
        """ValueError unless ``x`` (hence the call) is on the NPU."""
        if x.device.type != NPU_DEVICE:
            check.fail(where, "x", f"a tensor on the {NPU_DEVICE} (the buffer's heap is SHMEM's)",
                       str(x.device))

    def close(self) -> None:
        """Frees both regions and finalises SHMEM."""
        self._ops.zb_shmem_finalize(self.ext_info, self.workspace)

    def fused_deep_moe(self, where: str, args: Dict[str, Any]) -> List[torch.Tensor]:
        """The zero-buffer call: ``args`` are the validated arguments of fused_deep_moe's NPU
        kernel (W8A8, no biases); returns [output, share_output, expert_token_nums], zero-filled
        before the call as the non-ZB NPU kernel does (docs/semantics.md §8.4)."""
        from cam_jit.ascend import npu_ops, registry

        b = npu_ops.binding()
        if b.fdm_abi != BASE_ABI:
            raise RuntimeError(
                f"{where} on NPU: the zero buffer needs the {BASE_ABI} (SHMEM) aclnnFusedDeepMoe "
                f"prototype, but the installed one is {b.fdm_abi or 'unknown'} ({b.fdm_how}); "
                f"install the base FusedDeepMoe package built with SHMEM")
        npu_ops._check_nz_weights(args)
        outputs = npu_ops._zeroed(npu_ops._op_module("fused_deep_moe")._fake(**args))
        ordered = [args[name] for name in inspect.signature(npu_ops.fused_deep_moe).parameters]
        b.ops.fused_deep_moe(*ordered, registry.fdm_abi().codes[BASE_ABI], self.ext_info,
                             self.workspace, self.memsize - EXT_INFO_BYTES, *outputs)
        return outputs
