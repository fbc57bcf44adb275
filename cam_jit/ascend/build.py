"""The NPU backend's build spec (the aclnn wrappers under ``wrappers/``) and the compile-only check.

:func:`npu_spec` is what the JIT engine builds on an NPU machine: every ``*.cpp`` of the wrappers
directory, with torch_npu's headers and library and CANN's include/lib directories, and
torch_npu / CANN / SoC in the cache key. :func:`compile_only` compiles each translation unit of a
spec to an object file with the compiler flags ``torch.utils.cpp_extension`` uses, without
linking or loading anything: usable on a machine without an NPU, against an installed torch_npu
or the ``torch_npu/`` directory extracted from its wheel.

``zb_shmem.cpp`` (FusedDeepMoeBuffer's Ascend SHMEM heap, docs/semantics.md §5.1) is built only with SHMEM
(:func:`shmem_part`): ``SHMEM_HOME_PATH`` set and its ``shmem.h`` found; otherwise it is left out
and :func:`shmem_part` says why (``doctor`` and ``build --compile-only`` print it).
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from cam_jit.ascend import discover
from cam_jit.jit import toolchain
from cam_jit.jit.errors import JitError, ToolchainError
from cam_jit.jit.spec import BuildSpec

NAMESPACE = "_cam_jit_npu"  # the private op namespace of the NPU library
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_ERROR_LINE = re.compile(r"\berror:|undefined reference")
ERRORS_SHOWN = 3  # compiler errors quoted per failing file


def wrappers_dir() -> Path:
    """The C++ wrappers: ``cam_jit/_wrappers`` in an installed wheel, else ``<repo>/wrappers``."""
    installed = _PACKAGE_DIR / "_wrappers"
    return installed if installed.is_dir() else _PACKAGE_DIR.parent / "wrappers"


def torch_npu_package(root: Optional[Path]) -> Tuple[Path, Optional[str]]:
    """The torch_npu package directory and version: ``root`` (a directory holding ``torch_npu/``,
    e.g. an extracted wheel, or the package directory itself), else the importable torch_npu."""
    if root is None:
        found = discover.find_torch_npu()
        if found.root is None:
            raise JitError(f"cannot build the NPU wrappers: {found.problem}")
        return found.root, found.version
    root = Path(root).expanduser().absolute()
    package = root / "torch_npu" if (root / "torch_npu").is_dir() else root
    if not (package / "include" / "torch_npu").is_dir():
        raise JitError(f"{root} holds no torch_npu headers (expected {root}/torch_npu/include/"
                       "torch_npu/, e.g. from `unzip torch_npu-<version>-<tags>.whl 'torch_npu/*'`)")
    text = (package / "version.py").read_text() if (package / "version.py").is_file() else ""
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
    return package, match.group(1) if match else None


SHMEM_SOURCE = "zb_shmem.cpp"  # the one wrapper that needs SHMEM
SHMEM_HEADER = "shmem.h"
SHMEM_FEATURE = "FusedDeepMoeBuffer on NPU"


@dataclass(frozen=True)
class ShmemPart:
    """How the SHMEM wrapper enters the NPU build: ``excluded`` is None when it is built (with
    ``cflags``/``ldflags``/``key``), else the line saying why it is not."""

    excluded: Optional[str]
    cflags: Tuple[str, ...] = ()
    ldflags: Tuple[str, ...] = ()
    key: Tuple[Tuple[str, str], ...] = ()


def shmem_part() -> ShmemPart:
    """The SHMEM part of the NPU build, read from ``SHMEM_HOME_PATH`` now: its include directory
    (``include/`` or ``shmem/include/`` holding ``shmem.h``) and library (``libshmem*.so``, see
    :func:`cam_jit.ascend.discover.find_shmem`; ``-lshmem`` under ``lib/`` when not found)."""
    value = os.environ.get("SHMEM_HOME_PATH")
    if not value:
        return ShmemPart(f"{SHMEM_FEATURE}: excluded (SHMEM_HOME_PATH not set)")
    home = Path(value).expanduser().absolute()
    includes = [home / sub for sub in ("include", "shmem/include") if (home / sub / SHMEM_HEADER).is_file()]
    if not includes:
        return ShmemPart(f"{SHMEM_FEATURE}: excluded (no include/{SHMEM_HEADER} or shmem/include/"
                         f"{SHMEM_HEADER} under SHMEM_HOME_PATH={value})")
    library = discover.find_shmem().library
    lib_dir = library.parent if library is not None else home / "lib"
    lib_name = library.name[3:].split(".so")[0] if library is not None else "shmem"
    return ShmemPart(None, cflags=("-DCAM_JIT_WITH_SHMEM", f"-I{includes[0]}"),
                     ldflags=(f"-L{lib_dir}", f"-l{lib_name}", f"-Wl,-rpath,{lib_dir}"),
                     key=(("shmem_home", str(home)), ("shmem_library", str(library or "unknown"))))


def npu_spec(torch_npu_root: Optional[Path] = None, runtime_soc: bool = True) -> BuildSpec:
    """The NPU backend's spec (see the module docstring); ``runtime_soc`` asks torch_npu's runtime
    for the SoC (False for compile-only checks)."""
    package, version = torch_npu_package(torch_npu_root)
    wrappers = wrappers_dir()
    shmem = shmem_part()
    sources = tuple(sorted(p for p in wrappers.glob("*.cpp")
                           if shmem.excluded is None or p.name != SHMEM_SOURCE))
    if not sources:
        raise JitError(f"no C++ sources (*.cpp) in {wrappers}: this cam_jit installation is "
                       "incomplete (reinstall it, or run from a complete checkout)")
    cann = discover.find_cann()
    soc = discover.find_soc(runtime=runtime_soc)
    cflags = ["-O2", f"-DCAM_JIT_NPU_NS={NAMESPACE}", f"-I{package / 'include'}"]
    ldflags = [f"-L{package / 'lib'}", "-ltorch_npu", f"-Wl,-rpath,{package / 'lib'}", "-ldl"]
    if cann.home is not None:
        cflags += [f"-I{p}" for p in (cann.home / "include",) if p.is_dir()]
        ldflags += [f"-L{p}" for p in (cann.home / "lib64",) if p.is_dir()]
    return BuildSpec(backend="npu", name="cam_jit_npu", root=wrappers, sources=sources,
                     headers=tuple(sorted(wrappers.glob("*.h"))), include_dirs=(wrappers,),
                     cflags=tuple(cflags) + shmem.cflags, ldflags=tuple(ldflags) + shmem.ldflags,
                     extra_key={"torch_npu": version or "unknown", "torch_npu_dir": str(package),
                                "cann": cann.version or "none", "soc": soc.name or "unknown",
                                **dict(shmem.key)})


def _cxx_standard() -> str:
    """The ``-std=`` flag cpp_extension passes (read from its build-file writer; c++17 before
    torch used c++20)."""
    from torch.utils import cpp_extension

    try:
        text = inspect.getsource(cpp_extension._write_ninja_file_to_build_library)
    except (AttributeError, OSError, TypeError):
        text = ""
    match = re.search(r"-std=c\+\+\d+", text)
    return match.group(0) if match else "-std=c++17"


def compile_command(spec: BuildSpec, source: Path, obj: Path, compiler: str) -> List[str]:
    """The compile command cpp_extension.load runs for ``source`` (defines, user includes,
    ``-isystem`` torch and Python includes, ``-fPIC``, the C++ standard, the spec's cflags)."""
    from torch.utils.cpp_extension import include_paths

    cmd = [compiler, f"-DTORCH_EXTENSION_NAME={spec.name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    cmd += [f"-I{p}" for p in spec.include_dirs]
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    for path in include_paths() + ([python_include] if python_include else []):
        cmd += ["-isystem", path]
    cmd += ["-fPIC", _cxx_standard(), *spec.cflags, "-c", str(source), "-o", str(obj)]
    return cmd


@dataclass(frozen=True)
class CompileResult:
    """One translation unit of :func:`compile_only`: ``errors`` is empty when it compiled."""

    source: Path
    seconds: float
    errors: Tuple[str, ...]
    command: str


def first_errors(output: str, limit: int = ERRORS_SHOWN) -> List[str]:
    """The first ``limit`` compiler error lines of ``output``, each with the next two lines."""
    lines = output.splitlines()
    shown: List[str] = []
    count = 0
    for i, line in enumerate(lines):
        if count == limit:
            break
        if _ERROR_LINE.search(line):
            count += 1
            shown += [line] + [c for c in lines[i + 1:i + 3] if not _ERROR_LINE.search(c)]
    return shown or lines[:6]


def compile_only(spec: BuildSpec, jobs: Optional[int] = None) -> List[CompileResult]:
    """Compile every source of ``spec`` to an object file in a temporary directory (removed
    after), in parallel; nothing is linked or loaded. Raises ToolchainError without a compiler."""
    compiler = toolchain.find_compiler()
    if compiler is None:
        raise ToolchainError(toolchain.missing_tool(None, "ninja"))

    def one(source: Path, out_dir: str) -> CompileResult:
        cmd = compile_command(spec, source, Path(out_dir) / (source.stem + ".o"), compiler.path)
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
        errors = () if proc.returncode == 0 else tuple(first_errors(proc.stderr + proc.stdout))
        return CompileResult(source, time.monotonic() - start, errors, " ".join(cmd))

    with tempfile.TemporaryDirectory(prefix="cam_jit-compile-only-") as out_dir:
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            return list(pool.map(lambda s: one(s, out_dir), spec.sources))
