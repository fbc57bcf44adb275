"""The warm-load memo: a backend's cache entry found, and its library vouched for, without hashing.

Hashing the sources (for the content key) and the library (against its manifest's sha256) on every
load cost more than the dlopen that follows. A memo file ``<cache>/<backend>/memo-<place>``
(``place``: a checksum of the spec's root and declared inputs, which only names the file) holds:

1. the *state* it was written for: the spec's root, its declared inputs (flags, torch, Python and
   cam_jit versions, extra facts) and each source's and header's name, size, mtime, ctime, inode
   and device;
2. the content key computed by hashing those files in that state;
3. optionally, the compiler found on PATH (its path and the device, inode, size, mtime and ctime of
   the file it resolves to) and the entry published for it under that content key: its compiler
   key, its library's file name and the library's *identity* (device, inode, size, mtime, ctime)
   from ``fstat`` before and after a full read whose sha256 matched the manifest.

A load whose live state equals (1) takes the content key from (2) instead of hashing the sources;
one whose compiler also equals (3), and whose library's ``lstat`` gives the identity in (3), loads
that library without hashing it. Anything else is looked up and hashed as before, and the memo
rewritten.

Why an unchanged identity proves unchanged bytes: every write, truncation, ``utime`` or rename onto
the file sets its ctime to the current time, and no unprivileged process can set a ctime back; a
new file (a replacement through another inode, even one reusing the number) gets a new ctime too.
Identities (and source states) are recorded only when the ctime is older than
:data:`SETTLE_SECONDS`, so any later change lands on another clock tick and differs. Not covered:
bytes that change below the filesystem (media corruption), which no write reports, and a clock set
back by root; ``python -m cam_jit doctor`` (:func:`cam_jit.jit.core.list_entries`) still hashes
every library. The memo is read only if the trust rules accept it (:mod:`cam_jit.jit.trust`: owned
by this user or root, not writable by others, a regular file opened without following symlinks),
and the entry it names passes those rules on every load.
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

from cam_jit.jit import trust
from cam_jit.jit.spec import BuildSpec

PREFIX = "memo-"
FORMAT = "cam_jit memo 2"
SETTLE_SECONDS = 2.0  # far above any filesystem's timestamp granularity


def identity(st: os.stat_result) -> str:
    """What changes with any change to a file's bytes made through the filesystem."""
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def settled(st: os.stat_result) -> bool:
    """Whether ``st``'s ctime is old enough for a later change to land on another clock tick."""
    return _settled_ns(st.st_ctime_ns)


def _settled_ns(ctime_ns: int) -> bool:
    return ctime_ns < time.time_ns() - SETTLE_SECONDS * 1e9


@dataclass
class Known:
    """The live state of a spec and what its memo says about it (:func:`read`)."""

    name: str  # the memo's file name
    state: str  # the live state (line 1 of a memo of it)
    settled: bool  # every file settled: a memo of this state may be recorded
    files: list  # per source and header: (relative name, size, mtime, ctime, inode, device)
    text: Optional[str] = None  # the memo as read, if trusted
    content_key: Optional[str] = None  # its content key, if it is of the live state
    compiler: Optional[str] = None  # its compiler line, if any
    entry: Optional[Tuple[str, str, str]] = None  # its (compiler key, library, identity), if any


def read(root: Path, spec: BuildSpec, declared: Mapping[str, Any]) -> Known:
    """The live state of ``spec``'s files (``stat`` calls) and the memo recorded for it, if any;
    ``declared`` is :func:`cam_jit.jit.spec.declared_inputs` of the spec."""
    head = repr((str(spec.root), dict(declared)))
    files = []
    newest = 0
    for path in (*spec.sources, *spec.headers):
        st = os.stat(path)
        files.append((spec.relative(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
        newest = max(newest, st.st_ctime_ns)
    ready = _settled_ns(newest)
    known = Known(f"{PREFIX}{zlib.crc32(head.encode()):08x}", repr((head, files)), ready, files)
    known.text = trust.read_small(f"{root}{os.sep}{spec.backend}{os.sep}{known.name}")
    if known.text is None:
        return known
    lines = known.text.split("\n")
    if len(lines) not in (3, 5) or lines[0] != FORMAT or lines[1] != known.state or not _is_key(lines[2]):
        return known
    known.content_key = lines[2]
    if len(lines) == 5:
        entry = tuple(lines[4].split("\t"))
        if len(entry) == 3 and _is_key(entry[0]) and entry[1].isprintable() and os.sep not in entry[1] \
                and entry[1] not in ("", ".", ".."):
            known.compiler, known.entry = lines[3], entry
    return known


def _is_key(text: str) -> bool:
    """A cache key as :func:`cam_jit.jit.spec.digest` writes it (hex digits; no regex on the warm
    path)."""
    return 8 <= len(text) <= 64 and text.isalnum() and text.isascii() and text == text.lower()


def vouched(root: Path, backend: str, known: Known, compiler_facts: Optional[str],
            files: Tuple[str, ...]) -> Optional[Tuple[Path, str]]:
    """``(entry, library name)`` when the memo vouches for the entry of this compiler (its path
    and facts, ``Compiler.path + "\\t" + Compiler.facts``): same compiler, the entry passes the
    trust rules (raises :class:`cam_jit.jit.trust.UntrustedCacheError` otherwise) and its library
    has the recorded identity; else None. ``files``: the entry's files to trust-check besides the
    library (its manifest)."""
    if known.entry is None or compiler_facts is None or known.compiler != compiler_facts:
        return None
    compiler_key, library, recorded = known.entry
    entry = f"{root}{os.sep}{backend}{os.sep}{known.content_key}{os.sep}{compiler_key}"
    try:
        stats = trust.check_entry(root, entry, (*files, library))
    except FileNotFoundError:
        return None
    if identity(stats[-1]) != recorded:
        return None
    return Path(entry), library


def record(root: Path, backend: str, known: Known, content_key: str,
           entry: Optional[Tuple[str, str, str, str]] = None) -> None:
    """Write the memo of ``known.state`` -> ``content_key`` and, if given, ``entry`` =
    (compiler facts line, compiler key, library name, library identity) (best effort: a read-only
    cache just is not updated). Nothing is written for an unsettled state or an unchanged memo."""
    if not known.settled:
        return
    lines = [FORMAT, known.state, content_key]
    if entry is not None:
        lines += [entry[0], "\t".join(entry[1:])]
    text = "\n".join(lines)
    if text == known.text:
        return
    trust.write_small(str(root / backend / known.name), text)


def agrees(manifest: Mapping[str, Any], content_key: str, spec: BuildSpec, declared: Mapping[str, Any]) -> bool:
    """Whether an entry's manifest was built from ``spec`` as it is declared now: it records
    ``content_key``, the same files and the same inputs but for the files' bytes (which the
    memo's state vouches for)."""
    try:
        recorded = manifest["inputs"]["content"]
        return (manifest["content_key"] == content_key
                and [name for name, _ in recorded["sources"]] == [spec.relative(p) for p in spec.sources]
                and [name for name, _ in recorded["headers"]] == [spec.relative(p) for p in spec.headers]
                and all(recorded.get(k) == v for k, v in declared.items()))
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def forget(root: Path, backend: Optional[str] = None) -> None:
    """Remove the memos of ``backend`` (or of every backend), also those of the previous format
    (``sources-*``)."""
    for pattern in (PREFIX, "sources-"):
        for memo in root.glob(f"{backend or '*'}/{pattern}*"):
            try:
                memo.unlink()
            except OSError:
                pass
