"""CAM communicators (cam_jit.ops.comm, SPEC.md §4): argument checks, the commArgs byte layout
(checked against the SPEC's literal offsets with struct), slot life cycle, magic numbers, the torch
ops, multi-rank rendezvous on gloo pools, and that freeing releases threads, fds and processes."""
import logging
import os
import struct
import time

import pytest
import torch
import torch.distributed as dist

from cam_jit.ops import comm as comm_mod
from cam_jit.ops.comm import (cam_free_comm, cam_get_and_increase_magic, cam_get_comm, cam_get_magic,
                              cam_get_rank_size)
from dist_harness import free_port

COMM_ARGS_BYTES = 1_195_480  # SPEC §4.2
MEMLEN_OFFSET = 1_195_472


def addr(port=None):
    return f"127.0.0.1:{port or free_port()}"


@pytest.fixture
def solo():
    """A one-rank communicator in this process, slot 7; freed afterwards."""
    args = cam_get_comm(7, 0, 1, addr())
    yield args
    if 7 in comm_mod._SLOTS:
        cam_free_comm(7)


def header(args):
    raw = args.view(torch.uint8).numpy().tobytes()
    return struct.unpack_from("<6i", raw, 0), struct.unpack_from("<q", raw, MEMLEN_OFFSET)[0], raw


# ----------------------------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------------------------
GET_CASES = [
    ("id-str", ("1", 0, 1, "127.0.0.1:1"), TypeError, ["'comm_id'", "an int", "str"]),
    ("id-bool", (True, 0, 1, "127.0.0.1:1"), TypeError, ["'comm_id'", "an int", "bool"]),
    ("id-negative", (-1, 0, 1, "127.0.0.1:1"), ValueError, ["'comm_id'", "[0, 63]", "got -1"]),
    ("id-64", (64, 0, 1, "127.0.0.1:1"), ValueError, ["'comm_id'", "[0, 63]", "got 64"]),
    ("rank-float", (1, 0.0, 1, "127.0.0.1:1"), TypeError, ["'rank'", "an int", "float"]),
    ("rank-negative", (1, -1, 2, "127.0.0.1:1"), ValueError, ["'rank'", "0 <= rank < group_size (2)", "got -1"]),
    ("rank-equals-size", (1, 2, 2, "127.0.0.1:1"), ValueError, ["'rank'", "group_size (2)", "got 2"]),
    ("size-zero", (1, 0, 0, "127.0.0.1:1"), ValueError, ["'group_size'", "0 < group_size <= 384", "got 0"]),
    ("size-385", (1, 0, 385, "127.0.0.1:1"), ValueError, ["'group_size'", "<= 384", "got 385"]),
    ("size-str", (1, 0, "2", "127.0.0.1:1"), TypeError, ["'group_size'", "an int", "str"]),
    ("address-int", (1, 0, 1, 10067), TypeError, ["'server_ip_port'", "a str", "int"]),
    ("address-hostname", (1, 0, 1, "localhost:10067"), ValueError,
     ["'server_ip_port'", "A.B.C.D:port", "'localhost:10067'"]),
    ("address-no-port", (1, 0, 1, "127.0.0.1"), ValueError, ["'server_ip_port'", "A.B.C.D:port", "'127.0.0.1'"]),
    ("address-port-0", (1, 0, 1, "127.0.0.1:0"), ValueError, ["'server_ip_port'", "[1, 65535]", "'127.0.0.1:0'"]),
    ("address-port-big", (1, 0, 1, "127.0.0.1:70000"), ValueError, ["'server_ip_port'", "'127.0.0.1:70000'"]),
    ("address-scheme", (1, 0, 1, "tcp://127.0.0.1:5"), ValueError, ["'server_ip_port'", "no scheme"]),
    ("address-3-octets", (1, 0, 1, "127.0.1:5"), ValueError, ["'server_ip_port'", "'127.0.1:5'"]),
    ("address-ipv6", (1, 0, 1, "[::1]:5"), ValueError, ["'server_ip_port'", "IPv4"]),
]


@pytest.mark.parametrize("case_id,args,exc,fragments", GET_CASES, ids=[c[0] for c in GET_CASES])
def test_get_comm_bad_arguments(case_id, args, exc, fragments):
    with pytest.raises(exc) as info:
        cam_get_comm(*args)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert "cam_get_comm" in str(info.value)
    assert 1 not in comm_mod._SLOTS


def test_torch_op_checks_arguments_too():
    with pytest.raises(ValueError, match=r"'comm_id'.*\[0, 63\].*got 64"):
        torch.ops.cam_jit.cam_get_comm(64, 0, 1, "127.0.0.1:1")
    with pytest.raises(ValueError, match="'rank'"):
        torch.ops.cam_jit.cam_get_comm(1, 3, 2, "127.0.0.1:1")
    with pytest.raises(ValueError, match="empty slot"):
        torch.ops.cam_jit.cam_free_comm(5)


