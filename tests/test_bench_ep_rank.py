"""The one-EP-rank stand-in of the benches (`bench.ep_rank`) on the CPU: its groups, the group's plan it takes
its rank from, and a stand-in rank equal to a plain layer whose slot experts copy the home ones."""

import pytest


def test_ep_rank_groups_are_a_ranks_home_experts_and_as_many_slots():
    from bench.ep_rank import ep_rank_groups

    assert ep_rank_groups(256, 8) == (32, 32), "DeepSeek-V3 at EP=8: 32 home + 32 slot groups"
    assert ep_rank_groups(384, 8) == (48, 48), "Kimi-K2 at EP=8"
    for experts, ranks in ((256, 1), (256, 3)):
        with pytest.raises(ValueError, match=f"--ep-rank-of {ranks}"):
            ep_rank_groups(experts, ranks)


def assert_rank_equals_plain(rank, plain, epn: int, tokens: int, hidden: int) -> None:
    """One EP rank's layer and a plain layer over its home experts and their copies give the same output and
    input and router gradients, and each home expert's gradient is the sum of both copies' (float64)."""
    import torch

    x = torch.randn(tokens, hidden, dtype=torch.float64)
    grad = torch.randn(tokens, hidden, dtype=torch.float64)
    outs = []
    for layer in (rank, plain):
        x_th = x.clone().requires_grad_()
        out = layer(x_th)
        out.backward(grad)
        outs.append((out, x_th.grad, layer.router.weight.grad))
    for mine, ref in zip(*outs, strict=True):
        torch.testing.assert_close(mine, ref)
    for name in ("gate_up", "down"):
        ref = getattr(plain.experts, name).grad
        torch.testing.assert_close(getattr(rank.experts, name).grad, ref[:epn] + ref[epn:])


def test_ep_rank_layer_equals_a_layer_whose_slot_experts_copy_the_home_ones():
    """`as_ep_rank`: epn home + epn slot groups of one rank, the slots holding experts 0..epn-1 (the
    prefetch stand-in), equal a plain layer over 2*epn experts whose experts epn+j copy experts j; the home
    gradients are the sums of both copies' (the reduce_grad stand-in), the rest identical."""
    import torch

    from bench.ep_rank import RankOfEPBuffer, as_ep_rank
    from moonep_moe.config import MoEConfig
    from moonep_moe.layers.moe import MoonEPMoELayer
    from moonep_moe.transport.threads import single_world

    epn, tokens, hidden = 4, 48, 16
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=8, num_experts=2 * epn, top_k=3,
                    max_tokens_per_rank=tokens, dtype="float64", token_padding=4,
                    router={"dtype": "float64"})
    torch.manual_seed(0)
    rank = as_ep_rank(MoonEPMoELayer(cfg, single_world("cpu")), epn)
    plain = MoonEPMoELayer(cfg, single_world("cpu"))
    with torch.no_grad():
        plain.router.weight.copy_(rank.router.weight)
        plain.experts.gate_up.copy_(rank.experts.gate_up.repeat(2, 1, 1))
        plain.experts.down.copy_(rank.experts.down.repeat(2, 1, 1))
    assert isinstance(rank._state.buffer, RankOfEPBuffer)
    assert rank.experts.gate_up.shape[0] == epn and rank.experts.num_slots == epn
    assert_rank_equals_plain(rank, plain, epn, tokens, hidden)
    assert int(rank._state.last_plan.cu_seqlens[-1]) >= tokens * 3, "every route in the rank's groups"


