"""The planner's entry points, and the one place that chooses its implementation: on CUDA with Triton the
Triton planner (`plan.triton`, two launches), elsewhere the torch device planner (`plan.device`); both give
the same plan bit for bit, without a host read."""

from __future__ import annotations

import torch

from moonep_moe.base.triton import triton_available
from moonep_moe.plan.device import compute_groups, plan_global_device, route_destinations
from moonep_moe.plan.types import MoonEPCommPlan, decode_dst


def _use_triton(topk_experts_sk: torch.Tensor) -> bool:
    """The one place that picks the planner kernels: CUDA routes with Triton installed."""
    return topk_experts_sk.is_cuda and triton_available()


def expert_histogram(topk_experts_sk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[E]` int64 valid routes per expert of `topk_experts_sk [s, K]` (ids outside [0, E) count nowhere), on
    the ids' device with no host read (unlike `bincount`, whose length is read): on CUDA with Triton one
    launch (`expert_histogram_triton`), elsewhere a fixed-shape scatter-add."""
    if _use_triton(topk_experts_sk):
        from moonep_moe.plan.histogram import expert_histogram_triton

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
        from moonep_moe.plan.triton import plan_routes_triton

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
        from moonep_moe.plan.triton import plan_routes_triton

        counts_re = torch.empty(1, num_experts, dtype=torch.int64, device=topk_experts_sk.device)
        return plan_routes_triton(counts_re, topk_experts_sk, count_routes=True, **kwargs)
    return plan_routes(expert_histogram(topk_experts_sk, num_experts)[None], topk_experts_sk, **kwargs)
