"""The Ascend operator registry: ``kernels/operator_registry.json`` as typed records.

The JSON file is the one source of truth for which aclnn symbols, GE op types and SoCs each
operator has, whether it needs SHMEM and which variants exclude each other (docs/semantics.md §7.2-§7.4).
Code, ``doctor``, the CLI and tests read it through this module.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from cam_jit.jit.backends import kernels_dir

REGISTRY_FILE = "operator_registry.json"


@dataclass(frozen=True)
class OpEntry:
    """One registry operator (field meanings: the ``fields`` table of the JSON file)."""

    name: str
    torch_op: Optional[str]
    family: str
    variant: Optional[str]
    aclnn: Optional[str]
    aclnn_later: Optional[str]
    ge_op: str
    listed_socs: Tuple[str, ...]
    socs: Tuple[str, ...]
    requires_shmem: bool
    exclusive_with: Tuple[str, ...]
    wrapper: Optional[str]
    note: Optional[str] = None

    @property
    def workspace_symbol(self) -> Optional[str]:
        """``<aclnn>GetWorkspaceSize``, the first of the two-phase call (docs/semantics.md §7.1)."""
        return None if self.aclnn is None else self.aclnn + "GetWorkspaceSize"


@dataclass(frozen=True)
class FdmAbi:
    """How the installed ``aclnnFusedDeepMoe`` prototype is told apart (docs/semantics.md §7.2, §8.1)."""

    env: str
    w4a8_marker_input: str
    base_marker_attr: str
    codes: Dict[str, int]  # abi name -> the integer the C++ wrapper takes
    variant_ops: Dict[str, str]  # abi name -> registry op name


@functools.lru_cache(maxsize=None)
def _raw() -> dict:
    path = kernels_dir() / REGISTRY_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"cam_jit: cannot read the operator registry {path}: {e}; this cam_jit "
                           "installation is incomplete (reinstall it)") from None


def ops() -> Dict[str, OpEntry]:
    """Every registry operator by name, in file order."""
    return {name: OpEntry(name=name, torch_op=d["torch_op"], family=d["family"],
                          variant=d["variant"], aclnn=d["aclnn"], aclnn_later=d["aclnn_later"],
                          ge_op=d["ge_op"], listed_socs=tuple(d["listed_socs"]),
                          socs=tuple(d["socs"]), requires_shmem=bool(d["requires_shmem"]),
                          exclusive_with=tuple(d["exclusive_with"]), wrapper=d["wrapper"],
                          note=d.get("note"))
            for name, d in _raw()["ops"].items()}


def op(name: str) -> OpEntry:
    """The registry entry ``name``; KeyError naming the known ones otherwise."""
    table = ops()
    if name not in table:
        raise KeyError(f"{name!r} is not in the Ascend operator registry; known: {', '.join(table)}")
    return table[name]


def for_torch_op(torch_op: str) -> List[OpEntry]:
    """The registry operators that can serve ``torch.ops.cam_jit.<torch_op>`` (several variants
    for fused_deep_moe), in file order."""
    return [e for e in ops().values() if e.torch_op == torch_op]


def torch_ops() -> List[str]:
    """The cam_jit torch ops that have an NPU binding, in file order, without repeats."""
    return list(dict.fromkeys(e.torch_op for e in ops().values() if e.torch_op))


def wrapper_files() -> List[str]:
    """The C++ wrapper file names the registry refers to, without repeats."""
    return list(dict.fromkeys(e.wrapper for e in ops().values() if e.wrapper))


def fdm_abi() -> FdmAbi:
    """The FusedDeepMoe prototype detection facts."""
    d = _raw()["fused_deep_moe_abi"]
    return FdmAbi(d["env"], d["w4a8_marker_input"], d["base_marker_attr"], dict(d["abis"]),
                  dict(d["variant_ops"]))
