"""Expert weights prepacked once for the CPU int8 GEMM kernels (AVX512-VNNI / AMX).

On a CPU with AVX512-VNNI the CPU `fused_deep_moe` multiplies by a packed copy of each expert
matrix (16-column panels, K padded to 64, N to 16) instead of the weights as stored. Packed copies
live in a process-wide cache keyed by the weight's storage, offset, shape, strides and version
counter:

- the first call that meets a weight packs it (about one pass over its bytes); later calls reuse it;
- an in-place update of the weight (through it or any of its views) bumps its version and repacks;
- a copy dies with its weight's storage (it never keeps the weight alive).

Memory cost: one packed copy per weight matrix in use, the size of the weight as stored (W8A8:
K x N bytes + 4 N; W4A8: K x N / 2 bytes), plus padding. Bytes changed behind the version counter
(through `.data`, numpy or another framework sharing the memory) are not noticed: call
:func:`clear_prepared_weights` after such a change. `CAM_JIT_CPU_GEMM=int_mm` turns packing off
(ATen `_int_mm` on the stored weights, the portable path).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from cam_jit.ops import _checks as check
from cam_jit.ops._kernels import cpu_kernels

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
_OP = "prepare_expert_weights"


def _matrices(arg: str, container: Optional[TensorOrList]):
    """The 2-D expert matrices of a weight container: a stacked [E, K, N] tensor, one [K, N]
    tensor, or a list of [K, N] tensors (views of the container, so they key the cache as the op
    sees them)."""
    if container is None:
        return []
    for i, t in enumerate(check.weight_list(_OP, arg, container)):
        name = f"{arg}[{i}]"
        check.dtype(_OP, name, t, (torch.int8, torch.int32))
        check.ndim(_OP, name, t, (2, 3))
        if t.device.type != "cpu":
            check.fail(_OP, name, "a CPU tensor (prepacking is for the CPU kernels)", str(t.device))
        yield from (t.unbind(0) if t.dim() == 3 else (t,))


def prepare_expert_weights(gmm1_weight: TensorOrList, gmm2_weight: TensorOrList, *,
                           share_gmm1_weight: Optional[torch.Tensor] = None,
                           share_gmm2_weight: Optional[torch.Tensor] = None) -> int:
    """Prepack `fused_deep_moe` weights for the CPU int8 kernels now (e.g. at model load) instead
    of on their first call. Call it with the same tensors the op will get.

    Args:
        gmm1_weight, gmm2_weight: weight containers as for `fused_deep_moe`: [E_loc, H, 2I] /
            [E_loc, I, H] int8 (W8A8) or [E_loc, H, 2I/8] / [E_loc, I, H/8] int32 (W4A8), stacked or
            as lists of per-expert 2-D tensors.
        share_gmm1_weight, share_gmm2_weight: the shared expert's [H, 2Is] / [Is, H] (or with a
            leading 1) weights, optional.

    Returns:
        Bytes of packed copies made or found for these weights (0 when this CPU has no packed
        kernel, or packing is turned off by `CAM_JIT_CPU_GEMM=int_mm`).
    """
    kernels = cpu_kernels()
    previous = kernels.select_kernels("", "")
    if previous[0] == "int_mm" or "gemm:vnni" not in kernels.kernel_variants():
        return 0
    total = 0
    for arg, container in (("gmm1_weight", gmm1_weight), ("gmm2_weight", gmm2_weight),
                           ("share_gmm1_weight", share_gmm1_weight), ("share_gmm2_weight", share_gmm2_weight)):
        for w in _matrices(arg, container):
            total += kernels.prepack_weight(w, w.dtype == torch.int32)
    return total


def prepared_weights_bytes() -> int:
    """Bytes held by packed weight copies of live weights."""
    return cpu_kernels().prepack_cache_bytes(False)


def clear_prepared_weights() -> None:
    """Drop every packed weight copy (they are rebuilt on next use)."""
    cpu_kernels().prepack_cache_bytes(True)
