"""The backends the JIT can build: a registry of name -> spec factory + availability check.

The CPU backend compiles every ``*.cpp`` of the kernels directory's ``cpu/`` folder. The NPU
backend compiles the aclnn wrappers (``wrappers/``, spec in :mod:`cam_jit.ascend.build`, with
torch_npu/CANN/SoC facts in ``extra_key``); it is available only where torch_npu is importable.
The ``cpu_zb`` backend is FusedDeepMoeBuffer's shared-memory transport (spec in
:mod:`cam_jit.zero_buffer._heap`), compiled on a buffer's first ``init``.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from cam_jit.jit.errors import JitError
from cam_jit.jit.spec import BuildSpec

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the cam_jit package directory

# -ffp-contract=off: the numerical contract (docs/semantics.md §0.5) forbids FMA contraction. -fopenmp: at::parallel_for
# only runs in parallel when _OPENMP is defined; the library then needs libgomp.so.1, the runtime
# torch itself loads (bundled in torch/lib), so there is one OpenMP runtime in the process.
# -fvisibility=hidden: the library exports nothing (its ops register themselves from static
# initialisers), so the template code it instantiates from torch's headers binds locally instead of
# through ~170 symbol lookups at dlopen (~0.1 ms of every warm load).
CPU_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
CPU_LDFLAGS = ("-fopenmp",)
# No -march: the library targets the architecture's baseline ISA and picks its AVX512 / VNNI / AMX
# kernels at run time from CPUID (kernels/cpu/int8_gemm.cpp), so one cached binary is valid on every
# CPU of the architecture, which is part of the cache key.
CPU_TARGET_ISA = f"{os.uname().machine} baseline + runtime dispatch"


def kernels_dir() -> Path:
    """The C++ kernels: ``cam_jit/_kernels`` in an installed wheel, else ``<repo>/kernels``."""
    installed = os.path.join(_PACKAGE_DIR, "_kernels")  # strings: this runs on every warm load
    return Path(installed if os.path.isdir(installed) else os.path.join(os.path.dirname(_PACKAGE_DIR), "kernels"))


def kernels_chosen_in() -> Path:
    """The directory whose listing decides :func:`kernels_dir` (whether it holds ``_kernels``)."""
    return _PACKAGE_DIR


def cpu_spec() -> BuildSpec:
    """Spec of the CPU backend: every ``*.cpp`` (compiled) and ``*.h`` (hashed) under ``cpu/``."""
    root = kernels_dir()
    cpu = root / "cpu"
    listed = [kernels_chosen_in()]
    sources, headers = tree_files(cpu, ".cpp", ".h", walked=listed)
    if not sources:
        raise JitError(f"no C++ sources (*.cpp) in {cpu}: this cam_jit installation is incomplete "
                       "(reinstall it, or run from a complete checkout)")
    return BuildSpec(backend="cpu", name="cam_jit_cpu", root=root, sources=sources,
                     headers=headers, include_dirs=(cpu,), cflags=CPU_CFLAGS, ldflags=CPU_LDFLAGS,
                     extra_key={"target_isa": CPU_TARGET_ISA}, listed=tuple(listed))


def tree_files(folder: Path, *suffixes: str, walked: Optional[List[Path]] = None) -> Tuple[Tuple[Path, ...], ...]:
    """Per suffix, the sorted files under ``folder`` (recursively, not into symlinked
    directories) whose names end with it: ``sorted(folder.rglob("*" + suffix))`` in one
    ``scandir`` per directory and without pathlib's parsing per file, several times faster.
    ``walked``, if given, gets every directory listed (:attr:`BuildSpec.listed`)."""
    found: Dict[str, List[Path]] = {suffix: [] for suffix in suffixes}

    def walk(directory: Path) -> None:
        if walked is not None:
            walked.append(directory)
        try:
            with os.scandir(directory) as entries:
                listed = sorted((entry.name, entry.is_dir(), entry.is_symlink()) for entry in entries)
        except OSError:  # missing or unreadable: nothing found there, as os.walk
            return
        for name, is_dir, is_link in listed:  # sorted per directory = Path order of the whole tree
            if is_dir:
                if not is_link:
                    walk(directory / name)
                continue
            for suffix in suffixes:
                if name.endswith(suffix):
                    found[suffix].append(directory / name)

    walk(Path(folder))
    return tuple(tuple(found[suffix]) for suffix in suffixes)


def _npu_unavailable() -> Optional[str]:
    if importlib.util.find_spec("torch_npu") is None:
        return ("torch_npu is not importable (the `ascend` section of `python -m cam_jit "
                "doctor` says what the NPU path needs)")
    return None


def _npu_spec() -> BuildSpec:
    from cam_jit.ascend.build import npu_spec  # lazy: cam_jit.ascend imports this module

    return npu_spec()


def _zb_unavailable() -> Optional[str]:
    if not os.path.isdir("/dev/shm"):
        return "POSIX shared memory (/dev/shm) is not available on this system"
    return None


def _zb_spec() -> BuildSpec:
    from cam_jit.zero_buffer._heap import zb_spec  # lazy: cam_jit imports the zero buffer on first use

    return zb_spec()


@dataclass(frozen=True)
class Backend:
    """A registered backend: ``make_spec`` builds its :class:`BuildSpec` (None: not buildable in
    this version); ``unavailable`` returns why it cannot run on this machine, or None."""

    name: str
    make_spec: Optional[Callable[[], BuildSpec]]
    unavailable: Callable[[], Optional[str]]


BACKENDS: Dict[str, Backend] = {}


def register_backend(name: str, make_spec: Optional[Callable[[], BuildSpec]],
                     unavailable: Callable[[], Optional[str]] = lambda: None) -> None:
    """Add or replace a backend in the registry."""
    BACKENDS[name] = Backend(name, make_spec, unavailable)


register_backend("cpu", cpu_spec)
register_backend("npu", _npu_spec, _npu_unavailable)
register_backend("cpu_zb", _zb_spec, _zb_unavailable)  # FusedDeepMoeBuffer's shared-memory transport


def default_backend() -> str:
    """The current machine's backend: ``npu`` when it is buildable and torch_npu importable,
    else ``cpu``."""
    npu = BACKENDS.get("npu")
    if npu is not None and npu.make_spec is not None and npu.unavailable() is None:
        return "npu"
    return "cpu"


def backend_spec(name: str) -> BuildSpec:
    """The spec of backend ``name``; a clear :class:`JitError` if it is unknown or unavailable."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise JitError(f"unknown backend {name!r}; known backends: {', '.join(sorted(BACKENDS))}")
    reason = backend.unavailable()
    if backend.make_spec is None or reason is not None:
        raise JitError(f"backend {name!r} is not available here: {reason or 'no build spec'}")
    return backend.make_spec()
