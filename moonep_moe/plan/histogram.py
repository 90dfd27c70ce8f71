"""An expert histogram of a rank's routes in one Triton launch (what a one-rank plan, a serving step, needs
before planning), and the route counting the planner's one-rank program shares with it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep_moe.base.sizes import next_power_of_2

HISTOGRAM_ROUTES = 4096
"""Routes a program counting a histogram (`expert_histogram_triton`, a one-rank plan) reads a loop step."""


@triton.jit
def count_routes(topk_ptr, num_routes, E: tl.constexpr, E_P: tl.constexpr, ROUTES: tl.constexpr):
    """`[E_P]` int32 valid routes per expert among the `num_routes` ids at `topk_ptr`, `ROUTES` a loop step
    (ids outside [0, E) count nowhere)."""
    counts_e = tl.zeros([E_P], tl.int32)
    for r0 in range(0, num_routes, ROUTES):
        route_c = r0 + tl.arange(0, ROUTES)
        expert_c = tl.load(topk_ptr + route_c, mask=route_c < num_routes, other=-1).to(tl.int32)
        valid_c = (expert_c >= 0) & (expert_c < E)
        counts_e += tl.histogram(tl.where(valid_c, expert_c, 0), E_P, mask=valid_c)
    return counts_e


@triton.jit
def _plan_histogram_kernel(topk_ptr, num_routes, counts_ptr, E: tl.constexpr, E_P: tl.constexpr,
                           ROUTES: tl.constexpr):
    counts_e = count_routes(topk_ptr, num_routes, E, E_P, ROUTES)
    e_e = tl.arange(0, E_P)
    tl.store(counts_ptr + e_e, counts_e.to(tl.int64), mask=e_e < E)


def expert_histogram_triton(topk_experts_sk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`moonep_moe.plan.planner.expert_histogram` in one launch of one program (a serving step's routes fit
    one or two loop steps): `[E]` int64 valid routes per expert of `topk_experts_sk [s, K]` (ids
    outside [0, E) count nowhere)."""
    topk_n = topk_experts_sk.contiguous().view(-1)
    counts_e = torch.empty(num_experts, dtype=torch.int64, device=topk_n.device)
    _plan_histogram_kernel[(1,)](topk_n, topk_n.numel(), counts_e, E=num_experts,
                                 E_P=next_power_of_2(max(num_experts, 1)), ROUTES=HISTOGRAM_ROUTES,
                                 num_warps=4)
    return counts_e
