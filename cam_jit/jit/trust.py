"""The cache's trust boundary: what may be dlopened, and how cache paths are created.

A library in the cache runs with the loading process's rights, so an entry is loaded only if
nobody but its user (or root) could have written it: every directory from the cache root down to
the entry, and every file of the entry, must be owned by the current user or root and not be
group- or world-writable; below the root nothing may be a symlink, and the manifest may name only
a plain file inside its entry. Anything else raises :class:`UntrustedCacheError` naming the path
and the fix. Directories and files the engine creates get exactly those properties (owner-only
write, whatever the umask), and lock files are 0600.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, List, Optional

from cam_jit.jit.errors import JitError

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UntrustedCacheError(JitError):
    """A cache path that another user could have written; nothing under it is loaded."""


def _owner_ok(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _refuse(path: Path, problem: str) -> UntrustedCacheError:
    return UntrustedCacheError(
        f"cam_jit refuses to load from the cache: {path} {problem}, so another user could have planted the "
        f"library that would run in this process. Fix: remove that cache (`python -m cam_jit clean`, or delete "
        f"{path}) or `chmod go-w` it if you own it, or point CAM_JIT_CACHE_DIR at a directory only you can write "
        f"(default ~/.cache/cam_jit)")


def _check(path, st: os.stat_result, kind: str) -> None:
    if not _owner_ok(st.st_uid):
        raise _refuse(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise _refuse(path, f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})")
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory (a symlink?)")
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "is not a regular file (a symlink?)")


def check_entry(root: Path, entry: Path, files: Iterable[str]) -> List[os.stat_result]:
    """Raises UntrustedCacheError unless `root` (followed if a symlink), every directory below it
    down to `entry` (not followed) and entry/<f> for each of `files` are trusted (module doc);
    returns the ``lstat`` of each of `files`. Plain string paths: this runs on every warm load."""
    root_text, entry_text = os.fspath(root), os.fspath(entry)
    _check(root, os.stat(root_text), "dir")
    if entry_text != root_text:
        if not entry_text.startswith(root_text + os.sep):
            raise ValueError(f"{entry} is not under the cache root {root}")
        path = root_text
        for part in entry_text[len(root_text) + 1:].split(os.sep):
            path = f"{path}{os.sep}{part}"
            _check(path, os.lstat(path), "dir")
    found = []
    for name in files:
        path = f"{entry_text}{os.sep}{name}"
        st = os.lstat(path)
        _check(path, st, "file")
        found.append(st)
    return found


def read_small(path: str) -> Optional[str]:
    """The text of the small cache file ``path`` (at most 64 KiB read) if it is a trusted regular
    file, opened without following a symlink; None if it is missing, untrusted or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        _check(path, os.fstat(fd), "file")
        return os.read(fd, 1 << 16).decode()
    except (OSError, UnicodeDecodeError, UntrustedCacheError):
        return None
    finally:
        os.close(fd)


def write_small(path: str, text: str) -> None:
    """Replace the small cache file ``path`` by ``text`` atomically (a temporary file beside it,
    created without following a symlink, then renamed); best effort: a read-only cache is left as
    it is."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        pass


def library_name(manifest: dict) -> str:
    """The manifest's `library`: a plain file name (no directory part, not '.' or '..')."""
    name = manifest["library"]
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
        raise ValueError(f"manifest field 'library' must be a file name inside its entry, got {name!r}")
    return name


def make_dirs(path: Path) -> None:
    """mkdir -p whose new directories are owner-writable only (0755 less the umask's read bits)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        owner_only_writes(directory)


def owner_only_writes(path: Path) -> None:
    """Drops group and world write permission from a path this process created."""
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if mode & _WRITABLE_BY_OTHERS:
        os.chmod(path, mode & ~_WRITABLE_BY_OTHERS)


def lock_file(path: Path) -> None:
    """Creates the lock file `path` 0600 if missing, and refuses one another user could hold
    open for writing or own: a lock only its owner can take."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not _owner_ok(st.st_uid) or not stat.S_ISREG(st.st_mode):
        raise _refuse(path, f"(a build lock) is owned by uid {st.st_uid} or not a regular file")
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, 0o600)
