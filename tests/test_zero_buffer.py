"""FusedDeepMoeBuffer (SPEC.md §5) on CPU: zb_fused_deep_moe through shared memory equals
cam_jit.fused_deep_moe through gloo bit for bit (same math, another transport; the gloo path is
itself checked against cam_jit.reference in test_fused_deep_moe.py, and here once more against
the reference); lifecycle, errors, timeouts, a killed peer, and /dev/shm left clean."""
import glob
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import cam_jit
from cam_jit import reference
from cam_jit.zero_buffer import FusedDeepMoeBuffer
from cam_jit.zero_buffer._heap import Heap
from cam_jit.zero_buffer._strict import round_recv_tokens, workspace_fixed
from dist_harness import free_port
from moe_cases import make_rank_case

SMALL = dict(hidden=256, inter=128, experts=8, topk=4)
TINY = dict(hidden=32, inter=16, experts=4, topk=2)
MEMSIZE = 16 << 20
POSITIONAL = ("x", "expert_ids", "gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale",
              "expert_scales", "share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight",
              "share_gmm2_weight_scale", "expert_smooth_scales", "share_smooth_scales", "x_active_mask")
SEGMENTS = "/dev/shm/cam_jit_zb.*"


def zb_args(kw):
    """fused_deep_moe kwargs -> zb_fused_deep_moe's positional arguments (SPEC.md §5.1 order)."""
    return [kw[k] for k in POSITIONAL] + ["", kw["ep_rank_size"], kw["ep_rank_id"], kw["moe_expert_num"],
                                          kw["quant_mode"], kw["global_bs"]]


def _open(port, memsize=MEMSIZE, **init_kw):
    buf = FusedDeepMoeBuffer()
    buf.init(dist.get_rank(), dist.get_world_size(), memsize, f"tcp://127.0.0.1:{port}", **init_kw)
    return buf


def _equal(a, b):
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


# -- rank bodies (module level: they run in the rank pool) ----------------------------------------
def zb_vs_collective(port, seed, params, with_reference):
    kw = make_rank_case(seed, dist.get_rank(), **params)
    with torch.no_grad(), _open(port) as buf:
        got = buf.zb_fused_deep_moe(*zb_args(kw))
        collective = cam_jit.fused_deep_moe(**kw)
        ref = reference.fused_deep_moe(**dict(kw, group_ep=dist.group.WORLD)) if with_reference else None
    return got, collective, ref


def repeated_calls(port, seed, calls):
    """`calls` calls cycling through batch sizes 0..7 (global_bs covers the largest), each checked
    against the collective path's result for that batch."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    cases = [make_rank_case(seed + bs, rank, ranks=ranks, bs=(bs + rank) % 8, global_bs=8 * ranks,
                            minus_one_frac=0.25, **TINY) for bs in range(8)]
    with torch.no_grad():
        expected = [cam_jit.fused_deep_moe(**kw) for kw in cases]
        with _open(port) as buf:
            for i in range(calls):
                if not _equal(buf.zb_fused_deep_moe(*zb_args(cases[i % 8])), expected[i % 8]):
                    return i
    return None


def lifecycle(port, other_port):
    rank, ranks = dist.get_rank(), dist.get_world_size()
    kw = make_rank_case(5, rank, ranks=ranks, bs=4, **TINY)
    buf = FusedDeepMoeBuffer()
    facts = {"fresh": (buf.is_initialized(), buf.get_ext_info(), buf.get_shmem_workspace())}
    with torch.no_grad():
        want = cam_jit.fused_deep_moe(**kw)
        buf.init(rank, ranks, MEMSIZE, f"tcp://127.0.0.1:{port}")
        ext, ws = buf.get_ext_info(), buf.get_shmem_workspace()
        facts["regions"] = (ext != 0, ws - ext)
        buf.init(rank, ranks, MEMSIZE, f"tcp://127.0.0.1:{port}")  # silent no-op
        facts["second_init_keeps"] = (buf.get_ext_info(), buf.get_shmem_workspace()) == (ext, ws)
        facts["first"] = _equal(buf.zb_fused_deep_moe(*zb_args(kw)), want)
        facts["keywords"] = _equal(buf.zb_fused_deep_moe(**dict(
            {k: kw[k] for k in POSITIONAL}, group_ep="", ep_rank_size=ranks, ep_rank_id=rank,
            moe_expert_num=kw["moe_expert_num"], quant_mode=0, global_bs=kw["global_bs"])), want)
        buf.close()
        buf.close()  # idempotent
        facts["closed"] = (buf.is_initialized(), buf.get_ext_info(), buf.get_shmem_workspace())
        try:
            buf.zb_fused_deep_moe(*zb_args(kw))
        except RuntimeError as err:
            facts["closed_call"] = str(err)
        # re-init at the same address, plus two more buffers alive at the same time (same and other address)
        buf.init(rank, ranks, MEMSIZE, f"tcp://127.0.0.1:{port}")
        same, other = _open(port), _open(other_port, memsize=MEMSIZE * 2)
        facts["three_buffers"] = all(_equal(b.zb_fused_deep_moe(*zb_args(kw)), want)
                                     for b in (buf, other, same, buf, same, other))
        for b in (same, other, buf):
            b.close()
    facts["segments_left"] = glob.glob(SEGMENTS)
    return facts


def refusal(port, bad_rank, overrides):
    """bad_rank calls with bad arguments; everyone then makes a good call on the same buffer."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    kw = make_rank_case(6, rank, ranks=ranks, bs=4, **TINY)
    outcome = {}
    with torch.no_grad(), _open(port, memsize=overrides.pop("memsize", MEMSIZE)) as buf:
        if rank != bad_rank and "big" in overrides:  # only bad_rank routes more pairs than fit
            kw["x_active_mask"] = torch.zeros(kw["x"].shape[0], dtype=torch.bool)
        args = zb_args(dict(kw, **overrides) if rank == bad_rank else kw)
        try:
            buf.zb_fused_deep_moe(*args)
            outcome["first"] = "ok"
        except (TypeError, ValueError, RuntimeError) as err:
            outcome["first"] = (type(err).__name__, str(err))
        if "big" not in overrides:
            outcome["second"] = _equal(buf.zb_fused_deep_moe(*zb_args(kw)), cam_jit.fused_deep_moe(**kw))
    return outcome


