"""all2_all_detour / reduce_scatter_detour (cam_jit.ops.detour, SPEC.md §3) against the
all-gather reference (cam_jit.reference.detour) on communicators of R = 1, 2, 4, 8 gloo ranks
created with cam_get_comm; member subsets in any order, every dtype and op, hand-computed cases
(chunk placement, fold order, float32 accumulation), the magic sequence, members that disagree,
timeouts, strict mode, bad inputs, fake kernels."""
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from cam_jit.ops import comm as comm_mod
from cam_jit.ops.comm import cam_free_comm, cam_get_comm, cam_get_magic
from cam_jit.ops.detour import all2_all_detour, reduce_scatter_detour
from cam_jit.reference import detour as reference
from dist_harness import free_port

A2A_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32)
TINY = 2.0**-15  # an fp16 subnormal, far below half an f32 ulp of 2048 (2^-13)


# Summands whose float32 sum depends on the order (2048 + TINY - 2048 != 2048 - 2048 + TINY) and
# on float32 accumulation (2048 + 1 + 1): with G >= 3, a wrong fold order or precision shows.
CANCELLING = torch.tensor([2048.0, -2048.0, 1.0, -1.0, TINY, -TINY, 0.375, -3.0, 0.0])


def make_input(seed, rank, dtype, shape, cancelling=False):
    """Random data; `cancelling` draws from CANCELLING, else values spread over 2^-10 .. 2^10."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.int32:
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=gen)
    if cancelling:
        return CANCELLING[torch.randint(0, len(CANCELLING), shape, generator=gen)].to(dtype)
    scale = torch.exp2(torch.randint(-10, 10, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def bits(t):
    return t.contiguous().view(torch.uint8)


class Comm:
    """cam_get_comm on every rank of the pool's WORLD (rank = world rank), freed on exit."""

    def __init__(self, port, comm_id):
        self.comm_id = comm_id
        self.args = cam_get_comm(comm_id, dist.get_rank(), dist.get_world_size(), f"127.0.0.1:{port}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        cam_free_comm(self.comm_id)


def ids(members):
    return torch.tensor(members, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# op vs reference
# ----------------------------------------------------------------------------------------------
def _op_and_reference(port, cases):
    results = []
    with Comm(port, 20) as c:
        for kind, members, dtype, shape, op, seed in cases:
            x = make_input(seed, dist.get_rank(), dtype, shape, cancelling=kind == "rs" and op == 0)
            before = cam_get_magic(c.comm_id)
            if kind == "a2a":
                got = all2_all_detour(x, ids(members), c.args, c.comm_id)
                ref = reference.all2_all_detour(x, ids(members))
            else:
                got = reduce_scatter_detour(x, ids(members), c.args, c.comm_id, op)
                ref = reference.reduce_scatter_detour(x, ids(members), op)
            results.append((got, ref, cam_get_magic(c.comm_id) - before))
    return results


def member_lists(ranks):
    lists = [list(range(ranks)), list(range(ranks))[::-1]]
    if ranks == 2:
        lists.append([1])
    if ranks >= 4:
        lists += [[3, 0, 2], [ranks - 1, 1]]
    return lists


def cases_for(ranks):
    cases = []
    for i, members in enumerate(member_lists(ranks)):
        g = len(members)
        for dtype in A2A_DTYPES:
            cases.append(("a2a", members, dtype, (g * 4 + 1, 3), None, i))  # 3 tail elements
        cases.append(("a2a", members, torch.float16, (g * 2, 5), None, i))
        cases.append(("a2a", members, torch.float32, (0, 4), None, i))
        for op in (0, 2, 3):
            cases.append(("rs", members, torch.float16, (g * 2, 3, 5), op, i))
    return cases


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_matches_reference(rank_pool, ranks):
    cases = cases_for(ranks)
    results = rank_pool(ranks).run(_op_and_reference, free_port(), cases)
    for rank, per_rank in enumerate(results):
        for (kind, members, dtype, shape, op, _), (got, ref, magic_step) in zip(cases, per_rank):
            where = f"rank {rank}/{ranks} {kind} members={members} {dtype} {shape} op={op}"
            assert got.dtype == ref.dtype and got.shape == ref.shape, where
            expected_shape = shape if kind == "a2a" else (shape[0] // len(members), *shape[1:])
            assert tuple(got.shape) == expected_shape, where
            assert torch.equal(bits(got), bits(ref)), f"{where}: differs from the reference"
            if rank not in members:
                assert not bits(got).any(), f"{where}: a non-member must return zeros"
            assert magic_step == 1, f"{where}: the magic advanced by {magic_step}"


# ----------------------------------------------------------------------------------------------
# hand-computed cases
# ----------------------------------------------------------------------------------------------
def _hand_cases(port):
    rank = dist.get_rank()
    members = [2, 0, 3]  # rank 1 is a detour rank
    with Comm(port, 21) as c:
        x = torch.arange(7, dtype=torch.int32) + 100 * rank
        placed = all2_all_detour(x, ids(members), c.args, c.comm_id)
        # fold order: member at position m gets own + next + next-next (mod 3); chunk m of the
        # member at position p holds 2048, -2048, TINY for p = m, m+1, m+2 (mod 3): the right
        # order gives TINY, any other order 0.
        pos = members.index(rank) if rank in members else 0
        chunk = [0.0] * 3
        for m in range(3):
            chunk[m] = {0: 2048.0, 1: -2048.0, 2: TINY}[(pos - m) % 3]
        y = torch.tensor(chunk, dtype=torch.float16).repeat_interleave(6).view(6, 3)
        ordered = reduce_scatter_detour(y, ids(members), c.args, c.comm_id, 0)
        # float32 accumulation: 2048 + 1 + 1 is 2050 in f32 but 2048 in fp16 arithmetic
        z = torch.full((3, 2), 2048.0 if rank == 2 else 1.0, dtype=torch.float16)
        accumulated = reduce_scatter_detour(z, ids(members), c.args, c.comm_id, 0)
        w = torch.tensor([[-1.0 - rank, 5.0 + rank], [rank, -rank], [7.0, rank * 0.5]], dtype=torch.float16)
        maxed = reduce_scatter_detour(w, ids(members), c.args, c.comm_id, 2)
        mined = reduce_scatter_detour(w, ids(members), c.args, c.comm_id, 3)
    return placed, ordered, accumulated, maxed, mined


def test_hand_computed(rank_pool):
    results = rank_pool(4).run(_hand_cases, free_port())
    placed = [r[0].tolist() for r in results]
    assert placed[2] == [200, 201, 0, 1, 300, 301, 0]
    assert placed[0] == [202, 203, 2, 3, 302, 303, 0]
    assert placed[3] == [204, 205, 4, 5, 304, 305, 0]
    assert placed[1] == [0] * 7
    for rank in (0, 2, 3):
        _, ordered, accumulated, maxed, mined = results[rank]
        assert ordered.shape == (2, 3)
        assert torch.equal(ordered, torch.full((2, 3), TINY, dtype=torch.float16)), (rank, ordered)
        assert accumulated.tolist() == [[2050.0, 2050.0]], (rank, accumulated)
    row = {2: 0, 0: 1, 3: 2}  # chunk (row) m goes to the member at position m
    for rank, m in row.items():
        w = {r: [[-1.0 - r, 5.0 + r], [r, -r], [7.0, r * 0.5]] for r in (2, 0, 3)}
        assert results[rank][3].tolist() == [[max(w[r][m][j] for r in w) for j in range(2)]]
        assert results[rank][4].tolist() == [[min(w[r][m][j] for r in w) for j in range(2)]]
    assert not any(t.any() for t in results[1][1:])  # the detour rank


# ----------------------------------------------------------------------------------------------
# magic, promptness, disagreement, timeout, strict across ranks
# ----------------------------------------------------------------------------------------------
def _magic_and_failures(port):
    rank = dist.get_rank()
    seen = []
    with Comm(port, 22) as c:
        x = torch.ones(4, dtype=torch.float16)
        seen.append(cam_get_magic(c.comm_id))
        all2_all_detour(x, ids([0, 1]), c.args, c.comm_id)
        seen.append(cam_get_magic(c.comm_id))
        reduce_scatter_detour(x, ids([1]), c.args, c.comm_id, 0)
        seen.append(cam_get_magic(c.comm_id))
        with pytest.raises(ValueError):  # rejected before taking a magic number
            reduce_scatter_detour(x, ids([0, 1]), c.args, c.comm_id, 7)
        seen.append(cam_get_magic(c.comm_id))
        # a detour rank returns without waiting for the members
        if rank == 0:
            time.sleep(4.0)
        start = time.monotonic()
        all2_all_detour(x, ids([0]), c.args, c.comm_id)
        elapsed = time.monotonic() - start
        # members that disagree on numel: every member raises, nobody crashes or hangs
        try:
            all2_all_detour(torch.ones(8 + 4 * rank), ids([0, 1]), c.args, c.comm_id)
            disagreement = None
        except ValueError as err:
            disagreement = str(err)
        # ... and the communicator still works afterwards
        after = all2_all_detour(torch.full((4,), float(rank)), ids([0, 1]), c.args, c.comm_id)
        # strict: L % G != 0 is refused on every rank before any traffic
        try:
            all2_all_detour(torch.ones(5), ids([0, 1]), c.args, c.comm_id, strict=True)
            strict_text = None
        except ValueError as err:
            strict_text = str(err)
        seen.append(cam_get_magic(c.comm_id))
    return seen, elapsed, disagreement, after.tolist(), strict_text


def test_magic_promptness_disagreement_strict(rank_pool):
    results = rank_pool(2).run(_magic_and_failures, free_port())
    for rank, (seen, elapsed, disagreement, after, strict_text) in enumerate(results):
        assert seen == [1, 2, 3, 3, 6], (rank, seen)
        assert disagreement is not None and "disagree" in disagreement, disagreement
        assert ("numel 8 vs 12" if rank == 0 else "numel 12 vs 8") in disagreement, disagreement
        assert after == [0.0, 0.0, 1.0, 1.0]
        assert strict_text is not None and "strict" in strict_text and "'sendData'" in strict_text
        assert "len(commRankIds) = 2" in strict_text and "(got 5)" in strict_text
    assert results[1][1] < 2.0, f"the detour rank waited {results[1][1]:.2f} s for the member that slept 4 s"


def _timeout(port):
    rank = dist.get_rank()
    with Comm(port, 23) as c:
        if rank == 1:
            return None
        os.environ["CAM_JIT_COMM_TIMEOUT"] = "1"
        start = time.monotonic()
        try:
            all2_all_detour(torch.ones(4), ids([0, 1]), c.args, c.comm_id)
        except RuntimeError as err:
            return str(err), time.monotonic() - start
        finally:
            del os.environ["CAM_JIT_COMM_TIMEOUT"]
        return "no error", 0.0


def test_missing_member_times_out(rank_pool):
    text, elapsed = rank_pool(2).run(_timeout, free_port())[0]
    # rank 1 frees its communicator at once: rank 0 says that it dropped out, and when
    assert "all2_all_detour" in text and "rank 1" in text, text
    assert "a peer rank dropped its connection" in text and "of its 1 s limit, at " in text, text
    assert elapsed < 10


# ----------------------------------------------------------------------------------------------
# one process: bad inputs, strict texts, fake kernels, opcheck, autograd
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def solo():
    args = cam_get_comm(7, 0, 1, f"127.0.0.1:{free_port()}")
    yield args
    cam_free_comm(7)


@pytest.fixture
def fake_slot():
    """Slot 40 holding a communicator of `size` ranks that never communicates (strict checks run
    before any traffic)."""
    made = []

    def make(size):
        args = comm_mod.comm_args_tensor(0, size, 1, 204 << 20)
        comm_mod._SLOTS[40] = comm_mod.Communicator(40, 0, size, ("127.0.0.1", 1), None, None, args)
        made.append(40)
        return args

    yield make
    for slot in made:
        comm_mod._SLOTS.pop(slot, None)


OTHER_ARGS = comm_mod.comm_args_tensor(1, 2, 1, 204 << 20)  # rank 1 of 2: not slot 7's

# (case id, overrides, exception, fragments); run against both ops
COMMON_CASES = [
    ("send-not-tensor", dict(sendData=[1.0]), TypeError, ["'sendData'", "torch.Tensor", "list"]),
    ("ids-not-tensor", dict(commRankIds=[0]), TypeError, ["'commRankIds'", "torch.Tensor", "list"]),
    ("args-none", dict(commArgs=None), TypeError, ["'commArgs'", "torch.Tensor", "NoneType"]),
    ("id-str", dict(commId="7"), TypeError, ["'commId'", "an int", "str"]),
    ("strict-str", dict(strict="yes"), TypeError, ["'strict'", "None or a bool", "str"]),
    ("id-64", dict(commId=64), ValueError, ["'commId'", "[0, 63]", "got 64"]),
    ("id-negative", dict(commId=-1), ValueError, ["'commId'", "[0, 63]", "got -1"]),
    ("id-empty-slot", dict(commId=63), ValueError, ["'commId'", "live communicator", "got 63, an empty slot"]),
    ("ids-int64", dict(commRankIds=torch.zeros(1, dtype=torch.int64)), TypeError, ["'commRankIds'", "int32", "int64"]),
    ("ids-float", dict(commRankIds=torch.zeros(1)), TypeError, ["'commRankIds'", "int32", "float32"]),
    ("ids-2d", dict(commRankIds=torch.zeros(1, 1, dtype=torch.int32)), ValueError, ["'commRankIds'", "1-D", "2-D"]),
    ("ids-empty", dict(commRankIds=torch.zeros(0, dtype=torch.int32)), ValueError,
     ["'commRankIds'", "at least one member", "empty"]),
    ("ids-out-of-range", dict(commRankIds=ids([1])), ValueError, ["'commRankIds'", "in [0, 1)", "out of range: [1]"]),
    ("ids-negative", dict(commRankIds=ids([-1])), ValueError, ["'commRankIds'", "out of range: [-1]"]),
    ("ids-repeated", dict(commRankIds=ids([0, 0])), ValueError, ["'commRankIds'", "distinct", "repeated: [0]"]),
    ("args-dtype", dict(commArgs=torch.zeros(597740)), TypeError, ["'commArgs'", "float16", "float32"]),
    ("args-length", dict(commArgs=torch.zeros(100, dtype=torch.float16)), ValueError,
     ["'commArgs'", "[597740]", "[100]"]),
    ("args-2d", dict(commArgs=torch.zeros(2, 298870, dtype=torch.float16)), ValueError,
     ["'commArgs'", "[597740]", "[2, 298870]"]),
    ("args-of-another-comm", dict(commArgs=OTHER_ARGS), ValueError,
     ["'commArgs'", "communicator 7 (rank 0, rankSize 1", "rank 1, rankSize 2"]),
    ("args-meta", dict(commArgs=torch.zeros(597740, dtype=torch.float16, device="meta")), ValueError,
     ["'commArgs'", "cpu", "meta"]),
]

A2A_CASES = [
    ("send-int64", dict(sendData=torch.zeros(4, dtype=torch.int64)), TypeError,
     ["'sendData'", "float16 or bfloat16 or float32 or int32", "int64"]),
    ("send-float64", dict(sendData=torch.zeros(4, dtype=torch.float64)), TypeError, ["'sendData'", "float64"]),
    ("send-bool", dict(sendData=torch.zeros(4, dtype=torch.bool)), TypeError, ["'sendData'", "bool"]),
]

RS_CASES = [
    ("send-float32", dict(sendData=torch.zeros(4)), TypeError, ["'sendData'", "dtype float16", "float32"]),
    ("send-bfloat16", dict(sendData=torch.zeros(4, dtype=torch.bfloat16)), TypeError, ["'sendData'", "bfloat16"]),
    ("send-0d", dict(sendData=torch.tensor(1.0, dtype=torch.float16)), ValueError,
     ["'sendData'", "at least 1-D", "[]"]),
    ("send-rows", dict(sendData=torch.zeros(3, 2, dtype=torch.float16), commRankIds=ids([0, 0])), ValueError,
     ["'sendData'", "shape[0] divisible by len(commRankIds) = 2", "[3, 2]"]),
    ("op-mul", dict(op=1), NotImplementedError, ["'op'", "MUL", "not implemented"]),
    ("op-4", dict(op=4), ValueError, ["'op'", "0 (SUM), 2 (MAX) or 3 (MIN)", "got 4"]),
    ("op-copyonly", dict(op=-1), ValueError, ["'op'", "got -1"]),
    ("op-str", dict(op="0"), TypeError, ["'op'", "an int", "str"]),
    ("op-bool", dict(op=True), TypeError, ["'op'", "an int", "bool"]),
]

BAD = ([(all2_all_detour, c) for c in COMMON_CASES + A2A_CASES]
       + [(reduce_scatter_detour, c) for c in COMMON_CASES + RS_CASES])


def run_case(fn, solo, over):
    kw = dict(sendData=torch.ones(4, 2, dtype=torch.float16), commRankIds=ids([0]), commArgs=solo, commId=7)
    if fn is reduce_scatter_detour:
        kw["op"] = 0
    kw.update(over)
    return fn(**kw)


@pytest.mark.parametrize("fn,case", BAD, ids=[f"{fn.__name__[:3]}-{c[0]}" for fn, c in BAD])
def test_bad_inputs(solo, fn, case):
    _, over, exc, fragments = case
    before = cam_get_magic(7)
    with pytest.raises(exc) as info:
        run_case(fn, solo, over)
    text = str(info.value)
    assert text.startswith(fn.__name__), text
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert cam_get_magic(7) == before, "a rejected call must not take a magic number"


def test_valid_solo_calls(solo):
    x = torch.randn(4, 2)
    assert torch.equal(all2_all_detour(x, ids([0]), solo, 7), x)
    h = x.half()
    assert torch.equal(reduce_scatter_detour(h, ids([0]), solo, 7, 0), h)
    # positional call as written for the upstream ops
    assert torch.equal(torch.ops.cam_jit.reduce_scatter_detour(h, ids([0]), solo, 7, 3), h)
    assert torch.equal(all2_all_detour(x, ids([0]), solo.clone(), 7), x)  # a copy of commArgs is fine


STRICT_RS = [
    (1, (0, 4), ["'sendData'", "sendCount is invalid, only support >=0, but got sendCount=0.", "numel 0"]),
    (17, (17,), ["'commId'", "rankSize is invalid, only support (0, 16], but got rankSize=17."]),
    (2, (3, 1), ["'sendData'", "inputSize is invalid, inputSize 3, rankSize 2.", "numel 3"]),
]


@pytest.mark.parametrize("size,shape,fragments", STRICT_RS, ids=["sendCount", "rankSize", "inputSize"])
def test_strict_reduce_scatter(fake_slot, size, shape, fragments):
    args = fake_slot(size)
    x = torch.ones(shape, dtype=torch.float16)
    with pytest.raises(ValueError) as info:
        reduce_scatter_detour(x, ids([0]), args, 40, 0, strict=True)
    text = str(info.value)
    assert text.startswith("reduce_scatter_detour: strict: argument "), text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


def test_strict_switch(solo, monkeypatch):
    x0 = torch.ones(0, 4, dtype=torch.float16)
    assert reduce_scatter_detour(x0, ids([0]), solo, 7, 0).shape == (0, 4)  # basic mode: fine
    monkeypatch.setenv("CAM_JIT_STRICT", "1")
    with pytest.raises(ValueError, match="sendCount=0"):
        reduce_scatter_detour(x0, ids([0]), solo, 7, 0)
    assert reduce_scatter_detour(x0, ids([0]), solo, 7, 0, strict=False).shape == (0, 4)
    y = torch.ones(3)
    assert torch.equal(all2_all_detour(y, ids([0]), solo, 7, strict=True), y)  # 3 % 1 == 0


def test_fake_kernels():
    with FakeTensorMode():
        x = torch.empty(12, 3, 5, dtype=torch.float16)
        members = torch.empty(4, dtype=torch.int32)
        args = torch.empty(597740, dtype=torch.float16)
        a = torch.ops.cam_jit.all2_all_detour(x, members, args, 63)  # no communicator needed to trace
        r = torch.ops.cam_jit.reduce_scatter_detour(x, members, args, 63, 2)
        assert (a.shape, a.dtype) == (x.shape, torch.float16)
        assert (r.shape, r.dtype) == ((3, 3, 5), torch.float16)
        with pytest.raises(NotImplementedError, match="MUL"):
            torch.ops.cam_jit.reduce_scatter_detour(x, members, args, 63, 1)
        with pytest.raises(ValueError, match="shape\\[0\\] divisible by len\\(commRankIds\\) = 5"):
            torch.ops.cam_jit.reduce_scatter_detour(x, torch.empty(5, dtype=torch.int32), args, 63, 0)
        with pytest.raises(TypeError, match="int64"):
            torch.ops.cam_jit.all2_all_detour(x.long(), members, args, 63)


def test_opcheck_and_inference_only(solo):
    h = torch.randn(4, 3).half()
    torch.library.opcheck(torch.ops.cam_jit.all2_all_detour, (h, ids([0]), solo, 7))
    torch.library.opcheck(torch.ops.cam_jit.reduce_scatter_detour, (h, ids([0]), solo, 7, 0))
    x = torch.randn(4, requires_grad=True)
    out = all2_all_detour(x, ids([0]), solo, 7)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()
