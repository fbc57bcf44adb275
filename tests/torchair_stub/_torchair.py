"""Stand-in for TorchAir's C++ extension ``torchair.core._torchair`` (the one piece of vendor code
the converter tests replace; everything else they run is torchair's own Python from the
torch_npu wheel).

It holds only what torchair's Python layer touches on the paths the tests take: names read at
import time (``TorchNpuGraphBase``, ``TorchDataType``), graph-engine start-up (a no-op: there is
no device; ``install`` unhooks torchair's exit-time shutdown, so no finaliser is needed), and the
GE IR query. ``get_registered_ir_def`` answers like a CANN install with the
CAM operator package: the op types in ``REGISTERED_OPS`` (set by the fixture from cam_jit's
operator registry) are registered, any other is not. It returns no input/attr/output lists: the
converters under test spell those out themselves and the tests check them against SPEC.md.
"""
import enum
from typing import Set

REGISTERED_OPS: Set[str] = set()

TorchDataType = enum.IntEnum(
    "TorchDataType", "BOOL UINT8 INT8 INT16 UINT16 INT32 UINT32 INT64 UINT64 BF16 FLOAT16 FLOAT32 FLOAT64 "
    "COMPLEX64 COMPLEX128")


class TorchNpuGraphBase:
    """Base of torchair's graph executor; never loads or runs a graph here."""

    def __init__(self, name: str = "") -> None:
        self.name = name


def InitializeGraphEngine(options) -> None:  # noqa: N802 (the C++ name)
    """Called once per process before the first graph is converted; no device to set up."""


def get_registered_ir_def(op_type: str):
    """(status, inputs, outputs, attrs) as the C++ query returns them."""
    return ("SUCCESS" if op_type in REGISTERED_OPS else "FAILED", [], [], [])
