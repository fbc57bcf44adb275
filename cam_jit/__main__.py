"""Command line: ``python -m cam_jit {build,clean,doctor,ops,opp}`` (also the ``cam-jit`` script)."""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from typing import List, Optional

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


def _ops(args: argparse.Namespace) -> int:
    try:
        from cam_jit.ops import describe_ops
    except ImportError as e:
        print(f"cam_jit: the op registry is not available in this version "
              f"(cam_jit.ops.describe_ops: {e})", file=sys.stderr)
        return 1
    ops = describe_ops()
    width = max((len(op["name"]) for op in ops), default=0)
    backends = max((len(", ".join(op["backends"])) for op in ops), default=0)
    for op in ops:
        print(f"{op['name']:<{width}}  {', '.join(op['backends']):<{backends}}  {op['ge_converter']}")
    return 0


def _docs(args: argparse.Namespace) -> int:
    from cam_jit import docs

    try:
        sys.stdout.write(docs.semantics(args.section))
    except KeyError as e:
        print(f"cam_jit: {e.args[0]}", file=sys.stderr)
        return 2
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
    build.add_argument("--compile-only", action="store_true",
                       help="compile every translation unit of the backend to an object file, "
                       "link and load nothing (for npu: a check against torch_npu's headers, "
                       "usable without an NPU)")
    build.add_argument("--torch-npu-root", metavar="DIR",
                       help="with --compile-only --backend npu: a directory holding torch_npu/ "
                       "(e.g. an extracted torch_npu wheel) instead of the installed torch_npu")
    clean = commands.add_parser("clean", help="remove cache entries (all, or of one backend)")
    clean.add_argument("--backend", choices=backends)
    commands.add_parser("doctor", help="show versions, toolchain, cache entries, backends and "
                        "what the NPU (Ascend) path has and needs")
    commands.add_parser("ops", help="list the ops, their backends and whether they have a TorchAir GE converter")
    docs_parser = commands.add_parser("docs", help="print the numerical and interface contract of the "
                                      "ops (docs/semantics.md), or one numbered section of it")
    docs_parser.add_argument("section", nargs="?", help="a section number, e.g. 1.8 (fused_deep_moe's "
                             "float32 steps); default: the whole document")
    opp_parser = commands.add_parser("opp", help="Ascend operator packages: locate, install, build")
    opp_commands = opp_parser.add_subparsers(dest="opp_command", required=True)
    locate = opp_commands.add_parser("locate", help="list installed vendors holding CAM operators")
    locate.add_argument("--dir", action="append", default=[], metavar="DIR",
                        help="also look in DIR/vendors/* (repeatable)")
    install = opp_commands.add_parser("install", help="install a .run package into a vendor "
                                      "directory you own")
    install.add_argument("package", help="the custom opp .run file")
    install.add_argument("--dir", metavar="DIR", help="install path (default $CAM_JIT_OPP_DIR "
                         "or ~/.local/share/cam_jit/opp)")
    build_opp = opp_commands.add_parser("build", help="build a .run package with a kernel source "
                                        "tree's own build.sh (arguments after -- go to it)",
                                        usage="python -m cam_jit opp build [--install] [--dir DIR]"
                                        " tree [-- build.sh arguments]")
    build_opp.add_argument("tree", help="the kernel source tree (holds build.sh)")
    build_opp.add_argument("--install", action="store_true", help="then install the package")
    build_opp.add_argument("--dir", metavar="DIR", help="install path for --install")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.build_args = argv[cut + 1:]  # for `opp build`: passed to the tree's build.sh
    if cut < len(argv) and (args.command, getattr(args, "opp_command", None)) != ("opp", "build"):
        parser.error("arguments after -- are only for `opp build`")
    handlers = {"build": _build, "clean": _clean, "doctor": _doctor, "ops": _ops, "opp": _opp,
                "docs": _docs}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
