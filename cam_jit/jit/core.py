"""The build engine: spec -> key -> verified entry, or lock -> build in temp dir -> publish -> load.

Cache layout (``<cache>`` = :func:`cam_jit.jit.env.cache_dir`)::

    <cache>/compilers/<identity>.json           memo of `<compiler> --version` (toolchain.py)
    <cache>/<backend>/memo-<place>              the warm-load memo (memo.py)
    <cache>/<backend>/warm-<place>              the warm record of a registered backend (warm.py)
    <cache>/<backend>/<content key>/
        <compiler key>/                         a published entry: the library + manifest.json
        <compiler key>.lock                     flock of that entry (kept, never deleted)
        <compiler key>.build.log                full output of the last failed build
        .tmp-<compiler key>-<pid>-<random>/     a build in progress (or left by a killed one)

:func:`load` first asks the backend's warm record (:mod:`cam_jit.jit.warm`), which vouches for the
entry with ``stat`` calls before any spec is built. The warm path takes no lock, starts no subprocess
and hashes nothing: ``stat`` calls show that the
sources, the compiler and the library are those the memo recorded (:mod:`cam_jit.jit.memo`), the
entry passes the trust rules (:mod:`cam_jit.jit.trust`), and the library is dlopened, so it works
on a read-only cache without compiler or ninja. Otherwise the content key comes from hashing the
sources, the compiler's version from its memo, and the library is checked against its manifest
(size and sha256) before it is loaded. A build runs under the entry's flock (released by the
kernel if the holder dies), in a fresh temp dir next to the entry, and becomes visible through one
atomic ``os.rename`` of that dir: a killed build leaves only a temp dir, which the next builder
removes under the lock. A corrupted entry (size or sha256 not as in its manifest) is logged and
rebuilt.

Two consequences worth knowing: the building process dlopens the library from the temp dir (that
is cpp_extension's load check), so its ``torch.ops.loaded_libraries`` names the temp path; and a
compiler replaced since the memo was written is probed once (one subprocess) before use.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from cam_jit.jit import env, log, memo, reaper, toolchain, trust, warm
from cam_jit.jit.backends import BACKENDS, backend_spec, default_backend
from cam_jit.jit.errors import BuildError, CacheMissError, JitError, ToolchainError
from cam_jit.jit.progress import BuildProgress
from cam_jit.jit.spec import (CACHE_FORMAT, BuildSpec, compiler_inputs, compiler_key,
                              declared_inputs, digest, file_digests)

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
WAIT_LOG_FIRST = 10.0  # seconds a waiter waits silently before saying what it waits for
WAIT_LOG_EVERY = 30.0  # then it repeats the message this often
MAX_ERRORS_SHOWN = 3  # compiler `error:` lines quoted in a BuildError (with 2 lines of context)

_ERROR_LINE = re.compile(r"(\berror:|undefined reference|cannot find -l)")


@dataclass(frozen=True)
class LoadedLibrary:
    """What :func:`load` loaded: the backend, the library file, its cache entry directory, and
    whether this process compiled it."""

    backend: str
    library: Path
    entry: Path
    built: bool


_LOADED: Dict[Optional[str], LoadedLibrary] = {}
_LOAD_LOCK = threading.Lock()


def load(backend: Optional[str] = None) -> LoadedLibrary:
    """Build if needed and load the shared library of ``backend`` (default: this machine's, see
    :func:`cam_jit.jit.backends.default_backend`). Memoised per process: later calls are a dict
    lookup. Raises :class:`JitError` subclasses with the cause and the fix."""
    hit = _LOADED.get(backend)
    if hit is not None:
        return hit
    with _LOAD_LOCK:
        name = backend or default_backend()
        hit = _LOADED.get(name)
        if hit is None:
            hit = _load_backend(name)
        _LOADED[name] = _LOADED[backend] = hit
    return hit


def _load_backend(name: str) -> LoadedLibrary:
    """:func:`load` of a registered backend: by its warm record if it vouches for the entry
    (:mod:`cam_jit.jit.warm`: no spec built, no PATH search), else by :func:`load_spec`."""
    registered = BACKENDS.get(name)
    factory = registered.make_spec if registered is not None and registered.unavailable() is None else None
    if factory is not None:
        root = env.cache_root()
        vouched = warm.vouched(root, name, factory)
        if vouched is not None:
            library = f"{vouched[0]}{os.sep}{vouched[1]}"
            try:
                _dlopen_path(library)
                path = Path(library)
                return LoadedLibrary(name, path, path.parent, built=False)
            except OSError:
                pass  # checked in full below, then rebuilt once if it still does not load
    spec = backend_spec(name)
    return _load(spec, factory)


def load_spec(spec: BuildSpec) -> LoadedLibrary:
    """Load ``spec``'s library from the cache, building and publishing it first if needed (not
    memoised; :func:`load` is the memoised entry point)."""
    return _load(spec, None)


def _load(spec: BuildSpec, factory) -> LoadedLibrary:
    """:func:`load_spec`; ``factory``: the registered function that made ``spec``, whose warm
    record (:mod:`cam_jit.jit.warm`) is written when a memo vouches for the entry."""
    root = env.cache_dir()
    declared = declared_inputs(spec)
    known = memo.read(root, spec, declared)
    compiler = toolchain.find_compiler()
    vouched = memo.vouched(root, spec.backend, known, compiler and _facts(compiler), (MANIFEST,))
    if vouched is not None:
        try:
            loaded = _dlopen(spec, *vouched, built=False)
        except OSError:
            pass  # checked in full below, then rebuilt once if it still does not load
        else:
            if factory is not None and known.settled:
                warm.record(str(root), spec, factory, known.files, compiler,
                            (known.content_key, *known.entry[:2]), known.entry[2])
            return loaded
    found = _locate(spec, root, declared, known, compiler)
    if found.entry is not None:
        loaded = _load_entry(spec, found.entry, found.manifest, built=False, rebuild=_rebuilder(spec, found))
        if not loaded.built:
            _remember(found, known, loaded)
        return loaded
    if found.blocker is not None:
        raise _cannot_build(spec, found)
    version = found.version or toolchain.compiler_version(compiler, root, probe=True)
    entry = found.content_dir / compiler_key(compiler.path, version)
    loaded = _build_locked(spec, entry, found.inputs, compiler_inputs(compiler.path, version),
                           found.ninja)
    memo.record(root, spec.backend, known, found.content_dir.name)
    return loaded


def _facts(compiler: toolchain.Compiler) -> str:
    return f"{compiler.path}\t{compiler.facts}"


def _remember(found: "_Located", known: memo.Known, loaded: LoadedLibrary) -> None:
    """Record the memo of a verified load: the content key, and the entry with its library's
    identity when it is this compiler's entry and the library was hashed while settled."""
    entry = None
    if found.identity is not None and found.compiler is not None and \
            loaded.entry.name == compiler_key(found.compiler.path, found.version):
        entry = (_facts(found.compiler), loaded.entry.name, loaded.library.name, found.identity)
    memo.record(found.root, loaded.backend, known, found.content_dir.name, entry)


