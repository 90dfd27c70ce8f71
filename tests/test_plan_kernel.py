"""The Triton planner (`moonep_moe.plan.triton`) equals the torch planner and the host reference bit for
bit: every plan field, every rank, on random and adversarial routing; its internal tables give back the
reference's allocation and segment starts.

The random and adversarial cases run the kernels on `KERNEL_DEVICE`: compiled on CUDA where there is a GPU,
in Triton's interpreter on CPU tensors elsewhere (conftest sets TRITON_INTERPRET=1), so the cases are small;
the `gpu` test adds the DeepSeek-V3-sized case on CUDA with synchronisation forbidden.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_plan import Scenario, histograms, scenarios, topk_from_counts

from moonep_moe.base.sizes import default_slots, rows_capacity
from moonep_moe.plan.histogram import HISTOGRAM_ROUTES, expert_histogram_triton
from moonep_moe.plan.planner import expert_histogram, plan_one_rank, plan_routes
from moonep_moe.plan.reference import plan_global
from moonep_moe.plan.triton import plan_routes_triton, prepare
from moonep_moe.plan.types import MoonEPCommPlan

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_plans_equal(kernel: MoonEPCommPlan, torch_plan: MoonEPCommPlan) -> None:
    """Every field equal: tensors in value, dtype, shape and contiguity; scalars exactly."""
    for f in fields(MoonEPCommPlan):
        a, b = getattr(kernel, f.name), getattr(torch_plan, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), f.name
            assert torch.equal(a.cpu(), b.cpu()), f.name
        else:
            assert a == b, f.name


TUNINGS = {
    "default": {},
    # token blocks of 2-4 tokens: many blocks, so launch 2 sums earlier blocks' histograms in several chunks
    "many_blocks": dict(routes_per_block=16, plan_warps=1, destination_warps=1),
    # 16 tokens a block at K=8: launch 2 takes each block in two steps
    "two_steps": dict(routes_per_block=128, plan_warps=1, destination_warps=1, segment_ranks=2),
}
"""Launch shapes (`prepare`'s tuning arguments) every case runs with: the default and two that exercise the
loops the small cases would otherwise run once."""


def assert_kernel_plan(sc: Scenario, rank: int, topk_sk: torch.Tensor | None = None, **tuning) -> None:
    """The kernel's plan of `rank` (launch shape `tuning`) equals the torch planner's (itself checked
    against the reference by test_plan.py) and, for the global fields, the host reference `plan_global`."""
    topk_sk = sc.topk_rsk[rank] if topk_sk is None else topk_sk
    kwargs = dict(rank=rank, num_slots=sc.B, token_padding=sc.tp, rows_per_rank=sc.NvS)
    kernel = plan_routes_triton(sc.counts_re.to(KERNEL_DEVICE), topk_sk.to(KERNEL_DEVICE), **kwargs, **tuning)
    assert_plans_equal(kernel, plan_routes(sc.counts_re, topk_sk, **kwargs))
    ref = plan_global(sc.counts_re.tolist(), sc.B, sc.tp)
    assert kernel.experts_to_copy.tolist() == ref.experts_to_copy
    assert kernel.cu_seqlens.tolist() == ref.cu_seqlens[rank]
    assert kernel.zero_fill_ranges.tolist() == ref.zero_fill[rank]
    assert kernel.home_load.tolist() == ref.home_load


@pytest.mark.oldest_triton
@settings(max_examples=6, deadline=None)
@given(st.one_of(scenarios(), scenarios(slots="zero", min_ranks=2), scenarios(slots="one", min_epn=2,
                                                                               min_ranks=2)), st.data())
def test_kernel_plan_equals_torch_plan(sc, data):
    """Random routing of every strategy (uniform, zipf, hot expert, one rank, direct histograms, dropped
    tokens and routes), B = epn, B > epn, B = 0 and B = 1 < epn; the first, the last and one random rank;
    a random launch shape."""
    tuning = TUNINGS[data.draw(st.sampled_from(list(TUNINGS)))]
    for rank in sorted({0, sc.R - 1, data.draw(st.integers(0, sc.R - 1))}):
        assert_kernel_plan(sc, rank, **tuning)


def _case(R: int, epn: int, K: int, S: int, B: int | None, tp: int, topk_rsk: list[torch.Tensor]) -> Scenario:
    E = R * epn
    return Scenario(R, E, K, S, default_slots(E, R) if B is None else B, tp, [t.long() for t in topk_rsk])


def _adversarial_cases() -> dict[str, Scenario]:
    gen = torch.Generator().manual_seed(1)
    R, epn, K, S = 4, 4, 4, 32
    E = R * epn
    one_expert = torch.full((S, K), -1)
    one_expert[:, 0] = 5
    same_expert_twice = torch.full((S, K), 2)  # every k of a token on one expert: duplicates of one rank
    full_group = torch.arange(K).expand(S, K)  # all routes of all ranks on rank 0's home experts
    ties = (torch.arange(S * K) % E).view(S, K)  # every expert the same load, every rank the same
    dropped = torch.multinomial(torch.ones(S, E), K, generator=gen)
    dropped[torch.rand(S, K, generator=gen) < 0.4] = -1
    dropped[S // 2:] = -1  # padding tokens at the end
    skew = topk_from_counts(torch.tensor([S] * 2 + [1] * (E - 2)), S, K, gen)
    return {
        "one_expert": _case(R, epn, K, S, None, 8, [one_expert] * R),
        "same_expert_twice": _case(R, epn, K, S, None, 8, [same_expert_twice] + [dropped] * (R - 1)),
        "full_group_tp128": _case(8, 8, 8, 16, None, 128, [torch.arange(8).expand(16, 8)] * 8),
        "full_group_one_slot": _case(R, epn, K, S, 1, 8, [full_group] * R),
        "full_group_no_slots": _case(R, epn, K, S, 0, 8, [full_group] * R),
        "ties": _case(R, epn, K, S, None, 1, [ties] * R),
        "no_routes": _case(R, epn, K, S, None, 8, [torch.full((S, K), -1)] * R),
        "dropped_and_padding": _case(R, epn, K, S, None, 8, [dropped, skew, full_group, ties]),
        "one_rank": _case(1, 16, K, S, None, 8, [skew]),
        "two_ranks_epn_not_pow2": _case(2, 3, 2, S, None, 8, [dropped[:, :2] % 6, ties[:, :2] % 6]),
        "dsv3_like": _case(8, 48, 8, 64, None, 128, [topk_from_counts(
            torch.tensor([64] * 3 + [1] * 320 + [0] * 61), 64, 8, gen) for _ in range(8)]),
    }


ONCE = ("one_rank", "ties", "dsv3_like", "full_group_one_slot", "full_group_no_slots")
"""The adversarial cases CI reruns under the oldest Triton (`oldest_triton`): one rank, two ranks' plans with
no slot, one slot and several, equal loads, and DeepSeek-V3's sizes."""


@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.oldest_triton] if name in ONCE else [])
    for name in _adversarial_cases()])
