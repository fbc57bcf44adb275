"""`torch.nn` modules over the cam_jit ops.

* :class:`FusedDeepMoE` - an expert-parallel SwiGLU MoE layer (routed + shared experts, W8A8 or
  W4A8) computed by `cam_jit.fused_deep_moe`, built from float or quantized weights.
* :func:`softmax_topk`, :func:`sigmoid_group_topk` - the routing conventions it implements
  (Qwen/Mixtral softmax top-k; DeepSeek-V3 sigmoid, correction bias, group-limited top-k).
* :func:`replace_transformers_moe` - swaps the MoE blocks of a Hugging Face `transformers` model
  (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3) for FusedDeepMoE-backed blocks; needs `transformers`
  only in the model you pass.
"""
from cam_jit.nn.fused_deep_moe import FusedDeepMoE
from cam_jit.nn.routing import sigmoid_group_topk, softmax_topk
from cam_jit.nn.transformers_moe import TransformersMoEBlock, replace_transformers_moe

__all__ = ["FusedDeepMoE", "TransformersMoEBlock", "replace_transformers_moe", "sigmoid_group_topk", "softmax_topk"]
