"""Weight-preparation helpers for `fused_deep_moe`: int4 packing and the W4A8 compensation bias
(docs/semantics.md §1.5), the gate/up-interleaved ("permuted") GMM1 layout (§1.14), and the NPU
FRACTAL_NZ blocked layouts (§1.15). Pure tensor permutations and arithmetic; every helper works
on CPU and keeps the device of its input.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from cam_jit.ops import _checks as check

INT4_PER_WORD = 8  # int4 values in one int32 word (docs/semantics.md §1.5)
_NIBBLE_BITS = 4
_SIGNED_INTS = (torch.int8, torch.int16, torch.int32, torch.int64)
# FRACTAL_NZ fractal (rows, columns) by element dtype (docs/semantics.md §1.15).
NZ_FRACTALS = {
    torch.int8: (16, 32),
    torch.float16: (16, 16),
    torch.bfloat16: (16, 16),
    torch.int32: (16, 8),
}


def _at_least(op: str, arg: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() < dims:
        check.fail(op, arg, f"a tensor with at least {dims} dimension(s)", f"{t.dim()}-D with shape {list(t.shape)}")


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Packs int4 values into int32 words (docs/semantics.md §1.5).

    Args:
        values: [..., N] int8 (or another signed integer dtype) with values in [-8, 7],
            N a multiple of 8.

    Returns:
        int32 [..., N / 8]: column j is nibble j % 8 (bits 4s .. 4s+3, nibble 0 the least
        significant) of word j // 8, in two's complement.
    """
    op = "pack_int4"
    check.tensor(op, "values", values)
    check.dtype(op, "values", values, _SIGNED_INTS)
    _at_least(op, "values", values, 1)
    width = values.shape[-1]
    if width % INT4_PER_WORD:
        check.fail(op, "values", f"a last dimension that is a multiple of {INT4_PER_WORD}", width)
    if values.numel():
        low, high = (int(v) for v in torch.aminmax(values))
        if low < -8 or high > 7:
            check.fail(op, "values", "int4 values in [-8, 7]", f"values in [{low}, {high}]")
    nibbles = (values.to(torch.int64) & 0xF).unflatten(-1, (width // INT4_PER_WORD, INT4_PER_WORD))
    shifts = torch.arange(INT4_PER_WORD, device=values.device, dtype=torch.int64) * _NIBBLE_BITS
    words = (nibbles << shifts).sum(dim=-1)  # the unsigned 32-bit pattern (disjoint bits)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same pattern as signed int32


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Unpacks int32 words into int4 values; the inverse of :func:`pack_int4` (docs/semantics.md §1.5).

    Args:
        packed: [..., M] int32.

    Returns:
        int8 [..., 8 M] with values in [-8, 7]; column 8 w + s is nibble s of word w.
    """
    op = "unpack_int4"
    check.tensor(op, "packed", packed)
    check.dtype(op, "packed", packed, (torch.int32,))
    _at_least(op, "packed", packed, 1)
    shifts = torch.arange(INT4_PER_WORD, device=packed.device, dtype=torch.int32) * _NIBBLE_BITS
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift keeps the low bits
    values = (nibbles ^ 8) - 8  # 0..7 -> 0..7, 8..15 -> -8..-1
    return values.flatten(-2).to(torch.int8)


def w4a8_compensation_bias(packed_weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The W4A8 GMM bias (docs/semantics.md §1.5): bias[..., j] = 8 * sum_k W[..., k, j] * scale[..., j].

    It compensates the +8 offset of the kernel's activation nibble split; pass it as gmm1_bias /
    gmm2_bias (or the shared biases) of `fused_deep_moe`.

    Args:
        packed_weight: int32 [..., K_in, N / 8], one expert [K_in, N/8] or stacked [E, K_in, N/8].
        scale: [..., N] float32, bfloat16 or float16 per-column weight scale (widened exactly to
            float32), with the leading dimensions of packed_weight.

    Returns:
        float32 [..., N]. The column sums are exact; the product with the scale is the only
        rounding.
    """
    op = "w4a8_compensation_bias"
    check.tensor(op, "packed_weight", packed_weight)
    check.tensor(op, "scale", scale)
    check.dtype(op, "packed_weight", packed_weight, (torch.int32,))
    _at_least(op, "packed_weight", packed_weight, 2)
    check.dtype(op, "scale", scale, (torch.float32, torch.bfloat16, torch.float16))
    width = packed_weight.shape[-1] * INT4_PER_WORD
    expected = [*packed_weight.shape[:-2], width]
    check.shape(op, "scale", scale, expected, "the leading dimensions of packed_weight and 8 x its last")
    column_sums = unpack_int4(packed_weight).sum(dim=-2, dtype=torch.int64).to(torch.float32)
    return (column_sums * 8.0) * scale.to(torch.float32)


def _gmm1_axis(op: str, t: object, dim: object, tile: object) -> Tuple[int, int]:
    """Validates a §1.14 permutation request; returns (dim >= 0, tile length in stored elements)."""
    check.tensor(op, "t", t)
    check.integer(op, "dim", dim)
    check.integer(op, "tile", tile)
    _at_least(op, "t", t, 1)
    if not -t.dim() <= dim < t.dim():
        check.fail(op, "dim", f"a dimension in [{-t.dim()}, {t.dim()}) of t with shape {list(t.shape)}", dim)
    if tile <= 0:
        check.fail(op, "tile", "a positive number of columns", tile)
    dim = dim % t.dim()
    packed = t.dtype == torch.int32
    if packed and tile % INT4_PER_WORD:
        check.fail(op, "tile", f"a multiple of {INT4_PER_WORD} for an int32 tensor (W4A8 words of 8 int4 "
                   "columns; tile counts unpacked columns)", tile)
    unit = tile // INT4_PER_WORD if packed else tile
    length = t.shape[dim]
    if length % (2 * unit):
        columns = f"{length} int32 words = {length * INT4_PER_WORD} columns" if packed else f"{length}"
        check.fail(op, "t", f"dimension {dim} of length 2*I with I a multiple of tile = {tile}", columns)
    return dim, unit


def permute_gmm1_weight(t: torch.Tensor, dim: int = -1, tile: int = 64) -> torch.Tensor:
    """CAM's [gate | up] GMM1 columns -> the gate/up-interleaved layout (docs/semantics.md §1.14).

    Along `dim` (length 2I, I a multiple of `tile`), block b of 2*tile columns holds gate
    columns tile*b .. tile*b + tile-1, then up columns I + tile*b .. I + tile*b + tile-1:
    original column o = h*I + tile*b + j goes to position 2*tile*b + tile*h + j.

    Args:
        t: any dtype, e.g. an int8 [.., H, 2I] weight or a float [.., 2I] scale. An int32 tensor
            is taken as W4A8 words: `dim` then has 2I/8 words, `tile` must be a multiple of 8 and
            whole words move.
        dim: the 2I axis. tile: columns per half-block (64 for the NPU kernels).

    Returns:
        A new contiguous tensor of t's shape and dtype.
    """
    dim, unit = _gmm1_axis("permute_gmm1_weight", t, dim, tile)
    halves = t.unflatten(dim, (2, t.shape[dim] // (2 * unit), unit))  # [.., h, b, j, ..]
    return halves.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def unpermute_gmm1_weight(t: torch.Tensor, dim: int = -1, tile: int = 64) -> torch.Tensor:
    """The inverse of :func:`permute_gmm1_weight` (same arguments): interleaved -> [gate | up]."""
    dim, unit = _gmm1_axis("unpermute_gmm1_weight", t, dim, tile)
    blocks = t.unflatten(dim, (t.shape[dim] // (2 * unit), 2, unit))  # [.., b, h, j, ..]
    return blocks.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def _fractal(op: str, arg: str, t: torch.Tensor, shape: Sequence[int]) -> Tuple[int, int]:
    """The NZ fractal of t's dtype, checking that the logical [.., K, N] `shape` tiles into it."""
    if t.dtype not in NZ_FRACTALS:
        check.fail(op, arg, "dtype " + " or ".join(check.dtype_name(d) for d in NZ_FRACTALS),
                   check.dtype_name(t.dtype), TypeError)
    rows, cols = NZ_FRACTALS[t.dtype]
    if len(shape) < 2:
        check.fail(op, arg, "a logical shape [..., K, N] with at least 2 dimensions", list(shape))
    k, n = shape[-2], shape[-1]
    if k % rows or n % cols:
        check.fail(op, arg, f"a logical [..., K, N] with K % {rows} == 0 and N % {cols} == 0 (the "
                   f"{check.dtype_name(t.dtype)} fractal is {rows} x {cols})", f"shape {list(shape)}")
    return rows, cols


def nd_to_nz(t: torch.Tensor) -> torch.Tensor:
    """Row-major ("ND") matrices -> the NPU FRACTAL_NZ byte order (docs/semantics.md §1.15).

    Each logical [K, N] matrix is stored as [N/c][K/16][16][c] with the dtype's fractal 16 x c:
    int8 16 x 32, float16/bfloat16 16 x 16, int32 (W4A8 words) 16 x 8.

    Args:
        t: [..., K, N] int8, float16, bfloat16 or int32; K a multiple of 16, N of c.

    Returns:
        A contiguous tensor of t's shape and dtype whose memory holds the NZ order (W4A8 weights
        are passed this way, tagged ND); :func:`nz_to_nd` inverts it.
    """
    op = "nd_to_nz"
    check.tensor(op, "t", t)
    rows, cols = _fractal(op, "t", t, t.shape)
    k, n = t.shape[-2:]
    blocked = t.reshape(*t.shape[:-2], k // rows, rows, n // cols, cols)  # [.., K/16, 16, N/c, c]
    return blocked.movedim(-2, -4).contiguous().view(t.shape)  # [.., N/c, K/16, 16, c]


def nz_to_nd(t: torch.Tensor, shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """FRACTAL_NZ data -> row-major matrices; the inverse of :func:`nd_to_nz` (docs/semantics.md §1.15).

    Args:
        t: int8, float16, bfloat16 or int32 data in NZ order (any shape, e.g. the output of
            nd_to_nz or a flat buffer) with prod(shape) elements.
        shape: the logical [..., K, N] shape (default: t.shape).

    Returns:
        A contiguous [..., K, N] tensor of t's dtype in row-major order.
    """
    op = "nz_to_nd"
    check.tensor(op, "t", t)
    if shape is None:
        shape = list(t.shape)
    elif not isinstance(shape, (list, tuple, torch.Size)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        check.fail(op, "shape", "a sequence of non-negative ints [..., K, N]", repr(shape), TypeError)
    shape = list(shape)
    rows, cols = _fractal(op, "shape", t, shape)
    if t.numel() != math.prod(shape):
        check.fail(op, "t", f"{math.prod(shape)} elements (the logical shape {shape})",
                   f"{t.numel()} elements, shape {list(t.shape)}")
    k, n = shape[-2:]
    blocked = t.reshape(*shape[:-2], n // cols, k // rows, rows, cols)  # [.., N/c, K/16, 16, c]
    return blocked.movedim(-4, -2).reshape(shape).contiguous()  # [.., K/16, 16, N/c, c]