@pytest.mark.parametrize("fn", [cam_free_comm, cam_get_rank_size, cam_get_magic, cam_get_and_increase_magic])
@pytest.mark.parametrize("comm_id,exc,fragments", [
    (5, ValueError, ["'comm_id'", "live communicator", "got 5, an empty slot"]),
    (-1, ValueError, ["'comm_id'", "[0, 63]", "got -1"]),
    (64, ValueError, ["'comm_id'", "[0, 63]", "got 64"]),
    ("5", TypeError, ["'comm_id'", "an int", "str"]),
    (5.0, TypeError, ["'comm_id'", "an int", "float"]),
])
def test_slot_functions_bad_ids(fn, comm_id, exc, fragments):
    with pytest.raises(exc) as info:
        fn(comm_id)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert fn.__name__ in str(info.value)


def test_address_fallbacks(monkeypatch):
    monkeypatch.delenv("CAM_COMM_ID", raising=False)
    assert comm_mod.resolve_address("t", "") == ("127.0.0.1", 10067)
    assert comm_mod.resolve_address("t", "10.1.2.3:99") == ("10.1.2.3", 99)
    monkeypatch.setenv("CAM_COMM_ID", "192.168.0.7:4242")
    assert comm_mod.resolve_address("t", "") == ("192.168.0.7", 4242)
    assert comm_mod.resolve_address("t", "10.1.2.3:99") == ("10.1.2.3", 99)  # the argument wins
    monkeypatch.setenv("CAM_COMM_ID", "nowhere")
    with pytest.raises(ValueError, match=r"environment variable CAM_COMM_ID.*'nowhere'"):
        cam_get_comm(1, 0, 1, "")
    assert 1 not in comm_mod._SLOTS


def test_empty_address_uses_cam_comm_id(monkeypatch):
    monkeypatch.setenv("CAM_COMM_ID", addr())
    args = cam_get_comm(2, 0, 1, "")
    try:
        assert args.shape == (597740,)
    finally:
        cam_free_comm(2)


@pytest.mark.parametrize("value,fragment", [("abc", "'abc'"), ("0", "'0'"), ("-3", "'-3'")])
def test_bad_buffsize(monkeypatch, value, fragment):
    monkeypatch.setenv("CAM_BUFFSIZE", value)
    with pytest.raises(ValueError, match=f"CAM_BUFFSIZE.*positive number of MiB.*{fragment}"):
        cam_get_comm(3, 0, 1, addr())
    assert 3 not in comm_mod._SLOTS


# ----------------------------------------------------------------------------------------------
# one-rank communicators in this process
# ----------------------------------------------------------------------------------------------
def test_comm_args_layout(solo):
    assert solo.dtype == torch.float16 and solo.shape == (597740,) and solo.device.type == "cpu"
    assert solo.numel() * 2 == COMM_ARGS_BYTES == comm_mod.COMM_ARGS_BYTES
    ints, mem_len, raw = header(solo)
    assert ints == (0, 0, 1, 1, 0, 0)  # rank, localRank, rankSize, localRankSize, extraFlag, testFlag
    assert mem_len == 204 * 2**20
    assert raw[24:MEMLEN_OFFSET] == bytes(MEMLEN_OFFSET - 24)  # peerMems .. dfx all zero
    assert comm_mod.OFFSETS["peerMems"] == 24 and comm_mod.OFFSETS["sendCountMatrix"] == 3096
    assert comm_mod.OFFSETS["sendCounts"] == 1182744 and comm_mod.OFFSETS["batchSize"] == 1195032
    assert comm_mod.OFFSETS["dfx"] == 1195072 and comm_mod.OFFSETS["memLen"] == MEMLEN_OFFSET


def test_buffsize_env(monkeypatch, caplog):
    monkeypatch.setenv("CAM_BUFFSIZE", "300")
    args = cam_get_comm(4, 0, 1, addr())
    cam_free_comm(4)
    assert header(args)[1] == 300 * 2**20
    monkeypatch.setenv("CAM_BUFFSIZE", "2001")
    with caplog.at_level(logging.WARNING, logger="cam_jit"):
        args = cam_get_comm(4, 0, 1, addr())
    cam_free_comm(4)
    assert header(args)[1] == 2001 * 2**20
    assert "2001 MiB exceeds the supported maximum of 2000" in caplog.text


def test_slot_life_cycle(solo):
    assert cam_get_rank_size(7) == 1
    again = cam_get_comm(7, 0, 1, f"127.0.0.1:{comm_mod._SLOTS[7].address[1]}")
    assert again is solo  # same arguments: the existing communicator, no new rendezvous
    with pytest.raises(ValueError) as info:
        cam_get_comm(7, 0, 1, addr())
    assert "'comm_id'" in str(info.value) and "created with (rank 0, group_size 1" in str(info.value)
    with pytest.raises(ValueError, match="'rank'"):
        cam_get_comm(7, 1, 1, addr())
    assert cam_free_comm(7) is None
    for fn in (cam_free_comm, cam_get_rank_size, cam_get_magic, cam_get_and_increase_magic):
        with pytest.raises(ValueError, match="got 7, an empty slot"):
            fn(7)
    args = cam_get_comm(7, 0, 1, addr())  # the slot can be reused
    assert header(args)[0][2] == 1


