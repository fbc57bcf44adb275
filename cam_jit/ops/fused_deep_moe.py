"""`fused_deep_moe`: the expert-parallel MoE layer in one op (docs/semantics.md §1).

Public function, torch.library schema, argument checks, fake kernel and CPU implementation.
The CPU implementation dispatches quantised tokens to the ranks that own their experts with
`all_to_all_single`, runs the JIT-compiled expert kernels, sends the results back and combines.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from cam_jit.ops import _checks as check
from cam_jit.ops import _moe_cpu
from cam_jit.ops._kernels import cpu_kernels
from cam_jit.ops._registry import OpInfo, define_op
from cam_jit.ops._strict import strict_enabled
from cam_jit.ops.groups import group_ep_name, resolve_group
from cam_jit.ops.weights import INT4_PER_WORD

OP = "fused_deep_moe"
SCHEMA = (
    "(Tensor x, Tensor expert_ids, Tensor[] gmm1_weight, Tensor[] gmm1_weight_scale, Tensor[] gmm2_weight, "
    "Tensor[] gmm2_weight_scale, Tensor expert_scales, Tensor? share_gmm1_weight, Tensor? share_gmm1_weight_scale, "
    "Tensor? share_gmm2_weight, Tensor? share_gmm2_weight_scale, Tensor? expert_smooth_scales, "
    "Tensor? share_smooth_scales, Tensor? x_active_mask, Tensor[] gmm1_bias, Tensor[] gmm2_bias, "
    "Tensor? share_gmm1_bias, Tensor? share_gmm2_bias, str group_ep, int ep_rank_size, int ep_rank_id, "
    "int moe_expert_num, int quant_mode, int global_bs) -> Tensor[]"
)

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sizes derived from validated arguments (docs/semantics.md §1.2 symbols)."""

    batch: int  # BS
    hidden: int  # H
    topk: int  # K
    local_experts: int  # E_loc
    inter: int  # I (gmm1 output is 2I wide)
    shared: bool
    share_inter: int  # Is, 0 without a shared expert
    w4a8: bool = False  # int32-packed int4 weights with compensation biases (docs/semantics.md §1.5, §1.9)


_VARIANTS = {torch.int8: "W8A8", torch.int32: "W4A8"}


def _first(arg: str, items: Sequence[torch.Tensor]) -> str:
    """How errors name the first tensor of a container: `arg` for a single stacked tensor,
    `arg[0]` for the first of a per-expert list."""
    return arg if len(items) == 1 else f"{arg}[0]"


def _container(op: str, arg: str, items: object, item_shape: Sequence[int], local_experts: int, note: str = "") -> torch.dtype:
    """Checks a weight container (docs/semantics.md §1.3): one stacked [E_loc, *item_shape] tensor (or, with
    one local expert, one item_shape tensor), or E_loc item_shape tensors. Returns the dtype.
    `note` explains item_shape in the errors."""
    if not items:
        check.fail(op, arg, "a tensor or a non-empty list of tensors", "an empty list")
    item_dim = len(item_shape)
    if len(items) == 1:
        only = items[0]
        if only.dim() == item_dim + 1:
            check.shape(op, arg, only, [local_experts, *item_shape], "stacked [E_loc, ...] container" + note)
        elif only.dim() == item_dim and local_experts == 1:
            check.shape(op, arg, only, item_shape, note.lstrip("; "))
        else:
            check.fail(
                op,
                arg,
                f"a stacked {item_dim + 1}-D tensor of shape {[local_experts, *item_shape]}"
                + (f" or a {item_dim}-D tensor of shape {list(item_shape)}" if local_experts == 1 else ""),
                f"{only.dim()}-D with shape {list(only.shape)}",
            )
    elif len(items) == local_experts:
        for i, t in enumerate(items):
            check.shape(op, f"{arg}[{i}]", t, item_shape, f"local expert {i}{note}")
    else:
        check.fail(
            op,
            arg,
            f"a list of 1 stacked tensor or {local_experts} per-expert tensors (E_loc = moe_expert_num / ep_rank_size)",
            f"a list of {len(items)}",
        )
    dtypes = {t.dtype for t in items}
    if len(dtypes) > 1:
        check.fail(op, arg, "one dtype for all its tensors", sorted(check.dtype_name(d) for d in dtypes), TypeError)
    return items[0].dtype


def _shared_tensor(op: str, arg: str, t: torch.Tensor, item_shape: Sequence[int]) -> None:
    """A shared-expert tensor: item_shape, or [1, *item_shape] (docs/semantics.md §1.2 rows 7-10, 16-17)."""
    if list(t.shape) not in (list(item_shape), [1, *item_shape]):
        check.fail(op, arg, f"shape {list(item_shape)} or {[1, *item_shape]}", list(t.shape))


