"""Command line: ``python -m cam_jit {build,clean,doctor,ops,docs,opp}`` (also the ``cam-jit``
script). The parser and the commands that need no torch live in the top-level ``cam_jit_cli``
module, so that ``cam-jit --help``, ``--version``, ``ops`` and ``docs`` answer without importing
torch; this module holds the commands that need the package."""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from typing import List, Optional

import cam_jit_cli
from cam_jit import jit
from cam_jit.jit import toolchain


def _compile_only(args: argparse.Namespace) -> int:
    """``build --compile-only``: compile each translation unit, link and load nothing."""
    from cam_jit.ascend import build

    try:
        if args.backend == "npu":
            spec = build.npu_spec(args.torch_npu_root, runtime_soc=False)
        else:
            spec = jit.backend_spec(args.backend or "cpu")
        results = build.compile_only(spec)
    except jit.JitError as e:
        hint = ("; or pass --torch-npu-root DIR, DIR holding torch_npu/ from its wheel (`unzip "
                "torch_npu-*.whl 'torch_npu/include/*' 'torch_npu/version.py' -d DIR`; do not "
                "install it without CANN)") if args.backend == "npu" and not args.torch_npu_root \
            else ""
        print(f"cam_jit: {e}{hint}", file=sys.stderr)
        return 1
    failed = [r for r in results if r.errors]
    for r in results:
        print(f"{'FAILED' if r.errors else 'ok    '}  {r.source}  ({r.seconds:.1f} s)")
    for r in failed:
        print(f"cam_jit: {r.source} does not compile:", file=sys.stderr)
        for line in r.errors:
            print(f"  {line[:400]}", file=sys.stderr)
        print(f"  command: {r.command}", file=sys.stderr)
    against = (f" ({spec.extra_key['torch_npu']} torch_npu headers from "
               f"{spec.extra_key['torch_npu_dir']})" if spec.backend == "npu" else "")
    print(f"cam_jit: {len(results) - len(failed)}/{len(results)} translation units of the "
          f"{spec.backend} backend compile{against}", file=sys.stderr)
    excluded = build.shmem_part().excluded if spec.backend == "npu" else None
    if excluded:
        print(f"cam_jit: {excluded}", file=sys.stderr)
    return 1 if failed else 0


def _build(args: argparse.Namespace) -> int:
    if args.compile_only:
        return _compile_only(args)
    if args.torch_npu_root:
        print("cam_jit: --torch-npu-root only applies with --compile-only", file=sys.stderr)
        return 2
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
    width = max([6, *(len(e.backend) for e in entries)])
    for e in entries:
        print(f"  {e.backend:<{width}} {e.key}  {e.size / 1e6:7.2f} MB  "
              f"{'verified' if e.problem is None else 'NOT verified: ' + e.problem}  "
              f"created {e.created or '?'}")

    print("backends:")
    width = max([6, *(len(name) for name in jit.BACKENDS)])
    for name, backend in sorted(jit.BACKENDS.items()):
        ok, how = False, backend.unavailable() or "no build spec"
        if backend.make_spec is not None and backend.unavailable() is None:
            try:
                ok, how = jit.status(backend.make_spec())
            except jit.JitError as e:
                how = str(e)
        print(f"  {name:<{width}} {'available' if ok else 'unavailable'}: {how}")

    from cam_jit.ascend import report

    for line in report.lines(report.discover_stack()):
        print(line)
    return 0


def _opp(args: argparse.Namespace) -> int:
    from cam_jit.ascend import opp_install

    try:
        if args.opp_command == "locate":
            found = opp_install.locate(args.dir)
            if not found:
                print("no installed opp vendor holds a CAM operator; install one with "
                      "`python -m cam_jit opp install <package>.run` or build one with "
                      "`python -m cam_jit opp build <kernel source tree>`")
                return 1
            for f in found:
                state = "active" if f.active else f"not active; activate with: {f.activate}"
                print(f"{f.vendor.path} [{f.vendor.source}] ({state}): {', '.join(f.ops)}")
            return 0
        if args.opp_command == "install":
            for vendor in opp_install.install_run(args.package, args.dir):
                print(f"installed {vendor}; activate with: {opp_install.activation(vendor)}")
            return 0
        hint = opp_install.run_only_hint(args.tree, args.build_args)
        if hint:
            print(f"cam_jit: note: {hint}", file=sys.stderr)
        runs = opp_install.build_from_source(args.tree, args.build_args)
        for run in runs:
            print(f"built {run}")
        note = opp_install.shmem_note()
        if note:
            print(f"cam_jit: note: {note}", file=sys.stderr)
        if args.install:
            for vendor in opp_install.install_run(runs[0], args.dir):
                print(f"installed {vendor}; activate with: {opp_install.activation(vendor)}")
        return 0
    except opp_install.OppError as e:
        print(f"cam_jit: {e}", file=sys.stderr)
        return 1


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    """Entry point of ``python -m cam_jit`` (and of the ``cam-jit`` commands that need torch);
    returns the exit status."""
    prog = prog or cam_jit_cli.prog_name()
    parser = cam_jit_cli.build_parser(prog)
    args = cam_jit_cli.parse(parser, list(sys.argv[1:] if argv is None else argv))
    args.prog = prog
    if getattr(args, "backend", None) is not None and args.backend not in jit.BACKENDS:
        parser.error(f"argument --backend: expected one of {', '.join(sorted(jit.BACKENDS))}, got {args.backend!r}")
    handlers = {"build": _build, "clean": _clean, "doctor": _doctor, "opp": _opp, **cam_jit_cli.FAST_HANDLERS}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