def _rebuilder(spec: BuildSpec, found: "_Located"):
    """How to rebuild the located entry if it does not load: a function of the load error that
    returns the rebuilt library, or None when this process cannot build (JIT disabled, no ninja)
    or the entry is another compiler's."""
    def rebuild(error: BaseException) -> Optional[LoadedLibrary]:
        if found.blocker is not None or env.jit_disabled():
            return None
        ninja = toolchain.find_ninja()
        if ninja is None:
            return None
        log.warning("cache entry %s matches its manifest but does not load (%s); rebuilding it once",
                    found.entry, error)
        return _build_locked(spec, found.entry, found.inputs,
                             compiler_inputs(found.compiler.path, found.version), ninja, discard=True)

    return rebuild


def status(spec: BuildSpec) -> Tuple[bool, str]:
    """Whether ``spec`` can be loaded here without error, and how (for ``doctor``)."""
    root = env.cache_dir()
    declared = declared_inputs(spec)
    found = _locate(spec, root, declared, memo.read(root, spec, declared), toolchain.find_compiler())
    if found.entry is not None:
        return True, f"ready: cache entry {found.entry}"
    if found.blocker is None:
        return True, "compiles on first use (C++ compiler and ninja found)"
    return False, f"{found.blocker}; no prebuilt entry under {found.content_dir}"


