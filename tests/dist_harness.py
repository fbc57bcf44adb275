"""Multi-rank test harness: a pool of ``R`` worker processes sharing one gloo process group.

Usage::

    pool = RankPool(4)                        # spawns 4 workers, init_process_group("gloo")
    outs = pool.run(fn, *args, **kwargs)      # fn(*args, **kwargs) on every rank -> [out_0..out_3]
    outs = pool.run_with_timeout(10, fn, ...) # same with a per-call timeout (seconds)
    pool.close()                              # also done at interpreter exit

* ``fn`` must be a module-level (picklable) function; it finds its rank with
  ``torch.distributed.get_rank()``. Arguments and results travel by plain pickle (tensors are
  copied), through one pipe per worker.
* Workers are started with the multiprocessing "spawn" context, with the parent's ``sys.path``
  and environment (snapshot at pool creation), ``torch.set_num_threads(threads)`` (default 1) and
  ``init_process_group("gloo", init_method="tcp://127.0.0.1:<free port>")``. The port comes from
  binding a socket to port 0; if another process grabs it first, start-up is retried on a new one.
* A remote exception is re-raised in the parent: the original exception object (when it
  unpickles; :class:`RemoteError` otherwise), chained from a :class:`RemoteTraceback` that holds
  the remote traceback text, with ``exc.rank`` set and a note naming the rank. When only some
  ranks fail, the others are given ``error_grace`` seconds to finish (they are usually stuck in a
  collective); if they do not, the pool is killed (``pool.closed`` becomes True).
* A task that exceeds its timeout kills the whole pool and raises :class:`TimeoutError` naming the
  ranks that did not answer. A worker that dies kills the pool and raises :class:`RemoteError`.
* Workers exit by themselves when the parent process disappears.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Dict, List, Optional

__all__ = ["RankPool", "RemoteError", "RemoteTraceback", "free_port"]

DEFAULT_TIMEOUT = 120.0


class RemoteTraceback(Exception):
    """Carries the text of a traceback raised in a worker (used as ``__cause__``)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class RemoteError(RuntimeError):
    """A worker failed in a way that cannot be represented by its own exception object."""

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0 then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------
def _parent_watchdog(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def _worker_main(rank, world, port, conn, sys_path, environ, threads, init_timeout, parent_pid):
    sys.path[:] = sys_path
    os.environ.clear()
    os.environ.update(environ)
    threading.Thread(target=_parent_watchdog, args=(parent_pid,), daemon=True).start()
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            pass
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=init_timeout))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send_bytes(pickle.dumps(("init_error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    try:
        while True:
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                task = pickle.loads(msg)
            except BaseException as exc:  # noqa: BLE001
                conn.send_bytes(_error_reply(exc))
                continue
            if task is None:  # close request
                break
            fn, args, kwargs = task
            try:
                reply = ("ok", fn(*args, **kwargs))
                data = pickle.dumps(reply)
            except BaseException as exc:  # noqa: BLE001
                data = _error_reply(exc)
            conn.send_bytes(data)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _error_reply(exc: BaseException) -> bytes:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # must round-trip in the parent too
    except Exception:  # noqa: BLE001
        blob = None
    return pickle.dumps(("err", text, blob, f"{type(exc).__name__}: {exc}"))


# ----------------------------------------------------------------------------------------------
# parent side
# ----------------------------------------------------------------------------------------------
_LIVE_POOLS: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


class RankPool:
    """``world_size`` spawned worker processes in one gloo process group (see module doc).

    Args:
        world_size: number of ranks ``R >= 1``.
        timeout: default per-task timeout in seconds.
        init_timeout: seconds allowed for start-up (spawn + import torch + rendezvous); also the
            gloo collective timeout inside the workers.
        threads: ``torch.set_num_threads`` in each worker.
        error_grace: seconds the other ranks get to finish after one rank raised.
    """

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT,
                 init_timeout: float = 120.0, threads: int = 1, error_grace: float = 10.0,
                 start_attempts: int = 3):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = int(world_size)
        self.timeout = float(timeout)
        self.init_timeout = float(init_timeout)
        self.threads = int(threads)
        self.error_grace = float(error_grace)
        self._procs: List[mp.process.BaseProcess] = []
        self._conns: list = []
        self.closed = True
        self.port: Optional[int] = None
        last = None
        for _ in range(max(1, start_attempts)):
            try:
                self._start()
                break
            except _StartError as exc:
                last = exc
                self._kill()
        else:
            raise RuntimeError(f"RankPool({world_size}): could not start the workers:\n{last}")
        _LIVE_POOLS.add(self)

    # -- lifecycle -----------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.port = free_port()
        env = dict(os.environ)
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main, name=f"rank_pool_{self.world_size}_r{rank}", daemon=True,
                args=(rank, self.world_size, self.port, child_conn, list(sys.path), env,
                      self.threads, self.init_timeout, os.getpid()))
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self.closed = False
        deadline = time.monotonic() + self.init_timeout + 30.0
        pending = set(range(self.world_size))
        while pending:
            replies = self._wait(pending, deadline)
            if replies is None:
                raise _StartError(f"ranks {sorted(pending)} did not start within "
                                  f"{self.init_timeout + 30:.0f}s (port {self.port})")
            for rank, reply in replies.items():
                pending.discard(rank)
                if reply[0] != "ready":  # e.g. the port was taken: fail fast, retry
                    raise _StartError(f"rank {rank} (port {self.port}): {reply[1]}")

    @property
    def pids(self) -> List[int]:
        """Worker process ids, in rank order."""
        return [p.pid for p in self._procs]

    def close(self) -> None:
        """Ask the workers to leave the process group and exit; kill what does not. Idempotent."""
        if self.closed and not self._procs:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
        self._procs, self._conns = [], []
        self.closed = True
        _LIVE_POOLS.discard(self)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pids={self.pids}"
        return f"RankPool(world_size={self.world_size}, {state})"

    # -- tasks ---------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank with the pool's default timeout."""
        return self.run_with_timeout(self.timeout, fn, *args, **kwargs)

    def run_with_timeout(self, timeout: float, fn: Callable, *args, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self.closed:
            raise RuntimeError(f"{self!r} is closed")
        payload = pickle.dumps((fn, args, kwargs))
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError as exc:  # the worker is gone
                self._kill()
                raise RemoteError(f"RankPool({self.world_size}): cannot reach rank {rank} "
                                  f"({exc}); the pool was killed", rank=rank) from exc
        name = getattr(fn, "__qualname__", repr(fn))
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        results: Dict[int, Any] = {}
        errors: Dict[int, tuple] = {}
        grace_started = False
        while pending:
            if errors and not grace_started:  # the others may be stuck in a collective
                deadline = min(deadline, time.monotonic() + self.error_grace)
                grace_started = True
            replies = self._wait(pending, deadline)
            if replies is None:
                break
            for rank, reply in replies.items():
                pending.discard(rank)
                if reply[0] == "ok":
                    results[rank] = reply[1]
                else:
                    errors[rank] = reply
        if pending:
            self._kill()
            if errors:
                raise self._remote_exception(errors, name, note=(
                    f"ranks {sorted(pending)} did not finish within {self.error_grace:.0f}s "
                    f"after the failure; the pool of {self.world_size} was killed"))
            raise TimeoutError(f"RankPool({self.world_size}): task {name} exceeded {timeout:g}s; "
                               f"ranks {sorted(pending)} did not answer; the pool was killed")
        if errors:
            raise self._remote_exception(errors, name)
        return [results[r] for r in range(self.world_size)]

    def _wait(self, pending, deadline) -> Optional[Dict[int, tuple]]:
        """Replies of some pending ranks, or None at the deadline. A dead worker -> RemoteError."""
        by_conn = {self._conns[r]: r for r in pending}
        by_sentinel = {self._procs[r].sentinel: r for r in pending}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready = _mp_wait(list(by_conn) + list(by_sentinel), timeout=remaining)
        if not ready:
            return None
        replies = {}
        for obj in ready:
            if obj in by_conn and by_conn[obj] not in replies:
                rank = by_conn[obj]
                try:
                    replies[rank] = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    replies[rank] = None
        for obj in ready:
            rank = by_sentinel.get(obj)
            if rank is not None and rank not in replies:
                replies[rank] = None
        dead = [r for r, rep in replies.items() if rep is None]
        if dead:
            codes = {r: self._procs[r].exitcode for r in dead}
            self._kill()
            raise RemoteError(f"RankPool({self.world_size}): worker(s) {dead} died "
                              f"(exit codes {codes}); the pool was killed", rank=dead[0])
        return replies

    def _remote_exception(self, errors: Dict[int, tuple], name: str, note: str = "") -> BaseException:
        rank = min(errors)
        _, text, blob, summary = errors[rank]
        exc = None
        if blob is not None:
            try:
                exc = pickle.loads(blob)
            except Exception:  # noqa: BLE001
                exc = None
        header = (f"task {name} failed on rank {rank} of {self.world_size}"
                  + (f" (also failed on ranks {sorted(set(errors) - {rank})})"
                     if len(errors) > 1 else "") + (f"; {note}" if note else ""))
        if not isinstance(exc, BaseException):
            exc = RemoteError(f"{header}: {summary}", rank=rank)
        try:
            exc.rank = rank
        except Exception:  # noqa: BLE001
            pass
        if hasattr(exc, "add_note"):
            exc.add_note(header)
        exc.__cause__ = RemoteTraceback(f"\n[{header}] remote traceback:\n{text}")
        return exc


class _StartError(Exception):
    pass
