"""What every converter does: attribute values that must be graph constants, the GE op type from
the Ascend operator registry, and one GE node whose output dtypes come from the meta outputs; and
the refusing converter of an op without a GE op.

Only torchair's public API is used: ``torchair.ge.custom_op`` (one node with named inputs, optional
inputs as empty, list inputs as dynamic ``<name><i>``), ``torchair.ge.attr`` and
``torchair.ge.DataType``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torchair
from torchair.ge import DataType, attr

from cam_jit.ascend import hccl, registry
from cam_jit.ops import _checks as check

_CONSTANT_NOTE = ("a graph attribute, so a Python {kind} fixed at trace time (a value computed from a "
                  "dynamic shape cannot be one)")


def int_attr(op: str, arg: str, value: object) -> "attr.Int":
    """GE Int attribute for the schema's ``int`` argument ``arg``; TypeError if it is not a
    compile-time Python int (e.g. a SymInt that torchair turned into a graph tensor)."""
    if isinstance(value, bool) or not isinstance(value, int):
        check.fail(op, arg, _CONSTANT_NOTE.format(kind="int"), type(value).__name__, TypeError)
    return attr.Int(value)


def str_attr(op: str, arg: str, value: object) -> "attr.Str":
    """GE String attribute for the schema's ``str`` argument ``arg``."""
    if not isinstance(value, str):
        check.fail(op, arg, _CONSTANT_NOTE.format(kind="str"), type(value).__name__, TypeError)
    return attr.Str(value)


def group_attr(op: str, group_ep: object) -> "attr.Str":
    """GE String attribute ``group_ep``: the HCCL communicator name of the group the schema's
    ``group_ep`` names (a string that names no torch process group passes through)."""
    str_attr(op, "group_ep", group_ep)
    return attr.Str(hccl.comm_name(op, group_ep))


def rows(tensor: "torchair.ge.Tensor") -> object:
    """The first dimension of a GE tensor at trace time (an int, a SymInt if dynamic, or None)."""
    size = tensor.symsize
    return size[0] if size else None


def ge_op_type(registry_op: str) -> str:
    """The GE op type of operator ``registry_op`` of ``kernels/operator_registry.json``."""
    return registry.op(registry_op).ge_op


_GE_DTYPE_NAMES = {value: name for name, value in vars(DataType).items() if name.startswith("DT_")}


def _set_dtype(tensor: "torchair.ge.Tensor", ge_dtype: int) -> None:
    """Sets the output descriptor's dtype; the descriptor is a protobuf message whose enum has the
    same names as ``torchair.ge.DataType`` (different numbers)."""
    enum = tensor.desc.DESCRIPTOR.fields_by_name["dtype"].enum_type
    tensor.desc.dtype = enum.values_by_name[_GE_DTYPE_NAMES[ge_dtype]].number


def node(op_type: str, inputs: Dict[str, object], attrs: Dict[str, object], outputs: Sequence[str],
         meta_outputs: Optional[Sequence[object]]) -> List["torchair.ge.Tensor"]:
    """One GE node ``op_type``; returns its outputs in order. ``meta_outputs`` (torchair's
    TensorSpecs of the op's fake outputs, one per output) set the output dtypes."""
    result = torchair.ge.custom_op(op_type, inputs=inputs, outputs=list(outputs), attrs=attrs)
    result = [result] if len(outputs) == 1 else list(result)
    if meta_outputs is not None:
        specs = [meta_outputs] if len(outputs) == 1 and not isinstance(meta_outputs, (list, tuple)) \
            else list(meta_outputs)
        if len(specs) != len(result):
            raise ValueError(f"GE {op_type}: {len(result)} outputs ({', '.join(outputs)}) but "
                             f"{len(specs)} meta outputs")
        for tensor, spec in zip(result, specs):
            _set_dtype(tensor, spec.dtype)
    return result


def register_refusal(op: str, reason: str) -> None:
    """Registers, for ``torch.ops.cam_jit.<op>`` if it is defined, a converter raising
    NotImplementedError that says why the op has no GE converter."""
    if not hasattr(torch.ops.cam_jit, op):
        return

    def refuse(*args, **kwargs):
        raise NotImplementedError(f"cam_jit::{op} has no TorchAir GE converter: {reason}. Compile a model "
                                  "using it with another torch.compile backend (or run it eagerly)")

    torchair.register_fx_node_ge_converter(getattr(torch.ops.cam_jit, op).default)(refuse)
