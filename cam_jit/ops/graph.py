"""Graph mode: the TorchAir GE converters of the cam_jit ops (``ge_converters/``).

``register_ge_converters()`` makes TorchAir (Ascend graph mode, ``torchair.get_npu_backend``)
lower each cam_jit op to its GE op. It needs torchair; importing cam_jit never imports it.
``ge_converter_status()`` tells, without torchair, which ops have a converter and why the others
have none. The converters ship as ``cam_jit._ge_converters``; a source checkout without that
mapping uses ``<checkout>/ge_converters``.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Dict, List

_PACKAGE = "cam_jit._ge_converters"
_TORCHAIR_FIX = ("TorchAir ships with torch_npu (`pip install torch-npu` matching your torch, on a "
                 "machine with CANN; then `import torch_npu` makes `import torchair` work)")


def _converters() -> ModuleType:
    """The converter package (no torchair import)."""
    try:
        return importlib.import_module(_PACKAGE)
    except ModuleNotFoundError as e:
        if e.name != _PACKAGE:
            raise
    init = Path(__file__).resolve().parents[2] / "ge_converters" / "__init__.py"
    if not init.is_file():
        raise RuntimeError(f"cam_jit: the GE converters ({_PACKAGE}) are missing from this installation "
                           "(reinstall cam_jit)")
    spec = importlib.util.spec_from_file_location(_PACKAGE, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PACKAGE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_PACKAGE]
        raise
    return module


def ge_converter_status() -> Dict[str, str]:
    """Op name -> "GE converter" or "no GE converter: <reason>", for every op that has an entry."""
    package = _converters()
    status = {op: "GE converter" for op in package.CONVERTERS}
    status.update({op: f"no GE converter: {why}" for op, why in package.NO_CONVERTER.items()})
    return status


def register_ge_converters() -> List[str]:
    """Registers the GE converter of every cam_jit op that has one with
    ``torchair.register_fx_node_ge_converter`` (idempotent) and returns the qualified names of
    those ops, e.g. ``["cam_jit::fused_deep_moe", "cam_jit::a2e", "cam_jit::e2a"]``.

    Raises ImportError naming the fix when torchair cannot be imported."""
    try:
        import torchair  # noqa: F401
    except ImportError as e:
        raise ImportError(f"cam_jit.register_ge_converters needs torchair, which cannot be imported ({e}); "
                          f"{_TORCHAIR_FIX}") from e
    import cam_jit.ops  # noqa: F401  (defines torch.ops.cam_jit.*)

    return _converters().register_all()
