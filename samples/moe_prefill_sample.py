"""Prefill on CPU ranks: dispatch a batch in normal mode, run your own experts, combine.

Spawns --ranks local processes joined in a gloo process group (127.0.0.1, a free port). Each rank
routes its prefill batch (top-k of random logits), and then:

1. cam_jit.moe_dispatch_prefill: layout -> notify -> dispatch; every routed (token, k) pair
   arrives, int8-quantised, at the rank owning its expert, grouped by local expert;
2. my_experts: the expert code is yours; here a W8A8 SwiGLU FFN per local expert, written with
   the arithmetic of docs/semantics.md §1.8 (cam_jit.reference's expert step);
3. cam_jit.moe_combine_prefill: the results go home and are summed with the routing weights.

The result is compared with cam_jit.fused_deep_moe's routed output on the same layer: the two
are bit-identical whenever no token's max |x| is below 2^-16 (the prefill quantisation adds
1e-12 to it; see docs/semantics.md §9). Exits non-zero on a mismatch.

    python samples/moe_prefill_sample.py                       # 2 ranks, 256 tokens each
    python samples/moe_prefill_sample.py --ranks 4 --bs 1024 --experts 32
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import cam_jit
from cam_jit.reference import fused_deep_moe_steps
from cpu_ranks import run_on_ranks
from fused_deep_moe_sample import layer_inputs, timed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (local processes)")
    p.add_argument("--bs", type=int, default=256, help="prefill tokens per rank")
    p.add_argument("--hidden", type=int, default=1024, help="H (DeepSeek-V3: 7168)")
    p.add_argument("--inter", type=int, default=256, help="I, expert intermediate size (DeepSeek-V3: 2048)")
    p.add_argument("--experts", type=int, default=16, help="E, routed experts in total (DeepSeek-V3: 256)")
    p.add_argument("--topk", type=int, default=8, help="K, experts per token (DeepSeek-V3: 8)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=3, help="timed iterations of each path")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.experts % args.ranks or args.topk > args.experts:
        p.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks}) and >= --topk")
    args.share = args.smooth = args.mask = args.eplb = False  # the fused_deep_moe sample's layer options
    return args


def my_experts(recv_x, recv_scales, per_expert, weights, out_dtype):
    """Your expert code: rows [N, H] int8 with dequantisation scales [N], grouped by local expert
    (per_expert[e] rows for local expert e) -> results [N, H] out_dtype, row for row."""
    w1, s1, w2, s2 = (w[0] for w in weights)  # stacked [E_loc, ...] weights of this rank's experts
    results = torch.empty(recv_x.shape, dtype=out_dtype)
    start = 0
    for e, rows in enumerate(per_expert.tolist()):
        block = slice(start, start + rows)
        results[block] = fused_deep_moe_steps.expert_ffn(recv_x[block], recv_scales[block], w1[e], s1[e], None,
                                                         w2[e], s2[e], None, out_dtype)
        start += rows
    return results


def prefill_layer(kw):
    """dispatch (normal mode, int8) -> my_experts -> combine, on this rank's part of the layer."""
    group = dict(group_ep=kw["group_ep"], ep_rank_size=kw["ep_rank_size"], ep_rank_id=kw["ep_rank_id"],
                 moe_expert_num=kw["moe_expert_num"])
    recv_x, recv_scales, per_expert, handle = cam_jit.moe_dispatch_prefill(kw["x"], kw["expert_ids"], quant_mode=2,
                                                                           **group)
    weights = [kw[n] for n in ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale")]
    results = my_experts(recv_x, recv_scales, per_expert, weights, kw["x"].dtype)
    return cam_jit.moe_combine_prefill(results, handle, kw["expert_scales"]), int(per_expert.sum())


def rank_main(rank, args):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    kw = layer_inputs(args, rank)
    with torch.no_grad():
        (prefill, received), t_prefill = timed(prefill_layer, [kw], args.iters)
        fused, t_fused = timed(cam_jit.fused_deep_moe, kw, args.iters)
    exact = torch.equal(prefill, fused[0])
    diff = (prefill.float() - fused[0].float()).abs().max().item() if prefill.numel() else 0.0
    small = int((kw["x"].float().abs().amax(1) < 2.0 ** -16).sum())
    return exact, [f"received {received} (token, k) rows for {args.experts // args.ranks} local experts",
                   f"prefill output vs fused_deep_moe: exact {exact}, max |diff| {diff:.4g}"
                   + (f" ({small} tokens with max |x| < 2^-16)" if small else ""),
                   f"latency: dispatch+experts+combine {t_prefill * 1e3:.1f} ms, fused_deep_moe "
                   f"{t_fused * 1e3:.1f} ms"]


def main(argv=None):
    args = parse_args(argv)
    print(f"cam_jit {cam_jit.__version__}: prefill dispatch/combine on {args.ranks} CPU rank(s), bs={args.bs}/rank, "
          f"H={args.hidden}, I={args.inter}, E={args.experts}, top-{args.topk}, {args.dtype}")
    cam_jit.load()  # build (or load) the kernels once, before the ranks start
    passed = True
    for rank, (ok, lines) in enumerate(run_on_ranks(rank_main, args, args.ranks)):
        passed &= ok
        print(f"rank {rank}: " + "\n        ".join(lines))
    print("PASS: prefill dispatch -> experts -> combine equals fused_deep_moe bit for bit" if passed
          else "FAIL: the prefill path differs from fused_deep_moe")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
