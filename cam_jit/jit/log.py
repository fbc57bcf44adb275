"""User-visible messages of the JIT engine.

Messages go to ``logging.getLogger("cam_jit")``. When neither that logger nor any ancestor has a
handler (a plain script), they are printed as one ``cam_jit: ...`` line on stderr instead, so that
a first-use compile is visible by default. Setting the ``cam_jit`` logger's own level above a
message's level silences it in both cases.
"""
from __future__ import annotations

import logging
import sys

logger = logging.getLogger("cam_jit")


def _emit(level: int, msg: str, *args: object) -> None:
    if logger.hasHandlers():
        logger.log(level, msg, *args)
    elif level >= logger.level:
        print("cam_jit: " + (msg % args if args else msg), file=sys.stderr, flush=True)


def info(msg: str, *args: object) -> None:
    """Report progress (compiles, waits) at INFO."""
    _emit(logging.INFO, msg, *args)


def warning(msg: str, *args: object) -> None:
    """Report a problem that cam_jit recovers from (e.g. a corrupted cache entry)."""
    _emit(logging.WARNING, msg, *args)
