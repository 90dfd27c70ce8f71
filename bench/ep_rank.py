"""One rank of an EP group, stood in for by a one-rank layer on one GPU: what `bench.layer --ep-rank-of R`
and the benches built on its tables measure (`bench.gemm`, `bench.memory`, `bench.wgrad_hygiene`).

`ep_rank_plan` plans the whole group's routing at a skew with the real planner and takes the rank hosting
the most replicas (`RankPlan`); `as_ep_rank` turns a one-rank layer over `2 * epn` experts into one that
computes that rank's work: `epn` home groups and the slots the plan fills, its Buffer wrapped in
`RankOfEPBuffer`, which stands in for the slots' weight and gradient traffic with local copies of the same
bytes. No peer traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bench.skew import skewed_routing
from moonep_moe.comm.buffer import Buffer
from moonep_moe.config import MoEConfig
from moonep_moe.layers.function import ExpertsState
from moonep_moe.layers.moe import MoonEPMoELayer, experts_gemm
from moonep_moe.layers.router import RouterOutput
from moonep_moe.plan.device import plan_global_device
from moonep_moe.plan.planner import expert_histogram
from moonep_moe.weights.experts import HomeExperts
from moonep_moe.weights.pool import ExpertRows


def ep_rank_groups(num_experts: int, ep_size: int) -> tuple[int, int]:
    """`(epn, B)` of one rank of an EP group of `ep_size` ranks over `num_experts` experts, with the
    training default `B = epn`: the home and slot groups of the `--ep-rank-of` rows' one rank."""
    if ep_size < 2 or num_experts % ep_size:
        raise ValueError(f"--ep-rank-of {ep_size}: needs >= 2 ranks dividing --experts {num_experts}")
    epn = num_experts // ep_size
    return epn, epn


class RankOfEPBuffer:
    """Bench-only: the Buffer one rank of an EP group sees, in a one-rank world (the `--ep-rank-of` rows).

    `inner` is a real one-rank `Buffer` over `2 * epn` experts: its dispatch and combine (the planner and the
    row kernels, all local) put the rank's S*K routes into `2 * epn` padded segments, which `MoonEPExperts`
    reads as `epn` home groups, then `epn` slot groups (`compute_offsets` with `E = epn`). The slots' weight
    traffic is stood in for by local copies of the same bytes, one contiguous copy per slot and weight (as
    the real `copy_experts` and `add_replicas` kernels move whole experts, near the copy rate):
    `prefetch_weight` copies the home experts into the slots (over NVLink in a real group, and from peers),
    `reduce_grad` adds the slot gradients into the home gradients and clears the slots (in a real group the
    replicas' owners pull them); with `used_slots` (the slots a plan fills, `ep_rank_plan`) only those, else
    all of them. No peer traffic: the group's
    histogram all-gather, remote rows and every wait on a peer are left out, and so is the duplicate rows'
    expansion and pre-reduction (one rank's plans have none), and with them combine's copy of the expert
    outputs into the rows where the GEMM backend makes its own (`torch`; DeepGEMM and FP8 write into the
    rows, `GroupedGemm.fwd`'s `out`). Owns nothing.
    """

    def __init__(self, inner: Buffer, epn: int, used_slots: tuple[int, ...] | None = None):
        self.inner, self.epn, self.E = inner, epn, epn
        self.world, self.dtype, self.weight_dtype = inner.world, inner.dtype, inner.weight_dtype
        self.token_padding = inner.token_padding  # the rank's segments are the inner Buffer's
        self.used_j = tuple(range(epn) if used_slots is None else used_slots)
        """The slots whose weights are copied in and whose gradients are added back."""

    @property
    def hidden_nvsh_buffer_view(self) -> torch.Tensor:
        return self.inner.hidden_nvsh_buffer_view

    def dispatch(self, *args, **kwargs):
        return self.inner.dispatch(*args, **kwargs)

    def combine(self, *args, **kwargs):
        return self.inner.combine(*args, **kwargs)

    @torch.no_grad()
    def prefetch_weight(self, plan, gate_up: ExpertRows, up: None, down: ExpertRows, scales=None,
                        async_finish: bool = False, wait_for_readers: bool = True):
        """FP8 experts' block scales (`scales`: one `ExpertRows` per weight, or None) travel with them. With
        `async_finish` the copies run on the inner Buffer's comm stream, as the real prefetch does, and the
        event is returned. No peer reads this rank's experts here: `wait_for_readers` changes nothing."""
        moved = [gate_up, down] + ([] if scales is None else [s for s in scales if s is not None])

        def copies():
            for rows in moved:
                for j in self.used_j:
                    rows.slots.local[j].copy_(rows.home.local[j])

        return self.inner._launch(async_finish, copies, tuple(moved))[1]

    @torch.no_grad()
    def reduce_grad(self, plan, gate_up: ExpertRows, up: None, down: ExpertRows, *, behind: bool = False
                    ) -> None:
        """With `behind` on the inner Buffer's comm stream, left running behind the caller, as the real
        one (`Buffer.reduce_grad`)."""
        projections = [grads for grads in (gate_up, down) if grads is not None]

        def op():
            for grads in projections:
                home, slots = grads.home.local, grads.slots.local
                for j in self.used_j:
                    home[j].add_(slots[j])  # in fp32, rounded once to the home gradient's dtype (slots:
                    # fp32, or the home dtype where the gradients overwrote the slot weights)
                    slots[j].zero_()

        if behind:
            self.inner._run_behind(op, tuple(grads.slots for grads in projections))
        else:
            self.inner._launch(False, op, ())

    def wait_behind(self) -> None:
        self.inner.wait_behind()


