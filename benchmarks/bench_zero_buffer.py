"""FusedDeepMoeBuffer's shared-memory path vs fused_deep_moe's gloo path, side by side in one run.

Spawns --ranks local processes (one gloo process group on 127.0.0.1 and one FusedDeepMoeBuffer,
both on free ports) and measures, per batch size (tokens per rank), the latency per call: the
median over blocks of back-to-back calls (a barrier before each block) of the slowest rank's time
divided by the calls; the two paths alternate block by block:

- dispatch + combine: routing, sending each (token, k) row (int8 + scale + metadata) to the rank
  of its expert, sending one x.dtype row back per pair, and the weighted combine; no expert FFN,
  and the rows are quantised once outside the timing (both identical in the two paths). gloo:
  `_moe_cpu.plan_route` (count exchange) + `send_rows` + `return_rows` (two uneven all_to_all) +
  combine. shm: the buffer's transport
  (stores into the peers' segments, flags) + the same combine kernel;
- the whole op: cam_jit.fused_deep_moe vs FusedDeepMoeBuffer.zb_fused_deep_moe (bit-identical
  results, checked once per size).

Target (issue 6): shm dispatch + combine >= 3x lower latency than gloo at bs <= 64 per rank.
Prints ratios; asserts only that the two paths agree.

    python benchmarks/bench_zero_buffer.py                      # 2 ranks, bs 1..64 and 512
    python benchmarks/bench_zero_buffer.py --ranks 4 --bs 1 8 64 --prefill 256 --blocks 9
"""
import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cam_jit
from cam_jit.ops import _moe_cpu
from cam_jit.ops._kernels import cpu_kernels
from cam_jit.zero_buffer import FusedDeepMoeBuffer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layer(args, rank: int, bs: int):
    """This rank's fused_deep_moe kwargs (random tokens and routing, its E/R int8 experts)."""
    gen = torch.Generator().manual_seed(1000 * rank + bs)
    h, i, e, k, r = args.hidden, args.inter, args.experts, args.topk, args.ranks
    local = e // r
    return dict(
        x=torch.randn(bs, h, generator=gen).to(torch.bfloat16),
        expert_ids=torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(bs)]).to(torch.int32)
        if bs else torch.empty(0, k, dtype=torch.int32),
        expert_scales=torch.softmax(torch.randn(bs, k, generator=gen), 1),
        gmm1_weight=torch.randint(-127, 128, (local, h, 2 * i), dtype=torch.int8, generator=gen),
        gmm1_weight_scale=torch.rand(local, 2 * i, generator=gen) / (127 * h ** 0.5),
        gmm2_weight=torch.randint(-127, 128, (local, i, h), dtype=torch.int8, generator=gen),
        gmm2_weight_scale=torch.rand(local, h, generator=gen) / (127 * i ** 0.5),
        group_ep="", ep_rank_size=r, ep_rank_id=rank, moe_expert_num=e, global_bs=0,
    )


def zb_positional(kw):
    return [kw["x"], kw["expert_ids"], kw["gmm1_weight"], kw["gmm1_weight_scale"], kw["gmm2_weight"],
            kw["gmm2_weight_scale"], kw["expert_scales"], None, None, None, None, None, None, None, "",
            kw["ep_rank_size"], kw["ep_rank_id"], kw["moe_expert_num"], 0, 0]


def quantized(kw, local_experts):
    """The rows both paths send, quantised once outside the timing: (q [P, H] int8, scale [P]
    f32) in route order (which does not depend on the group)."""
    route = _moe_cpu.plan_route("bench", kw["expert_ids"], kw["x"].shape[0], local_experts, None,
                                experts=kw["moe_expert_num"])
    return cpu_kernels().quantize_rows(kw["x"], None, route.token, None)


def gloo_comm(kw, local_experts, q, scale):
    """dispatch + combine over gloo, as fused_deep_moe's CPU path does it."""
    route = _moe_cpu.plan_route("bench", kw["expert_ids"], kw["x"].shape[0], local_experts, dist.group.WORLD)
    received = _moe_cpu.send_rows("bench", route, q, scale, local_experts)
    y = _moe_cpu.return_rows("bench", route, received.rows.to(kw["x"].dtype))
    return cpu_kernels().combine(y, route.pair_rows, kw["expert_scales"], kw["x"].shape[0])


def shm_comm(buf, kw, local_experts, q, scale):
    """dispatch + combine through the buffer's transport, the steps of zb_fused_deep_moe."""
    transport = buf._transport
    x = kw["x"]
    batch, topk = kw["expert_ids"].shape
    route = _moe_cpu.plan_route("bench", kw["expert_ids"], batch, local_experts, None, experts=kw["moe_expert_num"])
    send = torch.bincount(torch.div(route.expert, local_experts, rounding_mode="floor"),
                          minlength=transport.ranks).tolist()
    transport.begin(60.0)
    geo = transport.geometry(x.shape[1], x.dtype)
    recv = transport.dispatch(geo, q, scale, route.expert, route.pos, send, local_experts, {})
    rows, _, order, _ = transport.receive(geo, recv, local_experts)
    transport.send_results(geo, rows.to(x.dtype), order, recv)
    returned = transport.results(geo, x.dtype, send)
    pair_rows = transport.pair_rows(geo, route.pos, route.expert, local_experts, batch, topk)
    return cpu_kernels().combine(returned, pair_rows, kw["expert_scales"], batch)


