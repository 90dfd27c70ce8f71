"""The Buffer's row exchange: how its rows, route weights and expert weights cross ranks.

One contract (`RowExchange`), two implementations, chosen once per Buffer by `select_exchange`:

- `ReferenceExchange`, the torch reference: everything that crosses ranks goes through the world's two
  collective row exchanges, `scatter_rows` (dispatch) and `gather_rows` (combine, prefetch, reduce_grad),
  so every EP world (threads, symmetric memory, torch.distributed collectives) runs it; local work (padding
  zero-fill, duplicate expansion and pre-reduction) is plain torch between them.
- `KernelExchange`, the Triton row kernels (`comm.kernels.rows`), where every peer's memory is mapped (the
  threads world on one GPU, the symmetric-memory world): kernels read and write peers' rows through pointer
  tables, and `world.barrier()` orders the phases where the reference's exchanges order them (before the
  first access to peers' tensors, and after it; a prefetch whose caller makes another collective call before
  it writes its home experts may leave out the closing barrier: `copy_experts(wait_for_readers=False)`).

Both give the same bits (combine sums in fp32 in k order, duplicates in row order, replicas in (slot, rank)
order) and the same dup tables; tests/test_comm_kernels.py checks it. Neither owns memory or state: the
Buffer owns its symmetric tensors and scratch (`RowMemory`), checks every argument and builds the indices
both read (the plan, the replica tables) before calling them; each exchange turns the duplicate routes it
received into the plan's dup tables (`record_duplicates`: a sort of the pairs in torch, three launches in
the kernels). Every index has a shape fixed by the config; unneeded entries are
marked (rank -1, a zero contribution, a self-copy), never masked out: no host read.

Notation and suffixes: DESIGN.md, "Notation".
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from moonep_moe.base.triton import triton_missing_reason
from moonep_moe.plan.types import MoonEPCommPlan, decode_dst
from moonep_moe.transport.world import EPWorld, SymmetricTensor
from moonep_moe.weights.pool import ExpertRows

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""Row dtypes the row kernels move."""


