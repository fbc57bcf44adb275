"""The fast warm path: a registered backend's library found and vouched for by ``stat`` calls
alone, before its :class:`~cam_jit.jit.spec.BuildSpec` is built and without a PATH search.

The warm-load memo (:mod:`cam_jit.jit.memo`) still needs the spec (a directory walk), the
declared inputs and a PATH search for the compiler, which in a fresh process cost as much as the
dlopen itself. Once a load has been vouched for by that memo, a *warm record*
``<cache>/<backend>/warm-<place>`` (``place``: a checksum of the package directory) stores what that load proved, each part with what vouches that it still holds:

1. *what decides the spec*: the backend's spec factory (module, name, and the identity of its
   module's file and of :mod:`cam_jit.jit.spec`'s, so an edit of the code that declares flags or
   files misses), the environment facts (torch, Python, cam_jit versions:
   :func:`cam_jit.jit.spec.environment_facts`), ``$CXX`` and ``$PATH``;
2. *the files*: the identity (device, inode, size, mtime, ctime) of every source and header, and
   of every directory whose listing chose them (:attr:`BuildSpec.listed`): creating, removing or
   renaming a file in a directory changes the directory's mtime and ctime;
3. *the compiler*: the path the PATH search found and the identity of the file it resolves to,
   and the identity of each PATH directory searched before it, recorded only if none of them
   held an entry of the compiler's name: while they are unchanged, the search would find the
   same compiler;
4. *the entry*: its path below the cache and its library's identity, recorded from a memo that
   vouched for it (an identity taken right after a matching sha256, :mod:`cam_jit.jit.memo`).

Identities taken when the record is written must be settled (:func:`cam_jit.jit.memo.settled`),
so that a change made since the spec was built or the compiler found cannot be recorded as the
state they saw.

A load whose live facts equal (1)-(3) and whose entry passes the trust rules
(:mod:`cam_jit.jit.trust`, as on every load) with the library's identity (4) dlopens it; anything
else falls back to the memo and the full lookup, which rewrite the record. The record is read
only if the trust rules accept it, like the memo. Only specs that declare ``listed`` directories
get a record: their factory promises that the spec depends on nothing but cam_jit's code, the
environment facts and those listings.
"""
from __future__ import annotations

import glob
import os
import sys
import zlib
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from cam_jit.jit import spec as _spec_module
from cam_jit.jit import trust
from cam_jit.jit.memo import identity, settled
from cam_jit.jit.spec import BuildSpec, environment_facts
from cam_jit.jit.toolchain import Compiler, requested_compiler

PREFIX = "warm-"
FORMAT = "cam_jit warm 1"
MANIFEST = "manifest.json"
_ABSENT = "-"
_UNKNOWN = "?"
_SPEC_SOURCE = _spec_module.__file__
# names the record per installation, so that checkouts sharing a cache do not overwrite each other's
_PLACE = f"{zlib.crc32(os.path.dirname(_SPEC_SOURCE).encode()):08x}"


