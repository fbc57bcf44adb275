"""The test suite never writes into the user's home (tests/conftest.py): the JIT cache of a test
session is temporary (or CAM_JIT_TEST_CACHE_DIR), the torch-npu wheel goes to pytest's cache
directory (or CAM_JIT_TEST_WHEEL_DIR)."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cam_jit import jit

REPO = Path(__file__).resolve().parent.parent
# pieces that build the CPU backend and the NPU wrapper harness, and fetch and read the wheel
PIECES = ["tests/test_first_use.py::test_readme_single_rank_snippet_passes_strict_mode",
          "tests/test_npu_marshalling.py::test_every_registry_op_has_a_private_op",
          "tests/test_npu_compile.py::test_spec_carries_torch_npu_facts_in_key_and_flags"]


def _tree(root: Path):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*")) if root.exists() else None


def test_session_cache_is_temporary_and_outside_home():
    cache = jit.cache_dir()
    assert cache != Path.home() / ".cache" / "cam_jit"
    if not os.environ.get("CAM_JIT_TEST_CACHE_DIR"):
        assert cache.parent == Path(tempfile.gettempdir()) and cache.name.startswith("cam_jit-test-cache-")
    assert not Path(os.environ["CAM_JIT_TEST_WHEEL_DIR"]).is_relative_to(Path.home())


def test_suite_pieces_leave_the_users_cam_jit_cache_as_it_was(tmp_path):
    home = tmp_path / "home"
    user_cache = home / ".cache" / "cam_jit"
    (user_cache / "cpu").mkdir(parents=True)
    (user_cache / "cpu" / "marker").write_text("the user's own entry")
    before = _tree(home / ".cache")
    env = {k: v for k, v in os.environ.items() if k not in ("CAM_JIT_CACHE_DIR", "CAM_JIT_TEST_WHEEL_DIR")}
    # reuse this session's builds (the inner session would otherwise compile them again); the
    # inner session's own defaults are checked by the test above
    env.update(HOME=str(home), CAM_JIT_TEST_CACHE_DIR=str(jit.cache_dir()), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *PIECES], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-2000:]
    assert _tree(home / ".cache") == before, sorted(p.name for p in (home / ".cache").iterdir())
