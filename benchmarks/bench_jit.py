"""Benchmark of the JIT engine: cold build, warm load, import overhead, concurrent cold starts.

Everything is measured side by side in one run, in fresh processes, and printed as ratios
against the targets (no asserts):

- cold build of the backend (fresh cache dir), time around ``cam_jit.jit.load()`` in the process;
- warm ``cam_jit.jit.load()`` vs bare ``torch.ops.load_library`` of the same .so vs a
  ``torch.utils.cpp_extension.load`` cache hit (median over fresh processes, time around the call;
  subprocesses started during the call counted with an audit hook);
- ``import cam_jit`` on top of ``import torch``;
- ``--concurrent`` (8) processes starting cold together vs one cold process (wall time until all have loaded).

usage: python benchmarks/bench_jit.py [--backend cpu] [--tiny] [--runs 7] [--concurrent 8]
``--tiny`` benchmarks tests/jit_data/torch_op.cpp (one small TORCH_LIBRARY op) instead of a real
backend, for developing the engine before the kernels exist.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, time
SPAWN = {"subprocess.Popen", "os.posix_spawn", "os.exec", "os.system", "os.fork", "os.spawn"}
spawns = []
sys.addaudithook(lambda event, args: spawns.append(event) if event in SPAWN else None)
mode, cfg = sys.argv[1], json.loads(sys.argv[2])
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
out = {"import_torch_ms": (t1 - t0) * 1e3}
if mode == "bare":
    start = time.perf_counter()
    torch.ops.load_library(cfg["library"])
elif mode == "cpp_ext":
    from torch.utils import cpp_extension
    start = time.perf_counter()
    cpp_extension.load(name=cfg["name"], sources=cfg["sources"], extra_cflags=cfg["cflags"],
                       extra_include_paths=cfg["include_dirs"], build_directory=cfg["dir"],
                       verbose=False, is_python_module=False)
else:
    import cam_jit
    from cam_jit import jit
    out["import_cam_jit_ms"] = (time.perf_counter() - t1) * 1e3
    if cfg["tiny"]:
        from pathlib import Path
        root = Path(cfg["root"])
        spec = jit.BuildSpec(backend=cfg["backend"], name=cfg["name"], root=root,
                             sources=tuple(Path(s) for s in cfg["sources"]))
        jit.register_backend(cfg["backend"], lambda: spec)
    start = time.perf_counter()
    before = len(spawns)
    loaded = jit.load(cfg["backend"])
    out.update(library=str(loaded.library), built=loaded.built)
out["ms"] = (time.perf_counter() - start) * 1e3
out["spawns"] = len(spawns) - (before if mode == "load" else 0)
print(json.dumps(out))
'''


def child(mode, cfg, cache, count=1):
    """Run ``count`` fresh processes at once; return (their JSON results, wall seconds)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), CAM_JIT_CACHE_DIR=str(cache))
    env.pop("CAM_JIT_DISABLE_JIT", None)
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, mode, json.dumps(cfg)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(count)]
    outputs = [proc.communicate(timeout=1800) for proc in procs]
    wall = time.perf_counter() - start
    for proc, (out, err) in zip(procs, outputs):
        if proc.returncode != 0:
            sys.exit(f"benchmark child ({mode}) failed:\n{err}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs], wall


def median(mode, cfg, cache, runs):
    """Median time in the measured call over ``runs`` fresh processes, and the most subprocesses
    any of them started during it."""
    results = [child(mode, cfg, cache)[0][0] for _ in range(runs)]
    return statistics.median(r["ms"] for r in results), max(r["spawns"] for r in results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="use tests/jit_data/torch_op.cpp")
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per median")
    parser.add_argument("--concurrent", type=int, default=8, help="processes starting cold together")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from cam_jit import jit

    if args.tiny:
        root = REPO / "tests" / "jit_data"
        spec = jit.BuildSpec(backend="bench-tiny", name="bench_tiny", root=root,
                             sources=(root / "torch_op.cpp",))
    else:
        spec = jit.backend_spec(args.backend)
    cfg = {"tiny": args.tiny, "backend": spec.backend, "name": spec.name, "root": str(spec.root),
           "sources": [str(p) for p in spec.sources], "cflags": list(spec.cflags),
           "include_dirs": [str(p) for p in spec.include_dirs]}
    work = Path(tempfile.mkdtemp(prefix="cam_jit_bench_"))
    print(f"benchmarking the {spec.backend} backend ({len(spec.sources)} sources), "
          f"{args.runs} fresh processes per median")
    try:
        measure(cfg, work, args.runs, args.concurrent)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(cfg, work, runs, concurrent):
    """Run every measurement in fresh processes under ``work`` and print the results."""
    (cold,), cold_wall = child("load", cfg, work / "cold")
    if not cold["built"]:
        sys.exit(f"the cold process did not build (fresh cache {work / 'cold'}?): {cold}")
    warm, warm_spawns = median("load", cfg, work / "cold", runs)
    bare, _ = median("bare", dict(cfg, library=cold["library"]), work / "cold", runs)
    (work / "cpp_ext").mkdir()
    child("cpp_ext", dict(cfg, dir=str(work / "cpp_ext")), work / "unused")  # compile once
    hit, hit_spawns = median("cpp_ext", dict(cfg, dir=str(work / "cpp_ext")), work / "unused",
                             runs)
    imports = [child("import", cfg, work / "cold")[0][0] for _ in range(runs)]
    import_torch = statistics.median(r["import_torch_ms"] for r in imports)
    import_cam_jit = statistics.median(r["import_cam_jit_ms"] for r in imports)
    many, many_wall = child("load", cfg, work / "concurrent", count=concurrent)
    builders = sum(r["built"] for r in many)

    def row(name, value, target, ok):
        print(f"  {name:<44} {value:<34} target {target:<22} {'ok' if ok else 'MISSED'}")

    print("results")
    row("cold build (time in load())", f"{cold['ms'] / 1e3:.1f} s", "<= 15 s",
        cold["ms"] <= 15e3)
    row("warm cam_jit.load() (median)", f"{warm:.2f} ms, {warm_spawns} subprocesses",
        "<= bare + 2 ms, 0 sub.", warm <= bare + 2 and warm_spawns == 0)
    row("bare torch.ops.load_library (median)", f"{bare:.2f} ms", "-", True)
    row("warm - bare", f"{warm - bare:+.2f} ms ({warm / bare:.2f}x)", "<= +2 ms",
        warm - bare <= 2)
    row("cpp_extension.load cache hit (median)",
        f"{hit:.1f} ms, {hit_spawns} subprocesses ({hit / warm:.0f}x warm)", "-", True)
    row("import cam_jit over import torch",
        f"{import_cam_jit:.1f} ms (torch {import_torch:.0f} ms)",
        "<= 50 ms", import_cam_jit <= 50)
    row(f"{concurrent} concurrent cold vs 1 cold (wall)",
        f"{many_wall:.1f} s vs {cold_wall:.1f} s = {many_wall / cold_wall:.2f}x, "
        f"{builders} built", "<= 3x, 1 builder", many_wall <= 3 * cold_wall and builders == 1)
    slowest = max(r["ms"] for r in many)
    row("  same, slowest time in load() vs 1 cold", f"{slowest / 1e3:.1f} s vs "
        f"{cold['ms'] / 1e3:.1f} s = {slowest / cold['ms']:.2f}x", "-", True)
    print(f"  ({concurrent} concurrent `import torch`: median "
          f"{statistics.median(r['import_torch_ms'] for r in many) / 1e3:.1f} s each)")
    print(f"(PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}: "
          "when set, import times include compiling cam_jit's .py files)")


if __name__ == "__main__":
    main()
