"""int4 packing helpers for W4A8 weights (docs/semantics.md §1.5), written from the spec.

Layout: a logical int4 matrix ``W[..., K_in, N]`` (values in ``[-8, 7]``) is stored as int32
``P[..., K_in, N // 8]``. Logical column ``j`` is nibble ``j % 8`` (bits ``4s .. 4s+3``, nibble 0
= least-significant bits) of word ``j // 8``. Nibbles decode as two's complement (``v >= 8`` ->
``v - 16``).
"""
from __future__ import annotations

import torch

__all__ = ["pack_int4", "unpack_int4", "w4a8_compensation_bias"]

_NIBBLES = 8
_SHIFTS = torch.arange(_NIBBLES, dtype=torch.int64) * 4


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int32 words into int4 values.

    Args:
        packed: int32 ``[..., M]``.
    Returns:
        int8 ``[..., 8 * M]`` with values in ``[-8, 7]``; column ``8*w + s`` is nibble ``s`` of
        word ``w``.
    """
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_int4: expected an int32 tensor, got {packed.dtype}")
    words = packed.to(torch.int64) & 0xFFFFFFFF  # the raw 32-bit pattern, non-negative
    nib = (words.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [..., M, 8]
    vals = torch.where(nib >= 8, nib - 16, nib)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * _NIBBLES).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack int4 values into int32 words (inverse of :func:`unpack_int4`).

    Args:
        values: any integer dtype ``[..., N]``, values in ``[-8, 7]``, ``N % 8 == 0``.
    Returns:
        int32 ``[..., N // 8]``.
    """
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise TypeError(f"pack_int4: expected an integer tensor, got {values.dtype}")
    n = values.shape[-1]
    if n % _NIBBLES:
        raise ValueError(f"pack_int4: last dimension must be a multiple of 8, got {n}")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < -8 or int(v.max()) > 7):
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    v = v.reshape(*values.shape[:-1], n // _NIBBLES, _NIBBLES) & 0xF
    words = (v << _SHIFTS.to(values.device)).sum(dim=-1)  # disjoint bits: sum == OR
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed 32 bit
    return words.to(torch.int32)


def w4a8_compensation_bias(packed_weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The W4A8 bias of docs/semantics.md §1.5: ``bias[..., j] = 8 * sum_k W[..., k, j] * scale[..., j]``.

    Args:
        packed_weight: int32 ``[..., K_in, N // 8]`` (one expert ``[K_in, N/8]`` or stacked
            ``[E, K_in, N/8]``).
        scale: ``[..., N]`` float32 / bf16 / fp16 (widened exactly to float32).
    Returns:
        float32 ``[..., N]``. The column sum of the int4 values is exact in float32; multiplying by
        8 is exact, so the only rounding is the product with the scale.
    """
    w = unpack_int4(packed_weight).to(torch.float32)
    colsum = w.sum(dim=-2)
    return (colsum * 8.0) * scale.to(torch.float32)
