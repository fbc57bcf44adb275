"""What a backend compiles (:class:`BuildSpec`) and the cache key derived from it.

A cache entry lives at ``<cache>/<backend>/<content key>/<compiler key>/``:

- the *content key* hashes everything but the compiler: the bytes of every source and header
  (named relative to the spec's root, so a reinstall of identical files elsewhere, with new
  mtimes, gives the same key), flags, torch version and git hash, the C++11 ABI flag, the Python
  ABI, the cam_jit version and the spec's extra facts (e.g. torch_npu/CANN/SoC for the NPU);
- the *compiler key* hashes the compiler path and its ``--version`` output.

The split lets a process with no compiler at all load the newest verified entry under its content
key. Facts are read live on every call, so a changed input is never answered by a stale key.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

CACHE_FORMAT = 1  # bump when the entry layout or manifest changes incompatibly
KEY_LENGTH = 24  # hex digits kept from sha256 for directory names (96 bits)


@dataclass(frozen=True)
class BuildSpec:
    """One shared library to build with ``torch.utils.cpp_extension.load``.

    ``sources``, ``headers`` and ``include_dirs`` are absolute paths under ``root``; headers are
    not compiled but hashed. ``name`` is the library's file stem; the library registers its ops
    itself (``TORCH_LIBRARY``). ``extra_key`` adds facts that must invalidate the cache (strings).
    ``listed``: the directories whose listings chose ``sources`` and ``headers`` (e.g. those
    :func:`cam_jit.jit.backends.tree_files` walked). A spec that names them promises it depends on
    nothing but cam_jit's code, the environment facts and those listings, which lets
    :mod:`cam_jit.jit.warm` find its entry without building it.
    """

    backend: str
    name: str
    root: Path
    sources: Tuple[Path, ...]
    headers: Tuple[Path, ...] = ()
    include_dirs: Tuple[Path, ...] = ()
    cflags: Tuple[str, ...] = ()
    ldflags: Tuple[str, ...] = ()
    extra_key: Mapping[str, str] = field(default_factory=dict)
    listed: Tuple[Path, ...] = ()

    def relative(self, path: Path) -> str:
        """``path`` named relative to ``root`` (the name that enters the key)."""
        text, root = str(path), str(self.root)
        if os.sep == "/" and text.startswith(root + "/"):  # the common case, without pathlib's parsing
            return text[len(root) + 1:]
        return path.relative_to(self.root).as_posix()


def environment_facts() -> Dict[str, Any]:
    """The facts outside the spec that a binary depends on (cheap: no subprocess, no sysconfig)."""
    import torch

    from cam_jit import _version

    return {
        "torch": str(torch.__version__),  # a plain str: TorchVersion parses itself in every comparison
        "torch_git": torch.version.git_version,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python_abi": importlib.machinery.EXTENSION_SUFFIXES[0],
        "python_cache_tag": sys.implementation.cache_tag,
        "cam_jit": _version.__version__,
    }


def file_digests(spec: BuildSpec) -> Dict[str, Any]:
    """``{"sources": [[relpath, sha256], ...], "headers": [...]}``: the file part of the key."""
    def digests(paths):
        return [[spec.relative(p), hashlib.sha256(p.read_bytes()).hexdigest()] for p in paths]

    return {"sources": digests(spec.sources), "headers": digests(spec.headers)}


def declared_inputs(spec: BuildSpec, facts: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Everything the content key hashes but the files' bytes (cheap: no file is read)."""
    return {
        "format": CACHE_FORMAT,
        "backend": spec.backend,
        "name": spec.name,
        "include_dirs": [spec.relative(p) for p in spec.include_dirs],
        "cflags": list(spec.cflags),
        "ldflags": list(spec.ldflags),
        "extra": {k: str(v) for k, v in sorted(spec.extra_key.items())},
        **(environment_facts() if facts is None else dict(facts)),
    }


def content_inputs(spec: BuildSpec, facts: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Everything the content key hashes, as a JSON-able dict (recorded in each manifest)."""
    return {**declared_inputs(spec, facts), **file_digests(spec)}


def digest(inputs: Mapping[str, Any]) -> str:
    """Stable short hash of a JSON-able mapping."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:KEY_LENGTH]


def content_key(spec: BuildSpec, facts: Optional[Mapping[str, Any]] = None) -> str:
    """The content key of ``spec`` (see the module docstring); ``facts`` overrides
    :func:`environment_facts` (for tests and tools)."""
    return digest(content_inputs(spec, facts))


def compiler_inputs(compiler_path: str, compiler_version: str) -> Dict[str, str]:
    """Everything the compiler key hashes."""
    return {"path": compiler_path, "version": compiler_version}


def compiler_key(compiler_path: str, compiler_version: str) -> str:
    """The compiler key: hash of the compiler's absolute path and ``--version`` output."""
    return digest(compiler_inputs(compiler_path, compiler_version))
