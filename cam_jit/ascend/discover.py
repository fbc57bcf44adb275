"""Discovery of the Ascend software stack: CANN, torch_npu, the SoC and SHMEM.

Nothing here imports torch_npu unless asked to read the SoC from the runtime, and nothing needs
CANN to be installed: every function returns a record that says what was found, where, and
when something is missing, why and how to fix it. Environment variables are read at call time.

- CANN: ``ASCEND_HOME_PATH`` (set by CANN's ``set_env.sh``), else ``ASCEND_TOOLKIT_HOME``, else
  the standard install roots (:data:`DEFAULT_CANN_ROOTS`); version from the toolkit's install
  info or ``version.info`` files; the opp directory from ``ASCEND_OPP_PATH`` or ``<home>/opp``.
- torch_npu: located with ``importlib`` (not imported); version from its distribution metadata.
- SoC: from the runtime (``torch_npu.npu.get_device_name``) when torch_npu is importable and a
  device is visible, else ``CAM_JIT_NPU_SOC``, else unknown.
- SHMEM: ``SHMEM_HOME_PATH`` and a ``libshmem*.so`` under it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Tuple

SOC_ENV = "CAM_JIT_NPU_SOC"
CANN_HOME_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
DEFAULT_CANN_ROOTS = (
    Path("/usr/local/Ascend/ascend-toolkit/latest"),
    Path("/usr/local/Ascend/cann"),
    Path.home() / "Ascend" / "ascend-toolkit" / "latest",
)
# Files that carry the CANN version, relative to its home, first match wins.
VERSION_FILES = ("*-linux/ascend_toolkit_install.info", "ascend_toolkit_install.info",
                 "version.info", "compiler/version.info", "runtime/version.info",
                 "share/info/version.info")
CANN_FIX = ("install the CANN toolkit and run `source <CANN install>/set_env.sh` (it sets "
            "ASCEND_HOME_PATH and ASCEND_OPP_PATH), or set ASCEND_HOME_PATH by hand")


@dataclass(frozen=True)
class Cann:
    """A CANN install: ``home`` is None when none was found (``problem`` says why)."""

    home: Optional[Path]
    source: str  # which variable or default root gave ``home``
    version: Optional[str]
    opp: Optional[Path]  # $ASCEND_OPP_PATH or <home>/opp, when it exists
    opapi: Optional[Path]  # CANN's libopapi.so, when it exists
    problem: Optional[str] = None


@dataclass(frozen=True)
class TorchNpu:
    """torch_npu as seen without importing it."""

    root: Optional[Path]  # the package directory; None when not importable
    version: Optional[str]
    problem: Optional[str] = None  # not importable, or its version does not match torch's


@dataclass(frozen=True)
class Soc:
    """The SoC family (``ascend910_93``, ``ascend910b``, ...), None when unknown."""

    name: Optional[str]
    device_name: Optional[str]  # as the runtime or the environment spelled it
    source: str


@dataclass(frozen=True)
class Shmem:
    """SHMEM: ``home`` from ``SHMEM_HOME_PATH``; ``problem`` is None when usable."""

    home: Optional[Path]
    library: Optional[Path]
    problem: Optional[str] = None


def _read_version(home: Path) -> Optional[str]:
    for pattern in VERSION_FILES:
        for path in sorted(home.glob(pattern)):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            match = re.search(r"^\s*version\s*=\s*(\S+)", text, re.IGNORECASE | re.MULTILINE)
            if match:
                return match.group(1).strip("\"'")
    return None


def _looks_like_cann(path: Path) -> bool:
    return path.is_dir() and any((path / p).exists() for p in ("set_env.sh", "lib64", "opp"))


def _first_existing(paths: Iterable[Path]) -> Optional[Path]:
    return next((p for p in paths if p.exists()), None)


def find_cann(default_roots: Iterable[Path] = DEFAULT_CANN_ROOTS) -> Cann:
    """Locate CANN (see the module docstring for the order): the first of the variables that is
    set decides; the default roots are tried only when none is set."""
    home, source, problem = None, "", None
    for var in CANN_HOME_VARS:
        value = os.environ.get(var)
        if not value:
            continue
        if _looks_like_cann(Path(value)):
            home, source = Path(value), var
            break
        problem = (f"{var}={value} is not a CANN install (no set_env.sh, lib64/ or opp/ in it); "
                   f"{CANN_FIX}")
        break  # a variable set to a wrong place is reported, not silently replaced
    if home is None and problem is None:
        home = next((p for p in default_roots if _looks_like_cann(p)), None)
        source = f"default location {home}" if home else ""
    if home is None:
        looked = ", ".join(str(p) for p in default_roots)
        return Cann(None, "", None, None, None, problem or (
            f"CANN not found: neither {' nor '.join(CANN_HOME_VARS)} is set and none of {looked} "
            f"exists; {CANN_FIX}"))
    opp_env = os.environ.get("ASCEND_OPP_PATH")
    opp = _first_existing([Path(opp_env)] if opp_env else [home / "opp"])
    opapi = _first_existing([home / "lib64" / "libopapi.so", home / "lib" / "libopapi.so"])
    version = _read_version(home)
    return Cann(home, source, version, opp, opapi,
                None if version else f"CANN at {home} has no readable version file "
                f"({', '.join(VERSION_FILES)})")


def _torch_minor(version: str) -> Tuple[str, ...]:
    return tuple(re.split(r"[.+]", version)[:2])


def find_torch_npu() -> TorchNpu:
    """Locate torch_npu without importing it; checks its version against torch's major.minor."""
    import torch

    spec = importlib.util.find_spec("torch_npu")
    if spec is None or not spec.origin:
        return TorchNpu(None, None, f"torch_npu is not importable; install the torch_npu release "
                        f"matching torch {torch.__version__} (`pip install torch-npu=="
                        f"{torch.__version__.split('+')[0]}`) on a machine with CANN")
    root = Path(spec.origin).parent
    try:
        version = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        text = (root / "version.py").read_text() if (root / "version.py").is_file() else ""
        match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
        version = match.group(1) if match else None
    problem = None
    if version and _torch_minor(version) != _torch_minor(torch.__version__):
        problem = (f"torch_npu {version} is built for torch {'.'.join(_torch_minor(version))}.*, "
                   f"but torch is {torch.__version__}; install matching versions")
    return TorchNpu(root, version, problem)


