"""Ranks that disagree, refuse or lie (real gloo ranks): every multi-rank op checks in the exchange
it already makes what all ranks must share, and every rank raises naming the argument and each
rank's value; counts a peer announces are range-checked before they size or index anything.
Covers fused_deep_moe on both paths (collective and FusedDeepMoeBuffer), the low-latency
dispatch/combine and the agreement helper itself."""
import glob
import time

import pytest
import torch
import torch.distributed as dist

import cam_jit
from cam_jit.ops import _exchange, _moe_cpu
from cam_jit.ops.moe_lowlatency import moe_combine_lowlatency, moe_dispatch_lowlatency
from cam_jit.zero_buffer import FusedDeepMoeBuffer
from dist_harness import free_port
from moe_cases import make_rank_case
from test_zero_buffer import MEMSIZE, SEGMENTS, zb_args

TINY = dict(hidden=32, inter=16, experts=4, topk=2)
# what rank 1 changes -> the argument every rank must name, and each rank's value
MISMATCHES = {
    "H": (dict(hidden=64), "x.shape[1]", "{0: 32, 1: 64}"),
    "E": (dict(experts=8), "moe_expert_num", "{0: 4, 1: 8}"),
    "dtype": (dict(dtype=torch.float16), "x.dtype", "{0: bfloat16, 1: float16}"),
}


def _case(seed, change):
    rank = dist.get_rank()
    params = dict(TINY, per_expert_lists=True)
    params.update(change if rank == 1 else {})
    return make_rank_case(seed, rank, ranks=dist.get_world_size(), bs=3, **params)


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
        return "ok"
    except (ValueError, TypeError, RuntimeError) as err:
        return type(err).__name__, str(err), time.monotonic() - start


def collective_mismatch(change):
    kw = _case(40, change)
    with torch.no_grad():
        first = _outcome(lambda: cam_jit.fused_deep_moe(**kw))
        again = _outcome(lambda: cam_jit.fused_deep_moe(**_case(40, {})))  # the group still works
    return first, again


def buffer_mismatch(port, change):
    kw = _case(41, change)
    buf = FusedDeepMoeBuffer()
    buf.init(dist.get_rank(), dist.get_world_size(), MEMSIZE, f"tcp://127.0.0.1:{port}", timeout=30.0)
    with torch.no_grad(), buf:
        first = _outcome(lambda: buf.zb_fused_deep_moe(*zb_args(kw)))
        good = _case(41, {})
        again = torch.equal(buf.zb_fused_deep_moe(*zb_args(good))[0], cam_jit.fused_deep_moe(**good)[0])
    return first, again


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_collective_path_mismatch_raises_on_every_rank(rank_pool, what):
    change, arg, values = MISMATCHES[what]
    for rank, (first, again) in enumerate(rank_pool(2).run(collective_mismatch, change)):
        kind, message, elapsed = first
        assert kind == "ValueError" and f"argument '{arg}'" in message and values in message, (rank, message)
        assert "same value on all 2 ranks" in message and elapsed < 10, message
        assert again == "ok"


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_zero_buffer_mismatch_raises_on_every_rank_and_stays_usable(rank_pool, what):
    change, arg, values = MISMATCHES[what]
    for rank, (first, again) in enumerate(rank_pool(2).run(buffer_mismatch, free_port(), change)):
        kind, message, elapsed = first
        assert kind == "ValueError" and f"argument '{arg}'" in message and values in message, (rank, message)
        assert again, rank
    assert not glob.glob(SEGMENTS)


def lowlatency_mismatch():
    rank = dist.get_rank()
    kw = make_rank_case(42, rank, ranks=2, bs=3, **dict(TINY, hidden=32 * (1 + rank)))
    group = dict(group_ep=dist.group.WORLD, ep_world_size=2, ep_rank_id=rank, moe_expert_num=4)
    dispatch = _outcome(lambda: moe_dispatch_lowlatency(kw["x"], kw["expert_ids"], quant_mode=2 * rank, **group))
    # combine with expand_x rows of different widths
    good = make_rank_case(42, rank, ranks=2, bs=3, **TINY)
    out = moe_dispatch_lowlatency(good["x"], good["expert_ids"], quant_mode=0, **group)
    results = out[0] if rank == 0 else torch.cat([out[0], out[0]], 1)
    combine = _outcome(lambda: moe_combine_lowlatency(results, good["expert_ids"], out[2], out[4],
                                                      good["expert_scales"], **group))
    return dispatch, combine


def test_lowlatency_mismatch_raises_on_every_rank(rank_pool):
    for dispatch, combine in rank_pool(2).run(lowlatency_mismatch):
        assert dispatch[0] == "ValueError" and "argument 'x.shape[1]'" in dispatch[1], dispatch
        assert "moe_dispatch_lowlatency" in dispatch[1] and "{0: 32, 1: 64}" in dispatch[1], dispatch
        assert combine[0] == "ValueError" and "argument 'expand_x.shape[1]'" in combine[1], combine


