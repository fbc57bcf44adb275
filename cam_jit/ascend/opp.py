"""Installed opp (operator package) vendors, the aclnn library search order, and the
FusedDeepMoe prototype installed.

A vendor directory (what a custom opp ``.run`` package installs) holds, among others::

    <vendor>/op_api/lib/libcust_opapi.so                     the aclnn entry points
    <vendor>/op_impl/ai_core/tbe/config/<soc>/aic-<soc>-ops-info.json   op-info: inputs, attrs

Vendors are searched in CANN's own order: each directory of ``ASCEND_CUSTOM_OPP_PATH``
(colon-separated, first wins), then the vendors under ``$ASCEND_OPP_PATH/vendors`` in the order of
``load_priority`` in ``vendors/config.ini``, then CANN's ``libopapi.so``. A vendor directory not
named in ``load_priority`` is not loaded by CANN; it is reported, not searched.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from cam_jit.ascend import registry
from cam_jit.ascend.discover import Cann

CUSTOM_OPP_VAR = "ASCEND_CUSTOM_OPP_PATH"
OPAPI_LIB = Path("op_api") / "lib" / "libcust_opapi.so"
OPS_INFO_GLOB = "op_impl/ai_core/tbe/config/*/aic-*-ops-info.json"


@dataclass(frozen=True)
class Vendor:
    """One opp vendor directory, with where it came from in the search order."""

    name: str
    path: Path
    source: str  # "ASCEND_CUSTOM_OPP_PATH[i]" or "vendors/config.ini load_priority[i]"
    opapi: Optional[Path]  # its libcust_opapi.so, when present
    ops_info: Tuple[Path, ...]  # its op-info JSON files


@dataclass(frozen=True)
class Vendors:
    """The vendors CANN would load, in search order, plus what was seen but skipped."""

    searched: Tuple[Vendor, ...]
    skipped: Tuple[str, ...]  # human-readable notes: missing dirs, unlisted vendors


def vendor_at(path: Path, source: str) -> Vendor:
    """The vendor record of directory ``path`` (``source``: how it was found)."""
    opapi = path / OPAPI_LIB
    return Vendor(path.name, path, source, opapi if opapi.is_file() else None,
                  tuple(sorted(path.glob(OPS_INFO_GLOB))))


def load_priority(config_ini: Path) -> List[str]:
    """Vendor names of ``load_priority=a,b,...`` in a vendors ``config.ini`` (first = highest)."""
    try:
        lines = config_ini.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == "load_priority":
            return [v.strip() for v in value.split(",") if v.strip()]
    return []


def find_vendors(cann: Optional[Cann]) -> Vendors:
    """Every vendor in search order (see the module docstring)."""
    searched: List[Vendor] = []
    skipped: List[str] = []
    custom = [p for p in os.environ.get(CUSTOM_OPP_VAR, "").split(":") if p]
    for i, entry in enumerate(custom):
        path = Path(entry)
        if path.is_dir():
            searched.append(vendor_at(path, f"{CUSTOM_OPP_VAR}[{i}]"))
        else:
            skipped.append(f"{CUSTOM_OPP_VAR}[{i}]={entry} is not a directory")
    opp = cann.opp if cann is not None else None
    if opp is not None:
        vendors_dir = opp / "vendors"
        order = load_priority(vendors_dir / "config.ini")
        for i, name in enumerate(order):
            path = vendors_dir / name
            if path.is_dir():
                searched.append(vendor_at(path, f"vendors/config.ini load_priority[{i}]"))
            else:
                skipped.append(f"load_priority names {name!r} but {path} does not exist")
        if vendors_dir.is_dir():
            for path in sorted(p for p in vendors_dir.iterdir() if p.is_dir()):
                if path.name not in order:
                    skipped.append(f"{path} is not in load_priority of {vendors_dir / 'config.ini'}"
                                   " (CANN does not load it)")
    return Vendors(tuple(searched), tuple(skipped))


def library_search_order(vendors: Vendors, cann: Optional[Cann]) -> List[Path]:
    """The libraries the exec helper tries, in order: vendor ``libcust_opapi.so`` files, then
    CANN's ``libopapi.so``."""
    libs = [v.opapi for v in vendors.searched if v.opapi is not None]
    if cann is not None and cann.opapi is not None:
        libs.append(cann.opapi)
    return libs


def op_info(vendor: Vendor, ge_op: str) -> Optional[dict]:
    """The op-info JSON entry of ``ge_op`` in ``vendor`` (first file that has it), or None."""
    for path in vendor.ops_info:
        try:
            table = json.loads(path.read_text(errors="replace"))
        except (OSError, ValueError):
            continue
        if isinstance(table, dict) and isinstance(table.get(ge_op), dict):
            return table[ge_op]
    return None


def info_inputs(entry: dict) -> List[str]:
    """Input names of an op-info entry (``inputN: {"name": ...}``), in index order."""
    keyed = [(k, v) for k, v in entry.items() if k.startswith("input") and isinstance(v, dict)]
    keyed.sort(key=lambda kv: int(kv[0][5:]) if kv[0][5:].isdigit() else 1 << 30)
    return [str(v.get("name", "")) for _, v in keyed]


