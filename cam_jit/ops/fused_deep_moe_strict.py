"""Strict validation of `fused_deep_moe` (docs/semantics.md §0.6, §7.5): the NPU kernel's own limits.

`check_strict(args)` runs when strict mode is on (`strict=True`, `cam_jit.set_strict(True)` or
`CAM_JIT_STRICT=1`), before the op. It first runs the basic validation, then the upstream tiling
limits in upstream order (§7.5 items 3-10), then the data checks, then, with more than one rank,
a cross-rank agreement on `global_bs`. Failures are `ValueError`s quoting the upstream text with
the real numbers: ``fused_deep_moe: strict: argument 'expert_ids': topK(k) must <= 12. (got K = 13)``.
Checks that upstream documents but does not enforce carry ``[doc]`` before the text.

Not repeated here, because basic validation already rejects the same inputs (with the argument,
expected and actual value): §7.5 items 1 and 2, the weight/scale container texts of item 4, item 7's
shape texts, item 8's dtype and shape texts (except the ones below) and all of item 10 except the
§1.2 warning. "moeExpertNumPerRank * epRankSize must <= 512." equals "moeExpertNum must <= 512."
once E % R == 0, and "batchSize(bs) must >= 0." cannot fail. Item 9 (ZB workspace) concerns the
zero-buffer FusedDeepMoeBuffer, not this op.

Every rank reaches the same verdict: each rank computes its local verdict (basic + strict +
data), then the ranks all-gather (verdict, BS, global_bs) with a timeout and all raise if any
rank failed, so no rank enters the collective op while a peer has refused it.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from cam_jit.ops.weights import INT4_PER_WORD
from cam_jit.ops import _exchange
from cam_jit.ops.fused_deep_moe import OP, Layout, validate
from cam_jit.ops.groups import resolve_group

MAX_EXPERTS = 512
MAX_BATCH = 256
HIDDEN_RANGE = (512, 7168)
DOC_MIN_HIDDEN, DOC_HIDDEN_ALIGN = 1024, 256
GMM1_WIDTH_RANGE, GMM1_WIDTH_ALIGN = (1024, 6144), 1024
MAX_TOPK = 12
W4A8_MAX_LOCAL_EXPERTS = 48 // 2  # aivNum / 2, aivNum = 48 on Ascend 910_93 (docs/semantics.md §7.5 item 6)
HCCL_BUFFSIZE_DEFAULT_MIB = 200
GROUP_NAME_MAX = 128  # exclusive
_MIB = 1024 * 1024
_TOKEN_BYTES, _DOUBLE_BUFFER = 2, 2


def check_strict(args: Dict[str, object]) -> None:
    """Strict checks for one `fused_deep_moe` call; raises where the NPU op would refuse.

    Args:
        args: the op's arguments by schema name, normalised as the op receives them (weight
            containers as lists of tensors, `group_ep` as the group-name string).

    Raises:
        TypeError / ValueError / NotImplementedError: from basic validation.
        ValueError: a strict limit (upstream text, formatted), on this rank or, with
            `ep_rank_size > 1`, on a peer rank of the group.
        RuntimeError: the cross-rank exchange timed out (CAM_JIT_COMM_TIMEOUT).
    Warns:
        UserWarning: `share_smooth_scales` given without `expert_smooth_scales` (ignored).
    """
    local_error = _local_verdict(args)
    ranks = args["ep_rank_size"]
    if ranks > 1:
        try:
            group = resolve_group(OP, args["group_ep"], ranks, args["ep_rank_id"])
        except ValueError:
            if local_error is not None:  # no group to tell the peers: report the first error
                raise local_error from None
            raise
        _agree_across_ranks(args, group, local_error)
    if local_error is not None:
        raise local_error


def _local_verdict(args: Dict[str, object]) -> Optional[Exception]:
    """The error this rank alone would raise (basic, then strict in upstream order), or None."""
    try:
        layout = validate(**args)
        check_attributes(args)
        check_bias_lists(args, layout)
        check_hccl_window(args, layout)
        check_data_limits(args, layout)
        check_shared_expert(args, layout)
        warn_ignored_share_smooth_scales(args)
        check_token_data(args, layout)
    except (TypeError, ValueError, NotImplementedError) as err:
        return err
    return None


def _fail(arg: str, text: str, got: str, doc: bool = False) -> None:
    raise ValueError(f"{OP}: strict: argument '{arg}': {'[doc] ' if doc else ''}{text} (got {got})")


def _is_w4a8(args: Dict[str, object]) -> bool:
    return args["gmm1_weight"][0].dtype == torch.int32


def _logical_width(args: Dict[str, object], arg: str) -> int:
    """Logical output width of a weight argument (W4A8 words hold 8 int4 columns, docs/semantics.md §1.5)."""
    value = args[arg]
    weight = value[0] if isinstance(value, list) else value
    return weight.shape[-1] * (INT4_PER_WORD if _is_w4a8(args) else 1)


def check_attributes(args: Dict[str, object]) -> None:
    """§7.5 item 3 (attributes), with the [doc] quant_mode and group_ep rules (the group name only
    matters with ep_rank_size > 1: one rank communicates with nobody)."""
    experts = args["moe_expert_num"]
    if experts > MAX_EXPERTS:
        _fail("moe_expert_num", f"moeExpertNum must <= {MAX_EXPERTS}.", f"moe_expert_num = {experts}")
    if args["quant_mode"] != 0:
        _fail("quant_mode", "quantMode must be 0 (reserved).", f"quant_mode = {args['quant_mode']}", doc=True)
    name = args["group_ep"]
    if args["ep_rank_size"] > 1 and not 0 < len(name) < GROUP_NAME_MAX:
        _fail("group_ep", f"the group name length must be in (0, {GROUP_NAME_MAX}) (on the NPU the kernel takes the "
              "group's HCCL communicator name, which cam_jit looks up; pass the ProcessGroup or its group_name)",
              f"length {len(name)}: {name[:32]!r}", doc=True)


def _check_bias_list(arg: str, name: str, items: List[torch.Tensor], width: int, width_text: str,
                     local_experts: int, weight_per_expert: bool) -> None:
    """One W4A8 bias container against the §1.3 rules, with the upstream gmm2Bias texts."""
    if not items:
        _fail(arg, f"{name} is null.", "an empty list (W4A8 needs the compensation bias, docs/semantics.md §1.5)")
    per_expert = len(items) > 1
    if per_expert and len(items) != local_experts:
        _fail(arg, f"{name} listlen does not equals to localExpertNum.",
              f"a list of {len(items)}, E_loc = {local_experts}")
    for i, t in enumerate(items):
        if t.dim() == 0 or t.shape[-1] != width:
            _fail(arg, f"{name} {width_text}", f"{arg}[{i}] of shape {list(t.shape)}, last dimension must be {width}")
        if per_expert:
            fits, expected = t.dim() == 1, f"[{width}]"
        else:
            fits = t.dim() == 2 and t.shape[0] == local_experts or t.dim() == 1 and local_experts == 1
            expected = f"[{local_experts}, {width}]"
        if not fits:
            _fail(arg, f"{name} does not match local expert number perRank.",
                  f"{arg}[{i}] of shape {list(t.shape)}, expected {expected}")
    if per_expert != weight_per_expert:
        _fail(arg, f"{name} listFlag does not match gmm1Weight listFlag.",
              f"a list of {len(items)} ({'per-expert' if per_expert else 'stacked'}) while gmm1_weight is "
              f"{'per-expert' if weight_per_expert else 'stacked'}")


def check_bias_lists(args: Dict[str, object], layout: Layout) -> None:
    """§7.5 item 4, W4A8 biases: the gmm2Bias texts applied to the real bias lists (upstream
    inspects the scale input, §8.7) and their gmm1 analogues against N1 (proposal)."""
    if not _is_w4a8(args):
        return
    weight_per_expert = len(args["gmm1_weight"]) > 1
    _check_bias_list("gmm1_bias", "gmm1Bias", args["gmm1_bias"], _logical_width(args, "gmm1_weight"),
                     "length does not equals to gmm1 hidden size.", layout.local_experts, weight_per_expert)
    _check_bias_list("gmm2_bias", "gmm2Bias", args["gmm2_bias"], layout.hidden,
                     "does not match token hidden size.", layout.local_experts, weight_per_expert)


def hccl_buffsize_mib() -> int:
    """`HCCL_BUFFSIZE` (MiB) from the environment, default 200 (docs/semantics.md §7.5 item 5)."""
    raw = os.environ.get("HCCL_BUFFSIZE", "").strip()
    if not raw:
        return HCCL_BUFFSIZE_DEFAULT_MIB
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{OP}: strict: environment variable HCCL_BUFFSIZE: expected a positive number of MiB, "
                         f"got {raw!r}")
    return value


def check_hccl_window(args: Dict[str, object], layout: Layout) -> None:
    """§7.5 item 5, evaluated with the defaulted global_bs (proposal; upstream checks before
    defaulting, so 0 passes vacuously there, §8.8)."""
    ranks, gbs = args["ep_rank_size"], args["global_bs"]
    effective = gbs or layout.batch * ranks
    needed = layout.local_experts * effective * layout.hidden * _TOKEN_BYTES * _DOUBLE_BUFFER
    limit = hccl_buffsize_mib()
    if needed > limit * _MIB:
        given = f"global_bs = {gbs}" if gbs else f"global_bs = 0, i.e. BS * ep_rank_size = {effective}"
        _fail("global_bs",
              f"HCCL_BUFFSIZE is too SMALL, globalBatchSize = {effective}, h = {layout.hidden}, "
              f"moeExpertNumPerRank = {layout.local_experts}, NEEDED_HCCL_BUFFSIZE(moeExpertNumPerRank * "
              f"globalBatchSize * h * TOKEN_DTYPE_BYTE_SIZE * doubleBuffer) B={math.ceil(needed / _MIB)}MB, "
              f"HCCL_BUFFSIZE={limit}MB.",
              f"{given}: {needed} bytes needed; raise HCCL_BUFFSIZE (MiB) or lower global_bs")


def check_data_limits(args: Dict[str, object], layout: Layout) -> None:
    """§7.5 item 6 (batch, hidden, gmm1 width, top-k, W4A8 experts per rank) and the [doc] rules
    h >= 1024, h % 256 == 0 and BS <= global_bs / R (§1.7)."""
    bs, h, k = layout.batch, layout.hidden, layout.topk
    if bs > MAX_BATCH:
        _fail("x", f"batchSize(bs) must <= {MAX_BATCH}.", f"BS = x.shape[0] = {bs}")
    low, high = HIDDEN_RANGE
    if not low <= h <= high:
        _fail("x", f"tokenLength(h) is invalid. Only support [{low}, {high}].", f"H = x.shape[1] = {h}")
    if h < DOC_MIN_HIDDEN or h % DOC_HIDDEN_ALIGN:
        _fail("x", f"tokenLength(h) must be in [{DOC_MIN_HIDDEN}, {high}] and divisible by {DOC_HIDDEN_ALIGN}.",
              f"H = x.shape[1] = {h}", doc=True)
    _check_gmm1_width("gmm1_weight", "gmm1", _logical_width(args, "gmm1_weight"))
    if k > MAX_TOPK:
        _fail("expert_ids", f"topK(k) must <= {MAX_TOPK}.", f"K = expert_ids.shape[1] = {k}")
    experts = args["moe_expert_num"]
    if k > experts:
        _fail("expert_ids", f"topK(k) must <= moeExpertNum({experts}).", f"K = expert_ids.shape[1] = {k}")
    if _is_w4a8(args) and layout.local_experts > W4A8_MAX_LOCAL_EXPERTS:
        _fail("moe_expert_num",
              f"moeExpertNumPerRank must <= (aivNum/2)({W4A8_MAX_LOCAL_EXPERTS}), but got {layout.local_experts}",
              f"E_loc = moe_expert_num / ep_rank_size = {experts} / {args['ep_rank_size']}")
    ranks, gbs = args["ep_rank_size"], args["global_bs"]
    if gbs and bs > gbs // ranks:
        _fail("global_bs", f"batchSize(bs) must <= globalBatchSize / epRankSize ({gbs} / {ranks} = {gbs // ranks}).",
              f"BS = x.shape[0] = {bs}; pass max_r(BS_r) * ep_rank_size, or 0 when all batches are equal", doc=True)


def _check_gmm1_width(arg: str, name: str, width: int) -> None:
    """The gmm1 / shareGmm1 output width 2I: range and 1024-alignment (§7.5 items 6 and 8)."""
    low, high = GMM1_WIDTH_RANGE
    got = f"2I = {width} (the logical last dimension of '{arg}')"
    if not low <= width <= high:
        _fail(arg, f"{name} hidden size is invalid. Only support [{low}, {high}].", got)
    if width % GMM1_WIDTH_ALIGN:
        _fail(arg, f"{name} hidden size must be divisible by {GMM1_WIDTH_ALIGN}, but got {width}.", got)


def check_shared_expert(args: Dict[str, object], layout: Layout) -> None:
    """§7.5 item 8: the shareGmm1 width range and alignment (master/W4A8 texts, applied to both
    variants as for gmm1), and the W4A8 3-D share_gmm2_weight rejection (§8.7)."""
    if not layout.shared:
        return
    _check_gmm1_width("share_gmm1_weight", "shareGmm1", _logical_width(args, "share_gmm1_weight"))
    weight2 = args["share_gmm2_weight"]
    if _is_w4a8(args) and weight2.dim() == 3:
        _fail("share_gmm2_weight", f"shareGmm2Weight dim2 should be h({layout.hidden}), but got {weight2.shape[2]}.",
              f"shape {list(weight2.shape)}; the W4A8 NPU op compares the packed dim 2 with h, so pass the 2-D "
              f"[Is, H/8] form")


def warn_ignored_share_smooth_scales(args: Dict[str, object]) -> None:
    """§1.2: without expert_smooth_scales smooth quant is off for routed and shared tokens alike,
    so a share_smooth_scales is ignored (as upstream); strict mode says so."""
    if args["share_smooth_scales"] is not None and args["expert_smooth_scales"] is None:
        warnings.warn(
            f"{OP}: strict: argument 'share_smooth_scales' is ignored because 'expert_smooth_scales' is None: "
            "smooth quantisation is keyed on the routed smooth scales and is off for routed and shared tokens "
            "alike (as upstream); pass expert_smooth_scales too, or drop share_smooth_scales",
            UserWarning, stacklevel=5)  # the caller of cam_jit.fused_deep_moe


def check_token_data(args: Dict[str, object], layout: Layout) -> None:
    """Data rules (read the tensors): [doc] True-before-False x_active_mask (§1.7, §8.5) and
    [doc] no duplicate non-negative expert id within an active token's row."""
    x = args["x"]
    if x.device.type == "meta":  # no data to read (tracing)
        return
    mask = args["x_active_mask"]
    active = layout.batch
    if mask is not None:
        active = int(mask.sum())
        if active and not bool(mask[:active].all()):
            first_false = int((~mask).nonzero()[0])
            late_true = int(mask[first_false:].nonzero()[0]) + first_false
            _fail("x_active_mask", "xActiveMask True values must precede False values.",
                  f"{active} True values, False at row {first_false} and True at row {late_true}", doc=True)
    ids = args["expert_ids"][:active]
    if ids.shape[1] < 2 or ids.numel() == 0:
        return
    ordered = torch.sort(ids, dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(repeated.any()):
        row, col = (int(v) for v in repeated.nonzero()[0])
        _fail("expert_ids", "A token cannot be sent to an expert beyond one time (no duplicate expert ids in a row).",
              f"expert {int(ordered[row, col])} twice in row {row}: {ids[row].tolist()}", doc=True)


def _agree_across_ranks(args: Dict[str, object], group: "dist.ProcessGroup",
                        local_error: Optional[Exception]) -> None:
    """All-gather (failed, BS, global_bs) over the EP group; raise on every rank if any rank
    failed locally, if global_bs differs between ranks, or if global_bs == 0 with unequal BS."""
    ranks = args["ep_rank_size"]
    mine = torch.tensor([int(local_error is not None), 0, 0], dtype=torch.int64)
    if local_error is None:
        mine[1], mine[2] = args["x"].shape[0], args["global_bs"]
    gathered = [torch.empty_like(mine) for _ in range(ranks)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    _exchange.wait(work, OP, "strict-mode exchange of (verdict, BS, global_bs)", group)
    if local_error is not None:
        return  # the caller raises this rank's own error
    failed = [r for r, row in enumerate(gathered) if int(row[0])]
    if failed:
        raise ValueError(
            f"{OP}: strict: rank(s) {failed} of EP group {args['group_ep']!r} rejected their arguments (see the "
            f"error on those ranks), so no rank enters the collective op"
        )
    batches = [int(row[1]) for row in gathered]
    global_bss = [int(row[2]) for row in gathered]
    where = f"on ranks 0..{ranks - 1}"
    if len(set(global_bss)) > 1:
        _fail("global_bs", "globalBatchSize must be the same on every rank of the EP group.",
              f"global_bs = {global_bss} {where}", doc=True)
    if global_bss[0] == 0 and len(set(batches)) > 1:
        _fail("global_bs", f"globalBatchSize = 0 needs the same batch on every rank; pass max_r(BS_r) * epRankSize "
              f"= {max(batches) * ranks} instead.", f"BS = x.shape[0] = {batches} {where}", doc=True)
