"""The symmetric heap of FusedDeepMoeBuffer on CPU (docs/semantics.md §5.2, "CPU design").

One POSIX shared-memory segment of `memsize` bytes per rank (sparse until touched): the first
2 MiB are the ext-info region (this module's header and the transport's flags), the rest is the
workspace. Ranks bootstrap through a `torch.distributed.TCPStore` at `ip_port`: each publishes
its segment's name, host and process identity, maps every peer's segment by name, and once every
rank has mapped every segment each unlinks its own name. From then on /dev/shm holds nothing: the
memory lives only in the mappings, which the kernel drops when the processes exit, killed or not.
`close()`, garbage collection and interpreter exit unmap (and unlink our name if init failed
before the end). A rank that dies inside init, between creating and unlinking its segment, leaves
its name behind: the survivors notice (their init fails) and unlink it for it.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import secrets
import socket
import threading
import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from cam_jit.jit import kernels_dir, load
from cam_jit.jit.backends import CPU_CFLAGS, CPU_LDFLAGS, tree_files
from cam_jit.jit.errors import JitError
from cam_jit.jit.spec import BuildSpec

BACKEND = "cpu_zb"
EXT_INFO_BYTES = 2 * 1024 * 1024  # docs/semantics.md §5.1
SEGMENT_PREFIX = "/cam_jit_zb."  # shm_open names; they appear as /dev/shm/cam_jit_zb.*
MAGIC = 0x42_5A_54_49_4A_4D_41_43  # "CAMJITZB" little-endian: the segment header's first word
HEADER_WORDS = 8  # int64: magic, rank, num_ranks, memsize, pid, process start time, 0, 0
POLL_SECONDS = 0.02  # how often init's waits poll the store and check that the ranks they wait for live


def zb_spec() -> BuildSpec:
    """Spec of the `cpu_zb` backend: every ``*.cpp``/``*.h`` under the kernels' ``cpu_zb/``."""
    root = kernels_dir()
    folder = root / "cpu_zb"
    sources, headers = tree_files(folder, ".cpp", ".h")
    if not sources:
        raise JitError(f"no C++ sources (*.cpp) in {folder}: this cam_jit installation is incomplete")
    return BuildSpec(backend=BACKEND, name="cam_jit_cpu_zb", root=root, sources=sources,
                     headers=headers, include_dirs=(folder,),
                     cflags=CPU_CFLAGS, ldflags=CPU_LDFLAGS)


def zb_kernels():
    """`torch.ops._cam_jit_cpu_zb`, building or loading the `cpu_zb` library first (memoised)."""
    load(BACKEND)
    return torch.ops._cam_jit_cpu_zb


_IP_PORT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s]+):(\d{1,5})$")


def parse_ip_port(where: str, ip_port: object) -> Tuple[str, int]:
    """"tcp://host:port" (IPv6 as "tcp://[addr]:port") -> (host, port)."""
    if not isinstance(ip_port, str):
        raise TypeError(f"{where}: argument 'ip_port': expected a str 'tcp://host:port', got {type(ip_port).__name__}")
    match = _IP_PORT.match(ip_port)
    port = int(match.group(2)) if match else 0
    if not match or not 0 < port < 65536:
        raise ValueError(f"{where}: argument 'ip_port': expected 'tcp://host:port' with a port in [1, 65535] "
                         f"(the bootstrap address: rank 0 serves a TCPStore there), got {ip_port!r}")
    return match.group(1).strip("[]"), port


def process_start_time(pid: int) -> Optional[int]:
    """Start time (clock ticks after boot) of a live process, None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _pid_namespace() -> str:
    """This process's pid namespace ("pid:[inode]"), "" if unknown: peers in the same one can see
    whether this process is alive."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


# One bootstrap store per address per process, kept for the process's life: a store dropped at
# close could still be answering a fast peer's next init. Keys are namespaced by a per-address
# init counter, so every rank must call init the same number of times at one address.
_STORES: Dict[Tuple[str, int], "torch.distributed.TCPStore"] = {}
_INITS: Dict[Tuple[str, int], int] = {}
_STORES_LOCK = threading.Lock()


def _bootstrap_store(where: str, host: str, port: int, rank: int, timeout: float):
    import torch.distributed as dist

    with _STORES_LOCK:
        store = _STORES.get((host, port))
        if store is None:
            try:
                store = dist.TCPStore(host, port, is_master=rank == 0, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=timeout))
            except (RuntimeError, OSError) as err:
                role = "serve" if rank == 0 else "reach"
                raise RuntimeError(
                    f"{where}: cannot {role} the bootstrap TCPStore at tcp://{host}:{port} within {timeout:g} s "
                    f"(rank 0 serves it, the others connect; every rank must pass the same ip_port): {err}"
                ) from err
            _STORES[(host, port)] = store
        generation = _INITS.get((host, port), 0) + 1
        _INITS[(host, port)] = generation
    return store, f"cam_jit_zb/{generation}/"