# a bad argument of rank 1 -> its exception and what its message names
REFUSALS = {
    "dtype": ("TypeError", "'expert_scales'"),
    "expert id": ("ValueError", "'expert_ids': expected values in [-1, 4) (-1 skips a slot; moe_expert_num = 4), "
                                "got a value 4"),  # found by the C++ routing, named as the argument
}


def one_rank_refuses(bad):
    """Rank 1 passes a bad argument: it raises its own error, rank 0 at once that rank 1 refused
    (timed from the call, the kernels already built)."""
    cam_jit.load("cpu")
    rank = dist.get_rank()
    kw = make_rank_case(43, rank, ranks=2, bs=3, **TINY)
    if rank == 1 and bad == "dtype":
        kw["expert_scales"] = kw["expert_scales"].double()
    if rank == 1 and bad == "expert id":
        kw["expert_ids"][0, 0] = TINY["experts"]
    return _outcome(lambda: cam_jit.fused_deep_moe(**kw))


@pytest.mark.parametrize("bad", sorted(REFUSALS))
def test_a_refusing_rank_makes_its_peers_raise_at_once(rank_pool, bad):
    own, peer = rank_pool(2).run(one_rank_refuses, bad)[::-1]
    kind, named = REFUSALS[bad]
    assert own[0] == kind and named in own[1], own
    assert peer[0] == "ValueError" and "rank(s) [1]" in peer[1] and "rejected their arguments" in peer[1], peer
    assert peer[2] < 10


def lying_counts():
    """Rank 1 announces more rows than it could have routed: every rank refuses the call."""
    rank = dist.get_rank()
    send = [1, 1] if rank == 0 else [1 << 40, 0]
    return _outcome(lambda: _moe_cpu.exchange_counts("test_op", dist.group.WORLD, send, 2, {"H": 8}))


def mixed_ops():
    rank = dist.get_rank()
    return _outcome(lambda: _exchange.agree("op_a" if rank == 0 else "op_b", dist.group.WORLD, {"H": 8}))


def test_forged_counts_and_mixed_ops_are_refused(rank_pool):
    for kind, message, _ in rank_pool(2).run(lying_counts):
        assert kind == "RuntimeError" and "rank 1 announced row counts [1099511627776, 0]" in message, message
    for kind, message, _ in rank_pool(2).run(mixed_ops):
        assert kind == "ValueError" and "called another cam_jit op" in message, message


class _LyingKernels:
    """The cpu_zb kernels of a rank whose dispatch signal announces `extra` more rows to rank 0
    than it wrote (`extra=None`: more than a slice holds)."""

    def __init__(self, kernels, transport, extra):
        self._kernels, self._transport, self._extra = kernels, transport, extra

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def publish(self, slots, counts, meta, value, bells):
        if len(meta) > 1:  # a dispatch signal
            counts = list(counts)
            counts[0] = self._transport.geometry(TINY["hidden"], torch.bfloat16).cap + 1 if self._extra is None \
                else counts[0] + self._extra
        return self._kernels.publish(slots, counts, meta, value, bells)


def buffer_with_lying_peer(port, extra):
    rank = dist.get_rank()
    kw = make_rank_case(44, rank, ranks=2, bs=3, **TINY)
    buf = FusedDeepMoeBuffer()
    buf.init(rank, 2, MEMSIZE, f"tcp://127.0.0.1:{port}", timeout=30.0)
    with torch.no_grad(), buf:
        buf.zb_fused_deep_moe(*zb_args(kw))  # an honest first call leaves rows of call 1 behind
        if rank == 1:
            buf._transport.kernels = _LyingKernels(buf._transport.kernels, buf._transport, extra)
        return _outcome(lambda: buf.zb_fused_deep_moe(*zb_args(kw)))


@pytest.mark.parametrize("extra", [None, 1], ids=["over-capacity", "stale-rows"])
def test_zero_buffer_refuses_forged_counts(rank_pool, extra):
    receiver, liar = rank_pool(2).run(buffer_with_lying_peer, free_port(), extra)
    assert receiver[0] in ("RuntimeError", "PeerFailure"), receiver
    if extra is None:
        assert "rank(s) [1] announced {1: " in receiver[1] and "more than the" in receiver[1], receiver
    else:
        assert "rank 1 announced" in receiver[1] and "is not from this call" in receiver[1], receiver
    assert liar[0] == "PeerFailure" and "rank 0 gave up" in liar[1], liar
    assert not glob.glob(SEGMENTS)
