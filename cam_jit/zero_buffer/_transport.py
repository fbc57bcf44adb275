"""Token transport of FusedDeepMoeBuffer on CPU: dispatch and combine by direct stores into the
peers' segments of the symmetric heap (docs/semantics.md §5.2, "CPU design").

Every rank's ext-info region holds at byte 2048 its doorbell, a 32-bit futex word that each
signal to it increments (waiters sleep on it), and from byte 4096 control slots of 64 bytes,
eight int64 words each: the flag (the call's sequence number, 1, 2, ... per buffer; stored last with
release semantics), a row count (negative: the sender refused the call, see REJECTED) and the
sender's agreed values (H, dtype, K, E, I, quant mode: ranks that disagree all raise, naming the
argument and each rank's value, before anyone reads a row). Rank r's
signals to this rank for call n land in
    dispatch slot  (n % 2) * R + r        (rows from source r are in place),
    combine slot   2R + (n % 2) * R + r   (results from expert rank r are in place),
    abort slot     4R + r                 (nonzero: rank r's buffer failed; no later signal comes).

Workspace of every rank, for a call with R ranks, hidden size H and activation dtype D:
    dispatch area: R slices of `cap` rows of `disp_row` bytes (slice s: rows from source s),
                   a row = int8 [H] | f32 scale | i32 local expert | i32 position t*K+k | i32 call
                   number, padded to 16 (a count above what was sent finds an old call's row);
    combine area:  R slices of `cap` rows of H x D (slice d: expert results from rank d).
with cap = workspace bytes // (R * (disp_row + H * D.itemsize)).

Why no call reads another call's data: every rank signals every peer once per stage and call
and a wait compares the flag with the call's number. A source writes call n+1's rows into a peer
only after it has received all of call n's results, which every expert rank sends only after
copying out call n's rows; an expert rank writes call n+1's results into a source only after
receiving that source's call n+1 rows, sent only after the source has read call n's results. A
call that a rank refuses ends for every rank right after the dispatch signals, without reading
rows, so a fast rank may signal call n+1 before a slow one has seen call n's refusal: the slots
alternate with the call's parity, and no rank gets two calls ahead of a peer.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Tuple

import torch

from cam_jit.ops import _exchange
from cam_jit.zero_buffer._heap import EXT_INFO_BYTES, Heap, zb_kernels

DOORBELL_OFFSET = 2048  # a 32-bit futex word per rank, rung by every signal to it
CTRL_OFFSET = 4096
SLOT_BYTES = 64
META_WORDS = SLOT_BYTES // 8 - 2  # agreed values a signal carries after its flag and count
MAX_RANKS = (EXT_INFO_BYTES - CTRL_OFFSET) // (5 * SLOT_BYTES)
POLL_SECONDS = 0.05  # how often a wait checks that the ranks it waits for are alive
REJECTED = {-1: "it failed before sending, e.g. on invalid arguments (see the error on that rank)",
            -2: "it routes more (token, expert) pairs to one rank than the workspace holds (see the error on "
                "that rank)"}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Row sizes and per-(source, destination) capacity of one call (module docstring)."""

    hidden: int
    disp_row: int
    comb_row: int
    cap: int
    ranks: int

    @property
    def comb_base(self) -> int:
        return self.ranks * self.cap * self.disp_row