def test_ep_rank_plan_is_the_busiest_rank_of_the_groups_real_plan():
    """`ep_rank_plan`: the group's routing at a maxvio, planned by the real planner (exact), and the rank
    hosting the most replicas, with its routes per home expert and per slot (S*K in all)."""
    import torch

    from bench.ep_rank import ep_rank_plan, planned_topk
    from bench.skew import skewed_routing
    from moonep_moe.plan.planner import expert_histogram
    from moonep_moe.plan.reference import plan_global

    experts, ranks, tokens, top_k = 32, 4, 64, 4
    plan = ep_rank_plan(experts, ranks, tokens, top_k, 5.0, "cpu")
    routing = skewed_routing(ranks, experts, top_k, tokens, 5.0, 0, "cpu")
    counts = torch.stack([expert_histogram(t, experts) for t in routing.topk]).tolist()
    reference = plan_global(counts, experts // ranks, 1)
    hosted = [sum(e >= 0 for e in row) for row in reference.experts_to_copy]
    assert plan.rank == hosted.index(max(hosted)) and len(plan.used_slots) == max(hosted) > 0
    epn = experts // ranks
    assert list(plan.home_routes) == reference.alloc[plan.rank][plan.rank * epn:(plan.rank + 1) * epn]
    assert list(plan.slot_routes) == [reference.alloc[plan.rank][e] if e >= 0 else 0
                                      for e in reference.experts_to_copy[plan.rank]]
    assert sum(plan.home_routes) + sum(plan.slot_routes) == tokens * top_k, "exact: S*K routes"
    assert plan.maxvio == pytest.approx(routing.maxvio) and plan.maxvio > 4
    topk = planned_topk(plan, tokens, top_k)
    assert topk.shape == (tokens, top_k) and topk.dtype == torch.int32
    assert torch.bincount(topk.flatten().long(), minlength=2 * epn).tolist() == list(
        plan.home_routes + plan.slot_routes), "the plan's routes per group"
    busy = max(plan.home_routes + plan.slot_routes) <= tokens
    assert not busy or all(len(set(row)) == top_k for row in topk.tolist()), "a token's experts differ"
    with pytest.raises(ValueError, match="not S\\*K"):
        planned_topk(plan, tokens + 1, top_k)


@pytest.mark.parametrize("overlap_prefetch", [False, True], ids=["prefetch-first", "prefetch-beside"])
def test_ep_rank_layer_with_a_plan_prefetches_and_reduces_only_its_slots(overlap_prefetch):
    """`as_ep_rank` with a plan: the router's choice replaced by the plan's routes per group, only the used
    slots copied and reduced; it equals a plain layer over 2*epn experts (experts epn+j copying experts j)
    routed the same way, the home gradients being the sums of both copies'. With `overlap_prefetch` the
    first GEMMs take the rank's `SlotsReady` (its segments' alignment from the rank's Buffer)."""
    import torch

    from bench.ep_rank import RankOfEPBuffer, RankPlan, as_ep_rank, planned_topk
    from moonep_moe.config import MoEConfig
    from moonep_moe.layers.moe import MoonEPMoELayer
    from moonep_moe.transport.threads import single_world

    epn, tokens, hidden, top_k = 4, 12, 16, 2
    plan = RankPlan(ranks=2, rank=0, home_routes=(5, 6, 0, 4), slot_routes=(0, 3, 0, 6), maxvio=1.0,
                    sigma=0.1)
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=8, num_experts=2 * epn, top_k=top_k,
                    max_tokens_per_rank=tokens, dtype="float64", token_padding=4, router={"dtype": "float64"},
                    overlap_prefetch=overlap_prefetch)
    torch.manual_seed(0)
    rank = as_ep_rank(MoonEPMoELayer(cfg, single_world("cpu")), epn, plan)
    plain = MoonEPMoELayer(cfg, single_world("cpu"))
    topk = planned_topk(plan, tokens, top_k)
    plain.router.register_forward_hook(lambda module, args, out: out._replace(topk_experts_tk=topk))
    with torch.no_grad():
        plain.router.weight.copy_(rank.router.weight)
        plain.experts.gate_up.copy_(rank.experts.gate_up.repeat(2, 1, 1))
        plain.experts.down.copy_(rank.experts.down.repeat(2, 1, 1))
    assert isinstance(rank._state.buffer, RankOfEPBuffer) and rank._state.buffer.used_j == (1, 3)
    assert_rank_equals_plain(rank, plain, epn, tokens, hidden)
    slots = rank.experts.rows[0].slots.local
    assert slots.abs().sum() == 0, "the used slots held their gradients, cleared by reduce_grad"
    with torch.no_grad():
        rank(torch.randn(tokens, hidden, dtype=torch.float64))
    assert slots[[0, 2]].abs().sum() == 0 and slots[[1, 3]].abs().sum() > 0, "only the used slots copied"
    ends = rank._state.last_plan.cu_seqlens
    routes = torch.diff(ends, prepend=ends.new_zeros(1))
    assert (routes > 0).tolist() == [True, True, False, True, False, True, False, True], "the plan's groups"
