"""The sources memo: a backend's content key on a warm load without hashing its sources.

The content key hashes the bytes of every source and header; reading and hashing them on each
load cost more than the dlopen that follows. A memo file
``<cache>/<backend>/sources-<place>-<fingerprint>`` records the content key computed for one
state of the files: ``place`` hashes the spec's root and everything else the key covers (flags,
torch, Python, cam_jit versions, extra facts), ``fingerprint`` adds each file's name, size,
mtime, ctime and inode. Any write to a file changes its ctime (even one that restores its mtime),
so an edited source misses the memo and is hashed as before; a memo is written only when every
file is older than :data:`SETTLE_SECONDS`, so that two edits within one timestamp tick cannot
share a fingerprint. The memo only finds the entry: the caller still checks the entry's library
against its manifest (size and sha256) and the manifest's recorded inputs against the live ones.
A memo the cache's trust rules refuse (:mod:`cam_jit.jit.trust`: another owner, writable by
others, not a regular file) is ignored. One memo is kept per
place: recording one removes the place's older memos.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

from cam_jit.jit import trust
from cam_jit.jit.spec import BuildSpec, digest

PREFIX = "sources-"
SETTLE_SECONDS = 2.0  # far above any filesystem's timestamp granularity
_KEY = re.compile(r"[0-9a-f]{8,64}")


def fingerprint(spec: BuildSpec, declared: Mapping[str, Any]) -> Tuple[str, bool]:
    """``(memo file name, settled)`` for the current state of ``spec``'s files; ``declared``
    is :func:`cam_jit.jit.spec.declared_inputs` of the spec. ``settled``: every file is older
    than SETTLE_SECONDS, so a memo of this state may be recorded."""
    files: List[object] = []
    newest = 0
    for path in (*spec.sources, *spec.headers):
        st = os.stat(path)
        files += [spec.relative(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    place = digest({"root": str(spec.root), "declared": dict(declared)})
    return f"{PREFIX}{place}-{digest(files)}", newest < time.time_ns() - SETTLE_SECONDS * 1e9


def lookup(root: Path, backend: str, name: str) -> Optional[str]:
    """The content key recorded under memo ``name``, or None (no memo, or one not to trust)."""
    try:
        fd = os.open(root / backend / name, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        trust._check(root / backend / name, os.fstat(fd), "file")
        key = os.read(fd, 128).decode("ascii", "replace").strip()
    except (OSError, trust.UntrustedCacheError):
        return None
    finally:
        os.close(fd)
    return key if _KEY.fullmatch(key) else None


def agrees(manifest: Mapping[str, Any], content_key: str, spec: BuildSpec, declared: Mapping[str, Any]) -> bool:
    """Whether an entry's manifest was built from ``spec`` as it is declared now: it records
    ``content_key``, the same files and the same inputs but for the files' bytes (which the
    memo's fingerprint vouches for)."""
    try:
        recorded = manifest["inputs"]["content"]
        return (manifest["content_key"] == content_key
                and [name for name, _ in recorded["sources"]] == [spec.relative(p) for p in spec.sources]
                and [name for name, _ in recorded["headers"]] == [spec.relative(p) for p in spec.headers]
                and all(recorded.get(k) == v for k, v in declared.items()))
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def record(root: Path, backend: str, name: str, content_key: str) -> None:
    """Write memo ``name`` -> ``content_key`` and drop the older memos of its place (best
    effort: a read-only cache just is not updated)."""
    folder = root / backend
    place = name[:name.rindex("-")]
    try:
        tmp = folder / f".{name}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, content_key.encode())
        finally:
            os.close(fd)
        os.replace(tmp, folder / name)
        for old in folder.glob(f"{place}-*"):
            if old.name != name:
                old.unlink(missing_ok=True)
    except OSError:
        pass


def forget(root: Path, backend: Optional[str] = None) -> None:
    """Remove the memos of ``backend`` (or of every backend)."""
    for memo in root.glob(f"{backend or '*'}/{PREFIX}*"):
        try:
            memo.unlink()
        except OSError:
            pass
