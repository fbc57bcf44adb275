"""The symmetric heap of FusedDeepMoeBuffer on CPU (docs/semantics.md §5.2, "CPU design").

One POSIX shared-memory segment of `memsize` bytes per rank (sparse until touched): the first
2 MiB are the ext-info region (this module's header and the transport's flags), the rest is the
workspace. Ranks meet through `cam_jit.ops._rendezvous` at `ip_port` (rank 0 listens there on
that interface only and admits only members of the job; the connections close when init ends).
Once the group is formed, each rank creates its segment, publishes its name, host and process
identity, maps every peer's segment by name, and once every rank has mapped every segment each
unlinks its own name. From then on /dev/shm holds nothing: the memory lives only in the mappings,
which the kernel drops when the processes exit, killed or not. `close()`, garbage collection and
interpreter exit unmap (and unlink our name if init failed before the end). A rank that dies
between creating and unlinking its segment leaves its name behind: the survivors unlink it (a
member dropping out of the rendezvous fails everyone's init), and every later init reclaims names
of processes of this user and pid namespace that have exited (the pid is in the name).
"""
from __future__ import annotations

import dataclasses
import os
import re
import secrets
import socket
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from cam_jit.jit import kernels_dir, load
from cam_jit.jit.backends import CPU_CFLAGS, CPU_LDFLAGS, kernels_chosen_in, tree_files
from cam_jit.jit.errors import JitError
from cam_jit.jit.spec import BuildSpec
from cam_jit.ops._rendezvous import Rendezvous, RendezvousError

BACKEND = "cpu_zb"
EXT_INFO_BYTES = 2 * 1024 * 1024  # docs/semantics.md §5.1
SEGMENT_PREFIX = "/cam_jit_zb."  # shm_open names; they appear as /dev/shm/cam_jit_zb.*
MAGIC = 0x42_5A_54_49_4A_4D_41_43  # "CAMJITZB" little-endian: the segment header's first word
HEADER_WORDS = 8  # int64: magic, rank, num_ranks, memsize, pid, process start time, 0, 0


def zb_spec() -> BuildSpec:
    """Spec of the `cpu_zb` backend: every ``*.cpp``/``*.h`` under the kernels' ``cpu_zb/``."""
    root = kernels_dir()
    folder = root / "cpu_zb"
    listed = [kernels_chosen_in()]
    sources, headers = tree_files(folder, ".cpp", ".h", walked=listed)
    if not sources:
        raise JitError(f"no C++ sources (*.cpp) in {folder}: this cam_jit installation is incomplete")
    return BuildSpec(backend=BACKEND, name="cam_jit_cpu_zb", root=root, sources=sources,
                     headers=headers, include_dirs=(folder,),
                     cflags=CPU_CFLAGS, ldflags=CPU_LDFLAGS, listed=tuple(listed))


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
                         f"(the rendezvous address: rank 0 listens there), got {ip_port!r}")
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


_NAME = re.compile(r"^/cam_jit_zb\.(\d+)\.(\d+)\.(\d+)\.[0-9a-f]{12}$")  # pid namespace, pid, rank


def segment_name(rank: int) -> str:
    """A fresh segment name of this process for `rank`: /cam_jit_zb.<pid ns>.<pid>.<rank>.<random>."""
    return f"{SEGMENT_PREFIX}{_pid_namespace_id()}.{os.getpid()}.{rank}.{secrets.token_hex(6)}"


def _pid_namespace_id() -> int:
    digits = re.sub(r"\D", "", _pid_namespace())
    return int(digits) if digits else 0


def reclaim_stale_segments() -> List[str]:
    """Unlinks /dev/shm names of segments that processes of this user and pid namespace created
    and left behind when they died (e.g. killed inside init); returns them."""
    reclaimed = []
    namespace, uid = _pid_namespace_id(), os.geteuid()
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return reclaimed
    for entry in entries:
        match = _NAME.match("/" + entry)
        if not match or int(match.group(1)) != namespace or not namespace:
            continue
        try:
            owner = os.stat(f"/dev/shm/{entry}").st_uid
        except OSError:
            continue
        if owner == uid and process_start_time(int(match.group(2))) is None:
            if torch.ops._cam_jit_cpu_zb.unlink_segment("/" + entry):
                reclaimed.append("/" + entry)
    return reclaimed


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
        reclaim_stale_segments()
        # The group first: a rank still waiting for its peers has created nothing that could leak.
        with Rendezvous(where, host, port, rank, ranks, timeout) as members:
            pid = os.getpid()
            start = process_start_time(pid)
            name = segment_name(rank)
            self._mappings.linked.append(name)
            self._mappings.addrs[rank] = kernels.map_segment(name, memsize, True)
            header = kernels.region(self._mappings.addrs[rank], [HEADER_WORDS], torch.int64)
            header.copy_(torch.tensor([MAGIC, rank, ranks, memsize, pid, start or 0, 0, 0], dtype=torch.int64))
            me = dict(name=name, host=socket.gethostname(), boot_id=_boot_id(), pid_ns=_pid_namespace(), pid=pid,
                      start_time=start, num_ranks=ranks, memsize=memsize)
            records: List[dict] = []
            try:
                records = members.exchange(me)  # from here on, the peers know the name
                peers = self._check_peers(where, records)
                for peer in peers:
                    if peer.rank != rank:
                        self._map_peer(where, kernels, peer)
                members.exchange("mapped")
            except BaseException as err:
                # A peer that died inside init cannot unlink its name: do it for it.
                exited = _exited(records, me)
                self._mappings.linked.extend(p.name for p in exited)
                if exited and isinstance(err, RendezvousError):
                    raise RuntimeError(
                        f"{where}: rank(s) {[p.rank for p in exited]} exited (pid {exited[0].pid}) before every rank "
                        f"could map every segment (rank {rank} of {ranks}): {err}") from None
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

    def _check_peers(self, where: str, records: List[dict]) -> List[Peer]:
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


def _peer(rank: int, record: dict, mine: dict) -> Peer:
    """The Peer a rank's published record describes, as seen from the rank that published `mine`:
    its process can be watched only from the same pid namespace."""
    visible = record["pid_ns"] and record["pid_ns"] == mine["pid_ns"] and record["start_time"] is not None
    return Peer(rank, record["name"], record["host"], record["boot_id"], record["pid"],
                record["start_time"] if visible else None)


def _exited(records: List[dict], mine: dict) -> List[Peer]:
    """The ranks among the published `records` whose process has exited and whose segment name
    is theirs (of the form segment_name gives, with their pid and rank), so a forged record can
    never make this rank unlink another segment."""
    exited = []
    for rank, record in enumerate(records):
        try:
            match = _NAME.match(record["name"])
            if (record["name"] == mine["name"] or not match or int(match.group(2)) != record["pid"]
                    or int(match.group(3)) != rank):
                continue
            peer = _peer(rank, record, mine)
        except (KeyError, TypeError, ValueError):
            continue
        if peer.exited():
            exited.append(peer)
    return exited
