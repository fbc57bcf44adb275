"""The cam_jit op registry: every op's name and schema, defined once, with its fake and CPU
kernels; `describe_ops`, the CLI and tests read the list from here."""
from __future__ import annotations

import dataclasses
from typing import Callable, List

import torch

from cam_jit.ops._kernels import register_inference_only

NAMESPACE = "cam_jit"


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """An op `torch.ops.cam_jit.<name>` with `schema` = "(args) -> returns" (no name)."""

    name: str
    schema: str

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


OPS: List[OpInfo] = []
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # holds every registration of the ops


def define_op(info: OpInfo, fake: Callable, kernel: Callable, dispatch_key: str = "CPU") -> None:
    """Defines the op, registers its fake kernel and its `kernel` for `dispatch_key` ("CPU", or
    "CompositeExplicitAutograd" for ops without tensor inputs), and makes it inference-only."""
    _LIBRARY.define(info.name + info.schema)
    torch.library.register_fake(info.qualname, fake, lib=_LIBRARY)
    _LIBRARY.impl(info.name, kernel, dispatch_key)
    register_inference_only(_LIBRARY, info.name)
    OPS.append(info)
