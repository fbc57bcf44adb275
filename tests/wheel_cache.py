"""The torch-npu wheel the NPU-side tests read headers and TorchAir's Python code from.

It is fetched once with ``pip download --no-deps`` (never installed: its backend autoload would
break ``import torch``) into the test wheel cache: ``$CAM_JIT_TEST_WHEEL_DIR`` if set, else
``cam_jit-test-wheels`` under pytest's cache directory (``.pytest_cache/d/`` of the checkout;
tests/conftest.py exports the resolved path so subprocesses share it). Never the user's home. A
file lock and atomic renames make concurrent fetches safe; without registry access the calling
test skips and says why.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from filelock import FileLock

WHEEL_DIR_VAR = "CAM_JIT_TEST_WHEEL_DIR"
PYTEST_CACHE_KEY = "cam_jit-test-wheels"
TORCH_NPU_VERSION = torch.__version__.split("+")[0]  # torch_npu releases follow torch's version
_REPO = Path(__file__).resolve().parent.parent


def wheel_dir() -> Path:
    """The test wheel cache (see the module docstring); created if missing."""
    value = os.environ.get(WHEEL_DIR_VAR)
    directory = Path(value).expanduser() if value else _REPO / ".pytest_cache" / "d" / PYTEST_CACHE_KEY
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def torch_npu_wheel() -> Path:
    """The cached torch-npu wheel matching torch, downloaded first if absent."""
    directory = wheel_dir()
    pattern = f"torch_npu-{TORCH_NPU_VERSION}-*.whl"
    with FileLock(str(directory / ".download.lock"), timeout=900):
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
                pytest.skip(f"cannot fetch torch-npu=={TORCH_NPU_VERSION} into {directory} (no network access "
                            f"to the package registry? set {WHEEL_DIR_VAR} to a directory holding it): {tail}")
            os.replace(fetched[-1], directory / fetched[-1].name)
            return directory / fetched[-1].name
