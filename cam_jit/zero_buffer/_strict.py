"""Strict mode of `FusedDeepMoeBuffer.zb_fused_deep_moe` (docs/semantics.md §0.6, §5.2, §7.5).

fused_deep_moe's NPU limits (reused from `cam_jit.ops.fused_deep_moe_strict`, in upstream order)
with the zero-buffer differences of §5.2: the local batch may reach 40960 instead of 256, the
HCCL window check is skipped, and the SHMEM workspace (memsize - 2 MiB) must pass §7.5 item 9.
`group_ep` is unused by the buffer (§5.1), so its [doc] name-length rule does not apply. Peers
learn of a strict failure through the buffer's own signalling (the failing rank refuses the call),
so there is no cross-rank agreement step and no cross-rank global_bs [doc] check.
"""
from __future__ import annotations

import dataclasses
from typing import Dict

from cam_jit.ops import fused_deep_moe_strict as fdm
from cam_jit.ops.fused_deep_moe import Layout

ZB_MAX_BATCH = 40960
ROUND_ALIGN = 64
_MIB = 1024 * 1024


def _ceil512(n: int) -> int:
    return (n + 511) // 512 * 512


def workspace_fixed(ranks: int, local_experts: int, batch: int, topk: int, hidden: int) -> int:
    """§5.2: bytes of the SHMEM workspace that do not depend on the round size."""
    return (_ceil512(ranks * ranks * local_experts * 8) + _ceil512(batch * topk * hidden * 2) + _ceil512(16384)
            + 16 * _MIB + 3 * 511)


def round_recv_tokens(workspace: int, fixed: int, hidden: int, inter: int) -> int:
    """§5.2 roundRecvTokenNum: received tokens per round, a multiple of 64 (may be <= 0)."""
    free = workspace - fixed
    return min(free // (hidden + 36), free // (inter + 36)) // ROUND_ALIGN * ROUND_ALIGN


def _fail(where: str, arg: str, text: str, got: str) -> None:
    raise ValueError(f"{where}: strict: argument '{arg}': {text} (got {got})")


def check(where: str, args: Dict[str, object], layout: Layout, workspace: int) -> None:
    """Raises ValueError where the NPU zero-buffer kernel would refuse (upstream texts).

    Args:
        where: the caller's name for messages. args: validated fused_deep_moe arguments.
        layout: their Layout. workspace: the SHMEM workspace bytes (memsize - 2 MiB).
    """
    fdm.check_attributes(dict(args, group_ep="unused by the zero buffer"))
    batch, ranks, gbs = layout.batch, args["ep_rank_size"], args["global_bs"]
    if batch > ZB_MAX_BATCH:
        _fail(where, "x", f"batchSize(bs) must <= {ZB_MAX_BATCH}.", f"BS = x.shape[0] = {batch}")
    # fused_deep_moe's data limits, minus its 256-token batch limit (checked above for the zero buffer)
    fdm.check_data_limits(args, dataclasses.replace(layout, batch=min(batch, fdm.MAX_BATCH)))
    if gbs and batch > gbs // ranks:
        _fail(where, "global_bs", f"[doc] batchSize(bs) must <= globalBatchSize / epRankSize ({gbs} / {ranks} = "
              f"{gbs // ranks}).", f"BS = x.shape[0] = {batch}")
    fdm.check_shared_expert(args, layout)
    fixed = workspace_fixed(ranks, layout.local_experts, batch, layout.topk, layout.hidden)
    sizes = f"memsize - 2 MiB = {workspace} bytes of workspace"
    if workspace < fixed:
        least = fixed + 2 * _MIB + ROUND_ALIGN * (max(layout.hidden, layout.inter) + 36)
        _fail(where, "memsize", f"SHMEM workspace is too small: size={workspace}, fixedSize={fixed}.",
              f"{sizes}; init with memsize >= {least}")
    rounds = round_recv_tokens(workspace, fixed, layout.hidden, layout.inter)
    if rounds < ROUND_ALIGN:
        _fail(where, "memsize", "SHMEM workspace leaves fewer than 64 tokens for the round buffer.",
              f"{sizes}, roundRecvTokenNum = {rounds}")
    fdm.warn_ignored_share_smooth_scales(args)
    fdm.check_token_data(args, layout)