@dataclass
class _Located:
    """Outcome of looking for a usable entry without building (see :func:`_locate`)."""

    root: Path
    inputs: Dict[str, Any]
    content_dir: Path
    compiler: Optional[toolchain.Compiler]
    version: Optional[str]
    rejected: List[str]
    entry: Optional[Path] = None
    manifest: Optional[Dict[str, Any]] = None
    identity: Optional[str] = None  # the entry's library's, if hashed while settled (memo.identity)
    blocker: Optional[str] = None  # why this process cannot build, if it cannot
    ninja: Optional[str] = None


def _locate(spec: BuildSpec, root: Path, declared: Dict[str, Any], known: memo.Known,
            compiler: Optional[toolchain.Compiler]) -> _Located:
    """The entry of this exact compiler if it verifies (its library hashed); otherwise, when this
    process cannot build (JIT disabled, no compiler, no ninja), the newest verified entry of any
    compiler under the content key. Never runs a subprocess nor takes a lock. The content key
    comes from the memo (:mod:`cam_jit.jit.memo`) when the files are as they were last hashed,
    else from hashing them."""
    version = toolchain.compiler_version(compiler, root, probe=False) if compiler else None
    if version is not None and known.content_key is not None:
        entry = root / spec.backend / known.content_key / compiler_key(compiler.path, version)
        manifest, _, identity = _verify(entry)
        if manifest is not None and memo.agrees(manifest, known.content_key, spec, declared):
            return _Located(root, manifest["inputs"]["content"], entry.parent, compiler, version, [],
                            entry, manifest, identity)
    return _search(spec, root, {**declared, **file_digests(spec)}, compiler, version)


def _search(spec: BuildSpec, root: Path, inputs: Dict[str, Any],
            compiler: Optional[toolchain.Compiler], version: Optional[str]) -> _Located:
    """:func:`_locate` with the content inputs computed (files hashed)."""
    found = _Located(root, inputs, root / spec.backend / digest(inputs), compiler, version, [])
    if version is not None:
        entry = found.content_dir / compiler_key(compiler.path, version)
        found.manifest, found.identity = _check(entry, found.rejected)
        if found.manifest is not None:
            found.entry = entry
            return found
    if env.jit_disabled():
        found.blocker = f"compiling is disabled ({env.DISABLE_JIT_VAR}=1)"
    else:
        found.ninja = toolchain.find_ninja() if compiler else None
        found.blocker = toolchain.missing_tool(compiler, found.ninja)
    if found.blocker is not None:
        newest = _newest_verified(found.content_dir, found.rejected)
        if newest is not None:
            found.entry, found.manifest = newest
    return found


