"""Planner invariants (DESIGN.md, "The planner") as property tests over random and adversarial routing.

Every scenario plans all R ranks of a group from real `topk_experts_sk [S, K]` tensors (distinct experts per
token, -1 = no route) and their histogram `counts_re [R, E]`, then checks one invariant per test directly
from the plans: nothing here is an expected output copied from the planner. The device planner (what
`plan_routes` runs) is compared bit for bit with the host reference `plan_global`, and run on fake tensors
to show it makes no data-dependent host read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from moonep_moe.base.sizes import default_slots, rows_capacity
from moonep_moe.plan.device import plan_global_device
from moonep_moe.plan.planner import plan_routes
from moonep_moe.plan.reference import plan_global
from moonep_moe.plan.types import NO_ROUTE, MoonEPCommPlan, decode_dst

RANKS = [1, 2, 3, 4, 8, 16]
KINDS = ["uniform", "zipf", "hot_expert", "one_rank", "random", "adversarial", "direct"]
SETTINGS = settings(max_examples=25, deadline=None)


@dataclass
class Scenario:
    """One EP group's routing and the plans of all its ranks."""

    R: int
    E: int
    K: int
    S: int
    B: int
    tp: int
    topk_rsk: list[torch.Tensor]

    @property
    def epn(self) -> int:
        return self.E // self.R

    @property
    def NvS(self) -> int:
        return rows_capacity(self.S, self.K, self.R, self.E, self.B, self.tp)

    @cached_property
    def counts_re(self) -> torch.Tensor:
        return torch.stack([torch.bincount(t[t >= 0].long(), minlength=self.E) for t in self.topk_rsk])

    @property
    def total_routes(self) -> int:
        return int(self.counts_re.sum())

    def plan(self, rank: int, topk_sk: torch.Tensor | None = None) -> MoonEPCommPlan:
        topk_sk = self.topk_rsk[rank] if topk_sk is None else topk_sk
        return plan_routes(self.counts_re, topk_sk, rank=rank, num_slots=self.B, token_padding=self.tp,
                           rows_per_rank=self.NvS)

    @cached_property
    def plans(self) -> list[MoonEPCommPlan]:
        return [self.plan(r) for r in range(self.R)]

    @cached_property
    def routes(self) -> dict[str, torch.Tensor]:
        """Every route of the group, `[R*S*K]` each, in (source rank, token, k) order."""
        dst = torch.cat([p.dst for p in self.plans])
        dest, row, primary, valid = decode_dst(dst, self.NvS)
        n = torch.arange(self.S * self.K).repeat(self.R)
        return dict(dst=dst, dest=dest, row=row, primary=primary, valid=valid,
                    expert=torch.cat([t.reshape(-1).long() for t in self.topk_rsk]),
                    src=torch.arange(self.R).repeat_interleave(self.S * self.K),
                    token=n // self.K, k=n % self.K)

    def group_of(self, d: int, e: int) -> int:
        """Physical group of expert e on rank d: its home row or the slot holding it; -1 if neither."""
        if e // self.epn == d:
            return e
        slots = self.plans[d].experts_to_copy[d].tolist()
        return self.E + slots.index(e) if e in slots else -1

    @cached_property
    def expert_segments_re(self) -> torch.Tensor:
        """`[R, E, 2]` (start, end of the routes) of each expert's segment on each rank; -1 if none."""
        table = torch.full((self.R, self.E, 2), -1, dtype=torch.long)
        for d in range(self.R):
            for e in range(self.E):
                g = self.group_of(d, e)
                if g >= 0:
                    table[d, e] = torch.tensor(self.segment(d, g)[:2])
        return table

    def segment(self, d: int, g: int) -> tuple[int, int, int]:
        """(start, end of the routes, padded end) of group g on rank d."""
        cu = self.plans[d].cu_seqlens.tolist()
        first_pad, pads = self.plans[d].zero_fill_ranges[g].tolist()
        return (cu[g - 1] if g else 0), first_pad, first_pad + pads


def _probs(kind: str, E: int, epn: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.ones(E, dtype=torch.float64)
    if kind in ("zipf", "adversarial"):
        ranks = torch.randperm(E, generator=gen).double()
        return (ranks + 1) ** -skew
    if kind == "hot_expert":
        p = torch.ones(E, dtype=torch.float64)
        p[torch.randint(E, (1,), generator=gen)] = 1e9
        return p
    if kind == "one_rank":
        g = int(torch.randint(E // epn, (1,), generator=gen))
        p = torch.full((E,), 1e-12, dtype=torch.float64)
        p[g * epn:(g + 1) * epn] = 1.0
        return p
    return torch.rand(E, generator=gen, dtype=torch.float64) + 1e-9  # random


def topk_from_counts(counts_e: torch.Tensor, S: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """A `[S, K]` routing with exactly this histogram (each count <= S, total <= S*K): route i of the
    expert-sorted list goes to token i % S, column i // S, so one expert's routes land on distinct tokens."""
    experts = torch.repeat_interleave(torch.arange(len(counts_e)), counts_e)
    i = torch.arange(len(experts))
    topk_sk = torch.full((S, K), -1, dtype=torch.int64)
    topk_sk[i % S, i // S] = experts
    topk_sk = topk_sk[torch.randperm(S, generator=gen)]
    return torch.gather(topk_sk, 1, torch.rand(S, K, generator=gen).argsort(1))


def direct_counts(E: int, epn: int, S: int, K: int, density: float, hot: str,
                  gen: torch.Generator) -> torch.Tensor:
    """An adversarial `[E]` histogram built directly: sparse or dense, a saturated expert or home group."""
    counts = torch.randint(0, S + 1, (E,), generator=gen) * (torch.rand(E, generator=gen) < density)
    if hot == "expert":
        counts[torch.randint(E, (1,), generator=gen)] = S
    elif hot == "group":
        g = int(torch.randint(E // epn, (1,), generator=gen))
        counts[g * epn:(g + 1) * epn] = S
    total = int(counts.sum())
    if total > S * K:
        counts = counts * (S * K) // total
    return counts


@st.composite
def scenarios(draw, slots: str = "balanced", min_epn: int = 1, min_ranks: int = 1) -> Scenario:
    R = draw(st.sampled_from([r for r in RANKS if r >= min_ranks]))
    max_epn = 512 // R
    epn = draw(st.one_of(st.integers(min_epn, 8), st.integers(min_epn, max_epn)))
    E = R * epn
    K = draw(st.integers(1, min(8, E)))
    S = draw(st.integers(1, 64))
    tp = draw(st.sampled_from([1, 8, 128]))
    if slots == "balanced":
        B = default_slots(E, R)
        if R > 1 and draw(st.booleans()):
            B = draw(st.integers(epn, E - epn))
    else:
        B = {"zero": 0, "one": 1}[slots]
    kind = draw(st.sampled_from(KINDS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    skew = draw(st.floats(0.0, 3.0))
    token_drop = draw(st.sampled_from([0.0, 0.0, 0.2, 0.8, 1.0]))
    route_drop = draw(st.sampled_from([0.0, 0.0, 0.3]))
    density = draw(st.sampled_from([0.05, 0.5, 1.0]))
    hot = draw(st.sampled_from(["none", "expert", "group"]))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    topk_rsk = []
    for _ in range(R):
        if kind == "direct":
            topk_sk = topk_from_counts(direct_counts(E, epn, S, K, density, hot, gen), S, K, gen)
        else:
            rank_skew = float(torch.rand(1, generator=gen)) * 4 if kind == "adversarial" else skew
            p = _probs(kind, E, epn, rank_skew, gen)
            topk_sk = torch.multinomial(p.expand(S, E), K, replacement=False, generator=gen)
            topk_sk[torch.rand(S, generator=gen) < token_drop] = -1
            topk_sk[torch.rand(S, K, generator=gen) < route_drop] = -1
            if kind == "adversarial":  # each rank fills a different number of its tokens
                topk_sk[int(torch.randint(S + 1, (1,), generator=gen)):] = -1
        topk_rsk.append(topk_sk.to(dtype))
    return Scenario(R, E, K, S, B, tp, topk_rsk)


# -- invariant checks (shared by the balanced and the B < epn tests) ---------------------------------------


def assert_loads_match_routes(sc: Scenario) -> None:
    """`rank_load` is what the dst of all ranks put on each rank, and only valid routes count."""
    rt = sc.routes
    received_r = torch.bincount(rt["dest"][rt["valid"]], minlength=sc.R)
    for plan in sc.plans:
        assert plan.rank_load.tolist() == received_r.tolist()
        assert int(plan.rank_load.sum()) == sc.total_routes


def assert_replicas(sc: Scenario, one_donor: bool = True) -> None:
    """Each rank's slots: its remote replicas, ascending and unique, at most B; with `one_donor` (exact
    balance: a receiver is filled by one donor) from at most one remote home group, so at most epn."""
    for plan in sc.plans:
        assert plan.experts_to_copy.shape == (sc.R, sc.B)
        for d, slots in enumerate(plan.experts_to_copy.tolist()):
            used = [e for e in slots if e >= 0]
            assert slots == used + [-1] * (sc.B - len(used)), "-1 only pads the end"
            assert used == sorted(set(used)), "ascending and unique"
            assert all(0 <= e < sc.E and e // sc.epn != d for e in used), "replicas are remote experts"
            assert len(used) <= sc.B
            if one_donor:
                assert len({e // sc.epn for e in used}) <= 1, "at most one remote home group"
                assert len(used) <= sc.epn
            assert int(plan.slots_used[d]) == len(used)


def assert_segments(sc: Scenario) -> None:
    rt = sc.routes
    for d, plan in enumerate(sc.plans):
        cu = plan.cu_seqlens.tolist()
        assert len(cu) == sc.E + sc.B and plan.zero_fill_ranges.shape == (sc.E + sc.B, 2)
        assert cu[-1] <= sc.NvS
        slots = plan.experts_to_copy[d].tolist()
        here = rt["valid"] & (rt["dest"] == d)
        for g in range(sc.E + sc.B):
            start, routes_end, end = sc.segment(d, g)
            assert start <= routes_end <= end == cu[g]
            assert (end - start) % sc.tp == 0 and end - routes_end < sc.tp
            expert = g if g < sc.E else slots[g - sc.E]
            hosted = g // sc.epn == d if g < sc.E else expert >= 0  # a home group or a used slot
            received = int((here & (rt["expert"] == expert)).sum()) if hosted else 0
            assert routes_end - start == received, f"group {g} on rank {d}: rows of routes"
            if g >= sc.E and expert >= 0:  # a used slot has rows: wgrad writes its gradient, which
                assert received > 0, f"slot {g - sc.E} on rank {d} holds expert {expert} without routes"
                # reduce_grad reads; an unused slot's is neither written nor read
            if not hosted:
                assert end == start, f"group {g} on rank {d} must be empty"
            if received == 0:
                assert end == start, "an empty segment carries no padding"


def assert_rows(sc: Scenario) -> None:
    """Every valid dst is a row of its expert's segment on its rank; no two routes share a (rank, row)."""
    rt = sc.routes
    valid = rt["valid"]
    dest, row, expert = rt["dest"][valid], rt["row"][valid], rt["expert"][valid]
    assert bool(((dest >= 0) & (dest < sc.R) & (row >= 0) & (row < sc.NvS)).all())
    start, routes_end = sc.expert_segments_re[dest, expert].unbind(-1)
    assert bool((start >= 0).all()), "every route's expert is home or in a slot on its rank"
    assert bool(((start <= row) & (row < routes_end)).all())
    cells = rt["dest"][valid] * sc.NvS + rt["row"][valid]
    assert len(torch.unique(cells)) == len(cells)


def assert_duplicates(sc: Scenario) -> None:
    rt = sc.routes
    dest_rsk = torch.where(rt["valid"], rt["dest"], -1).view(sc.R, sc.S, sc.K)
    for k in range(sc.K):
        earlier = (dest_rsk[:, :, :k] == dest_rsk[:, :, k:k + 1]).any(-1) & (dest_rsk[:, :, k] >= 0)
        earlier &= sc.R > 1  # one rank: no link to save, every route is primary
        dst_k = rt["dst"].view(sc.R, sc.S, sc.K)[:, :, k]
        assert torch.equal((dst_k < 0) & (dst_k != NO_ROUTE), earlier)


# -- the invariants, one test each -------------------------------------------------------------------------


@SETTINGS
@given(scenarios())
def test_balance_is_exact(sc):
    T, R = sc.total_routes, sc.R
    assert_loads_match_routes(sc)
    for plan in sc.plans:
        assert all(T // R <= load <= T // R + 1 for load in plan.rank_load.tolist())
        if bool((torch.stack(sc.topk_rsk) >= 0).all()):
            assert plan.rank_load.tolist() == [sc.S * sc.K] * R


@SETTINGS
@given(scenarios())
def test_replicas_come_from_one_remote_group(sc):
    assert_replicas(sc)


@SETTINGS
@given(scenarios())
def test_segments_padded_to_token_padding(sc):
    assert_segments(sc)


@SETTINGS
@given(scenarios())
def test_every_route_lands_in_its_experts_segment_once(sc):
    assert_rows(sc)


@SETTINGS
@given(scenarios())
def test_later_routes_to_the_same_rank_are_duplicates(sc):
    assert_duplicates(sc)


@pytest.mark.parametrize("ranks", [1, 2])
def test_duplicates_only_where_a_link_is_saved(ranks):
    # every token's K routes land on one rank: with two ranks all but the first are duplicates, with one
    # rank (no link) every valid route is primary, so its row is written and read directly
    topk_sk = torch.tensor([[0, 1, 2], [3, 0, -1], [1, 2, 3]])
    sc = Scenario(ranks, 4 * ranks, 3, 3, 0, 8, [topk_sk] * ranks)  # no slots: every route stays home
    rt = sc.routes
    duplicates = int((rt["valid"] & ~rt["primary"]).view(ranks, -1)[0].sum())
    assert duplicates == (0 if ranks == 1 else 8 - 3)


@SETTINGS
@given(scenarios())
def test_invalid_routes_are_not_routed_nor_counted(sc):
    rt = sc.routes
    assert torch.equal(rt["dst"] == NO_ROUTE, rt["expert"] < 0)
    assert_loads_match_routes(sc)
    N = sc.S * sc.K
    for r, plan in enumerate(sc.plans):
        mine = slice(r * N, (r + 1) * N)
        remote = rt["valid"][mine] & (rt["dest"][mine] != r)
        assert plan.remote_stats.tolist() == [int(remote.sum()), int((remote & rt["primary"][mine]).sum())]


@SETTINGS
@given(scenarios())
def test_global_fields_identical_and_deterministic(sc):
    glob = plan_global(sc.counts_re.tolist(), sc.B, sc.tp)
    assert glob == plan_global(sc.counts_re.tolist(), sc.B, sc.tp)
    home_load = sc.counts_re.sum(0).view(sc.R, sc.epn).sum(1)
    first = sc.plans[0]
    for r, plan in enumerate(sc.plans):
        for name in ("experts_to_copy", "rank_load", "home_load", "slots_used"):
            assert torch.equal(getattr(plan, name), getattr(first, name)), name
        assert plan.home_load.tolist() == home_load.tolist()
        assert plan.experts_to_copy.tolist() == glob.experts_to_copy
        assert plan.cu_seqlens.tolist() == glob.cu_seqlens[r]
        assert plan.zero_fill_ranges.tolist() == glob.zero_fill[r]
        again = sc.plan(r)
        for f in fields(plan):
            a, b = getattr(plan, f.name), getattr(again, f.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == torch.int32 and a.is_contiguous(), f.name
                assert torch.equal(a, b), f.name
            else:
                assert a == b, f.name
        scalars = (sc.S * sc.K, sc.R, sc.E, sc.B, sc.NvS, sc.K)
        assert (plan.N, plan.R, plan.E, plan.B, plan.NvS, plan.K) == scalars


@SETTINGS
@given(scenarios(), st.integers(1, 40), st.data())
def test_padding_tokens_change_nothing(sc, extra, data):
    r = data.draw(st.integers(0, sc.R - 1))
    topk = sc.topk_rsk[r]
    padded = torch.cat([topk, torch.full((extra, sc.K), -1, dtype=topk.dtype)])
    plan, padded_plan = sc.plans[r], sc.plan(r, padded)
    N = sc.S * sc.K
    assert torch.equal(padded_plan.dst[:N], plan.dst)
    assert bool((padded_plan.dst[N:] == NO_ROUTE).all())
    for name in ("experts_to_copy", "cu_seqlens", "zero_fill_ranges", "rank_load", "home_load", "slots_used",
                 "remote_stats"):
        assert torch.equal(getattr(padded_plan, name), getattr(plan, name)), name


@SETTINGS
@given(scenarios())
def test_order_contiguous_ranges_in_rank_order(sc):
    """An expert's routes in (source rank, token, k) order go to its computing ranks in contiguous ranges,
    in rank order, and fill each segment in that order from its start."""
    rt = sc.routes
    valid = rt["valid"]
    expert, dest, row = rt["expert"][valid], rt["dest"][valid], rt["row"][valid]
    order = torch.sort(expert, stable=True).indices  # routes are already in (source rank, token, k) order
    expert, dest, row = expert[order], dest[order], row[order]
    same_expert = expert[1:] == expert[:-1]
    assert bool((dest[1:][same_expert] >= dest[:-1][same_expert]).all()), "ranks in rank order"
    starts = sc.expert_segments_re[dest, expert, 0]
    assert bool((starts >= 0).all())
    cell = expert * sc.R + dest
    first_of_cell = torch.ones_like(cell, dtype=torch.bool)
    first_of_cell[1:] = cell[1:] != cell[:-1]
    group_start = torch.cummax(torch.where(first_of_cell, torch.arange(len(cell)), 0), 0).values
    assert torch.equal(row - starts, torch.arange(len(cell)) - group_start), "rows follow the order"


@settings(max_examples=40, deadline=None)
@given(scenarios(slots="zero", min_ranks=2))
def test_plain_ep_without_slots(sc):
    """B = 0: every route is computed on its expert's home rank."""
    rt = sc.routes
    valid = rt["valid"]
    assert torch.equal(rt["dest"][valid], rt["expert"][valid] // sc.epn)
    for plan in sc.plans:
        assert torch.equal(plan.rank_load, plan.home_load)
        assert plan.experts_to_copy.shape == (sc.R, 0) and plan.slots_used.tolist() == [0] * sc.R
    assert_loads_match_routes(sc)
    assert_segments(sc)
    assert_rows(sc)
    assert_duplicates(sc)


@settings(max_examples=40, deadline=None)
@given(scenarios(slots="one", min_epn=2, min_ranks=2))
def test_one_slot_best_effort(sc):
    """B = 1 < epn: balance is best effort, but slots, rows and capacity still hold."""
    for plan in sc.plans:
        assert int(plan.slots_used.max()) <= 1
        assert int(plan.cu_seqlens[-1]) <= sc.NvS
    assert_loads_match_routes(sc)
    assert_replicas(sc)
    assert_segments(sc)
    assert_rows(sc)
    assert_duplicates(sc)


def test_all_routes_of_a_full_group_to_one_rank():
    """The worst case for capacity: every token of every rank routes all K routes to rank 0's experts."""
    R, epn, K, S, tp = 8, 8, 8, 64, 128
    topk = torch.arange(K, dtype=torch.int32).expand(S, K).contiguous()
    sc = Scenario(R, R * epn, K, S, epn, tp, [topk] * R)
    assert sc.plans[0].home_load.tolist() == [R * S * K] + [0] * (R - 1)
    assert sc.plans[0].rank_load.tolist() == [S * K] * R
    assert_replicas(sc)
    assert_segments(sc)
    assert_rows(sc)


def test_clone_is_deep():
    sc = Scenario(2, 8, 2, 4, 4, 8, [torch.tensor([[0, 1], [2, 3], [0, -1], [1, 0]])] * 2)
    plan = sc.plans[0]
    copy = plan.clone()
    before = {f.name: getattr(plan, f.name).clone() for f in fields(plan) if isinstance(getattr(plan, f.name),
                                                                                         torch.Tensor)}
    for name in before:
        tensor = getattr(copy, name)
        assert torch.equal(tensor, before[name]) and tensor.data_ptr() != getattr(plan, name).data_ptr()
        tensor.fill_(7)
    for name, value in before.items():
        assert torch.equal(getattr(plan, name), value), name
    assert (copy.rank, copy.owner, copy.NvS) == (plan.rank, plan.owner, plan.NvS)


# -- the device planner: equal to the host reference, and no host read -----------------------------------


def assert_device_equals_reference(counts_re: torch.Tensor, B: int, tp: int) -> None:
    """Every field of `plan_global_device` equals the host reference `plan_global`, for int32 and int64."""
    ref = plan_global(counts_re.tolist(), B, tp)
    R, E = counts_re.shape
    shapes = dict(alloc_re=(R, E), experts_to_copy_rb=(R, B), row_base_re=(R, E), cu_seqlens_rg=(R, E + B),
                  zero_fill_rg2=(R, E + B, 2), home_load_r=(R,))
    for dtype in (torch.int64, torch.int32):
        dev = plan_global_device(counts_re.to(dtype), B, tp)
        for f in fields(dev):
            tensor = getattr(dev, f.name)
            assert tensor.dtype == torch.int64 and tuple(tensor.shape) == shapes[f.name], f.name
        assert dev.alloc_re.tolist() == ref.alloc
        assert dev.experts_to_copy_rb.tolist() == ref.experts_to_copy
        assert dev.row_base_re.tolist() == ref.row_base
        assert dev.cu_seqlens_rg.tolist() == ref.cu_seqlens
        assert dev.zero_fill_rg2.tolist() == ref.zero_fill
        assert dev.home_load_r.tolist() == ref.home_load


@settings(max_examples=60, deadline=None)
@given(st.one_of(scenarios(), scenarios(slots="zero"), scenarios(slots="one", min_epn=2, min_ranks=2)))
def test_device_global_plan_equals_reference(sc):
    """On every routing strategy, with B >= epn, B = 0 and B = 1 < epn."""
    assert_device_equals_reference(sc.counts_re, sc.B, sc.tp)


@st.composite
def histograms(draw) -> tuple[torch.Tensor, int, int]:
    """`(counts_re [R, E], B, tp)` drawn directly, any B in [0, E - epn]: few distinct values (ties
    everywhere), sparse, huge counts, one saturated home group."""
    R = draw(st.sampled_from(RANKS))
    epn = draw(st.one_of(st.integers(1, 8), st.integers(1, 512 // R)))
    E = R * epn
    B = draw(st.integers(0, E - epn))
    tp = draw(st.sampled_from([1, 8, 128]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    high = draw(st.sampled_from([1, 2, 3, 100, 10**6]))
    counts_re = torch.randint(0, high + 1, (R, E), generator=gen)
    counts_re *= torch.rand(R, E, generator=gen) < draw(st.sampled_from([0.05, 0.5, 1.0]))
    if draw(st.booleans()):
        g = int(torch.randint(R, (1,), generator=gen))
        counts_re[:, g * epn:(g + 1) * epn] += high
    return counts_re, B, tp


@settings(max_examples=150, deadline=None)
@given(histograms())
def test_device_global_plan_equals_reference_on_direct_histograms(case):
    assert_device_equals_reference(*case)


def test_device_global_plan_equals_reference_on_ties():
    """Every tie the reference breaks by lowest index: equal loads on all ranks but one, equal experts."""
    for R, epn, B in [(4, 4, 4), (8, 3, 1), (3, 5, 2), (16, 2, 30), (2, 1, 1)]:
        for low, high in [(0, 1), (1, 1), (2, 5)]:
            counts_re = torch.full((R, R * epn), low)
            counts_re[:, :epn] = high
            for tp in (1, 8):
                assert_device_equals_reference(counts_re, B, tp)
                assert_device_equals_reference(counts_re.flip(1).contiguous(), B, tp)


FAKE_CASE = dict(R=4, epn=8, K=4, S=32, B=8, tp=8)
HOST_READ = (DataDependentOutputException, DynamicOutputShapeException)


def _fake_inputs(mode: FakeTensorMode, device: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Fake `counts_re [R, E]` and `topk_experts_sk [S, K]` (no data: any read of a value raises) on
    `device`, and `plan_routes`'s keyword arguments."""
    c = FAKE_CASE
    E = c["R"] * c["epn"]
    gen = torch.Generator().manual_seed(0)
    topk_sk = torch.multinomial(torch.ones(c["S"], E), c["K"], generator=gen)
    counts_re = torch.randint(0, c["S"], (c["R"], E), generator=gen)
    kwargs = dict(rank=1, num_slots=c["B"], token_padding=c["tp"],
                  rows_per_rank=rows_capacity(c["S"], c["K"], c["R"], E, c["B"], c["tp"]))
    return mode.from_tensor(counts_re.to(device)), mode.from_tensor(topk_sk.to(device)), kwargs


def test_device_plan_makes_no_host_read():
    """`plan_routes` on fake tensors: `.item()`, `.tolist()`, `int()`/`bool()` of a tensor and every op whose
    output shape depends on values raise under FakeTensorMode. The fakes live on `meta`, a device that is
    not the CPU, so the path is the one a GPU takes (fake CUDA tensors need a CUDA build of torch)."""
    mode = FakeTensorMode()
    counts_re, topk_sk, kwargs = _fake_inputs(mode, "meta")
    with mode:
        plan = plan_routes(counts_re, topk_sk, **kwargs)
    c = FAKE_CASE
    E = c["R"] * c["epn"]
    assert plan.dst.shape == (c["S"] * c["K"],) and plan.experts_to_copy.shape == (c["R"], c["B"])
    assert plan.cu_seqlens.shape == (E + c["B"],) and plan.zero_fill_ranges.shape == (E + c["B"], 2)
    assert all(getattr(plan, f.name).device.type == "meta" for f in fields(plan)
               if isinstance(getattr(plan, f.name), torch.Tensor))


@pytest.mark.parametrize("host_path", ["reference", "cpu_capacity_check", "bincount"])
def test_no_host_read_check_can_fail(host_path):
    """The fake-tensor check above does catch host reads: the reference planner (`tolist`), the CPU-only
    capacity check (`int`) and `bincount` (its output size depends on the largest value) all raise."""
    mode = FakeTensorMode()
    counts_re, topk_sk, kwargs = _fake_inputs(mode, "meta" if host_path != "cpu_capacity_check" else "cpu")
    with mode, pytest.raises(HOST_READ):
        if host_path == "reference":
            plan_global(counts_re.tolist(), kwargs["num_slots"], kwargs["token_padding"])
        elif host_path == "cpu_capacity_check":
            plan_routes(counts_re, topk_sk, **kwargs)
        else:
            torch.bincount(topk_sk.reshape(-1), minlength=counts_re.shape[1])


@pytest.mark.gpu
def test_cuda_plan_no_sync_graph_capturable_and_equal_to_cpu():
    """On CUDA: no synchronisation (sync debug mode "error"), capturable in a CUDA graph, and the replayed
    graph gives the CPU plan for new inputs copied into the captured ones."""
    gen = torch.Generator().manual_seed(0)
    sc_a, sc_b = (Scenario(4, 32, 4, 64, 8, 8, [torch.multinomial(p.expand(64, 32), 4, generator=gen)
                                               for _ in range(4)])
                  for p in (torch.ones(32), torch.arange(1, 33.0) ** 2))
    kwargs = dict(rank=1, num_slots=sc_a.B, token_padding=sc_a.tp, rows_per_rank=sc_a.NvS)
    counts_re, topk_sk = sc_a.counts_re.cuda(), sc_a.topk_rsk[1].cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan_routes(counts_re, topk_sk, **kwargs)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan = plan_routes(counts_re, topk_sk, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for sc in (sc_a, sc_b):
        counts_re.copy_(sc.counts_re)
        topk_sk.copy_(sc.topk_rsk[1])
        graph.replay()
        expected = sc.plan(1)
        for f in fields(plan):
            if isinstance(getattr(plan, f.name), torch.Tensor):
                assert torch.equal(getattr(plan, f.name).cpu(), getattr(expected, f.name)), f.name
