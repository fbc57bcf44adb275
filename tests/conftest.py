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
"""
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from dist_harness import RankPool  # noqa: E402


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