def _identity(path: str, settled_only: bool = False) -> str:
    """``stat`` identity of ``path`` (device, inode, size, mtime, ctime; follows symlinks), ``-``
    if it does not exist, ``?`` if it cannot be examined or (``settled_only``) changed too recently
    to be recorded; ``?`` is never recorded, so it never vouches."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return _ABSENT
    except OSError:
        return _UNKNOWN
    if settled_only and not settled(st):
        return _UNKNOWN
    return identity(st)


def _decided_by(backend: str, factory: Callable[[], BuildSpec]) -> str:
    """Line (1): everything but the files that decides the spec and the compiler search."""
    module = sys.modules.get(getattr(factory, "__module__", None) or "")
    source = getattr(module, "__file__", None) or _ABSENT
    return repr((backend, factory.__module__, factory.__qualname__, source, _identity(source),
                 _identity(_SPEC_SOURCE), tuple(environment_facts().values()),
                 os.environ.get("CXX"), os.environ.get("PATH")))


def vouched(root: str, backend: str, factory: Callable[[], BuildSpec]) -> Optional[Tuple[str, str]]:
    """``(entry, library file)`` when the warm record of ``backend`` under cache root ``root``
    vouches for them (module doc), else None. Raises
    :class:`cam_jit.jit.trust.UntrustedCacheError` if the entry it names fails the trust rules."""
    text = trust.read_small(f"{root}{os.sep}{backend}{os.sep}{PREFIX}{_PLACE}")
    if text is None:
        return None
    lines = text.split("\n")
    if len(lines) != 5 or lines[0] != FORMAT or lines[1] != _decided_by(backend, factory) or \
            "\t".join(map(_identity, lines[2].split("\t"))) != lines[3]:
        return None
    relative, _, library = lines[4].partition("\t")
    parts = relative.split("/")
    if len(parts) != 3 or not all(parts) or any(p in (".", "..") for p in parts):
        return None
    entry = f"{root}{os.sep}{backend}{os.sep}{parts[0]}{os.sep}{parts[1]}"
    try:
        st = trust.check_entry(root, entry, (MANIFEST, parts[2]))[-1]
    except FileNotFoundError:
        return None
    if identity(st) != library:
        return None
    return entry, parts[2]


def record(root: str, spec: BuildSpec, factory: Callable[[], BuildSpec], files: Sequence[Any],
           compiler: Compiler, entry: Tuple[str, str, str], library_identity: str) -> None:
    """Write the warm record of ``spec`` (best effort; nothing if it would not be sound).

    ``files``: the state the memo vouched for (``memo.Known.files``: per source and header its
    relative name, size, mtime, ctime, inode, device); ``compiler``: the one the memo vouched for
    (its facts are its file's identity); ``entry``: (content key, compiler key, library file
    name), whose library had ``library_identity`` when a memo vouched for it."""
    searched = _searched_before(compiler.path)
    if not spec.listed or searched is None:
        return
    paths = [str(d) for d in spec.listed]
    identities = [_identity(p, settled_only=True) for p in paths]
    for path, (_, size, mtime, ctime, ino, dev) in zip((*spec.sources, *spec.headers), files):
        paths.append(str(path))
        identities.append(f"{dev} {ino} {size} {mtime} {ctime}")
    if _ABSENT in identities or _UNKNOWN in identities or _UNKNOWN in searched.values():
        return
    paths += [compiler.path, *searched]
    identities += [compiler.facts, *searched.values()]
    if any("\t" in p or "\n" in p for p in paths):
        return
    text = "\n".join([FORMAT, _decided_by(spec.backend, factory), "\t".join(paths), "\t".join(identities),
                      f"{entry[0]}/{entry[1]}/{entry[2]}\t{library_identity}"])
    target = f"{root}{os.sep}{spec.backend}{os.sep}{PREFIX}{_PLACE}"
    if trust.read_small(target) == text:  # an untrusted record reads as None: it is replaced
        return
    trust.write_small(target, text)


def _searched_before(compiler_path: str) -> Optional[Dict[str, str]]:
    """Identities of the PATH directories the compiler search tries before ``compiler_path``'s
    (as :func:`cam_jit.jit.toolchain.find_compiler` does), or None when an unchanged directory
    would not prove the same outcome: a relative entry (depends on the working directory), a
    directory that holds an entry of the compiler's name (e.g. not executable today), or a
    compiler named by a relative path."""
    name = requested_compiler()
    if os.sep in name:
        return {} if os.path.isabs(name) else None
    found: Dict[str, str] = {}
    for directory in dict.fromkeys(os.environ.get("PATH", os.defpath).split(os.pathsep)):
        candidate = os.path.join(directory, name)
        if os.path.abspath(candidate) == compiler_path:
            return found
        if not os.path.isabs(directory) or os.path.lexists(candidate):
            return None
        found[directory] = _identity(directory, settled_only=True)
    return None


def forget(root: str, backend: Optional[str] = None) -> None:
    """Remove the warm records of ``backend`` (or of every backend)."""
    for path in glob.glob(os.path.join(glob.escape(root), backend or "*", f"{PREFIX}*")):
        try:
            os.unlink(path)
        except OSError:
            pass
