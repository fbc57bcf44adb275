"""fused_deep_moe on one CPU rank, measured side by side in one run:

- the op (JIT-compiled C++ path) vs the plain-torch reference (tokens/s; the reference is written
  for exactness, not speed);
- the op vs its roofline: `torch._int_mm` doing the same routed GEMM work (every bs*top-k row
  through GEMM1 [H, 2I] and GEMM2 [I, H] of its expert), grouped per expert as the op runs it, and
  as two single large GEMMs (an upper bound no grouped kernel reaches).

Target (issue 2): op >= 60% of the grouped `_int_mm` roofline at bs=64, H=2048, I=1024, 8 experts,
top-4. Prints ratios; asserts nothing.
"""
import argparse
import statistics
import time

import torch

import cam_jit
from cam_jit import reference


def median_time(fn, iters, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bs, h, i, e, k = args.bs, args.hidden, args.inter, args.experts, args.topk

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(bs, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(bs)]).to(torch.int32)
    kw = dict(
        x=x, expert_ids=ids, expert_scales=torch.softmax(torch.randn(bs, k, generator=gen), 1),
        gmm1_weight=torch.randint(-127, 128, (e, h, 2 * i), dtype=torch.int8, generator=gen),
        gmm1_weight_scale=torch.rand(e, 2 * i, generator=gen) / (127 * h ** 0.5),
        gmm2_weight=torch.randint(-127, 128, (e, i, h), dtype=torch.int8, generator=gen),
        gmm2_weight_scale=torch.rand(e, h, generator=gen) / (127 * i ** 0.5),
        group_ep="", ep_rank_size=1, ep_rank_id=0, moe_expert_num=e,
    )
    cam_jit.load()
    with torch.no_grad():
        t_op = median_time(lambda: cam_jit.fused_deep_moe(**kw), args.iters)
        t_ref = median_time(lambda: reference.fused_deep_moe(**kw), max(3, args.iters // 5), warmup=1)

    counts = torch.bincount(ids.flatten().long(), minlength=e).tolist()
    rows = [torch.randint(-127, 128, (n, h), dtype=torch.int8, generator=gen) for n in counts]
    rows2 = [torch.randint(-127, 128, (n, i), dtype=torch.int8, generator=gen) for n in counts]
    w1, w2 = kw["gmm1_weight"], kw["gmm2_weight"]

    def grouped():
        for ex, n in enumerate(counts):
            if n:
                torch._int_mm(rows[ex], w1[ex])
                torch._int_mm(rows2[ex], w2[ex])

    all_rows, all_rows2 = torch.cat(rows), torch.cat(rows2)
    t_grouped = median_time(grouped, args.iters)
    t_single = median_time(lambda: (torch._int_mm(all_rows, w1[0]), torch._int_mm(all_rows2, w2[0])), args.iters)

    pairs = bs * k
    print(f"fused_deep_moe, 1 rank, bs={bs}, H={h}, I={i}, E={e}, top-{k}, bf16, {args.threads} threads")
    print(f"  op (C++ path)          {t_op * 1e3:8.2f} ms   {bs / t_op:10.0f} tokens/s")
    print(f"  reference (plain torch){t_ref * 1e3:8.2f} ms   {bs / t_ref:10.0f} tokens/s   op speed-up {t_ref / t_op:.1f}x")
    print(f"  _int_mm grouped roofline {t_grouped * 1e3:6.2f} ms   ({pairs} rows in {sum(1 for n in counts if n)} groups)")
    print(f"  _int_mm single-GEMM bound{t_single * 1e3:6.2f} ms")
    print(f"  op at {t_grouped / t_op:.0%} of the grouped roofline (target >= 60%), "
          f"{t_single / t_op:.0%} of the single-GEMM bound")


if __name__ == "__main__":
    main()
