"""The planner's replication policy (`replica_cost`, `CommConfig.balance`: exact | cost_aware | off).

Cost-aware plans are checked against plain EP where no transfer pays and against exact where every one does,
for every planner invariant that still applies (each route computed once, segments, dst encoding, at most B
replicas a receiver), for identity across ranks, for torch == Triton (Triton's interpreter on CPU
tensors), and end to end through the layer against the dense reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_layer import assert_matches_dense, build_layer, make_config, make_problem
from test_plan import (
    Scenario,
    assert_duplicates,
    assert_loads_match_routes,
    assert_replicas,
    assert_rows,
    assert_segments,
    histograms,
    scenarios,
    topk_from_counts,
)
from test_plan_kernel import KERNEL_DEVICE, assert_plans_equal

from moonep_moe.base.sizes import rows_capacity
from moonep_moe.comm.pool import BufferPool
from moonep_moe.config import load_config
from moonep_moe.engine.communicator import MoECommunicator
from moonep_moe.plan.device import _balance_ranks_device, _split_quotas_device, plan_global_device
from moonep_moe.plan.planner import plan_routes
from moonep_moe.plan.policies import NO_REPLICATION, replica_cost_routes
from moonep_moe.plan.reference import balance_ranks, modelled_load, plan_global, split_quotas
from moonep_moe.plan.triton import plan_routes_triton
from moonep_moe.transport.threads import run_ranks, single_world

GLOBAL_FIELDS = ("experts_to_copy", "rank_load", "home_load", "expert_load", "slots_used")
"""Plan fields that are a function of the histogram only (identical on every rank)."""


@dataclass
class PolicyScenario(Scenario):
    """A `Scenario` planned under the replication policy `replica_cost`."""

    replica_cost: int = 0

    @property
    def NvS(self) -> int:
        return rows_capacity(self.S, self.K, self.R, self.E, self.B, self.tp, self.replica_cost)

    def plan(self, rank: int, topk_sk: torch.Tensor | None = None):
        topk_sk = self.topk_rsk[rank] if topk_sk is None else topk_sk
        return plan_routes(self.counts_re, topk_sk, rank=rank, num_slots=self.B, token_padding=self.tp,
                           rows_per_rank=self.NvS, replica_cost=self.replica_cost)


def with_cost(sc: Scenario, replica_cost: int) -> PolicyScenario:
    return PolicyScenario(*(getattr(sc, f.name) for f in fields(Scenario)), replica_cost=replica_cost)


@st.composite
def policy_scenarios(draw) -> PolicyScenario:
    """Any scenario of test_plan (B >= epn, B = 0, B = 1 < epn), with a cost from 1 (almost exact) through
    the size of a rank's share (some moves pay) to `NO_REPLICATION`."""
    sc = draw(st.one_of(scenarios(), scenarios(slots="zero"), scenarios(slots="one", min_epn=2, min_ranks=2)))
    share = max(1, sc.total_routes // sc.R)
    cost = draw(st.sampled_from([1, 2, max(1, share // 8), max(1, share // 2), share, NO_REPLICATION]))
    return with_cost(sc, cost)


def plain_ep(sc: Scenario) -> dict[str, list]:
    """Plain EP's global fields: no replica, each rank computes its home experts' routes."""
    home_r = sc.counts_re.sum(0).view(sc.R, sc.epn).sum(1).tolist()
    return dict(experts_to_copy=[[-1] * sc.B for _ in range(sc.R)], rank_load=home_r, home_load=home_r,
                slots_used=[0] * sc.R)


def assert_global_fields(sc: Scenario, want: dict[str, list]) -> None:
    for plan in sc.plans:
        for name, value in want.items():
            assert getattr(plan, name).tolist() == value, name


def skewed_scenario(R: int, epn: int, K: int, S: int, hot_experts: int, seed: int) -> Scenario:
    """Every rank sends its routes to the first `hot_experts` experts (all on rank 0) and spreads the rest."""
    E = R * epn
    gen = torch.Generator().manual_seed(seed)
    counts_e = torch.zeros(E, dtype=torch.int64)
    counts_e[:hot_experts] = S  # each of a token's K routes goes to a distinct expert: at most S each
    rest = S * K - hot_experts * S
    counts_e[hot_experts:] = rest // (E - hot_experts)
    counts_e[hot_experts:hot_experts + rest % (E - hot_experts)] += 1
    topk_rsk = [topk_from_counts(counts_e, S, K, gen) for _ in range(R)]
    return Scenario(R, E, K, S, epn, 8, topk_rsk)


# -- where nothing pays, where everything pays ------------------------------------------------------------


def test_cost_aware_is_plain_ep_on_a_decode_step():
    """DeepSeek-V3's decode shape (R=8, E=256, K=8), 4 tokens a rank all on rank 0's experts: exact
    replicates, cost-aware (c from the bf16 defaults: 1724 routes) moves nothing, as 'off' does."""
    cfg = load_config("deepseek-v3", ep_size=8, balance="cost_aware")
    sc = skewed_scenario(R=8, epn=32, K=8, S=4, hot_experts=8, seed=0)
    assert int(sc.plans[0].slots_used.sum()) > 0, "exact replicates this step"
    for cost in (cfg.replica_cost, NO_REPLICATION):
        policy = with_cost(sc, cost)
        assert_global_fields(policy, plain_ep(sc))
        rt = policy.routes
        assert torch.equal(rt["dest"][rt["valid"]], rt["expert"][rt["valid"]] // sc.epn), "every route home"
        assert_rows(policy)
        assert_segments(policy)


def test_cost_aware_equals_exact_where_every_transfer_pays():
    """A huge skewed step (2048 tokens a rank, hot experts on rank 0) with transfers worth 8 routes: every
    move of the exact plan takes far more than 8 routes and the modelled hottest rank drops, so the
    cost-aware plan is the exact plan, field for field on every rank."""
    sc = skewed_scenario(R=4, epn=4, K=4, S=2048, hot_experts=3, seed=1)
    ref = plan_global(sc.counts_re.tolist(), sc.B, sc.tp)
    replicas = [n for d, row in enumerate(ref.alloc) for e, n in enumerate(row) if n and e // sc.epn != d]
    assert replicas and min(replicas) > 8
    assert max(modelled_load(ref.alloc, 8)) < max(ref.home_load)
    cost = replica_cost_routes(2, link_bytes_per_s=1e12, gemm_flops_per_s=8e12)
    assert cost == 8
    nvs = rows_capacity(sc.S, sc.K, sc.R, sc.E, sc.B, sc.tp, cost)  # best effort: R*S*K routes
    for rank in range(sc.R):
        kwargs = dict(rank=rank, num_slots=sc.B, token_padding=sc.tp, rows_per_rank=nvs)
        exact = plan_routes(sc.counts_re, sc.topk_rsk[rank], **kwargs)
        cost_aware = plan_routes(sc.counts_re, sc.topk_rsk[rank], **kwargs, replica_cost=cost)
        for f in fields(exact):
            a, b = getattr(exact, f.name), getattr(cost_aware, f.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name


# -- invariants on random histograms ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(policy_scenarios())
def test_cost_aware_plans_keep_the_invariants(sc):
    """Each valid route computed exactly once in its expert's segment, loads that match the routes, padded
    segments, duplicates encoded, at most B replicas a rank, identical global fields on every rank; every
    replica takes more than `replica_cost` routes; no rank both sends and receives a replica; the plan is
    plain EP or its modelled hottest rank is faster than plain EP's."""
    assert_loads_match_routes(sc)
    assert_rows(sc)
    assert_segments(sc)
    assert_duplicates(sc)
    assert_replicas(sc, one_donor=sc.replica_cost == 0)
    first = sc.plans[0]
    for plan in sc.plans[1:]:
        for name in GLOBAL_FIELDS:
            assert torch.equal(getattr(plan, name), getattr(first, name)), name
    rt = sc.routes
    valid = rt["valid"]
    alloc = torch.zeros(sc.R, sc.E, dtype=torch.int64)
    alloc.index_put_((rt["dest"][valid], rt["expert"][valid]), torch.ones_like(rt["dest"][valid]),
                     accumulate=True)
    replica = (alloc > 0) & (torch.arange(sc.E)[None, :] // sc.epn != torch.arange(sc.R)[:, None])
    assert bool((alloc[replica] > sc.replica_cost).all()), "every replica takes more than c routes"
    if sc.replica_cost:
        sends_r = replica.view(sc.R, sc.R, sc.epn).any(2).any(0)  # [home rank]: some rank holds its expert
        assert not bool((sends_r & replica.any(1)).any()), "no rank both sends and receives a replica"
    home_r = first.home_load
    if replica.any():
        assert max(modelled_load(alloc.tolist(), sc.replica_cost)) < int(home_r.max())
    else:
        assert first.rank_load.tolist() == home_r.tolist()
    if sc.replica_cost == NO_REPLICATION:
        assert not replica.any()


@settings(max_examples=100, deadline=None)
@given(histograms(), st.sampled_from([1, 2, 5, 100, 10**4, NO_REPLICATION]))
def test_device_policy_equals_reference(case, cost):
    """The torch planner (what `plan_routes` runs off CUDA) equals the host reference under the policy."""
    counts_re, B, tp = case
    ref = plan_global(counts_re.tolist(), B, tp, cost)
    for dtype in (torch.int64, torch.int32):
        dev = plan_global_device(counts_re.to(dtype), B, tp, cost)
        assert dev.alloc_re.tolist() == ref.alloc
        assert dev.experts_to_copy_rb.tolist() == ref.experts_to_copy
        assert dev.row_base_re.tolist() == ref.row_base
        assert dev.cu_seqlens_rg.tolist() == ref.cu_seqlens
        assert dev.zero_fill_rg2.tolist() == ref.zero_fill


@settings(max_examples=50, deadline=None)
@given(histograms(), st.sampled_from([0, 1, 5, 100, 10**4]))
def test_device_split_stops_early_only_where_every_later_iteration_is_a_no_op(case, cost):
    """The torch planner's per-donor split stops at its first iteration without a move on the CPU; its fixed
    trip count (what runs on a GPU, no host read) gives the same allocation."""
    counts_re, B, _ = case
    expert_load_e = counts_re.long().sum(0)
    quota_dr = _balance_ranks_device(expert_load_e.view(counts_re.shape[0], -1).sum(1), cost)
    early, fixed = (_split_quotas_device(expert_load_e, quota_dr, B, cost, stop_early=stop)
                    for stop in (True, False))
    assert torch.equal(early, fixed)


def test_fallback_to_plain_ep_when_the_hottest_rank_gets_no_faster():
    """R=3, epn=2, B=2, ranks 0 and 1 at 60 routes, rank 2 idle: each of ranks 0 and 1 gives rank 2 20 routes
    of one expert (a receiver with two donors, each move capped at its donor's surplus). At c = 19 routes a
    transfer every move takes more than c, but rank 2 then computes 40 routes + 2 transfers = 78 >= 60 in
    the model, so the plan falls back to plain EP. With c = 9 it pays (58 < 60)."""
    counts_re = [[30, 30, 30, 30, 0, 0], [0] * 6, [0] * 6]
    home = [60, 60, 0]
    assert balance_ranks(home, 19) == [(0, 2, 20), (1, 2, 20)]
    greedy = split_quotas([30, 30, 30, 30, 0, 0], balance_ranks(home, 19), 3, 2, 19)
    assert modelled_load(greedy, 19) == [59, 59, 78]
    fallback = plan_global(counts_re, 2, 1, 19)
    assert fallback.experts_to_copy == [[-1, -1]] * 3
    assert [sum(row) for row in fallback.alloc] == home
    pays = plan_global(counts_re, 2, 1, 9)
    assert max(modelled_load(pays.alloc, 9)) == 58
    assert pays.experts_to_copy[2] == [0, 2]
    for cost in (9, 19):
        dev = plan_global_device(torch.tensor(counts_re), 2, 1, cost)
        assert dev.alloc_re.tolist() == plan_global(counts_re, 2, 1, cost).alloc


SHARED_LOAD_E = [40, 40, 36, 36, 16, 16, 32, 32]
"""R=4, epn=2 (four source ranks each send a quarter): home loads [80, 72, 32, 64], target 62."""


@pytest.mark.parametrize("num_slots", [1, 2])
def test_a_donor_never_turns_receiver_under_a_replica_cost(num_slots):
    """Exact balance has rank 0 fill rank 2's whole deficit (30 routes, more than its surplus of 18), then
    take 12 back from rank 1: rank 0 both sends and receives a replica. With c = 4 each move stops at its
    donor's surplus, so ranks 0 and 1 both give to rank 2 and no donor receives. Rank 2's slots go to its
    donors in ascending rank: with one slot only rank 0's replica fits and rank 1 keeps its routes."""
    home = [80, 72, 32, 64]
    assert balance_ranks(home, 0) == [(0, 2, 30), (1, 0, 12), (3, 1, 2)]
    assert balance_ranks(home, 4) == [(0, 2, 18), (1, 2, 10)]
    counts_re = [[n // 4 for n in SHARED_LOAD_E]] * 4
    ref = plan_global(counts_re, num_slots, 1, 4)
    want = [0, 2] if num_slots == 2 else [0]
    assert ref.experts_to_copy[2] == want + [-1] * (num_slots - len(want))
    assert [sum(row) for row in ref.alloc] == ([62, 62, 60, 64] if num_slots == 2 else [62, 72, 50, 64])
    dev = plan_global_device(torch.tensor(counts_re), num_slots, 1, 4)
    assert dev.alloc_re.tolist() == ref.alloc and dev.experts_to_copy_rb.tolist() == ref.experts_to_copy


TIE_COUNTS_RE = [[1, 0, 2, 0, 3, 1], [0, 0, 13, 2, 0, 13], [0, 0, 3, 0, 0, 5]]
"""R=3, E=6, B=2 at c = 4: two replicas that gain nothing (the modelled hottest rank ties plain EP's)."""


def test_fallback_on_a_tie_keeps_no_replica():
    """Ranks 2 and 1 each give rank 0 one replica (7 and 6 routes, both more than c = 4), which leaves rank 0
    at 14 routes + two transfers = 22 in the model: the hottest rank of plain EP computes 22 too, so the
    replicas gain nothing and the plan is plain EP, on the host reference and the torch device planner alike
    (the Triton planner: the "tie" fixed case below)."""
    expert_load = [sum(col) for col in zip(*TIE_COUNTS_RE, strict=True)]
    home = [1, 20, 22]
    assert balance_ranks(home, 4) == [(2, 0, 7), (1, 0, 6)]
    greedy = split_quotas(expert_load, balance_ranks(home, 4), 3, 2, 4)
    assert greedy[0] == [1, 0, 6, 0, 0, 7] and max(modelled_load(greedy, 4)) == max(home) == 22
    ref = plan_global(TIE_COUNTS_RE, 2, 4, 4)
    assert ref.experts_to_copy == [[-1, -1]] * 3
    assert [sum(row) for row in ref.alloc] == home
    dev = plan_global_device(torch.tensor(TIE_COUNTS_RE), 2, 4, 4)
    assert dev.alloc_re.tolist() == ref.alloc and dev.experts_to_copy_rb.tolist() == ref.experts_to_copy


# -- Triton == torch -----------------------------------------------------------------------------------------


@settings(max_examples=6, deadline=None)
@given(policy_scenarios(), st.data())
def test_kernel_policy_plan_equals_torch_plan(sc, data):
    """The Triton planner (compiled on CUDA, in the interpreter on CPU tensors elsewhere) gives the torch
    planner's plan under the policy."""
    rank = data.draw(st.integers(0, sc.R - 1))
    kwargs = dict(rank=rank, num_slots=sc.B, token_padding=sc.tp, rows_per_rank=sc.NvS,
                  replica_cost=sc.replica_cost)
    kernel = plan_routes_triton(sc.counts_re.to(KERNEL_DEVICE), sc.topk_rsk[rank].to(KERNEL_DEVICE), **kwargs)
    assert_plans_equal(kernel, plan_routes(sc.counts_re, sc.topk_rsk[rank], **kwargs))


def _fixed_cases() -> dict[str, PolicyScenario]:
    """The deterministic cases above as scenarios: decode (nothing pays), huge (everything pays), fallback,
    the fallback's tie, a receiver with two donors (one slot and two), one with three donors and two slots."""
    gen = torch.Generator().manual_seed(3)
    fallback = [topk_from_counts(torch.tensor(row), 30, 4, gen) for row in
                ([30, 30, 30, 30, 0, 0], [0] * 6, [0] * 6)]
    tie = [topk_from_counts(torch.tensor(row), 13, 4, gen) for row in TIE_COUNTS_RE]
    shared = [topk_from_counts(torch.tensor(SHARED_LOAD_E) // 4, 16, 4, gen) for _ in range(4)]
    # R=16, epn=2: ranks 0-3 hot, rank 15 idle; at c = 5 rank 14 takes from donors 1, 2 and 3, and its two
    # slots run out before donor 3's turn
    hot_e = torch.tensor([4] * 8 + [1] * 22 + [0] * 2)
    sixteen = [topk_from_counts(hot_e, 16, 4, gen) for _ in range(16)]
    return dict(decode=with_cost(skewed_scenario(8, 32, 8, 4, 8, seed=0), 1724),
                pays=with_cost(skewed_scenario(4, 4, 4, 256, 3, seed=1), 8),
                fallback=with_cost(Scenario(3, 6, 4, 30, 2, 1, fallback), 19),
                tie=with_cost(Scenario(3, 6, 4, 13, 2, 4, tie), 4),
                shared_one_slot=with_cost(Scenario(4, 8, 4, 16, 1, 1, shared), 4),
                shared_two_slots=with_cost(Scenario(4, 8, 4, 16, 2, 1, shared), 4),
                shared_sixteen_ranks=with_cost(Scenario(16, 32, 4, 16, 2, 1, sixteen), 5),
                off=with_cost(skewed_scenario(4, 4, 4, 64, 3, seed=2), NO_REPLICATION))


@pytest.mark.parametrize("name", list(_fixed_cases()))
def test_kernel_policy_plan_on_fixed_cases(name):
    sc = _fixed_cases()[name]
    for rank in (0, sc.R - 1):
        kwargs = dict(rank=rank, num_slots=sc.B, token_padding=sc.tp, rows_per_rank=sc.NvS,
                      replica_cost=sc.replica_cost)
        kernel = plan_routes_triton(sc.counts_re.to(KERNEL_DEVICE), sc.topk_rsk[rank].to(KERNEL_DEVICE),
                                    **kwargs)
        assert_plans_equal(kernel, plan_routes(sc.counts_re, sc.topk_rsk[rank], **kwargs))
    replicates = name == "pays" or name.startswith("shared")
    assert (int(sc.plans[0].slots_used.sum()) > 0) == replicates, "only the huge and shared steps replicate"


# -- config, Buffer, layer and communicator ---------------------------------------------------------------


def test_config_policy_and_cost():
    cfg = load_config("deepseek-v3", ep_size=8)
    assert cfg.balance == "exact" and cfg.replica_cost == 0
    serving = load_config("deepseek-v3", ep_size=8, balance="cost_aware")
    assert serving.replica_cost == 1724  # ceil(2 B * 775.8e12 FLOP/s / (2 * 450e9 B/s))
    assert load_config("deepseek-v3", ep_size=8, balance="off").replica_cost == NO_REPLICATION
    S, K, R = cfg.max_tokens_per_rank, cfg.top_k, cfg.ep_size
    assert cfg.rows_per_rank < R * S * K <= serving.rows_per_rank
    with pytest.raises(ValueError, match="balance"):
        load_config("deepseek-v3", balance="greedy")
    with pytest.raises(ValueError, match="link_bandwidth_gbs"):
        load_config("deepseek-v3", link_bandwidth_gbs=0)


def test_replica_cost_rounds_up_and_counts_the_bytes_that_move():
    """c is the GEMM routes one expert's transfer is worth, rounded up (8.5 routes: a replica must take 9);
    its bytes are an element of the experts' weights as prefetch moves them: the layer's dtype (fp32 twice
    bf16's, fp64 four times), and with `expert_weights: fp8` one e4m3 byte plus its share of a 128x128
    block's fp32 scale (just over half of bf16's)."""
    assert replica_cost_routes(2, link_bytes_per_s=1e12, gemm_flops_per_s=8.5e12) == 9
    assert replica_cost_routes(2, link_bytes_per_s=1e12, gemm_flops_per_s=8e12) == 8
    bf16 = load_config("deepseek-v3", ep_size=8, balance="cost_aware")
    rate_over_link = bf16.gemm_tflops * 1e12 / (2 * bf16.link_bandwidth_gbs * 1e9)  # 862 routes a byte
    for overrides, weight_bytes, cost in ((dict(), 2, 1724), (dict(dtype="float32"), 4, 3448),
                                          (dict(dtype="float64"), 8, 6896),
                                          (dict(expert_weights="fp8"), 1 + 4 / 128**2, 863)):
        cfg = load_config("deepseek-v3", ep_size=8, balance="cost_aware", **overrides)
        assert cfg.replica_cost == math.ceil(weight_bytes * rate_over_link) == cost, overrides


def test_communicator_and_pool_take_the_policy():
    cfg = load_config("tiny-cpu", ep_size=1, balance="cost_aware")
    comm = MoECommunicator(cfg.comm, world=single_world())
    assert comm._pool.get(1).replica_cost == cfg.replica_cost > 0
    comm.destroy()
    pool = BufferPool(4, 8, 2, 4, world=single_world(), replica_cost=NO_REPLICATION, dtype=torch.float64)
    assert pool.get(4).replica_cost == NO_REPLICATION
    pool.destroy()


@pytest.mark.parametrize("balance, cheap, replicates", [("off", False, False), ("cost_aware", False, False),
                                                        ("cost_aware", True, True)])
def test_layer_policies_match_dense(balance, cheap, replicates):
    """A skewed step (maxvio >= 10) through the layer on 4 thread-ranks matches the dense reference in
    float64, forward and backward, under every policy: 'off' and 'cost_aware' at the default rates (48
    tokens a rank: nothing pays) keep plain EP's loads; 'cost_aware' with transfers worth one route
    replicates."""
    rates = dict(gemm_tflops=1e-6) if cheap else {}
    p = make_problem(make_config(4, balance=balance, **rates), seed=14, skew=100.0)
    got, maxvio = assert_matches_dense(p)
    assert maxvio >= 10
    stats = got[0]
    assert (int(stats["slots_used"].sum()) > 0) == replicates
    if not replicates:
        assert torch.equal(stats["rank_load"], stats["ep_rank_load"])
    else:
        assert int(stats["rank_load"].max()) < int(stats["ep_rank_load"].max())


def test_layers_of_one_shape_plan_under_their_own_policy():
    """Layers of one shape on one world share a Buffer (`MoEConfig.share_buffer`) only where they plan
    alike: an 'off' layer built after an 'exact' one, and a 'cost_aware' one after both, each gets a Buffer
    of its own policy, and the same skewed step (maxvio >= 10) replicates under 'exact' only."""
    problems = {balance: make_problem(make_config(4, balance=balance), seed=14, skew=100.0)
                for balance in ("exact", "off", "cost_aware")}

    def fn(world):
        layers = {balance: build_layer(p, world) for balance, p in problems.items()}
        buffers = [layer.buffer for layer in layers.values()]
        assert len({id(buffer) for buffer in buffers}) == 3, "one Buffer per policy"
        stats = {}
        for balance, layer in layers.items():
            layer(problems[balance].hidden[world.rank])
            stats[balance] = {k: v.clone() for k, v in layer.balance_stats().items()}
            assert layer.buffer.replica_cost == problems[balance].cfg.replica_cost
        for layer in layers.values():
            layer.destroy()
        return stats

    for stats in run_ranks(fn, 4):
        assert int(stats["exact"]["slots_used"].sum()) > 0
        for balance in ("off", "cost_aware"):
            assert int(stats[balance]["slots_used"].sum()) == 0, balance
            assert torch.equal(stats[balance]["rank_load"], stats[balance]["ep_rank_load"]), balance


def test_buffer_rejects_a_bad_replica_cost():
    from moonep_moe.comm.buffer import Buffer

    with pytest.raises(ValueError, match="rank 0: replica_cost must be an int"):
        Buffer(4, 8, 2, 4, 1, world=single_world(), replica_cost=-1)
