"""W4A8 fused_deep_moe on CPU ranks: the fused op against the small-ops reference.

Spawns --ranks local processes joined in a gloo process group on 127.0.0.1 (a free port), builds
a MoE layer with int4 experts (values packed eight to an int32 word with pack_int4, the
compensation biases from w4a8_compensation_bias), runs cam_jit.fused_deep_moe and
cam_jit.reference.fused_deep_moe on the same inputs, and prints their difference, the fraction
of elements within the upstream W4A8 tolerance |a - b| <= 1e-3 + 1e-2 |op|, and the latency.
Exits non-zero when fewer than 99 % of the elements are within it (the upstream bar) or the
expert token counts differ.

    python samples/fused_deep_moe_w4a8_sample.py                  # 2 ranks
    python samples/fused_deep_moe_w4a8_sample.py --ranks 4 --bs 16 --share --smooth --mask --eplb
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from cam_jit import pack_int4, w4a8_compensation_bias
from fused_deep_moe_sample import fused_vs_reference, run

ATOL, RTOL, PASS_FRACTION = 1e-3, 1e-2, 0.99  # upstream W4A8 sample: printed, > 99 % within


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (local processes)")
    p.add_argument("--bs", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048, help="H, a multiple of 8 (DeepSeek-V3: 7168)")
    p.add_argument("--inter", type=int, default=512, help="I, expert intermediate size, a multiple of 4")
    p.add_argument("--experts", type=int, default=16, help="E, routed experts in total")
    p.add_argument("--topk", type=int, default=8, help="K, experts per token")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=3, help="timed iterations of each")
    p.add_argument("--share", action="store_true", help="add a W4A8 shared expert (share_output)")
    p.add_argument("--share-inter", type=int, default=None, help="Is of the shared expert (default: --inter)")
    p.add_argument("--smooth", action="store_true", help="smooth-quant scales for routed and shared experts")
    p.add_argument("--mask", action="store_true", help="x_active_mask: the last quarter of each batch inactive")
    p.add_argument("--eplb", action="store_true", help="per-expert weight lists (dynamic EPLB) instead of stacked")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.experts % args.ranks:
        p.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    if args.hidden % 8 or any(i % 4 for i in (args.inter, args.share_inter or args.inter)):
        p.error("--hidden must be a multiple of 8 and --inter / --share-inter of 4 (int4 columns pack 8 to a word)")
    return args


def int4_ffn(gen, hidden, inter):
    """One expert: packed int32 [H, 2I/8] gate|up and [I, H/8] down weights, float32 per-column
    scales [2I] / [H] and the compensation biases [2I] / [H] (docs/semantics.md §1.5)."""
    std = ((16 ** 2 - 1) / 12) ** 0.5  # of int4 values uniform in [-8, 7]
    w1 = pack_int4(torch.randint(-8, 8, (hidden, 2 * inter), dtype=torch.int8, generator=gen))
    w2 = pack_int4(torch.randint(-8, 8, (inter, hidden), dtype=torch.int8, generator=gen))
    s1 = (torch.rand(2 * inter, generator=gen) + 0.5) / (std * hidden ** 0.5)
    s2 = (torch.rand(hidden, generator=gen) + 0.5) / (std * inter ** 0.5)
    return w1, s1, w2, s2, w4a8_compensation_bias(w1, s1), w4a8_compensation_bias(w2, s2)


def layer_inputs(args, rank):
    """This rank's tokens and routing, and the W4A8 weights of its E/R local experts."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    local = args.experts // args.ranks
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x = torch.randn(args.bs, args.hidden, generator=gen).to(dtype)
    top = torch.randn(args.bs, args.experts, generator=gen).topk(args.topk, dim=1)
    kw = dict(x=x, expert_ids=top.indices.to(torch.int32), expert_scales=torch.softmax(top.values, dim=1))
    experts = [int4_ffn(torch.Generator().manual_seed(10_000 + rank * local + e), args.hidden, args.inter)
               for e in range(local)]  # weights depend only on the global expert id
    containers = [list(t) for t in zip(*experts)]
    if not args.eplb:
        containers = [[torch.stack(t)] for t in containers]
    for name, items in zip(("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale", "gmm1_bias",
                            "gmm2_bias"), containers):
        kw[name] = items
    if args.share:
        shared = int4_ffn(torch.Generator().manual_seed(7), args.hidden, args.share_inter or args.inter)
        kw.update(zip(("share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight",
                       "share_gmm2_weight_scale", "share_gmm1_bias", "share_gmm2_bias"), shared))
    if args.smooth:
        sgen = torch.Generator().manual_seed(8)
        kw["expert_smooth_scales"] = torch.rand(args.experts, args.hidden, generator=sgen) + 0.5
        kw["share_smooth_scales"] = torch.rand(args.hidden, generator=sgen) + 0.5
    if args.mask:
        kw["x_active_mask"] = torch.arange(args.bs) < args.bs - args.bs // 4
    kw.update(group_ep=dist.group.WORLD if args.ranks > 1 else "", ep_rank_size=args.ranks, ep_rank_id=rank,
              moe_expert_num=args.experts, global_bs=args.bs * args.ranks)
    return kw


def compare(name, got, want, rows):
    """(passed, report line) for the first `rows` rows under the upstream W4A8 tolerance."""
    a, b = got[:rows].float(), want[:rows].float()
    if a.numel() == 0:
        return True, f"{name}: no rows"
    diff = (a - b).abs()
    within = (diff <= ATOL + RTOL * a.abs()).double().mean().item()
    line = (f"{name}: max |diff| {diff.max().item():.4g}, mean |diff| {diff.mean().item():.3g}, "
            f"{within:.4%} within {ATOL:g} + {RTOL:g}*|op|, bitwise equal {torch.equal(a, b)}")
    return within >= PASS_FRACTION, line


def rank_main(rank, args):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    return fused_vs_reference(layer_inputs(args, rank), args, compare)


def main(argv=None):
    return run(rank_main, parse_args(argv), "W4A8 fused_deep_moe")


if __name__ == "__main__":
    sys.exit(main())
