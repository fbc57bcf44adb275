"""Progress of a running build: ninja's ``[n/m]`` steps, reported while the compiler works.

``cpp_extension.load`` runs ninja with its output captured, so nothing would be seen between
"compiling" and "built" (tens of seconds on a small machine). :class:`BuildProgress` watches the
build directory instead: ninja lists every step in ``build.ninja`` and appends one line to
``.ninja_log`` as each step finishes. A daemon thread polls both (no subprocess, no patching of
torch) and reports each finished step through :func:`cam_jit.jit.log.step`: a ``cam_jit`` logger
record when logging is configured, else a live single line on a terminal, else nothing.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import List, Optional

from cam_jit.jit import log

POLL_SECONDS = 0.25
NINJA_FILE, NINJA_LOG = "build.ninja", ".ninja_log"


def planned_steps(build_dir: Path) -> List[str]:
    """The outputs of the steps ``build.ninja`` plans (objects, then the library), [] before it exists."""
    try:
        text = (build_dir / NINJA_FILE).read_text()
    except OSError:
        return []
    return [line[len("build "):].split(":", 1)[0] for line in text.splitlines() if line.startswith("build ")]


def finished_steps(build_dir: Path) -> List[str]:
    """The outputs ninja has recorded as finished, in order (``.ninja_log``: start, end, mtime, output, hash)."""
    try:
        lines = (build_dir / NINJA_LOG).read_text().splitlines()
    except OSError:
        return []
    return [fields[3] for fields in (line.split("\t") for line in lines if not line.startswith("#"))
            if len(fields) >= 4]


class BuildProgress:
    """Context manager reporting the steps of the build in ``build_dir`` while it runs.

    ``with BuildProgress(tmp, "cpu"): cpp_extension.load(..., build_directory=str(tmp))``
    """

    def __init__(self, build_dir: Path, backend: str, poll: float = POLL_SECONDS):
        self.build_dir, self.backend, self.poll = build_dir, backend, poll
        self.reported: List[str] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = 0.0

    def __enter__(self) -> "BuildProgress":
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="cam_jit-build-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._report_new(live_only=exc[0] is not None)
        log.step_done()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            self._report_new(live_only=False)

    def _report_new(self, live_only: bool) -> None:
        total = len(planned_steps(self.build_dir))
        done = finished_steps(self.build_dir)
        total = max(total, len(done))
        prefix = f"building the {self.backend} backend"
        for output in done[len(self.reported):]:
            self.reported.append(output)
            if not live_only:
                log.step(f"{prefix}: [{len(self.reported)}/{total}] {Path(output).name}")
        if total and not live_only:
            log.step(f"{prefix}: [{len(self.reported)}/{total}] steps done, "
                     f"{time.monotonic() - self._start:.0f} s", live_only=True)
