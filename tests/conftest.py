"""Shared pytest fixtures.

``rank_pool``: session-scoped factory. ``rank_pool(R)`` returns a :class:`dist_harness.RankPool`
of ``R`` spawned gloo ranks, cached per ``R`` for the whole session (so every test shares the
process groups; ``R = 1`` is a real one-process pool too, with a world-size-1 gloo group). A pool
killed by a timeout or a failure is replaced transparently on the next request. Extra keyword
arguments (``timeout=...``) apply only when the pool is created; use ``pool.run_with_timeout``
for a per-call timeout. All pools are closed at session end.

Example::

    def _body(n):                      # module level, so workers can unpickle it
        import torch.distributed as dist
        return dist.get_rank() * n

    def test_x(rank_pool):
        assert rank_pool(2).run(_body, 10) == [0, 10]

Caches: the suite never writes into the user's home. At configure time the session gets
- a temporary cam_jit JIT cache, exported as ``CAM_JIT_CACHE_DIR`` so that every subprocess and
  rank pool shares it: the CPU backend compiles once per session, and the directory is removed
  at the end (``CAM_JIT_TEST_CACHE_DIR=DIR`` uses DIR instead and keeps it, to reuse builds
  across sessions);
- the torch-npu wheel cache of tests/wheel_cache.py, exported as ``CAM_JIT_TEST_WHEEL_DIR``:
  as given, else ``cam_jit-test-wheels`` under pytest's cache directory (``.pytest_cache/d/``).
The directory holding the ``cam_jit`` this session imports is put first on ``PYTHONPATH``, so that
the scripts the tests start (samples, benchmarks, CLI) run the same package, installed or not.
"""
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from dist_harness import RankPool  # noqa: E402
from wheel_cache import PYTEST_CACHE_KEY, WHEEL_DIR_VAR  # noqa: E402

SESSION_CACHE_VAR = "CAM_JIT_TEST_CACHE_DIR"
_created_cache = []


def pytest_configure(config):
    found = importlib.util.find_spec("cam_jit")
    if found is not None:
        package = os.path.dirname(os.path.dirname(found.origin))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH")) if p)
    kept = os.environ.get(SESSION_CACHE_VAR)
    if kept:
        os.environ["CAM_JIT_CACHE_DIR"] = kept
    else:
        _created_cache.append(tempfile.mkdtemp(prefix="cam_jit-test-cache-"))
        os.environ["CAM_JIT_CACHE_DIR"] = _created_cache[-1]
    if not os.environ.get(WHEEL_DIR_VAR):
        cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
        os.environ[WHEEL_DIR_VAR] = str(cache.mkdir(PYTEST_CACHE_KEY) if cache is not None else
                                        Path(config.rootpath) / ".pytest_cache" / "d" / PYTEST_CACHE_KEY)


def pytest_unconfigure(config):
    while _created_cache:
        shutil.rmtree(_created_cache.pop(), ignore_errors=True)


@pytest.fixture(scope="session")
def rank_pool():
    pools = {}

    def get(world_size: int, **kwargs) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or pool.closed:
            pool = pools[world_size] = RankPool(world_size, **kwargs)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def npu_harness():
    """The NPU wrapper library built with the test runtime and the stand-in SHMEM
    (tests/npu_sim/standin.py): (op namespace, ctypes library)."""
    from npu_sim import standin

    return standin.build_harness()
