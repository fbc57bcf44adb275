"""From float expert weights to what `fused_deep_moe` takes: W8A8 and W4A8 weight quantization.

A checkpoint stores each expert's SwiGLU FFN as three `nn.Linear` weights (output-major):
`gate_proj` [I, H], `up_proj` [I, H] and `down_proj` [H, I]. `fused_deep_moe` wants them
input-major with the gate and up projections side by side, quantized per output column:

    gmm1_weight [E, H, 2I]  = [gate_proj^T | up_proj^T], gmm1_weight_scale [E, 2I]
    gmm2_weight [E, I, H]   = down_proj^T,               gmm2_weight_scale [E, H]

**Scheme.** Symmetric, per output column, round to nearest (ties to even): for column j with
amax_j = max_k |W[k, j]|, scale_j = amax_j / Q and q[k, j] = rint(W[k, j] / scale_j), with
Q = 127 (W8A8, int8 values in [-127, 127]) or Q = 7 (W4A8, int4 values in [-7, 7], packed eight
to an int32 word by `pack_int4`, with the compensation biases of `w4a8_compensation_bias`).
An all-zero column gets scale 0 and q = 0 (exact). The arithmetic is float32; scales are float32.

**Error bound** (checked by the tests): every weight satisfies, in exact arithmetic on the stored
values, |W - q * scale| <= scale * (1/2 + Q * 2^-23) (half a step, plus the float32 rounding of
W / scale), i.e. about amax_j / 254 (0.39 % of the column's largest magnitude) under W8A8 and
amax_j / 14 (7.1 %) under W4A8 (docs/semantics.md §1.16). This is the weight
error only: `fused_deep_moe` also quantizes activations per token to int8 (and requantizes the
SwiGLU output), which adds an error of the same order as W8A8's (see cam_jit.nn.FusedDeepMoE).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from cam_jit.ops import _checks as check
from cam_jit.ops.weights import nd_to_nz, pack_int4, permute_gmm1_weight, w4a8_compensation_bias

__all__ = ["QuantizedExperts", "quantize_experts", "SCHEMES", "GMM1_LAYOUTS", "WEIGHT_FORMATS"]

OP = "quantize_experts"
SCHEMES = {"w8a8": 127, "w4a8": 7}  # scheme -> largest quantized magnitude Q
GMM1_LAYOUTS = ("concat", "permuted")
WEIGHT_FORMATS = ("nd", "nz")
PERMUTED_TILE = 64  # columns per gate/up half-block of the permuted gmm1 layout (NPU kernels)

FloatWeights = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """Quantized experts in `fused_deep_moe`'s argument layout.

    Tensors have a leading expert dimension [E, ...] when built from stacked (3-D) weights, and
    none for one expert (2-D weights, e.g. a shared expert). Shapes per expert (I intermediate,
    H hidden; W4A8 weights hold eight int4 columns per int32 word):

    Attributes:
        gmm1_weight: int8 [H, 2I] (W8A8) or int32 [H, 2I/8] (W4A8), columns [gate | up]
            (gmm1_layout "concat") or gate/up interleaved by 64 ("permuted").
        gmm1_weight_scale: float32 [2I], per (unpacked) output column, in the gmm1 layout.
        gmm2_weight: int8 [I, H] or int32 [I, H/8].
        gmm2_weight_scale: float32 [H].
        gmm1_bias, gmm2_bias: float32 [2I] / [H] W4A8 compensation biases; None under W8A8.
        scheme: "w8a8" or "w4a8". gmm1_layout: "concat" or "permuted". weight_format: "nd"
            (row-major, what the CPU backend reads) or "nz" (FRACTAL_NZ byte order).
    """

    gmm1_weight: torch.Tensor
    gmm1_weight_scale: torch.Tensor
    gmm2_weight: torch.Tensor
    gmm2_weight_scale: torch.Tensor
    gmm1_bias: Optional[torch.Tensor]
    gmm2_bias: Optional[torch.Tensor]
    scheme: str
    gmm1_layout: str = "concat"
    weight_format: str = "nd"

    @property
    def num_experts(self) -> Optional[int]:
        """E for stacked experts, None for a single expert."""
        return self.gmm1_weight.shape[0] if self.gmm1_weight.dim() == 3 else None

    def experts(self, start: int, stop: int) -> "QuantizedExperts":
        """Experts start .. stop-1 of a stacked set (e.g. one rank's share: r*E_loc .. (r+1)*E_loc)."""
        if self.num_experts is None:
            check.fail("QuantizedExperts.experts", "self", "stacked experts (3-D weights)", "a single expert")
        if not 0 <= start < stop <= self.num_experts:
            check.fail("QuantizedExperts.experts", "start, stop",
                       f"0 <= start < stop <= {self.num_experts} (the number of experts)", (start, stop))
        return dataclasses.replace(self, **{name: None if t is None else t[start:stop]
                                            for name, t in self.tensors().items()})

    def tensors(self) -> Dict[str, Optional[torch.Tensor]]:
        """The six tensors by `fused_deep_moe`'s routed argument names (biases None under W8A8)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("scheme", "gmm1_layout", "weight_format")}

    def routed_arguments(self) -> Dict[str, object]:
        """Keyword arguments for `cam_jit.fused_deep_moe`'s routed experts (stacked containers)."""
        self._check_op_layout("routed_arguments")
        args = {name: t for name, t in self.tensors().items() if t is not None}
        if self.scheme == "w8a8":
            args.update(gmm1_bias=[], gmm2_bias=[])
        return args

    def shared_arguments(self) -> Dict[str, Optional[torch.Tensor]]:
        """Keyword arguments for `cam_jit.fused_deep_moe`'s shared expert (`share_*`)."""
        self._check_op_layout("shared_arguments")
        if self.num_experts is not None:
            check.fail("QuantizedExperts.shared_arguments", "self", "a single expert (2-D weights)",
                       f"{self.num_experts} stacked experts")
        return {"share_" + name: t for name, t in self.tensors().items()}

    def _check_op_layout(self, method: str) -> None:
        if (self.gmm1_layout, self.weight_format) != ("concat", "nd"):
            check.fail(f"QuantizedExperts.{method}", "self", "gmm1_layout 'concat' and weight_format 'nd' "
                       "(the layout cam_jit.fused_deep_moe takes)",
                       f"gmm1_layout {self.gmm1_layout!r}, weight_format {self.weight_format!r}")


def _stacked(arg: str, weights: FloatWeights) -> torch.Tensor:
    """A float weight argument as one tensor: a 2-D/3-D tensor, or a sequence of 2-D tensors."""
    if isinstance(weights, torch.Tensor):
        stacked = weights
    elif isinstance(weights, (list, tuple)) and weights:
        for i, t in enumerate(weights):
            check.tensor(OP, f"{arg}[{i}]", t)
            check.ndim(OP, f"{arg}[{i}]", t, 2)
        shapes = {tuple(t.shape) for t in weights}
        if len(shapes) > 1:
            check.fail(OP, arg, "per-expert tensors of one shape", sorted(shapes))
        stacked = torch.stack([t.detach() for t in weights])
    else:
        check.fail(OP, arg, "a tensor or a non-empty list of per-expert tensors", type(weights).__name__, TypeError)
    check.ndim(OP, arg, stacked, (2, 3))
    if not stacked.is_floating_point():
        check.fail(OP, arg, "a floating-point tensor", check.dtype_name(stacked.dtype), TypeError)
    return stacked.detach()


def _quantize_columns(arg: str, w: torch.Tensor, qmax: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-column quantization of input-major float32 w [..., K_in, N]:
    (q int8 [..., K_in, N] in [-qmax, qmax], scale float32 [..., N])."""
    if not bool(torch.isfinite(w).all()):
        check.fail(OP, arg, "finite values", "NaN or infinity")
    amax = w.abs().amax(dim=-2)
    scale = amax / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe.unsqueeze(-2)).clamp_(-qmax, qmax)
    return q.to(torch.int8), scale


def quantize_experts(
    gate_proj: FloatWeights,
    up_proj: FloatWeights,
    down_proj: FloatWeights,
    scheme: str = "w8a8",
    *,
    gmm1_layout: str = "concat",
    weight_format: str = "nd",
) -> QuantizedExperts:
    """Quantizes float SwiGLU experts for `fused_deep_moe` (W8A8 or W4A8; see the module doc for
    the scheme and its error bound).

    Args:
        gate_proj: [E, I, H] float (any floating dtype; nn.Linear's [out, in] per expert), a list of
            E [I, H] tensors, or one [I, H] expert (e.g. a shared expert: then no leading E).
        up_proj: like gate_proj.
        down_proj: [E, H, I] float, a list of E [H, I] tensors, or one [H, I].
        scheme: "w8a8" (int8 weights) or "w4a8" (int4 weights packed into int32, with the
            compensation biases).
        gmm1_layout: "concat" ([gate | up] columns, what cam_jit.fused_deep_moe and CAM's kernel
            take) or "permuted" (gate/up interleaved in blocks of 64 columns, as sgl-kernel-npu and
            CAM's FusedDeepMoeFwk take; applied to gmm1's weight, scale and bias; needs I % 64 == 0).
            gmm2 keeps CAM's [I, H] orientation either way.
        weight_format: "nd" (row-major) or "nz" (the NPU's FRACTAL_NZ byte order via nd_to_nz,
            applied to both weights: what the W4A8 NPU kernel reads from its ND-tagged int32
            weights; W8A8 NPU weights are usually cast with torch_npu.npu_format_cast(w, 29)).

    Returns:
        QuantizedExperts on the input's device; QuantizedExperts.routed_arguments() /
        shared_arguments() give fused_deep_moe's keyword arguments.
    """
    if scheme not in SCHEMES:
        check.fail(OP, "scheme", " or ".join(repr(s) for s in SCHEMES), repr(scheme))
    if gmm1_layout not in GMM1_LAYOUTS:
        check.fail(OP, "gmm1_layout", " or ".join(repr(s) for s in GMM1_LAYOUTS), repr(gmm1_layout))
    if weight_format not in WEIGHT_FORMATS:
        check.fail(OP, "weight_format", " or ".join(repr(s) for s in WEIGHT_FORMATS), repr(weight_format))
    gate, up, down = (_stacked(name, w) for name, w in
                      (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)))
    check.shape(OP, "up_proj", up, list(gate.shape), "the shape of gate_proj")
    lead, inter, hidden = list(gate.shape[:-2]), gate.shape[-2], gate.shape[-1]
    check.shape(OP, "down_proj", down, [*lead, hidden, inter], "[..., H, I] for gate_proj [..., I, H]")
    if scheme == "w4a8" and (hidden % 8 or (2 * inter) % 8):
        check.fail(OP, "gate_proj", "H and 2I multiples of 8 under W4A8 (8 int4 columns per int32 word)",
                   f"H = {hidden}, I = {inter}")
    qmax = SCHEMES[scheme]
    w1 = torch.cat([gate, up], dim=-2).to(torch.float32).transpose(-1, -2)  # [..., H, 2I]
    w2 = down.to(torch.float32).transpose(-1, -2)  # [..., I, H]
    q1, s1 = _quantize_columns("gate_proj/up_proj", w1, qmax)
    q2, s2 = _quantize_columns("down_proj", w2, qmax)
    b1 = b2 = None
    if scheme == "w4a8":
        q1, q2 = pack_int4(q1), pack_int4(q2)
        b1, b2 = w4a8_compensation_bias(q1, s1), w4a8_compensation_bias(q2, s2)
    if gmm1_layout == "permuted":
        q1, s1 = permute_gmm1_weight(q1, tile=PERMUTED_TILE), permute_gmm1_weight(s1, tile=PERMUTED_TILE)
        b1 = None if b1 is None else permute_gmm1_weight(b1, tile=PERMUTED_TILE)
    if weight_format == "nz":
        q1, q2 = nd_to_nz(q1), nd_to_nz(q2)
    return QuantizedExperts(q1.contiguous(), s1.contiguous(), q2.contiguous(), s2.contiguous(), b1, b2, scheme,
                            gmm1_layout, weight_format)
