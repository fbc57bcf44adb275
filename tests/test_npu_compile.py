"""The NPU compile check: every wrapper translation unit compiles against torch_npu's headers.

The torch_npu wheel matching torch comes from the test wheel cache (tests/wheel_cache.py:
``$CAM_JIT_TEST_WHEEL_DIR``, default under pytest's cache directory) and only its headers and
version file are extracted, to a temporary directory that is never on ``sys.path``: the wheel is
never installed (its backend autoload entry point would break ``import torch`` here). Without
network access to the package registry the test skips and says so.
"""
import dataclasses
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cam_jit.ascend import build, report
from cam_jit.jit.spec import BuildSpec

import wheel_cache
from wheel_cache import TORCH_NPU_VERSION

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def torch_npu_root(tmp_path_factory):
    """A directory holding ``torch_npu/include`` and ``torch_npu/version.py`` from the wheel."""
    root = tmp_path_factory.mktemp("torch_npu_wheel")
    with zipfile.ZipFile(wheel_cache.torch_npu_wheel()) as wheel:
        members = [m for m in wheel.namelist()
                   if m.startswith("torch_npu/include/") or m == "torch_npu/version.py"]
        wheel.extractall(root, members)
    return root


def test_every_wrapper_compiles_against_the_torch_npu_headers(torch_npu_root):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("SHMEM_HOME_PATH", None)
    run = subprocess.run([sys.executable, "-m", "cam_jit", "build", "--backend", "npu",
                          "--compile-only", "--torch-npu-root", str(torch_npu_root)],
                         capture_output=True, text=True, timeout=900, cwd="/", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    sources = sorted(p.name for p in build.wrappers_dir().glob("*.cpp") if p.name != "zb_shmem.cpp")
    compiled = sorted(Path(line.split()[1]).name for line in run.stdout.splitlines()
                      if line.startswith("ok"))
    assert compiled == sources and "npu_runtime.cpp" in sources
    assert f"{len(sources)}/{len(sources)} translation units of the npu backend compile" in run.stderr
    assert f"{TORCH_NPU_VERSION} torch_npu headers from {torch_npu_root}/torch_npu" in run.stderr
    assert "cam_jit: FusedDeepMoeBuffer on NPU: excluded (SHMEM_HOME_PATH not set)" in run.stderr


# A stand-in for Ascend SHMEM's host API (declarations only, written for this test from the API
# names and types: aclshmemx_init_attr with a bootstrap flag and the attribute struct, init status,
# aclshmem_malloc/free/finalize). MALLOC is dropped by the test that checks the header is used.
SHMEM_STANDIN = """#pragma once
#include <cstddef>
#include <cstdint>
enum aclshmemx_bootstrap_t : int { ACLSHMEMX_INIT_WITH_DEFAULT = 1 << 2 };
enum { ACLSHMEM_STATUS_NOT_INITIALIZED = 0, ACLSHMEM_STATUS_SHM_CREATED, ACLSHMEM_STATUS_IS_INITIALIZED };
struct aclshmem_init_optional_attr_t { int version; int data_op_engine_type; uint32_t timeouts[3]; int32_t sock_fd; };
typedef struct aclshmemx_init_attr_t {
  int my_pe; int n_pes; char ip_port[64] = {}; uint64_t local_mem_size;
  aclshmem_init_optional_attr_t option_attr = {1, 1, {120, 120, 120}, -1};
  void* comm_args = nullptr; uint64_t instance_id = 0;
} aclshmemx_init_attr_t;
extern "C" {
int32_t aclshmemx_set_conf_store_tls(bool enable, const char* tls_info, const uint32_t tls_info_len);
int aclshmemx_init_attr(aclshmemx_bootstrap_t bootstrap_flags, aclshmemx_init_attr_t* attributes);
int aclshmemx_init_status(void);
MALLOC
void aclshmem_free(void* ptr);
int aclshmem_finalize(void);
}
"""


def shmem_home(tmp_path, with_malloc=True):
    home = tmp_path / "shmem"
    (home / "include").mkdir(parents=True)
    malloc = "void* aclshmem_malloc(size_t size);" if with_malloc else ""
    (home / "include" / "shmem.h").write_text(SHMEM_STANDIN.replace("MALLOC", malloc))
    return home


def test_shmem_wrapper_is_built_only_with_shmem(torch_npu_root, tmp_path, monkeypatch):
    monkeypatch.delenv("SHMEM_HOME_PATH", raising=False)
    spec = build.npu_spec(torch_npu_root, runtime_soc=False)
    assert "zb_shmem.cpp" not in [p.name for p in spec.sources] and "shmem_home" not in spec.extra_key
    assert not any("SHMEM" in f or "shmem" in f for f in spec.cflags + spec.ldflags)
    monkeypatch.setenv("SHMEM_HOME_PATH", str(tmp_path))
    assert "no include/shmem.h or shmem/include/shmem.h under SHMEM_HOME_PATH=" in build.shmem_part().excluded
    assert "zb_shmem.cpp" not in [p.name for p in build.npu_spec(torch_npu_root, runtime_soc=False).sources]

    home = shmem_home(tmp_path)
    monkeypatch.setenv("SHMEM_HOME_PATH", str(home))
    spec = build.npu_spec(torch_npu_root, runtime_soc=False)
    assert "zb_shmem.cpp" in [p.name for p in spec.sources] and spec.extra_key["shmem_home"] == str(home)
    assert "-DCAM_JIT_WITH_SHMEM" in spec.cflags and f"-I{home / 'include'}" in spec.cflags
    assert "-lshmem" in spec.ldflags and f"-L{home / 'lib'}" in spec.ldflags


@pytest.mark.parametrize("with_malloc", [True, False])
def test_shmem_wrapper_compiles_against_a_stand_in_shmem_header(torch_npu_root, tmp_path, monkeypatch,
                                                                with_malloc):
    monkeypatch.setenv("SHMEM_HOME_PATH", str(shmem_home(tmp_path, with_malloc)))
    spec = build.npu_spec(torch_npu_root, runtime_soc=False)
    spec = dataclasses.replace(spec, sources=tuple(p for p in spec.sources if p.name == "zb_shmem.cpp"))
    (result,) = build.compile_only(spec)
    if with_malloc:
        assert result.errors == (), result.errors
    else:  # the header is really used: without aclshmem_malloc the wrapper does not compile
        assert result.errors and "aclshmem_malloc" in result.errors[0]


def test_doctor_reports_the_shmem_wrapper(tmp_path, monkeypatch):
    monkeypatch.delenv("SHMEM_HOME_PATH", raising=False)
    text = "\n".join(report.lines(report.discover_stack(runtime_soc=False)))
    assert "FusedDeepMoeBuffer on NPU: excluded (SHMEM_HOME_PATH not set)" in text
    monkeypatch.setenv("SHMEM_HOME_PATH", str(shmem_home(tmp_path)))
    text = "\n".join(report.lines(report.discover_stack(runtime_soc=False)))
    assert "FusedDeepMoeBuffer on NPU: included in the NPU build" in text and "excluded" not in text


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