def info_attrs(entry: dict) -> List[str]:
    """Attribute names of an op-info entry (``attr: {"list": "a,b"}`` and ``attr_<name>`` keys)."""
    listed = entry.get("attr", {}).get("list", "") if isinstance(entry.get("attr"), dict) else ""
    names = [a.strip() for a in str(listed).split(",") if a.strip()]
    names += [k[5:] for k in entry if k.startswith("attr_") and k[5:] not in names]
    return names


def has_symbol(library: Path, symbol: str) -> bool:
    """Whether ``library``'s bytes contain ``symbol`` as a NUL-terminated name (a cheap check of
    the dynamic symbol table without loading the library)."""
    try:
        return symbol.encode() + b"\0" in library.read_bytes()
    except OSError:
        return False


@dataclass(frozen=True)
class Provider:
    """Where an operator was found: the vendor (None = CANN's libopapi) and its library."""

    vendor: Optional[Vendor]
    library: Path


def find_provider(entry: registry.OpEntry, vendors: Vendors,
                  cann: Optional[Cann]) -> Optional[Provider]:
    """The first library in search order exporting ``entry``'s workspace symbol; for a vendor
    it must also list the GE op in its op-info JSON (the kernel binaries are installed)."""
    symbol = entry.workspace_symbol
    if symbol is None:
        return None
    for vendor in vendors.searched:
        if vendor.opapi is not None and has_symbol(vendor.opapi, symbol) \
                and op_info(vendor, entry.ge_op) is not None:
            return Provider(vendor, vendor.opapi)
    if cann is not None and cann.opapi is not None and has_symbol(cann.opapi, symbol):
        return Provider(None, cann.opapi)
    return None


@dataclass(frozen=True)
class FdmChoice:
    """The FusedDeepMoe prototype to call: ``abi`` in base/w4a8/master (None: not found)."""

    abi: Optional[str]
    how: str


def detect_fdm_abi(vendors: Vendors) -> FdmChoice:
    """The installed aclnnFusedDeepMoe prototype (docs/semantics.md §7.2, §8.1): ``$CAM_JIT_FDM_ABI`` if set
    (ValueError when not one of base/w4a8/master), else from the FusedDeepMoe op-info entry of the
    first vendor that has one: input ``gmm1_bias_optional`` -> w4a8, attribute ``ext_info`` ->
    base, neither -> master."""
    facts = registry.fdm_abi()
    value = os.environ.get(facts.env, "").strip()
    if value:
        if value not in facts.codes:
            raise ValueError(f"{facts.env}: expected one of {', '.join(facts.codes)}, got {value!r}")
        return FdmChoice(value, f"set by {facts.env}")
    ge_op = registry.op("fused_deep_moe").ge_op
    for vendor in vendors.searched:
        entry = op_info(vendor, ge_op)
        if entry is None:
            continue
        where = f"op-info JSON of vendor {vendor.name} ({vendor.path})"
        if facts.w4a8_marker_input in info_inputs(entry):
            return FdmChoice("w4a8", f"{where}: has input {facts.w4a8_marker_input}")
        if facts.base_marker_attr in info_attrs(entry):
            return FdmChoice("base", f"{where}: has attribute {facts.base_marker_attr}")
        return FdmChoice("master", f"{where}: neither input {facts.w4a8_marker_input} nor "
                         f"attribute {facts.base_marker_attr}")
    return FdmChoice(None, f"no vendor's op-info JSON has {ge_op}; set {facts.env}="
                     f"{'|'.join(facts.codes)} to choose the prototype by hand")


# What each FusedDeepMoe package serves. cam_feature's base (SHMEM) OpDef declares no HCCL group
# (no MC2().HcclGroup), so outside the SHMEM branch its kernel finds no communicator; UMDK master's
# OpDef declares one (MC2().HcclGroup({"group_ep"})), as does the w4a8 package.
FDM_SERVES = {
    "base": "FusedDeepMoeBuffer only (its OpDef declares no HCCL group, so a plain call would have "
            "no communicator)",
    "master": "plain W8A8 fused_deep_moe calls (not FusedDeepMoeBuffer: no SHMEM attributes)",
    "w4a8": "plain W4A8 (int32 weight) fused_deep_moe calls",
}
PLAIN_CALL_PACKAGES = ("install UMDK master's FusedDeepMoe package for plain W8A8 calls (for int4 "
                       "weights: the w4a8 package), or call through cam_jit.FusedDeepMoeBuffer")


def vendor_summary(vendors: Vendors) -> List[str]:
    """One line per vendor (search order) and per skipped entry, for ``doctor``."""
    lines = []
    for v in vendors.searched:
        ops = []
        for path in v.ops_info:
            try:
                ops += [k for k in json.loads(path.read_text(errors="replace"))]
            except (OSError, ValueError, TypeError):
                ops.append(f"(unreadable {path.name})")
        lib = v.opapi or f"no {OPAPI_LIB}"
        lines.append(f"{v.name} [{v.source}] {v.path}: {lib}; ops: "
                     f"{', '.join(dict.fromkeys(ops)) or 'none'}")
    lines += [f"skipped: {note}" for note in vendors.skipped]
    return lines
