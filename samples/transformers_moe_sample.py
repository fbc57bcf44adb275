"""A transformers MoE model served through cam_jit.nn.FusedDeepMoE on CPU ranks.

Builds a small random-initialised Qwen2-MoE model (routed experts plus a gated shared expert)
from a config object (no download), then on every rank swaps each MoE block for
cam_jit.nn.FusedDeepMoE (this rank's experts quantized W8A8 or W4A8; attention, norms and
routers stay float32), and runs a forward pass over the prompt and a greedy generation.

It prints, per prompt: the quantized model against the float model (logits error, top-1
agreement over the prompt's positions, greedy tokens in common), and whether the run on --ranks
ranks (rank r serving prompt r) is bit-identical to the one-rank run (logits and tokens). Exits
non-zero when it is not, or when the mean top-1 agreement is below --min-top1.

Needs transformers (pip install "cam-jit[transformers]"):

    python samples/transformers_moe_sample.py                   # 2 ranks, W8A8
    python samples/transformers_moe_sample.py --scheme w4a8 --layers 4 --experts 16 --topk 4
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import cam_jit
from cpu_ranks import run_on_ranks


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (local processes); also the number of prompts")
    p.add_argument("--scheme", choices=["w8a8", "w4a8"], default="w8a8")
    p.add_argument("--layers", type=int, default=4, help="decoder layers, each with an MoE block")
    p.add_argument("--hidden", type=int, default=256, help="hidden size H")
    p.add_argument("--moe-inter", type=int, default=128, help="routed expert intermediate size I")
    p.add_argument("--shared-inter", type=int, default=512, help="shared expert intermediate size")
    p.add_argument("--experts", type=int, default=16, help="routed experts E")
    p.add_argument("--topk", type=int, default=4, help="experts per token")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (random ids: no tokenizer)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens to generate")
    p.add_argument("--min-top1", type=float, default=None,
                   help="fail when the mean top-1 agreement is below this (default 0.9 for W8A8, 0.8 for W4A8)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.min_top1 is None:
        args.min_top1 = 0.9 if args.scheme == "w8a8" else 0.8
    if args.experts % args.ranks:
        p.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    return args


def model_config(args):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_inter, shared_expert_intermediate_size=args.shared_inter,
        num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.prompt_len + args.new_tokens, hidden_act="silu")


def prompt(args, index):
    gen = torch.Generator().manual_seed(args.seed * 100 + index)
    return torch.randint(0, args.vocab, (1, args.prompt_len), generator=gen)


def logits_and_tokens(model, ids, new_tokens):
    """(logits [1, L, V] of the prompt, the greedy continuation [new_tokens])."""
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return logits, out[0, ids.shape[1]:]


def rank_main(rank, job):
    """On one rank of `world` (job = (args, world, with_float)): the float model (when
    with_float) and the quantized model on the prompts this rank serves (prompt r on rank r; all
    of them with one rank)."""
    from transformers import Qwen2MoeForCausalLM

    args, world, with_float = job
    torch.set_num_threads(1)  # the same float arithmetic in every process
    torch.manual_seed(args.seed)
    model = Qwen2MoeForCausalLM(model_config(args)).eval()
    mine = range(args.ranks) if world == 1 else [rank]
    results = {i: {} for i in mine}
    if with_float:
        for i in mine:
            results[i]["float"] = logits_and_tokens(model, prompt(args, i), args.new_tokens)
    cam_jit.nn.replace_transformers_moe(model, scheme=args.scheme,
                                        group_ep=dist.group.WORLD if world > 1 else None)
    for i in mine:
        results[i]["quantized"] = logits_and_tokens(model, prompt(args, i), args.new_tokens)
    results["block"] = repr(model.model.layers[0].mlp)
    return results


def float_vs_quantized(fl, ql):
    """Figures of the quantized logits/tokens against the float ones."""
    (f_logits, f_tokens), (q_logits, q_tokens) = fl, ql
    diff = (q_logits - f_logits).abs()
    return {
        "max_abs": diff.max().item(),
        "rel_l2": ((q_logits - f_logits).norm() / f_logits.norm()).item(),
        "top1": (q_logits.argmax(-1) == f_logits.argmax(-1)).double().mean().item(),
        "tokens_same": int((q_tokens == f_tokens).sum()),
        "tokens_prefix": int((q_tokens != f_tokens).int().cumsum(0).eq(0).sum()),
    }


def main(argv=None):
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("this sample needs transformers: pip install \"cam-jit[transformers]\"")
        return 2
    print(f"cam_jit {cam_jit.__version__}, transformers {transformers.__version__}: Qwen2-MoE "
          f"(random init, seed {args.seed}): {args.layers} layers, H={args.hidden}, {args.experts} experts "
          f"top-{args.topk} (I={args.moe_inter}) + shared expert (I={args.shared_inter}), vocab {args.vocab}; "
          f"{args.scheme.upper()} experts, bf16 activations; prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} greedy tokens")
    cam_jit.load()  # build (or load) the kernels once, before the ranks start
    single = run_on_ranks(rank_main, (args, 1, True), 1)[0]
    spread = run_on_ranks(rank_main, (args, args.ranks, False), args.ranks)
    print(f"rank 0 of {args.ranks}, model.model.layers[0].mlp = {spread[0]['block']}")
    passed, top1s = True, []
    for i in range(args.ranks):
        f = float_vs_quantized(single[i]["float"], single[i]["quantized"])
        top1s.append(f["top1"])
        one, many = single[i]["quantized"], spread[i][i]["quantized"]
        identical = torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])
        passed &= identical
        print(f"prompt {i}: float vs quantized: logits max |diff| {f['max_abs']:.4g}, relative L2 "
              f"{f['rel_l2']:.3%}, top-1 agreement {f['top1']:.2%} of {args.prompt_len} positions, greedy "
              f"tokens {f['tokens_same']}/{args.new_tokens} equal (first {f['tokens_prefix']} in a row)\n"
              f"          1 rank vs {args.ranks} ranks (rank {i}): logits and tokens "
              f"{'bit-identical' if identical else 'DIFFER'}")
    top1 = sum(top1s) / len(top1s)
    passed &= top1 >= args.min_top1
    print(f"top-1 agreement (all prompts): {top1:.2%} (bar {args.min_top1:.0%})")
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
