"""FusedDeepMoeBuffer on CPU ranks: zero-copy expert parallelism through shared memory.

Spawns --ranks local processes. Each creates a FusedDeepMoeBuffer (one POSIX
shared-memory segment per rank, bootstrapped through a TCPStore at --ip-port), runs
zb_fused_deep_moe with docs/semantics.md §5.1's positional arguments, and checks the result against
cam_jit.fused_deep_moe over a gloo process group (same math, another transport: the two must be
bit-identical) and prints both latencies. Exits non-zero on a mismatch.

    python samples/fused_deep_moe_shmem_sample.py                      # 2 ranks, a free local port
    python samples/fused_deep_moe_shmem_sample.py --ranks 4 --bs 16 --share --smooth --mask
    python samples/fused_deep_moe_shmem_sample.py --ip-port tcp://127.0.0.1:29650 --memsize 512
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import cam_jit
from cpu_ranks import free_port, run_on_ranks
from fused_deep_moe_sample import quantized_ffn, timed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (local processes, one host)")
    p.add_argument("--ip-port", default=None, help="bootstrap address 'tcp://host:port' served by rank 0 "
                   "(default: 127.0.0.1 and a free port)")
    p.add_argument("--memsize", type=int, default=256, help="MiB of shared memory per rank (sparse; 2 MiB are "
                   "ext-info, the rest the workspace)")
    p.add_argument("--bs", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048, help="H (DeepSeek-V3: 7168)")
    p.add_argument("--inter", type=int, default=512, help="I, expert intermediate size")
    p.add_argument("--experts", type=int, default=16, help="E, routed experts in total")
    p.add_argument("--topk", type=int, default=8, help="K, experts per token")
    p.add_argument("--iters", type=int, default=5, help="timed iterations of each path")
    p.add_argument("--share", action="store_true", help="add a shared expert (share_output)")
    p.add_argument("--smooth", action="store_true", help="smooth-quant scales for routed and shared experts")
    p.add_argument("--mask", action="store_true", help="x_active_mask: the last quarter of each batch inactive")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.experts % args.ranks:
        p.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    if args.ip_port is None:
        args.ip_port = f"tcp://127.0.0.1:{free_port()}"
    return args


def positional_args(args, rank):
    """zb_fused_deep_moe's arguments in docs/semantics.md §5.1 order, for this rank."""
    local = args.experts // args.ranks
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x = torch.randn(args.bs, args.hidden, generator=gen).to(torch.bfloat16)
    top = torch.randn(args.bs, args.experts, generator=gen).topk(args.topk, dim=1)
    experts = [quantized_ffn(torch.Generator().manual_seed(10_000 + rank * local + e), args.hidden, args.inter)
               for e in range(local)]
    w1, s1, w2, s2 = ([torch.stack(t)] for t in zip(*experts))
    shared = [None] * 4
    if args.share:
        shared = list(quantized_ffn(torch.Generator().manual_seed(7), args.hidden, args.inter))
    smooth = [None, None]
    if args.smooth:
        sgen = torch.Generator().manual_seed(8)
        smooth = [torch.rand(args.experts, args.hidden, generator=sgen) + 0.5,
                  torch.rand(args.hidden, generator=sgen) + 0.5]
    mask = torch.arange(args.bs) < args.bs - args.bs // 4 if args.mask else None
    return [x, top.indices.to(torch.int32), w1, s1, w2, s2, torch.softmax(top.values, dim=1), *shared, *smooth,
            mask, "", args.ranks, rank, args.experts, 0, args.bs * args.ranks]


NAMES = ("x", "expert_ids", "gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale",
         "expert_scales", "share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight",
         "share_gmm2_weight_scale", "expert_smooth_scales", "share_smooth_scales", "x_active_mask", "group_ep",
         "ep_rank_size", "ep_rank_id", "moe_expert_num", "quant_mode", "global_bs")


def rank_main(rank, args):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    zb_args = positional_args(args, rank)
    kw = dict(zip(NAMES, zb_args), group_ep=dist.group.WORLD)
    buffer = cam_jit.FusedDeepMoeBuffer()
    buffer.init(rank, args.ranks, args.memsize << 20, args.ip_port)
    try:
        with torch.no_grad():
            zb, t_zb = timed(buffer.zb_fused_deep_moe, zb_args, args.iters)
            gloo, t_gloo = timed(cam_jit.fused_deep_moe, kw, args.iters)
    finally:
        buffer.close()
    same = [torch.equal(a, b) for a, b in zip(zb, gloo)]
    return all(same), [f"output / share_output / expert_token_nums bit-identical to the gloo path: {same}",
                       f"expert_token_nums {zb[2].tolist()}",
                       f"latency: shared memory {t_zb * 1e3:.2f} ms, gloo {t_gloo * 1e3:.2f} ms "
                       f"({t_gloo / t_zb:.2f}x)"]


def main(argv=None):
    args = parse_args(argv)
    print(f"cam_jit {cam_jit.__version__}: FusedDeepMoeBuffer on {args.ranks} CPU rank(s), bootstrap {args.ip_port}, "
          f"memsize {args.memsize} MiB/rank, bs={args.bs}/rank, H={args.hidden}, I={args.inter}, E={args.experts}, "
          f"top-{args.topk}, options: {[o for o in ('share', 'smooth', 'mask') if getattr(args, o)] or 'none'}")
    cam_jit.load()  # build (or load) the CPU kernels once, before the ranks start
    results = run_on_ranks(rank_main, args, args.ranks)
    passed = True
    for rank, (ok, lines) in enumerate(results):
        passed &= ok
        print(f"rank {rank}: " + "\n        ".join(lines))
    print("PASS: zb_fused_deep_moe matches fused_deep_moe bit for bit" if passed else "FAIL: mismatch")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
