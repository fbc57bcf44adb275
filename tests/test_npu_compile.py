"""The NPU compile check: every wrapper translation unit compiles against torch_npu's headers.

The torch_npu wheel matching torch is fetched with ``pip download --no-deps`` into a cache
(``$CAM_JIT_TEST_WHEEL_DIR`` or ``~/.cache/cam_jit-test-wheels``) and only its headers and
version file are extracted, to a temporary directory that is never on ``sys.path``: the wheel is
never installed (its backend autoload entry point would break ``import torch`` here). Without
network access to the package registry the test skips and says so.
"""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from cam_jit.ascend import build
from cam_jit.jit.spec import BuildSpec

REPO = Path(__file__).resolve().parents[1]
TORCH_NPU_VERSION = torch.__version__.split("+")[0]  # torch_npu releases follow torch's version


def wheel_dir() -> Path:
    return Path(os.environ.get("CAM_JIT_TEST_WHEEL_DIR") or
                Path.home() / ".cache" / "cam_jit-test-wheels")


def fetch_wheel() -> Path:
    """The cached torch_npu wheel, downloaded first if needed; skips without registry access."""
    directory = wheel_dir()
    pattern = f"torch_npu-{TORCH_NPU_VERSION}-*.whl"
    found = sorted(directory.glob(pattern))
    if found:
        return found[-1]
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"torch-npu=={TORCH_NPU_VERSION}", "-d", str(directory)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"`{' '.join(cmd)}` timed out: no usable access to the package registry")
    found = sorted(directory.glob(pattern))
    if run.returncode != 0 or not found:
        tail = " | ".join((run.stdout + run.stderr).strip().splitlines()[-3:])
        pytest.skip(f"cannot fetch torch-npu=={TORCH_NPU_VERSION} (no network access to the "
                    f"package registry?): {tail}")
    return found[-1]


@pytest.fixture(scope="module")
def torch_npu_root(tmp_path_factory):
    """A directory holding ``torch_npu/include`` and ``torch_npu/version.py`` from the wheel."""
    root = tmp_path_factory.mktemp("torch_npu_wheel")
    with zipfile.ZipFile(fetch_wheel()) as wheel:
        members = [m for m in wheel.namelist()
                   if m.startswith("torch_npu/include/") or m == "torch_npu/version.py"]
        wheel.extractall(root, members)
    return root


def test_every_wrapper_compiles_against_the_torch_npu_headers(torch_npu_root):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "cam_jit", "build", "--backend", "npu",
                          "--compile-only", "--torch-npu-root", str(torch_npu_root)],
                         capture_output=True, text=True, timeout=900, cwd="/", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    sources = sorted(p.name for p in build.wrappers_dir().glob("*.cpp"))
    compiled = sorted(Path(line.split()[1]).name for line in run.stdout.splitlines()
                      if line.startswith("ok"))
    assert compiled == sources and "npu_runtime.cpp" in sources
    assert f"{len(sources)}/{len(sources)} translation units of the npu backend compile" in run.stderr
    assert f"{TORCH_NPU_VERSION} torch_npu headers from {torch_npu_root}/torch_npu" in run.stderr


def test_spec_carries_torch_npu_facts_in_key_and_flags(torch_npu_root, monkeypatch):
    monkeypatch.setenv("CAM_JIT_NPU_SOC", "Ascend910_9392")
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    spec = build.npu_spec(torch_npu_root, runtime_soc=False)
    package = torch_npu_root / "torch_npu"
    assert spec.extra_key["torch_npu"] == TORCH_NPU_VERSION
    assert spec.extra_key["soc"] == "ascend910_93"
    assert f"-I{package / 'include'}" in spec.cflags and "-DCAM_JIT_NPU_NS=_cam_jit_npu" in spec.cflags
    assert "-ltorch_npu" in spec.ldflags and f"-L{package / 'lib'}" in spec.ldflags


def test_compile_failure_shows_the_first_compiler_errors(tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int ok() { return 1; }\nint broken() { return undeclared_name; }\n")
    good = tmp_path / "good.cpp"
    good.write_text("int fine() { return 2; }\n")
    spec = BuildSpec(backend="t", name="t", root=tmp_path, sources=(bad, good))
    results = {r.source.name: r for r in build.compile_only(spec)}
    assert results["good.cpp"].errors == ()
    errors = results["bad.cpp"].errors
    assert errors and "undeclared_name" in errors[0] and "error" in errors[0]
    assert "-std=c++" in results["bad.cpp"].command and "-fPIC" in results["bad.cpp"].command


def test_cli_without_torch_npu_headers_fails_clearly(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "cam_jit", "build", "--backend", "npu",
                          "--compile-only", "--torch-npu-root", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd="/", env=env)
    assert run.returncode == 1 and "holds no torch_npu headers" in run.stderr
    assert "Traceback" not in run.stderr
