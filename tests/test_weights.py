"""cam_jit.ops.weights: int4 packing and the W4A8 bias (SPEC.md §1.5), the permuted GMM1 layout
(§1.14) and the FRACTAL_NZ layouts (§1.15), checked against hand-built values and the SPEC's
index formulas written out element by element."""
import itertools

import pytest
import torch

import cam_jit
from cam_jit.ops.weights import (nd_to_nz, nz_to_nd, pack_int4, permute_gmm1_weight, unpack_int4,
                                 unpermute_gmm1_weight, w4a8_compensation_bias)
from moe_cases import make_rank_case


def _int4(*shape, seed=0):
    return torch.randint(-8, 8, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# pack_int4 / unpack_int4
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values,word", [
    ([1, 2, 3, 4, 5, 6, 7, -8], 0x87654321 - 2**32),  # nibble s = column s, nibble 0 lowest
    ([-1] * 8, -1),
    ([0] * 7 + [7], 0x70000000),
    ([0] * 7 + [-8], -(2**31)),
    ([-8, 0, 0, 0, 0, 0, 0, 0], 8),
    ([0] * 8, 0),
], ids=["ascending", "all-minus-one", "top-7", "top-minus-8", "low-minus-8", "zero"])
def test_hand_packed_words(values, word):
    v = torch.tensor(values, dtype=torch.int8)
    assert pack_int4(v).tolist() == [word]
    assert unpack_int4(torch.tensor([word], dtype=torch.int32)).tolist() == values


def test_pack_unpack_round_trips():
    v = _int4(3, 5, 64)
    packed = pack_int4(v)
    assert packed.shape == (3, 5, 8) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed), v) and unpack_int4(packed).dtype == torch.int8
    words = torch.randint(-(2**31), 2**31, (4, 16), dtype=torch.int64).to(torch.int32)
    words[0, :3] = torch.tensor([-(2**31), 2**31 - 1, -1], dtype=torch.int32)
    assert torch.equal(pack_int4(unpack_int4(words)), words)
    assert torch.equal(pack_int4(v.to(torch.int64)), packed)  # any signed integer dtype
    assert pack_int4(torch.zeros(0, 8, dtype=torch.int8)).shape == (0, 1)


@pytest.mark.parametrize("fn,arg,exc,fragments", [
    (pack_int4, torch.zeros(8), TypeError, ["pack_int4", "'values'", "int8", "float32"]),
    (pack_int4, torch.zeros(8, dtype=torch.uint8), TypeError, ["'values'", "uint8"]),
    (pack_int4, torch.zeros(2, 12, dtype=torch.int8), ValueError, ["'values'", "multiple of 8", "got 12"]),
    (pack_int4, torch.tensor([0] * 7 + [8], dtype=torch.int8), ValueError, ["'values'", "[-8, 7]", "[0, 8]"]),
    (pack_int4, torch.tensor([-9] + [0] * 7, dtype=torch.int8), ValueError, ["[-8, 7]", "[-9, 0]"]),
    (pack_int4, torch.tensor(1, dtype=torch.int8), ValueError, ["'values'", "at least 1", "0-D"]),
    (pack_int4, [1] * 8, TypeError, ["'values'", "torch.Tensor", "list"]),
    (unpack_int4, torch.zeros(4, dtype=torch.int8), TypeError, ["unpack_int4", "'packed'", "int32", "int8"]),
    (unpack_int4, torch.tensor(1, dtype=torch.int32), ValueError, ["'packed'", "at least 1"]),
])
def test_pack_errors(fn, arg, exc, fragments):
    _expect(exc, fragments, fn, arg)


