"""A build's compiler processes die with the process that builds.

``torch.utils.cpp_extension`` runs ``ninja`` by name; the engine puts a wrapper named ``ninja``
first on PATH for the build (:func:`ninja_wrapper`, written into the build's temp dir). The
wrapper makes itself the leader of a new process group, asks the kernel to send it SIGTERM when
its parent (the building process) dies, and runs the real ninja. On that SIGTERM (or when the
building process is already gone) it passes SIGTERM to ninja, which stops every job it runs (each
job is a process group of its own, so ninja is the one that can reach them), then kills its own
group. It records the group id, so the builder can stop the build itself when it is interrupted
(:func:`kill_build`).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

WRAPPER_DIR = "ninja-reaper"
PGID_FILE = "ninja.pgid"

_WRAPPER = '''#!{python} -S
# cam_jit: runs ninja in a process group that dies with the building process (cam_jit/jit/reaper.py)
import ctypes, os, signal, subprocess, sys, threading
builder, ninja, stopping = {builder}, None, False
os.setpgid(0, 0)
def kill_group():
    os.killpg(0, signal.SIGKILL)
def stop(*_):
    global stopping
    stopping = True
    threading.Timer(5, kill_group).start()  # in case ninja does not stop
    if ninja is None:
        kill_group()
    ninja.send_signal(signal.SIGTERM)  # ninja stops its jobs (each runs in a process group of its own)
signal.signal(signal.SIGTERM, stop)
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != builder:
    kill_group()
with open({pgid_file!r}, "w") as f:
    f.write(str(os.getpgid(0)))
ninja = subprocess.Popen([{ninja!r}, *sys.argv[1:]])
if stopping:
    stop()
code = ninja.wait()
if stopping:
    kill_group()
sys.exit(code)
'''


def ninja_wrapper(ninja: str, build_dir: Path) -> str:
    """Writes the wrapper for the real `ninja` into `build_dir`; returns its path (named
    ``ninja``, to be put first on PATH for the build)."""
    folder = build_dir / WRAPPER_DIR
    folder.mkdir(exist_ok=True)
    wrapper = folder / "ninja"
    wrapper.write_text(_WRAPPER.format(python=sys.executable, builder=os.getpid(), ninja=ninja,
                                       pgid_file=str(build_dir / WRAPPER_DIR / PGID_FILE)))
    wrapper.chmod(0o700)
    return str(wrapper)


def kill_build(build_dir: Path) -> None:
    """Stops the build that ran in `build_dir` (its wrapper, ninja and their jobs), if one is
    recorded and still running (best effort)."""
    try:
        pgid = int((build_dir / WRAPPER_DIR / PGID_FILE).read_text())
        os.killpg(pgid, signal.SIGTERM)
    except (OSError, ValueError):
        pass


def process_state(pid: int) -> str:
    """'running', 'stopped' or 'exited' for a process id (as /proc shows it), for messages."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "exited"
    return {b"T": "stopped", b"t": "stopped", b"Z": "exited", b"X": "exited"}.get(state, "running")