def test_torch_ops(solo):
    port = comm_mod._SLOTS[7].address[1]
    got = torch.ops.cam_jit.cam_get_comm(7, 0, 1, f"127.0.0.1:{port}")
    assert got is solo
    torch.library.opcheck(torch.ops.cam_jit.cam_get_comm, (7, 0, 1, f"127.0.0.1:{port}"))
    assert torch.ops.cam_jit.cam_free_comm(7) is None
    assert 7 not in comm_mod._SLOTS


def test_magic_sequence_and_wrap(solo):
    assert cam_get_magic(7) == 1
    assert [cam_get_and_increase_magic(7) for _ in range(3)] == [1, 2, 3]
    assert cam_get_magic(7) == 4
    comm_mod._SLOTS[7].magic = 2**30 - 2
    assert cam_get_and_increase_magic(7) == 2**30 - 2
    assert cam_get_and_increase_magic(7) == 2**30 - 1
    assert cam_get_magic(7) == 2**30  # observable before the next call resets it
    assert cam_get_and_increase_magic(7) == 1
    assert cam_get_magic(7) == 2


def test_magic_is_per_communicator(solo):
    other = cam_get_comm(8, 0, 1, addr())
    try:
        cam_get_and_increase_magic(7)
        cam_get_and_increase_magic(7)
        assert (cam_get_magic(7), cam_get_magic(8)) == (3, 1)
        assert header(other)[0][:4] == (0, 0, 1, 1)
    finally:
        cam_free_comm(8)


def test_rendezvous_timeout(monkeypatch):
    monkeypatch.setenv("CAM_JIT_COMM_TIMEOUT", "1")
    port = free_port()  # nobody hosts it: rank 1 cannot reach rank 0
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        cam_get_comm(9, 1, 2, f"127.0.0.1:{port}")
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert "cam_get_comm" in text and f"127.0.0.1:{port}" in text and "rank 1 of 2" in text
    assert 9 not in comm_mod._SLOTS


# ----------------------------------------------------------------------------------------------
# multi-rank
# ----------------------------------------------------------------------------------------------
def _create_and_describe(port, comm_id):
    rank, world = dist.get_rank(), dist.get_world_size()
    args = cam_get_comm(comm_id, rank, world, f"127.0.0.1:{port}")
    try:
        ints, mem_len, raw = header(args)
        magics = [cam_get_and_increase_magic(comm_id) for _ in range(3)]
        # the communicator works on its own: a gloo all-reduce over it
        group = comm_mod._SLOTS[comm_id].group
        t = torch.tensor([float(rank + 1)])
        group.allreduce([t]).wait()
        return ints, mem_len, cam_get_rank_size(comm_id), magics, cam_get_magic(comm_id), t.item()
    finally:
        cam_free_comm(comm_id)


@pytest.mark.parametrize("ranks", [2, 4])
def test_multi_rank_comm(rank_pool, ranks):
    results = rank_pool(ranks).run(_create_and_describe, free_port(), 11)
    for rank, (ints, mem_len, size, magics, magic, total) in enumerate(results):
        assert ints == (rank, rank, ranks, ranks, 0, 0)  # one host: localRankSize = rankSize
        assert mem_len == 204 * 2**20
        assert size == ranks and magics == [1, 2, 3] and magic == 4
        assert total == ranks * (ranks + 1) / 2


def _resources():
    me = os.getpid()
    children = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children += int(f.read().rsplit(")", 1)[1].split()[1]) == me
            except (OSError, IndexError, ValueError):
                pass
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), children


def _create_free_cycles(ports):
    rank, world = dist.get_rank(), dist.get_world_size()
    cam_get_comm(12, rank, world, f"127.0.0.1:{ports[0]}")  # warm-up: one-time allocations
    cam_free_comm(12)
    dist.barrier()  # every rank has freed before the next rendezvous
    before = _resources()
    during = None
    for port in ports[1:]:
        cam_get_comm(12, rank, world, f"127.0.0.1:{port}")
        during = _resources()
        cam_free_comm(12)
        dist.barrier()
    return before, during, _resources()


def test_free_releases_everything(rank_pool):
    results = rank_pool(2).run(_create_free_cycles, [free_port() for _ in range(21)])
    for rank, (before, during, after) in enumerate(results):
        assert during[0] > before[0] and during[1] > before[1], (rank, before, during)  # the probe sees them
        assert after == before, f"rank {rank}: (threads, fds, child processes) {before} -> {after} after 20 cycles"