@dataclass(frozen=True)
class RowMemory:
    """A Buffer's symmetric memory (owned by the Buffer) and the sizes the exchanges index it with.

    Attributes:
        world: the EP world. rows: `[NvS, H]` in the Buffer's dtype. weights: `[NvS]` route weights (fp32,
        float64 for float64 rows). dup_pairs: `[R*S*K, 2]` int32, at slot `source rank * S*K + route` a
        received duplicate route's (row, primary row), else -1 (one writer per slot; R*S*K, not NvS: its
        scan costs what the capacity's routes cost). dup_marks: `[NvS]` int32, local (not symmetric), zero
        between operations: the row kernels' scratch while they build the dup tables (`record_duplicates`).
        max_tokens, top_k, experts_per_rank, num_slots, token_padding: S, K, epn, B, tp.
        num_sms: SMs the kernels' grid-stride loops size their grids for (None: the device's).
    """

    world: EPWorld
    rows: SymmetricTensor
    weights: SymmetricTensor
    dup_pairs: SymmetricTensor
    dup_marks: torch.Tensor
    max_tokens: int
    top_k: int
    experts_per_rank: int
    num_slots: int
    token_padding: int
    num_sms: int | None

    @property
    def duplicates(self) -> bool:
        """Whether plans can hold duplicate routes: with R > 1 (a token crosses the link once per rank); with
        one rank every route is primary (`plan.route_destinations`)."""
        return self.world.size > 1

    @property
    def max_dup_groups(self) -> int:
        """A bound on a rank's duplicate groups: each is one (source rank, token) pair and spans >= 2 rows."""
        return min(self.rows.local.shape[0] // 2, self.world.size * self.max_tokens) if self.duplicates else 0

    @property
    def payload_capacity(self) -> int:
        """Payload rows a rank exchanges with any one rank: one per token (S) where duplicates share their
        primary row, every route (S*K) with one rank."""
        return self.max_tokens if self.duplicates else self.max_tokens * self.top_k


class RowExchange(Protocol):
    """What crosses ranks in a Buffer's operations. Collective methods are called by every rank in the
    same order; local ones touch only this rank's memory. Nothing is checked here (the Buffer has)."""

    memory: RowMemory

    def send_routes(self, plan: MoonEPCommPlan, hidden_sh: torch.Tensor,
                    route_weights_sk: torch.Tensor | None, record: bool) -> None:
        """Collective: every valid route's weight, and each primary route's payload row, into its
        destination row; with `record` (the forward dispatch) each duplicate route's (row, row of its
        token's primary route to the same rank) into the destination's `dup_pairs`, at its own slot; this
        rank's padding rows and their weights become zero. Starts once every rank is done with the rows'
        previous contents; returns once every write into this rank's rows has landed."""
        ...

    def record_duplicates(self, plan: MoonEPCommPlan) -> None:
        """Local, after `send_routes(record=True)`: the received duplicate pairs become the plan's dup tables
        (groups sorted by primary row, each group's duplicate rows ascending; the planner left the tables
        zero and the entries past the used ones stay zero), and `dup_pairs` is all -1 again."""
        ...

    def fill_rows(self, plan: MoonEPCommPlan) -> None:
        """Local, after `send_routes` and the dup tables: each primary row is copied into its duplicate
        rows."""
        ...

    def filled_copy(self, rows_nvsx: torch.Tensor, plan: MoonEPCommPlan) -> torch.Tensor:
        """Local: a new contiguous tensor of `rows_nvsx`'s shape and dtype holding its rows up to
        `cu_seqlens[-1]` (read on the device); the rows past it are unspecified. `rows_nvsx [NvS, X]`: the
        rows' memory or a view of it with unit column stride (the e4m3 rows or the scales inside packed FP8
        rows). O(rows the plan fills) where the exchange can bound it."""
        ...

    def combine(self, plan: MoonEPCommPlan, hidden_nvsh: torch.Tensor, zero_copy: bool, with_weights: bool,
                out_sh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Collective: each duplicate group of `hidden_nvsh [NvS, H]` (the Buffer's rows themselves with
        `zero_copy`) summed into its primary row in fp32, in row order, then `[s, H]` each token's primary
        rows summed in fp32 in k order (in the rows' dtype; written into `out_sh` when given, a contiguous
        `[s, H]` tensor of that dtype), and with `with_weights` `[s, K]` every route's weight (0 if invalid).
        The Buffer's rows up to `cu_seqlens[-1]` may be overwritten (with R > 1 peers read them there)."""
        ...

    def copy_experts(self, weights: list[ExpertRows], expert_b: torch.Tensor, wait_for_readers: bool = True
                     ) -> None:
        """Collective: slot j of each projection's slots gets home expert `expert_b[j]` (`[B]` int32) from
        its home rank; a slot marked -1 is not written. `wait_for_readers=False`: return once this rank's
        own copies are queued, not when every peer is done reading this rank's home experts (the caller
        writes them only after its next collective call, whose opening barrier orders those reads)."""
        ...

    def add_replicas(self, projections: list[tuple[torch.Tensor, SymmetricTensor]], mine_rb: torch.Tensor,
                     home_rb: torch.Tensor) -> None:
        """Collective: for each `(home_xf [epn, ...], slots [B, ...] symmetric)`, every replica of one of this
        rank's home experts (`mine_rb [R, B]`: slot j of rank d holds one; `home_rb [R, B]`: which, in
        [0, epn)) added into that expert's gradient, in (slot, rank) order."""
        ...

    def clear_slots(self, slots_b: torch.Tensor, expert_b: torch.Tensor) -> None:
        """Local: the used slots (`expert_b [B] >= 0`) of `slots_b [B, ...]` (contiguous) become zero."""
        ...


def write_used_slots(slots_b: torch.Tensor, copies_b: torch.Tensor, expert_b: torch.Tensor) -> None:
    """`slots_b[j] = copies_b[j]` for every used slot (`expert_b [B] >= 0`); an unused slot keeps what it
    holds (its group is empty: nothing reads it). The torch form of the copy kernel's rule."""
    used_b = (expert_b >= 0).view(-1, *[1] * (slots_b.dim() - 1))
    slots_b.copy_(torch.where(used_b, copies_b, slots_b))


@dataclass(frozen=True)
class ReferenceExchange:
    """`RowExchange` in torch over the world's `scatter_rows` / `gather_rows`: runs in every EP world."""

    memory: RowMemory

    def send_routes(self, plan, hidden_sh, route_weights_sk, record) -> None:
        m = self.memory
        nvs, top_k = m.rows.local.shape[0], m.top_k
        dest_n, row_n, primary_n, valid_n = decode_dst(plan.dst, nvs)
        token_n = torch.arange(plan.dst.numel(), device=plan.dst.device) // top_k
        # capacities: payload rows per destination rank (`payload_capacity`), a weight per route
        m.world.scatter_rows(m.rows, torch.where(valid_n & primary_n, dest_n, -1), row_n,
                             hidden_sh.index_select(0, token_n), capacity=m.payload_capacity)
        if route_weights_sk is not None:
            m.world.scatter_rows(m.weights, torch.where(valid_n, dest_n, -1), row_n,
                                 route_weights_sk.reshape(-1), capacity=m.max_tokens * top_k)
        if record:
            slot_n = m.world.rank * m.max_tokens * top_k + torch.arange(len(row_n), device=row_n.device)
            m.world.scatter_rows(m.dup_pairs, torch.where(valid_n & ~primary_n, dest_n, -1), slot_n,
                                 torch.stack([row_n.to(torch.int32), primary_rows(plan.dst, nvs, top_k)], 1),
                                 capacity=m.max_tokens * top_k)
        padding_nvs = _padding_mask(plan.zero_fill_ranges, nvs)  # local rows no route writes
        m.rows.local.masked_fill_(padding_nvs[:, None], 0)
        m.weights.local.masked_fill_(padding_nvs, 0)

    def record_duplicates(self, plan) -> None:
        # fixed shapes of the pairs' size R*S*K, never NvS: the pairs sorted by (primary, row) with empty
        # slots pushed to the end by a sentinel key; a group starts where the primary changes. Only the
        # first min(R*S*K, NvS) table entries are written (no rank receives more duplicates; none with one
        # rank, whose tables are empty).
        nvs = plan.rows_per_rank
        pairs_p2 = self.memory.dup_pairs.local
        used = min(pairs_p2.shape[0], plan.dup_loffs.shape[0])
        row_p, primary_p = pairs_p2.long().unbind(1)
        order_p = torch.argsort(torch.where(row_p >= 0, primary_p * nvs + row_p, nvs * nvs), stable=True)
        row_p, primary_p = row_p[order_p][:used], primary_p[order_p][:used]
        dup_p = row_p >= 0  # position i of the sorted order holds a duplicate
        index_p = torch.arange(used, device=pairs_p2.device)  # positions in the sorted order
        starts_p = dup_p & ((index_p == 0) | (primary_p != torch.roll(primary_p, 1)))
        group_p = torch.cumsum(starts_p, 0) - 1
        dump_p = torch.full_like(index_p, used)  # fixed-shape scatters send unused entries to a dump row
        groups_p3 = torch.zeros(used + 1, 3, dtype=torch.int64, device=index_p.device)
        groups_p3.index_copy_(0, torch.where(starts_p, group_p, dump_p),
                              torch.stack([primary_p, index_p, torch.zeros_like(index_p)], 1))
        groups_p3[:, 2].index_add_(0, torch.where(dup_p, group_p, dump_p), torch.ones_like(index_p))
        plan.dup_groups[:used].copy_(groups_p3[:used])
        plan.dup_loffs[:used].copy_(torch.where(dup_p, row_p, 0))
        plan.dup_counts.copy_(torch.stack([starts_p.sum(), dup_p.sum()]))
        pairs_p2.fill_(-1)

    def filled_copy(self, rows_nvsx, plan) -> torch.Tensor:
        words_nvsw, = as_words(rows_nvsx)  # fixed-shape torch: all NvS rows
        return words_nvsw.clone(memory_format=torch.contiguous_format).view(torch.uint8).view(rows_nvsx.dtype)

    def fill_rows(self, plan) -> None:
        rows_nvsh = self.memory.rows.local
        rows_nvsh.copy_(rows_nvsh.index_select(0, source_rows(plan)))

    def combine(self, plan, hidden_nvsh, zero_copy, with_weights, out_sh=None):
        self._pre_reduce(plan, hidden_nvsh)
        return self._gather_routes(plan, with_weights, out_sh)

    def _pre_reduce(self, plan, hidden_nvsh) -> None:
        # every row adds into its source row (duplicates into their primary, the rest into themselves), in
        # fp32, in row order; only primary rows are read afterwards
        # (rows past the plan's end keep their values, as the kernels leave them)
        rows_nvsh = self.memory.rows.local
        accumulate = self.memory.weights.local.dtype
        sums_nvsh = torch.zeros(rows_nvsh.shape, dtype=accumulate, device=rows_nvsh.device)
        sums_nvsh.index_add_(0, source_rows(plan), hidden_nvsh.to(accumulate))
        filled_v = torch.arange(rows_nvsh.shape[0], device=rows_nvsh.device) < plan.cu_seqlens[-1]
        rows_nvsh.copy_(torch.where(filled_v[:, None], sums_nvsh, rows_nvsh))

    def _gather_routes(self, plan, with_weights, out_sh):
        m = self.memory
        rows_nvsh, top_k = m.rows.local, m.top_k
        accumulate = m.weights.local.dtype
        dest_n, row_n, primary_n, valid_n = decode_dst(plan.dst, rows_nvsh.shape[0])
        num_tokens, width = plan.dst.numel() // top_k, rows_nvsh.shape[1]
        gathered_nh = m.world.gather_rows(m.rows, torch.where(valid_n & primary_n, dest_n, -1), row_n,
                                          capacity=m.payload_capacity).to(accumulate)
        sum_sh = torch.zeros(num_tokens, width, dtype=accumulate, device=rows_nvsh.device)
        for k in range(top_k):  # fp32 sum in k order
            sum_sh += gathered_nh.view(num_tokens, top_k, width)[:, k]
        weights_sk = None
        if with_weights:
            weights_n = m.world.gather_rows(m.weights, torch.where(valid_n, dest_n, -1), row_n,
                                            capacity=m.max_tokens * top_k)
            weights_sk = weights_n.view(num_tokens, top_k)
        if out_sh is None:
            return sum_sh.to(rows_nvsh.dtype), weights_sk
        return out_sh.copy_(sum_sh), weights_sk

    def copy_experts(self, weights, expert_b, wait_for_readers=True) -> None:
        m = self.memory
        epn = m.experts_per_rank
        expert_b = expert_b.long()
        for weight in weights:
            copies = m.world.gather_rows(weight.home, torch.where(expert_b >= 0, expert_b // epn, -1),
                                         expert_b.clamp(min=0) % epn, capacity=m.num_slots)
            write_used_slots(weight.slots.local, copies, expert_b)

    def add_replicas(self, projections, mine_rb, home_rb) -> None:
        m = self.memory
        rank_r = torch.arange(m.world.size, device=mine_rb.device)
        for home, slots in projections:
            # one slot index per exchange: R rows in flight (the peak memory), R * B rows in all; rows of
            # other ranks' experts come back zero and add nothing
            for slot in range(m.num_slots):
                pulled_r = m.world.gather_rows(slots, torch.where(mine_rb[:, slot], rank_r, -1),
                                               torch.full_like(rank_r, slot), capacity=1)
                _index_add_blocked_(home, home_rb[:, slot], pulled_r.to(home.dtype))

    def clear_slots(self, slots_b, expert_b) -> None:
        slots_b.masked_fill_((expert_b >= 0).view((-1,) + (1,) * (slots_b.dim() - 1)), 0)


@dataclass(frozen=True)
class KernelExchange:
    """`RowExchange` with the Triton kernels (`rows` and `experts`, the `comm.kernels.rows` and
    `comm.kernels.experts` modules) over per-rank pointer tables, ordered by `world.barrier()`: needs every
    peer's memory mapped."""

    memory: RowMemory
    rows: ModuleType
    experts: ModuleType

    def send_routes(self, plan, hidden_sh, route_weights_sk, record) -> None:
        m = self.memory
        m.world.barrier()  # every rank is done with the rows' previous contents
        self.rows.send_routes(hidden_sh.contiguous(), None if route_weights_sk is None else
                              route_weights_sk.contiguous(), plan.dst, record and m.duplicates, m.rows,
                              m.weights, m.dup_pairs, m.world.rank * m.max_tokens * m.top_k,
                              plan.zero_fill_ranges, m.token_padding)
        m.world.barrier()  # every write into this rank's rows has landed

    def record_duplicates(self, plan) -> None:
        m = self.memory
        if not m.duplicates:  # none to record: the dup tables stay empty
            return
        self.rows.record_duplicates(m.dup_pairs.local, m.dup_marks, plan.cu_seqlens[-1:], plan.dup_groups,
                                    plan.dup_loffs, plan.dup_counts, m.top_k)

    def filled_copy(self, rows_nvsx, plan) -> torch.Tensor:
        copy_nvsx = torch.empty(rows_nvsx.shape, dtype=rows_nvsx.dtype, device=rows_nvsx.device)
        self.rows.copy_rows(*as_words(copy_nvsx, rows_nvsx), plan.cu_seqlens[-1:], self.memory.num_sms)
        return copy_nvsx

    def fill_rows(self, plan) -> None:
        m = self.memory
        self.rows.expand_duplicates(m.rows.local, plan.dup_groups, plan.dup_loffs, plan.dup_counts,
                                    m.top_k - 1, m.max_dup_groups, m.num_sms)

    def combine(self, plan, hidden_nvsh, zero_copy, with_weights, out_sh=None):
        m = self.memory
        rows = m.rows
        if not m.duplicates:  # one rank, every route primary: its row is read where the experts wrote it
            rows = hidden_nvsh.contiguous()
        else:  # the expert outputs in the rows (copied in unless the experts wrote there), then each
            # duplicate group summed into its primary there
            if not zero_copy:
                self.rows.copy_rows(m.rows.local, hidden_nvsh.contiguous(), plan.cu_seqlens[-1:], m.num_sms)
            self.rows.pre_reduce_duplicates(m.rows.local, plan.dup_groups, plan.dup_loffs, plan.dup_counts,
                                            m.top_k - 1, m.max_dup_groups, m.weights.local.dtype, m.num_sms)
        rows_nvsh, weights_nvs = m.rows.local, m.weights.local
        num_tokens = plan.dst.numel() // m.top_k
        if out_sh is None:
            out_sh = torch.empty(num_tokens, rows_nvsh.shape[1], dtype=rows_nvsh.dtype,
                                 device=rows_nvsh.device)
        weights_sk = None
        if with_weights:
            weights_sk = torch.empty(num_tokens, m.top_k, dtype=weights_nvs.dtype, device=rows_nvsh.device)
        m.world.barrier()  # every rank's primary rows are final
        self.rows.gather_routes(plan.dst, rows, m.weights if with_weights else None, out_sh, weights_sk,
                                weights_nvs.dtype)
        m.world.barrier()  # every rank is done reading this rank's rows
        return out_sh, weights_sk

    def copy_experts(self, weights, expert_b, wait_for_readers=True) -> None:
        world = self.memory.world
        world.barrier()  # every rank's home weights are final
        for weight in weights:
            self.experts.copy_experts(weight.home, weight.slots.local, expert_b)
        if wait_for_readers:
            world.barrier()  # every rank is done reading this rank's home weights

    def add_replicas(self, projections, mine_rb, home_rb) -> None:
        world = self.memory.world
        sources_xr = replica_sources(mine_rb, home_rb, self.memory.experts_per_rank)
        world.barrier()  # every rank's slot gradients are final
        for home, slots in projections:
            self.experts.add_replicas(home, slots, sources_xr)
        world.barrier()  # every rank is done reading this rank's slot gradients

    def clear_slots(self, slots_b, expert_b) -> None:
        self.experts.clear_slots(slots_b, expert_b)


WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
"""What `as_words` views rows as, widest first."""


def as_words(*rows_nx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of `rows_nx` (2-D, unit column stride, any row stride and offset) viewed as the widest integers
    that divide every one's row bytes, row stride and offset in bytes: the same memory, so a copy of the
    views copies the rows' bits whatever their dtype (e4m3 included, which Triton's interpreter and many
    torch kernels lack), and moves whole words where a strided copy moves one element per thread."""
    sizes = [size * t.element_size() for t in rows_nx
             for size in (t.shape[1], t.stride(0), t.storage_offset())]
    word = next(w for w in WORDS if all(size % w.itemsize == 0 for size in sizes))
    return tuple(t.view(torch.uint8).view(word) for t in rows_nx)


def select_exchange(memory: RowMemory, kernels: bool | None) -> RowExchange:
    """The one place that picks a Buffer's exchange. `kernels`: None = the kernels where they apply (a CUDA
    world whose symmetric tensors map every peer, rows in a `ROW_DTYPES` dtype, Triton importable), else
    the reference; True = the kernels (a ValueError naming why where they cannot run; on CPU tensors they
    need Triton's interpreter, `TRITON_INTERPRET=1`); False = the reference."""
    if kernels is False:
        return ReferenceExchange(memory)
    device, dtype = memory.world.device, memory.rows.local.dtype
    reasons = []
    if any(peer is None for peer in memory.rows.peers):
        reasons.append("the world does not map every peer's memory")
    if dtype not in ROW_DTYPES:
        reasons.append(f"rows in {dtype} are not supported")
    rows, experts, interpreted = None, None, False
    missing = triton_missing_reason()
    if missing is not None:  # no Triton: the reference runs everywhere
        reasons.append(missing)
    else:
        from moonep_moe.base.interpreter import INTERPRETED as interpreted
        from moonep_moe.comm.kernels import experts, rows
    if rows is not None and device.type != "cuda" and not (device.type == "cpu" and interpreted):
        reasons.append(f"{device} tensors: the kernels run on CUDA, or on the CPU in Triton's interpreter "
                       "(TRITON_INTERPRET=1)")
    if kernels is None:
        usable = device.type == "cuda" and not reasons
        return KernelExchange(memory, rows, experts) if usable else ReferenceExchange(memory)
    if reasons:
        raise ValueError(f"rank {memory.world.rank}: kernels=True: the row kernels cannot run here: "
                         f"{'; '.join(reasons)}")
    return KernelExchange(memory, rows, experts)


# -- indices the reference builds ----------------------------------------------------------------------------


def primary_rows(dst_n: torch.Tensor, rows_per_rank: int, top_k: int) -> torch.Tensor:
    """`[N]` int32: for each route of `dst_n [N]` the row of its token's primary route to the same rank (its
    own row if primary): what a duplicate route records as its duplicate source."""
    dest_n, row_n, _, valid_n = decode_dst(dst_n, rows_per_rank)
    dest_sk = torch.where(valid_n, dest_n, -1).view(-1, top_k)
    # the primary is the first k of the token with the same destination
    same_skk = dest_sk[:, :, None] == dest_sk[:, None, :]
    first_sk = same_skk.int().argmax(-1)
    return torch.gather(row_n.view(-1, top_k), 1, first_sk).reshape(-1).to(torch.int32)


def source_rows(plan: MoonEPCommPlan) -> torch.Tensor:
    """`[NvS]` int64 from the plan's dup tables: each row's primary row if it is a duplicate, else the
    row itself (so `rows[source]` expands duplicates, and an `index_add_` over it pre-reduces them); every
    row itself where the plan has no dup tables (one rank)."""
    nvs = plan.rows_per_rank
    if plan.dup_loffs.numel() == 0:
        return torch.arange(nvs, device=plan.dup_loffs.device)
    groups_v3 = plan.dup_groups.long()
    num_groups, num_dups = plan.dup_counts.long().unbind()
    index_v = torch.arange(nvs, device=groups_v3.device)
    dump_v = torch.full_like(index_v, nvs)
    # the group of each dup_loffs entry: count the group starts at or before it
    starts_v = torch.zeros(nvs + 1, dtype=torch.int64, device=index_v.device)
    starts_v.index_add_(0, torch.where(index_v < num_groups, groups_v3[:, 1], dump_v),
                        torch.ones_like(index_v))
    group_v = (torch.cumsum(starts_v[:nvs], 0) - 1).clamp(min=0)
    source_v = torch.arange(nvs + 1, device=index_v.device)
    source_v.index_copy_(0, torch.where(index_v < num_dups, plan.dup_loffs.long(), dump_v),
                         groups_v3[:, 0].index_select(0, group_v))
    return source_v[:nvs]


def _padding_mask(zero_fill_g2: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`[G, 2]` (first padding row, padding rows) of groups in row order -> `[num_rows]` bool, True on
    padding rows. Each row finds its group by its end offset (searchsorted), so the shape is fixed."""
    first_g = zero_fill_g2[:, 0].long()
    end_g = first_g + zero_fill_g2[:, 1].long()
    row_v = torch.arange(num_rows, device=zero_fill_g2.device)
    group_v = torch.searchsorted(end_g, row_v, right=True)
    inside_v = group_v < len(end_g)
    return inside_v & (row_v >= first_g[group_v.clamp(max=len(end_g) - 1)])


def _index_add_blocked_(target: torch.Tensor, index_c: torch.Tensor, values_c: torch.Tensor,
                        max_elements: int = 2**31 - 1) -> None:
    """`target[index_c[i]] += values_c[i]` for all i (`[C]` indices, `[C, *row]` values), in blocks of
    target rows each spanning at most `max_elements` (< 2^31) elements. CUDA's `index_add_` failed on the
    H200 for a DeepSeek-V3 layer's fp32 home gradients (3.8e9 elements); a block that small takes the 32-bit
    indexing path that every smaller call takes. Entries outside a block add a zero row there (a `where`,
    not a product, so an inf gradient stays where it belongs). One block, the usual case, is one call."""
    rows_per_block = max(1, max_elements // max(1, target[0].numel()))
    if target.shape[0] <= rows_per_block:
        target.index_add_(0, index_c, values_c)
        return
    expand = (-1,) + (1,) * (values_c.dim() - 1)
    for first in range(0, target.shape[0], rows_per_block):
        block = target[first:first + rows_per_block]
        local_c = index_c - first
        inside_c = (local_c >= 0) & (local_c < block.shape[0])
        block.index_add_(0, local_c.clamp(0, block.shape[0] - 1),
                         torch.where(inside_c.view(expand), values_c, 0))


# -- indices the kernels build -------------------------------------------------------------------------------


def replica_sources(mine_rb: torch.Tensor, home_rb: torch.Tensor, num_home: int) -> torch.Tensor:
    """`[epn, R]` int32: each of this rank's home experts' replicas as `rank * B + slot` in (slot, rank)
    order (the reference's order of adds), then -1; from `mine_rb [R, B]` (slot j of rank d holds one of
    this rank's experts) and `home_rb [R, B]` (which one, in [0, epn)). A rank holds an expert at most
    once, so R entries suffice. Fixed shapes: other ranks' experts are scattered into a dump row."""
    num_ranks, num_slots = mine_rb.shape
    device = mine_rb.device
    rank_rb = torch.arange(num_ranks, device=device)[:, None].expand(-1, num_slots)
    slot_rb = torch.arange(num_slots, device=device)[None, :].expand(num_ranks, -1)
    slot_xr = torch.full((num_home + 1, num_ranks), -1, dtype=torch.int64, device=device)
    slot_xr[torch.where(mine_rb, home_rb, num_home), rank_rb] = slot_rb
    slot_xr = slot_xr[:num_home]
    rank_r = torch.arange(num_ranks, device=device)
    key_xr = torch.where(slot_xr >= 0, slot_xr * num_ranks + rank_r, num_slots * num_ranks)
    order_xr = torch.argsort(key_xr, dim=1, stable=True)
    slot_xr = slot_xr.gather(1, order_xr)
    return torch.where(slot_xr >= 0, order_xr * num_slots + slot_xr, -1).to(torch.int32)
