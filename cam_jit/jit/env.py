"""Environment variables of the JIT engine, read at call time (never cached at import).

- ``CAM_JIT_CACHE_DIR``: cache root (default ``~/.cache/cam_jit``).
- ``CAM_JIT_DISABLE_JIT``: ``1``/``true``/``yes``/``on`` forbids compiling; a cache miss raises
  :class:`cam_jit.jit.CacheMissError`.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_VAR = "CAM_JIT_CACHE_DIR"
DISABLE_JIT_VAR = "CAM_JIT_DISABLE_JIT"


def cache_dir() -> Path:
    """The cache root: ``$CAM_JIT_CACHE_DIR`` or ``~/.cache/cam_jit`` (not created here)."""
    value = os.environ.get(CACHE_DIR_VAR)
    if value:
        return Path(value).expanduser().absolute()
    return Path.home() / ".cache" / "cam_jit"


def jit_disabled() -> bool:
    """Whether ``CAM_JIT_DISABLE_JIT`` forbids compiling in this process."""
    return os.environ.get(DISABLE_JIT_VAR, "").strip().lower() in ("1", "true", "yes", "on")