def soc_family(device_name: str) -> str:
    """The registry's SoC family of a runtime device name: ``Ascend910_9391`` -> ``ascend910_93``,
    ``Ascend910B3`` -> ``ascend910b``, ``Ascend310P3`` -> ``ascend310p``."""
    name = device_name.strip().lower()
    match = re.match(r"(ascend910_93|ascend910b|ascend310p|ascend310b|ascend910|ascend950|ascend310)",
                     name)
    return match.group(1) if match else name


def find_soc(runtime: bool = True) -> Soc:
    """The SoC: from the runtime (imports torch_npu; only when ``runtime`` and it is
    importable), else ``$CAM_JIT_NPU_SOC``, else unknown."""
    if runtime and importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401  (registers the NPU device with torch)
            import torch

            if torch.npu.is_available() and torch.npu.device_count() > 0:
                name = torch.npu.get_device_name(0)
                return Soc(soc_family(name), name, "the NPU runtime (torch.npu.get_device_name)")
        except Exception as e:  # a broken runtime must not break discovery
            runtime_error = f"the NPU runtime failed ({type(e).__name__}: {e})"
        else:
            runtime_error = "torch_npu sees no NPU device"
    else:
        runtime_error = "torch_npu is not importable"
    value = os.environ.get(SOC_ENV)
    if value:
        return Soc(soc_family(value), value, f"{SOC_ENV} ({runtime_error})")
    return Soc(None, None, f"unknown: {runtime_error} and {SOC_ENV} is not set")


def find_shmem() -> Shmem:
    """SHMEM from ``SHMEM_HOME_PATH`` (a directory holding ``libshmem*.so`` under lib/ or lib64/,
    possibly below a ``shmem/`` folder)."""
    value = os.environ.get("SHMEM_HOME_PATH")
    if not value:
        return Shmem(None, None, "SHMEM_HOME_PATH is not set; install SHMEM and source its "
                     "set_env.sh (or set SHMEM_HOME_PATH to its install directory)")
    home = Path(value)
    if not home.is_dir():
        return Shmem(home, None, f"SHMEM_HOME_PATH={value} is not a directory")
    for sub in ("lib", "lib64", "shmem/lib", "shmem/lib64"):
        found = sorted((home / sub).glob("libshmem*.so*"))
        if found:
            return Shmem(home, found[0])
    return Shmem(home, None, f"SHMEM_HOME_PATH={value} has no libshmem*.so under lib/, lib64/ "
                 "or shmem/lib/")