def _same_variant(op: str, arg: str, t: torch.Tensor, weight_dtype: torch.dtype) -> None:
    """A weight must have gmm1_weight's dtype: one variant for all weights (docs/semantics.md §1.1)."""
    if t.dtype != weight_dtype:
        check.fail(op, arg, f"dtype {check.dtype_name(weight_dtype)} ({_VARIANTS[weight_dtype]}, like gmm1_weight: "
                   "all weights share one variant)", check.dtype_name(t.dtype), TypeError)


def _bias_container(op: str, arg: str, items: List[torch.Tensor], width: int, width_name: str, local_experts: int,
                    note: str) -> None:
    """A required W4A8 bias container (docs/semantics.md §1.3, §1.5): float32 [E_loc, width] or E_loc [width]."""
    if not items:
        check.fail(op, arg, f"the W4A8 compensation bias, a float32 [E_loc, {width_name}] tensor or E_loc "
                   f"[{width_name}] tensors ({width_name} = {width}; see cam_jit.ops.weights.w4a8_compensation_bias)",
                   "an empty list")
    _container(op, arg, items, (width,), local_experts, note)
    check.dtype(op, _first(arg, items), items[0], (torch.float32,))


def _check_gate_and_up(op: str, gmm1_weight, gmm1_weight_scale, gmm2_weight, width1: int, pack: int) -> None:
    """gmm1_weight's output width must be 2I, I being gmm2_weight's input rows: when gmm1_weight
    alone disagrees (e.g. its up half is missing) while gmm1_weight_scale and gmm2_weight agree
    with each other, the error names gmm1_weight, not the arguments that are right."""
    if not gmm1_weight_scale or not gmm2_weight or gmm2_weight[0].dim() not in (2, 3):
        return
    inter, scale_width = gmm2_weight[0].shape[-2], gmm1_weight_scale[0].shape[-1]
    if width1 != 2 * inter and scale_width == 2 * inter:
        words = f" int32 words (2I = {2 * inter} int4 columns)" if pack > 1 else ""
        check.fail(op, _first("gmm1_weight", gmm1_weight),
                   f"a last dimension of {2 * inter // pack}{words}: the [gate | up] columns, 2I with I = {inter} "
                   f"(gmm2_weight's input rows; gmm1_weight_scale has {scale_width} columns)",
                   f"shape {list(gmm1_weight[0].shape)}, {width1} columns"
                   + (" (half of them: is the up half missing?)" if width1 == inter else ""))


