"""CAM communicators (docs/semantics.md §4): a process-global table of 64 slots, each holding one
communicator created by a TCP rendezvous, and its commArgs tensor (§4.2).

On CPU a communicator is a dedicated gloo process group built on a `torch.distributed.TCPStore`
that rank 0 hosts at `server_ip_port`; it never touches (or needs) the default WORLD group. The
detour collectives (`cam_jit.ops.detour`) run over it. `cam_free_comm` releases the group, the
store and their threads and sockets.

Choices where upstream leaves room (docs/semantics.md §4, §8):

* `cam_get_comm` on an occupied slot returns the existing commArgs (upstream's notice is logged at
  INFO) when rank, group_size and the resolved address match; different arguments raise
  `ValueError` instead of being silently ignored.
* A non-empty `server_ip_port` that is not "A.B.C.D:port" raises `ValueError` (upstream falls back
  to `CAM_COMM_ID`); an empty one uses `CAM_COMM_ID`, else 127.0.0.1:10067. An invalid
  `CAM_COMM_ID` raises too.
* Bad ids, bad ranks/sizes, an empty slot (use after free, double free) raise `ValueError`
  naming the argument (upstream: a RuntimeError assertion text); `TypeError` for wrong types.
* The communicator is always a new gloo group, even when WORLD has the same rank and size.
"""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging
import os
import secrets
import socket
import threading
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from cam_jit.ops import _checks as check
from cam_jit.ops import _exchange
from cam_jit.ops._registry import OpInfo, define_op
from cam_jit.ops._rendezvous import Rendezvous, RendezvousError

logger = logging.getLogger("cam_jit")

MAX_COMMS = 64  # slots [0, 63] (docs/semantics.md §4.1; upstream's check lets 64 through)
MAX_RANKS = 384
MAGIC_MAX = 2**30 - 1
DEFAULT_ADDRESS = "127.0.0.1:10067"
ADDRESS_ENV = "CAM_COMM_ID"
BUFFSIZE_ENV, BUFFSIZE_DEFAULT_MIB, BUFFSIZE_MAX_MIB = "CAM_BUFFSIZE", 204, 2000


GET_COMM = OpInfo("cam_get_comm", "(int comm_id, int rank, int group_size, str server_ip_port) -> Tensor")
FREE_COMM = OpInfo("cam_free_comm", "(int comm_id) -> Tensor")

# CommArgs byte layout (docs/semantics.md §4.2): (field, byte size), in order, naturally aligned on LP64.
_FIELDS = (
    ("rank", 4), ("localRank", 4), ("rankSize", 4), ("localRankSize", 4), ("extraFlag", 4), ("testFlag", 4),
    ("peerMems", 8 * MAX_RANKS), ("sendCountMatrix", 8 * MAX_RANKS * MAX_RANKS),
    ("sendCounts", 8 * MAX_RANKS), ("sdispls", 8 * MAX_RANKS), ("recvCounts", 8 * MAX_RANKS),
    ("rdispls", 8 * MAX_RANKS), ("batchSize", 8), ("hiddenSize", 8), ("topk", 8), ("sharedExpertRankNum", 8),
    ("expertNumPerRank", 8), ("dfx", 8 * 50), ("memLen", 8),
)
OFFSETS: Dict[str, int] = {}
_end = 0
for _name, _size in _FIELDS:
    OFFSETS[_name] = _end
    _end += _size
COMM_ARGS_BYTES = _end  # 1,195,480
COMM_ARGS_NUMEL = COMM_ARGS_BYTES // 2  # fp16 elements: 597,740
_HEADER_BYTES = OFFSETS["extraFlag"]  # rank, localRank, rankSize, localRankSize


@dataclasses.dataclass
class Communicator:
    """One slot: `rank` of `size`, its gloo `group` and `store`, commArgs `args`, and `magic`."""

    comm_id: int
    rank: int
    size: int
    address: Tuple[str, int]
    store: "dist.Store"
    group: "dist.ProcessGroup"
    args: torch.Tensor
    magic: int = 1


