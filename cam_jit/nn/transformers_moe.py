"""Serving a Hugging Face `transformers` MoE model through `FusedDeepMoE`.

`replace_transformers_moe(model, ...)` swaps every sparse MoE block of a transformers (>= 5.24)
Qwen2-MoE, Qwen3-MoE, Mixtral or DeepSeek-V3 model for a `TransformersMoEBlock`: the model's own
router (so routing follows the family's convention exactly: softmax top-k with its
norm_topk_prob, or DeepSeek-V3's sigmoid + correction-bias group routing with its scaling
factor), this rank's experts and the shared expert(s) quantized into a `FusedDeepMoE`, and
Qwen2-MoE's sigmoid shared-expert gate. Attention, norms, embeddings and routers stay in float.
This module never imports transformers; it reads the blocks' attributes.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from cam_jit.nn.fused_deep_moe import FusedDeepMoE
from cam_jit.ops import _checks as check

__all__ = ["TransformersMoEBlock", "replace_transformers_moe", "SUPPORTED_MODEL_TYPES"]

OP = "replace_transformers_moe"
SUPPORTED_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
_SHARED_NAMES = ("shared_expert", "shared_experts")


def _is_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return hasattr(module, "gate") and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")


class TransformersMoEBlock(nn.Module):
    """A transformers sparse MoE block computed by `FusedDeepMoE`: forward(hidden_states [B, S, H])
    -> [B, S, H], like the block it replaces.

    Args:
        block: the transformers block (Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock,
            MixtralSparseMoeBlock, DeepseekV3MoE): its `gate` router, `experts` (gate_up_proj
            [E, 2I, H], down_proj [E, H, I]) and optional shared expert(s) and shared-expert gate.
        scheme, group_ep, activation_dtype, max_tokens_per_rank: as FusedDeepMoE.
    """

    def __init__(self, block: nn.Module, *, scheme: str = "w8a8", group_ep=None,
                 activation_dtype: torch.dtype = torch.bfloat16, max_tokens_per_rank: Optional[int] = None):
        super().__init__()
        if not _is_moe_block(block):
            check.fail("TransformersMoEBlock", "block", "a transformers sparse MoE block (with .gate and .experts "
                       "holding gate_up_proj and down_proj)", type(block).__name__, TypeError)
        experts = block.experts
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        num_experts, hidden = down.shape[0], down.shape[1]
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != num_experts or \
                gate_up.shape[2] != hidden or gate_up.shape[1] != 2 * down.shape[2]:
            check.fail("TransformersMoEBlock", "block.experts", "gate_up_proj [E, 2I, H] and down_proj [E, H, I]",
                       f"{list(gate_up.shape)} and {list(down.shape)}")
        if any(getattr(experts, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")):
            check.fail("TransformersMoEBlock", "block.experts", "experts without biases", "biases")
        inter = down.shape[2]
        shared = next((getattr(block, n) for n in _SHARED_NAMES if getattr(block, n, None) is not None), None)
        shared_weights = None
        if shared is not None:
            shared_weights = tuple(getattr(shared, p).weight.detach() for p in ("gate_proj", "up_proj", "down_proj"))
        self.gate = block.gate
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        self.moe = FusedDeepMoE.from_float(
            gate_up[:, :inter], gate_up[:, inter:], down, block.gate.top_k, shared=shared_weights, scheme=scheme,
            group_ep=group_ep, norm_topk_prob=bool(getattr(block.gate, "norm_topk_prob", True)),
            activation_dtype=activation_dtype, max_tokens_per_rank=max_tokens_per_rank)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = self.gate(x)
        if not isinstance(routing, tuple) or len(routing) != 3:
            check.fail("TransformersMoEBlock", "gate", "a router returning (router_logits, topk_weights, topk_ids), "
                       "as in transformers >= 5.24", type(routing).__name__, TypeError)
        _, topk_weights, topk_ids = routing
        routed, shared = self.moe(x, topk_ids=topk_ids, topk_weights=topk_weights, return_parts=True)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return (routed + shared).view(hidden_states.shape)

    def extra_repr(self) -> str:
        gated = ", sigmoid shared-expert gate" if self.shared_expert_gate is not None else ""
        return f"router: the model's {type(self.gate).__name__}{gated}"


def replace_transformers_moe(model: nn.Module, *, scheme: str = "w8a8", group_ep=None,
                             activation_dtype: torch.dtype = torch.bfloat16,
                             max_tokens_per_rank: Optional[int] = None) -> List[str]:
    """Replaces, in place, every sparse MoE block of a transformers model by a
    `TransformersMoEBlock` holding this rank's quantized experts (call it on every rank of
    `group_ep` with the same model weights). The float experts are dropped with the old blocks.

    Args:
        model: a transformers (>= 5.24) model of a type in SUPPORTED_MODEL_TYPES, e.g.
            Qwen2MoeForCausalLM, with SiLU experts.
        scheme: "w8a8" or "w4a8". group_ep: the EP ProcessGroup, or None for one rank.
        activation_dtype, max_tokens_per_rank: as FusedDeepMoE.

    Returns:
        The qualified names of the replaced blocks.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        check.fail(OP, "model", f"a transformers model of type {' / '.join(SUPPORTED_MODEL_TYPES)}",
                   f"model_type {model_type!r}")
    act = getattr(config, "hidden_act", None)
    if act != "silu":
        check.fail(OP, "model", "experts with hidden_act 'silu' (fused_deep_moe computes SwiGLU)", repr(act))
    targets = [(name, module) for name, module in model.named_modules() if _is_moe_block(module)]
    if not targets:
        check.fail(OP, "model", "at least one sparse MoE block (.gate and .experts)", "none")
    for name, block in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, TransformersMoEBlock(block, scheme=scheme, group_ep=group_ep,
                                                   activation_dtype=activation_dtype,
                                                   max_tokens_per_rank=max_tokens_per_rank))
    return [name for name, _ in targets]