def validate(
    x, expert_ids, gmm1_weight, gmm1_weight_scale, gmm2_weight, gmm2_weight_scale, expert_scales,
    share_gmm1_weight, share_gmm1_weight_scale, share_gmm2_weight, share_gmm2_weight_scale,
    expert_smooth_scales, share_smooth_scales, x_active_mask, gmm1_bias, gmm2_bias, share_gmm1_bias,
    share_gmm2_bias, group_ep, ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs, op: str = OP,
) -> Layout:
    """Basic validation (docs/semantics.md §0.6) of everything knowable without reading tensor data, for
    arguments of the schema's types (the dispatcher has checked those). Works on fake tensors.
    `op` labels the errors (the public entry point that was called)."""
    local_experts = check.expert_parallel(op, "ep_rank_size", ep_rank_size, ep_rank_id, moe_expert_num, global_bs)

    check.ndim(op, "x", x, 2)
    check.dtype(op, "x", x, (torch.bfloat16, torch.float16))
    batch, hidden = x.shape
    check.ndim(op, "expert_ids", expert_ids, 2)
    check.dtype(op, "expert_ids", expert_ids, (torch.int32,))
    if expert_ids.shape[0] != batch:
        check.fail(op, "expert_ids", f"shape[0] == {batch} (x.shape[0], the batch)", list(expert_ids.shape))
    topk = expert_ids.shape[1]
    check.dtype(op, "expert_scales", expert_scales, (torch.float32,))
    check.shape(op, "expert_scales", expert_scales, list(expert_ids.shape), "the shape of expert_ids")

    if not gmm1_weight:
        check.fail(op, "gmm1_weight", "a tensor or a non-empty list of tensors", "an empty list")
    weight_dtype = gmm1_weight[0].dtype
    if weight_dtype not in _VARIANTS:
        check.fail(op, _first("gmm1_weight", gmm1_weight), "dtype int8 (W8A8) or int32 (W4A8: packed int4)",
                   check.dtype_name(weight_dtype), TypeError)
    w4a8 = weight_dtype == torch.int32
    pack = INT4_PER_WORD if w4a8 else 1  # logical columns per stored element
    check.ndim(op, _first("gmm1_weight", gmm1_weight), gmm1_weight[0], (2, 3))
    width1 = gmm1_weight[0].shape[-1] * pack
    if width1 % 2:
        check.fail(op, "gmm1_weight", "an even last dimension 2*I (gate | up columns)", width1)
    _check_gate_and_up(op, gmm1_weight, gmm1_weight_scale, gmm2_weight, width1, pack)
    inter = width1 // 2
    if hidden % pack:
        check.fail(op, "x", f"a hidden size H that is a multiple of {pack} under W4A8 (gmm2_weight packs H int4 "
                   f"columns into H/{pack} int32 words)", f"H = {hidden}")
    scale_dtypes = (torch.float32, x.dtype)
    packed1 = f"; 2I = 8 x the {width1 // pack} int32 words of gmm1_weight" if w4a8 else ""
    _container(op, "gmm1_weight", gmm1_weight, (hidden, width1 // pack), local_experts)
    s1_dtype = _container(op, "gmm1_weight_scale", gmm1_weight_scale, (width1,), local_experts, packed1)
    if gmm2_weight:
        _same_variant(op, _first("gmm2_weight", gmm2_weight), gmm2_weight[0], weight_dtype)
    _container(op, "gmm2_weight", gmm2_weight, (inter, hidden // pack), local_experts,
               f"; H / 8 = {hidden // pack} int32 words of 8 int4 columns each" if w4a8 else "")
    s2_dtype = _container(op, "gmm2_weight_scale", gmm2_weight_scale, (hidden,), local_experts)
    check.dtype(op, _first("gmm1_weight_scale", gmm1_weight_scale), gmm1_weight_scale[0], scale_dtypes)
    check.dtype(op, _first("gmm2_weight_scale", gmm2_weight_scale), gmm2_weight_scale[0], scale_dtypes)
    per_expert = len(gmm1_weight) > 1
    containers = [("gmm1_weight_scale", gmm1_weight_scale), ("gmm2_weight", gmm2_weight),
                  ("gmm2_weight_scale", gmm2_weight_scale)]
    if w4a8:
        _bias_container(op, "gmm1_bias", gmm1_bias, width1, "2I", local_experts, packed1)
        _bias_container(op, "gmm2_bias", gmm2_bias, hidden, "H", local_experts, "; one per unpacked column")
        containers += [("gmm1_bias", gmm1_bias), ("gmm2_bias", gmm2_bias)]
    else:
        for arg, items in (("gmm1_bias", gmm1_bias), ("gmm2_bias", gmm2_bias)):
            if items:
                check.fail(op, arg, "an empty list under W8A8 (biases are W4A8 compensation terms)",
                           f"a list of {len(items)}")
    for arg, items in containers:
        if (len(items) > 1) != per_expert:
            check.fail(op, arg, f"the same container mode as gmm1_weight (a list of {len(gmm1_weight)})",
                       f"a list of {len(items)}")

    shared_args = {
        "share_gmm1_weight": share_gmm1_weight,
        "share_gmm1_weight_scale": share_gmm1_weight_scale,
        "share_gmm2_weight": share_gmm2_weight,
        "share_gmm2_weight_scale": share_gmm2_weight_scale,
    }
    share_biases = {"share_gmm1_bias": share_gmm1_bias, "share_gmm2_bias": share_gmm2_bias}
    present = [name for name, t in shared_args.items() if t is not None]
    shared = bool(present)
    share_inter = 0
    if not w4a8 or not shared:
        why = "under W8A8 (biases are W4A8 compensation terms)" if not w4a8 else \
            "without a shared expert (share_gmm1_weight is None)"
        for arg, value in share_biases.items():
            if value is not None:
                check.fail(op, arg, f"None {why}", "a tensor")
    if shared:
        if len(present) != 4:
            missing = [name for name in shared_args if name not in present]
            check.fail(op, missing[0], "a tensor: the four share_* weights and scales are given together",
                       f"None while {present} are given")
        _same_variant(op, "share_gmm1_weight", share_gmm1_weight, weight_dtype)
        check.ndim(op, "share_gmm1_weight", share_gmm1_weight, (2, 3))
        share_width = share_gmm1_weight.shape[-1] * pack
        if share_width % 2:
            check.fail(op, "share_gmm1_weight", "an even last dimension 2*Is", share_width)
        share_inter = share_width // 2
        _shared_tensor(op, "share_gmm1_weight", share_gmm1_weight, (hidden, share_width // pack))
        _shared_tensor(op, "share_gmm1_weight_scale", share_gmm1_weight_scale, (share_width,))
        _same_variant(op, "share_gmm2_weight", share_gmm2_weight, weight_dtype)
        _shared_tensor(op, "share_gmm2_weight", share_gmm2_weight, (share_inter, hidden // pack))
        _shared_tensor(op, "share_gmm2_weight_scale", share_gmm2_weight_scale, (hidden,))
        check.dtype(op, "share_gmm1_weight_scale", share_gmm1_weight_scale, (s1_dtype,))
        check.dtype(op, "share_gmm2_weight_scale", share_gmm2_weight_scale, (s2_dtype,))
        if w4a8:
            for (arg, bias), (width, name) in zip(share_biases.items(), ((share_width, "2Is"), (hidden, "H"))):
                if bias is None:
                    check.fail(op, arg, f"the W4A8 compensation bias of the shared expert, a float32 [{name}] tensor "
                               f"({name} = {width}; see cam_jit.ops.weights.w4a8_compensation_bias)", None)
                _shared_tensor(op, arg, bias, (width,))
                check.dtype(op, arg, bias, (torch.float32,))

    smooth, share_smooth = expert_smooth_scales, share_smooth_scales
    if smooth is not None:
        check.dtype(op, "expert_smooth_scales", smooth, (torch.float32,))
        check.shape(op, "expert_smooth_scales", smooth, [moe_expert_num, hidden], "[moe_expert_num, H], by global expert id")
        if shared and share_smooth is None:
            check.fail(op, "share_smooth_scales", "a float32 [H] tensor when expert_smooth_scales and a shared "
                       "expert are given", None)
    if share_smooth is not None:
        check.dtype(op, "share_smooth_scales", share_smooth, (torch.float32,))
        check.shape(op, "share_smooth_scales", share_smooth, [hidden], "[H]")
    mask = x_active_mask
    if mask is not None:
        check.dtype(op, "x_active_mask", mask, (torch.bool,))
        check.shape(op, "x_active_mask", mask, [batch], "[BS], 1-D")

    tensors = {"expert_ids": expert_ids, "expert_scales": expert_scales, "expert_smooth_scales": smooth,
               "share_smooth_scales": share_smooth, "x_active_mask": mask, **shared_args, **share_biases}
    for name, items in (("gmm1_weight", gmm1_weight), ("gmm1_weight_scale", gmm1_weight_scale),
                        ("gmm2_weight", gmm2_weight), ("gmm2_weight_scale", gmm2_weight_scale),
                        ("gmm1_bias", gmm1_bias), ("gmm2_bias", gmm2_bias)):
        tensors.update({name if len(items) == 1 else f"{name}[{i}]": t for i, t in enumerate(items)})
    for name, t in tensors.items():
        if t is not None:
            check.device(op, name, t, x.device)
    return Layout(batch, hidden, topk, local_experts, inter, shared, share_inter, w4a8)


_VERDICTS: Dict[tuple, Layout] = {}  # argument signature -> validate's Layout, for the CPU kernel
_VERDICTS_MAX = 256  # distinct signatures kept (shapes vary with the batch); then the cache is reset


def _signature(values: Sequence[object]) -> tuple:
    """What validate's verdict depends on in the arguments `values` (the schema's, in order), as
    one flat tuple: each tensor's dtype, device (True for the CPU: the cheapest to read) and shape,
    each list's length followed by its tensors' three, and any other value itself (never tensor
    data). The schema fixes what each position holds, so equal tuples mean arguments equal in all
    of that."""
    key = []
    for v in values:
        kind = type(v)
        if v is None or kind is int or kind is str:
            key.append(v)
        elif kind is list:
            key.append(len(v))
            for t in v:
                key += t.dtype, t.is_cpu or t.device, t.shape
        elif isinstance(v, torch.Tensor):
            key += v.dtype, v.is_cpu or v.device, v.shape
        else:
            key.append(v)
    return tuple(key)


def validated(args: Dict[str, object]) -> Layout:
    """validate(**args) for real tensors, memoised per argument signature (:func:`_signature`
    of every argument): validate reads only those, so an equal signature has the same verdict.
    Only successes are kept; a failing call raises every time. Not for fake tensors (symbolic
    shapes must be checked, and guarded, at every trace)."""
    key = _signature(args.values())
    layout = _VERDICTS.get(key)
    if layout is None:
        layout = validate(**args)
        if len(_VERDICTS) >= _VERDICTS_MAX:
            _VERDICTS.clear()
        _VERDICTS[key] = layout
    return layout


def _check_expert_ids(expert_ids: torch.Tensor, experts: int, op: str = OP) -> None:
    """Routed ids must lie in [-1, moe_expert_num) (docs/semantics.md §1.7; upstream leaves >= E undefined)."""
    if expert_ids.numel() == 0:
        return
    low, high = torch.aminmax(expert_ids)
    low, high = int(low), int(high)
    if low < -1 or high >= experts:
        bad = low if low < -1 else high
        check.fail(op, "expert_ids", f"values in [-1, {experts}) (-1 skips a slot; moe_expert_num = {experts})",
                   f"a value {bad} (min {low}, max {high})")


def _fake(x, expert_ids, gmm1_weight, gmm1_weight_scale, gmm2_weight, gmm2_weight_scale, expert_scales,
          share_gmm1_weight, share_gmm1_weight_scale, share_gmm2_weight, share_gmm2_weight_scale,
          expert_smooth_scales, share_smooth_scales, x_active_mask, gmm1_bias, gmm2_bias, share_gmm1_bias,
          share_gmm2_bias, group_ep, ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs):
    layout = validate(**locals())
    return [
        x.new_empty(x.shape),
        x.new_empty(x.shape),
        x.new_empty((layout.local_experts,), dtype=torch.int64),
    ]


def _expert_ffn(kernels, layout: Layout, rows, scale, group_sizes, w1, s1, b1, w2, s2, b2, dtype, order=None):
    """docs/semantics.md §1.8 steps 2-4 (W4A8: §1.9) on int8 rows [M, H] grouped by local expert
    (group_sizes[e] rows for expert e) with per-row scales [M], or, with `order` (int64 [M]), on
    the rows rows[order] with scales scale[order], read in place; weight containers as in §1.3
    (b1, b2: the W4A8 bias containers, ignored under W8A8). Returns [M, H] of dtype."""
    if layout.w4a8:
        return kernels.expert_ffn_w4a8(rows, scale, group_sizes, w1, s1, b1, w2, s2, b2, dtype, order)
    return kernels.expert_ffn_w8a8(rows, scale, group_sizes, w1, s1, w2, s2, dtype, order)


AGREED = ("x.shape[1]", "x.dtype", "expert_ids.shape[1]", "moe_expert_num", "gmm1_weight.dtype", "gmm2_weight (I)",
          "quant_mode")


def agreed_values(layout: Layout, x: torch.Tensor, weight_dtype: torch.dtype, moe_expert_num: int,
                  quant_mode: int) -> Dict[str, object]:
    """What every rank of the EP group must pass alike, by AGREED label: the sizes and dtypes
    that fix the layout of the rows they exchange and the experts they address."""
    return dict(zip(AGREED, (layout.hidden, x.dtype, layout.topk, moe_expert_num, weight_dtype, layout.inter,
                             quant_mode)))


def _routing_call(kernel, x, expert_ids, active: int, experts: int, *rest):
    """kernel(x, expert_ids, active, experts, *rest): a C++ kernel that routes the first `active`
    rows of expert_ids and checks every id on the way; when one is out of range the error names
    the argument as _check_expert_ids does."""
    try:
        return kernel(x, expert_ids, active, experts, *rest)
    except RuntimeError as err:
        routing_error = err
    _check_expert_ids(expert_ids[:active], experts)
    raise routing_error


def _cpu(x, expert_ids, gmm1_weight, gmm1_weight_scale, gmm2_weight, gmm2_weight_scale, expert_scales,
         share_gmm1_weight, share_gmm1_weight_scale, share_gmm2_weight, share_gmm2_weight_scale,
         expert_smooth_scales, share_smooth_scales, x_active_mask, gmm1_bias, gmm2_bias, share_gmm1_bias,
         share_gmm2_bias, group_ep, ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs):
    args = dict(locals())  # the schema's arguments by name
    group = None
    if ep_rank_size != 1:  # with one rank, validate checks the EP attributes first
        check.expert_parallel(OP, "ep_rank_size", ep_rank_size, ep_rank_id, moe_expert_num, global_bs)
        group = resolve_group(OP, group_ep, ep_rank_size, ep_rank_id)
    try:
        layout = validated(args)
        active = layout.batch if x_active_mask is None else int(x_active_mask.sum())
        kernels = cpu_kernels()  # after validation: bad arguments fail without a kernel build
        if group is None:  # one rank: routing, quantisation, the expert FFN and combine in one C++ call
            output, share_zeros, expert_token_nums = _routing_call(
                kernels.moe_one_rank, x, expert_ids, active, moe_expert_num, expert_smooth_scales, expert_scales,
                gmm1_weight, gmm1_weight_scale, gmm1_bias, gmm2_weight, gmm2_weight_scale, gmm2_bias,
                not layout.shared)
        else:
            routed = _routing_call(kernels.route_and_quantize, x, expert_ids, active, moe_expert_num,
                                   expert_smooth_scales)
    except (TypeError, ValueError) as err:
        _moe_cpu.refuse(OP, group, AGREED, err)
    if group is None:
        share_output = shared_expert_output(kernels, layout, args) if layout.shared else share_zeros
        return [output, share_output, expert_token_nums]
    return _across_ranks(kernels, layout, args, group, active, routed)


def _across_ranks(kernels, layout: Layout, args: dict, group, active: int, routed) -> List[torch.Tensor]:
    """_cpu on the ranks of `group`, from route_and_quantize's result `routed` for the first `active`
    tokens of `args` (the schema's arguments by name): the quantised rows go to the ranks owning
    their experts and come back through their FFN to be combined; the shared expert runs while
    the routed rows are in flight."""
    pos, token, expert, counts, pair_rows, q, q_scale = routed
    x = args["x"]
    weights = [args[name] for name in ("gmm1_weight", "gmm1_weight_scale", "gmm1_bias", "gmm2_weight",
                                       "gmm2_weight_scale", "gmm2_bias")]
    shared = []  # the shared expert's output
    agreed = agreed_values(layout, x, weights[0][0].dtype, args["moe_expert_num"], args["quant_mode"])
    route = _moe_cpu.exchange_route(OP, (pos, token, expert, counts, pair_rows), active * layout.topk,
                                    layout.local_experts, group, agreed)
    received = _moe_cpu.send_rows(OP, route, q, q_scale, layout.local_experts,
                                  meanwhile=lambda: shared.append(shared_expert_output(kernels, layout, args)))
    expert_token_nums = torch.bincount(received.local_expert, minlength=layout.local_experts)
    by_expert = torch.sort(received.local_expert, stable=True).indices
    y_grouped = _expert_ffn(kernels, layout, received.rows, received.scale, expert_token_nums.tolist(), *weights,
                            x.dtype, by_expert)
    y = torch.empty_like(y_grouped)
    y[by_expert] = y_grouped
    output = kernels.combine(_moe_cpu.return_rows(OP, route, y), pair_rows, args["expert_scales"], active)
    share_output = shared[0] if shared else shared_expert_output(kernels, layout, args)
    return [output, share_output, expert_token_nums]


def shared_expert_output(kernels, layout: Layout, args: dict) -> torch.Tensor:
    """share_output (docs/semantics.md §1.10): the shared expert on all BS tokens of `args` (the schema's
    arguments by name), smoothed only when routed smooth scales are given; zeros without one."""
    x = args["x"]
    if not layout.shared:
        return torch.zeros_like(x)
    smooth = args["share_smooth_scales"] if args["expert_smooth_scales"] is not None else None
    q, q_scale = kernels.quantize_rows(x, None if smooth is None else smooth.view(1, -1), None,
                                       None if smooth is None else torch.zeros(layout.batch, dtype=torch.int64))
    biases = ([args["share_gmm1_bias"]], [args["share_gmm2_bias"]]) if layout.w4a8 else ([], [])
    return _expert_ffn(kernels, layout, q, q_scale, [layout.batch], [args["share_gmm1_weight"]],
                       [args["share_gmm1_weight_scale"]], biases[0], [args["share_gmm2_weight"]],
                       [args["share_gmm2_weight_scale"]], biases[1], x.dtype)


define_op(OpInfo(OP, SCHEMA), _fake, _cpu)

_ARGUMENTS = tuple(inspect.signature(_cpu).parameters)  # the schema's argument names, in order
_OPTIONAL_TENSORS = ("share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight", "share_gmm2_weight_scale",
                     "expert_smooth_scales", "share_smooth_scales", "x_active_mask", "share_gmm1_bias",
                     "share_gmm2_bias")
_INTS = ("ep_rank_size", "ep_rank_id", "moe_expert_num", "quant_mode", "global_bs")
_CONTAINERS = ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale", "gmm1_bias", "gmm2_bias")
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types whose ops nothing intercepts


def _plain_containers(required: Sequence[object], optional: Sequence[object], ints: Sequence[object],
                      containers: Sequence[object]) -> Optional[Tuple[List[torch.Tensor], ...]]:
    """The weight containers as the schema's lists (see check.weight_list) when every argument has
    an exact type nothing intercepts: `required` and `optional` (or None) tensors of
    _PLAIN_TENSORS, `ints` of int, each container such a tensor, a list or tuple of them, or
    None. None otherwise (a wrong type, a subclass or an int subclass): the caller then runs
    the checks that name the argument."""
    plain = _PLAIN_TENSORS
    for t in required:
        if type(t) not in plain:
            return None
    for t in optional:
        if t is not None and type(t) not in plain:
            return None
    for v in ints:
        if type(v) is not int:
            return None
    lists = []
    for c in containers:
        kind = type(c)
        if kind in plain:
            lists.append([c])
        elif c is None:
            lists.append([])
        elif kind is list or kind is tuple:
            for t in c:
                if type(t) not in plain:
                    return None
            lists.append(list(c))
        else:
            return None
    return tuple(lists)


def _interception_probes() -> Optional[tuple]:
    """The torch internals `_runs_directly` asks, or None on a torch that lacks any of them (every
    call then takes the dispatcher hop)."""
    c = torch._C
    try:
        return (c._len_torch_dispatch_stack, c._is_torch_function_mode_enabled, c._functorch.peek_interpreter_stack,
                c._get_tracing_state, c._autograd._profiler_enabled, c._any_requires_grad)
    except AttributeError:
        return None


_PROBES = _interception_probes()


def _runs_directly(required: Sequence[torch.Tensor], optional: Sequence[Optional[torch.Tensor]],
                   containers: Sequence[List[torch.Tensor]]) -> bool:
    """Whether a call whose tensors (`required`, x first, and `optional` as _plain_containers takes
    them, and the `containers` it returns) are all of _PLAIN_TENSORS may run the CPU implementation
    `_cpu` in place of its dispatcher hop (`torch.ops.cam_jit.fused_deep_moe`, which would call `_cpu`
    with the same arguments): CPU tensors, no autograd to record, and nothing that must see the op
    (a jit trace, dispatch or function modes, functorch transforms, the profiler; the caller has
    excluded torch.compile and export)."""
    if _PROBES is None or not required[0].is_cpu:
        return False
    dispatch_modes, function_modes, functorch_stack, jit_trace, profiler, any_requires_grad = _PROBES
    if (dispatch_modes() or function_modes() or functorch_stack() is not None or jit_trace() is not None
            or profiler()):
        return False
    return not (torch.is_grad_enabled() and any_requires_grad(*required, *optional, *containers))


def fused_deep_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    gmm1_weight: TensorOrList,
    gmm1_weight_scale: TensorOrList,
    gmm2_weight: TensorOrList,
    gmm2_weight_scale: TensorOrList,
    expert_scales: torch.Tensor,
    *,
    share_gmm1_weight: Optional[torch.Tensor] = None,
    share_gmm1_weight_scale: Optional[torch.Tensor] = None,
    share_gmm2_weight: Optional[torch.Tensor] = None,
    share_gmm2_weight_scale: Optional[torch.Tensor] = None,
    expert_smooth_scales: Optional[torch.Tensor] = None,
    share_smooth_scales: Optional[torch.Tensor] = None,
    x_active_mask: Optional[torch.Tensor] = None,
    gmm1_bias: Optional[TensorOrList] = None,
    gmm2_bias: Optional[TensorOrList] = None,
    share_gmm1_bias: Optional[torch.Tensor] = None,
    share_gmm2_bias: Optional[torch.Tensor] = None,
    group_ep: Union[str, "torch.distributed.ProcessGroup"],
    ep_rank_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    quant_mode: int = 0,
    global_bs: int = 0,
    strict: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-parallel MoE layer: dispatch, int8 GEMM, SwiGLU, requantise, int8 GEMM, combine.

    The weights' dtype picks the variant (docs/semantics.md §1.1): int8 is W8A8; int32 is W4A8, whose
    words each pack 8 int4 columns (cam_jit.ops.weights.pack_int4) and which needs the
    compensation biases (cam_jit.ops.weights.w4a8_compensation_bias). All weights share one
    variant.

    Every rank of the EP group calls it with its own tokens and its own E_loc = E / R experts
    (global expert g lives on rank g // E_loc). Shapes (BS tokens, hidden H, top-k K, I =
    intermediate size; weight containers are one stacked tensor with a leading E_loc dimension
    or a list of E_loc per-expert tensors):

    Args:
        x: [BS, H] bfloat16 or float16 tokens.
        expert_ids: [BS, K] int32 global expert ids in [-1, E); -1 skips the slot.
        gmm1_weight: [E_loc, H, 2I] int8 (W4A8: [E_loc, H, 2I/8] int32), output columns
            [gate | up].
        gmm1_weight_scale: [E_loc, 2I] float32 or x.dtype, per (unpacked) output column.
        gmm2_weight: [E_loc, I, H] int8 (W4A8: [E_loc, I, H/8] int32).
        gmm2_weight_scale: [E_loc, H] float32 or x.dtype.
        expert_scales: [BS, K] float32 combine weights.
        share_gmm1_weight, share_gmm1_weight_scale, share_gmm2_weight, share_gmm2_weight_scale:
            optional shared expert, [H, 2Is] / [2Is] / [Is, H] / [H] (a leading 1 is allowed;
            W4A8: int32 [H, 2Is/8] and [Is, H/8] weights); applied locally to all BS tokens,
            result in share_output.
        expert_smooth_scales: optional [E, H] float32 smooth-quant factors by global expert id.
        share_smooth_scales: [H] float32; required with expert_smooth_scales and a shared expert,
            ignored without expert_smooth_scales (as upstream).
        x_active_mask: optional [BS] bool; the first sum(mask) tokens are active (True must
            precede False); inactive tokens are not dispatched and their output rows are zero.
        gmm1_bias, gmm2_bias: W4A8 compensation biases, required there: [E_loc, 2I] / [E_loc, H]
            float32, in the container mode of the weights; must be None/empty under W8A8.
        share_gmm1_bias, share_gmm2_bias: [2Is] / [H] float32 (a leading 1 is allowed); required
            with a W4A8 shared expert, None otherwise.
        group_ep: the EP process group, or its name (ProcessGroup.group_name, a name given to
            cam_jit.register_group, or "" for the default group). On CPU unused when
            ep_rank_size == 1. On NPU tensors the kernel gets the group's HCCL communicator name
            (the group needs the HCCL backend, even for one rank); a string naming no torch group
            is passed as an HCCL name.
        ep_rank_size: R, ranks in the EP group. ep_rank_id: this rank's index in it.
        moe_expert_num: E, total routed experts, a multiple of R.
        quant_mode: reserved, 0. global_bs: 0 (equal batches) or max_r(BS_r) * R.
        strict: also apply the NPU kernel's own limits (docs/semantics.md §7.5), so that what the NPU would
            reject fails here too; None follows cam_jit.set_strict / CAM_JIT_STRICT.

    Returns:
        (output [BS, H] x.dtype: weighted combine of the routed experts (no shared expert),
         share_output [BS, H] x.dtype: shared-expert output, zeros without a shared expert,
         expert_token_nums [E_loc] int64: (token, k) pairs this rank's experts received).
    """
    required = (x, expert_ids, expert_scales)
    optional = (share_gmm1_weight, share_gmm1_weight_scale, share_gmm2_weight, share_gmm2_weight_scale,
                expert_smooth_scales, share_smooth_scales, x_active_mask, share_gmm1_bias, share_gmm2_bias)
    ints = (ep_rank_size, ep_rank_id, moe_expert_num, quant_mode, global_bs)
    given = (gmm1_weight, gmm1_weight_scale, gmm2_weight, gmm2_weight_scale, gmm1_bias, gmm2_bias)
    # torch.compile and export trace the checks below and the registered op, never the direct path
    containers = None if torch.compiler.is_compiling() else _plain_containers(required, optional, ints, given)
    plain = containers is not None
    if not plain:  # the checks that name an argument of a wrong type
        for arg, value in zip(("x", "expert_ids", "expert_scales"), required):
            check.tensor(OP, arg, value)
        for arg, value in zip(_OPTIONAL_TENSORS, optional):
            check.optional_tensor(OP, arg, value)
        for arg, value in zip(_INTS, ints):
            check.integer(OP, arg, value)
        containers = tuple(check.weight_list(OP, arg, value) for arg, value in zip(_CONTAINERS, given))
    values = (x, expert_ids, *containers[:4], expert_scales, *optional[:7], *containers[4:], *optional[7:],
              group_ep_name(OP, group_ep), *ints)  # the schema's order
    if strict_enabled(strict):
        from cam_jit.ops.fused_deep_moe_strict import check_strict

        check_strict(dict(zip(_ARGUMENTS, values)))
    if plain and _runs_directly(required, optional, containers):
        return tuple(_cpu(*values))
    return tuple(torch.ops.cam_jit.fused_deep_moe(*values))
