"""The planner as two Triton launches: the gathered histogram and the rank's routes -> `MoonEPCommPlan`.

The contract is `moonep_moe.plan` (package docstring, steps 1-6); this is its GPU implementation, equal to
the reference bit for bit, with no host read (every size is a launch constant; nothing is read back).

Notation and suffixes: DESIGN.md, "Notation", except the global program's tile axes, local to this file:
`R_P`, `W`, `B_P`, `K_P`, `E_P` are padded powers of two, and `_wg` tiles are indexed by (expert-in-group
or rank w, home group or rank g; g is not a compute group here): `[W, R_P]` with
`W = max(R_P, epn padded)` so that donor x expert and donor x receiver matrices share one shape (and one
register layout: their row reductions meet without a layout conversion). `_dwg`: (computing rank d, w, g).

Launch 1, `_plan_kernel` (grid `nb + 1`), two kinds of program that run side by side:

- programs `0 .. nb-1` each take a block of `TOK` tokens and write, for every valid route, its position
  among the block's earlier routes to the same expert in (token, k) order (`position_n`), and the block's
  expert histogram (`block_counts_be`); they also zero the dup tables (the planner leaves them empty);
- the last program plans the group (steps 1-5): rank balancing and the per-donor split as loops that stop
  when nothing moves (the reference's `break`; each moving iteration exhausts a receiver or an expert; a
  move of at most `replica_cost` routes is no move), the policy's fallback to plain EP (`replica_cost` > 0:
  unless the modelled hottest rank gets faster, the moves are dropped), then every rank's segments at
  once, and writes the plan's global fields, this rank's `compute_groups`, and two `[E, R]` tables for
  launch 2:
  `ends_er[e, d]` (routes of expert e computed on ranks `<= d`) and `offset_er[e, d]`
  (`d * NvS + row_base[d, e] - start`: a route with index i in e's group order on d lands at
  `offset + i`), and `before_e` (routes of expert e on ranks before this one). With one rank it is
  `_one_rank_plan`: the same fields without the loops (nothing to balance), and with `count_routes` it
  counts the rank's routes itself (no histogram launch before it: one rank has nothing to gather).

One rank whose routes fit one token block (a decode step: s <= TOK tokens) is planned in one program
(`FUSED`): the block's positions, `_one_rank_plan`, then launch 2's work for that block, with no launch 2.

Launch 2, `_destinations_kernel` (grid `nb`): block b adds the histograms of blocks `< b` to `before_e`,
so every route gets its index in its expert's (source rank, token, k) order; its destination rank is the
number of `ends_er[e, :]` at or below the index; duplicates (R > 1: a later k of the same token to the same
rank) are encoded `-dst - 1`, invalid routes `NO_ROUTE`; `remote_stats` is summed with integer atomics
(exact in any order).

Limits: the group's total routes and `R * NvS` below 2^31 (int32 plan fields), expert ids in [-1, E)
(`Buffer(validate=True)` checks them; an id outside is treated as no route, never read out of bounds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moonep_moe.base.sizes import align_up, cdiv, next_power_of_2
from moonep_moe.plan.histogram import HISTOGRAM_ROUTES, count_routes
from moonep_moe.plan.types import NO_ROUTE, MoonEPCommPlan

ROUTES_PER_BLOCK = 512
"""The most routes (tokens x padded K) a block program takes: S=8192, K=8 gives 128 blocks (the H200 sweep of
256 .. 2048 in `bench.plan` put 512 first)."""
BLOCKS = 128
"""Block programs a launch aims for (about the H200's 132 SMs): smaller steps get smaller blocks, down to one
loop step each, since a block's loop steps run one after another (a decode step's 8 tokens in one block of
64 tokens took 8 steps, ~1 us each)."""
PLAN_WARPS = 8
"""Warps of launch 1 (the global program's loops reduce across them; `bench.plan` sweeps the choice)."""
DESTINATION_WARPS = 8
"""Warps of launch 2 (`bench.plan` sweeps them)."""
ZERO_CHUNK = tl.constexpr(1024)
"""Elements a block program zeroes per store of the dup tables."""
BIG = tl.constexpr(2**31 - 1)
_PLAN_CONSTANTS = ("R", "E", "B", "TP", "NVS", "K", "R_P", "W", "B_P", "DC", "K_P", "E_P", "TOK", "SUB",
                   "G_P", "COUNT", "ROUTES", "FUSED", "SUB2", "NB_CHUNK")


@triton.jit
def _block_positions(topk_ptr, num_tokens, position_ptr, block_counts_ptr, dup_ptr, dup_numel, dup_share,
                     block, E: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr,
                     TOK: tl.constexpr, SUB: tl.constexpr):
    """Block `block`: each valid route's position among the block's routes to its expert (token, k order),
    and the block's histogram `[E]`; a slice of the dup tables zeroed."""
    C: tl.constexpr = SUB * K_P
    i_c = tl.arange(0, C)
    earlier_cc = i_c[None, :] < i_c[:, None]
    seen_e = tl.zeros([E_P], tl.int32)
    for t0 in range(0, TOK, SUB):
        token_c = block * TOK + t0 + i_c // K_P
        k_c = i_c % K_P
        route_c = token_c * K + k_c
        expert_c = tl.load(topk_ptr + route_c, mask=(k_c < K) & (token_c < num_tokens), other=-1).to(tl.int32)
        valid_c = (expert_c >= 0) & (expert_c < E)
        expert_c = tl.where(valid_c, expert_c, 0)
        same_cc = (expert_c[:, None] == expert_c[None, :]) & valid_c[None, :] & earlier_cc
        position_c = tl.gather(seen_e, expert_c, 0) + tl.sum(same_cc.to(tl.int32), 1)
        tl.store(position_ptr + route_c, position_c, mask=valid_c)
        seen_e += tl.histogram(expert_c, E_P, mask=valid_c)
    e_e = tl.arange(0, E_P)
    tl.store(block_counts_ptr + block * E + e_e, seen_e, mask=e_e < E)
    for z0 in range(0, dup_share, ZERO_CHUNK):
        z = block * dup_share + z0 + tl.arange(0, ZERO_CHUNK)
        tl.store(dup_ptr + z, tl.zeros([ZERO_CHUNK], tl.int32), mask=z < dup_numel)


@triton.jit
def _global_plan(counts_ptr, counts_stride_r, counts_stride_e, rank, replica_cost, received_ptr, before_ptr,
                 ends_ptr, offset_ptr, experts_to_copy_ptr, cu_seqlens_ptr, zero_fill_ptr, remote_stats_ptr,
                 rank_load_ptr, home_load_ptr, expert_load_ptr, slots_used_ptr, groups_ptr, R: tl.constexpr,
                 E: tl.constexpr, B: tl.constexpr, TP: tl.constexpr, NVS: tl.constexpr, R_P: tl.constexpr,
                 W: tl.constexpr, B_P: tl.constexpr, DC: tl.constexpr, G_P: tl.constexpr):
    """Steps 1-5 of the planner for the whole group (one program)."""
    EPN: tl.constexpr = E // R
    g_g = tl.arange(0, R_P)
    g_1g = g_g[None, :]
    w_w1 = tl.arange(0, W)[:, None]
    cell_wg = (g_1g < R) & (w_w1 < EPN)
    expert_wg = g_1g * EPN + w_w1
    tl.store(remote_stats_ptr + tl.arange(0, 2), tl.zeros([2], tl.int32))
    # Loops over the ranks take DC of them a step, as `[DC, W, R_P]` tiles: one step where the group is
    # small, a rolled loop where it is large (R_P / DC inlined copies did not compile for R = 64).
    cell_1wg, expert_1wg = cell_wg[None, :, :], expert_wg[None, :, :]
    for r0 in range(0, R_P, DC):
        r_r11 = r0 + tl.arange(0, DC)[:, None, None]
        tl.store(received_ptr + expert_1wg * R_P + r_r11, tl.zeros([DC, W, R_P], tl.int32),
                 mask=cell_1wg & (r_r11 < R))
    tl.debug_barrier()  # the zeros land before any move is stored over them

    # 1. Loads: routes per expert in the group and on the ranks before this one.
    load_wg = tl.zeros([W, R_P], tl.int32)
    before_wg = tl.zeros([W, R_P], tl.int32)
    for r0 in range(0, R_P, DC):
        r_r11 = r0 + tl.arange(0, DC)[:, None, None]
        counts_rwg = tl.load(counts_ptr + r_r11 * counts_stride_r + expert_1wg * counts_stride_e,
                             mask=cell_1wg & (r_r11 < R), other=0).to(tl.int32)
        load_wg += tl.sum(counts_rwg, 0)
        before_wg += tl.sum(tl.where(r_r11 < rank, counts_rwg, 0), 0)
    tl.store(before_ptr + expert_wg, before_wg, mask=cell_wg)
    tl.store(expert_load_ptr + expert_wg, load_wg, mask=cell_wg)
    home_g = tl.sum(load_wg, 0)
    tl.store(home_load_ptr + g_g, home_g, mask=g_g < R)

    # Targets: T // R each, one more for the T % R most loaded ranks (ties: lowest rank).
    home_w1 = tl.sum(tl.where(w_w1 == g_1g, home_g[None, :], 0), 1)[:, None]  # rank w's home load
    ahead_wg = (home_w1 > home_g[None, :]) | ((home_w1 == home_g[None, :]) & (w_w1 < g_1g))
    ahead_g = tl.sum((ahead_wg & (w_w1 < R)).to(tl.int32), 0)
    total = tl.sum(home_g, 0)
    balance_g = tl.where(g_g < R, home_g - (total // R + (ahead_g < total % R).to(tl.int32)), 0)

    # 2. Rank balancing: quota_wg[receiver, donor]. An iteration after the reference's `break` moves 0
    # (as does a move of at most replica_cost routes: every later one is smaller). With replica_cost > 0 a
    # move stops at the donor's surplus.
    quota_wg = tl.zeros([W, R_P], tl.int32)
    for _ in range(R):
        surplus, donor = tl.max(tl.where(g_g < R, balance_g, -BIG), 0, return_indices=True,
                                return_indices_tie_break_left=True)
        lowest, receiver = tl.min(tl.where(g_g < R, balance_g, BIG), 0, return_indices=True,
                                  return_indices_tie_break_left=True)
        move = tl.where(replica_cost > 0, tl.minimum(surplus, -lowest), -lowest)
        routes = tl.where((surplus > 0) & (move > replica_cost), move, 0)
        balance_g += tl.where(g_g == receiver, routes, 0) - tl.where(g_g == donor, routes, 0)
        quota_wg += tl.where((w_w1 == receiver) & (g_1g == donor), routes, 0)

    # 3. Per-donor split, all donors at once (column g = donor): the open receiver (positive quota and a
    # free slot) with the largest quota takes the expert with the most remaining routes (ties: lowest
    # index). A receiver takes an expert at most once (afterwards the receiver is closed or the expert
    # exhausted), so each move is stored to its own cell of received_er[expert, receiver]. A take of at
    # most replica_cost routes moves nothing (every later take of that donor is smaller). With
    # replica_cost > 0 a receiver may have several donors: a donor waits while a lower donor that shares a
    # receiver still moves (the reference runs donors in ascending rank), so the donors that move in one
    # iteration have distinct receivers. Stops when no donor moves.
    remaining_wg = tl.where(cell_wg, load_wg, -1)
    w_w = tl.arange(0, W)
    slots_w = tl.where(w_w < R, B, 0)  # receiver w's free slots
    quota0_wg = quota_wg
    sent_g = tl.zeros([R_P], tl.int32)
    moving = total >= 0
    while moving:
        most_g, expert_g = tl.max(remaining_wg, 0, return_indices=True, return_indices_tie_break_left=True)
        largest_g, receiver_g = tl.max(tl.where((quota_wg > 0) & (slots_w[:, None] > 0), quota_wg, -1), 0,
                                       return_indices=True, return_indices_tie_break_left=True)
        take_g = tl.minimum(largest_g, most_g)
        moves_g = take_g > replica_cost
        if replica_cost > 0:  # wait where a lower donor still moving gives to one of this donor's receivers
            gives_wg = quota_wg > 0
            first_w = tl.min(tl.where(gives_wg & moves_g[None, :], g_1g, R_P), 1)  # lowest moving giver
            moves_g = moves_g & (tl.max((gives_wg & (first_w[:, None] < g_1g)).to(tl.int32), 0) == 0)
        sent_g += moves_g.to(tl.int32)
        routes_1g = tl.where(moves_g, take_g, 0)[None, :]
        to_wg = w_w1 == receiver_g[None, :]
        quota_wg -= tl.where(to_wg, routes_1g, 0)
        slots_w -= tl.sum((to_wg & (routes_1g > 0)).to(tl.int32), 1)
        taken_wg = w_w1 == expert_g[None, :]
        remaining_wg -= tl.where(taken_wg, routes_1g, 0)
        tl.store(received_ptr + expert_wg * R_P + receiver_g[None, :], tl.broadcast_to(routes_1g, [W, R_P]),
                 mask=taken_wg & (routes_1g > 0))
        moving = tl.max(tl.max(routes_1g, 1), 0) > 0
    tl.debug_barrier()

    # The policy's fallback (replica_cost > 0): plain EP unless the modelled hottest rank (routes computed
    # + replica_cost per transfer received or sent) is faster than plain EP's. Receiver w's routes and
    # transfers come in rows w; `tl.where(w == g)` moves them to column g.
    cost = replica_cost.to(tl.int64)
    received_w = tl.sum(quota0_wg - quota_wg, 1) + cost * tl.where(w_w < R, B - slots_w, 0)
    received_g = tl.sum(tl.where(w_w1 == g_1g, received_w[:, None], 0), 0)
    time_g = tl.sum(tl.where(cell_wg, remaining_wg, 0), 0) + received_g + cost * sent_g
    hottest = tl.max(tl.where(g_g < R, time_g, 0), 0)
    plain_ep = (replica_cost > 0) & (hottest >= tl.max(home_g, 0))

    # 4-5. Every rank's segments, DC ranks at a time (ends_er accumulates over the ranks in order).
    home_alloc_wg = tl.where(cell_wg, tl.where(plain_ep, load_wg, remaining_wg), 0)
    routes_before_wg = tl.zeros([W, R_P], tl.int32)
    for d0 in range(0, R_P, DC):
        routes_before_wg = _rank_segments(d0, routes_before_wg, home_alloc_wg, plain_ep, rank, received_ptr,
                                          ends_ptr, offset_ptr, experts_to_copy_ptr, cu_seqlens_ptr,
                                          zero_fill_ptr, rank_load_ptr, slots_used_ptr, R, E, B, TP, NVS, R_P,
                                          W, B_P, DC)
    tl.debug_barrier()  # this rank's segments land before they are read back

    # 6. This rank's compute groups (`compute_groups`): its home groups then its slots, each starting at
    # the previous one's end (the groups between are empty on this rank).
    c_c = tl.arange(0, G_P)
    inside_c = c_c < EPN + B
    group_c = tl.where(c_c < EPN, rank * EPN + c_c, E + c_c - EPN)
    previous_c = tl.where(c_c <= EPN, rank * EPN + c_c - 1, E + c_c - EPN - 1)
    ends_c = tl.load(cu_seqlens_ptr + group_c, mask=inside_c, other=0)
    starts_c = tl.load(cu_seqlens_ptr + previous_c, mask=inside_c & (c_c > 0), other=0)
    padding_c = tl.load(zero_fill_ptr + 2 * group_c + 1, mask=inside_c, other=0)
    experts_c = tl.where(c_c < EPN, group_c, tl.load(experts_to_copy_ptr + rank * B + c_c - EPN,
                                                     mask=inside_c & (c_c >= EPN), other=-1))
    tl.store(groups_ptr + c_c, ends_c, mask=inside_c)
    tl.store(groups_ptr + EPN + B + c_c, ends_c - starts_c - padding_c, mask=inside_c)
    tl.store(groups_ptr + 2 * (EPN + B) + c_c, experts_c, mask=inside_c)


@triton.jit
def _rank_segments(d0, routes_before_wg, home_alloc_wg, plain_ep, rank, received_ptr, ends_ptr, offset_ptr,
                   experts_to_copy_ptr, cu_seqlens_ptr, zero_fill_ptr, rank_load_ptr, slots_used_ptr,
                   R: tl.constexpr, E: tl.constexpr, B: tl.constexpr, TP: tl.constexpr, NVS: tl.constexpr,
                   R_P: tl.constexpr, W: tl.constexpr, B_P: tl.constexpr, DC: tl.constexpr):
    """Ranks `d0 .. d0+DC-1`: slots, segments, `ends_er` / `offset_er` columns, loads; and this rank's
    `cu_seqlens` / `zero_fill_ranges` if it is among them. Returns `routes_before_wg` plus their routes.

    `alloc_dwg[d, w, g]`: routes of expert (g, w) computed on d: the remainder of its home experts, and what
    it received from its donors (none under `plain_ep`, the policy's fallback). Its slots hold its replicas
    in ascending expert id: group g's after those of the groups before it.
    """
    EPN: tl.constexpr = E // R
    d_d = d0 + tl.arange(0, DC)
    d_d11 = d_d[:, None, None]
    w_1w1 = tl.arange(0, W)[None, :, None]
    g_11g = tl.arange(0, R_P)[None, None, :]
    cell_dwg = (d_d11 < R) & (g_11g < R) & (w_1w1 < EPN)
    expert_dwg = tl.broadcast_to(g_11g * EPN + w_1w1, [DC, W, R_P])
    home_dwg = d_d11 == g_11g
    received_dwg = tl.load(received_ptr + expert_dwg * R_P + d_d11, mask=cell_dwg & ~home_dwg, other=0)
    received_dwg = tl.where(plain_ep, 0, received_dwg)
    alloc_dwg = tl.where(home_dwg, home_alloc_wg[None, :, :], 0) + received_dwg
    padded_dwg = (alloc_dwg + TP - 1) // TP * TP
    end_dwg = tl.cumsum(padded_dwg, 1)
    home_rows_d11 = tl.sum(tl.sum(tl.where(home_dwg, padded_dwg, 0), 2), 1)[:, None, None]
    replica_dwg = ~home_dwg & (alloc_dwg > 0)
    replica_rows_dg = tl.sum(tl.where(replica_dwg, padded_dwg, 0), 1)
    slots_before_d1g = (tl.cumsum(replica_rows_dg, 1) - replica_rows_dg)[:, None, :] + home_rows_d11
    # Segment start of every expert on d: home groups in expert order, then the slots (ascending expert).
    start_dwg = tl.where(home_dwg, end_dwg - padded_dwg, slots_before_d1g + end_dwg - padded_dwg)
    ends_dwg = routes_before_wg[None, :, :] + tl.cumsum(alloc_dwg, 0)
    table_dwg = expert_dwg * R + d_d11
    tl.store(ends_ptr + table_dwg, ends_dwg, mask=cell_dwg)
    tl.store(offset_ptr + table_dwg, d_d11 * NVS + start_dwg - (ends_dwg - alloc_dwg), mask=cell_dwg)
    replicas_dwg = replica_dwg.to(tl.int32)
    replicas_dg = tl.sum(replicas_dwg, 1)
    slot_dwg = (tl.cumsum(replicas_dg, 1) - replicas_dg)[:, None, :] + tl.cumsum(replicas_dwg, 1) - 1
    tl.store(experts_to_copy_ptr + d_d11 * B + slot_dwg, expert_dwg, mask=replica_dwg)
    used_d = tl.sum(replicas_dg, 1)
    tl.store(slots_used_ptr + d_d, used_d, mask=d_d < R)
    tl.store(rank_load_ptr + d_d, tl.sum(tl.sum(alloc_dwg, 2), 1), mask=d_d < R)
    d_d1 = d_d[:, None]
    s_1s = tl.arange(0, B_P)[None, :]
    unused_ds = (d_d1 < R) & (s_1s < B) & (s_1s >= used_d[:, None])
    tl.store(experts_to_copy_ptr + d_d1 * B + s_1s, tl.full([DC, B_P], -1, tl.int32), mask=unused_ds)

    # This rank's groups: E experts (only its home ones non-empty), then its B slots.
    mine_dwg = cell_dwg & (d_d11 == rank)
    home_routes_dwg = tl.where(home_dwg, alloc_dwg, 0)
    home_padded_dwg = tl.where(home_dwg, padded_dwg, 0)
    home_end_dwg = tl.where(g_11g < d_d11, 0, tl.where(home_dwg, end_dwg, home_rows_d11))
    tl.store(cu_seqlens_ptr + expert_dwg, home_end_dwg, mask=mine_dwg)
    tl.store(zero_fill_ptr + 2 * expert_dwg, home_end_dwg - home_padded_dwg + home_routes_dwg, mask=mine_dwg)
    tl.store(zero_fill_ptr + 2 * expert_dwg + 1, home_padded_dwg - home_routes_dwg, mask=mine_dwg)
    slot_end_dwg = slots_before_d1g + end_dwg
    mine_replica_dwg = replica_dwg & (d_d11 == rank)
    tl.store(cu_seqlens_ptr + E + slot_dwg, slot_end_dwg, mask=mine_replica_dwg)
    tl.store(zero_fill_ptr + 2 * (E + slot_dwg), slot_end_dwg - padded_dwg + alloc_dwg, mask=mine_replica_dwg)
    tl.store(zero_fill_ptr + 2 * (E + slot_dwg) + 1, padded_dwg - alloc_dwg, mask=mine_replica_dwg)
    rows_d1 = tl.sum(tl.sum(tl.where(home_dwg | replica_dwg, padded_dwg, 0), 2), 1)[:, None]
    unused_mine_ds = unused_ds & (d_d1 == rank)
    slot_ds = tl.broadcast_to(E + s_1s, [DC, B_P])
    rows_ds = tl.broadcast_to(rows_d1, [DC, B_P])
    tl.store(cu_seqlens_ptr + slot_ds, rows_ds, mask=unused_mine_ds)
    tl.store(zero_fill_ptr + 2 * slot_ds, rows_ds, mask=unused_mine_ds)
    tl.store(zero_fill_ptr + 2 * slot_ds + 1, tl.zeros([DC, B_P], tl.int32), mask=unused_mine_ds)
    return routes_before_wg + tl.sum(alloc_dwg, 0)


@triton.jit
def _one_rank_plan(counts_ptr, counts_stride_e, topk_ptr, num_routes, received_ptr, before_ptr, ends_ptr,
                   offset_ptr, experts_to_copy_ptr, cu_seqlens_ptr, zero_fill_ptr, remote_stats_ptr,
                   rank_load_ptr, home_load_ptr, expert_load_ptr, slots_used_ptr, groups_ptr, E: tl.constexpr,
                   B: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, B_P: tl.constexpr, E_P: tl.constexpr,
                   COUNT: tl.constexpr, ROUTES: tl.constexpr):
    """Steps 1-6 of a one-rank group, what `_global_plan` computes when R = 1 without its loops: nothing to
    balance, every slot unused, each expert's routes in its home segment. With `COUNT` the histogram is
    counted here from the rank's routes and written to `counts_ptr` (one rank has nothing to gather)."""
    e_e = tl.arange(0, E_P)
    expert_e = e_e < E
    if COUNT:
        load_e = count_routes(topk_ptr, num_routes, E, E_P, ROUTES)
        tl.store(counts_ptr + e_e * counts_stride_e, load_e.to(counts_ptr.dtype.element_ty), mask=expert_e)
    else:
        load_e = tl.load(counts_ptr + e_e * counts_stride_e, mask=expert_e, other=0).to(tl.int32)
    padded_e = (load_e + TP - 1) // TP * TP
    end_e = tl.cumsum(padded_e, 0)
    total = tl.sum(load_e, 0)
    rows = tl.sum(padded_e, 0)
    tl.store(remote_stats_ptr + tl.arange(0, 2), tl.zeros([2], tl.int32))
    tl.store(received_ptr + e_e, tl.zeros([E_P], tl.int32), mask=expert_e)
    tl.store(rank_load_ptr, total)
    tl.store(home_load_ptr, total)
    tl.store(slots_used_ptr, 0)
    tl.store(before_ptr + e_e, tl.zeros([E_P], tl.int32), mask=expert_e)
    tl.store(expert_load_ptr + e_e, load_e, mask=expert_e)
    tl.store(ends_ptr + e_e, load_e, mask=expert_e)  # ends_er[e, 0]: all of e's routes
    tl.store(offset_ptr + e_e, end_e - padded_e, mask=expert_e)  # offset_er[e, 0]: e's segment start
    tl.store(cu_seqlens_ptr + e_e, end_e, mask=expert_e)
    tl.store(zero_fill_ptr + 2 * e_e, end_e - padded_e + load_e, mask=expert_e)
    tl.store(zero_fill_ptr + 2 * e_e + 1, padded_e - load_e, mask=expert_e)
    tl.store(groups_ptr + e_e, end_e, mask=expert_e)
    tl.store(groups_ptr + E + B + e_e, load_e, mask=expert_e)
    tl.store(groups_ptr + 2 * (E + B) + e_e, e_e, mask=expert_e)
    s_s = tl.arange(0, B_P)
    slot_s = s_s < B
    rows_s = tl.full([B_P], rows, tl.int32)
    tl.store(experts_to_copy_ptr + s_s, tl.full([B_P], -1, tl.int32), mask=slot_s)
    tl.store(cu_seqlens_ptr + E + s_s, rows_s, mask=slot_s)
    tl.store(zero_fill_ptr + 2 * (E + s_s), rows_s, mask=slot_s)
    tl.store(zero_fill_ptr + 2 * (E + s_s) + 1, tl.zeros([B_P], tl.int32), mask=slot_s)
    tl.store(groups_ptr + E + s_s, rows_s, mask=slot_s)
    tl.store(groups_ptr + E + B + E + s_s, tl.zeros([B_P], tl.int32), mask=slot_s)
    tl.store(groups_ptr + 2 * (E + B) + E + s_s, tl.full([B_P], -1, tl.int32), mask=slot_s)


@triton.jit(do_not_specialize=["counts_stride_e", "replica_cost"])
def _plan_kernel(counts_ptr, counts_stride_r, counts_stride_e, topk_ptr, num_tokens, rank, replica_cost,
                 position_ptr,
                 block_counts_ptr, dup_ptr, dup_numel, dup_share, received_ptr, before_ptr, ends_ptr,
                 offset_ptr, experts_to_copy_ptr, cu_seqlens_ptr, zero_fill_ptr, remote_stats_ptr,
                 rank_load_ptr, home_load_ptr, expert_load_ptr, slots_used_ptr, groups_ptr, R: tl.constexpr,
                 E: tl.constexpr, B: tl.constexpr, TP: tl.constexpr, NVS: tl.constexpr, K: tl.constexpr,
                 R_P: tl.constexpr,
                 W: tl.constexpr, B_P: tl.constexpr, DC: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr,
                 TOK: tl.constexpr, SUB: tl.constexpr, G_P: tl.constexpr, COUNT: tl.constexpr,
                 ROUTES: tl.constexpr, FUSED: tl.constexpr, SUB2: tl.constexpr, NB_CHUNK: tl.constexpr,
                 NO_ROUTE_: tl.constexpr, dst_ptr):
    """Launch 1: programs `< nb` are token blocks (`_block_positions`), the last one plans the group. `FUSED`
    (one rank, one token block): one program runs the block, the plan and launch 2's destinations in turn,
    each phase reading what the one before stored (a barrier between), and launch 2 does not run."""
    pid = tl.program_id(0)
    num_blocks = tl.num_programs(0) - 1
    if FUSED:  # block `pid` (= 0): a literal 0 crashes Triton 3.6's coalescing pass (an LLVM assertion)
        _block_positions(topk_ptr, num_tokens, position_ptr, block_counts_ptr, dup_ptr, dup_numel, dup_share,
                         pid, E, K, K_P, E_P, TOK, SUB)
        _one_rank_plan(counts_ptr, counts_stride_e, topk_ptr, num_tokens * K, received_ptr, before_ptr,
                       ends_ptr, offset_ptr, experts_to_copy_ptr, cu_seqlens_ptr, zero_fill_ptr,
                       remote_stats_ptr, rank_load_ptr, home_load_ptr, expert_load_ptr, slots_used_ptr,
                       groups_ptr, E, B, TP, W, B_P, E_P, COUNT, ROUTES)
        tl.debug_barrier()  # positions, tables and the zeroed remote_stats land before they are read
        _block_destinations(pid, topk_ptr, num_tokens, rank, position_ptr, block_counts_ptr, before_ptr,
                            ends_ptr, offset_ptr, dst_ptr, remote_stats_ptr, R, E, K, NO_ROUTE_, R_P, K_P,
                            E_P, TOK, SUB2, NB_CHUNK)
    elif pid == num_blocks and R == 1:
        _one_rank_plan(counts_ptr, counts_stride_e, topk_ptr, num_tokens * K, received_ptr, before_ptr,
                       ends_ptr, offset_ptr, experts_to_copy_ptr, cu_seqlens_ptr, zero_fill_ptr,
                       remote_stats_ptr, rank_load_ptr, home_load_ptr, expert_load_ptr, slots_used_ptr,
                       groups_ptr, E, B, TP, W, B_P, E_P, COUNT, ROUTES)
    elif pid == num_blocks:
        _global_plan(counts_ptr, counts_stride_r, counts_stride_e, rank, replica_cost, received_ptr,
                     before_ptr, ends_ptr, offset_ptr, experts_to_copy_ptr, cu_seqlens_ptr, zero_fill_ptr,
                     remote_stats_ptr, rank_load_ptr, home_load_ptr, expert_load_ptr, slots_used_ptr,
                     groups_ptr, R, E, B, TP, NVS, R_P, W, B_P, DC, G_P)
    else:
        _block_positions(topk_ptr, num_tokens, position_ptr, block_counts_ptr, dup_ptr, dup_numel, dup_share,
                         pid, E, K, K_P, E_P, TOK, SUB)


@triton.jit
def _destinations_kernel(topk_ptr, num_tokens, rank, position_ptr, block_counts_ptr, before_ptr, ends_ptr,
                         offset_ptr, dst_ptr, remote_stats_ptr, R: tl.constexpr, E: tl.constexpr,
                         K: tl.constexpr, NO_ROUTE_: tl.constexpr, R_P: tl.constexpr, K_P: tl.constexpr,
                         E_P: tl.constexpr, TOK: tl.constexpr, SUB: tl.constexpr, NB_CHUNK: tl.constexpr):
    """Launch 2: `dst` of block `program_id`'s routes (`_block_destinations`)."""
    _block_destinations(tl.program_id(0), topk_ptr, num_tokens, rank, position_ptr, block_counts_ptr,
                        before_ptr, ends_ptr, offset_ptr, dst_ptr, remote_stats_ptr, R, E, K, NO_ROUTE_, R_P,
                        K_P, E_P, TOK, SUB, NB_CHUNK)


@triton.jit
def _block_destinations(block, topk_ptr, num_tokens, rank, position_ptr, block_counts_ptr, before_ptr,
                        ends_ptr, offset_ptr, dst_ptr, remote_stats_ptr, R: tl.constexpr, E: tl.constexpr,
                        K: tl.constexpr, NO_ROUTE_: tl.constexpr, R_P: tl.constexpr, K_P: tl.constexpr,
                        E_P: tl.constexpr, TOK: tl.constexpr, SUB: tl.constexpr, NB_CHUNK: tl.constexpr):
    """`dst` of block `block`'s routes, `SUB` tokens a step, and this block's share of `remote_stats`."""
    e_e = tl.arange(0, E_P)
    # Routes of each expert before this block: on earlier ranks, then in earlier blocks of this rank.
    first_e = tl.load(before_ptr + e_e, mask=e_e < E, other=0)
    b0 = block * 0
    while b0 < block:  # (a while loop: the interpreter takes no program-dependent range bound)
        b_b1 = b0 + tl.arange(0, NB_CHUNK)[:, None]
        counts_be = tl.load(block_counts_ptr + b_b1 * E + e_e[None, :],
                            mask=(b_b1 < block) & (e_e[None, :] < E), other=0)
        first_e += tl.sum(counts_be, 0)
        b0 += NB_CHUNK
    C: tl.constexpr = SUB * K_P
    i_c = tl.arange(0, C)
    d_1r = tl.arange(0, R_P)[None, :]
    k_k = tl.arange(0, K_P)
    earlier_1kk = (k_k[None, None, :] < k_k[None, :, None])
    remote = tl.zeros([], tl.int32)
    remote_primary = tl.zeros([], tl.int32)
    for t0 in range(0, TOK, SUB):
        token_c = block * TOK + t0 + i_c // K_P
        k_c = i_c % K_P
        route_c = token_c * K + k_c
        inside_c = (k_c < K) & (token_c < num_tokens)
        expert_c = tl.load(topk_ptr + route_c, mask=inside_c, other=-1).to(tl.int32)
        valid_c = (expert_c >= 0) & (expert_c < E)
        expert_c = tl.where(valid_c, expert_c, 0)
        index_c = tl.gather(first_e, expert_c, 0) + tl.load(position_ptr + route_c, mask=valid_c, other=0)
        ends_cr = tl.load(ends_ptr + expert_c[:, None] * R + d_1r, mask=valid_c[:, None] & (d_1r < R),
                          other=BIG)
        dest_c = tl.minimum(tl.sum((ends_cr <= index_c[:, None]).to(tl.int32), 1), R - 1)
        dst_c = tl.load(offset_ptr + expert_c * R + dest_c, mask=valid_c, other=0) + index_c
        dest_c = tl.where(valid_c, dest_c, -1)
        # a duplicate (R > 1): an earlier k of the same token goes to the same rank ([SUB, K_P, K_P]
        # compares); with one rank every route is primary
        dest_tk = tl.reshape(dest_c, [SUB, K_P])
        again_tkk = (dest_tk[:, :, None] == dest_tk[:, None, :]) & earlier_1kk
        duplicate_c = (tl.reshape(tl.sum(again_tkk.to(tl.int32), 2), [C]) > 0) & valid_c & (R > 1)
        dst_c = tl.where(duplicate_c, -dst_c - 1, dst_c)
        tl.store(dst_ptr + route_c, tl.where(valid_c, dst_c, NO_ROUTE_), mask=inside_c)
        remote_c = valid_c & (dest_c != rank)
        remote += tl.sum(remote_c.to(tl.int32), 0)
        remote_primary += tl.sum((remote_c & ~duplicate_c).to(tl.int32), 0)
    tl.atomic_add(remote_stats_ptr, remote)
    tl.atomic_add(remote_stats_ptr + 1, remote_primary)


@dataclass(frozen=True)
class PlanLaunch:
    """One planning of one rank: its inputs, launch constants, the plan the two launches write
    (`MoonEPCommPlan.empty`) and their scratch (int32, one allocation), kept for tests and benchmarks:

    Attributes:
        position_n: `[s*K]` a valid route's position among its block's earlier routes to its expert.
        block_counts_be: `[nb, E]` valid routes per expert in each token block.
        received_er: `[E, R_P]` routes of expert e that receiver r computes as a replica.
        before_e: `[E]` routes of expert e on the ranks before this one.
        ends_er: `[E, R]` routes of expert e computed on ranks `<= d` (cumulative over d).
        offset_er: `[E, R]` `d * NvS + row_base[d, e] - (ends_er[e, d] - alloc[d, e])`.
    """

    counts_re: torch.Tensor
    topk_sk: torch.Tensor
    rank: int
    replica_cost: int
    constants: dict
    num_blocks: int
    dup_share: int
    plan: MoonEPCommPlan
    position_n: torch.Tensor
    block_counts_be: torch.Tensor
    received_er: torch.Tensor
    before_e: torch.Tensor
    ends_er: torch.Tensor
    offset_er: torch.Tensor

    def plan_group(self) -> None:
        """Launch 1: the global plan (last program) beside the token blocks' positions and histograms; the
        whole plan in one program when fused (`constants["FUSED"]`)."""
        c, plan = self.constants, self.plan
        dup_tables = plan.dup_tables
        _plan_kernel[(1 if c["FUSED"] else self.num_blocks + 1,)](
            self.counts_re, *self.counts_re.stride(), self.topk_sk, self.topk_sk.shape[0], self.rank,
            self.replica_cost, self.position_n, self.block_counts_be, dup_tables, dup_tables.numel(),
            self.dup_share, self.received_er, self.before_e, self.ends_er, self.offset_er,
            plan.experts_to_copy, plan.cu_seqlens, plan.zero_fill_ranges, plan.remote_stats, plan.rank_load,
            plan.home_load, plan.expert_load, plan.slots_used, plan.compute_groups,
            **{name: c[name] for name in _PLAN_CONSTANTS}, NO_ROUTE_=NO_ROUTE, dst_ptr=plan.dst,
            num_warps=c["plan_warps"])

    def route_destinations(self) -> None:
        """Launch 2: `dst` of every route of this rank and `remote_stats` (after `plan_group`); nothing when
        fused (launch 1 did it)."""
        c = self.constants
        if c["FUSED"]:
            return
        _destinations_kernel[(self.num_blocks,)](
            self.topk_sk, self.topk_sk.shape[0], self.rank, self.position_n, self.block_counts_be,
            self.before_e, self.ends_er, self.offset_er, self.plan.dst, self.plan.remote_stats, R=c["R"],
            E=c["E"], K=c["K"], NO_ROUTE_=NO_ROUTE, R_P=c["R_P"], K_P=c["K_P"], E_P=c["E_P"], TOK=c["TOK"],
            SUB=c["SUB2"], NB_CHUNK=c["NB_CHUNK"], num_warps=c["destination_warps"])


def prepare(counts_re: torch.Tensor, topk_experts_sk: torch.Tensor, *, rank: int, num_slots: int,
            token_padding: int, rows_per_rank: int, owner: int | None = None, replica_cost: int = 0,
            routes_per_block: int | None = None,
            plan_warps: int = PLAN_WARPS, destination_warps: int = DESTINATION_WARPS,
            segment_ranks: int | None = None, count_routes: bool = False) -> PlanLaunch:
    """Allocate (the plan and one int32 scratch tensor, no kernel) and describe the two launches of one rank's
    plan.

    Args: as `plan_routes_triton` (`count_routes` too); the rest tune the launches (`bench.plan` sweeps them):
        routes_per_block: routes (tokens x padded K) of one token block, a power of two (None: the
            smallest that keeps the blocks at most `BLOCKS`, between one loop step and `ROUTES_PER_BLOCK`).
        plan_warps / destination_warps: warps of launch 1 / launch 2.
        segment_ranks: ranks the global program takes at once in its loops over the ranks (their counts,
            their segments: DC, a power of two; None: as many as keep its `[DC, W, R_P]` tiles near 16
            elements a thread).
    Per-thread register tiles stay near 16-32 elements: launch 1's `[C, C]` route comparisons (C = 32 routes
    below 4 warps, else 64) and `[DC, R_P, W]` segment tiles; launch 2's `[C2, R_P]` destination search
    (C2 routes a step, `SUB2` tokens) and `[NB_CHUNK, E_P]` histogram rows.
    """
    device = topk_experts_sk.device
    num_ranks, num_experts = counts_re.shape
    num_tokens, top_k = topk_experts_sk.shape
    if count_routes and num_ranks != 1:
        raise ValueError(f"count_routes: only a one-rank group's plan counts its own routes; counts_re "
                         f"has {num_ranks} ranks")
    epn = num_experts // num_ranks
    R_P, K_P, E_P = next_power_of_2(num_ranks), next_power_of_2(top_k), next_power_of_2(num_experts)
    W = max(R_P, next_power_of_2(epn))
    SUB = max(1, (32 if plan_warps < 4 else 64) // K_P)
    if routes_per_block is None:
        routes_per_block = min(ROUTES_PER_BLOCK, next_power_of_2(cdiv(num_tokens * K_P, BLOCKS)))
    TOK = max(SUB, routes_per_block // K_P)
    num_blocks = max(1, cdiv(num_tokens, TOK))
    threads, threads2 = 32 * plan_warps, 32 * destination_warps
    constants = dict(R=num_ranks, E=num_experts, B=num_slots, TP=token_padding, NVS=rows_per_rank, K=top_k,
                     R_P=R_P, W=W, B_P=next_power_of_2(num_slots), G_P=next_power_of_2(epn + num_slots),
                     DC=min(R_P, segment_ranks or max(1, 16 * threads // (R_P * W))), K_P=K_P, E_P=E_P,
                     TOK=TOK, SUB=SUB,
                     SUB2=min(TOK, max(1, 16 * threads2 // (R_P * K_P))),
                     NB_CHUNK=max(1, 32 * threads2 // E_P), COUNT=count_routes, ROUTES=HISTOGRAM_ROUTES,
                     FUSED=num_ranks == 1 and num_blocks == 1, plan_warps=plan_warps,
                     destination_warps=destination_warps)
    plan = MoonEPCommPlan.empty(num_tokens=num_tokens, top_k=top_k, num_ranks=num_ranks,
                                num_experts=num_experts, num_slots=num_slots, rows_per_rank=rows_per_rank,
                                rank=rank, device=device, owner=owner)
    shapes = dict(position_n=(num_tokens * top_k,), block_counts_be=(num_blocks, num_experts),
                  received_er=(num_experts, R_P), before_e=(num_experts,), ends_er=(num_experts, num_ranks),
                  offset_er=(num_experts, num_ranks))
    sizes = [torch.Size(shape).numel() for shape in shapes.values()]
    scratch = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    views = {name: part.view(shape)
             for (name, shape), part in zip(shapes.items(), scratch.split(sizes), strict=True)}
    dup_share = align_up(cdiv(plan.dup_tables.numel(), num_blocks), ZERO_CHUNK)
    return PlanLaunch(counts_re=counts_re.to(device), topk_sk=topk_experts_sk.contiguous(), rank=rank,
                      replica_cost=replica_cost, constants=constants, num_blocks=num_blocks,
                      dup_share=dup_share, plan=plan, **views)


def plan_routes_triton(counts_re: torch.Tensor, topk_experts_sk: torch.Tensor, *, rank: int, num_slots: int,
                       token_padding: int, rows_per_rank: int, owner: int | None = None,
                       replica_cost: int = 0, count_routes: bool = False,
                       **tuning: int | None) -> MoonEPCommPlan:
    """`moonep_moe.plan.planner.plan_routes` in two Triton launches (equal to it bit for bit, no host read).

    Args:
        counts_re: `[R, E]` int32/int64, valid routes from each source rank to each expert; with
            `count_routes` (one rank, R = 1) the launch writes `topk_experts_sk`'s histogram into it instead.
        topk_experts_sk: `[s, K]` int32/int64, this rank's routed experts, -1 = no route.
        num_slots: B. token_padding: tp. rows_per_rank: NvS. replica_cost: the replication policy
            (`plan.policies`; 0 = exact balance).
        tuning: `prepare`'s launch-shape arguments (default: its defaults).
    """
    launch = prepare(counts_re, topk_experts_sk, rank=rank, num_slots=num_slots, token_padding=token_padding,
                     rows_per_rank=rows_per_rank, owner=owner, replica_cost=replica_cost,
                     count_routes=count_routes, **tuning)
    launch.plan_group()
    launch.route_destinations()
    return launch.plan