def test_kernel_plan_adversarial(name, tuning):
    sc = _adversarial_cases()[name]
    for rank in sorted({0, sc.R - 1}):
        assert_kernel_plan(sc, rank, **TUNINGS[tuning])


@pytest.mark.oldest_triton
def test_kernel_plan_fewer_tokens_than_capacity():
    """s < S (a short batch): the kernel plans the s tokens it is given; the plan equals the torch plan."""
    sc = _adversarial_cases()["dropped_and_padding"]
    assert_kernel_plan(sc, 2, sc.topk_rsk[2][:5])


@pytest.mark.oldest_triton
@settings(max_examples=8, deadline=None)
@given(histograms(), st.data())
def test_kernel_tables_give_the_reference_allocation(case, data):
    """Direct histograms (ties everywhere, sparse, large counts, a saturated group, any B): the `[E, R]`
    tables handed to the route launch encode exactly the reference's allocation and segment starts, and the
    global fields equal the reference's. No routes of this rank: the histogram alone is planned."""
    counts_re, B, tp = case
    R, E = counts_re.shape
    assume(int(counts_re.sum()) < 2**31)
    rank = data.draw(st.integers(0, R - 1))
    NvS = rows_capacity(1, 1, R, E, B, tp)
    launch = prepare(counts_re.to(KERNEL_DEVICE), torch.full((1, 1), -1, device=KERNEL_DEVICE), rank=rank,
                     num_slots=B, token_padding=tp, rows_per_rank=NvS)
    launch.plan_group()
    ref = plan_global(counts_re.tolist(), B, tp)
    ends_er = launch.ends_er.cpu().long()
    alloc_re = (ends_er - torch.nn.functional.pad(ends_er, (1, 0))[:, :-1]).t()
    start_re = (ends_er.t() - alloc_re)
    row_base_re = launch.offset_er.cpu().long().t() - torch.arange(R)[:, None] * NvS + start_re
    assert alloc_re.tolist() == ref.alloc
    assert torch.where(alloc_re > 0, row_base_re, -1).tolist() == ref.row_base
    assert launch.plan.experts_to_copy.tolist() == ref.experts_to_copy
    assert launch.plan.cu_seqlens.tolist() == ref.cu_seqlens[rank]
    assert launch.plan.zero_fill_ranges.tolist() == ref.zero_fill[rank]
    assert launch.plan.rank_load.tolist() == alloc_re.sum(1).tolist()
    assert launch.plan.expert_load.tolist() == counts_re.sum(0).tolist()
    assert launch.plan.home_load.tolist() == ref.home_load
    assert launch.plan.slots_used.tolist() == [sum(e >= 0 for e in row) for row in ref.experts_to_copy]
    assert launch.before_e.tolist() == counts_re[:rank].sum(0).tolist()


