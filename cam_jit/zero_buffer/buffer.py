"""`FusedDeepMoeBuffer`: the zero-buffer (SHMEM) variant of W8A8 `fused_deep_moe` (docs/semantics.md §5).

On CPU the symmetric heap is one POSIX shared-memory segment per rank (`_heap`), and tokens
travel by direct stores into the peers' segments (`_transport`). The math is fused_deep_moe's
(§1.8), computed by the same JIT-compiled kernels in the same order, so results are bit-identical
to `cam_jit.fused_deep_moe`; only the transport differs. On the NPU (torch_npu with a device) the
heap is Ascend SHMEM's and a call is the NPU fused_deep_moe kernel with the heap's addresses
(`_npu`).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from cam_jit.ops import _checks as check
from cam_jit.ops import _exchange, _moe_cpu
from cam_jit.ops._kernels import cpu_kernels
from cam_jit.ops._strict import strict_enabled
from cam_jit.ops.fused_deep_moe import Layout, _check_expert_ids, agreed_values, shared_expert_output, validate
from cam_jit.zero_buffer import _strict
from cam_jit.zero_buffer._heap import EXT_INFO_BYTES, Heap, parse_ip_port
from cam_jit.zero_buffer._npu import NPU_DEVICE, NpuHeap, npu_present
from cam_jit.zero_buffer._transport import MAX_RANKS, Geometry, Transport

CLASS = "FusedDeepMoeBuffer"
DEVICES = ("cpu", NPU_DEVICE)
OP = f"{CLASS}.zb_fused_deep_moe"
_INVALID, _OVER_CAPACITY = -1, -2  # reject codes (see _transport.REJECTED)

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


class FusedDeepMoeBuffer:
    """Communication resources for `zb_fused_deep_moe`: a symmetric heap shared by the ranks of
    one host (docs/semantics.md §5.1). Usage, on every rank::

        buf = cam_jit.FusedDeepMoeBuffer()
        buf.init(rank, num_ranks, memsize, "tcp://127.0.0.1:29600")
        output, share_output, expert_token_nums = buf.zb_fused_deep_moe(...)
        buf.close()  # or `with buf:`; garbage collection and process exit release it too

    Several buffers may live in one process (each has its own segments); every rank must create
    and use them in the same order. Not thread-safe: one call at a time per buffer.
    """

    def __init__(self) -> None:
        self._heap: Optional[Heap] = None
        self._transport: Optional[Transport] = None
        self._timeout: Optional[float] = None
        self._npu: Optional[NpuHeap] = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def init(self, rank: int, num_ranks: int, memsize: int, ip_port: str, *, timeout: Optional[float] = None,
             device: Optional[str] = None) -> None:
        """Creates this rank's shared-memory segment and maps every peer's; collective over
        the num_ranks ranks, which must run on one host. A second call on an initialised buffer
        is a silent no-op (as upstream).

        Args:
            rank: this rank, in [0, num_ranks).
            num_ranks: R, the ranks of the expert-parallel group (every rank's ep_rank_size).
            memsize: bytes of this rank's segment, > 2 MiB: the 2 MiB ext-info region, then the
                workspace (memsize - 2 MiB). The segment is sparse: only touched pages use memory.
                A call needs memsize >= 2 MiB + R * P * (ceil16(H + 16) + H * x.element_size()),
                P = the most (token, expert) pairs one rank sends to one rank (<= BS * K); a call
                that needs more is refused on every rank, naming the memsize it needs. Strict
                mode also applies the NPU's workspace formula (docs/semantics.md §5.2).
            ip_port: "tcp://host:port" where rank 0 listens for the rendezvous (any free port; see
                cam_jit.ops._rendezvous for who may join).
            timeout: seconds a rank waits for its peers, in init and in every call (default:
                CAM_JIT_COMM_TIMEOUT, 300). A dead peer is noticed within ~50 ms. CPU only (SHMEM
                has its own timeouts).
            device: "cpu" (the shared-memory heap above) or "npu" (Ascend SHMEM: the heap is on
                the device, calls take NPU tensors and run the NPU kernel); default "npu" when
                torch_npu sees an NPU, else "cpu".

        Raises:
            TypeError / ValueError: a bad argument, or ranks that disagree on num_ranks/memsize.
            RuntimeError: peers missing after the timeout, ranks on different hosts, or a
                shared-memory failure (the text says which). On the NPU: "SHMEM is not enabled.
                Please set SHMEM_HOME_PATH and recompile." when the wrapper library was built
                without SHMEM, or SHMEM's failure (docs/semantics.md §5.1 texts).
        """
        where = f"{CLASS}.init"
        for arg, value in (("rank", rank), ("num_ranks", num_ranks), ("memsize", memsize)):
            check.integer(where, arg, value)
        if not 0 < num_ranks <= MAX_RANKS:
            check.fail(where, "num_ranks", f"1 <= num_ranks <= {MAX_RANKS}", num_ranks)
        if not 0 <= rank < num_ranks:
            check.fail(where, "rank", f"0 <= rank < num_ranks ({num_ranks})", rank)
        if memsize <= EXT_INFO_BYTES:
            check.fail(where, "memsize", f"more than {EXT_INFO_BYTES} bytes (2 MiB of ext-info + the workspace)",
                       memsize)
        host, port = parse_ip_port(where, ip_port)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            check.fail(where, "timeout", "None or a positive number of seconds", repr(timeout),
                       ValueError if isinstance(timeout, (int, float)) else TypeError)
        if device is not None and device not in DEVICES:
            check.fail(where, "device", f"None or one of {DEVICES}", repr(device),
                       ValueError if isinstance(device, str) else TypeError)
        if self.is_initialized():
            return
        if (device or (NPU_DEVICE if npu_present() else "cpu")) == NPU_DEVICE:
            self._npu = NpuHeap(rank, num_ranks, memsize, ip_port)
            return
        wait = float(timeout) if timeout is not None else _exchange.timeout_seconds()
        heap = Heap(where, rank, num_ranks, memsize, host, port, wait)
        self._heap, self._transport, self._timeout = heap, Transport(heap, OP), timeout

    def is_initialized(self) -> bool:
        """Whether init() succeeded and close() was not called since."""
        return self._heap is not None or self._npu is not None

    def get_ext_info(self) -> int:
        """Address (in this process; on the NPU, the device address) of this rank's 2 MiB ext-info
        region, 0 if uninitialised."""
        if self._npu is not None:
            return self._npu.ext_info
        return self._heap.ext_info(self._heap.rank) if self._heap else 0

    def get_shmem_workspace(self) -> int:
        """Address (in this process; on the NPU, the device address) of this rank's workspace
        (memsize - 2 MiB bytes), or 0."""
        if self._npu is not None:
            return self._npu.workspace
        return self._heap.workspace(self._heap.rank) if self._heap else 0

    def close(self) -> None:
        """Unmaps every segment (on the NPU: frees both regions and finalises SHMEM); the buffer
        can be init()-ed again. Idempotent. Collective in spirit: peers still calling
        zb_fused_deep_moe would wait for this rank and time out."""
        heap, self._heap, self._transport = self._heap, None, None
        npu, self._npu = self._npu, None
        if heap is not None:
            heap.close()
        if npu is not None:
            npu.close()

    def __enter__(self) -> "FusedDeepMoeBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._npu is not None:
            return f"{CLASS}(rank={self._npu.rank}, num_ranks={self._npu.num_ranks}, memsize={self._npu.memsize}, npu)"
        if self._heap is None:
            return f"{CLASS}(uninitialized)"
        return f"{CLASS}(rank={self._heap.rank}, num_ranks={self._heap.num_ranks}, memsize={self._heap.memsize})"

    # -- the op ------------------------------------------------------------------------------------
    def zb_fused_deep_moe(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        gmm1_weight: TensorOrList,
        gmm1_weight_scale: TensorOrList,
        gmm2_weight: TensorOrList,
        gmm2_weight_scale: TensorOrList,
        expert_scales: torch.Tensor,
        share_gmm1_weight: Optional[torch.Tensor],
        share_gmm1_weight_scale: Optional[torch.Tensor],
        share_gmm2_weight: Optional[torch.Tensor],
        share_gmm2_weight_scale: Optional[torch.Tensor],
        expert_smooth_scales: Optional[torch.Tensor],
        share_smooth_scales: Optional[torch.Tensor],
        x_active_mask: Optional[torch.Tensor],
        group_ep: object,
        ep_rank_size: int,
        ep_rank_id: int,
        moe_expert_num: int,
        quant_mode: int,
        global_bs: int,
        *,
        strict: Optional[bool] = None,
    ) -> List[torch.Tensor]:
        """`cam_jit.fused_deep_moe` (W8A8 only) through the buffer: same arguments, in CAM's
        positional order (docs/semantics.md §5.1) (or by keyword), same results bit for bit. Collective: every
        rank of the buffer calls it, in the same order.

        Args:
            x .. x_active_mask, moe_expert_num, quant_mode, global_bs: as cam_jit.fused_deep_moe,
                W8A8 (int8 weights; no biases). Shapes: x [BS, H] bf16/fp16, expert_ids /
                expert_scales [BS, K] int32 / float32, gmm1_weight [E_loc, H, 2I] int8, ...
            group_ep: unused (upstream passes ""); any value.
            ep_rank_size, ep_rank_id: must equal init's num_ranks and rank.
            strict: also apply the NPU kernel's limits, with the zero-buffer ones (docs/semantics.md §5.2,
                §7.5 item 9): batch <= 40960, no HCCL window, the workspace formula.

        Returns:
            [output [BS, H] x.dtype, share_output [BS, H] x.dtype (zeros without a shared
             expert), expert_token_nums [E_loc] int64], fresh tensors (nothing aliases the heap).

        On an NPU buffer the tensors are on the NPU and the call is the NPU kernel (base ABI,
        ext_info, shmem_workspace, memsize - 2 MiB; docs/semantics.md §7.2); data checks are the device's.

        Raises:
            RuntimeError: not initialised; a peer refused its arguments, died or timed out
                (then the buffer is unusable until closed and initialised again).
            TypeError / ValueError: this rank's arguments (its peers then raise RuntimeError).
        """
        npu = self._npu
        if npu is not None:
            args = _arguments(locals())
            npu.check_device(OP, args["x"])
            _check_call(args, npu.rank, npu.num_ranks, npu.memsize, strict)
            return npu.fused_deep_moe(OP, args)
        transport = self._transport
        if transport is None:
            raise RuntimeError("Buffer not initialized, call init() first")
        transport.begin(self._timeout if self._timeout is not None else _exchange.timeout_seconds())
        heap = self._heap
        try:
            args = _arguments(locals())
            layout = _check_call(args, heap.rank, heap.num_ranks, heap.memsize, strict)
            active = layout.batch if x_active_mask is None else int(x_active_mask.sum())
            _check_expert_ids(expert_ids[:active], moe_expert_num, OP)
            return _run(transport, args, layout, active)
        except BaseException as err:
            transport.abandon(err, _INVALID)
            raise


def _check_call(args: dict, rank: int, num_ranks: int, memsize: int, strict: Optional[bool]) -> Layout:
    """The metadata checks of a call on a buffer of init's rank/num_ranks/memsize (strict mode
    adds the zero-buffer limits); returns the layout."""
    ep_rank_size, ep_rank_id = args["ep_rank_size"], args["ep_rank_id"]
    if ep_rank_size != num_ranks or ep_rank_id != rank:
        arg, want, got = (("ep_rank_size", num_ranks, ep_rank_size) if ep_rank_size != num_ranks
                          else ("ep_rank_id", rank, ep_rank_id))
        check.fail(OP, arg, f"{want} (init's {'num_ranks' if arg == 'ep_rank_size' else 'rank'})", got)
    weights = args["gmm1_weight"]
    if weights and weights[0].dtype != torch.int8:
        check.fail(OP, "gmm1_weight" if len(weights) == 1 else "gmm1_weight[0]", "dtype int8: the zero buffer is W8A8 only (docs/semantics.md §5.1)",
                   check.dtype_name(weights[0].dtype), TypeError)
    layout = validate(**args, op=OP)
    if strict_enabled(strict):
        _strict.check(OP, args, layout, memsize - EXT_INFO_BYTES)
    return layout


def _arguments(given: dict) -> dict:
    """Type-checks the public arguments and returns them as validate() takes them."""
    for arg in ("x", "expert_ids", "expert_scales"):
        check.tensor(OP, arg, given[arg])
    for arg in ("share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight", "share_gmm2_weight_scale",
                "expert_smooth_scales", "share_smooth_scales", "x_active_mask"):
        check.optional_tensor(OP, arg, given[arg])
    for arg in ("ep_rank_size", "ep_rank_id", "moe_expert_num", "quant_mode", "global_bs"):
        check.integer(OP, arg, given[arg])
    args = {name: given[name] for name in (
        "x", "expert_ids", "expert_scales", "share_gmm1_weight", "share_gmm1_weight_scale", "share_gmm2_weight",
        "share_gmm2_weight_scale", "expert_smooth_scales", "share_smooth_scales", "x_active_mask", "ep_rank_size",
        "ep_rank_id", "moe_expert_num", "quant_mode", "global_bs")}
    for name in ("gmm1_weight", "gmm1_weight_scale", "gmm2_weight", "gmm2_weight_scale"):
        args[name] = check.weight_list(OP, name, given[name])
    args.update(gmm1_bias=[], gmm2_bias=[], share_gmm1_bias=None, share_gmm2_bias=None, group_ep="")
    return args


def _run(transport: Transport, a: dict, layout: Layout, active: int) -> List[torch.Tensor]:
    """docs/semantics.md §1.8 with the kernels and order of fused_deep_moe's CPU path; the rows travel
    through the heap instead of all_to_all."""
    kernels = cpu_kernels()
    x, e_loc, hidden = a["x"], layout.local_experts, layout.hidden
    route = _moe_cpu.plan_route(OP, a["expert_ids"], active, e_loc, None, experts=a["moe_expert_num"])
    send_counts = torch.bincount(torch.div(route.expert, e_loc, rounding_mode="floor"),
                                 minlength=transport.ranks).tolist()
    geo = transport.geometry(hidden, x.dtype)
    if max(send_counts) > geo.cap:
        transport.reject(_OVER_CAPACITY)
        raise ValueError(_capacity_message(transport, geo, send_counts))
    smooth = a["expert_smooth_scales"]
    q, q_scale = kernels.quantize_rows(x, smooth, route.token, route.expert if smooth is not None else None)
    agreed = agreed_values(layout, x, torch.int8, a["moe_expert_num"], a["quant_mode"])
    del agreed["gmm1_weight.dtype"]  # the buffer is W8A8 only
    recv_counts = transport.dispatch(geo, q, q_scale, route.expert, route.pos, send_counts, e_loc, agreed)
    rows, scale, order, expert_token_nums = transport.receive(geo, recv_counts, e_loc)
    y = kernels.expert_ffn_w8a8(rows, scale, expert_token_nums.tolist(), a["gmm1_weight"], a["gmm1_weight_scale"],
                                a["gmm2_weight"], a["gmm2_weight_scale"], x.dtype)
    transport.send_results(geo, y, order, recv_counts)

    share_output = shared_expert_output(kernels, layout, a)
    returned = transport.results(geo, x.dtype, send_counts)
    pair_rows = transport.pair_rows(geo, route.pos, route.expert, e_loc, layout.batch, layout.topk)
    output = kernels.combine(returned, pair_rows, a["expert_scales"], active)
    return [output, share_output, expert_token_nums]


def _capacity_message(transport: Transport, geo: Geometry, send_counts: List[int]) -> str:
    most = max(send_counts)
    per_pair = geo.disp_row + geo.comb_row
    need = EXT_INFO_BYTES + transport.ranks * most * per_pair
    return (f"{OP}: rank {transport.rank} routes {most} (token, expert) pairs to rank {send_counts.index(most)}, but "
            f"a memsize of {transport.heap.memsize} bytes holds {geo.cap} per pair of ranks at H = {geo.hidden} "
            f"({per_pair} bytes per pair x R = {transport.ranks} sources); init the buffer with memsize >= {need}")