def geometry(ranks: int, hidden: int, dtype: torch.dtype, workspace_bytes: int) -> Geometry:
    disp_row = (hidden + 16 + 15) // 16 * 16
    comb_row = hidden * dtype.itemsize
    return Geometry(hidden, disp_row, comb_row, workspace_bytes // (ranks * (disp_row + comb_row)), ranks)


class PeerFailure(RuntimeError):
    """A peer rank died, did not answer in time, or disagreed on the call's geometry."""


class Transport:
    """The per-call protocol between this rank and its peers (module docstring).

    A call is: `begin()`, then either `reject(code)` (this rank refuses its arguments) or
    `dispatch` -> `receive` -> `send_results` -> `results` (+ `pair_rows`); `abandon` when the
    call fails on this rank. After a PeerFailure the buffer is
    broken (`broken` says why) and must be closed and initialised again."""

    def __init__(self, heap: Heap, where: str):
        self.heap, self.where = heap, where
        self.kernels = zb_kernels()
        ranks, me = heap.num_ranks, heap.rank
        self.ranks, self.rank = ranks, me
        self._bells = [heap.ext_info(d) + DOORBELL_OFFSET for d in range(ranks)]
        self._slots = self.kernels.region(heap.ext_info(me) + CTRL_OFFSET, [5 * ranks, SLOT_BYTES // 8],
                                          torch.int64)
        self.seq = 0
        self.broken: Optional[str] = None
        self.timeout = 0.0
        self._state = "over"

    def _first_slot(self, kind: str) -> int:
        """Index of rank 0's slot of `kind` ("dispatch", "combine", "abort") for this call."""
        parity = self.seq % 2
        return {"dispatch": parity * self.ranks, "combine": (2 + parity) * self.ranks, "abort": 4 * self.ranks}[kind]

    def _inbox(self, kind: str) -> List[int]:
        """Addresses of the slots where every rank signals this rank."""
        first = self.heap.ext_info(self.rank) + CTRL_OFFSET + self._first_slot(kind) * SLOT_BYTES
        return [first + r * SLOT_BYTES for r in range(self.ranks)]

    def _outbox(self, kind: str) -> List[int]:
        """Addresses of this rank's slot in every rank's segment."""
        index = self._first_slot(kind) + self.rank
        return [self.heap.ext_info(d) + CTRL_OFFSET + index * SLOT_BYTES for d in range(self.ranks)]

    def _received(self, kind: str) -> Tuple[List[int], List[List[int]]]:
        """(counts, meta words) of the slots where every rank signalled this rank."""
        first = self._first_slot(kind)
        rows = self._slots[first:first + self.ranks]
        return rows[:, 1].tolist(), rows[:, 2:].tolist()

    def begin(self, timeout: float) -> None:
        if self.broken is not None:
            raise RuntimeError(f"{self.where}: this buffer is unusable since an earlier call failed ({self.broken}); "
                               "close() it and init() a new one on every rank")
        self.seq += 1
        self.timeout = timeout
        self._state = "begun"  # -> "dispatched" once peers may have heard from us, "over" at the end

    def geometry(self, hidden: int, dtype: torch.dtype) -> Geometry:
        return geometry(self.ranks, hidden, dtype, self.heap.memsize - EXT_INFO_BYTES)

    # -- dispatch --------------------------------------------------------------------------------
    def reject(self, code: int) -> None:
        """Tells every peer that this rank refuses the call, and waits for their dispatch signals
        so the next call starts in step (a timeout here is left to the caller's own error)."""
        self.kernels.publish(self._outbox("dispatch"), [code] * self.ranks, [], self.seq, self._bells)
        self._state = "over"
        try:
            self._wait(self._inbox("dispatch"), "token dispatch")
        except PeerFailure:
            pass

    def dispatch(self, geo: Geometry, q: torch.Tensor, scale: torch.Tensor, expert: torch.Tensor, pos: torch.Tensor,
                 send_counts: List[int], local_experts: int, agreed: Dict[str, object]) -> List[int]:
        """Writes each pair's row into its destination's dispatch area and signals every peer
        with `agreed` (label -> value every rank must share, at most META_WORDS); returns the row
        counts received from each source. Pairs in route order (grouped by destination rank,
        send_counts[d] for rank d): q [P, H] int8, scale [P] float32, expert [P] int64 global
        expert ids, pos [P] int64 positions t*K+k."""
        dest = [self.heap.workspace(d) + self.rank * geo.cap * geo.disp_row for d in range(self.ranks)]
        self.kernels.put_rows(dest, q, scale, expert, pos, send_counts, local_experts, geo.disp_row, self.seq)
        meta = [_exchange.encode_value(v) for v in agreed.values()]
        self.kernels.publish(self._outbox("dispatch"), send_counts, meta, self.seq, self._bells)
        self._state = "dispatched"
        self._wait(self._inbox("dispatch"), "token dispatch")
        counts, metas = self._received("dispatch")
        rejected = {s: c for s, c in enumerate(counts) if c < 0}
        if rejected:
            self._state = "over"
            reasons = "; ".join(f"rank {s}: {REJECTED.get(c, f'code {c}')}" for s, c in sorted(rejected.items()))
            raise RuntimeError(f"{self.where}: peer rank(s) {sorted(rejected)} refused this call, so no rank runs it "
                               f"({reasons})")
        self._check_agreement(agreed, metas)
        over = {s: c for s, c in enumerate(counts) if c > geo.cap}
        if over:
            self._fail(f"rank(s) {sorted(over)} announced {over} rows, more than the {geo.cap} a slice holds: a peer "
                       "that does not follow the protocol")
        return counts

    def _check_agreement(self, agreed: Dict[str, object], metas: List[List[int]]) -> None:
        """Every rank signalled the same agreed values: otherwise every rank raises the same
        ValueError here, before reading a row, and the buffer stays usable."""
        for column, (label, value) in enumerate(agreed.items()):
            by_rank = [meta[column] for meta in metas]
            if len(set(by_rank)) > 1:
                self._state = "over"
                shown = ", ".join(f"{r}: {_exchange.describe_value(c, value)}" for r, c in enumerate(by_rank))
                raise ValueError(f"{self.where}: argument '{label}': expected the same value on all {self.ranks} "
                                 f"ranks of the buffer, got by rank {{{shown}}}")

    def receive(self, geo: Geometry, counts: List[int], local_experts: int):
        """The rows that arrived (counts[s] from source s), grouped by local expert, stably in
        received order (source rank, then the source's route order): (rows [M, H] int8, scale
        [M] float32, order [M] int64 = received index of each grouped row, expert_token_nums
        [E_loc] int64). Copies out of the heap: the area is free again afterwards."""
        return self.kernels.take_rows(self.heap.workspace(self.rank), counts, geo.cap, geo.disp_row, geo.hidden,
                                      local_experts, self.seq)

    # -- combine ---------------------------------------------------------------------------------
    def send_results(self, geo: Geometry, y: torch.Tensor, order: torch.Tensor, counts: List[int]) -> None:
        """Writes expert results y [M, H] (grouped as `receive` returned them) into their
        sources' combine areas and signals every source (meta: the row size)."""
        dest = [self.heap.workspace(s) + geo.comb_base + self.rank * geo.cap * geo.comb_row
                for s in range(self.ranks)]
        self.kernels.put_results(dest, y.contiguous(), order, counts)
        self.kernels.publish(self._outbox("combine"), counts, [geo.comb_row], self.seq, self._bells)

    def results(self, geo: Geometry, dtype: torch.dtype, send_counts: List[int]) -> torch.Tensor:
        """Waits for every expert rank's results; returns the combine area as [R * cap, H] of
        dtype (a view of shared memory, valid until this rank's next call): the result of the
        j-th pair sent to rank d is row d * cap + j (see `pair_rows`)."""
        self._wait(self._inbox("combine"), "result combine")
        counts, metas = self._received("combine")
        self._check_tags([meta[0] for meta in metas], geo.comb_row, "combine row")
        if counts != send_counts:
            self._fail(f"expert ranks returned {counts} rows where this rank sent {send_counts}")
        base = self.heap.workspace(self.rank) + geo.comb_base
        self._state = "over"
        return self.kernels.region(base, [self.ranks * geo.cap, geo.hidden], dtype)

    def pair_rows(self, geo: Geometry, pos: torch.Tensor, expert: torch.Tensor, local_experts: int, batch: int,
                  topk: int) -> torch.Tensor:
        """[batch, topk] int64: the row of `results` holding pair (t, k), -1 if not routed
        (pos / expert: the route's [P] int64 positions and experts)."""
        return self.kernels.pair_rows(pos, expert, local_experts, geo.cap, batch, topk)

    # -- waiting and failures --------------------------------------------------------------------
    def abandon(self, error: BaseException, code: int) -> None:
        """This rank's call failed on its own (bad arguments, a kernel error, an interrupt): if
        no peer has heard from this call yet, refuse it with `code` (the peers raise, the buffer
        stays usable); after the dispatch signal, mark the buffer broken and post an abort
        notice so the peers raise at once instead of timing out."""
        if self.broken is not None or self._state == "over":
            return
        if self._state == "begun":
            self.reject(code)
            return
        self.broken = f"rank {self.rank} failed during call {self.seq}: {type(error).__name__}: {error}"
        self._state = "over"
        self.kernels.publish(self._outbox("abort"), [0] * self.ranks, [], self.seq, self._bells)

    def _wait(self, slots: List[int], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            missing = self.kernels.wait_flags(slots, self.seq, max(0.0, min(POLL_SECONDS, left)),
                                              self._bells[self.rank])
            if missing < 0:
                return
            # the rank we wait for may itself be waiting for a dead or failed one: look at all of them
            dead = [r for r in range(self.ranks) if self.heap.dead_peer(r)]
            if dead:
                self._fail(f"rank {dead[0]} (pid {self.heap.peers[dead[0]].pid}) exited; this rank was waiting for "
                           f"the {what} signal of call {self.seq} from rank {missing}")
            aborted = [r for r, v in enumerate(self._slots[4 * self.ranks:, 0].tolist()) if v]
            if aborted:
                self._fail(f"rank {aborted[0]} gave up (see the error on that rank); this rank was waiting for the "
                           f"{what} signal of call {self.seq} from rank {missing}")
            if left <= 0:
                self._fail(f"rank {missing} did not send its {what} signal of call {self.seq} within "
                           f"{self.timeout:g} s (timeout: init(timeout=...) or CAM_JIT_COMM_TIMEOUT); every rank "
                           "must call zb_fused_deep_moe the same number of times")

    def _check_tags(self, tags: List[int], expected: int, what: str) -> None:
        wrong = {r: t for r, t in enumerate(tags) if t != expected}
        if wrong:
            self._fail(f"ranks disagree on the {what} size ({expected} bytes here, {wrong} by rank): every rank must "
                       "pass the same hidden size H and x dtype")

    def _fail(self, why: str) -> None:
        """Marks the buffer unusable, tells every peer (abort notice) and raises PeerFailure."""
        self.broken = why
        self._state = "over"
        self.kernels.publish(self._outbox("abort"), [0] * self.ranks, [], self.seq, self._bells)
        raise PeerFailure(f"{self.where}: rank {self.rank} of {self.ranks}: {why}; this buffer is now unusable "
                          "(close() it and init() a new one on every rank)")