def verify_entry(entry: Path) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``(manifest, None)`` if ``entry`` holds a library matching its manifest (size and sha256),
    else ``(None, reason)``; the reason is None when the entry simply does not exist."""
    return _verify(entry)[:2]


def _verify(entry: Path) -> Tuple[Optional[Dict[str, Any]], Optional[str], Optional[str]]:
    """:func:`verify_entry` and the library's identity (:func:`cam_jit.jit.memo.identity`) when
    it verified, was settled and did not change while it was read (else None)."""
    try:
        manifest = json.loads((entry / MANIFEST).read_bytes())
        library = trust.library_name(manifest)
        trust.check_entry(env.cache_dir(), entry, (MANIFEST, library))
        with open(entry / library, "rb") as f:
            before = os.fstat(f.fileno())
            if before.st_size != manifest["size"]:
                return None, f"library is {before.st_size} bytes, its manifest says {manifest['size']}", None
            if hashlib.sha256(f.read()).hexdigest() != manifest["sha256"]:
                return None, "library sha256 differs from its manifest (corrupted)", None
            after = os.fstat(f.fileno())
    except FileNotFoundError:
        return None, ("incomplete (manifest or library missing)" if entry.exists() else None), None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"unreadable ({e})", None
    same = memo.identity(before) == memo.identity(after) and memo.settled(after)
    return manifest, None, memo.identity(after) if same else None


def _check(entry: Path, rejected: List[str]) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    manifest, reason, identity = _verify(entry)
    if reason is not None:
        log.warning("cache entry %s failed verification: %s", entry, reason)
        rejected.append(f"{entry}: {reason}")
    return manifest, identity


def _newest_verified(content_dir: Path, rejected: List[str]):
    """The newest verified entry under ``content_dir`` (any compiler), or None."""
    best = None
    try:
        candidates = [p for p in content_dir.iterdir() if p.is_dir() and p.name[0] != "."]
    except OSError:
        return None
    for entry in candidates:
        if any(r.startswith(f"{entry}:") for r in rejected):
            continue
        manifest = _check(entry, rejected)[0]
        if manifest is not None and (best is None or
                                     manifest["created_unix"] > best[1]["created_unix"]):
            best = (entry, manifest)
    return best


def _load_entry(spec: BuildSpec, entry: Path, manifest: Dict[str, Any], built: bool, rebuild=None):
    """dlopen the entry's library. If that fails (e.g. an undefined symbol), return
    ``rebuild(error)`` (see :func:`_rebuilder`) unless it is None or returns None."""
    try:
        return _dlopen(spec, entry, trust.library_name(manifest), built)
    except OSError as e:
        error = e.__cause__ or e
        rebuilt = rebuild(error) if rebuild is not None else None
        if rebuilt is not None:
            return rebuilt
        raise JitError(f"cannot load the {spec.backend} library {entry / manifest['library']}: {error}; "
                       f"remove it with `python -m cam_jit clean --backend {spec.backend}`") from e


def _dlopen(spec: BuildSpec, entry: Path, library: str, built: bool) -> LoadedLibrary:
    path = entry / library
    _dlopen_path(str(path))
    return LoadedLibrary(spec.backend, path, entry, built)


def _dlopen_path(path: str) -> None:
    """dlopen as ``torch.ops.load_library`` does (``ctypes``' flags: RTLD_NOW | RTLD_LOCAL; the path
    added to ``torch.ops.loaded_libraries``), without its ``realpath`` walk and ``ctypes.CDLL``
    class: the trust rules already refused symlinks below the cache root."""
    import _ctypes

    import torch

    try:
        _ctypes.dlopen(path, os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as e:
        raise OSError(f"Could not load this library: {path}") from e
    torch.ops.loaded_libraries.add(path)


def _cannot_build(spec: BuildSpec, found: _Located) -> JitError:
    lines = [f"cam_jit has no usable cache entry for the {spec.backend} backend and cannot "
             f"build one: {found.blocker}.",
             f"Looked under {found.content_dir} (content key {found.content_dir.name}: sources in "
             f"{spec.root}, flags, torch, Python and cam_jit versions)."]
    lines += [f"Rejected entry {r}" for r in found.rejected]
    lines.append(f"Pre-build it with `python -m cam_jit build --backend {spec.backend}` with the "
                 f"same torch, Python, cam_jit and CAM_JIT_CACHE_DIR={found.root} on a machine "
                 "with a C++ compiler and ninja.")
    error = CacheMissError if env.jit_disabled() else ToolchainError
    return error("\n".join(lines))


def _acquire(lock_path: Path, what: str):
    """Take the entry's flock, saying after WAIT_LOG_FIRST s (then every WAIT_LOG_EVERY s) what
    this process is waiting for; BuildError after the build-lock timeout (env.lock_timeout())."""
    from filelock import Timeout, UnixFileLock

    trust.lock_file(lock_path)
    lock = UnixFileLock(str(lock_path))
    start = time.monotonic()
    limit = env.lock_timeout()
    timeout = min(WAIT_LOG_FIRST, limit)
    while True:
        try:
            lock.acquire(timeout=timeout)
            return lock
        except Timeout:
            waited = time.monotonic() - start
            builds = _builds_in_progress(lock_path)
            if waited >= limit:
                raise BuildError(f"waited {waited:.0f} s for another process to finish building {what} "
                                 f"(lock {lock_path}; builds in progress: {builds}); giving up after "
                                 f"{env.LOCK_TIMEOUT_VAR}={limit:g} s. Stop or wait for that process, or "
                                 "raise the timeout") from None
            log.info("waiting %.0f s so far for another process to finish building %s "
                     "(lock %s, builds in progress: %s)", waited, what, lock_path, builds)
            timeout = min(WAIT_LOG_EVERY, limit - waited)


def _builds_in_progress(lock_path: Path) -> str:
    """The temp build dirs of the entry, each with its builder's pid and state, for messages."""
    found = []
    for path in sorted(lock_path.parent.glob(f"{TMP_PREFIX}{lock_path.stem}-*")):
        pid = path.name[len(f"{TMP_PREFIX}{lock_path.stem}-"):].split("-")[0]
        found.append(f"{path.name} (pid {pid}: {reaper.process_state(int(pid)) if pid.isdigit() else '?'})")
    return ", ".join(found) or "none yet"