def _expect(exc, fragments, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# ---------------------------------------------------------------------------------------------
# w4a8_compensation_bias
# ---------------------------------------------------------------------------------------------
def test_compensation_bias_by_hand():
    """8 * column sum * scale, the column sum exact and one float32 rounding: in double the
    product of an exact integer and a float32 is exact, so rounding it once gives the answer."""
    w = _int4(3, 2, 8, seed=1)  # 3 experts, K_in = 2, N = 8
    scale = torch.rand(3, 8, generator=torch.Generator().manual_seed(2)) * 0.1
    bias = w4a8_compensation_bias(pack_int4(w), scale)
    assert bias.dtype == torch.float32 and bias.shape == (3, 8)
    for e, j in itertools.product(range(3), range(8)):
        column_sum = int(w[e, 0, j]) + int(w[e, 1, j])
        want = torch.tensor(8 * column_sum * float(scale[e, j]), dtype=torch.float64).float()
        assert bias[e, j] == want, (e, j)


def test_compensation_bias_scale_dtypes_and_one_expert():
    w = _int4(16, 32, seed=3)
    scale = torch.rand(32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = w4a8_compensation_bias(pack_int4(w), scale)
    assert torch.equal(got, w4a8_compensation_bias(pack_int4(w), scale.float()))
    assert torch.equal(got, (w.float().sum(0) * 8) * scale.float())


@pytest.mark.parametrize("weight,scale,exc,fragments", [
    (torch.zeros(4, 2, dtype=torch.int8), torch.ones(16), TypeError, ["'packed_weight'", "int32", "int8"]),
    (torch.zeros(4, 2, dtype=torch.int32), torch.ones(2), ValueError, ["'scale'", "[16]", "[2]"]),
    (torch.zeros(3, 4, 2, dtype=torch.int32), torch.ones(16), ValueError, ["'scale'", "[3, 16]", "[16]"]),
    (torch.zeros(4, 2, dtype=torch.int32), torch.ones(16, dtype=torch.int32), TypeError, ["'scale'", "float32"]),
    (torch.zeros(2, dtype=torch.int32), torch.ones(16), ValueError, ["'packed_weight'", "at least 2", "1-D"]),
])
def test_compensation_bias_errors(weight, scale, exc, fragments):
    _expect(exc, ["w4a8_compensation_bias", *fragments], w4a8_compensation_bias, weight, scale)


# ---------------------------------------------------------------------------------------------
# permute_gmm1_weight / unpermute_gmm1_weight (SPEC.md §1.14)
# ---------------------------------------------------------------------------------------------
def test_permuted_layout_by_hand():
    """I = 128, tile 64: [gate 0-63 | up 128-191 | gate 64-127 | up 192-255]."""
    got = permute_gmm1_weight(torch.arange(256))
    want = list(range(0, 64)) + list(range(128, 192)) + list(range(64, 128)) + list(range(192, 256))
    assert got.tolist() == want
    assert unpermute_gmm1_weight(torch.tensor(want)).tolist() == list(range(256))


@pytest.mark.parametrize("inter,tile", [(128, 64), (192, 64), (64, 16), (24, 8)])
def test_permuted_index_maps(inter, tile):
    """Position p = 2*tile*b + tile*h + j holds original column o = h*I + tile*b + j, and
    original o sits at p with h = o // I, b = (o % I) // tile, j = o % tile."""
    columns = torch.arange(2 * inter)
    permuted = permute_gmm1_weight(columns, tile=tile)
    for p in range(2 * inter):
        b, h, j = p // (2 * tile), (p // tile) % 2, p % tile
        assert int(permuted[p]) == h * inter + tile * b + j
    original = unpermute_gmm1_weight(columns, tile=tile)  # where each permuted position came from
    for o in range(2 * inter):
        h, b, j = o // inter, (o % inter) // tile, o % tile
        assert int(original[o]) == 2 * tile * b + tile * h + j


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32, torch.bfloat16, torch.float16, torch.int32])
@pytest.mark.parametrize("shape,dim", [((256,), 0), ((3, 256), -1), ((256, 5), 0), ((2, 512, 3), 1)])
def test_permute_is_an_exact_inverse(dtype, shape, dim):
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 100).to(dtype)
    permuted = permute_gmm1_weight(t, dim=dim)
    assert permuted.shape == t.shape and permuted.dtype == dtype and permuted.is_contiguous()
    assert torch.equal(unpermute_gmm1_weight(permuted, dim=dim), t)
    assert torch.equal(permute_gmm1_weight(unpermute_gmm1_weight(t, dim=dim), dim=dim), t)
    if dtype != torch.int32:  # int32 moves whole words; the others move single columns
        assert not torch.equal(permuted, t)


