"""The rendezvous of cam_get_comm and FusedDeepMoeBuffer.init (cam_jit/ops/_rendezvous.py): it
listens where it is asked to (loopback for 127.0.0.1, checked in the kernel's socket table),
admits only members of the job (the per-job secret, or the same user on loopback), bounds every
wait (a silent server, a stopped rank 0), and leaves nothing behind (100 init/close cycles; names
of segments whose creator died)."""
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cam_jit import cam_free_comm, cam_get_comm
from cam_jit.ops._rendezvous import INSECURE_ENV, TOKEN_ENV, Rendezvous, RendezvousError
from cam_jit.zero_buffer import FusedDeepMoeBuffer
from cam_jit.zero_buffer._heap import segment_name, zb_kernels
from dist_harness import free_port
from test_comm import _resources
from test_jit_engine import as_nobody

REPO = Path(__file__).resolve().parents[1]
SMALL_MEMSIZE = 4 << 20


def _listening():
    """{inode: (address, port)} of the TCP sockets this process listens on (kernel's view)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in mine:  # LISTEN
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    host = socket.inet_ntop(socket.AF_INET, raw[::-1]) if len(raw) == 4 else address
                    found[int(fields[9])] = (host, int(port, 16))
    return found


def _watch_listeners(during):
    """Runs during() while sampling this process's new listening sockets; returns
    (during()'s result, every new (address, port) seen, those still listening afterwards)."""
    before = set(_listening())
    seen, stop = set(), threading.Event()

    def sample():
        while not stop.is_set():
            seen.update(v for k, v in _listening().items() if k not in before)
            time.sleep(0.01)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        result = during()
    finally:
        stop.set()
        watcher.join()
    after = {v for k, v in _listening().items() if k not in before}
    return result, seen, after


def loopback_comm(port):
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(2.0)  # rank 0 listens meanwhile (the sampler needs to see it, even on a busy machine)
        cam_get_comm(30, 1, 2, f"127.0.0.1:{port}")
        cam_free_comm(30)
        return None
    _, seen, after = _watch_listeners(lambda: cam_get_comm(30, 0, 2, f"127.0.0.1:{port}"))
    cam_free_comm(30)
    return seen, after


def loopback_buffer(port):
    rank = dist.get_rank()
    buf = FusedDeepMoeBuffer()
    if rank == 1:
        time.sleep(2.0)
        buf.init(1, 2, SMALL_MEMSIZE, f"tcp://127.0.0.1:{port}")
        buf.close()
        return None
    _, seen, after = _watch_listeners(lambda: buf.init(0, 2, SMALL_MEMSIZE, f"tcp://127.0.0.1:{port}"))
    buf.close()
    return seen, after


@pytest.mark.parametrize("body", [loopback_comm, loopback_buffer], ids=["cam_get_comm", "FusedDeepMoeBuffer"])
def test_loopback_rendezvous_listens_on_loopback_only(rank_pool, body):
    port = free_port()
    seen, after = rank_pool(2).run(body, port)[0]
    assert ("127.0.0.1", port) in seen, seen  # the sampler saw the rendezvous listening
    assert {host for host, _ in seen} == {"127.0.0.1"}, seen  # and nothing else on another interface
    # the rendezvous (and cam_get_comm's store) closed once the group is formed; what is left is the
    # live group's own gloo listener, on loopback too
    assert ("127.0.0.1", port) not in after and {host for host, _ in after} <= {"127.0.0.1"}, after
    assert len(after) <= 1, after


def _member(host, port, rank, size, results, token=None, timeout=20.0):
    saved = os.environ.get(TOKEN_ENV)
    if token is not None:
        os.environ[TOKEN_ENV] = token
    try:
        with Rendezvous("test", host, port, rank, size, timeout) as members:
            results[rank] = members.exchange({"rank": rank})
    except (RendezvousError, ValueError) as err:
        results[rank] = err
    finally:
        if token is not None:
            if saved is None:
                del os.environ[TOKEN_ENV]
            else:
                os.environ[TOKEN_ENV] = saved


def _with_rank0(port, intruder, token=None):
    """Rank 0 (a thread) waits for rank 1; `intruder()` tries first; then the real rank 1 joins."""
    results = {}
    server = threading.Thread(target=_member, args=("127.0.0.1", port, 0, 2, results, token))
    server.start()
    time.sleep(0.2)
    refused = intruder()
    _member("127.0.0.1", port, 1, 2, results, token)
    server.join(30)
    return refused, results


def test_joiner_without_the_secret_is_refused(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "the-secret-of-this-job")
    port = free_port()

    def intruder():
        results = {}
        _member("127.0.0.1", port, 1, 2, results, token="a-guess", timeout=5.0)
        return results[1]

    refused, results = _with_rank0(port, intruder)
    assert isinstance(refused, RendezvousError), refused
    assert "rank 0 refused this process" in str(refused) and f"did not prove the secret of {TOKEN_ENV}" in str(refused)
    assert results == {0: [{"rank": 0}, {"rank": 1}], 1: [{"rank": 0}, {"rank": 1}]}  # the job formed anyway


def test_loopback_joiner_of_another_user_is_refused_without_a_secret(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    if os.geteuid() != 0:
        pytest.skip("running a joiner as another user (uid 65534 via setpriv) needs root")
    prefix = as_nobody()
    port = free_port()
    code = ("import sys; from cam_jit.ops._rendezvous import Rendezvous\n"
            f"try:\n    Rendezvous('intruder', '127.0.0.1', {port}, 1, 2, 10.0).exchange('me')\n"
            "except Exception as err:\n    print(err); sys.exit(7)\n")

    def intruder():
        run = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO), HOME="/nonexistent"))
        return run.returncode, run.stdout + run.stderr

    (code_, output), results = _with_rank0(port, intruder)
    assert code_ == 7 and "runs as uid 65534, not as this user" in output, output
    assert results[0] == results[1] == [{"rank": 0}, {"rank": 1}]


