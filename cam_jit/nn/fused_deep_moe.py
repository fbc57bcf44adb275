"""`FusedDeepMoE`: an expert-parallel MoE layer as an `nn.Module` over `cam_jit.fused_deep_moe`."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from cam_jit.ops import _checks as check
from cam_jit.ops.fused_deep_moe import fused_deep_moe
from cam_jit.ops.groups import group_ep_name
from cam_jit.ops.prepared_weights import prepare_expert_weights
from cam_jit.nn.routing import ROUTINGS, sigmoid_group_topk, softmax_topk
from cam_jit.ops.weights import INT4_PER_WORD
from cam_jit.quantize import SCHEMES, FloatWeights, QuantizedExperts, quantize_experts

__all__ = ["FusedDeepMoE"]

OP = "FusedDeepMoE"
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
_ROUTED = ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale", "gmm1_bias", "gmm2_bias")


def _prepare_after_load(module: "FusedDeepMoE", _incompatible_keys) -> None:
    module.prepare()


class FusedDeepMoE(nn.Module):
    """A SwiGLU mixture-of-experts layer (routed experts and an optional shared expert) whose
    experts are spread over an expert-parallel (EP) process group, computed by
    `cam_jit.fused_deep_moe`: tokens are quantized to int8 per token, sent to the ranks owning
    their experts, run through the int8 (W8A8) or int4 (W4A8) experts and combined back.

    Every rank of `group_ep` builds one with the same arguments and holds E / R of the
    `num_experts` experts (global expert g on rank g // (E / R)), plus the whole shared expert;
    every rank must call `forward` the same number of times (it is a collective). The weights are
    buffers (in `state_dict`), zero until loaded: build with `from_float` / `from_quantized`, or
    construct and `load_state_dict`.

    Numerics: the CPU result is bit-identical to `cam_jit.reference.fused_deep_moe` on the same
    quantized weights and does not depend on the number of ranks. Against the float layer, the
    error is the weight quantization's (see `cam_jit.quantize`) plus the int8 per-token
    activation quantization; measured on random Gaussian layers (tests) the relative RMS error of
    the output is about 1.7 % under W8A8 and 19 % under W4A8 (int4 has 15 levels per column).

    Args:
        hidden_size: H. intermediate_size: I, of each routed expert. num_experts: E, in total.
        top_k: experts per token.
        shared_intermediate_size: Is of the shared expert; 0 for none.
        scheme: "w8a8" or "w4a8".
        group_ep: the torch.distributed ProcessGroup of the EP ranks, or None for one rank
            (no process group needed).
        routing: how `forward(hidden_states, router_logits)` picks experts: "softmax" (softmax,
            top-k: Qwen2-MoE, Qwen3-MoE, Mixtral; `cam_jit.nn.softmax_topk`) or "sigmoid_group"
            (DeepSeek-V3: sigmoid scores, correction bias, group-limited top-k;
            `cam_jit.nn.sigmoid_group_topk`, whose bias is the buffer `e_score_correction_bias`).
        norm_topk_prob: renormalise the top-k weights (the model family's flag).
        n_group, topk_group, routed_scaling_factor: "sigmoid_group" routing's parameters.
        activation_dtype: bfloat16 or float16: the dtype tokens enter the op in (inputs of other
            dtypes are cast to it, and the output back to the input's dtype).
        max_tokens_per_rank: the largest batch any rank passes, when batches differ between ranks
            (the NPU kernel sizes its buffers by it: global_bs = max_tokens_per_rank * R); None for
            equal batches.
        transport: None (torch.distributed collectives; on the NPU, HCCL) or an initialised
            `cam_jit.FusedDeepMoeBuffer` of the same ranks (zero-copy shared memory; W8A8 only; a
            graph break under torch.compile).
        device: where the weights live.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 shared_intermediate_size: int = 0, scheme: str = "w8a8",
                 group_ep: Optional["dist.ProcessGroup"] = None, routing: str = "softmax",
                 norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0,
                 activation_dtype: torch.dtype = torch.bfloat16, max_tokens_per_rank: Optional[int] = None,
                 transport: Optional[object] = None, device: Union[str, torch.device, None] = None):
        super().__init__()
        for arg, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                           ("num_experts", num_experts), ("top_k", top_k),
                           ("shared_intermediate_size", shared_intermediate_size)):
            check.integer(OP, arg, value)
            if value < (0 if arg == "shared_intermediate_size" else 1):
                check.fail(OP, arg, "a positive int" if arg != "shared_intermediate_size" else ">= 0", value)
        if top_k > num_experts:
            check.fail(OP, "top_k", f"<= num_experts ({num_experts})", top_k)
        if routing not in ROUTINGS:
            check.fail(OP, "routing", " or ".join(repr(r) for r in ROUTINGS), repr(routing))
        for arg, value in (("n_group", n_group), ("topk_group", topk_group)):
            check.integer(OP, arg, value)
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group or \
                top_k > topk_group * (num_experts // n_group):
            check.fail(OP, "n_group", f"n_group dividing num_experts ({num_experts}), 1 <= topk_group <= n_group and "
                       "top_k <= topk_group * num_experts / n_group", f"n_group {n_group}, topk_group {topk_group}")
        if scheme not in SCHEMES:
            check.fail(OP, "scheme", " or ".join(repr(s) for s in SCHEMES), repr(scheme))
        if activation_dtype not in _ACTIVATION_DTYPES:
            check.fail(OP, "activation_dtype", "torch.bfloat16 or torch.float16", activation_dtype, TypeError)
        if group_ep is None:
            self.ep_rank_size, self.ep_rank_id, self._group_ep_name = 1, 0, ""
        elif dist.is_available() and isinstance(group_ep, dist.ProcessGroup):
            self.ep_rank_size, self.ep_rank_id = dist.get_world_size(group_ep), dist.get_rank(group_ep)
            if self.ep_rank_id < 0:
                check.fail(OP, "group_ep", "a process group this process belongs to", "a group without it")
            self._group_ep_name = group_ep_name(OP, group_ep)
        else:
            check.fail(OP, "group_ep", "a torch.distributed.ProcessGroup or None", type(group_ep).__name__, TypeError)
        if num_experts % self.ep_rank_size:
            check.fail(OP, "num_experts", f"a multiple of the EP group's size ({self.ep_rank_size})", num_experts)
        w4a8 = scheme == "w4a8"
        if w4a8 and (hidden_size % INT4_PER_WORD or any(
                (2 * i) % INT4_PER_WORD for i in (intermediate_size, shared_intermediate_size))):
            check.fail(OP, "hidden_size", "H and 2I (2Is) multiples of 8 under W4A8",
                       f"H = {hidden_size}, I = {intermediate_size}, Is = {shared_intermediate_size}")
        if max_tokens_per_rank is not None:
            check.integer(OP, "max_tokens_per_rank", max_tokens_per_rank)
            if max_tokens_per_rank < 1:
                check.fail(OP, "max_tokens_per_rank", "a positive int or None", max_tokens_per_rank)
        if transport is not None:
            from cam_jit.zero_buffer import FusedDeepMoeBuffer  # imported only when used

            if not isinstance(transport, FusedDeepMoeBuffer):
                check.fail(OP, "transport", "None or a cam_jit.FusedDeepMoeBuffer", type(transport).__name__, TypeError)
            if w4a8:
                check.fail(OP, "transport", "None under W4A8 (FusedDeepMoeBuffer is W8A8 only)", "a FusedDeepMoeBuffer")
        self.hidden_size, self.intermediate_size, self.num_experts, self.top_k = (
            hidden_size, intermediate_size, num_experts, top_k)
        self.shared_intermediate_size, self.scheme = shared_intermediate_size, scheme
        self.routing, self.norm_topk_prob, self.n_group, self.topk_group, self.routed_scaling_factor = (
            routing, norm_topk_prob, n_group, topk_group, float(routed_scaling_factor))
        self.activation_dtype, self.max_tokens_per_rank, self.transport = (
            activation_dtype, max_tokens_per_rank, transport)
        self.local_experts = num_experts // self.ep_rank_size
        self.first_expert = self.ep_rank_id * self.local_experts
        for name, shape, dtype in self._buffer_specs():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device))
        if routing == "sigmoid_group":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32,
                                                                        device=device))
        self.register_load_state_dict_post_hook(_prepare_after_load)

    # -- construction ----------------------------------------------------------------------------
    def _buffer_specs(self):
        """(name, shape, dtype) of every weight buffer: the routed experts' with a leading E_loc,
        then the shared expert's (Is in place of I)."""
        w4a8 = self.scheme == "w4a8"
        pack, wdt = (INT4_PER_WORD, torch.int32) if w4a8 else (1, torch.int8)
        h, f32 = self.hidden_size, torch.float32

        def expert(inter, lead):
            specs = [("gmm1_weight", (*lead, h, 2 * inter // pack), wdt),
                     ("gmm1_weight_scale", (*lead, 2 * inter), f32),
                     ("gmm2_weight", (*lead, inter, h // pack), wdt), ("gmm2_weight_scale", (*lead, h), f32)]
            return specs + ([("gmm1_bias", (*lead, 2 * inter), f32), ("gmm2_bias", (*lead, h), f32)] if w4a8 else [])

        specs = expert(self.intermediate_size, (self.local_experts,))
        if self.shared_intermediate_size:
            shared = expert(self.shared_intermediate_size, ())
            specs += [("share_" + name, shape, dtype) for name, shape, dtype in shared]
        return specs

    def load_quantized(self, experts: QuantizedExperts, shared: Optional[QuantizedExperts] = None) -> "FusedDeepMoE":
        """Copies quantized weights into the buffers and returns self.

        Args:
            experts: all `num_experts` experts (this rank takes its own) or this rank's
                `num_experts / R`, from `cam_jit.quantize_experts` with this module's scheme, in the
                "concat" gmm1 layout and "nd" format.
            shared: the shared expert (one expert: 2-D weights); required iff
                shared_intermediate_size > 0.
        """
        self._check_quantized("experts", experts)
        if experts.num_experts == self.num_experts:
            experts = experts.experts(self.first_expert, self.first_expert + self.local_experts)
        elif experts.num_experts != self.local_experts:
            check.fail(OP, "experts", f"{self.num_experts} experts (all) or {self.local_experts} (this rank's)",
                       experts.num_experts)
        sources = {name: t for name, t in experts.tensors().items() if t is not None}
        if bool(self.shared_intermediate_size) != (shared is not None):
            wanted = "a QuantizedExperts (shared_intermediate_size > 0)" if self.shared_intermediate_size \
                else "None (shared_intermediate_size is 0)"
            check.fail(OP, "shared", wanted, type(shared).__name__)
        if shared is not None:
            self._check_quantized("shared", shared)
            if shared.num_experts is not None:
                check.fail(OP, "shared", "one expert (2-D weights)", f"{shared.num_experts} stacked experts")
            sources.update({"share_" + name: t for name, t in shared.tensors().items() if t is not None})
        with torch.no_grad():
            for name, buffer in self.named_buffers(recurse=False):
                if name == "e_score_correction_bias":
                    continue
                source = sources[name]
                check.shape(OP, name, source, list(buffer.shape), "of this module's buffer")
                check.dtype(OP, name, source, (buffer.dtype,))
                buffer.copy_(source)
        self.prepare()
        return self

    def prepare(self) -> int:
        """Prepacks the weights for the CPU int8 kernels now (`cam_jit.prepare_expert_weights`)
        rather than on the first forward; done by `load_quantized` (so `from_float` /
        `from_quantized`) and after `load_state_dict`. Returns the bytes of packed copies (0 off
        the CPU, or where the CPU has no packed kernel)."""
        if self.gmm1_weight.device.type != "cpu":
            return 0
        return prepare_expert_weights(self.gmm1_weight, self.gmm2_weight,
                                      share_gmm1_weight=getattr(self, "share_gmm1_weight", None),
                                      share_gmm2_weight=getattr(self, "share_gmm2_weight", None))

    def _check_quantized(self, arg: str, q: object) -> None:
        if not isinstance(q, QuantizedExperts):
            check.fail(OP, arg, "a cam_jit.QuantizedExperts", type(q).__name__, TypeError)
        if q.scheme != self.scheme:
            check.fail(OP, arg, f"scheme {self.scheme!r} (this module's)", repr(q.scheme))
        if (q.gmm1_layout, q.weight_format) != ("concat", "nd"):
            check.fail(OP, arg, "gmm1_layout 'concat' and weight_format 'nd' (what fused_deep_moe takes)",
                       f"{q.gmm1_layout!r}, {q.weight_format!r}")

    @classmethod
    def from_quantized(cls, experts: QuantizedExperts, top_k: int, *, shared: Optional[QuantizedExperts] = None,
                       num_experts: Optional[int] = None, **kwargs) -> "FusedDeepMoE":
        """A module holding already-quantized experts.

        Args:
            experts: QuantizedExperts of all experts, or of this rank's (then give num_experts).
            top_k: experts per token. shared: the quantized shared expert, or None.
            num_experts: E in total (default: experts.num_experts).
            kwargs: the constructor's keyword arguments (group_ep, norm_topk_prob, ...).
        """
        if not isinstance(experts, QuantizedExperts) or experts.num_experts is None:
            check.fail(OP, "experts", "a QuantizedExperts of stacked experts", type(experts).__name__, TypeError)
        pack = INT4_PER_WORD if experts.scheme == "w4a8" else 1
        hidden, inter = experts.gmm1_weight.shape[1], experts.gmm2_weight.shape[1]
        share_inter = 0 if shared is None else shared.gmm2_weight.shape[0]
        module = cls(hidden, inter, num_experts or experts.num_experts, top_k, shared_intermediate_size=share_inter,
                     scheme=experts.scheme, device=experts.gmm1_weight.device, **kwargs)
        if experts.gmm1_weight.shape[2] * pack != 2 * inter:
            check.fail(OP, "experts", f"gmm1_weight of width 2I = {2 * inter}", experts.gmm1_weight.shape[2] * pack)
        return module.load_quantized(experts, shared)

    @classmethod
    def from_float(cls, gate_proj: FloatWeights, up_proj: FloatWeights, down_proj: FloatWeights, top_k: int, *,
                   shared: Optional[Sequence[torch.Tensor]] = None, scheme: str = "w8a8",
                   **kwargs) -> "FusedDeepMoE":
        """Quantizes float experts (only this rank's) with `cam_jit.quantize_experts` into a module.

        Args:
            gate_proj, up_proj: [E, I, H] float (nn.Linear's [out, in] per expert) or a list of E
                [I, H] tensors, of all E experts; with a list, other ranks' entries may be None.
            down_proj: [E, H, I] float or a list of E [H, I] tensors.
            top_k: experts per token.
            shared: the shared expert's (gate_proj [Is, H], up_proj [Is, H], down_proj [H, Is]),
                or None.
            scheme: "w8a8" or "w4a8". kwargs: the constructor's keyword arguments.
        """
        group_ep = kwargs.get("group_ep")
        ranks = 1 if group_ep is None else dist.get_world_size(group_ep)
        rank = 0 if group_ep is None else dist.get_rank(group_ep)
        experts = len(gate_proj) if isinstance(gate_proj, (list, tuple)) else gate_proj.shape[0]
        if experts % ranks:
            check.fail(OP, "gate_proj", f"a number of experts that is a multiple of the EP group's size ({ranks})",
                       experts)
        local = experts // ranks
        mine = slice(rank * local, (rank + 1) * local)
        q = quantize_experts(gate_proj[mine], up_proj[mine], down_proj[mine], scheme)
        q_shared = None if shared is None else quantize_experts(*shared, scheme)
        return cls.from_quantized(q, top_k, shared=q_shared, num_experts=experts, **kwargs)

    # -- state_dict --------------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        return {"scheme": self.scheme, "num_experts": self.num_experts,
                "experts": [self.first_expert, self.first_expert + self.local_experts]}

    def set_extra_state(self, state: dict) -> None:
        mine = self.get_extra_state()
        if state != mine:
            check.fail(OP, "state_dict", f"weights of {mine} (this module: its scheme, total experts and "
                       "the global experts of its EP rank)", state)

    # -- forward -----------------------------------------------------------------------------------
    def route(self, router_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """This module's routing of [T, E] logits: ([T, K] int32 ids, [T, K] float32 weights)."""
        if self.routing == "softmax":
            return softmax_topk(router_logits, self.top_k, self.norm_topk_prob)
        return sigmoid_group_topk(router_logits, self.top_k, self.norm_topk_prob,
                                  correction_bias=self.e_score_correction_bias, n_group=self.n_group,
                                  topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor, router_logits: Optional[torch.Tensor] = None, *,
                topk_ids: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                return_parts: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """The layer on this rank's tokens (a collective over the EP group).

        Args:
            hidden_states: [..., H] float tokens (T = their number).
            router_logits: [..., E] logits, routed by `route` (softmax, top-k); or, instead:
            topk_ids: [..., K] global expert ids (any integer dtype; -1 skips a slot) and
            topk_weights: [..., K] their combine weights (the model's own router's output).
            return_parts: return (routed, shared) instead of their sum.

        Returns:
            [..., H] in hidden_states' dtype: sum over the top-k of weight * expert(x), plus the
            shared expert's output; or the two separately (shared: zeros without a shared expert).
        """
        check.tensor(OP, "hidden_states", hidden_states)
        if hidden_states.shape[-1] != self.hidden_size:
            check.fail(OP, "hidden_states", f"a last dimension of {self.hidden_size} (hidden_size)",
                       list(hidden_states.shape))
        x = hidden_states.reshape(-1, self.hidden_size)
        if router_logits is not None:
            if topk_ids is not None or topk_weights is not None:
                check.fail(OP, "router_logits", "either router_logits or (topk_ids, topk_weights)", "both")
            check.tensor(OP, "router_logits", router_logits)
            ids, weights = self.route(router_logits.reshape(-1, self.num_experts))
        else:
            if topk_ids is None or topk_weights is None:
                check.fail(OP, "router_logits", "router_logits or both topk_ids and topk_weights",
                           "neither" if topk_ids is None and topk_weights is None else "only one of the two")
            ids = topk_ids.reshape(x.shape[0], -1).to(torch.int32)
            weights = topk_weights.reshape(x.shape[0], -1).to(torch.float32)
        routed, shared = self._fused(x.to(self.activation_dtype), ids, weights)
        if return_parts:
            return (routed.to(hidden_states.dtype).view(hidden_states.shape),
                    shared.to(hidden_states.dtype).view(hidden_states.shape))
        total = routed.to(torch.float32) + shared.to(torch.float32) if self.shared_intermediate_size else routed
        return total.to(hidden_states.dtype).view(hidden_states.shape)

    def _fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        buffers = dict(self.named_buffers(recurse=False))
        routed = {name: buffers.get(name) for name in _ROUTED}
        shared = {"share_" + name: buffers.get("share_" + name) for name in _ROUTED}
        global_bs = 0 if self.max_tokens_per_rank is None else self.max_tokens_per_rank * self.ep_rank_size
        if self.transport is not None:
            out = self.transport.zb_fused_deep_moe(
                x, ids, routed["gmm1_weight"], routed["gmm1_weight_scale"], routed["gmm2_weight"],
                routed["gmm2_weight_scale"], weights, shared["share_gmm1_weight"], shared["share_gmm1_weight_scale"],
                shared["share_gmm2_weight"], shared["share_gmm2_weight_scale"], None, None, None, "", self.ep_rank_size,
                self.ep_rank_id, self.num_experts, 0, global_bs)
        else:
            out = fused_deep_moe(x, ids, expert_scales=weights, **routed, **shared, group_ep=self._group_ep_name,
                                 ep_rank_size=self.ep_rank_size, ep_rank_id=self.ep_rank_id,
                                 moe_expert_num=self.num_experts, global_bs=global_bs)
        return out[0], out[1]

    def extra_repr(self) -> str:
        last = self.first_expert + self.local_experts - 1
        shared = f"shared_intermediate_size={self.shared_intermediate_size}" if self.shared_intermediate_size \
            else "no shared expert"
        group = "one rank" if self.ep_rank_size == 1 else \
            f"EP rank {self.ep_rank_id} of {self.ep_rank_size} ({self._group_ep_name!r})"
        transport = "collectives" if self.transport is None else "FusedDeepMoeBuffer"
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"experts {self.first_expert}..{last} of {self.num_experts} on {group}, top_k={self.top_k}, "
                f"{self.scheme.upper()}, {shared}, {self._routing_repr()}, "
                f"activation_dtype={check.dtype_name(self.activation_dtype)}, transport={transport}")

    def _routing_repr(self) -> str:
        if self.routing == "softmax":
            return f"router_logits routing: softmax top-k (norm_topk_prob={self.norm_topk_prob})"
        return (f"router_logits routing: sigmoid group top-k (n_group={self.n_group}, topk_group={self.topk_group}, "
                f"norm_topk_prob={self.norm_topk_prob}, routed_scaling_factor={self.routed_scaling_factor:g})")
