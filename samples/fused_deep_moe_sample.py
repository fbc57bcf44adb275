"""fused_deep_moe on CPU ranks: the fused op against the small-ops reference.

Spawns --ranks local processes joined in a gloo process group on 127.0.0.1 (a free port), builds
a DeepSeek-like MoE layer scaled to this machine (int8 W8A8 experts spread over the ranks, top-k
routing), runs cam_jit.fused_deep_moe and cam_jit.reference.fused_deep_moe (dispatch, grouped
GEMM, dequant-SwiGLU-quant, grouped GEMM, combine in plain torch) on the same inputs, and prints
their difference and latency. Exits non-zero on a mismatch.

    python samples/fused_deep_moe_sample.py                 # 2 ranks
    python samples/fused_deep_moe_sample.py --ranks 4 --bs 16 --share --smooth --mask --eplb
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import cam_jit
from cam_jit import reference
from cpu_ranks import run_on_ranks


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (local processes)")
    p.add_argument("--bs", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048, help="H (DeepSeek-V3: 7168)")
    p.add_argument("--inter", type=int, default=512, help="I, expert intermediate size (DeepSeek-V3: 2048)")
    p.add_argument("--experts", type=int, default=16, help="E, routed experts in total (DeepSeek-V3: 256)")
    p.add_argument("--topk", type=int, default=8, help="K, experts per token (DeepSeek-V3: 8)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=5, help="timed iterations of each")
    p.add_argument("--share", action="store_true", help="add a shared expert (share_output)")
    p.add_argument("--smooth", action="store_true", help="smooth-quant scales for routed and shared experts")
    p.add_argument("--mask", action="store_true", help="x_active_mask: the last quarter of each batch inactive")
    p.add_argument("--eplb", action="store_true", help="per-expert weight lists (dynamic EPLB) instead of stacked")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.experts % args.ranks:
        p.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    return args


def quantized_ffn(gen, hidden, inter):
    """One expert: int8 [H, 2I] gate|up weight, [2I] scales, int8 [I, H] down weight, [H] scales."""
    w1 = torch.randint(-127, 128, (hidden, 2 * inter), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-127, 128, (inter, hidden), dtype=torch.int8, generator=gen)
    s1 = (torch.rand(2 * inter, generator=gen) + 0.5) / (127 * hidden ** 0.5)
    s2 = (torch.rand(hidden, generator=gen) + 0.5) / (127 * inter ** 0.5)
    return w1, s1, w2, s2


def layer_inputs(args, rank):
    """This rank's tokens and routing, and the weights of its E/R local experts."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    local = args.experts // args.ranks
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x = torch.randn(args.bs, args.hidden, generator=gen).to(dtype)
    logits = torch.randn(args.bs, args.experts, generator=gen)
    top = logits.topk(args.topk, dim=1)
    kw = dict(x=x, expert_ids=top.indices.to(torch.int32), expert_scales=torch.softmax(top.values, dim=1))
    experts = []
    for e in range(local):  # weights depend only on the global expert id
        experts.append(quantized_ffn(torch.Generator().manual_seed(10_000 + rank * local + e), args.hidden, args.inter))
    w1, s1, w2, s2 = (list(t) for t in zip(*experts))
    if not args.eplb:
        w1, s1, w2, s2 = ([torch.stack(t)] for t in (w1, s1, w2, s2))
    kw.update(gmm1_weight=w1, gmm1_weight_scale=s1, gmm2_weight=w2, gmm2_weight_scale=s2)
    if args.share:
        sw1, ss1, sw2, ss2 = quantized_ffn(torch.Generator().manual_seed(7), args.hidden, args.inter)
        kw.update(share_gmm1_weight=sw1, share_gmm1_weight_scale=ss1, share_gmm2_weight=sw2,
                  share_gmm2_weight_scale=ss2)
    if args.smooth:
        sgen = torch.Generator().manual_seed(8)
        kw["expert_smooth_scales"] = torch.rand(args.experts, args.hidden, generator=sgen) + 0.5
        kw["share_smooth_scales"] = torch.rand(args.hidden, generator=sgen) + 0.5
    if args.mask:
        kw["x_active_mask"] = torch.arange(args.bs) < args.bs - args.bs // 4
    kw.update(group_ep=dist.group.WORLD if args.ranks > 1 else "", ep_rank_size=args.ranks, ep_rank_id=rank,
              moe_expert_num=args.experts, global_bs=args.bs * args.ranks)
    return kw


def timed(fn, args, iters):
    """fn's result and its median latency over `iters` calls after a warm-up (which also does the
    first-use JIT build); `args` is a dict of keywords or a list of positional arguments."""
    call = (lambda: fn(**args)) if isinstance(args, dict) else (lambda: fn(*args))
    result = call()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def compare(name, got, want, rows):
    diff = (got[:rows].float() - want[:rows].float()).abs()
    ok = bool(torch.allclose(got[:rows].float(), want[:rows].float(), atol=2.0, rtol=0.02))
    return ok, f"{name}: max |diff| {diff.max().item() if diff.numel() else 0:.4g}, " \
               f"mean |diff| {diff.mean().item() if diff.numel() else 0:.3g}, exact {torch.equal(got, want)}"


def fused_vs_reference(kw, args, compare):
    """Runs the fused op and the small-ops reference on one rank's inputs and compares them with
    `compare(name, got, want, rows) -> (ok, line)`; returns (passed, report lines)."""
    with torch.no_grad():
        fused, t_fused = timed(cam_jit.fused_deep_moe, kw, args.iters)
        small, t_small = timed(reference.fused_deep_moe, kw, args.iters)
    active = int(kw["x_active_mask"].sum()) if args.mask else args.bs
    ok_out, line_out = compare("output", fused[0], small[0], active)
    ok_share, line_share = compare("share_output", fused[1], small[1], args.bs)
    ok_counts = torch.equal(fused[2], small[2])
    lines = [line_out, line_share, f"expert_token_nums {fused[2].tolist()} "
             f"{'==' if ok_counts else '!='} reference {small[2].tolist()}",
             f"latency: fused {t_fused * 1e3:.2f} ms, small ops {t_small * 1e3:.2f} ms "
             f"({t_small / t_fused:.1f}x)"]
    return ok_out and ok_share and ok_counts, lines


def rank_main(rank, args):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    return fused_vs_reference(layer_inputs(args, rank), args, compare)


def run(rank_body, args, what):
    """Prints the configuration, runs rank_body on --ranks local ranks, prints each rank's report
    and the verdict; returns the exit status."""
    print(f"cam_jit {cam_jit.__version__}: {what} on {args.ranks} CPU rank(s), bs={args.bs}/rank, "
          f"H={args.hidden}, I={args.inter}, E={args.experts}, top-{args.topk}, {args.dtype}, "
          f"options: {[o for o in ('share', 'smooth', 'mask', 'eplb') if getattr(args, o)] or 'none'}")
    cam_jit.load()  # build (or load) the kernels once, before the ranks start
    passed = True
    for rank, (ok, lines) in enumerate(run_on_ranks(rank_body, args, args.ranks)):
        passed &= ok
        print(f"rank {rank}: " + "\n        ".join(lines))
    print(f"PASS: {what} matches the small-ops reference" if passed else "FAIL: mismatch against the reference")
    return 0 if passed else 1


def main(argv=None):
    return run(rank_main, parse_args(argv), "fused_deep_moe")


if __name__ == "__main__":
    sys.exit(main())
