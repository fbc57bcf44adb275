"""The NPU stand-in for tests: the simulated opapi library, the wrapper library built for CPU
tensors, and the executing kernels.

* :func:`build_sim` compiles ``sim_opapi.c`` (one variant per set of macros) and :class:`Sim`
  drives it with ctypes: its call log, live handle count, statuses, and the kernel callback.
* :func:`build_harness` builds the real ``wrappers/*.cpp`` (minus the torch_npu runtime) with
  ``test_runtime.cpp`` into the op namespace ``_cam_jit_npu_test``, ``zb_shmem.cpp`` included and
  linked to the stand-in SHMEM (``shmem/include/shmem.h``, ``sim_shmem.c``).
* :func:`executing` makes a Sim's launches run :data:`KERNELS`: each rebuilds its arguments from
  nothing but the ACL descriptors the wrapper passed (data address, dtype, view shape, strides,
  storage offset, format, storage dims: :func:`tensor_of`), checks them as the device kernel would
  read them, and computes the outputs with the CPU backend's op (the same arithmetic), writing them
  through the output descriptors. A failed check returns an error status whose text is the one
  ``aclGetRecentErrMsg`` gives.

Communicators: the kernels look ``group_ep`` up as an HCCL communicator name. :func:`hccl_comm_name`
stands in for torch_npu's ``get_hccl_comm_name`` and registers the names it hands out; a kernel
given any other string fails, as the real tiling does. The stand-in's transport is the CPU op's:
torch.distributed on the group the name was made for. The SHMEM heap of a FusedDeepMoeBuffer is
the stand-in SHMEM's host allocations (:func:`use_shmem`).

An aclnn function added to ``sim_opapi.c`` gets its executing kernel by adding an entry to
:data:`KERNELS` (aclnn name -> function of the decoded argument list).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch

SIM_DIR = Path(__file__).resolve().parent
REPO = SIM_DIR.parents[1]
WRAPPERS = REPO / "wrappers"
NS = "_cam_jit_npu_test"
STREAM = 0x5EED  # test_runtime.cpp's stream sentinel
ND, NZ = 2, 29  # aclFormat
ACL_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.int8, 3: torch.int32, 4: torch.uint8,
              6: torch.int16, 9: torch.int64, 11: torch.float64, 12: torch.bool, 27: torch.bfloat16}
NZ_FRACTAL = {torch.int8: (16, 32)}  # rows x columns of one fractal: [K, N] -> [N/32][K/16][16][32]
KERNEL_FAILED = 561103  # the status a stand-in kernel returns when its checks fail
EXT_INFO_BYTES = 2 * 1024 * 1024


class StandinError(RuntimeError):
    """What the device kernel would do wrong (or refuse) with the arguments it was given."""


def compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("the NPU stand-in needs a C compiler (cc or gcc) on PATH")
    return cc


def build_sim(out_dir: Path, name: str, *flags: str) -> Path:
    """``sim_opapi.c`` compiled with ``flags`` to ``<out_dir>/libsim_<name>.so``."""
    path = Path(out_dir) / f"libsim_{name}.so"
    subprocess.run([compiler(), "-shared", "-fPIC", "-O1", *flags, "-o", str(path),
                    str(SIM_DIR / "sim_opapi.c")], check=True, capture_output=True)
    return path


def build_sims(out_dir: Path, variants: Dict[str, Sequence[str]]) -> Dict[str, "Sim"]:
    """One :class:`Sim` per variant name, each built with its macro flags."""
    return {name: Sim(build_sim(out_dir, name, *flags)) for name, flags in variants.items()}


def shmem_library() -> Path:
    """The stand-in SHMEM library, compiled once per content into a per-user temporary directory
    (a stable path, so the harness linking it stays cached by the JIT engine across sessions)."""
    sources = (SIM_DIR / "sim_shmem.c", SIM_DIR / "shmem" / "include" / "shmem.h")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"cam_jit_npu_sim_{os.getuid()}" / digest / "libshmem.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"libshmem.{os.getpid()}.so")
        subprocess.run([compiler(), "-shared", "-fPIC", "-O1", f"-I{sources[1].parent}", "-o", str(partial),
                        str(sources[0])], check=True, capture_output=True)
        os.replace(partial, path)
    return path


KernelFn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_char_p, ctypes.c_char_p)


class Sim:
    """One build of the simulated opapi, with its control functions."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.sim_log.restype = ctypes.c_char_p
        self.lib.sim_live_handles.restype = ctypes.c_long
        self.lib.sim_set_workspace.argtypes = [ctypes.c_uint64]
        self.lib.sim_set_kernel.argtypes = [KernelFn]
        self.lib.sim_set_error.argtypes = [ctypes.c_char_p]
        self.lib.sim_reset()

    def calls(self) -> List[dict]:
        return [json.loads(line) for line in self.lib.sim_log().decode().splitlines()]

    def live(self) -> int:
        return self.lib.sim_live_handles()


