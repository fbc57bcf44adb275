"""Tests of the ``python -m cam_jit`` command line (build, clean, doctor, ops)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cam_jit
from cam_jit import jit
from cam_jit.__main__ import main
from cam_jit.jit import core
from test_jit_engine import hold_lock

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "jit_data"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A private cache per test, a registered tiny backend, no memoised loads."""
    path = tmp_path / "cache"
    monkeypatch.setenv("CAM_JIT_CACHE_DIR", str(path))
    monkeypatch.delenv("CAM_JIT_DISABLE_JIT", raising=False)
    monkeypatch.setattr(core, "_LOADED", {})
    spec = jit.BuildSpec(backend="tiny", name="t_cli_tiny", root=DATA,
                         sources=(DATA / "tiny.cpp",), headers=(DATA / "tiny.h",))
    monkeypatch.setitem(jit.BACKENDS, "tiny", jit.Backend("tiny", lambda: spec, lambda: None))
    return path


def test_build_prints_the_entry_then_doctor_lists_it_then_clean_removes_it(capsys):
    assert main(["build", "--backend", "tiny"]) == 0
    out, err = capsys.readouterr()
    entry = Path(out.strip())
    assert (entry / "manifest.json").is_file() and "was built" in err
    assert main(["build", "--backend", "tiny"]) == 0  # memoised in this process: no rebuild
    assert Path(capsys.readouterr().out.strip()) == entry

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for expected in (torch.__version__, torch.version.git_version, cam_jit.__version__,
                     "numpy", "compiler", "ninja", str(jit.cache_dir()), "cache entries: 1",
                     f"tiny   {entry.parent.name}/{entry.name}", "verified",
                     "npu    unavailable: torch_npu is not importable",
                     f"tiny   available: ready: cache entry {entry}"):
        assert expected in out, (expected, out)

    assert main(["clean", "--backend", "tiny"]) == 0
    out = capsys.readouterr().out
    assert f"removed {entry}" in out and "1 entries removed" in out and not entry.exists()


def test_clean_skips_an_entry_being_built(capsys):
    assert main(["build", "--backend", "tiny"]) == 0
    entry = Path(capsys.readouterr().out.strip())
    holder = hold_lock(f"{entry}.lock", 60)
    try:
        assert main(["clean"]) == 0
        assert f"skipped {entry}" in capsys.readouterr().out and entry.is_dir()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.communicate()
    assert main(["clean"]) == 0 and not entry.exists()


def test_ops_prints_the_op_registry(capsys):
    from cam_jit.ops import describe_ops

    import cam_jit

    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    ops = describe_ops()
    assert {op["name"] for op in ops} >= {
        f"cam_jit::{name}" for name in ("fused_deep_moe", "moe_dispatch_lowlatency", "moe_combine_lowlatency", "a2e",
                                        "e2a", "all2_all_detour", "reduce_scatter_detour", "cam_get_comm",
                                        "cam_free_comm", "moe_dispatch_layout", "moe_notify_dispatch",
                                        "moe_dispatch_normal", "moe_combine_normal")}
    for op in ops:
        line = next(line for line in out.splitlines() if line.split()[0] == op["name"])
        assert "CPU" in op["backends"] and "Meta" in op["backends"], op
        assert all(backend in line for backend in op["backends"]) and op["ge_converter"] in line
        assert callable(getattr(cam_jit, op["python_api"].split(".")[1]))


def test_module_entry_point_in_a_fresh_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), CAM_JIT_CACHE_DIR=str(tmp_path / "cache"),
               CAM_JIT_DISABLE_JIT="1")
    run = subprocess.run([sys.executable, "-m", "cam_jit", "build", "--backend", "cpu"],
                         env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert run.returncode == 1 and run.stdout == ""
    assert "CAM_JIT_DISABLE_JIT=1" in run.stderr and "python -m cam_jit build" in run.stderr
    assert "Traceback" not in run.stderr


def _script(tmp_path) -> Path:
    """A `cam-jit` console script as pip writes it for the wheel's entry point."""
    path = tmp_path / "bin" / "cam-jit"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!{sys.executable}\nimport sys\nfrom cam_jit_cli import main\n"
                    "if __name__ == '__main__':\n    sys.exit(main())\n")
    path.chmod(0o755)
    return path


def _run_script(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONPROFILEIMPORTTIME="1")
    run = subprocess.run([str(_script(tmp_path)), *args], capture_output=True, text=True, timeout=300, cwd="/",
                         env=env)
    imported = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    stderr = "\n".join(line for line in run.stderr.splitlines() if not line.startswith("import time:"))
    return run, imported, stderr


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["ops"], ["docs", "0.7"], ["build", "--help"]])
def test_script_answers_without_importing_torch(tmp_path, args):
    run, imported, stderr = _run_script(tmp_path, *args)
    assert run.returncode == 0, stderr
    assert "torch" not in imported and "cam_jit" not in imported, sorted(imported)[:20]
    if args[0] in ("--help", "build"):
        assert run.stdout.startswith(f"usage: cam-jit {'build ' if args[0] == 'build' else ''}["), run.stdout
    if args == ["--version"]:
        assert run.stdout == f"cam_jit {cam_jit.__version__}\n"
    if args == ["ops"]:
        from cam_jit.ops import describe_ops

        lines = run.stdout.splitlines()
        for op in describe_ops():
            line = next(line for line in lines if line.split()[0] == op["name"])
            assert line.endswith(op["ge_converter"]), line
        assert len(lines) == len(describe_ops()) and "cam-jit ops --backends" in stderr


def test_script_runs_the_other_commands_with_the_package(tmp_path):
    run, imported, stderr = _run_script(tmp_path, "ops", "--backends")
    assert run.returncode == 0 and "torch" in imported, stderr
    assert "CPU, Meta" in run.stdout and "PrivateUse1" not in run.stdout
    run, imported, stderr = _run_script(tmp_path, "build", "--backend", "nope")
    assert run.returncode == 2 and "usage: cam-jit" in stderr and "expected one of cpu" in stderr, stderr


def test_module_usage_names_python_m_and_ops_says_npu(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m cam_jit [")
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert "PrivateUse1" not in out and "cam_jit::fused_deep_moe" in out
    from cam_jit.ops import describe_ops

    assert all(set(op["backends"]) <= {"CPU", "Meta", "NPU"} for op in describe_ops())


def test_doctor_columns_align_with_long_backend_names(capsys, monkeypatch):
    spec = jit.BuildSpec(backend="tiny_long_backend", name="t_cli_tiny_long", root=DATA,
                         sources=(DATA / "tiny.cpp",), headers=(DATA / "tiny.h",))
    monkeypatch.setitem(jit.BACKENDS, spec.backend, jit.Backend(spec.backend, lambda: spec, lambda: None))
    for backend in ("tiny", spec.backend):
        assert main(["build", "--backend", backend]) == 0
    capsys.readouterr()
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    entries = lines[lines.index("cache entries: 2") + 1:][:2]
    keys = [line.index(line.split()[1]) for line in entries]
    assert keys[0] == keys[1], entries  # the key column starts at the same place
    backends = lines[lines.index("backends:") + 1:]
    states = [line.index(" available" if " available" in line else " unavailable") for line in backends
              if line.startswith("  ") and ("available" in line)]
    assert len(set(states)) == 1, backends