def test_permute_packed_words_equals_permute_columns():
    """Permuting W4A8 words (tile in unpacked columns) is permuting the int4 columns."""
    w = _int4(16, 256, seed=6)
    for tile in (64, 32, 8):
        assert torch.equal(permute_gmm1_weight(pack_int4(w), tile=tile), pack_int4(permute_gmm1_weight(w, tile=tile)))
    x = torch.randint(-127, 128, (20, 16), dtype=torch.int8)
    product = torch._int_mm(x, unpack_int4(permute_gmm1_weight(pack_int4(w)))).long()
    assert torch.equal(product, permute_gmm1_weight(torch._int_mm(x, w).long()))  # int32 would mean words


def test_permute_commutes_with_compensation_bias():
    w, scale = pack_int4(_int4(2, 32, 128, seed=7)), torch.rand(2, 128)
    assert torch.equal(w4a8_compensation_bias(permute_gmm1_weight(w), permute_gmm1_weight(scale)),
                       permute_gmm1_weight(w4a8_compensation_bias(w, scale)))


@pytest.mark.parametrize("variant", ["w8a8", "w4a8"])
def test_op_result_survives_permute_then_unpermute(variant):
    """gmm1 weights, scales (and W4A8 biases) taken to the permuted layout and back give the
    op's original result bit for bit; the permuted layout itself does not (fused_deep_moe takes
    CAM's unpermuted layout)."""
    kw = make_rank_case(8, 0, ranks=1, bs=6, hidden=128, inter=128, experts=2, topk=2, variant=variant)
    names = ["gmm1_weight", "gmm1_weight_scale"] + (["gmm1_bias"] if variant == "w4a8" else [])
    permuted = {n: [permute_gmm1_weight(t) for t in kw[n]] for n in names}
    restored = dict(kw, **{n: [unpermute_gmm1_weight(t) for t in permuted[n]] for n in names})
    with torch.no_grad():
        want = cam_jit.fused_deep_moe(**kw)
        got = cam_jit.fused_deep_moe(**restored)
        scrambled = cam_jit.fused_deep_moe(**dict(kw, **permuted))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not torch.equal(scrambled[0], want[0])


@pytest.mark.parametrize("fn", [permute_gmm1_weight, unpermute_gmm1_weight])
@pytest.mark.parametrize("t,kwargs,exc,fragments", [
    (torch.zeros(200), {}, ValueError, ["'t'", "multiple of tile = 64", "200"]),
    (torch.zeros(4, 256), dict(dim=0), ValueError, ["'t'", "dimension 0", "got 4"]),
    (torch.zeros(12, dtype=torch.int32), {}, ValueError, ["'t'", "12 int32 words = 96 columns"]),
    (torch.zeros(64, dtype=torch.int32), dict(tile=12), ValueError, ["'tile'", "multiple of 8", "got 12"]),
    (torch.zeros(256), dict(dim=1), ValueError, ["'dim'", "[-1, 1)", "got 1"]),
    (torch.zeros(256), dict(tile=0), ValueError, ["'tile'", "positive", "got 0"]),
    (torch.zeros(256), dict(tile=64.0), TypeError, ["'tile'", "an int", "float"]),
    (torch.tensor(1.0), {}, ValueError, ["'t'", "at least 1"]),
    ([0.0] * 128, {}, TypeError, ["'t'", "torch.Tensor", "list"]),
])
def test_permute_errors(fn, t, kwargs, exc, fragments):
    _expect(exc, [fn.__name__, *fragments], fn, t, **kwargs)


# ---------------------------------------------------------------------------------------------
# nd_to_nz / nz_to_nd (SPEC.md §1.15)
# ---------------------------------------------------------------------------------------------
FRACTALS = [(torch.int8, 32), (torch.float16, 16), (torch.bfloat16, 16), (torch.int32, 8)]


