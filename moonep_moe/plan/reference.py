"""The reference planner (steps 1-5 of the package docstring, `moonep_moe.plan`): plain Python over host
lists, the algorithm as written, what the tests compare the device and Triton planners against."""

from __future__ import annotations

from dataclasses import dataclass

from moonep_moe.base.sizes import align_up


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


def rank_targets(home_load_r: list[int]) -> list[int]:
    """Routes each rank must compute: `T // R`, plus one for the `T % R` most loaded ranks (ties: lowest)."""
    num_ranks = len(home_load_r)
    base, extra = divmod(sum(home_load_r), num_ranks)
    order = sorted(range(num_ranks), key=lambda r: (-home_load_r[r], r))
    targets = [base] * num_ranks
    for r in order[:extra]:
        targets[r] += 1
    return targets


def balance_ranks(home_load_r: list[int], replica_cost: int = 0) -> list[tuple[int, int, int]]:
    """Greedy rank balancing: `(donor, receiver, routes)` moves that bring the ranks to their targets.

    Exact (`replica_cost` 0): a move fills the receiver's whole deficit, so each receiver has one donor. With
    `replica_cost` c > 0 a move takes at most the donor's surplus, so no donor turns receiver (it would pay
    for transfers both ways) and a receiver may have several donors; balancing stops at the first move of at
    most c routes (every later move is smaller)."""
    num_ranks = len(home_load_r)
    balance = [load - target for load, target in zip(home_load_r, rank_targets(home_load_r), strict=True)]
    moves = []
    for _ in range(num_ranks):
        donor = max(range(num_ranks), key=lambda r: (balance[r], -r))
        receiver = min(range(num_ranks), key=lambda r: (balance[r], r))
        routes = min(balance[donor], -balance[receiver]) if replica_cost else -balance[receiver]
        if balance[donor] <= 0 or routes <= replica_cost:
            break
        balance[donor] -= routes
        balance[receiver] += routes
        moves.append((donor, receiver, routes))
    return moves


def split_quotas(expert_load_e: list[int], moves: list[tuple[int, int, int]], num_ranks: int,
                 num_slots: int, replica_cost: int = 0) -> list[list[int]]:
    """Per-donor split of the receivers' quotas over the donor's experts -> `alloc [R][E]`.

    The receiver with the largest remaining quota (ties: lowest rank) takes the donor's expert with the
    most remaining routes (ties: lowest id), `min(both)` routes at a time, while that is more than
    `replica_cost`; each take costs the receiver one of its slots. Donors go in ascending rank, so a
    receiver with several donors (`replica_cost` > 0) gives its slots to them in that order. Whatever a
    donor does not give away it computes itself.
    """
    num_experts = len(expert_load_e)
    epn = num_experts // num_ranks
    alloc = [[0] * num_experts for _ in range(num_ranks)]
    remaining = list(expert_load_e)
    slots_left = [num_slots] * num_ranks
    for donor in sorted({m[0] for m in moves}):
        quota = {receiver: routes for d, receiver, routes in moves if d == donor}
        experts = range(donor * epn, (donor + 1) * epn)
        while True:
            open_receivers = [r for r in sorted(quota) if quota[r] > 0 and slots_left[r] > 0]
            expert = max(experts, key=lambda e: (remaining[e], -e))
            if not open_receivers or remaining[expert] == 0:
                break
            receiver = max(open_receivers, key=lambda r: (quota[r], -r))
            routes = min(quota[receiver], remaining[expert])
            if routes <= replica_cost:
                break
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


def modelled_load(alloc_re: list[list[int]], replica_cost: int) -> list[int]:
    """Each rank's modelled time in routes: the routes it computes plus `replica_cost` per weight transfer
    over its link (replicas it receives, replicas of its home experts it sends). Transfers are assumed to
    overlap with nothing (the worst case), and a donor's transfers to share its link."""
    num_ranks, num_experts = len(alloc_re), len(alloc_re[0])
    epn = num_experts // num_ranks
    transfers = [0] * num_ranks
    for d in range(num_ranks):
        for e in range(num_experts):
            if alloc_re[d][e] > 0 and e // epn != d:
                transfers[d] += 1
                transfers[e // epn] += 1
    return [sum(alloc_re[d]) + replica_cost * transfers[d] for d in range(num_ranks)]


def plan_global(counts_re: list[list[int]], num_slots: int, token_padding: int,
                replica_cost: int = 0) -> GlobalPlan:
    """The histogram-only part of the plan (steps 1-5 of the module docstring; the policy `replica_cost`)."""
    num_ranks, num_experts = len(counts_re), len(counts_re[0])
    epn = num_experts // num_ranks
    expert_load = [sum(col) for col in zip(*counts_re, strict=True)]
    home_load = [sum(expert_load[g * epn:(g + 1) * epn]) for g in range(num_ranks)]
    alloc = split_quotas(expert_load, balance_ranks(home_load, replica_cost), num_ranks, num_slots,
                         replica_cost)
    if replica_cost and max(modelled_load(alloc, replica_cost)) >= max(home_load):  # plain EP
        alloc = [[n if e // epn == d else 0 for e, n in enumerate(expert_load)] for d in range(num_ranks)]
    experts_to_copy = assign_slots(alloc, num_slots)
    cu_seqlens, row_base, zero_fill = segment_layout(alloc, experts_to_copy, token_padding)
    return GlobalPlan(alloc, experts_to_copy, row_base, cu_seqlens, zero_fill, home_load)