class _FailingExperts:
    """cpu_kernels() whose expert FFN raises: a rank failing after it has dispatched."""

    def __init__(self, kernels):
        self._kernels = kernels

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def expert_ffn_w8a8(self, *args):
        raise RuntimeError("expert FFN exploded")


def failure_after_dispatch(port):
    from cam_jit.zero_buffer import buffer as zb

    rank = dist.get_rank()
    kw = make_rank_case(11, rank, ranks=2, bs=4, **TINY)
    real = zb.cpu_kernels
    if rank == 1:
        zb.cpu_kernels = lambda: _FailingExperts(real())
    start = time.monotonic()
    try:
        with torch.no_grad(), _open(port, timeout=60.0) as buf:
            try:
                buf.zb_fused_deep_moe(*zb_args(kw))
            except RuntimeError as err:
                try:
                    buf.zb_fused_deep_moe(*zb_args(kw))
                except RuntimeError as again:
                    return str(err), time.monotonic() - start, str(again)
    finally:
        zb.cpu_kernels = real
    return "returned"


def strict_call(port, memsize, hidden, inter, bs=2):
    rank, ranks = dist.get_rank(), dist.get_world_size()
    kw = make_rank_case(7, rank, ranks=ranks, bs=bs, hidden=hidden, inter=inter, experts=4, topk=2)
    with torch.no_grad(), _open(port, memsize=memsize) as buf:
        try:
            buf.zb_fused_deep_moe(*zb_args(kw), strict=True)
            return "ok"
        except (ValueError, RuntimeError) as err:
            return f"{type(err).__name__}: {err}"


def init_without_peer(port):
    if dist.get_rank() == 1:
        return "absent"
    start = time.monotonic()
    try:
        _open(port, timeout=1.0)
    except RuntimeError as err:
        return str(err), time.monotonic() - start, glob.glob(SEGMENTS)
    return "initialised"


def init_mismatched_memsize(port):
    try:
        _open(port, memsize=MEMSIZE + dist.get_rank() * 4096, timeout=30.0)
    except ValueError as err:
        return str(err)
    return "initialised"


