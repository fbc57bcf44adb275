"""Every CPU kernel variant the build can select on this machine, forced one at a time: the GEMMs
(`int_mm` portable, `vnni` and `vnni_l1` AVX512-VNNI prefetching into L2 and into L1, and `amx`
AMX, on prepacked weights) are exact, and the whole fused_deep_moe op is bit-identical across all
GEMM x element-wise (`scalar`, `avx512`, and `avx512_stream`, which writes the expert FFN's bf16
output past the caches) variants and to the plain-torch reference. Also: the prepack cache follows
in-place weight updates, the preparation API, every VNNI kernel in the built library issues its L2
prefetch, and the argument checks of the internal ops."""
import contextlib
import dataclasses
import os
import platform
import re
import shutil
import subprocess

import pytest
import torch

import cam_jit
from cam_jit import reference
from cam_jit.ops._kernels import cpu_kernels
from moe_cases import make_rank_case


def available(kind):
    return [v.split(":", 1)[1] for v in cpu_kernels().kernel_variants() if v.startswith(kind + ":")]


@contextlib.contextmanager
def forced(gemm="", vector=""):
    previous = cpu_kernels().select_kernels(gemm, vector)
    try:
        yield
    finally:
        cpu_kernels().select_kernels(*previous)


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def test_portable_variants_always_exist_and_this_cpu_gets_its_own():
    gemms, vectors = available("gemm"), available("vector")
    assert "int_mm" in gemms and "scalar" in vectors
    flags = cpu_flags()
    if platform.machine() == "x86_64" and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags):
        assert "avx512" in vectors
        if "avx512_vnni" in flags:
            assert "vnni" in gemms and "vnni_l1" in gemms
    if platform.machine() != "x86_64":
        assert gemms == ["int_mm"] and vectors == ["scalar"]


PACKED = [g for g in ("vnni", "vnni_l1", "amx") if g in available("gemm")]
# Rows on both sides of the AMX tile rows (16) and row pairs (32), K off the 64-k tiles, N ending
# inside a 16-column block, a block pair and a 64-column group; (1|7, 600, 200): one row and an odd
# row block (the int4 VNNI kernel's two accumulators per output for one row) over several column
# groups per thread, with int4 panels longer than the prefetch distance (it runs on into the next group).
GEMM_SHAPES = [(1, 64, 16), (3, 72, 80), (15, 1, 17), (16, 200, 48), (17, 64, 1), (40, 130, 33), (31, 65, 200),
               (32, 128, 64), (33, 130, 97), (47, 64, 160), (64, 129, 17), (1, 600, 200), (7, 600, 200)]


