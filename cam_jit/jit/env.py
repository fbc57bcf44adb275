"""Environment variables of the JIT engine, read at call time (never cached at import).

- ``CAM_JIT_CACHE_DIR``: cache root (default ``~/.cache/cam_jit``).
- ``CAM_JIT_DISABLE_JIT``: ``1``/``true``/``yes``/``on`` forbids compiling; a cache miss raises
  :class:`cam_jit.jit.CacheMissError`.
- ``CAM_JIT_BUILD_LOCK_TIMEOUT``: seconds a process waits for another one's build of the same
  entry before raising (default 1800).
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_VAR = "CAM_JIT_CACHE_DIR"
DISABLE_JIT_VAR = "CAM_JIT_DISABLE_JIT"
LOCK_TIMEOUT_VAR = "CAM_JIT_BUILD_LOCK_TIMEOUT"
LOCK_TIMEOUT_DEFAULT = 1800.0


def cache_dir() -> Path:
    """The cache root: ``$CAM_JIT_CACHE_DIR`` or ``~/.cache/cam_jit`` (not created here)."""
    return Path(cache_root())


def cache_root() -> str:
    """:func:`cache_dir` as a string (no pathlib: this runs on every warm load)."""
    value = os.environ.get(CACHE_DIR_VAR)
    if value:
        value = os.path.expanduser(value)
        return value if os.path.isabs(value) else os.path.join(os.getcwd(), value)
    return os.path.join(os.path.expanduser("~"), ".cache", "cam_jit")


def jit_disabled() -> bool:
    """Whether ``CAM_JIT_DISABLE_JIT`` forbids compiling in this process."""
    return os.environ.get(DISABLE_JIT_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def lock_timeout() -> float:
    """``CAM_JIT_BUILD_LOCK_TIMEOUT`` in seconds (default 1800); ValueError if not positive."""
    raw = os.environ.get(LOCK_TIMEOUT_VAR, "").strip()
    if not raw:
        return LOCK_TIMEOUT_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{LOCK_TIMEOUT_VAR}: expected a positive number of seconds, got {raw!r}")
    return value