def call_without_peer(port):
    rank = dist.get_rank()
    kw = make_rank_case(8, rank, ranks=2, bs=2, **TINY)
    with torch.no_grad(), _open(port, timeout=1.0) as buf:
        if rank == 1:
            return "absent"
        start = time.monotonic()
        try:
            buf.zb_fused_deep_moe(*zb_args(kw))
        except RuntimeError as first:
            try:
                buf.zb_fused_deep_moe(*zb_args(kw))
            except RuntimeError as second:
                return str(first), time.monotonic() - start, str(second)
    return "returned"


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks,params", [
    (2, dict(bs=[6, 4], share_inter=96, smooth=True, active_counts=[4, 0], **SMALL)),
    (2, dict(bs=5, share_inter=128, per_expert_lists=True, dtype=torch.float16, **SMALL)),
    (4, dict(bs=[5, 0, 9, 1], global_bs=36, minus_one_frac=0.2, share_inter=64, **SMALL)),
    (4, dict(bs=6, smooth=True, share_inter=128, share_smooth=True, active_counts=[6, 3, 0, 5],
             empty_experts=[1, 2], **SMALL)),
    (4, dict(bs=3, hidden=128, inter=64, experts=8, topk=2, empty_experts=list(range(2, 8)))),
    (1, dict(bs=7, smooth=True, **SMALL)),
], ids=["r2-mask-shared-smooth", "r2-fp16-lists", "r4-uneven-minus1", "r4-mask-smooth", "r4-all-to-rank0", "r1"])
def test_bit_identical_to_collective_path(rank_pool, ranks, params):
    params = dict(ranks=ranks, **params)
    results = rank_pool(ranks).run(zb_vs_collective, free_port(), 31, params, ranks == 2)
    for rank, (got, collective, ref) in enumerate(results):
        assert isinstance(got, list) and len(got) == 3
        for name, a, b in zip(("output", "share_output", "expert_token_nums"), got, collective):
            assert a.dtype == b.dtype and a.shape == b.shape, f"rank {rank} {name}"
            assert torch.equal(a, b), f"rank {rank} {name}: {(a.float() - b.float()).abs().max()}"
        if ref is not None:  # and close to the independent reference (§1.13: within 1 ulp)
            assert torch.equal(got[2], ref[2])
            assert (got[0].float() - ref[0].float()).abs().max() <= 0.02 * ref[0].float().abs().max() + 1e-3
    assert not glob.glob(SEGMENTS)


def test_repeated_calls_with_changing_batches(rank_pool):
    assert rank_pool(2).run(repeated_calls, free_port(), 40, 1000) == [None, None]


def test_lifecycle_getters_reinit_and_several_buffers(rank_pool):
    for rank, facts in enumerate(rank_pool(2).run(lifecycle, free_port(), free_port())):
        assert facts["fresh"] == (False, 0, 0)
        assert facts["regions"] == (True, 2 * 1024 * 1024)
        assert facts["second_init_keeps"] and facts["first"] and facts["keywords"], facts
        assert facts["closed"] == (False, 0, 0)
        assert facts["closed_call"] == "Buffer not initialized, call init() first"
        assert facts["three_buffers"]
        assert facts["segments_left"] == []


@pytest.mark.parametrize("overrides,error,fragments", [
    (dict(expert_scales=torch.zeros(4, 3)), ValueError, ["expert_scales", "[4, 2]"]),
    (dict(ep_rank_id=0), ValueError, ["ep_rank_id", "expected 1"]),
    (dict(gmm1_weight=[torch.zeros(2, 32, 4, dtype=torch.int32)]), TypeError, ["W8A8 only", "got int32"]),
    (dict(memsize=(2 << 20) + 512, big=True), ValueError, ["memsize >=", "pairs to rank"]),
], ids=["bad-shape", "wrong-rank-id", "w4a8", "over-capacity"])
def test_refused_call_raises_everywhere(rank_pool, overrides, error, fragments):
    bad, good = rank_pool(2).run(refusal, free_port(), 1, overrides)[::-1]
    assert bad["first"][0] == error.__name__ and all(f in bad["first"][1] for f in fragments), bad
    assert good["first"][0] == "RuntimeError" and "rank(s) [1] refused" in good["first"][1], good
    if "big" not in overrides:
        assert bad["second"] and good["second"]  # still usable


def test_rank_failing_after_dispatch_aborts_its_peers(rank_pool):
    (survivor, elapsed, again), (failed, _, failed_again) = rank_pool(2).run(failure_after_dispatch, free_port())
    assert failed == "expert FFN exploded"
    assert "rank 1 gave up" in survivor and elapsed < 10, survivor  # the abort notice, not the 60 s timeout
    assert "unusable since an earlier call failed" in again and "unusable" in failed_again


def test_strict_workspace_formula(rank_pool):
    hidden, inter, ranks = 1024, 512, 2
    fixed = workspace_fixed(ranks, 2, 2, 2, hidden)
    assert fixed == 512 + 8192 + 16384 + (16 << 20) + 3 * 511
    assert round_recv_tokens(fixed + 64 * (hidden + 36), fixed, hidden, inter) == 64
    assert round_recv_tokens(fixed + 64 * (hidden + 36) - 1, fixed, hidden, inter) == 0
    ext = 2 << 20
    small, tight, fine = (rank_pool(2).run(strict_call, free_port(), memsize, hidden, inter)
                          for memsize in (ext + fixed - 1, ext + fixed + 100, ext + fixed + 64 * (hidden + 36)))
    assert all(f"SHMEM workspace is too small: size={fixed - 1}, fixedSize={fixed}." in r for r in small), small
    assert all("fewer than 64 tokens for the round buffer" in r for r in tight), tight
    assert fine == ["ok", "ok"]
    # the zero buffer allows BS up to 40960 where fused_deep_moe's strict mode stops at 256
    big = ext + workspace_fixed(ranks, 2, 300, 2, hidden) + 64 * (hidden + 36)
    assert rank_pool(2).run(strict_call, free_port(), big, hidden, inter, 300) == ["ok", "ok"]