def test_non_loopback_address_needs_a_secret_or_an_opt_in(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(INSECURE_ENV, raising=False)
    with pytest.raises(ValueError, match=f"needs a per-job secret: set {TOKEN_ENV}"):
        cam_get_comm(31, 1, 2, "10.255.255.1:29999")
    with pytest.raises(ValueError, match=INSECURE_ENV):
        FusedDeepMoeBuffer().init(1, 2, SMALL_MEMSIZE, "tcp://10.255.255.1:29999")


def test_silent_server_raises_within_the_timeout(monkeypatch):
    monkeypatch.setenv("CAM_JIT_COMM_TIMEOUT", "1")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(RendezvousError, match="waiting for rank 0's greeting did not finish within 1 s"):
            cam_get_comm(32, 1, 2, f"127.0.0.1:{port}")
        with pytest.raises(RendezvousError, match="did not finish within 1 s"):
            FusedDeepMoeBuffer().init(1, 2, SMALL_MEMSIZE, f"tcp://127.0.0.1:{port}", timeout=1.0)
        assert time.monotonic() - start < 10


def test_stopped_rank0_raises_within_the_timeout(monkeypatch):
    port = free_port()
    code = f"import cam_jit; cam_jit.cam_get_comm(33, 0, 2, '127.0.0.1:{port}')"
    rank0 = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # until rank 0 listens
            assert rank0.poll() is None and time.monotonic() < deadline
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        os.kill(rank0.pid, signal.SIGSTOP)
        monkeypatch.setenv("CAM_JIT_COMM_TIMEOUT", "1")
        start = time.monotonic()
        with pytest.raises(RendezvousError, match="did not finish within 1 s"):
            cam_get_comm(33, 1, 2, f"127.0.0.1:{port}")
        assert time.monotonic() - start < 10
    finally:
        os.killpg(rank0.pid, signal.SIGKILL)
        rank0.wait(10)


def init_close_cycles(ports):
    rank = dist.get_rank()
    buf = FusedDeepMoeBuffer()
    buf.init(rank, 2, SMALL_MEMSIZE, f"tcp://127.0.0.1:{ports[0]}")  # warm-up: one-time allocations
    buf.close()
    dist.barrier()
    before = _resources()
    start = time.monotonic()
    for port in ports[1:]:
        buf.init(rank, 2, SMALL_MEMSIZE, f"tcp://127.0.0.1:{port}")
        buf.close()
    return before, _resources(), time.monotonic() - start


def test_init_close_cycles_at_new_addresses_leak_nothing(rank_pool):
    results = rank_pool(2).run(init_close_cycles, [free_port() for _ in range(101)])
    for rank, (before, after, seconds) in enumerate(results):
        assert after == before, f"rank {rank}: (threads, fds, children) {before} -> {after} after 100 cycles"
    assert not glob.glob("/dev/shm/cam_jit_zb.*")


def test_names_left_by_dead_processes_are_reclaimed_by_the_next_init():
    zb_kernels()  # built before the child needs it
    code = ("import os, torch; from cam_jit.zero_buffer._heap import segment_name, zb_kernels\n"
            "name = segment_name(0); zb_kernels().map_segment(name, 1 << 20, True); print(name, flush=True)\n"
            "os._exit(9)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
    name = child.stdout.strip()
    assert child.returncode == 9 and os.path.exists(f"/dev/shm{name}"), child.stderr
    mine = segment_name(0)  # a live process's name (this one) is never reclaimed
    zb_kernels().unmap_segment(zb_kernels().map_segment(mine, 1 << 20, True), 1 << 20)
    try:
        buf = FusedDeepMoeBuffer()
        buf.init(0, 1, SMALL_MEMSIZE, f"tcp://127.0.0.1:{free_port()}")
        buf.close()
        assert not os.path.exists(f"/dev/shm{name}") and os.path.exists(f"/dev/shm{mine}")
    finally:
        zb_kernels().unlink_segment(mine)
    assert torch.ops._cam_jit_cpu_zb.unlink_segment(name) is False
