"""Argument checks shared by the ops: every failure names the op, the argument, the expected
value and the actual value."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

_DTYPE_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def fail(op: str, arg: str, expected: str, actual: object, exc: type = ValueError) -> None:
    raise exc(f"{op}: argument '{arg}': expected {expected}, got {actual}")


def tensor(op: str, arg: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        fail(op, arg, "a torch.Tensor", type(value).__name__, TypeError)
    return value


def optional_tensor(op: str, arg: str, value: object) -> Optional[torch.Tensor]:
    return None if value is None else tensor(op, arg, value)


def integer(op: str, arg: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(op, arg, "an int", type(value).__name__, TypeError)
    return value


def keyword_alias(op: str, name: str, value: object, alias: str, alias_value: object) -> object:
    """The value of a required keyword argument `name` that may also be given under its alias
    (e.g. torch_npu's `ep_world_size` for `ep_rank_size`); exactly one of the two must be given."""
    if value is not None and alias_value is not None:
        raise TypeError(f"{op}: got both '{name}' and its alias '{alias}'; pass one")
    if value is None and alias_value is None:
        raise TypeError(f"{op}: missing required keyword argument '{name}' (or its alias '{alias}')")
    return value if value is not None else alias_value


def argument_types(op: str, tensors: Dict[str, object], optional: Dict[str, object], ints: Dict[str, object]) -> None:
    """Python-level type checks a public function makes before calling its op (the dispatcher's
    own messages for these are unreadable): tensors, optional tensors and ints, by name."""
    for arg, value in tensors.items():
        tensor(op, arg, value)
    for arg, value in optional.items():
        optional_tensor(op, arg, value)
    for arg, value in ints.items():
        integer(op, arg, value)


def weight_list(op: str, arg: str, value: object) -> List["torch.Tensor"]:
    """A weight-container argument (a tensor, or a list/tuple of tensors; None -> []) as the
    schema's Tensor[]."""
    if value is None:
        return []
    items = [value] if isinstance(value, torch.Tensor) else value
    if not isinstance(items, (list, tuple)):
        fail(op, arg, "a tensor or a list of tensors", type(value).__name__, TypeError)
    for i, t in enumerate(items):
        tensor(op, f"{arg}[{i}]", t)
    return list(items)


def dtype(op: str, arg: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        fail(op, arg, "dtype " + " or ".join(dtype_name(d) for d in allowed), dtype_name(t.dtype), TypeError)


def ndim(op: str, arg: str, t: torch.Tensor, dims: Union[int, Sequence[int]]) -> None:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if t.dim() not in dims:
        wanted = " or ".join(f"{d}-D" for d in dims)
        fail(op, arg, f"a {wanted} tensor", f"{t.dim()}-D with shape {list(t.shape)}")


def shape(op: str, arg: str, t: torch.Tensor, expected: Sequence[int], meaning: str = "") -> None:
    if list(t.shape) != list(expected):
        note = f" ({meaning})" if meaning else ""
        fail(op, arg, f"shape {list(expected)}{note}", list(t.shape))


def device(op: str, arg: str, t: torch.Tensor, expected: torch.device) -> None:
    if t.device != expected:
        fail(op, arg, f"a tensor on {expected} (the device of 'x')", t.device)


def expert_ids_in_range(op: str, expert_ids: torch.Tensor, experts: int, arg: str = "expert_ids") -> None:
    """Every value of `expert_ids` in [-1, experts) (-1 skips a slot)."""
    if expert_ids.numel():
        low, high = (int(v) for v in torch.aminmax(expert_ids))
        if low < -1 or high >= experts:
            fail(op, arg, f"values in [-1, {experts}) (-1 skips a slot)", f"min {low}, max {high}")


MAX_EXPERTS = 1 << 16  # far above any kernel's (the NPU's: 512); bounds what E may allocate


def expert_parallel(op: str, size_arg: str, ranks: int, rank: int, experts: int, global_bs: int) -> int:
    """The EP attributes every MoE op shares: R = `size_arg` > 0, 0 <= ep_rank_id < R,
    moe_expert_num a positive multiple of R, global_bs 0 or a multiple of R. Returns E_loc."""
    if ranks <= 0:
        fail(op, size_arg, "> 0", ranks)
    if not 0 <= rank < ranks:
        fail(op, "ep_rank_id", f"0 <= ep_rank_id < {size_arg} ({ranks})", rank)
    if experts <= 0 or experts % ranks or experts > MAX_EXPERTS:
        fail(op, "moe_expert_num", f"a positive multiple of {size_arg} ({ranks}), at most {MAX_EXPERTS}", experts)
    if global_bs < 0 or global_bs % ranks:
        fail(op, "global_bs", f"0 or a positive multiple of {size_arg} ({ranks})", global_bs)
    return experts // ranks