@pytest.mark.parametrize("dtype,cols", FRACTALS, ids=["int8", "fp16", "bf16", "int32"])
def test_nz_layout_by_definition(dtype, cols):
    """Logical [K, N] is stored as [N/c][K/16][16][c]: element (k, n) sits at flat offset
    ((n // c) * (K/16) + k // 16) * 16c + (k % 16) * c + n % c."""
    k_in, n = 48, 3 * cols
    t = torch.arange(k_in * n).remainder(100).to(dtype).view(k_in, n)
    nz = nd_to_nz(t)
    assert nz.shape == t.shape and nz.dtype == dtype and nz.is_contiguous()
    flat = nz.flatten()
    for k, j in itertools.product(range(k_in), range(n)):
        offset = ((j // cols) * (k_in // 16) + k // 16) * 16 * cols + (k % 16) * cols + j % cols
        assert flat[offset] == t[k, j], (k, j)
    assert torch.equal(nz_to_nd(nz), t)
    assert torch.equal(nz_to_nd(flat, [k_in, n]), t)
    assert torch.equal(nz_to_nd(nz.view(n // cols, k_in // 16, 16, cols), (k_in, n)), t)


@pytest.mark.parametrize("dtype,cols", FRACTALS, ids=["int8", "fp16", "bf16", "int32"])
def test_nz_round_trip_stacked(dtype, cols):
    t = (torch.randn(3, 32, 4 * cols, generator=torch.Generator().manual_seed(9)) * 50).to(dtype)
    nz = nd_to_nz(t)
    assert torch.equal(nz[1], nd_to_nz(t[1]))  # each matrix on its own
    assert torch.equal(nz_to_nd(nz), t)
    assert torch.equal(nd_to_nz(nz_to_nd(t)), t)


def test_nz_of_packed_w4a8_weight():
    """A W4A8 weight [K, N/8] int32 uses the 16 x 8 word fractal, i.e. 64 int4 columns."""
    w = pack_int4(_int4(32, 128, seed=10))  # [32, 16] words
    nz = nd_to_nz(w)
    assert torch.equal(nz.flatten()[:8], w[0, :8]) and torch.equal(nz.flatten()[8:16], w[1, :8])
    assert torch.equal(nz.flatten()[16 * 8 * 2:16 * 8 * 2 + 8], w[0, 8:16])


@pytest.mark.parametrize("call,exc,fragments", [
    (lambda: nd_to_nz(torch.zeros(16, 32)), TypeError, ["nd_to_nz", "'t'", "int8 or float16", "float32"]),
    (lambda: nd_to_nz(torch.zeros(24, 32, dtype=torch.int8)), ValueError, ["'t'", "K % 16", "N % 32", "[24, 32]"]),
    (lambda: nd_to_nz(torch.zeros(16, 24, dtype=torch.float16)), ValueError, ["16 x 16", "[16, 24]"]),
    (lambda: nd_to_nz(torch.zeros(16, 4, dtype=torch.int32)), ValueError, ["16 x 8", "[16, 4]"]),
    (lambda: nd_to_nz(torch.zeros(32, dtype=torch.int8)), ValueError, ["at least 2", "[32]"]),
    (lambda: nz_to_nd(torch.zeros(512, dtype=torch.int8), [16, 16]), ValueError,
     ["nz_to_nd", "'shape'", "N % 32", "[16, 16]"]),
    (lambda: nz_to_nd(torch.zeros(500, dtype=torch.int8), [16, 32]), ValueError,
     ["'t'", "512 elements", "500 elements"]),
    (lambda: nz_to_nd(torch.zeros(512, dtype=torch.int8), "16x32"), TypeError, ["'shape'", "ints", "'16x32'"]),
    (lambda: nz_to_nd(torch.zeros(512, dtype=torch.int8), [16, 32.0]), TypeError, ["'shape'", "ints"]),
])
def test_nz_errors(call, exc, fragments):
    _expect(exc, fragments, call)
