"""opp package tooling behind ``python -m cam_jit opp``: locate an installed (prebuilt) package,
install a ``.run`` package into a user-owned vendor directory, build one from a kernel source tree.

A custom opp ``.run`` package (a self-extracting installer) installs with
``<package>.run --quiet --install-path=<dir>`` into ``<dir>/vendors/<vendor>/`` and leaves a
``bin/set_env.bash`` there that adds the vendor to ``ASCEND_CUSTOM_OPP_PATH``. Building runs the
source tree's own build script (UMDK's ``build/cam/build.sh``, else a ``build.sh`` at the top;
extra arguments are passed through, e.g. UMDK's ``-q`` for the W4A8 FusedDeepMoe, docs/semantics.md §7.4,
or ``-r`` for the ``.run`` package alone) and then looks for the ``.run`` file it produced (UMDK
writes it under ``output/cam/comm_operator/run/``). All three
need CANN (the package's kernels, op-info and aclnn library only work with it) and fail with a
clear message when it is missing.
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from cam_jit.ascend import discover, opp, registry

DEFAULT_INSTALL_DIR = Path.home() / ".local" / "share" / "cam_jit" / "opp"
INSTALL_DIR_VAR = "CAM_JIT_OPP_DIR"
BUILD_SCRIPTS = (Path("build") / "cam" / "build.sh", Path("build.sh"))  # UMDK's first
RUN_DIRS = (Path("output") / "cam" / "comm_operator" / "run",)  # where UMDK's build puts the .run
RUN_ONLY_FLAG = "-r"
RUN_ONLY_HINT = (f"UMDK's build/cam/build.sh also builds the pybind wheel, which cam_jit does not "
                 f"use; `python -m cam_jit opp build <tree> -- {RUN_ONLY_FLAG}` builds the .run "
                 "package alone")


class OppError(RuntimeError):
    """An opp tool failed; the message says why and what to do."""


def _now_ns() -> int:
    """A start time to compare file mtimes with: now minus one second, because file timestamps
    come from a coarser clock than time.time_ns() and may read slightly earlier."""
    return time.time_ns() - 1_000_000_000


def install_dir(path: Optional[Path] = None) -> Path:
    """Where packages are installed: ``path``, else ``$CAM_JIT_OPP_DIR``, else
    ``~/.local/share/cam_jit/opp``."""
    return Path(path or os.environ.get(INSTALL_DIR_VAR) or DEFAULT_INSTALL_DIR).expanduser().absolute()


def require_cann(action: str) -> discover.Cann:
    """The CANN install, or OppError saying that ``action`` needs it and how to get it."""
    cann = discover.find_cann()
    if cann.home is None:
        raise OppError(f"cannot {action}: {cann.problem}")
    return cann


@dataclass(frozen=True)
class Located:
    """An installed vendor directory holding registry operators."""

    vendor: opp.Vendor
    ops: List[str]  # registry operator names found in its op-info
    active: bool  # in CANN's search order right now
    activate: str  # the shell command that makes it active


def activation(vendor_dir: Path) -> str:
    """The shell command that puts ``vendor_dir`` first in the search order."""
    script = vendor_dir / "bin" / "set_env.bash"
    if script.is_file():
        return f"source {script}"
    return f"export {opp.CUSTOM_OPP_VAR}={vendor_dir}${{{opp.CUSTOM_OPP_VAR}:+:${opp.CUSTOM_OPP_VAR}}}"


def locate(extra_dirs: Sequence[Path] = ()) -> List[Located]:
    """Vendors with CAM operators: those CANN searches, then vendor directories under
    ``extra_dirs`` and the cam_jit install directory (``<dir>/vendors/*``) that it does not."""
    cann = discover.find_cann()
    vendors = opp.find_vendors(cann)
    active = {v.path.resolve() for v in vendors.searched}
    candidates = list(vendors.searched)
    for base in [*extra_dirs, install_dir()]:
        for path in sorted(Path(base).glob("vendors/*")):
            if path.is_dir() and path.resolve() not in active:
                candidates.append(opp.vendor_at(path, f"found under {base}"))
                active.add(path.resolve())
    found = []
    searched = {v.path.resolve() for v in vendors.searched}
    for vendor in candidates:
        names = [e.name for e in registry.ops().values() if opp.op_info(vendor, e.ge_op) is not None]
        if names:
            found.append(Located(vendor, names, vendor.path.resolve() in searched,
                                 activation(vendor.path)))
    return found


def install_run(run_file: Path, target: Optional[Path] = None, timeout: float = 1800) -> List[Path]:
    """Install the ``.run`` package into ``<target>/vendors/`` (default :func:`install_dir`);
    returns the vendor directories it created or updated."""
    run_file = Path(run_file).expanduser().absolute()
    if not run_file.is_file():
        raise OppError(f"cannot install {run_file}: no such file")
    require_cann(f"install {run_file.name}")
    target = install_dir(target)
    target.mkdir(parents=True, exist_ok=True)
    if not os.access(target, os.W_OK):
        raise OppError(f"cannot install into {target}: not writable; pass a directory you own")
    start = _now_ns()
    cmd = ["bash", str(run_file), "--quiet", f"--install-path={target}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OppError(f"installing {run_file.name} did not finish in {timeout:.0f} s: "
                       f"{' '.join(cmd)}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise OppError(f"installing {run_file.name} failed (exit {proc.returncode}): "
                       f"{' '.join(cmd)}\n{tail}")
    created = [p for p in sorted(target.glob("vendors/*"))
               if p.is_dir() and any(f.stat().st_mtime_ns >= start for f in p.rglob("*"))]
    if not created:
        raise OppError(f"{run_file.name} exited 0 but created no vendor directory under "
                       f"{target}/vendors; is it a custom opp package?")
    return created


def find_built_packages(tree: Path, since_ns: int) -> List[Path]:
    """``.run`` files written at or after ``since_ns``, newest first: those in UMDK's output
    directory, else any under ``tree``."""
    for sub in (*RUN_DIRS, Path(".")):
        found = (tree / sub).glob("*.run") if sub in RUN_DIRS else tree.rglob("*.run")
        runs = [p for p in found if p.is_file() and p.stat().st_mtime_ns >= since_ns]
        if runs:
            return sorted(runs, key=lambda p: p.stat().st_mtime_ns, reverse=True)
    return []


def build_script(tree: Path) -> Optional[Path]:
    """The tree's build script: UMDK's ``build/cam/build.sh``, else ``build.sh``; None if neither."""
    return next((tree / s for s in BUILD_SCRIPTS if (tree / s).is_file()), None)


def run_only_hint(tree: Path, args: Sequence[str]) -> Optional[str]:
    """The advice to pass ``-r`` when building with UMDK's script without it, else None."""
    tree = Path(tree).expanduser().absolute()
    umdk = build_script(tree) == tree / BUILD_SCRIPTS[0]
    return RUN_ONLY_HINT if umdk and RUN_ONLY_FLAG not in args else None


def build_from_source(tree: Path, args: Sequence[str] = (), timeout: float = 7200) -> List[Path]:
    """Run the tree's build script (:func:`build_script`) with ``args`` in ``tree`` and return the
    ``.run`` packages it produced. Without SHMEM the SHMEM-only operators are left out of the build
    (docs/semantics.md §7.4)."""
    tree = Path(tree).expanduser().absolute()
    script = build_script(tree)
    if script is None:
        raise OppError(f"cannot build from {tree}: neither {' nor '.join(map(str, BUILD_SCRIPTS))} in it "
                       "(expected the kernel source tree's own build script, e.g. a UMDK checkout)")
    require_cann(f"build the opp package in {tree}")
    start = _now_ns()
    try:
        proc = subprocess.run(["bash", str(script), *args], cwd=tree, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OppError(f"{script} {' '.join(args)} did not finish in {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise OppError(f"{script} {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
    runs = find_built_packages(tree, start)
    if not runs:
        raise OppError(f"{script} {' '.join(args)} succeeded but wrote no .run package under "
                       f"{tree} (UMDK writes it to {RUN_DIRS[0]}/)")
    return runs


def shmem_note() -> Optional[str]:
    """Why a build here would leave operators out (SHMEM absent), or None."""
    shmem = discover.find_shmem()
    if shmem.problem is None:
        return None
    dropped = [e.name for e in registry.ops().values() if e.requires_shmem]
    return (f"{shmem.problem}. Operators that need SHMEM are left out of such a build: "
            f"{', '.join(dropped)}")
