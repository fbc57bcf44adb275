"""Real TorchAir on CPU for the converter tests.

``torchair_root()`` fetches the ``torch-npu`` wheel matching torch with ``pip download --no-deps``
into a cache (``$CAM_JIT_TEST_WHEEL_DIR`` or ``~/.cache/cam_jit-test-wheels``, shared with the NPU
compile test; a file lock and atomic renames make concurrent fetches safe) and extracts only the
Python files of ``torch_npu/dynamo/torchair/`` next to it. torch_npu itself is never installed or
imported (its backend autoload would break ``import torch``). Without registry access it skips.

``install(root)`` (in a process of its own: torchair patches torch on import) puts that directory
on ``sys.path``, replaces torchair's C++ extension ``torchair.core._torchair`` with
``torchair_stub._torchair`` (the one stand-in for vendor code), imports torchair, and undoes the
process-wide hooks torchair installs on import (SIGINT/SIGTERM handlers, an atexit hook) and
silences the warnings its converters of torch_npu's own ops give when those ops are absent.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from filelock import FileLock

TORCH_NPU_VERSION = torch.__version__.split("+")[0]  # torch_npu releases follow torch's version
_PREFIX = "torch_npu/dynamo/torchair/"


def cache_dir() -> Path:
    return Path(os.environ.get("CAM_JIT_TEST_WHEEL_DIR") or Path.home() / ".cache" / "cam_jit-test-wheels")


def _missing_protobuf() -> str:
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        return "torchair's GE graph needs protobuf: pip install protobuf (part of cam-jit[test])"
    return ""


def _fetch_wheel(directory: Path) -> Path:
    """The cached wheel; downloads it (under the cache lock) if absent; skips without registry."""
    pattern = f"torch_npu-{TORCH_NPU_VERSION}-*.whl"
    found = sorted(directory.glob(pattern))
    if found:
        return found[-1]
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               f"torch-npu=={TORCH_NPU_VERSION}", "-d", tmp]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`{' '.join(cmd)}` timed out: no usable access to the package registry")
        fetched = sorted(Path(tmp).glob(pattern))
        if run.returncode != 0 or not fetched:
            tail = " | ".join((run.stdout + run.stderr).strip().splitlines()[-3:])
            pytest.skip(f"cannot fetch torch-npu=={TORCH_NPU_VERSION} to test the GE converters through real "
                        f"torchair (no network access to the package registry?): {tail}")
        os.replace(fetched[-1], directory / fetched[-1].name)
        return directory / fetched[-1].name


def torchair_root() -> Path:
    """A directory D with D/torchair = the wheel's torch_npu/dynamo/torchair (Python files)."""
    missing = _missing_protobuf()
    if missing:
        pytest.skip(missing)
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory / ".torchair.lock"), timeout=900):
        wheel = _fetch_wheel(directory)
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