def test_init_without_peer_times_out_naming_it(rank_pool):
    reply = rank_pool(2).run(init_without_peer, free_port())[0]
    message, elapsed, segments = reply
    assert "waiting for rank(s) [1] to join did not finish within 1 s" in message
    assert elapsed < 10 and segments == []


def test_init_rejects_ranks_that_disagree(rank_pool):
    for message in rank_pool(2).run(init_mismatched_memsize, free_port()):
        assert f"argument 'memsize': expected the same value on every rank, got [{MEMSIZE}, {MEMSIZE + 4096}]" \
            in message
    assert not glob.glob(SEGMENTS)


def test_ranks_on_different_hosts_are_rejected():
    """The same-host check on the records ranks publish at init (two hosts cannot be simulated)."""
    heap = Heap.__new__(Heap)
    heap.rank, heap.num_ranks = 0, 2
    record = dict(name="/cam_jit_zb.x", host="node-a", boot_id="b1", pid_ns="", pid=1, start_time=None, num_ranks=2,
                  memsize=MEMSIZE)
    records = [record, dict(record, host="node-b", boot_id="b2")]
    with pytest.raises(RuntimeError, match=r"needs every rank on one host .* rank\(s\) \[1\] run on another host"):
        heap._check_peers("FusedDeepMoeBuffer.init", records)
    assert [p.rank for p in heap._check_peers("x", [record, record])] == [0, 1]


def test_call_without_peer_times_out_naming_it(rank_pool):
    message, elapsed, second = rank_pool(2).run(call_without_peer, free_port())[0]
    assert "rank 1 did not send its token dispatch signal of call 1 within 1 s" in message
    assert elapsed < 5
    assert "unusable since an earlier call failed" in second


@pytest.mark.parametrize("kwargs,error,fragment", [
    (dict(rank=0, num_ranks=2, memsize=2 << 20, ip_port="tcp://127.0.0.1:1"), ValueError, "more than 2097152"),
    (dict(rank=2, num_ranks=2, memsize=8 << 20, ip_port="tcp://127.0.0.1:1"), ValueError, "'rank'"),
    (dict(rank=0, num_ranks=0, memsize=8 << 20, ip_port="tcp://127.0.0.1:1"), ValueError, "'num_ranks'"),
    (dict(rank=0, num_ranks=1, memsize=8 << 20, ip_port="127.0.0.1:29500"), ValueError, "tcp://host:port"),
    (dict(rank=0, num_ranks=1, memsize=8 << 20, ip_port="tcp://127.0.0.1:70000"), ValueError, "[1, 65535]"),
    (dict(rank=0, num_ranks=1, memsize=8 << 20, ip_port=29500), TypeError, "'ip_port'"),
    (dict(rank=0, num_ranks=1, memsize=8.0, ip_port="tcp://127.0.0.1:1"), TypeError, "'memsize'"),
    (dict(rank=0, num_ranks=1, memsize=8 << 20, ip_port="tcp://127.0.0.1:1", timeout=0), ValueError, "'timeout'"),
])
def test_init_argument_errors(kwargs, error, fragment):
    with pytest.raises(error, match="FusedDeepMoeBuffer.init: argument") as info:
        FusedDeepMoeBuffer().init(**kwargs)
    assert fragment in str(info.value)


def test_uninitialised_buffer():
    buf = FusedDeepMoeBuffer()
    assert (buf.is_initialized(), buf.get_ext_info(), buf.get_shmem_workspace()) == (False, 0, 0)
    with pytest.raises(RuntimeError, match=r"^Buffer not initialized, call init\(\) first$"):
        buf.zb_fused_deep_moe(*([None] * 20))
    buf.close()