def _discard(path: Path) -> None:
    """Remove an entry or temp dir; entries are first renamed out of the way atomically."""
    if not path.name.startswith(TMP_PREFIX):
        moved = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-discarded")
        os.rename(path, moved)
        path = moved
    shutil.rmtree(path, ignore_errors=True)


def _build_locked(spec: BuildSpec, entry: Path, inputs: Dict[str, Any],
                  compiler: Dict[str, str], ninja: str, discard: bool = False) -> LoadedLibrary:
    """Build `entry` under its lock unless another process published it meanwhile (`discard`:
    the published entry does not load, replace it)."""
    what = f"the {spec.backend} backend ({entry})"
    try:
        trust.make_dirs(entry.parent)
        trust.check_entry(env.cache_dir(), entry.parent, ())
        lock = _acquire(entry.with_name(entry.name + ".lock"), what)
    except OSError as e:
        raise BuildError(f"cannot build the {spec.backend} backend: the cache is not writable "
                         f"({e}); set CAM_JIT_CACHE_DIR to a writable directory, or pre-build "
                         f"with `python -m cam_jit build --backend {spec.backend}` as a user "
                         "who can write it") from None
    try:
        manifest, reason = verify_entry(entry)  # another process may have built it meanwhile
        if manifest is not None and not discard:
            return _load_entry(spec, entry, manifest, built=False)
        if reason is not None or manifest is not None:
            _discard(entry)
        for stale in entry.parent.glob(f"{TMP_PREFIX}{entry.name}-*"):
            _discard(stale)
        return _build(spec, entry, inputs, compiler, ninja)
    finally:
        lock.release()