@dataclasses.dataclass
class _Mappings:
    """What must be released: mapped segments and the name of our segment while linked. Owned by
    a weakref.finalize, so it must not reference the Heap."""

    memsize: int
    addrs: Dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> mapping address
    linked: List[str] = dataclasses.field(default_factory=list)  # names this rank must unlink

    def release(self) -> None:
        kernels = torch.ops._cam_jit_cpu_zb
        for name in self.linked:
            kernels.unlink_segment(name)
        self.linked.clear()
        for addr in self.addrs.values():
            kernels.unmap_segment(addr, self.memsize)
        self.addrs.clear()


@dataclasses.dataclass(frozen=True)
class Peer:
    """A rank as it announced itself at init."""

    rank: int
    name: str
    host: str
    boot_id: str
    pid: int
    start_time: Optional[int]  # None: its process is not visible from here (another pid namespace)

    def exited(self) -> bool:
        """Whether its process is known to have exited (False when it cannot be observed)."""
        return self.start_time is not None and process_start_time(self.pid) != self.start_time


class Heap:
    """This rank's segment and the mappings of every peer's segment (see the module docstring).

    `addrs[r]` is the local address of rank r's segment; `ext_info(r)` / `workspace(r)` the
    addresses of its two regions."""

    def __init__(self, where: str, rank: int, num_ranks: int, memsize: int, host: str, port: int,
                 timeout: float):
        kernels = zb_kernels()
        self.rank, self.num_ranks, self.memsize = rank, num_ranks, memsize
        self._mappings = _Mappings(memsize)
        self._finalizer = weakref.finalize(self, self._mappings.release)
        try:
            self.peers = self._open(where, kernels, host, port, timeout)
        except BaseException:
            self.close()
            raise
        self.addrs = [self._mappings.addrs[r] for r in range(num_ranks)]

    def _open(self, where: str, kernels, host: str, port: int, timeout: float) -> List[Peer]:
        rank, ranks, memsize = self.rank, self.num_ranks, self.memsize
        # The store first: a rank still waiting for it has created nothing that could leak.
        store, prefix = _bootstrap_store(where, host, port, rank, timeout)
        pid = os.getpid()
        start = process_start_time(pid)
        name = f"{SEGMENT_PREFIX}{pid}.{rank}.{secrets.token_hex(6)}"
        self._mappings.linked.append(name)
        self._mappings.addrs[rank] = kernels.map_segment(name, memsize, True)
        header = kernels.region(self._mappings.addrs[rank], [HEADER_WORDS], torch.int64)
        header.copy_(torch.tensor([MAGIC, rank, ranks, memsize, pid, start or 0, 0, 0], dtype=torch.int64))
        me = dict(name=name, host=socket.gethostname(), boot_id=_boot_id(), pid_ns=_pid_namespace(), pid=pid,
                  start_time=start, num_ranks=ranks, memsize=memsize)
        store.set(f"{prefix}info/{rank}", json.dumps(me))  # from here on, the peers know the name
        try:
            infos = self._gather(where, store, f"{prefix}info", timeout, "publish its segment")
            peers = self._check_peers(where, infos)
            for peer in peers:
                if peer.rank != rank:
                    self._map_peer(where, kernels, peer)
            store.set(f"{prefix}mapped/{rank}", "1")
            self._gather(where, store, f"{prefix}mapped", timeout, "map every segment", tuple(peers))
        except BaseException:
            # A peer that died inside init cannot unlink its name: do it for it.
            self._mappings.linked.extend(_names_of_exited(store, f"{prefix}info", ranks, me))
            raise
        kernels.unlink_segment(name)
        self._mappings.linked.remove(name)
        return peers

    def _map_peer(self, where: str, kernels, peer: "Peer") -> None:
        try:
            self._mappings.addrs[peer.rank] = kernels.map_segment(peer.name, self.memsize, False)
        except RuntimeError as err:
            raise RuntimeError(f"{where}: cannot map the segment of rank {peer.rank}: it is gone (rank {peer.rank} "
                               f"abandoned init: see its error) or not visible from rank {self.rank}: {err}") from err
        self._check_header(where, kernels, peer)

    def _gather(self, where: str, store, key: str, timeout: float, what: str,
                peers: Tuple["Peer", ...] = ()) -> Dict[int, str]:
        """Waits until every rank has set `key`/<rank>; returns the values by rank. Raises within
        POLL_SECONDS when one of `peers` (the ranks known so far) has exited."""
        keys = [f"{key}/{r}" for r in range(self.num_ranks)]
        deadline = time.monotonic() + timeout
        while not _has_key(store, keys):  # polled: a blocking wait logs a warning at each time-out
            missing = [r for r, k in enumerate(keys) if not _has_key(store, [k])]
            dead = [p.rank for p in peers if p.rank in missing and p.exited()]
            if dead or time.monotonic() > deadline:
                why = f"exited (pid {peers[dead[0]].pid}) before they could" if dead else "did not"
                raise RuntimeError(
                    f"{where}: rank(s) {dead or missing} {why} {what} within {timeout:g} s (rank {self.rank} of "
                    f"{self.num_ranks}); every rank must call init with the same num_ranks, memsize and ip_port")
            time.sleep(POLL_SECONDS)
        return {r: store.get(k).decode() for r, k in enumerate(keys)}

    def _check_peers(self, where: str, infos: Dict[int, str]) -> List[Peer]:
        records = {r: json.loads(v) for r, v in infos.items()}
        mine = records[self.rank]
        for field, arg in (("num_ranks", "num_ranks"), ("memsize", "memsize")):
            values = [records[r][field] for r in range(self.num_ranks)]
            if len(set(values)) > 1:
                raise ValueError(f"{where}: argument '{arg}': expected the same value on every rank, got {values} "
                                 f"on ranks 0..{self.num_ranks - 1}")
        elsewhere = [r for r in range(self.num_ranks)
                     if (records[r]["host"], records[r]["boot_id"]) != (mine["host"], mine["boot_id"])]
        if elsewhere:
            hosts = {r: records[r]["host"] for r in range(self.num_ranks)}
            raise RuntimeError(
                f"{where}: the CPU zero-copy buffer needs every rank on one host (they share /dev/shm), but rank(s) "
                f"{elsewhere} run on another host than rank {self.rank} (hosts by rank: {hosts}); across hosts use "
                "cam_jit.fused_deep_moe, whose transport is torch.distributed")
        return [_peer(r, records[r], mine) for r in range(self.num_ranks)]

    def _check_header(self, where: str, kernels, peer: Peer) -> None:
        header = kernels.region(self._mappings.addrs[peer.rank], [HEADER_WORDS], torch.int64).tolist()
        expected = [MAGIC, peer.rank, self.num_ranks, self.memsize, peer.pid]
        if header[:5] != expected:
            raise RuntimeError(f"{where}: segment {peer.name} of rank {peer.rank} has header {header[:5]}, expected "
                               f"{expected} (magic, rank, num_ranks, memsize, pid): not the peer's segment")

    def ext_info(self, rank: int) -> int:
        return self.addrs[rank]

    def workspace(self, rank: int) -> int:
        return self.addrs[rank] + EXT_INFO_BYTES

    def dead_peer(self, rank: int) -> bool:
        """Whether rank's process is known to have exited (False when it cannot be observed)."""
        return self.peers[rank].exited()

    def close(self) -> None:
        """Unmaps every segment (and unlinks our name if still linked). Idempotent."""
        self._finalizer()


def _has_key(store, keys: List[str]) -> bool:
    """Whether the store holds every key (False when the store is unreachable)."""
    try:
        return bool(store.check(keys))
    except (RuntimeError, OSError):
        return False


def _peer(rank: int, record: dict, mine: dict) -> Peer:
    """The Peer a rank's published record describes, as seen from the rank that published `mine`:
    its process can be watched only from the same pid namespace."""
    visible = record["pid_ns"] and record["pid_ns"] == mine["pid_ns"] and record["start_time"] is not None
    return Peer(rank, record["name"], record["host"], record["boot_id"], record["pid"],
                record["start_time"] if visible else None)


def _names_of_exited(store, key: str, num_ranks: int, mine: dict) -> List[str]:
    """Segment names published under `key` by ranks whose process has exited (best effort: the
    store may be gone)."""
    names = []
    for r in range(num_ranks):
        if not _has_key(store, [f"{key}/{r}"]):
            continue
        try:
            record = json.loads(store.get(f"{key}/{r}"))
        except (RuntimeError, OSError, ValueError):
            continue
        if record["name"] != mine["name"] and _peer(r, record, mine).exited():
            names.append(record["name"])
    return names
