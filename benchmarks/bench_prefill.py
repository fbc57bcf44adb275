"""Prefill throughput: the normal-mode pair (moe_dispatch_prefill + moe_combine_prefill) vs the
low-latency pair (moe_dispatch_lowlatency + moe_combine_lowlatency) on the same work, side by side.

Spawns --ranks local processes in one gloo process group (127.0.0.1, a free port). For each batch
size (tokens per rank) both paths dispatch the same tokens and routing with int8 quantisation,
run the same stand-in expert (each received int8 row cast to bf16) and combine with the same
weights; their outputs are checked equal once per size. Reported: tokens per second per rank
(BS / seconds per call; seconds per call = median over blocks of the slowest rank's time, the two
paths alternating block by block, from bench_zero_buffer.timed_pair) and the ratio.

The low-latency pair sizes its outputs for the worst case (global_bs / R * R * min(K, E_loc)
rows) and zero-fills them; the normal pair learns the exact row count first (notify) and moves
each token once per destination rank.

    python benchmarks/bench_prefill.py                          # 2 ranks, bs 512 1024 2048 4096
    python benchmarks/bench_prefill.py --bs 512 1024 --hidden 2048 --blocks 5
"""
import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import cam_jit
from bench_zero_buffer import free_port, spawn_ranks, timed_pair


def tokens(args, rank: int, bs: int):
    """This rank's x [bs, H] bf16, top-k expert_ids [bs, K] int32 and softmax weights [bs, K]."""
    gen = torch.Generator().manual_seed(1000 * rank + bs)
    logits = torch.randn(bs, args.experts, generator=gen)
    top = logits.topk(args.topk, dim=1)
    return (torch.randn(bs, args.hidden, generator=gen).to(torch.bfloat16), top.indices.to(torch.int32),
            torch.softmax(top.values, dim=1))


def expert(rows):
    """The stand-in expert both paths run: each int8 row cast to bf16."""
    return rows.to(torch.bfloat16)


def normal_pair(x, ids, weights, group):
    recv_x, _, _, handle = cam_jit.moe_dispatch_prefill(x, ids, quant_mode=2, **group)
    return cam_jit.moe_combine_prefill(expert(recv_x), handle, weights)


def lowlatency_pair(x, ids, weights, group):
    expand_x, _, assist, _, recv_count = cam_jit.moe_dispatch_lowlatency(x, ids, quant_mode=2, **group)
    return cam_jit.moe_combine_lowlatency(expert(expand_x), ids, assist, recv_count, weights, **group)


def worker(rank, args, port, out):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=600))
    group = dict(group_ep="", ep_rank_size=args.ranks, ep_rank_id=rank, moe_expert_num=args.experts)
    rows = []
    with torch.no_grad():
        for bs in args.bs:
            x, ids, weights = tokens(args, rank, bs)
            same = torch.equal(normal_pair(x, ids, weights, group), lowlatency_pair(x, ids, weights, group))
            assert same, f"rank {rank}: the two paths differ at bs={bs}"
            normal, low = timed_pair(lambda: normal_pair(x, ids, weights, group),
                                     lambda: lowlatency_pair(x, ids, weights, group), args.blocks, 1)
            rows.append((bs, normal, low))
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--bs", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="prefill tokens per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--blocks", type=int, default=3, help="timed calls per path and size (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if args.experts % args.ranks or args.topk > args.experts:
        p.error("--experts must be a multiple of --ranks and >= --topk")
    cam_jit.load()
    rows = spawn_ranks(worker, args, free_port())
    print(f"prefill (normal) vs low-latency dispatch+combine: {args.ranks} ranks, H={args.hidden}, "
          f"E={args.experts}, top-{args.topk}, bf16 -> int8, {args.threads} thread(s) per rank, {os.cpu_count()} cores")
    print(f"{'bs/rank':>8} | {'normal tokens/s':>16} {'low-latency tokens/s':>21} | {'normal / low-latency':>20}")
    for bs, normal, low in rows:
        print(f"{bs:>8} | {bs / normal:>16,.0f} {bs / low:>21,.0f} | {low / normal:>19.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