@pytest.mark.skipif(not PACKED, reason="no packed int8 GEMM on this CPU")
@pytest.mark.parametrize("kernel", PACKED + ["auto"])
def test_packed_gemm_is_exact(kernel):
    gen = torch.Generator().manual_seed(11)
    for m, k, n in GEMM_SHAPES:
        q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
        w8 = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=gen)
        exact = (q.long() @ w8.long()).int()
        assert torch.equal(cpu_kernels().int8_matmul(q, w8, False, kernel), exact), (kernel, m, k, n)
        n4 = 8 * ((n + 7) // 8)
        w4 = torch.randint(-8, 8, (k, n4), dtype=torch.int8, generator=gen)
        hi, lo = q.long() >> 4, (q.long() & 15) - 8
        exact4 = torch.cat([hi @ w4.long(), lo @ w4.long()]).int()
        got4 = cpu_kernels().int8_matmul(q, cam_jit.pack_int4(w4), True, kernel)
        assert torch.equal(got4, exact4), (kernel, "int4", m, k, n4)


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not PACKED, reason="no packed int8 GEMM on this CPU")
@pytest.mark.skipif(platform.system() != "Linux", reason="packed panels from 2 MiB on are mapped on Linux only")
def test_packed_panels_of_2_mib_and_more_are_exact_and_given_back():
    """From 2 MiB on the packed panels live in their own mapping (huge-page aligned): products on
    them are exact, int8 and int4, and dropping the packed copies returns the memory."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randint(-128, 128, (5, 2100), dtype=torch.int8, generator=gen)
    w8 = torch.randint(-128, 128, (1030, 2064), dtype=torch.int8, generator=gen)  # 1088 x 2064 packed bytes
    w4 = torch.randint(-8, 8, (2100, 2048), dtype=torch.int8, generator=gen)      # 2112 x 2048 / 2
    hi, lo = q.long() >> 4, (q.long() & 15) - 8
    exact4 = torch.cat([hi @ w4.long(), lo @ w4.long()]).int()
    packed4 = cam_jit.pack_int4(w4)
    cam_jit.clear_prepared_weights()
    for kernel in PACKED:
        assert torch.equal(cpu_kernels().int8_matmul(q[:, :1030].contiguous(), w8, False, kernel),
                           (q[:, :1030].long() @ w8.long()).int()), kernel
        assert torch.equal(cpu_kernels().int8_matmul(q, packed4, True, kernel), exact4), (kernel, "int4")
    assert cam_jit.prepared_weights_bytes() >= 1088 * 2064 + 2112 * 2048 // 2
    cam_jit.clear_prepared_weights()
    before = resident_bytes()
    for _ in range(20):
        cpu_kernels().prepack_weight(w8, False)
        cpu_kernels().prepack_weight(packed4, True)
        cam_jit.clear_prepared_weights()
    assert resident_bytes() - before < 16 << 20  # 20 x 4.4 MB were packed and dropped


CASES = [
    dict(variant="w8a8", bs=13, hidden=72, inter=40, experts=4, topk=3, share_inter=24, minus_one_frac=0.2,
         zero_rows=[2]),
    dict(variant="w8a8", bs=40, hidden=128, inter=64, experts=2, topk=2, smooth=True, share_inter=32,
         dtype=torch.float16),
    dict(variant="w4a8", bs=11, hidden=64, inter=48, experts=4, topk=2, share_inter=16, minus_one_frac=0.1),
    dict(variant="w4a8", bs=36, hidden=128, inter=32, experts=2, topk=2, smooth=True, share_inter=32,
         per_expert_lists=True, active_counts=[30]),
]


def run_op(kw):
    with torch.no_grad():
        return cam_jit.fused_deep_moe(**kw)


def bits(t):
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def same(a, b):
    """Bitwise equal, with NaN equal to NaN whatever its payload (the reference's NaN bits are not
    part of the contract; between our own variants they are compared exactly)."""
    if a.dtype == torch.int64:
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(bits(a)[~nan], bits(b)[~nan])


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"{p['variant']}-bs{p['bs']}")
def test_every_variant_bit_identical_to_reference(params):
    kw = make_rank_case(5, 0, ranks=1, **params)
    kw["x"][4, 3] = float("nan")  # a non-finite token: NaN must reach the same outputs in every variant
    with torch.no_grad():
        ref = reference.fused_deep_moe(**kw)
    with forced("int_mm", "scalar"):
        portable = run_op(kw)
    for name, a, b in zip(("output", "share_output", "expert_token_nums"), portable, ref):
        assert same(a, b), f"int_mm/scalar: {name} differs from the reference"
    combos = [(g, v) for g in available("gemm") for v in available("vector")]
    for gemm, vector in combos:
        with forced(gemm, vector):
            got = run_op(kw)
        for name, a, b in zip(("output", "share_output", "expert_token_nums"), got, portable):
            assert torch.equal(bits(a), bits(b)), f"{gemm}/{vector}: {name} differs from int_mm/scalar"


def expert_rows_case(variant, group_sizes, hidden, inter, seed):
    """Arguments of the internal expert_ffn op: int8 rows grouped by expert, their scales and the
    weight containers (W4A8: packed int4 with compensation biases)."""
    gen = torch.Generator().manual_seed(seed)
    experts, m = len(group_sizes), sum(group_sizes)
    q = torch.randint(-127, 128, (m, hidden), dtype=torch.int8, generator=gen)
    a = torch.rand(m, generator=gen) * 1e-2
    q[1 % max(m, 1)] = 0  # a zero row: h = 0, the §1.11 zero scale
    s1, s2 = torch.rand(experts, 2 * inter, generator=gen) * 1e-2, torch.rand(experts, hidden, generator=gen) * 1e-2
    if variant == "w8a8":
        w1 = torch.randint(-127, 128, (experts, hidden, 2 * inter), dtype=torch.int8, generator=gen)
        w2 = torch.randint(-127, 128, (experts, inter, hidden), dtype=torch.int8, generator=gen)
        return (q, a, group_sizes, [w1], [s1], [w2], [s2])
    w1 = cam_jit.pack_int4(torch.randint(-8, 8, (experts, hidden, 2 * inter), dtype=torch.int8, generator=gen))
    w2 = cam_jit.pack_int4(torch.randint(-8, 8, (experts, inter, hidden), dtype=torch.int8, generator=gen))
    b1, b2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    return (q, a, group_sizes, [w1], [s1], [b1], [w2], [s2], [b2])


# Experts with 0 rows, rows on both sides of the AMX threshold (16), of its row pairs (32) and of
# the VNNI row block (6); widths I that are multiples of the 64-column groups (SwiGLU in GEMM1's
# epilogue, on x86-64 builds with MKL) and widths that are not (the gate / up boundary inside a
# group: SwiGLU after GEMM1). The last two exceed the batch limit of their path (I = 264: 2 MiB of
# GEMM1 output; I = 1024, fused: 7.5 MiB of stage buffer): batches of several experts, and one
# expert alone over the limit and over the 8 MiB of stage buffer a thread keeps (freed after each
# such call and grown again by the next).
EXPERT_ROWS = [
    dict(group_sizes=[0, 1, 15, 16, 7, 0, 40], hidden=72, inter=40),
    dict(group_sizes=[1, 1, 1, 1], hidden=128, inter=96),
    dict(group_sizes=[0, 1, 15, 16, 7, 33], hidden=72, inter=128),
    dict(group_sizes=[3, 0, 6, 13], hidden=64, inter=8),
    dict(group_sizes=[600, 31, 5, 520, 33, 48], hidden=64, inter=264),
    dict(group_sizes=[2, 2100], hidden=48, inter=1024),
]


@pytest.mark.parametrize("variant", ["w8a8", "w4a8"])
def test_non_finite_values_in_one_column_group_agree(variant):
    """Infinite and NaN gmm1 scales in single columns of I = 192 (three 64-column groups per half):
    where SwiGLU runs in GEMM1's epilogue, each row's max|h| is folded from its groups' maxima, and
    rows with an inf or a NaN in one group only must come out as the portable kernels' whole-row
    fold gives them."""
    op = getattr(cpu_kernels(), f"expert_ffn_{variant}")
    args = list(expert_rows_case(variant, [3, 17, 40, 9], hidden=64, inter=192, seed=31))
    s1 = args[4][0].clone()
    s1[0, 70] = float("inf")  # gate column of group 1: G = inf
    s1[1, 192 + 130] = float("nan")  # up column of group 2
    s1[2, 5] = float("-inf")  # gate column of group 0: G = -inf / inf = NaN (expert 3 stays finite)
    args[4] = [s1]
    with forced("int_mm", "scalar"):
        expected = op(*args, torch.bfloat16)
    rows_nan = torch.isnan(expected.float()).any(dim=1)
    assert rows_nan.any() and not rows_nan.all(), "the case must give rows with and without NaN"
    for gemm in ["auto"] + available("gemm"):
        for vector in available("vector"):
            with forced(gemm, vector):
                got = op(*args, torch.bfloat16)
            assert torch.equal(bits(got), bits(expected)), (variant, gemm, vector)


@pytest.mark.parametrize("variant", ["w8a8", "w4a8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_expert_kernels_auto_and_forced_variants_agree(variant, dtype):
    """The automatic choice mixes VNNI (few rows) and AMX experts in batches that share one parallel
    region per stage: every split must give the portable kernels' bits, with the grouped rows given
    as they are or read through a row index (as the one-rank op reads its token rows)."""
    op = getattr(cpu_kernels(), f"expert_ffn_{variant}")
    for i, shape in enumerate(EXPERT_ROWS):
        args = expert_rows_case(variant, seed=20 + i, **shape)
        q, a = args[0], args[1]
        index = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(i))
        grouped = (q[index], a[index], *args[2:])
        with forced("int_mm", "scalar"):
            expected = op(*grouped, dtype)
        for gemm in ["auto"] + available("gemm"):
            for vector in available("vector"):
                with forced(gemm, vector):
                    got, got_indexed = op(*grouped, dtype), op(*args, dtype, index)
                assert torch.equal(bits(got), bits(expected)), (variant, shape, gemm, vector)
                assert torch.equal(bits(got_indexed), bits(expected)), (variant, shape, gemm, vector, "index")


@pytest.mark.skipif(not PACKED, reason="no packed int8 GEMM on this CPU")
def test_prepack_cache_follows_in_place_updates_and_can_be_cleared():
    kw = make_rank_case(6, 0, ranks=1, variant="w8a8", bs=8, hidden=64, inter=32, experts=2, topk=2)
    w1 = kw["gmm1_weight"][0]
    assert w1.dim() == 3  # stacked: the op reads each expert's slice without a view
    cam_jit.clear_prepared_weights()
    prepared = cam_jit.prepare_expert_weights(kw["gmm1_weight"], kw["gmm2_weight"])
    assert prepared >= w1.numel()
    assert cam_jit.prepared_weights_bytes() == prepared
    with forced(PACKED[0]):
        before = run_op(kw)[0]
        assert cam_jit.prepared_weights_bytes() == prepared  # the op found the entries prepared from views
        w1[1].neg_()  # in place through a view: the version counter moves, the packed copy is rebuilt
        after = run_op(kw)[0]
    with forced("int_mm"):
        expected = run_op(kw)[0]
    assert not torch.equal(bits(before), bits(after))
    assert torch.equal(bits(after), bits(expected))
    cam_jit.clear_prepared_weights()
    assert cam_jit.prepared_weights_bytes() == 0


@pytest.mark.skipif(not PACKED, reason="no packed int8 GEMM on this CPU")
def test_inference_tensor_weights_are_packed_per_call():
    with torch.inference_mode():
        kw = make_rank_case(7, 0, ranks=1, variant="w4a8", bs=5, hidden=64, inter=32, experts=2, topk=2)
        with forced(PACKED[0]):
            got = run_op(kw)
        with forced("int_mm"):
            expected = run_op(kw)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, expected))


def test_direct_exp_is_atens_exp_bit_for_bit():
    """The AVX512 variant's exp (MKL's vmsExp without the dispatcher) gives torch.exp's bits for
    2^24 float32 bit patterns spread over all signs, exponents and NaNs, and at short lengths."""
    kernels = cpu_kernels()
    try:
        kernels.exp_direct(torch.zeros(1))
    except RuntimeError as err:
        assert "not available" in str(err)
        assert platform.machine() != "x86_64" or not torch.backends.mkl.is_available()
        pytest.skip("ATen's exp is not MKL's vmsExp on this build")
    x = ((torch.arange(1 << 24, dtype=torch.int64) * 257 + 12345) % (1 << 32)).to(torch.int32).view(torch.float32)
    for values in (x, *(x[5_000_000 + start:5_000_000 + start + n] for n in range(1, 40) for start in (0, 1))):
        got, want = kernels.exp_direct(values), torch.exp(values)
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert bool(same.all()), values.numel()


def test_prepare_without_packed_kernel_returns_zero():
    kw = make_rank_case(8, 0, ranks=1, variant="w8a8", bs=2, hidden=64, inter=32, experts=2, topk=2)
    with forced("int_mm"):
        assert cam_jit.prepare_expert_weights(kw["gmm1_weight"], kw["gmm2_weight"]) == 0


def test_prepare_rejects_bad_weights():
    with pytest.raises(TypeError, match="gmm1_weight"):
        cam_jit.prepare_expert_weights([torch.zeros(4, 4)], [torch.zeros(4, 4, dtype=torch.int8)])
    with pytest.raises(ValueError, match="gmm2_weight"):
        cam_jit.prepare_expert_weights(torch.zeros(4, 4, dtype=torch.int8), torch.zeros(4, dtype=torch.int8))


def test_select_kernels_names_the_choices():
    with pytest.raises(RuntimeError, match="unknown GEMM kernel 'fast'.*int_mm"):
        cpu_kernels().select_kernels("fast", "")
    with pytest.raises(RuntimeError, match="unknown vector kernel 'sse'.*scalar"):
        cpu_kernels().select_kernels("", "sse")
    assert cpu_kernels().select_kernels("", "") == cpu_kernels().select_kernels("", "")


def test_internal_ops_check_arguments():
    k = cpu_kernels()
    q = torch.zeros(2, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="q must be a 2-D int8"):
        k.int8_matmul(q.float(), torch.zeros(8, 4, dtype=torch.int8), False, "vnni")
    with pytest.raises(RuntimeError, match=r"w must be a 2-D int8 \[8, \*\]"):
        k.int8_matmul(q, torch.zeros(7, 4, dtype=torch.int8), False, "vnni")
    with pytest.raises(RuntimeError, match="kernel must be a packed one .*got 'int_mm'|cannot run on this CPU"):
        k.int8_matmul(q, torch.zeros(8, 4, dtype=torch.int8), False, "int_mm")
    with pytest.raises(RuntimeError, match="prepack_weight: w must be a 2-D int32"):
        k.prepack_weight(torch.zeros(8, 4, dtype=torch.int8), True)
    ids = torch.tensor([[0, 5]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"expert_ids\[0, 1\] = 5 outside \[-1, 4\)"):
        k.route_pairs(ids, 1, 4)
    with pytest.raises(RuntimeError, match="active must be in"):
        k.route_pairs(ids, 2, 8)


def test_route_pairs_sorts_stably_by_expert():
    ids = torch.tensor([[2, 0, -1], [0, 2, 1], [1, 1, 0]], dtype=torch.int32)
    pos, token, expert, counts, rows = cpu_kernels().route_pairs(ids, 2, 3)
    assert pos.tolist() == [1, 3, 5, 0, 4]
    assert token.tolist() == [0, 1, 1, 0, 1]
    assert expert.tolist() == [0, 0, 1, 2, 2]
    assert counts.tolist() == [2, 1, 2]
    assert rows.tolist() == [[3, 0, -1], [1, 4, 2], [-1, -1, -1]]


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="the VNNI kernels are x86-64 code; objdump reads them")
def test_every_vnni_row_block_kernel_issues_its_l2_prefetch():
    """The VNNI row-block kernels bring the thread's next column group into L2 (prefetcht1) while
    they multiply. GCC 12 once split that helper, kept the test inline and deleted the outlined
    prefetch as free of side effects: the kernels issued none, and each group's first row block
    waited on memory (the op 1.18x the time at 32 rows per expert). Every instantiation of both
    kernels in the loaded library must contain the instruction."""
    library = cam_jit.load().library
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(library)], capture_output=True,
                             text=True, check=True, timeout=300).stdout
    bodies = {}  # kernel instantiation (without GCC's clone suffix) -> its disassembled lines
    name = None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            name = re.sub(r" \[clone [^]]*\]$", "", header.group(1))
            name = name if re.search(r"vnni_i[48]_block<", name) else None
        elif name is not None:
            bodies.setdefault(name, []).append(line)
    assert len(bodies) >= 2 * 6 * 4, f"found {len(bodies)} VNNI row-block kernels in {library}"
    missing = [kernel for kernel, lines in bodies.items() if not any("prefetcht1" in line for line in lines)]
    assert not missing, f"{len(missing)} of {len(bodies)} VNNI kernels issue no L2 prefetch, e.g. {missing[0]}"


def test_cache_key_names_the_target_isa():
    from cam_jit.jit import content_key, cpu_spec

    spec = cpu_spec()
    assert spec.extra_key["target_isa"].startswith(platform.machine())
    other = dataclasses.replace(spec, extra_key={"target_isa": "another-arch baseline + runtime dispatch"})
    assert content_key(other) != content_key(spec)
