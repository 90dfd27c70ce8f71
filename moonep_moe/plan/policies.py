"""Balance policies: how far the planner replicates hot experts, each a class in one registry.

The planner itself takes one int, `replica_cost` c (in routes: the GEMM routes whose time equals one expert's
weight transfer), so that the same fixed-shape code (torch and Triton) serves every policy:

- `Exact` (c = 0, the default and training's): every rank computes `T // R` or `T // R + 1` routes for any
  routing when B >= epn, replicating hot experts however few routes they take.
- `CostAware` (c from the link and the GEMM rate, serving): a move pays only if it takes more than c routes
  off its donor, and the plan falls back to plain EP unless the modelled hottest rank gets faster.
- `Off` (c = `NO_REPLICATION`): plain EP, every route on its home rank.

A new policy is one class with a `name` and a `replica_cost`, plus one entry in `BALANCE_POLICIES`;
`MoEConfig.balance` takes its choices from that table.
"""

from __future__ import annotations

import math
from typing import ClassVar

NO_REPLICATION = 2**31 - 1
"""`replica_cost` of `balance='off'`: no move pays (a move takes fewer routes than the group's total, which
the int32 plan fields keep below 2^31), so the plan is plain EP."""


def replica_cost_routes(weight_bytes: float, link_bytes_per_s: float, gemm_flops_per_s: float) -> int:
    """c for `balance='cost_aware'`: GEMM routes whose time equals one expert's weight transfer, rounded up
    (a replica must take more than c routes, so one worth 8.5 routes must take 9), at least 1.

    Moving expert e takes `W_e / BW` with `W_e = 3 * H * H' * weight_bytes` (gate, up, down; `weight_bytes`
    per element as prefetch moves them: the dtype's itemsize, or `fp8.format.WEIGHT_BYTES` for FP8 experts
    with their block scales); computing one of its routes takes `2 * 3 * H * H' / rate` (forward). H * H'
    cancels: `c = weight_bytes * rate / (2 * BW)`, a function of the bytes, the link bandwidth and the GEMM
    rate only. Forward only (serving): in training backward prefetches again and reduce_grad moves the
    gradients (`MoEConfig.replica_grad_dtype`: g bytes), while the routes cost 3x the FLOPs, so the
    break-even is `(2 * weight_bytes + g) / (3 * weight_bytes)` times this (1 for bf16 with "param"
    gradients, 4/3 with "main_grad"'s fp32).
    """
    return max(1, math.ceil(weight_bytes * gemm_flops_per_s / (2 * link_bytes_per_s)))


class BalancePolicy:
    """One replication policy: its config name and the planner's `replica_cost` for a layer."""

    name: ClassVar[str]
    exact: ClassVar[bool] = False
    """Whether the balance invariant holds (rows sized for S*K routes); else best effort (R*S*K)."""

    def replica_cost(self, weight_bytes: float, link_bytes_per_s: float, gemm_flops_per_s: float) -> int:
        """c for a layer whose expert weights move `weight_bytes` per element, on this link and GEMM rate."""
        raise NotImplementedError


class Exact(BalancePolicy):
    name = "exact"
    exact = True

    def replica_cost(self, weight_bytes: float, link_bytes_per_s: float, gemm_flops_per_s: float) -> int:
        return 0


class CostAware(BalancePolicy):
    name = "cost_aware"

    def replica_cost(self, weight_bytes: float, link_bytes_per_s: float, gemm_flops_per_s: float) -> int:
        return replica_cost_routes(weight_bytes, link_bytes_per_s, gemm_flops_per_s)


class Off(BalancePolicy):
    name = "off"

    def replica_cost(self, weight_bytes: float, link_bytes_per_s: float, gemm_flops_per_s: float) -> int:
        return NO_REPLICATION


BALANCE_POLICIES: dict[str, BalancePolicy] = {policy.name: policy for policy in (Exact(), CostAware(), Off())}
"""Every balance policy by its config name (`MoEConfig.balance`); the first is the default."""
BALANCE_NAMES = tuple(BALANCE_POLICIES)
