"""a2e / e2a on CPU ranks: attention ranks hand their tokens to expert ranks and get them back.

Spawns --experts + --attention local processes joined in one gloo process group on 127.0.0.1 (a
free port): ranks 0 .. Er-1 are expert ranks, the others attention ranks. Each attention rank sends
its tokens (and, with --compute-gate 1, its routing ids and scales) with a2e; each expert rank
applies a stand-in expert to the expand_x it received (--expert identity, or double: x * 2, exact
in bfloat16) and sends the blocks back with e2a. Every rank compares its outputs with
cam_jit.reference.a2e_e2a (an all_gather-based implementation of docs/semantics.md §2), and every attention
rank checks that it got expert(x) back bitwise where docs/semantics.md §2.4 promises the round trip. Prints the
results and the latency; exits non-zero on a mismatch.

    python samples/a2e_e2a_sample.py                                   # 2 expert + 2 attention ranks
    python samples/a2e_e2a_sample.py --experts 1 --attention 3 --bs 24 --hidden 7168 --strict
    python samples/a2e_e2a_sample.py --experts 2 --attention 3 --compute-gate 0 --dtype fp16
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import cam_jit
from cam_jit import a2e, e2a
from cam_jit.reference import a2e_e2a as reference
from cpu_ranks import run_on_ranks

EXPERTS = {"identity": lambda t: t, "double": lambda t: t * 2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=2, help="Er, expert ranks (local processes)")
    p.add_argument("--attention", type=int, default=2, help="Ar >= Er, attention ranks (local processes)")
    p.add_argument("--bs", type=int, default=16,
                   help="batch_size BE of an expert rank; each attention rank has BE // ceil(Ar/Er) tokens")
    p.add_argument("--hidden", type=int, default=1024, help="hidden_size H (DeepSeek-V3: 7168)")
    p.add_argument("--topk", type=int, default=8, help="routed experts per token (ids and scales sent along)")
    p.add_argument("--compute-gate", type=int, choices=[0, 1], default=1, help="1: send ids and scales too")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="token dtype (fp16 is rounded to bf16)")
    p.add_argument("--expert", choices=sorted(EXPERTS), default="identity", help="stand-in expert computation")
    p.add_argument("--strict", action="store_true", help="also check the NPU kernel's limits (docs/semantics.md §2.5)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.experts <= args.attention:
        p.error(f"need 0 < --experts ({args.experts}) <= --attention ({args.attention})")
    return args


def rank_inputs(args, rank):
    """Attention rank: [P, H] tokens, [P, topk] int32 ids, [P, topk] float32 scales. Expert rank:
    empty placeholders (a2e does not read them)."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if rank < args.experts:
        return (torch.empty(0, args.hidden, dtype=dtype), torch.empty(0, args.topk, dtype=torch.int32),
                torch.empty(0, args.topk))
    rows = args.bs // math.ceil(args.attention / args.experts)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x = torch.randn(rows, args.hidden, generator=gen).to(dtype)
    ids = torch.randint(0, 256, (rows, args.topk), dtype=torch.int32, generator=gen)
    scales = torch.softmax(torch.randn(rows, args.topk, generator=gen), dim=1)
    return x, ids, scales


def round_trip_promised(args, rank):
    """docs/semantics.md §2.4: slot i of expert e gets rows [i*Q, ...) back where a2e put it at [i*P, ...)."""
    er, ar = args.experts, args.attention
    expert, slot = rank % er, rank // er - 1
    served = len(range(expert + er, er + ar, er))
    return slot * (args.bs // math.ceil(ar / er)) == slot * (args.bs // served)


def layer(fn_a2e, fn_e2a, args, rank, group, x, ids, scales, **kw):
    """a2e -> stand-in expert -> e2a on this rank; returns (a2e outputs, e2a output)."""
    sizes = (args.bs, args.hidden, args.topk, args.experts, args.attention, rank, group)
    out = fn_a2e(x, ids, scales, *sizes, 24, args.compute_gate, **kw)
    expand = EXPERTS[args.expert](out[0]) if rank < args.experts else x
    return list(out), fn_e2a(expand, out[3], *sizes, 24, **kw)


def rank_main(rank, args):
    world = args.experts + args.attention
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = dist.group.WORLD
    x, ids, scales = rank_inputs(args, rank)
    with torch.no_grad():
        got, back = layer(a2e, e2a, args, rank, group, x, ids, scales, strict=args.strict)
        want, want_back = layer(reference.a2e, reference.e2a, args, rank, group, x, ids, scales)
        times = []
        for _ in range(args.iters):
            dist.barrier()
            start = time.perf_counter()
            layer(a2e, e2a, args, rank, group, x, ids, scales, strict=args.strict)
            times.append(time.perf_counter() - start)
    names = ["expand_x", "simulate_expert_ids", "simulate_expert_scales", "atten_batch_size", "x_active_mask"]
    bad = [n for n, a, b in zip(names, got, want) if a.dtype != b.dtype or not torch.equal(a, b)]
    if not torch.equal(back, want_back):
        bad.append("e2a output")
    ok = not bad
    if rank < args.experts:
        role = f"expert rank, serves {list(range(rank + args.experts, world, args.experts))}"
        lines = [f"a2e: expand_x {list(got[0].shape)}, ids {list(got[1].shape)}, scales {list(got[2].shape)}; "
                 f"e2a placeholder {list(back.shape)}"]
    else:
        role = f"attention rank -> expert {rank % args.experts}, slot {rank // args.experts - 1}"
        expected = EXPERTS[args.expert](x.to(torch.bfloat16))
        if round_trip_promised(args, rank):
            same = torch.equal(back, expected)
            ok &= same
            trip = f"e2a returned expert(x) bitwise: {same}"
        else:
            trip = "no round trip promised here (docs/semantics.md §2.4, uneven ratio)"
        lines = [f"x {list(x.shape)} {args.dtype} -> e2a {list(back.shape)} bf16; {trip}"]
    lines.append("matches the reference" if not bad else f"MISMATCH against the reference: {bad}")
    lines.append(f"latency a2e + e2a: {statistics.median(times) * 1e3:.3f} ms" if times else "")
    return (ok, role, [line for line in lines if line])



def main(argv=None):
    args = parse_args(argv)
    world = args.experts + args.attention
    print(f"cam_jit {cam_jit.__version__}: a2e/e2a on {args.experts} expert + {args.attention} attention CPU "
          f"ranks, batch_size={args.bs} (per attention rank {args.bs // math.ceil(args.attention / args.experts)}), "
          f"H={args.hidden}, top-{args.topk}, compute_gate={args.compute_gate}, {args.dtype}, "
          f"expert={args.expert}{', strict' if args.strict else ''}")
    results = run_on_ranks(rank_main, args, world)
    passed = True
    for rank in range(world):
        ok, role, lines = results[rank]
        passed &= ok
        print(f"rank {rank} ({role}):\n        " + "\n        ".join(lines))
    print("PASS: a2e/e2a match the reference and the round trip holds" if passed else "FAIL: see the mismatches above")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