_SLOTS: Dict[int, Optional[Communicator]] = {}  # None: being created
_LOCK = threading.Lock()


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------
def check_comm_id(op: str, arg: str, comm_id: int) -> None:
    """comm_id must be a slot in [0, MAX_COMMS)."""
    if not 0 <= comm_id < MAX_COMMS:
        check.fail(op, arg, f"a communicator slot in [0, {MAX_COMMS - 1}]", comm_id)


def _parse_address(op: str, source: str, text: str) -> Tuple[str, int]:
    host, sep, port = text.rpartition(":")
    try:
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(port)
        ipaddress.IPv4Address(host)
    except ValueError:
        check.fail(op, source, '"A.B.C.D:port" (an IPv4 address and a port in [1, 65535], no scheme)', repr(text))
    return host, int(port)


def resolve_address(op: str, server_ip_port: str) -> Tuple[str, int]:
    """(host, port) of the rendezvous: server_ip_port, else $CAM_COMM_ID, else 127.0.0.1:10067."""
    if server_ip_port:
        return _parse_address(op, "server_ip_port", server_ip_port)
    env = os.environ.get(ADDRESS_ENV, "")
    if env:
        return _parse_address(op, f"server_ip_port (empty, so environment variable {ADDRESS_ENV})", env)
    return _parse_address(op, "server_ip_port (default)", DEFAULT_ADDRESS)