def build_harness():
    """The wrapper library for tests (cached by the JIT engine like any backend), with the SHMEM
    heap wrapper linked to the stand-in SHMEM (:func:`shmem_library`). Returns (the op namespace,
    the library as ctypes); the stand-in SHMEM is loaded for the kernels' checks too."""
    from cam_jit import jit

    shmem = shmem_library()
    sources = [p for p in sorted(WRAPPERS.glob("*.cpp")) if p.name != "npu_runtime.cpp"]
    spec = jit.BuildSpec(backend="npu_sim", name="cam_jit_npu_test", root=REPO,
                         sources=(*sources, SIM_DIR / "test_runtime.cpp"),
                         headers=(*sorted(WRAPPERS.glob("*.h")), SIM_DIR / "shmem" / "include" / "shmem.h"),
                         include_dirs=(WRAPPERS,),
                         cflags=("-O0", f"-DCAM_JIT_NPU_NS={NS}", "-DCAM_JIT_WITH_SHMEM",
                                 f"-I{SIM_DIR / 'shmem' / 'include'}"),
                         ldflags=("-ldl", f"-L{shmem.parent}", "-lshmem", f"-Wl,-rpath,{shmem.parent}"))
    lib = ctypes.CDLL(str(jit.load_spec(spec).library))
    lib.cam_jit_test_set_storage_format.argtypes = [
        ctypes.c_size_t, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), ctypes.c_uint64]
    lib.cam_jit_test_run_queue.restype = ctypes.c_int64
    lib.cam_jit_test_queue_error.restype = ctypes.c_char_p
    use_shmem(shmem)
    return getattr(torch.ops, NS), lib


def tag_format(lib, t: torch.Tensor, fmt: int, storage_dims: Sequence[int]) -> None:
    """Makes the test runtime report ``t``'s storage as format ``fmt`` with ``storage_dims``."""
    dims = (ctypes.c_int64 * len(storage_dims))(*storage_dims)
    lib.cam_jit_test_set_storage_format(t.untyped_storage().data_ptr(), fmt, dims, len(storage_dims))


# ---- descriptors -> tensors ------------------------------------------------------------------
def _flat(data: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if not data:
        raise StandinError(f"a {count}-element {dtype} storage with a null data address")
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    buffer = (ctypes.c_char * nbytes).from_address(data)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)


