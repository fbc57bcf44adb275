"""The ``cam-jit`` command line (also ``python -m cam_jit``): its parser, and the commands that
need no torch.

This module sits outside the ``cam_jit`` package on purpose: importing anything inside the
package runs its ``__init__``, which defines the ``torch.ops.cam_jit`` ops and so imports torch
(about 2 s of CPU). ``cam-jit --help``, ``--version``, any ``--help``, ``docs`` and ``ops``
answer from the package's files (its version, the GE converter table, ``docs/semantics.md``)
without it; the other commands import ``cam_jit.__main__``. ``python -m cam_jit`` imports the
package before it starts, so there torch is loaded anyway and ``ops`` also shows which backends
have a kernel (read from torch's dispatcher; ``cam-jit ops --backends`` asks for that column).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import List, Optional

_FAST_COMMANDS = ("docs", "ops")


def _package_dir() -> Path:
    spec = importlib.util.find_spec("cam_jit")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("cam-jit: the cam_jit package is not importable")
    return Path(next(iter(spec.submodule_search_locations)))


def _load(relative: str, checkout: Optional[str] = None) -> ModuleType:
    """A file of the package loaded on its own (``checkout``: its place in a source checkout when
    the installed name is absent), without running the package's __init__."""
    package = _package_dir()
    path = package / relative
    if checkout is not None and not path.exists():
        path = package.parent / checkout
    name = "_cam_jit_cli_" + relative.replace("/", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def version() -> str:
    """cam_jit's version, read from ``cam_jit/_version.py``."""
    return _load("_version.py").__version__


def prog_name() -> str:
    """How the user invoked the command: ``cam-jit`` (the script) or ``python -m cam_jit``."""
    return "cam-jit" if Path(sys.argv[0]).name == "cam-jit" else "python -m cam_jit"


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The parser of every command (backend names are checked by the command, not here)."""
    parser = argparse.ArgumentParser(prog=prog, description="cam_jit: JIT-compiled CAM MoE ops for PyTorch")
    parser.add_argument("--version", action="version", version=f"cam_jit {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    build = commands.add_parser("build", help="pre-build the cache of a backend (default: this "
                                "machine's) and print the entry path")
    build.add_argument("--backend", metavar="NAME", help="cpu or npu (default: this machine's)")
    build.add_argument("--compile-only", action="store_true",
                       help="compile every translation unit of the backend to an object file, "
                       "link and load nothing (for npu: a check against torch_npu's headers, "
                       "usable without an NPU)")
    build.add_argument("--torch-npu-root", metavar="DIR",
                       help="with --compile-only --backend npu: a directory holding torch_npu/ "
                       "(e.g. an extracted torch_npu wheel) instead of the installed torch_npu")
    clean = commands.add_parser("clean", help="remove cache entries (all, or of one backend)")
    clean.add_argument("--backend", metavar="NAME", help="only this backend's entries")
    commands.add_parser("doctor", help="show versions, toolchain, cache entries, backends and "
                        "what the NPU (Ascend) path has and needs")
    ops = commands.add_parser("ops", help="list the ops and whether they have a TorchAir GE converter "
                              "(and which backends have a kernel: --backends, or under python -m)")
    ops.add_argument("--backends", action="store_true", help="also show the backends (CPU, Meta, NPU) "
                     "that have a kernel, read from torch's dispatcher (imports torch)")
    docs = commands.add_parser("docs", help="print the numerical and interface contract of the ops "
                               "(docs/semantics.md), or one numbered section of it")
    docs.add_argument("section", nargs="?", help="a section number, e.g. 1.8 (fused_deep_moe's float32 "
                      "steps); default: the whole document")
    opp_parser = commands.add_parser("opp", help="Ascend operator packages: locate, install, build")
    opp_commands = opp_parser.add_subparsers(dest="opp_command", required=True, metavar="COMMAND")
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
                                        usage=f"{prog} opp build [--install] [--dir DIR]"
                                        " tree [-- build.sh arguments]")
    build_opp.add_argument("tree", help="the kernel source tree (holds build.sh)")
    build_opp.add_argument("--install", action="store_true", help="then install the package")
    build_opp.add_argument("--dir", metavar="DIR", help="install path for --install")
    return parser


def parse(parser: argparse.ArgumentParser, argv: List[str]) -> argparse.Namespace:
    """Parses ``argv``; what follows ``--`` is kept in ``build_args`` (for ``opp build`` only)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.build_args = argv[cut + 1:]
    if cut < len(argv) and (args.command, getattr(args, "opp_command", None)) != ("opp", "build"):
        parser.error("arguments after -- are only for `opp build`")
    return args


def run_docs(args: argparse.Namespace) -> int:
    """``docs [SECTION]``: prints docs/semantics.md or one section of it."""
    docs = _load("docs.py")
    try:
        sys.stdout.write(docs.semantics(args.section))
    except KeyError as e:
        print(f"cam_jit: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


def run_ops(args: argparse.Namespace) -> int:
    """``ops``: one line per op with its GE converter status; with torch loaded (``python -m
    cam_jit``) or ``--backends``, also the backends that have a kernel."""
    if args.backends or "torch" in sys.modules:
        from cam_jit.ops import describe_ops

        rows = [(op["name"], ", ".join(op["backends"]), op["ge_converter"]) for op in describe_ops()]
    else:
        tables = _load("_ge_converters/__init__.py", "ge_converters/__init__.py")
        rows = [(f"cam_jit::{op}", None, "GE converter") for op in tables.CONVERTERS]
        rows += [(f"cam_jit::{op}", None, f"no GE converter: {why}") for op, why in tables.NO_CONVERTER.items()]
    width = max(len(name) for name, _, _ in rows)
    backends = max(len(b or "") for _, b, _ in rows)
    for name, kernels, converter in rows:
        middle = f"  {kernels:<{backends}}" if kernels is not None else ""
        print(f"{name:<{width}}{middle}  {converter}")
    if rows[0][1] is None:
        print(f"(the backends with a kernel come from torch's dispatcher: `{args.prog} ops --backends`)",
              file=sys.stderr)
    return 0


FAST_HANDLERS = {"docs": run_docs, "ops": run_ops}


def _needs_torch(argv: List[str]) -> bool:
    head = argv[:argv.index("--")] if "--" in argv else argv
    if not head or "-h" in head or "--help" in head or "--version" in head:
        return False
    command = next((a for a in head if not a.startswith("-")), None)
    return command not in _FAST_COMMANDS


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``cam-jit`` (and, through cam_jit.__main__, of ``python -m cam_jit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog_name()
    if _needs_torch(argv):
        from cam_jit.__main__ import main as full_main

        return full_main(argv, prog=prog)
    args = parse(build_parser(prog), argv)
    args.prog = prog
    return FAST_HANDLERS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
