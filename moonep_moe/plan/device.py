"""The device planner: steps 1-6 of `moonep_moe.plan` in fixed-shape torch ops on the histogram's device,
with no host read and no value-dependent shape (no `.item()`, `.tolist()`, `nonzero`, mask indexing,
`bincount`), so a GPU step can be captured in a CUDA graph. Its loops have trip counts fixed by R, E and B:
once a loop of the reference would have stopped, every further iteration is masked to a no-op. Ties break
with an explicit combined key (`_first_argmax`), never by relying on `argmax`'s tie order. Equal to
`reference.plan_global` bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonep_moe.plan.types import NO_ROUTE


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
    so every later one fails it too: masking it to a no-op is the reference's `break`. A (donor, receiver)
    pair moves at most once (afterwards the donor's surplus or the receiver's deficit is 0, and only ranks
    with non-zero balance move), so a `[R, R]` matrix holds the moves without loss.
    """
    num_ranks = home_load_r.shape[0]
    rank_r = torch.arange(num_ranks, device=home_load_r.device)
    balance_r = home_load_r - _rank_targets_device(home_load_r)
    quota_dr = torch.zeros(num_ranks, num_ranks, dtype=torch.int64, device=home_load_r.device)
    for _ in range(num_ranks):
        donor_r = rank_r == _first_argmax(balance_r)
        receiver_r = rank_r == _first_argmax(-balance_r)
        surplus, deficit = (balance_r * donor_r).sum(), -(balance_r * receiver_r).sum()
        move = torch.minimum(surplus, deficit) if replica_cost else deficit
        routes = torch.where((surplus > 0) & (move > replica_cost), move, 0)
        balance_r = balance_r + routes * (receiver_r.long() - donor_r.long())
        quota_dr = quota_dr + routes * (donor_r[:, None] & receiver_r[None, :])
    return quota_dr


def split_iterations(num_ranks: int, num_experts: int, num_slots: int, shared_receivers: bool) -> int:
    """Iterations of the device per-donor split that cover the reference's loops.

    In an iteration that moves routes, `min(quota, remaining)` routes leave both the receiver's quota and
    the expert; afterwards one of them is 0 and stays 0 (both only decrease), so that (donor, receiver)
    quota is never open again or that expert never again has routes to give. Each move also spends one of
    its receiver's B slots. Without `shared_receivers` (exact balance: a receiver has one donor) the donors
    move side by side, each at most `R - 1 + epn` times (its receivers and experts) and `(R - 1) * B`
    times (its receivers' slots). With them, at least one donor moves in every iteration until all have
    stopped, and the group makes at most `R - 1 + E` moves (the rank balancing's at most R - 1 quotas and
    the experts) and `(R - 1) * B` (the receivers' slots). Further iterations would be no-ops.
    """
    spans = num_experts if shared_receivers else num_experts // num_ranks
    return min(num_ranks - 1 + spans, (num_ranks - 1) * num_slots)


def _split_quotas_device(expert_load_e: torch.Tensor, quota_dr: torch.Tensor, num_slots: int,
                         replica_cost: int, stop_early: bool) -> torch.Tensor:
    """`split_quotas` on the device for all donors at once -> `alloc_re [R, E]`.

    Each iteration every donor d makes at most one move of the reference loop: its expert with the most
    remaining routes (ties: lowest id) goes to its open receiver (positive quota and a free slot) with the
    largest quota (ties: lowest rank), if that moves more than `replica_cost` routes. A donor whose
    reference loop has stopped moves 0 routes: its quotas and experts change only by its own moves and its
    receivers' slots only decrease, so its take only shrinks and it stays stopped. With `replica_cost` > 0
    a receiver may have several donors, which the reference runs in ascending rank: a donor that shares a
    receiver with a lower donor still moving waits, so each receiver's slots go to its donors in the
    reference's order, and donors that move in one iteration have distinct receivers. The argmax keys of
    `_first_argmax` are kept up to date in place (`remaining_key_dx [R, epn]`: remaining * epn + epn - 1 -
    j) instead of being rebuilt each iteration. Donors give only their own experts, so the moves of one
    iteration land in distinct cells; they are added to `alloc` once, after the loop. An iteration in which
    no donor moves leaves the state as it was, so every later one moves nothing too: with `stop_early` (on
    the CPU, where reading that costs nothing) the loop stops there, else it runs its fixed trip count with
    no host read.
    """
    num_ranks, num_experts = quota_dr.shape[0], expert_load_e.shape[0]
    epn = num_experts // num_ranks
    device = expert_load_e.device
    reverse_r = torch.arange(num_ranks - 1, -1, -1, device=device)
    donor_d1 = torch.arange(num_ranks, device=device)[:, None]
    remaining_key_dx = expert_load_e.view(num_ranks, epn) * epn + torch.arange(epn - 1, -1, -1, device=device)
    slots_left_r = torch.full((num_ranks,), num_slots, dtype=torch.int64, device=device)
    receivers, experts, routes = [], [], []
    for _ in range(split_iterations(num_ranks, num_experts, num_slots, shared_receivers=replica_cost > 0)):
        expert_d1 = remaining_key_dx.argmax(1, keepdim=True)
        open_key_dr = torch.where((quota_dr > 0) & (slots_left_r > 0), quota_dr * num_ranks + reverse_r, -1)
        receiver_d1 = open_key_dr.argmax(1, keepdim=True)
        # A closed receiver decodes to quota -1, an exhausted expert to 0 remaining: both move 0 routes.
        take_d1 = torch.minimum(open_key_dr.gather(1, receiver_d1).div(num_ranks, rounding_mode="floor"),
                                remaining_key_dx.gather(1, expert_d1) // epn)
        moves_d1 = take_d1 > replica_cost
        if replica_cost:  # wait where a lower donor still moving gives to one of this donor's receivers
            gives_dr = quota_dr > 0
            first_r = torch.where(gives_dr & moves_d1, donor_d1, num_ranks).amin(0)  # lowest moving giver
            moves_d1 = moves_d1 & ~(gives_dr & (first_r < donor_d1)).any(1, keepdim=True)
        if stop_early and not moves_d1.any():
            break
        routes_d1 = torch.where(moves_d1, take_d1, 0)
        quota_dr = quota_dr.scatter_add(1, receiver_d1, -routes_d1)
        remaining_key_dx = remaining_key_dx.scatter_add(1, expert_d1, -routes_d1 * epn)
        slots_left_r = slots_left_r.scatter_add(0, receiver_d1.view(-1), -moves_d1.view(-1).long())
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
    alloc_re = _split_quotas_device(expert_load_e, quota_dr, num_slots, replica_cost,
                                    stop_early=device.type == "cpu")
    home_re = _home_mask_re(num_ranks, num_experts, device)
    if replica_cost:  # fall back to plain EP unless the modelled hottest rank gets faster (a device select)
        pays = modelled_load_device(alloc_re, replica_cost).max() < home_load_r.max()
        alloc_re = torch.where(pays, alloc_re, torch.where(home_re, expert_load_e, 0))
    # Slots: a rank's replicas in ascending expert id. Non-replicas go to distinct sentinel columns B + e
    # (every scatter index unique). A rank never has more than B replicas (each take costs one of its slots
    # and a receiver takes an expert once); the clamp only keeps indices in range.
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
