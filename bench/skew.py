"""Routing skew over a whole EP group: the demo's generator (`moonep_moe.apps.demo.make_model`) at a target
maxvio, for the benchmarks that time a group's ranks (`bench.ep_group`) or one rank of it (`bench.layer
--ep-rank-of`).

maxvio is the group's hottest expert's routes over the mean, minus 1 (the demo's measure). The generator
offsets every expert's logits by `sigma * z_e` (lognormal expert popularity); `skewed_routing` bisects sigma
until the maxvio is reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moonep_moe.apps.demo import make_model
from moonep_moe.config import MoEConfig
from moonep_moe.layers.router import TopKRouter

ROUTER_HIDDEN = 64
"""The demo generator's token width: only its routing is used (the bench's tokens are drawn apart)."""
SIGMA_RANGE = (1e-3, 4.0)
"""The bisection's bracket of the generator's skew sigma (maxvio 20 needs about 0.3)."""
SIGMA_STEPS = 14
"""Bisection steps (log scale): the bracket narrows to a factor of 1.0005."""


@dataclass
class Routing:
    """One step's routing of a group: per rank `[S, K]` int32 experts and float64 route weights, the maxvio
    reached (the group's hottest expert over the mean, minus 1) and the generator's sigma."""

    topk: list[torch.Tensor]
    weights: list[torch.Tensor]
    maxvio: float
    sigma: float


def router_config(ranks: int, experts: int, top_k: int, tokens: int) -> MoEConfig:
    """The demo generator's config: `ROUTER_HIDDEN`-wide tokens routed by a float64 softmax top-k router."""
    return MoEConfig(hidden_size=ROUTER_HIDDEN, ffn_hidden_size=1, num_experts=experts, top_k=top_k,
                     ep_size=ranks, max_tokens_per_rank=tokens, dtype="float64", router={"dtype": "float64"})


def skewed_routing(ranks: int, experts: int, top_k: int, tokens: int, maxvio: float, seed: int,
                   device: torch.device | str) -> Routing:
    """The demo's generator (`apps.demo.make_model`: expert logits offset by `sigma * z_e`, lognormal
    expert popularity) over the whole group, with sigma bisected (log scale, `SIGMA_STEPS` steps in
    `SIGMA_RANGE`) until the group's maxvio reaches `maxvio` (0: sigma 0). The demo's router is linear in
    sigma (`base + sigma * z u`), so its tokens are drawn once and each sigma only routes them again, on
    `device`."""
    cfg = router_config(ranks, experts, top_k, tokens)
    plain, leaning = make_model(cfg, 0.0, seed), make_model(cfg, 1.0, seed)
    router = TopKRouter(cfg.router, cfg.hidden_size, experts, top_k).to(device)
    hidden = [x.to(device) for x in plain.hidden]
    base_eh = plain.router_weight_eh.to(device)
    lean_eh = leaning.router_weight_eh.to(device) - base_eh

    @torch.no_grad()
    def route(sigma: float) -> tuple[list, float]:
        router.weight.copy_(base_eh + sigma * lean_eh)
        outs = [router(x) for x in hidden]
        counts_e = sum(out.tokens_per_expert_e.double() for out in outs)
        return outs, float(counts_e.max() / counts_e.mean() - 1)

    sigma = 0.0
    if maxvio > 0:
        low, high = SIGMA_RANGE
        for _ in range(SIGMA_STEPS):
            mid = math.sqrt(low * high)
            low, high = (mid, high) if route(mid)[1] < maxvio else (low, mid)
        sigma = high
    outs, reached = route(sigma)
    return Routing([out.topk_experts_tk for out in outs], [out.route_weights_tk for out in outs], reached,
                   sigma)