def tensor_of(desc: dict) -> torch.Tensor:
    """The tensor an aclTensor descriptor describes, read as a device kernel reads it: ND views
    share the memory (outputs are written through them); a FRACTAL_NZ operand is un-blocked into a
    logical [K, N] copy."""
    dtype = ACL_DTYPES[desc["dtype"]]
    shape, strides, offset, storage = desc["shape"], desc["strides"], desc["offset"], desc["storage"]
    count = 1
    for d in storage:
        count *= d
    flat = _flat(desc["data"], dtype, count)
    if desc["format"] == NZ:
        rows, cols = NZ_FRACTAL.get(dtype, (None, None))
        if rows is None or len(shape) != 2 or len(storage) != 4:
            raise StandinError(f"FRACTAL_NZ operand {shape} {dtype} with storage dims {storage}")
        k, n = shape
        if storage != [n // cols, k // rows, rows, cols] or k % rows or n % cols:
            raise StandinError(f"FRACTAL_NZ storage dims {storage} do not hold a [{k}, {n}] {dtype} matrix "
                               f"(expected [{n // cols}, {k // rows}, {rows}, {cols}])")
        return flat.view(storage).permute(1, 2, 0, 3).reshape(k, n)
    if desc["format"] != ND:
        raise StandinError(f"operand format {desc['format']} (only ND and FRACTAL_NZ are read)")
    if any(d < 0 for d in shape) or any(s < 0 for s in strides) or offset < 0:
        raise StandinError(f"negative size, stride or offset: {shape} {strides} {offset}")
    last = offset + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else offset - 1
    if last >= count:
        raise StandinError(f"view {shape} strides {strides} offset {offset} reaches element {last} "
                           f"of a {count}-element storage")
    return flat.as_strided(shape, strides, offset)


def decode(record: dict) -> list:
    """The arguments of one logged GetWorkspaceSize call: tensors (:func:`tensor_of`), None, lists
    of tensors, ints and strings."""
    def one(a):
        if a is None:
            return None
        if a["kind"] == "tensor":
            return tensor_of(a)
        if a["kind"] == "list":
            return [tensor_of(t) for t in a["items"]]
        return a["value"]

    return [one(a) for a in record["args"]]


# ---- communicators ---------------------------------------------------------------------------
COMMUNICATORS: Dict[str, str] = {}  # HCCL name -> torch process group name
SHMEM: List[ctypes.CDLL] = []  # the stand-in SHMEM library, once loaded (:func:`use_shmem`)


def use_shmem(path: Path) -> ctypes.CDLL:
    """Loads the stand-in SHMEM library (the one the harness links: the same instance) for the
    kernels' checks and the tests."""
    lib = ctypes.CDLL(str(path))
    lib.sim_shmem_log.restype = ctypes.c_char_p
    lib.sim_shmem_live.restype = ctypes.c_long
    SHMEM[:] = [lib]
    return lib


def shmem_calls() -> List[dict]:
    return [json.loads(line) for line in SHMEM[0].sim_shmem_log().decode().splitlines()] if SHMEM else []


def _live_allocations() -> Dict[int, int]:
    """Address -> size of the stand-in SHMEM's allocations not freed yet."""
    live: Dict[int, int] = {}
    for call in shmem_calls():
        if call["fn"] == "aclshmem_malloc" and call["ptr"]:
            live[call["ptr"]] = call["size"]
        elif call["fn"] == "aclshmem_free":
            live.pop(call["ptr"], None)
    return live


def hccl_comm_name(group, rank: int) -> str:
    """Stands in for ``ProcessGroupHCCL.get_hccl_comm_name(rank)``: one name per group."""
    name = f"hccl_comm:{group.group_name}"
    COMMUNICATORS[name] = group.group_name
    return name


def _torch_group(op: str, group_ep: str) -> str:
    if group_ep not in COMMUNICATORS:
        raise StandinError(f"{op}: no HCCL communicator named {group_ep!r} (known: {sorted(COMMUNICATORS)})")
    return COMMUNICATORS[group_ep]


def _store(op: str, outputs: Sequence[torch.Tensor], results: Sequence[torch.Tensor]) -> None:
    for i, (out, value) in enumerate(zip(outputs, results)):
        if tuple(out.shape) != tuple(value.shape) or out.dtype != value.dtype:
            raise StandinError(f"{op}: output {i} is {list(out.shape)} {out.dtype}, the kernel writes "
                               f"{list(value.shape)} {value.dtype}")
        out.copy_(value)


# ---- kernels ---------------------------------------------------------------------------------
def fused_deep_moe(args: list) -> None:
    """aclnnFusedDeepMoe, any of the three prototypes (told apart by argument count: base 26,
    w4a8 27, master 23). The base prototype runs only as FusedDeepMoeBuffer's SHMEM call: its OpDef
    declares no HCCL group, so with ext_info == 0 it has no communicator."""
    op = "aclnnFusedDeepMoe"
    inputs, rest = args[:14], args[14:]
    biases = [[], [], None, None]
    if len(args) == 27:
        biases, rest = rest[:4], rest[4:]
    group, ranks, rank, experts, quant, global_bs = rest[:6]
    outputs = rest[-3:]
    if len(args) == 26:
        ext_info, workspace, workspace_size = rest[6:9]
        if ext_info == 0:
            raise StandinError(f"{op} (base package) without SHMEM attributes: its OpDef declares no HCCL "
                               f"group, so the kernel has no communicator for {group!r}")
        live = _live_allocations()
        if live.get(ext_info) != EXT_INFO_BYTES or live.get(workspace) != workspace_size:
            raise StandinError(f"{op}: ext_info {ext_info:#x}, shmem_workspace {workspace:#x} of "
                               f"{workspace_size} bytes are not this PE's SHMEM allocations {live}")
        torch_group = ""
    elif len(args) in (23, 27):
        torch_group = _torch_group(op, group)
    else:
        raise StandinError(f"{op}: {len(args)} arguments match no prototype")
    results = torch.ops.cam_jit.fused_deep_moe(*inputs, *biases, torch_group, ranks, rank, experts, quant,
                                               global_bs)
    _store(op, outputs, results)


def a2e(args: list) -> None:
    """aclnnA2e: on an attention rank the kernel copies batch * hiddenSize elements of x (and of
    the ids and scales with computeGate) to its expert rank."""
    x, ids, scales, batch, hidden, topk, experts, attention, rank, group, aiv, gate = args[:12]
    if rank >= experts:
        if batch > x.shape[0]:
            raise StandinError(f"aclnnA2e on attention rank {rank}: batchSize {batch} but x has {x.shape[0]} "
                               f"rows: the kernel would read {(batch - x.shape[0]) * hidden} elements past x")
        x = x[:batch]
        ids = ids[:batch] if ids is not None else None
        scales = scales[:batch] if scales is not None else None
    results = torch.ops.cam_jit.a2e(x, ids, scales, batch, hidden, topk, experts, attention, rank,
                                    _torch_group("aclnnA2e", group), aiv, gate)
    _store("aclnnA2e", args[12:], results)


def e2a(args: list) -> None:
    """aclnnE2a: on an attention rank the kernel writes batch * hiddenSize elements of out."""
    expand_x, batches, batch, hidden, topk, experts, attention, rank, group, aiv, out = args
    if rank >= experts:
        if batch > out.shape[0] or batch > expand_x.shape[0]:
            raise StandinError(f"aclnnE2a on attention rank {rank}: batchSize {batch} but out has {out.shape[0]} "
                               f"rows: the kernel would write {(batch - out.shape[0]) * hidden} elements past out")
        expand_x = expand_x[:batch]
    result = torch.ops.cam_jit.e2a(expand_x, batches, batch, hidden, topk, experts, attention, rank,
                                   _torch_group("aclnnE2a", group), aiv)
    _store("aclnnE2a", [out], [result])


# UMDK master's prefill kernels (ascend_kernels/{dispatch_layout,notify_dispatch,moe_dispatch_normal,
# moe_combine_normal}/op_kernel/*.h): what each reads, and the checks of their op_host tilings.
AIV_CORES = 48  # vector cores of an ascend910_93 die: the layout kernel's scratch holds one [E] row per core


def _require(op: str, ok: bool, what: str) -> None:
    if not ok:
        raise StandinError(f"{op}: {what}")


def _process_group(op: str, group: str, ranks: int, rank: int):
    from cam_jit.ops.groups import resolve_group

    name = _torch_group(op, group)
    return "" if ranks == 1 else resolve_group(op, name, ranks, rank)


def dispatch_layout(args: list) -> None:
    """aclnnDispatchLayout: reads topkIdx as int64 and indexes its counters by every id (no -1)."""
    op = "aclnnDispatchLayout"
    topk, tokens, ranks, experts, k, local_ranks, per_rank, per_expert, in_rank, scratch, token_idx = args
    _require(op, topk.dtype == torch.int64 and list(topk.shape) == [tokens, k], f"topkIdx {topk.dtype} "
             f"{list(topk.shape)}, the kernel reads int64 [numTokens={tokens}, numTopk={k}]")
    _require(op, not topk.numel() or int(topk.min()) >= 0, "an id of -1 indexes its counters out of bounds")
    _require(op, scratch.numel() >= AIV_CORES * experts, f"notifySendData of {scratch.numel()} ints, the "
             f"kernel writes {AIV_CORES} x numExperts")
    results = torch.ops.cam_jit.moe_dispatch_layout(topk, experts, ranks)
    _store(op, [per_rank, per_expert, in_rank, token_idx], results)


def notify_dispatch(args: list) -> None:
    """aclnnNotifyDispatch: sends 3 ints per expert (sendCount = 3 * E) to the experts' ranks."""
    op = "aclnnNotifyDispatch"
    (send_data, per_expert, send_count, tokens, group, ranks, rank, local_ranks, local_rank, send_offset,
     recv_data, total, recv_count, recv_offset, max_bs, recv_per_expert) = args
    experts = per_expert.shape[0]
    _require(op, send_count == 3 * experts and send_data.numel() >= send_count and recv_data.numel() >= send_count,
             f"sendCount {send_count}, sendData {send_data.numel()}, recvData {recv_data.numel()} ints for "
             f"{experts} experts (3 each)")
    _require(op, local_ranks > 0 and ranks % local_ranks == 0 and local_rank == rank % local_ranks,
             f"localRankSize {local_ranks} / localRankId {local_rank} for rank {rank} of {ranks}")
    results = torch.ops.cam_jit.moe_notify_dispatch(per_expert, tokens, _torch_group(op, group), ranks, rank)
    _store(op, [send_offset, recv_offset, recv_count, total, max_bs, recv_per_expert], results)


def dispatch_normal(args: list) -> None:
    """aclnnMoeDispatchNormal: writes recvCount[-1] rows; assist info is 1-D (tiling)."""
    op = "aclnnMoeDispatchNormal"
    (x, topk, send_offset, token_idx, recv_offset, recv_count, group, ranks, rank, group_tp, tp_size, tp_rank,
     experts, quant, global_bs, recv_x, scales, assist, stats) = args
    rows = int(recv_count[-1])
    _require(op, topk.dtype == torch.int32, f"topk_idx {topk.dtype}, the kernel reads int32")
    _require(op, assist.dim() == 1 and assist.numel() >= 3 * rows and recv_x.shape[0] >= rows
             and scales.shape[0] >= rows, f"outputs recv_x {list(recv_x.shape)}, x_scales {list(scales.shape)}, "
             f"assist_info_for_combine {list(assist.shape)} (1-D) for {rows} rows")
    _require(op, 0 <= tp_size <= 2 and global_bs >= x.shape[0] * ranks, f"tp_world_size {tp_size}, global_bs "
             f"{global_bs} (the window reserves global_bs / R tokens per rank; this rank has {x.shape[0]})")
    results = torch.ops.cam_jit.moe_dispatch_normal(x, topk, send_offset, token_idx, recv_offset, recv_count,
                                                    _torch_group(op, group), ranks, rank, experts, quant, global_bs,
                                                    rows)
    _store(op, [recv_x[:rows], scales[:rows], assist[:3 * rows].view(rows, 3)], results)


def combine_normal(args: list) -> None:
    """aclnnMoeCombineNormal: each row goes back to (source rank, token, k) of its assist triple;
    a token's output waits for all K of its results (an unfilled slot would hang the kernel), and is
    the float32 sum over k ascending (cam_jit.reference.moe_normal, all ids routed)."""
    from cam_jit.reference import moe_normal as reference

    op = "aclnnMoeCombineNormal"
    (recv_x, src_info, recv_counts, weights, tp_counts, group, ranks, rank, group_tp, tp_size, tp_rank, experts,
     global_bs, out, stats) = args
    rows = int(recv_counts[-1])
    _require(op, src_info.dim() == 1 and src_info.numel() >= 3 * rows and recv_counts.shape[0] == experts,
             f"tokenSrcInfo {list(src_info.shape)} (1-D, 3 per row) and epRecvCounts {list(recv_counts.shape)} "
             f"for {rows} rows and {experts} experts")
    process_group = _process_group(op, group, ranks, rank)
    assist = src_info[:3 * rows].view(rows, 3)
    routed = torch.zeros(weights.shape, dtype=torch.int32)  # every slot awaited
    filled = reference.combine_normal(torch.ones(rows, 1, dtype=torch.float32), assist, routed,
                                      torch.ones(weights.shape), process_group, ranks, rank)
    _require(op, bool((filled == weights.shape[1]).all()), "a (token, k) slot gets no result: the kernel would "
             "wait for it forever")
    result = reference.combine_normal(recv_x[:rows], assist, routed, weights, process_group, ranks, rank)
    _store(op, [out], [result])


KERNELS: Dict[str, Callable[[list], None]] = {
    "aclnnFusedDeepMoe": fused_deep_moe, "aclnnA2e": a2e, "aclnnE2a": e2a,
    "aclnnDispatchLayout": dispatch_layout, "aclnnNotifyDispatch": notify_dispatch,
    "aclnnMoeDispatchNormal": dispatch_normal, "aclnnMoeCombineNormal": combine_normal,
}


@contextmanager
def executing(sim: Sim):
    """Within the block, ``sim``'s launches run :data:`KERNELS` on the recorded descriptors."""
    def kernel(aclnn: bytes, record: bytes) -> int:
        name = aclnn.decode()
        try:
            KERNELS[name](decode(json.loads(record)))
        except Exception as e:  # noqa: BLE001 - reported through the aclnn status and message
            text = f"stand-in {name}: {type(e).__name__}: {e}"
            if not isinstance(e, StandinError):
                text += "\n" + traceback.format_exc(limit=4)
            sim.lib.sim_set_error(text.encode())
            return KERNEL_FAILED
        return 0

    callback = KernelFn(kernel)
    sim.lib.sim_set_kernel(callback)
    try:
        yield sim
    finally:
        sim.lib.sim_set_kernel(KernelFn())