@dataclass(frozen=True)
class RankPlan:
    """One rank of an EP group of `ranks` ranks as the real planner (balance exact) plans it at a routing
    skew: what the `--ep-rank-of` rows compute. Pure description."""

    ranks: int
    rank: int
    home_routes: tuple[int, ...]
    """`[epn]` routes of each home expert the rank computes."""
    slot_routes: tuple[int, ...]
    """`[B]` routes of the replica in each slot, 0 for an unused slot."""
    maxvio: float
    """The group's routing skew reached (the target is the table's)."""
    sigma: float

    @property
    def epn(self) -> int:
        return len(self.home_routes)

    @property
    def used_slots(self) -> tuple[int, ...]:
        return tuple(j for j, routes in enumerate(self.slot_routes) if routes > 0)

    def describe(self) -> dict:
        """The record's `setup.ep_rank_plan`."""
        return {"rank": self.rank, "maxvio_reached": self.maxvio, "sigma": self.sigma,
                "slots_used": len(self.used_slots), "home_routes": list(self.home_routes),
                "slot_routes": list(self.slot_routes)}


def ep_rank_plan(experts: int, ranks: int, tokens: int, top_k: int, maxvio: float,
                 device: torch.device | str, seed: int = 0) -> RankPlan:
    """The group's routing at `maxvio` (`bench.skew.skewed_routing`: the demo's generator over R ranks of
    `tokens` tokens), planned (`plan_global_device`, balance exact, B = epn), and the rank hosting the most
    replicas (ties: the lowest): its routes per home expert and per slot."""
    routing = skewed_routing(ranks, experts, top_k, tokens, maxvio, seed, device)
    counts_re = torch.stack([expert_histogram(t, experts) for t in routing.topk])
    epn = experts // ranks
    plan = plan_global_device(counts_re, num_slots=epn, token_padding=1)
    hosted_r = (plan.experts_to_copy_rb >= 0).sum(1).cpu()
    rank = int(torch.argmax(hosted_r * ranks - torch.arange(ranks)))
    alloc_e, table_b = plan.alloc_re[rank].cpu(), plan.experts_to_copy_rb[rank].cpu()
    slot_routes = torch.where(table_b >= 0, alloc_e[table_b.clamp(min=0)], 0)
    return RankPlan(ranks, rank, tuple(alloc_e[rank * epn:(rank + 1) * epn].tolist()),
                    tuple(slot_routes.tolist()), routing.maxvio, routing.sigma)


def planned_topk(plan: RankPlan, tokens: int, top_k: int) -> torch.Tensor:
    """`[tokens, top_k]` int32 experts of a one-rank layer over `2 * epn` experts (home expert j is j, slot j
    is `epn + j`) with the plan's routes per group: the experts' ids repeated by their routes, dealt k-major
    (token s gets positions s, S + s, ...), so a token's K experts differ unless one has more than S routes.
    Raises ValueError unless the plan's routes are `tokens * top_k` (exact balance, every route valid)."""
    counts_g = torch.tensor(plan.home_routes + plan.slot_routes)
    if int(counts_g.sum()) != tokens * top_k:
        raise ValueError(f"planned_topk: the rank computes {int(counts_g.sum())} routes, not S*K = "
                         f"{tokens * top_k}")
    ids_n = torch.repeat_interleave(torch.arange(len(counts_g)), counts_g)
    return ids_n.view(top_k, tokens).t().contiguous().to(torch.int32)