def timed_pair(gloo_fn, shm_fn, blocks: int, calls: int):
    """(gloo, shm) seconds per call: for each path, the median over blocks of `calls` back-to-back
    calls (a barrier before each block, so barrier skew is amortised) of the slowest rank's time
    per call. The two paths alternate block by block, so background load hits both alike."""
    gloo_fn(), shm_fn()
    times = []
    for _ in range(blocks):
        row = []
        for fn in (gloo_fn, shm_fn):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            row.append((time.perf_counter() - start) / calls)
        times.append(row)
    mine = torch.tensor(times, dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    slowest = torch.stack(gathered).max(0).values
    return statistics.median(slowest[:, 0].tolist()), statistics.median(slowest[:, 1].tolist())


def worker(rank, args, gloo_port, zb_port, out):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                            world_size=args.ranks, timeout=datetime.timedelta(seconds=120))
    local = args.experts // args.ranks
    sizes = list(args.bs) + ([args.prefill] if args.prefill else [])
    pair_bytes = (args.hidden + 12 + 15) // 16 * 16 + 2 * args.hidden
    memsize = (2 << 20) + args.ranks * max(sizes) * args.topk * pair_bytes
    rows = []
    with torch.no_grad(), FusedDeepMoeBuffer() as buf:
        buf.init(rank, args.ranks, memsize, f"tcp://127.0.0.1:{zb_port}")
        for bs in sizes:
            kw = layer(args, rank, bs)
            blocks, calls = (args.blocks, args.calls) if bs <= 64 else (max(3, args.blocks // 3), 1)
            same = all(torch.equal(a, b) for a, b in zip(buf.zb_fused_deep_moe(*zb_positional(kw)),
                                                        cam_jit.fused_deep_moe(**kw)))
            assert same, f"rank {rank}: zb_fused_deep_moe differs from fused_deep_moe at bs={bs}"
            q, scale = quantized(kw, local)
            assert torch.equal(gloo_comm(kw, local, q, scale), shm_comm(buf, kw, local, q, scale))
            comm = timed_pair(lambda: gloo_comm(kw, local, q, scale), lambda: shm_comm(buf, kw, local, q, scale),
                              blocks, calls)
            whole = timed_pair(lambda: cam_jit.fused_deep_moe(**kw),
                               lambda: buf.zb_fused_deep_moe(*zb_positional(kw)), blocks, max(1, calls // 5))
            rows.append((bs, comm, whole))
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def spawn_ranks(worker, args, *extra, timeout: float = 3600):
    """Runs worker(rank, args, *extra, queue) in args.ranks spawned processes; returns what rank 0
    puts on the queue."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, *extra, out)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    rows = out.get(timeout=timeout)
    for proc in procs:
        proc.join()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--bs", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="decode tokens per rank")
    p.add_argument("--prefill", type=int, default=512, help="a prefill batch per rank (0: none)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--blocks", type=int, default=15, help="timed blocks per path and size (median reported)")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per block at bs <= 64 (prefill: 1; "
                   "whole op: calls / 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if args.experts % args.ranks or args.topk > args.experts:
        p.error("--experts must be a multiple of --ranks and >= --topk")
    cam_jit.load()
    rows = spawn_ranks(worker, args, free_port(), free_port())
    print(f"FusedDeepMoeBuffer (shared memory) vs fused_deep_moe (gloo): {args.ranks} ranks, H={args.hidden}, "
          f"I={args.inter}, E={args.experts}, top-{args.topk}, bf16, {args.threads} thread(s) per rank, "
          f"{os.cpu_count()} cores")
    print(f"{'bs/rank':>8} | {'dispatch+combine: gloo':>22} {'shm':>9} {'ratio':>7} | "
          f"{'whole op: gloo':>15} {'shm':>9} {'ratio':>7}")
    for bs, (c_gloo, c_shm), (w_gloo, w_shm) in rows:
        print(f"{bs:>8} | {c_gloo * 1e3:>19.3f} ms {c_shm * 1e3:>6.3f} ms {c_gloo / c_shm:>6.1f}x | "
              f"{w_gloo * 1e3:>12.3f} ms {w_shm * 1e3:>6.3f} ms {w_gloo / w_shm:>6.2f}x")
    decode = [c_gloo / c_shm for bs, (c_gloo, c_shm), _ in rows if bs <= 64]
    if decode:
        verdict = "met" if min(decode) >= 3 else "NOT met"
        print(f"target shm dispatch+combine >= 3x lower latency at bs <= 64: {verdict} (min ratio {min(decode):.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