def _build(spec: BuildSpec, entry: Path, inputs: Dict[str, Any], compiler: Dict[str, str],
           ninja: str) -> LoadedLibrary:
    """Compile into a temp dir (which also dlopens the library: the load check), write the
    manifest there, then publish with one ``os.rename``. Caller holds the entry's lock."""
    tmp = entry.with_name(f"{TMP_PREFIX}{entry.name}-{os.getpid()}-{os.urandom(4).hex()}")
    tmp.mkdir()  # unlike mkdtemp, honours the umask: a shared cache stays readable by others
    trust.owner_only_writes(tmp)
    log.info("compiling the %s backend (%d C++ file(s) from %s) into the cache at %s; "
             "this happens once per cache entry", spec.backend, len(spec.sources), spec.root,
             entry)
    start = time.monotonic()
    try:
        from torch.utils import cpp_extension

        try:
            with toolchain.ninja_on_path(reaper.ninja_wrapper(ninja, tmp)), BuildProgress(tmp, spec.backend):
                built = Path(cpp_extension.load(
                    name=spec.name, sources=[str(p) for p in spec.sources],
                    extra_cflags=list(spec.cflags), extra_ldflags=list(spec.ldflags),
                    extra_include_paths=[str(p) for p in spec.include_dirs],
                    build_directory=str(tmp), verbose=False, is_python_module=False))
        except (RuntimeError, OSError) as e:
            raise _build_error(spec, entry, e) from None
        seconds = time.monotonic() - start
        if file_digests(spec) != {k: inputs[k] for k in ("sources", "headers")}:
            raise BuildError(f"the {spec.backend} sources in {spec.root} changed while they were "
                             "being compiled; nothing was cached, run again")
        for path in tmp.iterdir():
            if path != built:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        data = built.read_bytes()
        now = time.time()
        manifest = {
            "format": CACHE_FORMAT, "backend": spec.backend, "library": built.name,
            "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "content_key": entry.parent.name, "compiler_key": entry.name,
            "inputs": {"content": inputs, "compiler": compiler},
            "created": datetime.datetime.fromtimestamp(now).isoformat(timespec="seconds"),
            "created_unix": now, "build_seconds": round(seconds, 3),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for path in (tmp / MANIFEST, built):
            trust.owner_only_writes(path)
        os.rename(tmp, entry)  # the commit point
    except BaseException:
        reaper.kill_build(tmp)  # compilers still running (an interrupt, an error)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    entry.with_name(entry.name + ".build.log").unlink(missing_ok=True)  # of an earlier failure
    log.info("built the %s backend in %.1f s: %s", spec.backend, seconds, entry / built.name)
    return LoadedLibrary(spec.backend, entry / built.name, entry, built=True)


def _build_error(spec: BuildSpec, entry: Path, error: BaseException) -> BuildError:
    """A short BuildError: first compiler errors with context, the failing command, the log."""
    text = str(error) + (f"\n{error.__cause__}" if error.__cause__ else "")
    log_path = entry.with_name(entry.name + ".build.log")
    try:
        log_path.write_text(text)
        where = str(log_path)
    except OSError as e:
        where = f"not saved ({e})"
    lines = text.splitlines()
    command = next((lines[i + 1] for i, line in enumerate(lines[:-1])
                    if line.startswith("FAILED:")), None)
    shown: List[str] = []
    errors = 0
    for i, line in enumerate(lines):
        if errors == MAX_ERRORS_SHOWN:
            break
        if _ERROR_LINE.search(line) and line != command and not line.startswith("FAILED:"):
            errors += 1
            context = [c for c in lines[i + 1:i + 3] if not _ERROR_LINE.search(c)
                       and not c.startswith("ninja:")]
            shown += [line] + context
    if not shown:  # not a compiler error (e.g. the library does not load): show the start
        shown = lines[:6]
    msg = [f"failed to build the {spec.backend} backend ({len(spec.sources)} C++ sources in "
           f"{spec.root}):"]
    msg += ["  " + line[:400] for line in shown]
    if command:
        msg.append(f"command: {command.strip()}")
    msg.append(f"full log: {where}")
    return BuildError("\n".join(msg))


@dataclass(frozen=True)
class EntryInfo:
    """One published cache entry, as listed by :func:`list_entries`."""

    backend: str
    key: str  # "<content key>/<compiler key>"
    path: Path
    size: int  # bytes of all files in the entry
    problem: Optional[str]  # None when it verifies
    created: Optional[str]


def list_entries(backend: Optional[str] = None) -> List[EntryInfo]:
    """Every published entry in the cache (of ``backend`` or all), verified (reads each library)."""
    root = env.cache_dir()
    out = []
    for entry in sorted(root.glob(f"{backend or '*'}/*/*")):
        if not entry.is_dir() or entry.name.startswith(TMP_PREFIX):
            continue
        try:
            manifest, problem = verify_entry(entry)
        except trust.UntrustedCacheError as e:
            manifest, problem = None, str(e)
        try:
            size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
        except OSError:
            size = 0
        out.append(EntryInfo(entry.parent.parent.name, f"{entry.parent.name}/{entry.name}",
                             entry, size, problem or (None if manifest else "incomplete"),
                             manifest and manifest.get("created")))
    return out


def clean(backend: Optional[str] = None) -> Tuple[List[Path], List[Tuple[Path, str]]]:
    """Remove cache entries, temp dirs and logs (of ``backend``, or everything including the
    compiler memo). An entry whose lock is held (a build in progress) is skipped. Lock files are
    kept: deleting a lock another process may be opening would let two builders in.
    Returns ``(removed entries, [(skipped entry, reason)])``."""
    from filelock import Timeout, UnixFileLock

    root = env.cache_dir()
    removed: List[Path] = []
    skipped: List[Tuple[Path, str]] = []
    entries = {p.with_suffix("") if p.suffix == ".lock" else p
               for p in root.glob(f"{backend or '*'}/*/*")
               if not p.name.startswith(TMP_PREFIX) and p.suffix != ".log"}
    for entry in sorted(entries):
        lock = UnixFileLock(str(entry.with_name(entry.name + ".lock")))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            skipped.append((entry, "its lock is held: a build is in progress"))
            continue
        except OSError as e:
            skipped.append((entry, f"cannot take its lock: {e}"))
            continue
        try:
            if entry.is_dir():
                _discard(entry)
                removed.append(entry)
            for leftover in entry.parent.glob(f"{TMP_PREFIX}{entry.name}-*"):
                _discard(leftover)
            entry.with_name(entry.name + ".build.log").unlink(missing_ok=True)
        except OSError as e:
            skipped.append((entry, f"cannot remove it: {e}"))
        finally:
            lock.release()
    memo.forget(root, backend)
    warm.forget(str(root), backend)
    if backend is None:
        shutil.rmtree(root / "compilers", ignore_errors=True)
    return removed, skipped
