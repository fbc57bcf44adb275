"""The NPU readiness report of ``python -m cam_jit doctor``: the stack found, then one verdict per
registry operator (ready / why not / how to fix)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from cam_jit.ascend import build, discover, opp, registry

INSTALL_FIX = ("install an opp package that contains it: `python -m cam_jit opp install "
               "<package>.run`, or build one with `python -m cam_jit opp build <kernel source tree>`"
               " (see `python -m cam_jit opp locate`)")


@dataclass(frozen=True)
class Stack:
    """Everything discovered once, shared by all verdicts."""

    torch_npu: discover.TorchNpu
    cann: discover.Cann
    soc: discover.Soc
    shmem: discover.Shmem
    vendors: opp.Vendors
    fdm: opp.FdmChoice


@dataclass
class Verdict:
    """An operator's readiness: ``stack`` names what blocks every operator (no torch_npu, CANN,
    NPU), ``problems`` are its own (why, fix) pairs; none at all means ready."""

    op: registry.OpEntry
    provider: Optional[opp.Provider] = None
    stack: List[str] = field(default_factory=list)
    problems: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not self.stack and not self.problems


def discover_stack(runtime_soc: bool = True) -> Stack:
    """Discover the stack (``runtime_soc``: ask torch_npu's runtime for the SoC when present)."""
    cann = discover.find_cann()
    vendors = opp.find_vendors(cann)
    try:
        fdm = opp.detect_fdm_abi(vendors)
    except ValueError as e:
        fdm = opp.FdmChoice(None, str(e))
    return Stack(discover.find_torch_npu(), cann, discover.find_soc(runtime_soc),
                 discover.find_shmem(), vendors, fdm)


def stack_problems(stack: Stack) -> List[str]:
    """Short names of what blocks every operator (the stack rows of :func:`lines` say why and
    how to fix): torch_npu, CANN, the NPU itself."""
    out = []
    if stack.torch_npu.problem:
        out.append("torch_npu " + ("not importable" if stack.torch_npu.root is None
                                   else "does not match torch"))
    if stack.cann.home is None:
        out.append("CANN not found")
    if stack.soc.name is None:
        out.append("no NPU visible")
    return out


SHMEM_FIX = "install SHMEM and set SHMEM_HOME_PATH (before building the package and at run time)"
VARIANT_FIX = ("install the package of the FusedDeepMoe variant you need (base, w4a8 and master "
               "exclude each other), or set CAM_JIT_FDM_ABI if detection is wrong")
BINDING_FIX = "call it through TorchAir/GE (cam_jit has no torch op for it)"


def verdict(entry: registry.OpEntry, stack: Stack) -> Verdict:
    """Why ``entry`` can or cannot run here: short reasons, each with its fix."""
    v = Verdict(entry, stack=stack_problems(stack))
    if entry.torch_op is None:
        v.problems.append(("no cam_jit binding (aclnn/GE only)", BINDING_FIX))
    if stack.soc.name is not None and stack.soc.name not in entry.socs:
        v.problems.append((f"not configured for {stack.soc.name} (its OpDef: "
                           f"{', '.join(entry.socs)})", "run on a supported SoC"))
    if entry.requires_shmem and stack.shmem.problem:
        v.problems.append(("needs SHMEM, not found", SHMEM_FIX))
    if entry.family == "fused_deep_moe" and stack.fdm.abi not in (None, entry.variant):
        v.problems.append((f"the installed FusedDeepMoe is the {stack.fdm.abi} variant",
                           VARIANT_FIX))
        return v
    if entry.aclnn is not None:
        v.provider = opp.find_provider(entry, stack.vendors, stack.cann)
        if v.provider is None:
            v.problems.append((f"no installed package provides {entry.aclnn} ({entry.ge_op})",
                               INSTALL_FIX))
    return v


def _row(name: str, value: str) -> str:
    return f"  {name:<10} {value}"


def lines(stack: Stack) -> List[str]:
    """The ``doctor`` section: stack, vendors, search order, per-op verdicts, and a summary of
    what is needed when nothing is ready."""
    t, c, s, sh = stack.torch_npu, stack.cann, stack.soc, stack.shmem
    out = ["ascend (NPU path):"]
    out.append(_row("torch_npu", f"{t.version} at {t.root}" + (f" -- {t.problem}" if t.problem else "")
                    if t.root else t.problem))
    out.append(_row("CANN", f"{c.version or '(version unknown)'} at {c.home} (from {c.source})"
                    if c.home else c.problem))
    if c.home is not None:
        out.append(_row("opp", str(c.opp) if c.opp else f"no opp directory under {c.home} and "
                        "ASCEND_OPP_PATH unset"))
    out.append(_row("NPU", f"{s.device_name} -> SoC {s.name} (from {s.source})" if s.name
                    else f"none visible (SoC {s.source}); run on an Ascend NPU machine, or set "
                    f"{discover.SOC_ENV}=ascend910_93 to check a configuration without one"))
    out.append(_row("SHMEM", f"{sh.home} ({sh.library})" if not sh.problem else sh.problem))
    out.append(_row("", build.shmem_part().excluded or f"{build.SHMEM_FEATURE}: included in the NPU build"))
    vendor_lines = opp.vendor_summary(stack.vendors)
    out.append(_row("vendors", "none found" if not vendor_lines else vendor_lines[0]))
    out += [_row("", line) for line in vendor_lines[1:]]
    order = opp.library_search_order(stack.vendors, c)
    out.append(_row("search", " -> ".join(str(p) for p in order) if order
                    else "no aclnn library to search (no vendor libcust_opapi.so, no libopapi.so)"))
    out.append(_row("FDM ABI", f"{stack.fdm.abi or 'unknown'} ({stack.fdm.how})"))
    if stack.fdm.abi is not None:
        out.append(_row("", f"serves {opp.FDM_SERVES[stack.fdm.abi]}"))
    if stack.fdm.abi == "base":
        out.append(_row("", f"plain calls: {opp.PLAIN_CALL_PACKAGES}"))
    blockers = stack_problems(stack)
    if blockers:
        out.append(_row("BLOCKED", f"{', '.join(blockers)} (see above): no operator can run"))
    out.append("  operators (registry kernels/operator_registry.json)"
               + (", besides the BLOCKED line:" if blockers else ":"))
    verdicts = [verdict(e, stack) for e in registry.ops().values()]
    width = max(len(v.op.name) for v in verdicts)
    fixes: List[str] = []
    for v in verdicts:
        if v.ready:
            where = v.provider.vendor.name if v.provider and v.provider.vendor else "CANN libopapi"
            out.append(f"    {v.op.name:<{width}}  ready ({v.op.aclnn} from {where})")
            continue
        reasons = "; ".join(why for why, _ in v.problems) or "only the BLOCKED line above"
        out.append(f"    {v.op.name:<{width}}  not ready: {reasons}")
        fixes += [fix for _, fix in v.problems if fix not in fixes]
    if fixes:
        out.append("  how to fix:")
        out += [f"    - {fix}" for fix in fixes]
    if not any(v.ready for v in verdicts):
        out.append("  no NPU operator can run here. The NPU path needs: an Ascend NPU "
                   "(ascend910_93 / ascend910b), CANN (ASCEND_HOME_PATH), torch_npu matching torch, "
                   "an opp package with the CAM operators (python -m cam_jit opp ...), and SHMEM "
                   "for the operators that need it. On this machine the ops run on CPU.")
    return out