@pytest.mark.oldest_triton
@pytest.mark.parametrize("num_tokens, E, B, tp", [(0, 16, 0, 8), (3, 12, 0, 1), (40, 16, 2, 8),
                                                    (HISTOGRAM_ROUTES // 4 + 5, 12, 0, 128)])
def test_one_rank_plan_counts_its_routes(num_tokens, E, B, tp):
    """One rank (`plan_one_rank`): the planner's first launch counts the routes itself (no histogram launch)
    and writes the histogram it counted; the plan equals the torch planner's given `expert_histogram`.
    Skewed routing with dropped routes; E not a power of two; B > 0 slots, which one rank leaves unused; the
    largest case counts in two loop steps; no tokens at all; one fused program (up to 16 tokens) and two
    launches."""
    K = 4
    gen = torch.Generator().manual_seed(num_tokens)
    skew_e = torch.exp(torch.randn(E, generator=gen, dtype=torch.float64) * 2)
    topk_sk = torch.multinomial(skew_e.expand(num_tokens, -1), K, generator=gen) if num_tokens else \
        torch.empty(0, K, dtype=torch.int64)
    topk_sk[torch.rand(num_tokens, K, generator=gen) < 0.2] = -1
    nvs = rows_capacity(max(num_tokens, 1), K, 1, E, B, tp)
    kwargs = dict(num_slots=B, token_padding=tp, rows_per_rank=nvs)
    counts_e = expert_histogram(topk_sk, E)
    expected = plan_routes(counts_e[None], topk_sk, rank=0, **kwargs)
    counts_re = torch.full((1, E), -7, dtype=torch.int64, device=KERNEL_DEVICE)
    # one token block (SUB = 16 tokens at K = 4) is planned by one program, more take two launches
    fused = prepare(counts_re, topk_sk.to(KERNEL_DEVICE), rank=0, count_routes=True, **kwargs).constants
    assert fused["FUSED"] == (num_tokens <= 16)
    kernel = plan_routes_triton(counts_re, topk_sk.to(KERNEL_DEVICE), rank=0, count_routes=True, **kwargs)
    assert torch.equal(counts_re.cpu()[0], counts_e)
    assert_plans_equal(kernel, expected)
    assert_plans_equal(plan_one_rank(topk_sk.to(KERNEL_DEVICE), E, **kwargs), expected)
    assert kernel.dup_groups.numel() == kernel.dup_loffs.numel() == 0  # one rank: no duplicates, no tables


def test_only_one_rank_counts_its_routes():
    counts_re = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="count_routes: only a one-rank group's plan counts its own routes"):
        prepare(counts_re, torch.zeros(1, 2, dtype=torch.int64), rank=0, num_slots=4, token_padding=8,
                rows_per_rank=64, count_routes=True)


def _dsv3_scenario(sigma: float) -> Scenario:
    """S=8192, K=8, E=384, R=8, B=48, tp=128 with expert popularity exp(N(0, sigma)) (bench/plan.py's)."""
    R, E, K, S = 8, 384, 8, 8192
    gen = torch.Generator().manual_seed(0)
    popularity_e = torch.exp(torch.randn(E, generator=gen, dtype=torch.float64) * sigma)
    topk_rsk = [torch.multinomial(popularity_e.expand(S, -1), K, generator=gen) for _ in range(R)]
    return Scenario(R, E, K, S, default_slots(E, R), 128, topk_rsk)


@pytest.mark.parametrize("R, E, policy", [(64, 256, "exact"), (64, 384, "cost_aware"),
                                          (128, 256, "cost_aware")])
def test_kernel_plan_large_groups(R, E, policy):
    """Groups of 64 and 128 ranks (DeepSeek-V3's and Kimi-K2's E), skewed: the global program's loops over
    the ranks run rolled, one rank a step (inlined, their copies did not compile for sm90 at R = 64); every
    field equal to the torch planner for the first, a middle and the last rank."""
    gen = torch.Generator().manual_seed(R + E)
    S, K = 16, 8
    popularity_e = torch.exp(torch.randn(E, generator=gen, dtype=torch.float64) * 2.0)
    topk_rsk = [torch.multinomial(popularity_e.expand(S, -1), K, generator=gen) for _ in range(R)]
    sc = Scenario(R, E, K, S, default_slots(E, R), 8, topk_rsk)
    cost = {"exact": 0, "cost_aware": 3}[policy]
    for rank in (0, R // 2 + 1, R - 1):
        kwargs = dict(rank=rank, num_slots=sc.B, token_padding=sc.tp, rows_per_rank=sc.NvS, replica_cost=cost)
        kernel = plan_routes_triton(sc.counts_re.to(KERNEL_DEVICE), sc.topk_rsk[rank].to(KERNEL_DEVICE),
                                    **kwargs)
        assert_plans_equal(kernel, plan_routes(sc.counts_re, sc.topk_rsk[rank], **kwargs))
    assert int(kernel.slots_used.sum()) > 0  # the skew made the plan replicate: the segments hold slots


@pytest.mark.gpu
@pytest.mark.parametrize("sigma", [0.0, 3.0])
def test_cuda_kernel_plan_dsv3_size_no_sync(sigma):
    """On CUDA, `plan_routes` runs the kernels: no synchronisation (sync debug mode "error"), every field
    equal to the torch planner on the CPU for two ranks, and the same plan from a replayed CUDA graph."""
    sc = _dsv3_scenario(sigma)
    counts_re = sc.counts_re.cuda()
    for rank in (0, 5):
        topk_sk = sc.topk_rsk[rank].cuda()
        kwargs = dict(rank=rank, num_slots=sc.B, token_padding=sc.tp, rows_per_rank=sc.NvS)
        plan_routes(counts_re, topk_sk, **kwargs)  # compile outside the checks
        torch.cuda.set_sync_debug_mode("error")
        try:
            kernel = plan_routes(counts_re, topk_sk, **kwargs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = plan_routes(counts_re, topk_sk, **kwargs)
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        expected = plan_routes(sc.counts_re, sc.topk_rsk[rank], **kwargs)
        assert_plans_equal(kernel, expected)
        assert_plans_equal(replayed, expected)


@pytest.mark.oldest_triton
@pytest.mark.parametrize("num_tokens", [0, 3, HISTOGRAM_ROUTES // 8 + 5])
def test_kernel_histogram_equals_torch(num_tokens):
    """`expert_histogram_triton` (one program, a loop over route chunks: the largest case takes two) equals
    the torch `expert_histogram` on the CPU: ids outside [0, E) count nowhere; a non-contiguous input."""
    E, K = 12, 8
    gen = torch.Generator().manual_seed(num_tokens)
    topk_sk2 = torch.randint(-2, E + 2, (num_tokens, 2 * K), generator=gen, dtype=torch.int32)
    topk_sk = topk_sk2[:, ::2]  # every other column: not contiguous
    counts_e = expert_histogram_triton(topk_sk.to(KERNEL_DEVICE), E)
    assert counts_e.dtype == torch.int64 and counts_e.shape == (E,)
    assert torch.equal(counts_e.cpu(), expert_histogram(topk_sk, E))
