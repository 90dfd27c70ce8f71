"""The planner: from the group's routing histogram to where every route is computed.

Notation and suffixes: DESIGN.md, "Notation" (S, K, E, R, `epn = E / R`, B, tp, NvS; `_re`: ranks x experts).

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
   only the home ones can be non-empty, then the B slots), each non-empty one padded to a multiple of tp;
   this rank's compute groups (`compute_groups`: home experts then slots) are what an engine runs.
6. Routes (`route_destinations`): an expert's routes are ordered by (source rank, token, k) and the ranks
   computing it take contiguous ranges of that order, in rank order. A route's `dst` is
   `dest_rank * NvS + row`; with R > 1 a later route of a token to a rank the token already visits is
   encoded `-(dest_rank * NvS + row) - 1` (it carries only its weight: the receiver copies the primary row,
   so the token crosses the link once per rank); with one rank there is no link to save and every valid
   route is primary (its row written and read directly); an invalid route (expert -1) is `NO_ROUTE`.

Replication policy (`replica_cost` c, in routes: the GEMM routes whose time equals one expert's weight
transfer, `replica_cost_routes`): c = 0 is `balance='exact'`, the algorithm above. With c > 0
(`balance='cost_aware'`) a move pays only if it takes more than c routes off its donor: rank balancing stops
at the first receiver whose deficit is <= c (every later deficit is smaller) and a donor's split stops at its
first take of <= c routes (every later take is smaller); then, if the plan's hottest rank in the model
(`modelled_load`: routes computed + c per weight transfer over the rank's link) is not strictly below plain
EP's hottest rank, the whole plan falls back to plain EP (no replica, every route on its home rank). c =
`NO_REPLICATION` (`balance='off'`) moves nothing: plain EP. Balance is then best effort, so the row capacity
is that of `B < epn` (`rows_capacity`).

Two implementations of steps 1-5 compute the same global plan, bit for bit:

- `plan_global` (and its helpers) is the reference oracle: plain Python over host lists, the algorithm as
  written above. Tests compare the device planner against it.
- `plan_global_device` is what `plan_routes` runs: fixed-shape torch ops on the histogram's device with no
  host read and no value-dependent shape (no `.item()`, `.tolist()`, `nonzero`, mask indexing, `bincount`),
  so a GPU step can be captured in a CUDA graph. Its loops have trip counts fixed by R, E and B: once a
  loop of the reference would have stopped, every further iteration is masked to a no-op. Ties break with
  an explicit combined key (`_first_argmax`), never by relying on `argmax`'s tie order.

Step 6 (`route_destinations`) is one implementation, sync-free on every device.

On CUDA (with Triton) `plan_routes` runs steps 1-6 as two Triton launches instead
(`moonep_moe.comm.kernels.plan`, equal to these bit for bit); elsewhere the torch path above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moonep_moe.comm.plan_types import NO_ROUTE, MoonEPCommPlan, decode_dst


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


@dataclass(frozen=True)
class DeviceGlobalPlan:
    """`GlobalPlan` as int64 tensors on the histogram's device (same values, built without a host read).

    Attributes:
        alloc_re: `[R, E]` routes of expert e computed on rank d.
        experts_to_copy_rb: `[R, B]` expert held by each slot, -1 for an unused slot.
        row_base_re: `[R, E]` first row of expert e's segment on rank d, -1 if d does not compute e.
        cu_seqlens_rg: `[R, E+B]` each rank's padded group end offsets.
        zero_fill_rg2: `[R, E+B, 2]` each rank's (first padding row, padding rows) per group.
        home_load_r: `[R]` routes to each rank's home experts.
    """

    alloc_re: torch.Tensor
    experts_to_copy_rb: torch.Tensor
    row_base_re: torch.Tensor
    cu_seqlens_rg: torch.Tensor
    zero_fill_rg2: torch.Tensor
    home_load_r: torch.Tensor


def align_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` (>= 1) that is >= `value`."""
    return -(-value // multiple) * multiple


def default_slots(num_experts: int, num_ranks: int) -> int:
    """B when none is given: `E / R` (what training needs), 0 for a single rank (nothing to replicate)."""
    return num_experts // num_ranks if num_ranks > 1 else 0


NO_REPLICATION = 2**31 - 1
"""`replica_cost` of `balance='off'`: no move pays (a move takes fewer routes than the group's total, which
the int32 plan fields keep below 2^31), so the plan is plain EP."""


def replica_cost_routes(dtype_bytes: int, link_bytes_per_s: float, gemm_flops_per_s: float) -> int:
    """c for `balance='cost_aware'`: GEMM routes whose time equals one expert's weight transfer (ceil, >= 1).

    Moving expert e takes `W_e / BW` with `W_e = 3 * H * H' * dtype_bytes` (gate, up, down); computing one
    of its routes takes `2 * 3 * H * H' / rate` (forward). H * H' cancels: `c = dtype_bytes * rate / (2 *
    BW)`, a function of the dtype, the link bandwidth and the GEMM rate only. Forward only (serving): in
    training backward prefetches again and reduce_grad moves fp32 gradients, while the routes cost 3x the
    FLOPs, so the break-even is `(2 * dtype_bytes + 4) / (3 * dtype_bytes)` times higher (4/3 for bf16).
    """
    return max(1, math.ceil(dtype_bytes * gemm_flops_per_s / (2 * link_bytes_per_s)))


LAYOUT_NAMES = dict(E="num_experts (E={})", R="ep_size (R={})", K="top_k (K={})",
                    B="num_prefetch_slots (B={})")
"""How configs name E, R, K and B in `check_layout`'s errors (`MoEConfig`, `CommConfig`)."""


def check_layout(E: int, R: int, K: int, B: int | None, names: dict[str, str] = LAYOUT_NAMES,
                 where: str = "") -> None:
    """Raise a one-line ValueError unless E % R == 0, K <= E and 0 <= B <= E - E/R (B None: the default,
    always in range). The one check of an EP group's layout: configs, the communicator and the Buffer call
    it. `names` spells each quantity as the caller's user wrote it (a template with `{}` for the value, e.g.
    `"num_experts (E={})"` or `"E={}"`); `where` prefixes the message (e.g. `"rank 0"`)."""
    E_, R_, K_ = names["E"].format(E), names["R"].format(R), names["K"].format(K)
    problem = None
    if E % R:
        problem = f"{E_} must be divisible by {R_}"
    elif K > E:
        problem = f"{K_} must be <= {E_}"
    elif B is not None and B < 0:
        problem = f"{names['B'].format(B)} must be >= 0"
    elif B is not None and B > E - E // R:
        problem = f"{names['B'].format(B)} must be <= E - E/R = {E} - {E // R} = {E - E // R}"
    if problem is not None:
        raise ValueError(f"{where}: {problem}" if where else problem)


def rows_capacity(S: int, K: int, R: int, E: int, B: int, token_padding: int, replica_cost: int = 0) -> int:
    """NvS: rows a rank can receive. A rank has at most `epn + B` non-empty segments, each padded by fewer
    than tp rows. With `B >= epn` and exact balance (`replica_cost` 0) a rank computes at most `S*K` routes;
    with `B < epn` or a cost-aware / no replication policy it is best effort and a rank may keep all `R*S*K`
    routes of its home experts: static shapes must cover that worst case."""
    epn = E // R
    routes = S * K if B >= epn and replica_cost == 0 else R * S * K
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


def balance_ranks(home_load_r: list[int], replica_cost: int = 0) -> list[tuple[int, int, int]]:
    """Greedy rank balancing: `(donor, receiver, routes)` moves that bring every rank to its target, while
    the receiver's deficit is more than `replica_cost` routes."""
    num_ranks = len(home_load_r)
    balance = [load - target for load, target in zip(home_load_r, rank_targets(home_load_r), strict=True)]
    moves = []
    for _ in range(num_ranks):
        donor = max(range(num_ranks), key=lambda r: (balance[r], -r))
        receiver = min(range(num_ranks), key=lambda r: (balance[r], r))
        if balance[donor] <= 0 or -balance[receiver] <= replica_cost:
            break
        routes = -balance[receiver]
        balance[donor] -= routes
        balance[receiver] = 0
        moves.append((donor, receiver, routes))
    return moves


def split_quotas(expert_load_e: list[int], moves: list[tuple[int, int, int]], num_ranks: int,
                 num_slots: int, replica_cost: int = 0) -> list[list[int]]:
    """Per-donor split of the receivers' quotas over the donor's experts -> `alloc [R][E]`.

    The receiver with the largest remaining quota (ties: lowest rank) takes the donor's expert with the
    most remaining routes (ties: lowest id), `min(both)` routes at a time, while that is more than
    `replica_cost`; each take costs the receiver one slot. Whatever a donor does not give away it computes
    itself.
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


def _first_argmax(key_c: torch.Tensor) -> torch.Tensor:
    """Index of the largest entry along the last dim of `key_c [..., c]` -> `[...]`, the LOWEST index among
    ties (Python's `max(range(c), key=lambda i: (key[i], -i))`).

    The tie-break is explicit: `key * c + (c - 1 - i)` is unique per row and orders first by key (keys are
    integers, so keys that differ differ by at least c in the combined key) then by lowest index. Keys here
    are route counts (< 2^40), far from int64 overflow.
    """
    count = key_c.shape[-1]
    reverse_c = torch.arange(count - 1, -1, -1, device=key_c.device)
    return torch.argmax(key_c * count + reverse_c, dim=-1)


def _rank_targets_device(home_load_r: torch.Tensor) -> torch.Tensor:
    """`rank_targets` on the device: `[R]` -> `[R]`. Rank r gets the extra route when fewer than `T % R`
    ranks come before it in (load descending, rank ascending) order: a stable descending sort's position,
    counted with an `[R, R]` comparison."""
    num_ranks = home_load_r.shape[0]
    rank_r = torch.arange(num_ranks, device=home_load_r.device)
    load_row, load_col = home_load_r[:, None], home_load_r[None, :]
    ahead_r = ((load_col > load_row) | ((load_col == load_row) & (rank_r[None, :] < rank_r[:, None]))).sum(1)
    total = home_load_r.sum()
    return total // num_ranks + (ahead_r < total % num_ranks)


def _balance_ranks_device(home_load_r: torch.Tensor, replica_cost: int) -> torch.Tensor:
    """`balance_ranks` on the device: `[R]` home loads -> `quota_dr [R, R]`, routes donor d gives receiver r.

    Same R iterations as the reference. An iteration that fails the reference's stop test changes nothing,
    so every later one fails it too: masking it to a no-op is the reference's `break`. A receiver appears
    in at most one move (its balance becomes 0 and only ranks with non-zero balance move), so a `[R, R]`
    matrix holds the moves without loss.
    """
    num_ranks = home_load_r.shape[0]
    rank_r = torch.arange(num_ranks, device=home_load_r.device)
    balance_r = home_load_r - _rank_targets_device(home_load_r)
    quota_dr = torch.zeros(num_ranks, num_ranks, dtype=torch.int64, device=home_load_r.device)
    for _ in range(num_ranks):
        donor_r = rank_r == _first_argmax(balance_r)
        receiver_r = rank_r == _first_argmax(-balance_r)
        surplus, deficit = (balance_r * donor_r).sum(), -(balance_r * receiver_r).sum()
        routes = torch.where((surplus > 0) & (deficit > replica_cost), deficit, 0)
        balance_r = balance_r + routes * (receiver_r.long() - donor_r.long())
        quota_dr = quota_dr + routes * (donor_r[:, None] & receiver_r[None, :])
    return quota_dr


def split_iterations(num_ranks: int, num_experts: int, num_slots: int) -> int:
    """Iterations of the device per-donor split that cover every donor's reference loop.

    In an iteration that moves routes, `min(quota, remaining)` routes leave both the receiver's quota and
    the expert; afterwards one of them is 0 and stays 0 (both only decrease), so that receiver is never
    open again or that expert never again has routes to give. A donor has at most R - 1 receivers and epn
    experts: at most `R - 1 + epn` moving iterations. Each move also spends one of its receiver's B slots:
    at most `(R - 1) * B`. The smaller bound holds for every donor; further iterations would be no-ops.
    """
    return min(num_ranks - 1 + num_experts // num_ranks, (num_ranks - 1) * num_slots)


def _split_quotas_device(expert_load_e: torch.Tensor, quota_dr: torch.Tensor, num_slots: int,
                         replica_cost: int) -> torch.Tensor:
    """`split_quotas` on the device for all donors at once -> `alloc_re [R, E]`.

    Each iteration every donor d makes at most one move of the reference loop: its expert with the most
    remaining routes (ties: lowest id) goes to its open receiver (positive quota and a free slot) with the
    largest quota (ties: lowest rank), if that moves more than `replica_cost` routes. A donor whose
    reference loop has stopped moves 0 routes (its state no longer changes, so it stays stopped). The argmax
    keys of `_first_argmax` are kept up to date in place (`remaining_key_dx [R, epn]`: remaining * epn +
    epn - 1 - j) instead of being rebuilt each iteration. Receivers of different donors are distinct, so the
    moves of one iteration never collide; they are added to `alloc` once, after the loop.
    """
    num_ranks, num_experts = quota_dr.shape[0], expert_load_e.shape[0]
    epn = num_experts // num_ranks
    device = expert_load_e.device
    reverse_r = torch.arange(num_ranks - 1, -1, -1, device=device)
    remaining_key_dx = expert_load_e.view(num_ranks, epn) * epn + torch.arange(epn - 1, -1, -1, device=device)
    slots_left_dr = torch.where(quota_dr > 0, num_slots, 0)
    receivers, experts, routes = [], [], []
    for _ in range(split_iterations(num_ranks, num_experts, num_slots)):
        expert_d1 = remaining_key_dx.argmax(1, keepdim=True)
        open_key_dr = torch.where((quota_dr > 0) & (slots_left_dr > 0), quota_dr * num_ranks + reverse_r, -1)
        receiver_d1 = open_key_dr.argmax(1, keepdim=True)
        # A closed receiver decodes to quota -1, an exhausted expert to 0 remaining: both move 0 routes.
        take_d1 = torch.minimum(open_key_dr.gather(1, receiver_d1).div(num_ranks, rounding_mode="floor"),
                                remaining_key_dx.gather(1, expert_d1) // epn)
        routes_d1 = torch.where(take_d1 > replica_cost, take_d1, 0)
        quota_dr = quota_dr.scatter_add(1, receiver_d1, -routes_d1)
        remaining_key_dx = remaining_key_dx.scatter_add(1, expert_d1, -routes_d1 * epn)
        slots_left_dr = slots_left_dr.scatter_add(1, receiver_d1, -(routes_d1 > 0).long())
        receivers.append(receiver_d1)
        experts.append(expert_d1)
        routes.append(routes_d1)
    # What a donor does not give away it computes itself (receivers are never donors: home cells are 0).
    home_re = _home_mask_re(num_ranks, num_experts, device)
    alloc_re = torch.where(home_re, (remaining_key_dx // epn).view(1, num_experts), 0)
    if routes:
        first_expert_1d1 = torch.arange(0, num_experts, epn, device=device)[None, :, None]  # donor's first
        cell_n = (torch.stack(receivers) * num_experts + first_expert_1d1 + torch.stack(experts)).view(-1)
        alloc_re = alloc_re.view(-1).index_add(0, cell_n, torch.stack(routes).view(-1)).view_as(alloc_re)
    return alloc_re


def _home_mask_re(num_ranks: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """`[R, E]` bool: expert e is a home expert of rank d."""
    home_rank_e = torch.arange(num_experts, device=device) // (num_experts // num_ranks)
    return home_rank_e[None, :] == torch.arange(num_ranks, device=device)[:, None]


def modelled_load_device(alloc_re: torch.Tensor, replica_cost: int) -> torch.Tensor:
    """`modelled_load` on the device: `alloc_re [R, E]` -> `[R]` routes computed + `replica_cost` per weight
    transfer received or sent."""
    num_ranks, num_experts = alloc_re.shape
    replica_re = (alloc_re > 0) & ~_home_mask_re(num_ranks, num_experts, alloc_re.device)
    transfers_r = replica_re.sum(1) + replica_re.sum(0).view(num_ranks, -1).sum(1)
    return alloc_re.sum(1) + replica_cost * transfers_r


def plan_global_device(counts_re: torch.Tensor, num_slots: int, token_padding: int,
                       replica_cost: int = 0) -> DeviceGlobalPlan:
    """`plan_global` on the histogram's device, equal to it bit for bit, with no host read.

    Args:
        counts_re: `[R, E]` int, valid routes from each source rank to each expert.
        num_slots: B. token_padding: tp. replica_cost: the policy (module docstring; 0 = exact).
    """
    num_ranks, num_experts = counts_re.shape
    device = counts_re.device
    expert_load_e = counts_re.long().sum(0)
    home_load_r = expert_load_e.view(num_ranks, -1).sum(1)
    quota_dr = _balance_ranks_device(home_load_r, replica_cost)
    alloc_re = _split_quotas_device(expert_load_e, quota_dr, num_slots, replica_cost)
    home_re = _home_mask_re(num_ranks, num_experts, device)
    if replica_cost:  # fall back to plain EP unless the modelled hottest rank gets faster (a device select)
        pays = modelled_load_device(alloc_re, replica_cost).max() < home_load_r.max()
        alloc_re = torch.where(pays, alloc_re, torch.where(home_re, expert_load_e, 0))
    # Slots: a rank's replicas in ascending expert id. Non-replicas go to distinct sentinel columns B + e
    # (every scatter index unique). A rank never has more than B replicas (each take costs one slot and a
    # receiver takes an expert once); the clamp only keeps indices in range.
    expert_e = torch.arange(num_experts, device=device)
    replica_re = (alloc_re > 0) & ~home_re
    slot_re = torch.where(replica_re, (replica_re.cumsum(1) - 1).clamp(max=num_slots), num_slots + expert_e)
    # c: the B slots, then a sentinel column per expert
    unset_rc = torch.full((num_ranks, num_slots + num_experts), -1, dtype=torch.int64, device=device)
    experts_to_copy_rb = unset_rc.scatter(1, slot_re, expert_e.expand(num_ranks, -1))[:, :num_slots]
    # Segments: the E expert groups (only home ones non-empty), then the B slots, each padded to tp.
    used_rb = experts_to_copy_rb >= 0
    slot_routes_rb = torch.where(used_rb, alloc_re.gather(1, experts_to_copy_rb.clamp(min=0)), 0)
    routes_rg = torch.cat([torch.where(home_re, alloc_re, 0), slot_routes_rb], 1)
    padded_rg = (routes_rg + token_padding - 1) // token_padding * token_padding
    cu_seqlens_rg = padded_rg.cumsum(1)
    start_rg = cu_seqlens_rg - padded_rg
    zero_fill_rg2 = torch.stack([start_rg + routes_rg, padded_rg - routes_rg], -1)
    base_rg = torch.where(routes_rg > 0, start_rg, -1)
    # Row bases: home experts' from their groups, replicas' scattered from their slots (an unused slot j
    # writes to its own sentinel column E + j, dropped).
    sentinel_b = num_experts + torch.arange(num_slots, device=device)
    slot_col_rb = torch.where(used_rb, experts_to_copy_rb, sentinel_b)
    row_base_rg = torch.cat([torch.where(home_re, base_rg[:, :num_experts], -1), base_rg[:, num_experts:]], 1)
    row_base_re = row_base_rg.scatter(1, slot_col_rb, base_rg[:, num_experts:])[:, :num_experts]
    return DeviceGlobalPlan(alloc_re, experts_to_copy_rb, row_base_re, cu_seqlens_rg, zero_fill_rg2,
                            home_load_r)


def route_destinations(topk_experts_sk: torch.Tensor, counts_re: torch.Tensor, alloc_re: torch.Tensor,
                       row_base_re: torch.Tensor, rank: int, rows_per_rank: int) -> torch.Tensor:
    """`dst [S*K]` of this rank's routes (step 6 of the module docstring), duplicates and invalids encoded.

    Fixed-shape ops only (a stable sort, a `scatter_add_` histogram of fixed size E+1, cumsums, gathers):
    no host read on any device.

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
    local_e = torch.zeros(num_experts + 1, dtype=torch.int64, device=key_n.device)
    local_e.scatter_add_(0, key_n, torch.ones_like(key_n))
    first_e = torch.cumsum(local_e, 0) - local_e
    sorted_position_n = torch.arange(key_n.numel(), device=key_n.device) - first_e[key_n[order_n]]
    position_n = torch.empty_like(key_n).scatter_(0, order_n, sorted_position_n)
    expert_n = key_n.clamp(max=num_experts - 1)
    # Index in the expert's global (source rank, token, k) order; the computing ranks take ranges of it.
    global_n = (torch.cumsum(counts_re, 0) - counts_re)[rank, expert_n] + position_n
    ends_er = torch.cumsum(alloc_re, 0).t()
    dest_n = (ends_er[expert_n] <= global_n[:, None]).sum(1).clamp(max=counts_re.shape[0] - 1)
    start_n = (ends_er - alloc_re.t())[expert_n, dest_n]
    dst_n = dest_n * rows_per_rank + row_base_re[dest_n, expert_n] + global_n - start_n
    # With R > 1, a later route of a token to a rank it already visits carries only its weight.
    dest_sk = torch.where(valid_n & (counts_re.shape[0] > 1), dest_n, -1).view(num_tokens, top_k)
    earlier_kk = torch.ones(top_k, top_k, dtype=torch.bool, device=key_n.device).tril(-1)
    seen_sk = ((dest_sk[:, :, None] == dest_sk[:, None, :]) & earlier_kk).any(2) & (dest_sk >= 0)
    dst_n = torch.where(seen_sk.view(-1), -dst_n - 1, dst_n)
    return torch.where(valid_n, dst_n, NO_ROUTE).to(torch.int32)


def _use_triton(topk_experts_sk: torch.Tensor) -> bool:
    """The one place that picks the planner kernels: CUDA routes with Triton installed."""
    if not topk_experts_sk.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compute_groups(cu_seqlens_g: torch.Tensor, padding_g: torch.Tensor, experts_to_copy_b: torch.Tensor,
                   rank: int, experts_per_rank: int) -> torch.Tensor:
    """`[3, epn+B]` the plan's `compute_groups` of `rank`: from its `[E+B]` group ends and padding rows and
    its `[B]` slot experts, the (padded end, routes, expert) of its home groups, then of its slots. The
    groups before, between and after them are empty on this rank, so each one starts at the previous end."""
    num_experts = cu_seqlens_g.shape[0] - experts_to_copy_b.shape[0]
    mine_g = torch.cat([torch.arange(rank * experts_per_rank, (rank + 1) * experts_per_rank),
                        torch.arange(num_experts, cu_seqlens_g.shape[0])]).to(cu_seqlens_g.device)
    ends_g = cu_seqlens_g.long()[mine_g]
    routes_g = torch.diff(ends_g, prepend=ends_g.new_zeros(1)) - padding_g.long()[mine_g]
    experts_g = torch.cat([mine_g[:experts_per_rank], experts_to_copy_b.long()])
    return torch.stack([ends_g, routes_g, experts_g])


def expert_histogram(topk_experts_sk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[E]` int64 valid routes per expert of `topk_experts_sk [s, K]` (ids outside [0, E) count nowhere), on
    the ids' device with no host read (unlike `bincount`, whose length is read): on CUDA with Triton one
    launch (`expert_histogram_triton`), elsewhere a fixed-shape scatter-add."""
    if _use_triton(topk_experts_sk):
        from moonep_moe.comm.kernels.plan import expert_histogram_triton

        return expert_histogram_triton(topk_experts_sk, num_experts)
    ids_n = topk_experts_sk.reshape(-1).long()
    valid_n = (ids_n >= 0) & (ids_n < num_experts)
    counts_e = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids_n.device)
    counts_e.index_add_(0, torch.where(valid_n, ids_n, num_experts), valid_n.long())
    return counts_e[:num_experts]


def plan_routes(counts_re: torch.Tensor, topk_experts_sk: torch.Tensor, *, rank: int, num_slots: int,
                token_padding: int, rows_per_rank: int, owner: int | None = None,
                replica_cost: int = 0) -> MoonEPCommPlan:
    """The full plan of `rank` from the gathered histogram and the rank's own routes, built on the device of
    `topk_experts_sk` without a host read: on CUDA with Triton by `plan_routes_triton` (two launches),
    elsewhere by `plan_global_device` and `route_destinations`.

    Only on the CPU does it check that this rank's rows fit (`cu_seqlens[-1] <= NvS`, a host read): on other
    devices the check would sync. `rows_capacity` guarantees it by construction; the CPU tests check it.

    Args:
        counts_re: `[R, E]` int, valid routes from each source rank to each expert (identical on all ranks).
        topk_experts_sk: `[S, K]` int, this rank's routed experts, -1 = no route.
        num_slots: B. token_padding: tp. rows_per_rank: NvS (capacity of the dispatched rows).
        replica_cost: the replication policy (module docstring): 0 exact balance (default), c > 0 cost-aware
            (a replica must take more than c routes off its donor), `NO_REPLICATION` plain EP.
    """
    if _use_triton(topk_experts_sk):
        from moonep_moe.comm.kernels.plan import plan_routes_triton

        return plan_routes_triton(counts_re, topk_experts_sk, rank=rank, num_slots=num_slots,
                                  token_padding=token_padding, rows_per_rank=rows_per_rank, owner=owner,
                                  replica_cost=replica_cost)
    num_ranks, num_experts = counts_re.shape
    device = topk_experts_sk.device
    counts_re = counts_re.to(device=device, dtype=torch.int64)
    glob = plan_global_device(counts_re, num_slots, token_padding, replica_cost)
    cu_seqlens_g = glob.cu_seqlens_rg[rank]
    if device.type == "cpu" and int(cu_seqlens_g[-1]) > rows_per_rank:
        raise AssertionError(f"rank {rank} needs {int(cu_seqlens_g[-1])} rows, capacity is {rows_per_rank}")
    dst_n = route_destinations(topk_experts_sk, counts_re, glob.alloc_re, glob.row_base_re, rank,
                               rows_per_rank)
    dest_n, _, primary_n, valid_n = decode_dst(dst_n, rows_per_rank)
    remote_n = valid_n & (dest_n != rank)
    num_tokens, top_k = topk_experts_sk.shape
    plan = MoonEPCommPlan.empty(num_tokens=num_tokens, top_k=top_k, num_ranks=num_ranks,
                                num_experts=num_experts, num_slots=num_slots, rows_per_rank=rows_per_rank,
                                rank=rank, device=device, owner=owner)
    values = dict(dst=dst_n, experts_to_copy=glob.experts_to_copy_rb, cu_seqlens=cu_seqlens_g,
                  zero_fill_ranges=glob.zero_fill_rg2[rank],
                  remote_stats=torch.stack([remote_n.sum(), (remote_n & primary_n).sum()]),
                  rank_load=glob.alloc_re.sum(1), home_load=glob.home_load_r,
                  expert_load=glob.alloc_re.sum(0), slots_used=(glob.experts_to_copy_rb >= 0).sum(1),
                  compute_groups=compute_groups(cu_seqlens_g, glob.zero_fill_rg2[rank, :, 1],
                                                glob.experts_to_copy_rb[rank], rank,
                                                num_experts // num_ranks))
    for name, value in values.items():
        getattr(plan, name).copy_(value)
    plan.dup_tables.zero_()
    return plan


def plan_one_rank(topk_experts_sk: torch.Tensor, num_experts: int, *, num_slots: int, token_padding: int,
                  rows_per_rank: int, owner: int | None = None, replica_cost: int = 0) -> MoonEPCommPlan:
    """`plan_routes` of a one-rank group (R = 1), whose histogram is its own routes' and needs no gathering:
    on CUDA with Triton counted inside the planner's first launch (no histogram launch), elsewhere by
    `expert_histogram`. Args: as `plan_routes`, with E = `num_experts`."""
    kwargs = dict(rank=0, num_slots=num_slots, token_padding=token_padding, rows_per_rank=rows_per_rank,
                  owner=owner, replica_cost=replica_cost)
    if _use_triton(topk_experts_sk):
        from moonep_moe.comm.kernels.plan import plan_routes_triton

        counts_re = torch.empty(1, num_experts, dtype=torch.int64, device=topk_experts_sk.device)
        return plan_routes_triton(counts_re, topk_experts_sk, count_routes=True, **kwargs)
    return plan_routes(expert_histogram(topk_experts_sk, num_experts)[None], topk_experts_sk, **kwargs)