def as_ep_rank(layer: MoonEPMoELayer, epn: int, plan: RankPlan | None = None) -> MoonEPMoELayer:
    """Bench-only: turn a one-rank layer over `2 * epn` experts into one that computes what ONE rank of an
    EP group computes with `epn` home experts and `B = epn` slots, in place. The layer keeps its router
    (over `2 * epn` experts), planner and row kernels; with `plan` its grouped GEMM is the one the real
    rank's config picks (`rank_config`, `experts_gemm`: `epn` home groups of S*K / epn rows and `epn` slots);
    its home experts become a `HomeExperts` of `epn` experts with `epn` slots (joined by the arena
    where it applies, as in a real group) holding its first `epn` experts' weights, and its Buffer is
    wrapped in `RankOfEPBuffer`. Slot j then holds expert j, so the layer equals one over `2 * epn` experts
    whose experts `epn + j` are copies of experts j. With `plan` (`ep_rank_plan`) the router's choice is
    replaced by the plan's routes per group (`planned_topk`, a forward hook on the router: its scores and
    their gradient stay) and only the slots the plan fills are prefetched and reduced. Sets the layer's
    private `_state`: no hook in the package."""
    cfg, world = layer.config, layer.world
    if cfg.num_experts != 2 * epn or world.size != 1:
        raise ValueError(f"as_ep_rank needs a one-rank layer over 2 * epn = {2 * epn} experts, got "
                         f"num_experts={cfg.num_experts} on {world.size} ranks")
    if plan is not None and plan.epn != epn:
        raise ValueError(f"as_ep_rank: the plan's rank has {plan.epn} home experts, not epn = {epn}")
    whole = layer.experts
    gemm = layer._state.gemm if plan is None else experts_gemm(rank_config(cfg, plan.ranks), world)
    rank = HomeExperts(world, epn, cfg.hidden_size, cfg.ffn_hidden_size, epn, cfg.torch_dtype,
                       name=f"{whole.name}/rank-of-ep", seed=layer.init_seed,
                       grads_in_slots=whole.grads_in_slots)
    rank.bind(world)
    with torch.no_grad():
        rank.gate_up.copy_(whole.gate_up[:epn])
        rank.down.copy_(whole.down[:epn])
    whole.release()
    layer.experts = rank
    state = layer._state
    used = None if plan is None else plan.used_slots
    layer._state = ExpertsState(RankOfEPBuffer(layer.buffer, epn, used), rank, gemm, state.main_grad,
                                overlap_prefetch=state.overlap_prefetch,
                                overlap_reduce_grad=state.overlap_reduce_grad)
    if plan is not None:
        topk_sk = planned_topk(plan, cfg.max_tokens_per_rank, cfg.top_k).to(world.device)
        counts_e = torch.bincount(topk_sk.flatten().long(), minlength=2 * epn).to(torch.int32)

        def planned(router: nn.Module, args: tuple, routing: RouterOutput) -> RouterOutput:
            if routing.topk_experts_tk.shape != topk_sk.shape:
                raise ValueError(f"the --ep-rank-of layer routes S = {topk_sk.shape[0]} tokens, got "
                                 f"{routing.topk_experts_tk.shape[0]}")
            return routing._replace(topk_experts_tk=topk_sk, tokens_per_expert_e=counts_e)

        layer.router.register_forward_hook(planned)
    return layer


def rank_config(cfg: MoEConfig, ranks: int) -> MoEConfig:
    """The config of one rank of the group the one-rank stand-in ``cfg`` (over ``2 * epn`` experts) computes
    for (`as_ep_rank`): ``epn * ranks`` experts on ``ranks`` ranks, ``epn`` slots, every other field as
    ``cfg`` has it."""
    epn = cfg.num_experts // 2
    return MoEConfig(**{**cfg.model_dump(), "num_experts": epn * ranks, "ep_size": ranks,
                        "num_prefetch_slots": epn})