def test_single_process_buffer_and_gc():
    """R = 1 needs no process group; dropping the last reference releases the mapping."""
    kw = make_rank_case(9, 0, ranks=1, bs=3, **TINY)
    buf = FusedDeepMoeBuffer()
    buf.init(0, 1, MEMSIZE, f"tcp://127.0.0.1:{free_port()}")
    with torch.no_grad():
        assert _equal(buf.zb_fused_deep_moe(*zb_args(kw)), cam_jit.fused_deep_moe(**kw))
    maps = _mapped_segments()
    assert len(maps) == 1
    del buf
    assert len(_mapped_segments()) == len(maps) - 1 and not glob.glob(SEGMENTS)


def _mapped_segments():
    with open("/proc/self/maps") as f:
        return [line for line in f if "cam_jit_zb." in line]


# -- a SIGKILLed rank, in processes of this test's own ------------------------------------------
def _kill_worker(rank, ranks, port, conn):
    import torch  # noqa: F811 - spawned process
    torch.set_num_threads(1)
    buf = FusedDeepMoeBuffer()
    buf.init(rank, ranks, MEMSIZE, f"tcp://127.0.0.1:{port}", timeout=60.0)
    kw = make_rank_case(10, rank, ranks=ranks, bs=4, **dict(TINY, experts=6))
    calls = 0
    with torch.no_grad():
        try:
            while True:
                buf.zb_fused_deep_moe(*zb_args(kw))
                calls += 1
                if calls == 3:
                    conn.send(("running", os.getpid()))
        except RuntimeError as err:
            conn.send(("raised", str(err), time.monotonic()))
    buf.close()
    conn.send(("segments", glob.glob(SEGMENTS), len(_mapped_segments())))


def _receive(conn, proc, seconds):
    deadline = time.monotonic() + seconds
    while not conn.poll(0.1):
        assert proc.is_alive(), f"{proc.name} exited with code {proc.exitcode}"
        assert time.monotonic() < deadline, f"{proc.name} sent nothing within {seconds} s"
    return conn.recv()


def test_killed_peer_makes_survivors_raise_and_leaves_no_segment():
    ctx = mp.get_context("spawn")
    ranks, victim, port = 3, 2, free_port()
    pipes = [ctx.Pipe() for _ in range(ranks)]
    procs = [ctx.Process(target=_kill_worker, args=(r, ranks, port, pipes[r][1]), daemon=True)
             for r in range(ranks)]
    try:
        for p in procs:
            p.start()
        for rank, (conn, _) in enumerate(pipes):
            assert _receive(conn, procs[rank], 90)[0] == "running"
        killed_at = time.monotonic()
        os.kill(procs[victim].pid, signal.SIGKILL)
        for rank in (0, 1):
            kind, message, raised_at = _receive(pipes[rank][0], procs[rank], 20)
            assert kind == "raised" and f"rank {victim} (pid {procs[victim].pid}) exited" in message, message
            assert raised_at - killed_at < 5.0  # liveness polling, far below the 60 s timeout
            kind, segments, mapped = _receive(pipes[rank][0], procs[rank], 20)
            assert (kind, segments, mapped) == ("segments", [], 0)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not glob.glob(SEGMENTS)


def _init_death_worker(rank, ranks, port, conn, victim):
    if rank == victim:  # dies like a SIGKILL (no cleanup) once its segment is created and published
        Heap._check_peers = lambda *args: os._exit(9)
    start = time.monotonic()
    try:
        FusedDeepMoeBuffer().init(rank, ranks, MEMSIZE, f"tcp://127.0.0.1:{port}", timeout=60.0)
        conn.send(("initialised",))
    except RuntimeError as err:
        conn.send(("raised", str(err), time.monotonic() - start, glob.glob(SEGMENTS)))


def test_rank_dying_inside_init_leaves_no_segment():
    """A rank that dies between creating its segment and unlinking it: the survivors notice,
    raise, and unlink its name (and their own)."""
    ctx = mp.get_context("spawn")
    ranks, victim, port = 3, 2, free_port()
    pipes = [ctx.Pipe() for _ in range(ranks)]
    procs = [ctx.Process(target=_init_death_worker, args=(r, ranks, port, pipes[r][1], victim), daemon=True)
             for r in range(ranks)]
    try:
        for p in procs:
            p.start()
        messages = []
        for rank in (0, 1):
            kind, message, elapsed, _ = _receive(pipes[rank][0], procs[rank], 90)
            assert kind == "raised" and elapsed < 30, message  # polling, long before the 60 s timeout
            messages.append(message)
        # the first survivor to notice names the victim; the other may see that survivor give up first
        assert any(f"rank(s) [{victim}] exited (pid {procs[victim].pid})" in m for m in messages), messages
        assert all("exited (pid" in m or "abandoned init" in m for m in messages), messages
        procs[victim].join(10)
        assert procs[victim].exitcode == 9
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not glob.glob(SEGMENTS)
