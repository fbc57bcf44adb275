"""Discovery of the C++ compiler and ninja, without running them unless asked.

The compiler is what ``torch.utils.cpp_extension`` will use: ``$CXX`` or ``c++``, resolved on
``PATH``. Its ``--version`` output is part of the cache key, but running it on every warm load
would start a subprocess, so the output is memoised under ``<cache>/compilers/`` keyed by the
binary's identity (path, real path, size, mtime): a memo of a probe of the compiler, not of our
sources. Upgrading or replacing the compiler changes its identity, so it is probed again; copying
the cache to a machine with the same compiler package (same size and mtime) keeps the memo valid.
Finding the compiler costs one ``access`` per PATH directory and one ``stat`` (every warm load).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from cam_jit.jit import trust
from cam_jit.jit.errors import ToolchainError

COMPILER_HINT = "install one (e.g. `apt-get install g++`) or set CXX to a C++ compiler"
NINJA_HINT = "`pip install ninja` (or `apt-get install ninja-build`)"


@dataclass(frozen=True)
class Compiler:
    """A resolved C++ compiler: the absolute path found on PATH and ``stat`` facts of the file it
    resolves to (device, inode, size, mtime, ctime: any replacement or rewrite changes them)."""

    path: str
    facts: str

    @property
    def realpath(self) -> str:
        return os.path.realpath(self.path)

    @property
    def identity(self) -> str:
        """Hash of (path, real path, size, mtime): the key of the ``--version`` memo, stable across
        machines with the same compiler package."""
        _, _, size, mtime, _ = (int(f) for f in self.facts.split())
        facts = [self.path, self.realpath, size, mtime]
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:24]


def requested_compiler() -> str:
    """The compiler cpp_extension will run: ``$CXX`` or ``c++``."""
    return os.environ.get("CXX") or "c++"


def find_compiler() -> Optional[Compiler]:
    """Resolve the compiler on PATH as ``shutil.which`` does (one ``access`` per PATH directory and
    one ``stat``: this runs on every warm load); None if absent."""
    name = requested_compiler()
    if os.sep in name:
        candidates = [name]
    else:
        directories = os.environ.get("PATH", os.defpath).split(os.pathsep)
        candidates = [os.path.join(directory, name) for directory in dict.fromkeys(directories)]
    executable = list(map(os.access, candidates, [os.X_OK] * len(candidates)))
    for path, ok in zip(candidates, executable):
        if ok:
            try:
                st = os.stat(path)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                facts = f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"
                return Compiler(os.path.abspath(path), facts)
    return None


def compiler_version(compiler: Compiler, cache_root: Path, probe: bool) -> Optional[str]:
    """The compiler's ``--version`` output, from the memo under ``cache_root``.

    On a memo miss, returns None if ``probe`` is false; otherwise runs the compiler once and
    records the answer (best effort: a read-only cache just is not updated).
    """
    memo = cache_root / "compilers" / f"{compiler.identity}.json"
    try:
        return json.loads(memo.read_text())["version"]
    except (OSError, ValueError, KeyError):
        if not probe:
            return None
    env = dict(os.environ, LC_ALL="C")
    try:
        out = subprocess.run([compiler.path, "--version"], capture_output=True, text=True,
                             env=env, timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"the C++ compiler {compiler.path} does not run (`{compiler.path} "
                             f"--version` failed: {e}); {COMPILER_HINT}") from None
    version = out.strip()
    record = {"path": compiler.path, "realpath": compiler.realpath, "version": version}
    try:
        trust.make_dirs(memo.parent)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, memo)
    except OSError:
        pass
    return version


def find_ninja() -> Optional[str]:
    """Path of ninja: on PATH, else the binary of the ``ninja`` Python package; None if absent."""
    path = shutil.which("ninja")
    if path:
        return path
    if importlib.util.find_spec("ninja") is None:
        return None
    import ninja

    candidate = os.path.join(ninja.BIN_DIR, "ninja")
    return candidate if os.access(candidate, os.X_OK) else None


def missing_tool(compiler: Optional[Compiler], ninja: Optional[str]) -> Optional[str]:
    """Why a build is impossible with these tools (a sentence with the fix), or None."""
    if compiler is None:
        where = "$CXX" if os.environ.get("CXX") else "the default, set CXX to change it"
        return (f"no C++ compiler: {requested_compiler()!r} ({where}) was not found on PATH; "
                f"{COMPILER_HINT}")
    if ninja is None:
        return f"ninja was not found on PATH nor in the `ninja` Python package; {NINJA_HINT}"
    return None


@contextlib.contextmanager
def ninja_on_path(ninja: str) -> Iterator[None]:
    """Make ``ninja`` (which cpp_extension runs by name) resolvable on PATH for the duration."""
    directory = os.path.dirname(ninja)
    old = os.environ.get("PATH", "")
    if directory in old.split(os.pathsep):
        yield
        return
    os.environ["PATH"] = directory + (os.pathsep + old if old else "")
    try:
        yield
    finally:
        os.environ["PATH"] = old
