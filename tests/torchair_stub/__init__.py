"""Real TorchAir on CPU for the converter tests.

``torchair_root()`` takes the ``torch-npu`` wheel matching torch from the test wheel cache
(tests/wheel_cache.py, shared with the NPU compile test) and extracts only the Python files of
``torch_npu/dynamo/torchair/`` next to it. torch_npu itself is never installed or
imported (its backend autoload would break ``import torch``). Without registry access it skips.

``install(root)`` (in a process of its own: torchair patches torch on import) puts that directory
on ``sys.path``, replaces torchair's C++ extension ``torchair.core._torchair`` with
``torchair_stub._torchair`` (the one stand-in for vendor code), imports torchair, and undoes the
process-wide hooks torchair installs on import (SIGINT/SIGTERM handlers, an atexit hook) and
silences the warnings its converters of torch_npu's own ops give when those ops are absent.
"""
from __future__ import annotations

import atexit
import shutil
import signal
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock

import wheel_cache

_PREFIX = "torch_npu/dynamo/torchair/"


def _missing_protobuf() -> str:
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        return "torchair's GE graph needs protobuf: pip install protobuf (part of cam-jit[test])"
    return ""


def torchair_root() -> Path:
    """A directory D with D/torchair = the wheel's torch_npu/dynamo/torchair (Python files)."""
    missing = _missing_protobuf()
    if missing:
        pytest.skip(missing)
    wheel = wheel_cache.torch_npu_wheel()
    directory = wheel.parent
    with FileLock(str(directory / ".torchair.lock"), timeout=900):
        root = directory / f"torchair-{wheel.stem}"
        if not (root / "torchair" / "__init__.py").is_file():
            with tempfile.TemporaryDirectory(dir=directory, prefix=".extract-") as tmp:
                with zipfile.ZipFile(wheel) as zf:
                    members = [m for m in zf.namelist() if m.startswith(_PREFIX) and not m.endswith(".so")]
                    zf.extractall(tmp, members)
                staged = Path(tmp) / "root"
                staged.mkdir()
                (Path(tmp) / _PREFIX).rename(staged / "torchair")
                shutil.rmtree(root, ignore_errors=True)
                staged.rename(root)
    return root


def install(root: str):
    """Imports torchair from `root` over the stub; returns the torchair module."""
    from cam_jit.ascend import registry
    from torchair_stub import _torchair

    if "torchair" in sys.modules:
        return sys.modules["torchair"]
    sys.path.insert(0, str(root))
    _torchair.REGISTERED_OPS.update(entry.ge_op for entry in registry.ops().values())
    sys.modules["torchair.core._torchair"] = _torchair
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with warnings.catch_warnings():  # its converters of torch_npu ops warn that those ops are absent
        warnings.simplefilter("ignore")
        import torchair
        import torchair._ge_concrete_graph.ge_converter.custom  # noqa: F401 (loaded on first compile)
    from torchair.core import _backend

    for s, handler in handlers.items():
        signal.signal(s, handler)
    atexit.unregister(_backend.finalize_graph_engine)
    return torchair
