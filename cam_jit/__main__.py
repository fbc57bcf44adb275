"""Command line: ``python -m cam_jit {build,clean,doctor,ops}`` (also the ``cam-jit`` script)."""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from typing import List, Optional

from cam_jit import jit
from cam_jit.jit import toolchain


def _build(args: argparse.Namespace) -> int:
    try:
        loaded = jit.load(args.backend)
    except jit.JitError as e:
        print(f"cam_jit: {e}", file=sys.stderr)
        return 1
    print(f"cam_jit: the {loaded.backend} backend was "
          f"{'built' if loaded.built else 'already in the cache'}", file=sys.stderr)
    print(loaded.entry)
    return 0


def _clean(args: argparse.Namespace) -> int:
    removed, skipped = jit.clean(args.backend)
    for entry in removed:
        print(f"removed {entry}")
    for entry, reason in skipped:
        print(f"skipped {entry} ({reason})")
    print(f"{len(removed)} entries removed from {jit.cache_dir()}")
    return 0


def _version_line(args: List[str]) -> str:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"(does not run: {e})"
    return out.strip().splitlines()[0] if out.strip() else "(no version output)"


def _doctor(args: argparse.Namespace) -> int:
    import torch

    import cam_jit

    try:
        import numpy
        numpy_version = numpy.__version__
    except ImportError:
        numpy_version = "not installed (pip install numpy)"
    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} (git {torch.version.git_version})"),
        ("cam_jit", f"{cam_jit.__version__} ({os.path.dirname(cam_jit.__file__)})"),
        ("numpy", numpy_version),
    ]
    compiler = toolchain.find_compiler()
    if compiler is None:
        rows.append(("compiler", toolchain.missing_tool(None, None)))
    else:
        cache = jit.cache_dir()
        version = toolchain.compiler_version(compiler, cache, probe=True).splitlines()[0]
        rows.append(("compiler", f"{compiler.path} ({version})"))
    ninja = toolchain.find_ninja()
    rows.append(("ninja", f"{ninja} ({_version_line([ninja, '--version'])})" if ninja
                 else f"not found; {toolchain.NINJA_HINT}"))
    cache = jit.cache_dir()
    state = ("writable" if os.access(cache, os.W_OK) else "read-only") if cache.is_dir() \
        else "not created yet"
    rows.append(("cache", f"{cache} ({state}; set CAM_JIT_CACHE_DIR to change)"))
    rows.append(("jit", "disabled (CAM_JIT_DISABLE_JIT=1)" if jit.jit_disabled() else "enabled"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")

    entries = jit.list_entries()
    print(f"cache entries: {len(entries)}")
    for e in entries:
        print(f"  {e.backend:<6} {e.key}  {e.size / 1e6:7.2f} MB  "
              f"{'verified' if e.problem is None else 'NOT verified: ' + e.problem}  "
              f"created {e.created or '?'}")

    print("backends:")
    for name, backend in sorted(jit.BACKENDS.items()):
        ok, how = False, backend.unavailable() or "no build spec"
        if backend.make_spec is not None and backend.unavailable() is None:
            try:
                ok, how = jit.status(backend.make_spec())
            except jit.JitError as e:
                how = str(e)
        print(f"  {name:<6} {'available' if ok else 'unavailable'}: {how}")
    return 0


def _ops(args: argparse.Namespace) -> int:
    try:
        from cam_jit.ops import describe_ops
    except ImportError as e:
        print(f"cam_jit: the op registry is not available in this version "
              f"(cam_jit.ops.describe_ops: {e})", file=sys.stderr)
        return 1
    ops = describe_ops()
    width = max((len(op["name"]) for op in ops), default=0)
    for op in ops:
        print(f"{op['name']:<{width}}  {', '.join(op['backends'])}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m cam_jit`` and ``cam-jit``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m cam_jit",
                                     description="cam_jit: JIT-compiled CAM MoE ops for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    backends = sorted(jit.BACKENDS)
    build = commands.add_parser("build", help="pre-build the cache of a backend (default: this "
                                "machine's) and print the entry path")
    build.add_argument("--backend", choices=backends)
    clean = commands.add_parser("clean", help="remove cache entries (all, or of one backend)")
    clean.add_argument("--backend", choices=backends)
    commands.add_parser("doctor", help="show versions, toolchain, cache entries and backends")
    commands.add_parser("ops", help="list the ops and their backends")
    args = parser.parse_args(argv)
    handlers = {"build": _build, "clean": _clean, "doctor": _doctor, "ops": _ops}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
