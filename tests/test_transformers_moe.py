"""cam_jit.nn.replace_transformers_moe on small random-initialised transformers models (built from
config objects, nothing downloaded), and the end-to-end sample: a Qwen2-MoE model served on 2 CPU
ranks, against the float model and bit for bit against 1 rank. transformers comes with the
"test" extra."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import cam_jit
from cam_jit.nn import FusedDeepMoE, TransformersMoEBlock, softmax_topk

transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

REPO = pathlib.Path(__file__).resolve().parent.parent


def qwen2_moe(**overrides):
    config = transformers.Qwen2MoeConfig(**{
        **dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        **overrides})
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(config).eval()


def deepseek_v3():
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # a non-trivial correction bias, so that it matters for the routing
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.2, 0.2, generator=torch.Generator().manual_seed(1))
    return model


def hidden_states(seed=2, tokens=24, hidden=64):
    return torch.randn(2, tokens // 2, hidden, generator=torch.Generator().manual_seed(seed))


def test_module_routing_is_qwen2_moe_routing():
    """FusedDeepMoE's router_logits routing gives the Qwen2-MoE router's ids and weights, bit for bit."""
    for norm in (True, False):
        gate = qwen2_moe(norm_topk_prob=norm).model.layers[0].mlp.gate
        with torch.no_grad():
            torch.nn.init.normal_(gate.weight, std=0.5, generator=torch.Generator().manual_seed(3))
            logits, weights, ids = gate(hidden_states().view(-1, 64))
        got_ids, got_weights = softmax_topk(logits, gate.top_k, norm)
        assert torch.equal(got_ids.long(), ids) and torch.equal(got_weights, weights)


def test_module_routing_is_deepseek_v3_routing():
    """routing="sigmoid_group" gives DeepSeek-V3's router's ids and weights, bit for bit."""
    model = deepseek_v3()
    config, gate = model.config, model.model.layers[1].mlp.gate
    module = FusedDeepMoE(64, 32, 8, config.num_experts_per_tok, routing="sigmoid_group", n_group=config.n_group,
                          topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
                          norm_topk_prob=config.norm_topk_prob)
    with torch.no_grad():
        torch.nn.init.normal_(gate.weight, std=0.5, generator=torch.Generator().manual_seed(3))
        module.e_score_correction_bias.copy_(gate.e_score_correction_bias)
        logits, weights, ids = gate(hidden_states().view(-1, 64))
    got_ids, got_weights = module.route(logits)
    assert torch.equal(got_ids.long(), ids) and torch.equal(got_weights, weights)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("scheme, bound", [("w8a8", 0.03), ("w4a8", 0.3)])
def test_replaced_block_against_the_float_block(family, scheme, bound):
    """The replaced block computes the float block (routing by the model's own router, shared
    expert(s), Qwen2-MoE's sigmoid shared-expert gate) up to the quantization error."""
    model = qwen2_moe() if family == "qwen2_moe" else deepseek_v3()
    layer = model.model.layers[-1]
    x = hidden_states()
    with torch.no_grad():
        float_block = layer.mlp
        for p in float_block.parameters():  # weights large enough for the experts to matter
            p.mul_(10)
        want = float_block(x)
        names = cam_jit.nn.replace_transformers_moe(model, scheme=scheme)
        got = layer.mlp(x)
    assert isinstance(layer.mlp, TransformersMoEBlock) and layer.mlp.gate is float_block.gate
    assert names == [f"model.layers.{i}.mlp" for i in range(1 if family == "deepseek_v3" else 0, 2)]
    assert got.shape == want.shape and got.dtype == want.dtype
    error = ((got - want).norm() / want.norm()).item()
    assert error < bound, f"relative error {error:.3%}"
    assert "router: the model's" in repr(layer.mlp) and scheme.upper() in repr(layer.mlp)


def test_unsupported_models_are_refused():
    with pytest.raises(ValueError, match="argument 'model': expected a transformers model of type"):
        cam_jit.nn.replace_transformers_moe(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="hidden_act 'silu'.*'gelu'"):
        cam_jit.nn.replace_transformers_moe(qwen2_moe(hidden_act="gelu"))
    with pytest.raises(TypeError, match="argument 'block'"):
        TransformersMoEBlock(torch.nn.Linear(2, 2))


def test_sample_end_to_end_on_two_ranks():
    """The sample: forward pass and greedy generation on 2 CPU ranks, float-vs-quantized figures,
    1-rank vs 2-rank bit identity (it exits non-zero otherwise)."""
    argv = ["--layers", "2", "--hidden", "128", "--moe-inter", "64", "--shared-inter", "128", "--experts", "8",
            "--topk", "2", "--vocab", "256", "--prompt-len", "12", "--new-tokens", "4"]
    done = subprocess.run([sys.executable, str(REPO / "samples" / "transformers_moe_sample.py"), *argv],
                          capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("1 rank vs 2 ranks") == 2 and done.stdout.count("bit-identical") == 2
    assert "top-1 agreement" in done.stdout and done.stdout.rstrip().endswith("PASS")