def _buffer_bytes(op: str) -> int:
    """memLen: CAM_BUFFSIZE MiB (default 204; above 2000 is only logged, as upstream)."""
    raw = os.environ.get(BUFFSIZE_ENV, "")
    if not raw:
        return BUFFSIZE_DEFAULT_MIB << 20
    if not raw.strip().isdigit() or int(raw) <= 0:
        check.fail(op, f"environment variable {BUFFSIZE_ENV}", "a positive number of MiB", repr(raw))
    mib = int(raw)
    if mib > BUFFSIZE_MAX_MIB:
        logger.warning("%s: %s=%d MiB exceeds the supported maximum of %d MiB", op, BUFFSIZE_ENV, mib,
                       BUFFSIZE_MAX_MIB)
    return mib << 20


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def comm_args_tensor(rank: int, size: int, hosts: int, mem_len: int) -> torch.Tensor:
    """The commArgs tensor of docs/semantics.md §4.2: [597740] float16 whose bytes are a CommArgs struct with
    rank, localRank, rankSize, localRankSize and memLen filled, everything else zero."""
    local_size = max(size // hosts, 1)
    args = torch.zeros(COMM_ARGS_NUMEL, dtype=torch.float16)
    raw = args.view(torch.uint8)
    raw[:_HEADER_BYTES].view(torch.int32).copy_(torch.tensor([rank, rank % local_size, size, local_size]))
    raw[OFFSETS["memLen"]:].view(torch.int64).fill_(mem_len)
    return args


# ----------------------------------------------------------------------------------------------
# the slot table
# ----------------------------------------------------------------------------------------------
def communicator(op: str, comm_id: int, arg: str = "comm_id") -> Communicator:
    """The communicator in slot comm_id; ValueError if the slot is out of range or empty."""
    check_comm_id(op, arg, comm_id)
    with _LOCK:
        comm = _SLOTS.get(comm_id)
        busy = comm_id in _SLOTS
    if comm is None:
        state = "a slot that is still being created" if busy else "an empty slot (never created, or freed)"
        check.fail(op, arg, "the slot of a live communicator created by cam_get_comm", f"{comm_id}, {state}")
    return comm


def check_comm_args(op: str, arg: str, comm: Communicator, args: torch.Tensor) -> None:
    """`args` (already a [597740] float16 tensor) must carry comm's rank, localRank, rankSize,
    localRankSize and memLen, i.e. be (a copy of) the tensor cam_get_comm returned for it."""
    raw = args.detach().contiguous().view(torch.uint8)
    mine = comm.args.view(torch.uint8)
    mem = OFFSETS["memLen"]
    if torch.equal(raw[:_HEADER_BYTES], mine[:_HEADER_BYTES]) and torch.equal(raw[mem:], mine[mem:]):
        return
    words = raw[:_HEADER_BYTES].view(torch.int32).tolist()
    check.fail(op, arg, f"the commArgs tensor of communicator {comm.comm_id} (rank {comm.rank}, rankSize {comm.size}, "
               f"memLen {int(mine[mem:].view(torch.int64))})",
               f"a tensor with rank {words[0]}, rankSize {words[2]}, memLen {int(raw[mem:].view(torch.int64))}")


def _rendezvous(comm_id: int, rank: int, size: int, address: Tuple[str, int]) -> Communicator:
    """Forms the group through `_rendezvous.Rendezvous` at `address` (rank 0 listens there, on
    that interface only, and admits only members of the job). Gloo's own exchange then runs
    over a TCPStore that rank 0 serves on an ephemeral port of the same interface, under a key
    prefix drawn at random and handed out only to admitted members; rank 0 stops accepting
    connections to it once the group is formed."""
    op = GET_COMM.name
    mem_len = _buffer_bytes(op)
    limit = _exchange.timeout_seconds()
    timeout = datetime.timedelta(seconds=limit)
    host, port = address
    store = group = listener = None
    served = False  # whether the store's server owns the listener's descriptor
    try:
        with Rendezvous(op, host, port, rank, size, limit) as members:
            record = {"boot_id": _boot_id()}
            if rank == 0:
                listener = socket.create_server((host, 0), backlog=size + 8)
                store = dist.TCPStore(host, listener.getsockname()[1], size, True, timeout, wait_for_workers=False,
                                      master_listen_fd=listener.fileno())
                served = True
                record.update(store_port=listener.getsockname()[1], prefix=secrets.token_hex(16))
            table = members.exchange(record)
            local_host = members.local_host
        if rank != 0:
            store = dist.TCPStore(host, int(table[0]["store_port"]), size, False, timeout, wait_for_workers=False)
        prefix = dist.PrefixStore(f"cam_comm_{comm_id}/{table[0]['prefix']}", store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout, options._threads = timeout, 2
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]  # gloo listens there only
        group = dist.ProcessGroupGloo(prefix, rank, size, options)
        group.barrier().wait(timeout)  # every rank is past the store: no newcomer is needed
    except (RuntimeError, ValueError) as err:
        if group is not None:
            group.shutdown()
        store = prefix = group = None  # the traceback keeps this frame: release the sockets now
        if isinstance(err, (RendezvousError, ValueError)):
            raise
        raise RuntimeError(
            f"{op}: rendezvous of comm_id {comm_id} (rank {rank} of {size}) at {host}:{port} failed "
            f"(rank 0 hosts it, the others connect; timeout {limit:g} s, CAM_JIT_COMM_TIMEOUT). Cause: {err}"
        ) from err
    finally:
        if served:  # the store's server owns the descriptor: it only stops accepting
            listener.shutdown(socket.SHUT_RDWR)
            listener.detach()
        elif listener is not None:
            listener.close()
    hosts = len({r["boot_id"] for r in table})
    return Communicator(comm_id, rank, size, address, store, group, comm_args_tensor(rank, size, hosts, mem_len))


def _get_comm(comm_id: int, rank: int, group_size: int, server_ip_port: str) -> torch.Tensor:
    op = GET_COMM.name
    check_comm_id(op, "comm_id", comm_id)
    if not 0 < group_size <= MAX_RANKS:
        check.fail(op, "group_size", f"0 < group_size <= {MAX_RANKS}", group_size)
    if not 0 <= rank < group_size:
        check.fail(op, "rank", f"0 <= rank < group_size ({group_size})", rank)
    address = resolve_address(op, server_ip_port)
    with _LOCK:
        existing = _SLOTS.get(comm_id)
        occupied = comm_id in _SLOTS
        if not occupied:
            _SLOTS[comm_id] = None  # reserved while the rendezvous runs outside the lock
    if occupied:
        if existing is None:
            check.fail(op, "comm_id", "a slot that is not being created by another thread", comm_id)
        mine = (existing.rank, existing.size, existing.address)
        if mine != (rank, group_size, address):
            check.fail(op, "comm_id", f"a free slot, or the arguments slot {comm_id} was created with "
                       f"(rank {mine[0]}, group_size {mine[1]}, {mine[2][0]}:{mine[2][1]})",
                       f"slot {comm_id} again with rank {rank}, group_size {group_size}, {address[0]}:{address[1]}")
        logger.info("%s: communicator %d already exists; returning it", op, comm_id)
        return existing.args
    try:
        comm = _rendezvous(comm_id, rank, group_size, address)
    except BaseException:
        with _LOCK:
            del _SLOTS[comm_id]
        raise
    with _LOCK:
        _SLOTS[comm_id] = comm
    return comm.args


def _free_comm(comm_id: int) -> None:
    comm = communicator(FREE_COMM.name, comm_id)
    with _LOCK:
        del _SLOTS[comm_id]
    comm.group.shutdown()


def _get_comm_fake(comm_id: int, rank: int, group_size: int, server_ip_port: str) -> torch.Tensor:
    return torch.empty(COMM_ARGS_NUMEL, dtype=torch.float16)


def _free_comm_fake(comm_id: int) -> None:
    return None


# No tensor arguments, so no backend to dispatch on: one kernel for every device.
define_op(GET_COMM, _get_comm_fake, _get_comm, "CompositeExplicitAutograd")  # no tensor inputs to dispatch on
define_op(FREE_COMM, _free_comm_fake, _free_comm, "CompositeExplicitAutograd")


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def cam_get_comm(comm_id: int, rank: int, group_size: int, server_ip_port: str) -> torch.Tensor:
    """Create CAM communicator `comm_id` (or return it if it exists with the same arguments).

    Blocking rendezvous of `group_size` processes: rank 0 hosts a TCP store at the address, the
    others connect; together they build a dedicated gloo process group (timeout
    CAM_JIT_COMM_TIMEOUT). Every rank of the communicator must call it with the same comm_id,
    group_size and address. To reuse an address after cam_free_comm, let every rank free the
    old communicator first (e.g. a barrier): a rank that reconnects early may reach the old store.

    Args:
        comm_id: slot in [0, 63].
        rank: this process's rank in the communicator, 0 <= rank < group_size.
        group_size: number of ranks, 1 .. 384.
        server_ip_port: "A.B.C.D:port" of rank 0; "" uses $CAM_COMM_ID, else "127.0.0.1:10067".

    Returns:
        commArgs: [597740] float16 CPU tensor, the bytes of the CommArgs struct (docs/semantics.md §4.2:
        rank, localRank, rankSize, localRankSize, memLen = CAM_BUFFSIZE MiB; the rest zero). Pass
        it unchanged to the detour ops.
    """
    check.integer(GET_COMM.name, "comm_id", comm_id)
    check.integer(GET_COMM.name, "rank", rank)
    check.integer(GET_COMM.name, "group_size", group_size)
    if not isinstance(server_ip_port, str):
        check.fail(GET_COMM.name, "server_ip_port", 'a str "A.B.C.D:port"', type(server_ip_port).__name__, TypeError)
    return torch.ops.cam_jit.cam_get_comm(comm_id, rank, group_size, server_ip_port)


def cam_free_comm(comm_id: int) -> None:
    """Destroy communicator `comm_id` (this process's side: its process group, store, threads and
    sockets) and empty the slot. Returns None (upstream returns an undefined tensor)."""
    check.integer(FREE_COMM.name, "comm_id", comm_id)
    return torch.ops.cam_jit.cam_free_comm(comm_id)


def cam_get_rank_size(comm_id: int) -> int:
    """The group_size communicator `comm_id` was created with."""
    check.integer("cam_get_rank_size", "comm_id", comm_id)
    return communicator("cam_get_rank_size", comm_id).size


def cam_get_magic(comm_id: int) -> int:
    """The current magic of communicator `comm_id` (starts at 1; docs/semantics.md §4.1)."""
    check.integer("cam_get_magic", "comm_id", comm_id)
    comm = communicator("cam_get_magic", comm_id)
    with _LOCK:
        return comm.magic


def cam_get_and_increase_magic(comm_id: int) -> int:
    """Returns the magic of communicator `comm_id` and increments it: 1, 2, 3, ... After
    returning 2^30 - 1 the stored value is 2^30; the next call resets it and returns 1."""
    check.integer("cam_get_and_increase_magic", "comm_id", comm_id)
    comm = communicator("cam_get_and_increase_magic", comm_id)
    with _LOCK:
        if comm.magic > MAGIC_MAX:
            comm.magic = 1
        value = comm.magic
        comm.magic += 1
    return value
