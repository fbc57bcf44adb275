"""Strict validation (docs/semantics.md §0.6): the NPU kernels' own limits, checked on any backend so a
user learns on CPU what the NPU would reject.

Enabled per call with the public functions' `strict=True`, or for the process with
`cam_jit.set_strict(True)` or the environment variable `CAM_JIT_STRICT=1`.
"""
from __future__ import annotations

import os
from typing import Optional

_ENV = "CAM_JIT_STRICT"
_process_default: Optional[bool] = None


def set_strict(enabled: bool) -> None:
    """Turn strict validation on or off for every later call in this process (overrides
    CAM_JIT_STRICT; a call's own `strict=` argument overrides both)."""
    global _process_default
    if not isinstance(enabled, bool):
        raise TypeError(f"set_strict: argument 'enabled': expected a bool, got {type(enabled).__name__}")
    _process_default = enabled


def strict_enabled(explicit: Optional[bool] = None) -> bool:
    """Whether a call runs strict checks: its `strict=` argument if given, else set_strict's
    setting, else CAM_JIT_STRICT (1/true/yes/on)."""
    if explicit is not None:
        return bool(explicit)
    if _process_default is not None:
        return _process_default
    return os.environ.get(_ENV, "").strip().lower() in ("1", "true", "yes", "on")
