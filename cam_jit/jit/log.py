"""User-visible messages of the JIT engine.

Messages go to ``logging.getLogger("cam_jit")``. When neither that logger nor any ancestor has a
handler (a plain script), they are printed as one ``cam_jit: ...`` line on stderr instead, so that
a first-use compile is visible by default. Setting the ``cam_jit`` logger's own level above a
message's level silences it in both cases.

Build steps (:func:`step`) are INFO records when logging is configured; otherwise they rewrite
one live line on stderr if it is a terminal, and print nothing if it is not (a log file or CI
output gets only the "compiling" and "built" lines).
"""
from __future__ import annotations

import logging
import sys
import threading

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


_live_lock = threading.Lock()
_live = False  # a live line is on stderr and needs clearing


def step(msg: str, live_only: bool = False) -> None:
    """Report one build step: an INFO record when logging is configured (unless ``live_only``: a
    mere clock tick), else the live stderr line on a terminal, else nothing."""
    global _live
    if logger.hasHandlers():
        if not live_only:
            logger.info(msg)
        return
    if logging.INFO < logger.level or not _stderr_is_tty():
        return
    with _live_lock:
        sys.stderr.write("\r\x1b[Kcam_jit: " + msg)
        sys.stderr.flush()
        _live = True


def step_done() -> None:
    """Clear the live line, if any, so that the next message starts on a clean line."""
    global _live
    with _live_lock:
        if _live:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            _live = False


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
