"""The planner: from the group's routing histogram to where every route is computed.

Shapes (DESIGN.md): S tokens of capacity per rank, K routes per token, E experts, R ranks, `epn = E / R` home
experts per rank, B prefetch slots per rank, `tp` token padding, `NvS` dispatched rows per rank.

Every rank calls `plan_routes` with the same gathered histogram `counts_re [R, E]` and gets the same global
plan, bit for bit (no rank-0 broadcast):

1. Targets: with T valid routes, every rank computes `T // R` routes, and the `T % R` ranks with the largest
   home load (ties: lowest rank) one more.
2. Rank balancing (`balance_ranks`): repeatedly pair the rank with the largest surplus with the rank with
   the largest deficit (ties: lowest rank) and fill the receiver in one shot. A receiver is never touched
   again, so it hosts replicas of at most one remote home group: at most `epn` slots.
3. Per-donor split (`split_quotas`): the receiver with the largest remaining quota takes the donor's expert
   with the most remaining routes, `min(both)` at a time. Each move uses one slot of the receiver; with
   `B < epn` a receiver whose slots run out stops receiving and the rest stays home (best effort, reported
   by `rank_load`).
4. Slots (`assign_slots`): a receiver's replicated experts fill its slots in ascending expert id.
5. Segments (`segment_layout`): on each rank the E+B groups in row order (the E global experts, of which
   only the home ones can be non-empty, then the B slots), each non-empty one padded to a multiple of tp.
6. Routes (`route_destinations`): an expert's routes are ordered by (source rank, token, k) and the ranks
   computing it take contiguous ranges of that order, in rank order. A route's `dst` is
   `dest_rank * NvS + row`; a later route of a token to a rank the token already visits is encoded
   `-(dest_rank * NvS + row) - 1` (it carries only its weight: the receiver copies the primary row);
   an invalid route (expert -1) is `NO_ROUTE`.

This is the reference planner in plain torch; it reads the small histogram on the host (a device-to-host
read when it lives on a GPU). A GPU planner implements the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

NO_ROUTE = -(2**31)
"""`dst` of an invalid route (expert -1): not sent, contributes zero."""


@dataclass(frozen=True)
class MoonEPCommPlan:
    """Everything a step needs to move rows; identical on every rank except the rank-local fields.

    All tensors are int32, contiguous, on the rank's device. The dup tables describe this rank's *received*
    rows and are filled by `Buffer.dispatch` (the planner leaves them empty).

    Attributes:
        dst: `[S*K]` per local route: `d * NvS + row`, `-(d * NvS + row) - 1` for a later route of the same
            token to the same rank d, `NO_ROUTE` for an invalid route.
        experts_to_copy: `[R, B]` global expert held by each rank's slot, -1 for an unused slot.
        cu_seqlens: `[E+B]` this rank's padded group end offsets (groups: E experts, then B slots).
        zero_fill_ranges: `[E+B, 2]` this rank's (first padding row, padding rows) per group.
        remote_stats: `[2]` this rank's (valid routes computed on other ranks, payload rows sent to other
            ranks after deduplication).
        dup_groups: `[NvS, 3]` rows `(primary row, first index into dup_loffs, duplicates)`; the first
            `dup_counts[0]` are used, sorted by primary row.
        dup_loffs: `[NvS]` duplicate rows; the first `dup_counts[1]` are used.
        dup_counts: `[2]` (duplicate groups, duplicate rows) received by this rank.
        rank_load: `[R]` routes computed by each rank (telemetry; equal up to one when balanced).
        home_load: `[R]` routes to each rank's home experts: the load of plain expert parallelism.
        expert_load: `[E]` valid routes to each expert in the whole group (the gathered histogram's sum).
        slots_used: `[R]` slots holding a replica on each rank.
        num_routes, num_ranks, num_experts, num_slots, rows_per_rank, top_k: the scalars N, R, E, B, NvS, K.
        rank: the rank this plan belongs to; owner: id of the Buffer that made it (None: a bare plan).
    """

    dst: torch.Tensor
    experts_to_copy: torch.Tensor
    cu_seqlens: torch.Tensor
    zero_fill_ranges: torch.Tensor
    remote_stats: torch.Tensor
    dup_groups: torch.Tensor
    dup_loffs: torch.Tensor
    dup_counts: torch.Tensor
    rank_load: torch.Tensor
    home_load: torch.Tensor
    expert_load: torch.Tensor
    slots_used: torch.Tensor
    num_routes: int
    num_ranks: int
    num_experts: int
    num_slots: int
    rows_per_rank: int
    top_k: int
    rank: int
    owner: int | None = None

    N = property(lambda self: self.num_routes)
    R = property(lambda self: self.num_ranks)
    E = property(lambda self: self.num_experts)
    B = property(lambda self: self.num_slots)
    NvS = property(lambda self: self.rows_per_rank)
    K = property(lambda self: self.top_k)

    def clone(self) -> MoonEPCommPlan:
        """A deep copy: every tensor cloned (a later dispatch into the same Buffer cannot change it)."""
        return replace(self, **{f.name: getattr(self, f.name).clone() for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


@dataclass(frozen=True)
class GlobalPlan:
    """The part of a plan that is a pure function of the histogram (host lists; identical on every rank).

    `alloc[d][e]`: routes of expert e computed on rank d. `experts_to_copy[d][j]`: expert of slot j on d.
    `row_base[d][e]`: first row of expert e's segment on rank d (-1 if d does not compute e).
    `cu_seqlens[d]`, `zero_fill[d]`: rank d's E+B padded group ends and (first padding row, padding rows).
    """

    alloc: list[list[int]]
    experts_to_copy: list[list[int]]
    row_base: list[list[int]]
    cu_seqlens: list[list[int]]
    zero_fill: list[list[list[int]]]
    home_load: list[int]


def align_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` (>= 1) that is >= `value`."""
    return -(-value // multiple) * multiple


def default_slots(num_experts: int, num_ranks: int) -> int:
    """B when none is given: `E / R` (what training needs), 0 for a single rank (nothing to replicate)."""
    return num_experts // num_ranks if num_ranks > 1 else 0


def rows_capacity(S: int, K: int, R: int, E: int, B: int, token_padding: int) -> int:
    """NvS: rows a rank can receive. A rank has at most `epn + B` non-empty segments, each padded by fewer
    than tp rows. With `B >= epn` balance is exact, so a rank computes at most `S*K` routes; with `B < epn`
    it is best effort and a rank may keep all `R*S*K` routes of its home experts: static shapes must cover
    that worst case."""
    epn = E // R
    routes = S * K if B >= epn else R * S * K
    return align_up(routes + (token_padding - 1) * (epn + B), token_padding)


def rank_targets(home_load_r: list[int]) -> list[int]:
    """Routes each rank must compute: `T // R`, plus one for the `T % R` most loaded ranks (ties: lowest)."""
    num_ranks = len(home_load_r)
    base, extra = divmod(sum(home_load_r), num_ranks)
    order = sorted(range(num_ranks), key=lambda r: (-home_load_r[r], r))
    targets = [base] * num_ranks
    for r in order[:extra]:
        targets[r] += 1
    return targets


def balance_ranks(home_load_r: list[int]) -> list[tuple[int, int, int]]:
    """Greedy rank balancing: `(donor, receiver, routes)` moves that bring every rank to its target."""
    num_ranks = len(home_load_r)
    balance = [load - target for load, target in zip(home_load_r, rank_targets(home_load_r), strict=True)]
    moves = []
    for _ in range(num_ranks):
        donor = max(range(num_ranks), key=lambda r: (balance[r], -r))
        receiver = min(range(num_ranks), key=lambda r: (balance[r], r))
        if balance[donor] <= 0 or balance[receiver] >= 0:
            break
        routes = -balance[receiver]
        balance[donor] -= routes
        balance[receiver] = 0
        moves.append((donor, receiver, routes))
    return moves


def split_quotas(expert_load_e: list[int], moves: list[tuple[int, int, int]], num_ranks: int,
                 num_slots: int) -> list[list[int]]:
    """Per-donor split of the receivers' quotas over the donor's experts -> `alloc [R][E]`.

    The receiver with the largest remaining quota (ties: lowest rank) takes the donor's expert with the
    most remaining routes (ties: lowest id), `min(both)` routes at a time; each take costs the receiver one
    slot. Whatever a donor does not give away it computes itself.
    """
    num_experts = len(expert_load_e)
    epn = num_experts // num_ranks
    alloc = [[0] * num_experts for _ in range(num_ranks)]
    remaining = list(expert_load_e)
    for donor in sorted({m[0] for m in moves}):
        quota = {receiver: routes for d, receiver, routes in moves if d == donor}
        slots_left = dict.fromkeys(quota, num_slots)
        experts = range(donor * epn, (donor + 1) * epn)
        while True:
            open_receivers = [r for r in sorted(quota) if quota[r] > 0 and slots_left[r] > 0]
            expert = max(experts, key=lambda e: (remaining[e], -e))
            if not open_receivers or remaining[expert] == 0:
                break
            receiver = max(open_receivers, key=lambda r: (quota[r], -r))
            routes = min(quota[receiver], remaining[expert])
            alloc[receiver][expert] += routes
            quota[receiver] -= routes
            remaining[expert] -= routes
            slots_left[receiver] -= 1
    for e in range(num_experts):
        alloc[e // epn][e] = remaining[e]
    return alloc


def assign_slots(alloc_re: list[list[int]], num_slots: int) -> list[list[int]]:
    """`experts_to_copy [R][B]`: each rank's replicated (non-home) experts in ascending id, -1 padded."""
    num_ranks, num_experts = len(alloc_re), len(alloc_re[0])
    epn = num_experts // num_ranks
    table = []
    for d in range(num_ranks):
        remote = [e for e in range(num_experts) if alloc_re[d][e] > 0 and e // epn != d]
        if len(remote) > num_slots:
            raise AssertionError(f"rank {d} needs {len(remote)} slots, has {num_slots}")
        table.append(remote + [-1] * (num_slots - len(remote)))
    return table


def segment_layout(alloc_re: list[list[int]], experts_to_copy: list[list[int]],
                   token_padding: int) -> tuple[list[list[int]], list[list[int]], list[list[list[int]]]]:
    """Per rank d: `cu_seqlens[d] [E+B]` (padded group ends), `row_base[d] [E]` (segment start, -1 if d
    does not compute the expert) and `zero_fill[d] [E+B][2]` (first padding row, padding rows)."""
    num_ranks, num_experts = len(alloc_re), len(alloc_re[0])
    epn = num_experts // num_ranks
    cu_seqlens, row_base, zero_fill = [], [], []
    for d in range(num_ranks):
        groups = [e if e // epn == d else -1 for e in range(num_experts)] + experts_to_copy[d]
        ends, base, fill, end = [], [-1] * num_experts, [], 0
        for e in groups:
            routes = alloc_re[d][e] if e >= 0 else 0
            padded = align_up(routes, token_padding)
            if routes:
                base[e] = end
            fill.append([end + routes, padded - routes])
            end += padded
            ends.append(end)
        cu_seqlens.append(ends)
        row_base.append(base)
        zero_fill.append(fill)
    return cu_seqlens, row_base, zero_fill


def plan_global(counts_re: list[list[int]], num_slots: int, token_padding: int) -> GlobalPlan:
    """The histogram-only part of the plan (steps 1-5 of the module docstring)."""
    num_ranks, num_experts = len(counts_re), len(counts_re[0])
    epn = num_experts // num_ranks
    expert_load = [sum(col) for col in zip(*counts_re, strict=True)]
    home_load = [sum(expert_load[g * epn:(g + 1) * epn]) for g in range(num_ranks)]
    alloc = split_quotas(expert_load, balance_ranks(home_load), num_ranks, num_slots)
    experts_to_copy = assign_slots(alloc, num_slots)
    cu_seqlens, row_base, zero_fill = segment_layout(alloc, experts_to_copy, token_padding)
    return GlobalPlan(alloc, experts_to_copy, row_base, cu_seqlens, zero_fill, home_load)


def route_destinations(topk_experts_sk: torch.Tensor, counts_re: torch.Tensor, alloc_re: torch.Tensor,
                       row_base_re: torch.Tensor, rank: int, rows_per_rank: int) -> torch.Tensor:
    """`dst [S*K]` of this rank's routes (step 6 of the module docstring), duplicates and invalids encoded.

    Args:
        topk_experts_sk: `[S, K]` int, -1 = no route.
        counts_re, alloc_re, row_base_re: `[R, E]` int64 histogram, allocation and segment starts.
    """
    num_tokens, top_k = topk_experts_sk.shape
    num_experts = counts_re.shape[1]
    expert_n = topk_experts_sk.reshape(-1).long()
    valid_n = expert_n >= 0
    key_n = torch.where(valid_n, expert_n, num_experts)
    # Position of each route among this rank's routes to the same expert, in (token, k) order.
    order_n = torch.sort(key_n, stable=True).indices
    local_e = torch.bincount(key_n, minlength=num_experts + 1)
    first_e = torch.cumsum(local_e, 0) - local_e
    position_n = torch.empty_like(key_n)
    position_n[order_n] = torch.arange(key_n.numel(), device=key_n.device) - first_e[key_n[order_n]]
    expert_n = key_n.clamp(max=num_experts - 1)
    # Index in the expert's global (source rank, token, k) order; the computing ranks take ranges of it.
    global_n = (torch.cumsum(counts_re, 0) - counts_re)[rank, expert_n] + position_n
    ends_er = torch.cumsum(alloc_re, 0).t()
    dest_n = (ends_er[expert_n] <= global_n[:, None]).sum(1).clamp(max=counts_re.shape[0] - 1)
    start_n = (ends_er - alloc_re.t())[expert_n, dest_n]
    dst_n = dest_n * rows_per_rank + row_base_re[dest_n, expert_n] + global_n - start_n
    # A later route of a token to a rank it already visits carries only its weight.
    dest_sk = torch.where(valid_n, dest_n, -1).view(num_tokens, top_k)
    seen_sk = torch.zeros_like(dest_sk, dtype=torch.bool)
    for k in range(1, top_k):
        seen_sk[:, k] = ((dest_sk[:, :k] == dest_sk[:, k:k + 1]) & (dest_sk[:, k:k + 1] >= 0)).any(1)
    dst_n = torch.where(seen_sk.view(-1), -dst_n - 1, dst_n)
    return torch.where(valid_n, dst_n, NO_ROUTE).to(torch.int32)


def plan_routes(counts_re: torch.Tensor, topk_experts_sk: torch.Tensor, *, rank: int, num_slots: int,
                token_padding: int, rows_per_rank: int, owner: int | None = None) -> MoonEPCommPlan:
    """The full plan of `rank` from the gathered histogram and the rank's own routes.

    Args:
        counts_re: `[R, E]` int, valid routes from each source rank to each expert (identical on all ranks).
        topk_experts_sk: `[S, K]` int, this rank's routed experts, -1 = no route.
        num_slots: B. token_padding: tp. rows_per_rank: NvS (capacity of the dispatched rows).
    """
    num_ranks, num_experts = counts_re.shape
    device = topk_experts_sk.device
    glob = plan_global(counts_re.tolist(), num_slots, token_padding)  # host read of the [R, E] histogram

    def tensor(value: object) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.int64, device=device)

    alloc_re, row_base_re = tensor(glob.alloc), tensor(glob.row_base)
    experts_to_copy_rb = tensor(glob.experts_to_copy).view(num_ranks, num_slots)
    cu_seqlens_g = tensor(glob.cu_seqlens[rank])
    if int(cu_seqlens_g[-1]) > rows_per_rank:
        raise AssertionError(f"rank {rank} needs {int(cu_seqlens_g[-1])} rows, capacity is {rows_per_rank}")
    dst_n = route_destinations(topk_experts_sk, counts_re.to(device=device, dtype=torch.int64), alloc_re,
                               row_base_re, rank, rows_per_rank)
    dest_n, _, primary_n, valid_n = decode_dst(dst_n, rows_per_rank)
    remote_n = valid_n & (dest_n != rank)
    i32 = torch.int32
    return MoonEPCommPlan(
        dst=dst_n,
        experts_to_copy=experts_to_copy_rb.to(i32),
        cu_seqlens=cu_seqlens_g.to(i32),
        zero_fill_ranges=tensor(glob.zero_fill[rank]).view(num_experts + num_slots, 2).to(i32),
        remote_stats=torch.stack([remote_n.sum(), (remote_n & primary_n).sum()]).to(i32),
        dup_groups=torch.zeros(rows_per_rank, 3, dtype=i32, device=device),
        dup_loffs=torch.zeros(rows_per_rank, dtype=i32, device=device),
        dup_counts=torch.zeros(2, dtype=i32, device=device),
        rank_load=alloc_re.sum(1).to(i32),
        home_load=tensor(glob.home_load).to(i32),
        expert_load=alloc_re.sum(0).to(i32),
        slots_used=(experts_to_copy_rb >= 0).sum(1).to(i32),
        num_routes=topk_experts_sk.numel(),
        num_ranks=num_ranks,
        num_experts=num_experts,
        num_slots=num_slots,
        rows_per_rank=rows_per_rank,
        top_k=topk_experts_sk.shape[1],
        rank=rank,
        owner=owner,
    )


def decode_dst(dst_n: torch.Tensor, rows_per_rank: int) -> tuple[torch.Tensor, ...]:
    """`dst [N]` -> (destination rank, row, is primary, is valid), each `[N]`; rank and row are 0 where
    the route is invalid."""
    valid_n = dst_n != NO_ROUTE
    primary_n = dst_n >= 0
    raw_n = torch.where(primary_n, dst_n, -dst_n.long() - 1)
    raw_n = torch.where(valid_n, raw_n, 0).long()
    return raw_n // rows_per_rank, raw_n % rows_per_rank, primary_n, valid_n
