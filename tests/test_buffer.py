"""The Buffer on the threads world in float64: dispatch, combine, prefetch_weight, reduce_grad, bad input.

Rows hold small integers and route weights multiples of 1/8, so every sum below is exact and is compared
with `torch.equal` against a hand computation from the inputs (never against a recorded output).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.event import CommEvent
from moonep_moe.plan.types import decode_dst
from moonep_moe.transport.registry import world_of_group
from moonep_moe.transport.threads import ThreadGroup, run_ranks, single_world
from moonep_moe.transport.world import RankFailedError
from moonep_moe.weights.pool import ExpertRows, slot_grad_pool, slot_pool

F64 = torch.float64


@dataclass(frozen=True)
class Case:
    """One EP group: R ranks, capacity S, H hidden, K top-k, E experts, tp padding, `tokens[r]` tokens on
    rank r, routing `kind` ("uniform" or "skewed": every route to rank 0's experts), a share of -1 routes."""

    R: int = 2
    S: int = 16
    H: int = 8
    K: int = 3
    E: int = 8
    tp: int = 4
    kind: str = "uniform"
    invalid: float = 0.2
    seed: int = 0
    tokens: tuple[int, ...] | None = None

    @property
    def epn(self) -> int:
        return self.E // self.R

    def num_tokens(self, rank: int) -> int:
        return self.S if self.tokens is None else self.tokens[rank]

    def buffer(self, world, **kwargs) -> Buffer:
        return Buffer(self.S, self.H, self.K, self.E, self.R, token_padding=self.tp, world=world, dtype=F64,
                      **kwargs)

    def inputs(self, rank: int, dtype: torch.dtype = torch.int32) -> dict[str, torch.Tensor]:
        """hidden `[s, H]`, weights `[s, K]`, topk `[s, K]` (distinct experts per token), histogram `[E]`."""
        s = self.num_tokens(rank)
        gen = torch.Generator().manual_seed(1000 * self.seed + rank)
        p_e = torch.ones(self.E, dtype=F64)
        if self.kind == "skewed":
            p_e[self.epn:] = 0
        topk = torch.empty(0, self.K, dtype=torch.long)
        if s:
            topk = torch.multinomial(p_e.expand(s, self.E), self.K, generator=gen)
        topk[torch.rand(s, self.K, generator=gen) < self.invalid] = -1
        topk[torch.rand(s, generator=gen) < self.invalid / 2] = -1  # whole padding tokens
        return dict(hidden=torch.randint(-8, 9, (s, self.H), generator=gen).to(F64),
                    weights=torch.randint(1, 17, (s, self.K), generator=gen).to(F64) / 8,
                    topk=topk.to(dtype),
                    tpe=torch.bincount(topk[topk >= 0], minlength=self.E).to(dtype))


def dispatch(buf: Buffer, x: dict[str, torch.Tensor], **kwargs):
    return buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"], **kwargs)


def valid_sk(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return (x["topk"] >= 0).to(F64)


def assert_layout(case: Case, results: list[dict], rows_key: str, source_key: str, weights: bool) -> None:
    """Pull with the plan: each valid route's row on its destination holds its token's source row (duplicates
    expanded) and its weight; padding rows are zero."""
    for res in results:
        plan = res["plan"]
        dest_n, row_n, _, valid_n = decode_dst(plan.dst, plan.NvS)
        for n in torch.nonzero(valid_n).squeeze(1).tolist():
            t, k = divmod(n, case.K)
            there = results[int(dest_n[n])]
            assert torch.equal(there[rows_key][row_n[n]], res["x"][source_key][t]), (res["rank"], t, k)
            if weights:
                assert there["weights_nvs"][row_n[n]] == res["x"]["weights"][t, k]
    for res in results:
        for first, count in res["plan"].zero_fill_ranges.tolist():
            assert not res[rows_key][first:first + count].any()
            if weights:
                assert not res["weights_nvs"][first:first + count].any()


def roundtrip(case: Case, topk_dtype: torch.dtype = torch.int32) -> list[dict]:
    """Every rank: dispatch, then identity and row-scaling "experts" combined, route weights brought back,
    and the backward dispatch of a gradient through the same plan."""

    def fn(world):
        buf = case.buffer(world)
        x = case.inputs(world.rank, topk_dtype)
        rows, weights_nvs, cu_seqlens, plan = dispatch(buf, x)
        out = dict(rank=world.rank, x=x, plan=plan.clone(), rows=rows, weights_nvs=weights_nvs, cu=cu_seqlens)
        out["scaled"], _, _ = buf.combine(plan, rows * weights_nvs[:, None])
        tags = world.rank * 10_000 + torch.arange(buf.NvS, dtype=F64)  # also left in the padding weights
        _, out["tags_sk"], _ = buf.combine(plan, rows, tags)
        garbage = rows.clone()  # left in the buffer where no route reads: padding and the unused tail
        for first, count in plan.zero_fill_ranges.tolist():
            garbage[first:first + count] = 99.0
        garbage[int(cu_seqlens[-1]):] = 99.0
        out["identity"], none, _ = buf.combine(plan, garbage)
        assert none is None
        x["grad"] = torch.randint(-8, 9, x["hidden"].shape, dtype=torch.int64).to(F64)
        out["grad_rows"], out["grad_w"], out["grad_cu"], same = buf.dispatch(x["grad"], None, None, None,
                                                                          plan=plan)
        assert same is plan
        out["again"] = dispatch(buf, x)  # over the garbage left by the combines: padding is zero again
        return out

    return run_ranks(fn, case.R)


def assert_roundtrip(case: Case, results: list[dict]) -> None:
    loads = results[0]["plan"].rank_load.tolist()
    total = sum(int((r["x"]["topk"] >= 0).sum()) for r in results)
    assert sum(loads) == total and max(loads) - min(loads) <= 1, "balanced with B = E/R"
    for res in results:
        x, valid = res["x"], valid_sk(res["x"])
        assert torch.equal(res["identity"], valid.sum(1, keepdim=True) * x["hidden"])
        assert torch.equal(res["scaled"], (x["weights"] * valid).sum(1, keepdim=True) * x["hidden"])
        dest_n, row_n, _, valid_n = decode_dst(res["plan"].dst, res["plan"].NvS)
        tags_n = torch.where(valid_n, dest_n * 10_000 + row_n, 0).to(F64)
        assert torch.equal(res["tags_sk"], tags_n.view(-1, case.K))
        assert res["grad_w"] is None and res["grad_cu"] is None
        B = case.epn if case.R > 1 else 0
        assert res["cu"].dtype == torch.int32 and res["cu"].shape == (case.E + B,)
    assert_layout(case, results, "rows", "hidden", weights=True)
    assert_layout(case, results, "grad_rows", "grad", weights=False)
    again = [dict(res, rows=res["again"][0], weights_nvs=res["again"][1]) for res in results]
    assert_layout(case, again, "rows", "hidden", weights=True)


# -- dispatch / combine ------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_roundtrip_exact(R, kind):
    case = Case(R=R, S=32, H=12, K=3, E=12 if R != 4 else 16, tp=4 if R < 4 else 8, kind=kind, seed=R)
    assert_roundtrip(case, roundtrip(case))


@settings(max_examples=12, deadline=None)
@given(R=st.sampled_from([1, 2, 4]), S=st.integers(16, 32), H=st.integers(8, 16), K=st.integers(2, 4),
       epn=st.integers(2, 4), tp=st.sampled_from([4, 8]), kind=st.sampled_from(["uniform", "skewed"]),
       invalid=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 10**6), dtype=st.sampled_from([torch.int32,
                                                                                               torch.int64]))
def test_roundtrip_property(R, S, H, K, epn, tp, kind, invalid, seed, dtype):
    E = max(R * epn, 8)
    K = min(K, E // R) if kind == "skewed" else K
    case = Case(R=R, S=S, H=H, K=K, E=E, tp=tp, kind=kind, invalid=invalid, seed=seed)
    assert_roundtrip(case, roundtrip(case, dtype))


def test_skewed_routing_is_balanced_and_exact():
    """Every route of every rank goes to rank 0's experts; B = E/R replicas spread them exactly."""
    case = Case(R=4, S=32, H=8, K=4, E=16, tp=8, kind="skewed", invalid=0.0)
    results = roundtrip(case)
    plan = results[0]["plan"]
    assert plan.home_load.tolist() == [4 * 32 * 4, 0, 0, 0]
    assert plan.rank_load.tolist() == [32 * 4] * 4
    assert_roundtrip(case, results)


def test_fewer_tokens_than_capacity():
    case = Case(R=4, S=24, H=8, K=2, E=8, tp=4, tokens=(5, 24, 0, 1), seed=3)
    results = roundtrip(case)
    assert [r["identity"].shape[0] for r in results] == [5, 24, 0, 1]
    assert_roundtrip(case, results)


def test_duplicates_are_expanded():
    """R = 2, E = 8, K = 4: token 0 sends all four routes to rank 0 (one payload row, three duplicates)."""
    case = Case(R=2, S=16, H=8, K=4, E=8, tp=4, invalid=0.0)

    def fn(world):
        buf = case.buffer(world)
        x = case.inputs(world.rank)
        x["topk"][0] = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
        x["tpe"] = torch.bincount(x["topk"][x["topk"] >= 0].long(), minlength=case.E).int()
        rows, weights_nvs, _, plan = dispatch(buf, x)
        identity, _, _ = buf.combine(plan, rows)
        return dict(rank=world.rank, x=x, plan=plan, rows=rows, weights_nvs=weights_nvs, identity=identity)

    results = run_ranks(fn, case.R)
    received = [dict() for _ in results]  # per rank: duplicate row -> its primary row
    for res in results:
        dst = res["plan"].dst[: case.K]
        assert int(dst[0]) >= 0 and bool((dst[1:] < 0).all()), "one primary, three duplicates"
        assert torch.equal(res["identity"], valid_sk(res["x"]).sum(1, keepdim=True) * res["x"]["hidden"])
        dest_sk, row_sk, primary_sk, valid_route_sk = (t.view(-1, case.K) for t in decode_dst(res["plan"].dst,
                                                                                         res["plan"].NvS))
        for t, k in torch.nonzero(~primary_sk & valid_route_sk).tolist():
            first = int(torch.nonzero(dest_sk[t] == dest_sk[t, k])[0])
            received[int(dest_sk[t, k])][int(row_sk[t, k])] = int(row_sk[t, first])
    for res, dups in zip(results, received, strict=True):  # the dup tables, from the routes that sent them
        plan = res["plan"]
        num_groups, num_dups = plan.dup_counts.tolist()
        groups = plan.dup_groups[:num_groups].tolist()
        assert num_dups == len(dups) and num_groups == len(set(dups.values()))
        assert [g[0] for g in groups] == sorted(set(dups.values()))
        for primary, first, count in groups:
            rows = sorted(row for row, p in dups.items() if p == primary)
            assert plan.dup_loffs[first:first + count].tolist() == rows
        assert not plan.dup_groups[num_groups:].any() and not plan.dup_loffs[num_dups:].any()
    assert_layout(case, results, "rows", "hidden", weights=True)


def test_zero_copy_views():
    case = Case(R=2, S=16, H=8, K=2, E=8, tp=4)

    def fn(world):
        buf = case.buffer(world)
        x = case.inputs(world.rank)
        rows, weights_nvs, _, plan = dispatch(buf, x, zero_copy=True, router_weights_zero_copy=True)
        assert rows.data_ptr() == buf.hidden_nvsh_buffer_view.data_ptr()
        assert weights_nvs.data_ptr() == buf.router_weight_buffer_view.data_ptr()
        with pytest.raises(ValueError, match="hidden_nvsh"):
            buf.combine(plan, rows.clone(), zero_copy=True)
        rows.mul_(weights_nvs[:, None])  # the "expert" writes its output in place
        out, _, _ = buf.combine(plan, buf.hidden_nvsh_buffer_view, zero_copy=True)
        copied, _, _, _ = dispatch(buf, x)
        assert copied.data_ptr() != buf.hidden_nvsh_buffer_view.data_ptr()
        return x, out

    for x, out in run_ranks(fn, case.R):
        assert torch.equal(out, (x["weights"] * valid_sk(x)).sum(1, keepdim=True) * x["hidden"])


# -- weights -----------------------------------------------------------------------------------------------

GATE_NK, DOWN_NK = (6, 4), (4, 6)


def full_weights(case: Case, shape_nk: tuple[int, int], seed: int) -> torch.Tensor:
    """`[E, N, K]` the group's experts, identical on every rank; integer-valued."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 51, (case.E, *shape_nk), generator=gen).to(F64)


def projections(first, second, position: str) -> tuple:
    """MoonEP's `(gate, up, down)` arguments with a second projection in the `up` or `down` position (the
    layer fuses gate and up, so passes `(gate_up, None, down)`; the guide's callers pass all three)."""
    return (first, second, None) if position == "up" else (first, None, second)


@pytest.mark.parametrize("position", ["down", "up"])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_prefetch_weight_fills_slots(R, position):
    case = Case(R=R, S=16, H=8, K=2, E=8, tp=4, kind="skewed", invalid=0.0)

    def fn(world):
        buf = case.buffer(world)
        _, _, _, plan = dispatch(buf, case.inputs(world.rank))
        gate_e, down_e = full_weights(case, GATE_NK, 1), full_weights(case, DOWN_NK, 2)
        epn, r, B = case.epn, world.rank, buf.B
        # replicated form [E+B, N, K]: rows E.. are the slots
        replicated = [torch.cat([w, torch.zeros(B, *w.shape[1:], dtype=F64)]) for w in (gate_e, down_e)]
        buf.prefetch_weight(plan, *projections(replicated[0], replicated[1], position))
        # ExpertRows: home experts from the symmetric home tensors, slots from the process-global pool
        rows = [ExpertRows(world.symmetric(f"test/home/{name}", w[r * epn:(r + 1) * epn].clone()),
                           slot_pool(world, (B, *w.shape[1:]), F64))
                for name, w in (("gate", gate_e), ("down", down_e))]
        buf.prefetch_weight(plan, *projections(rows[0], rows[1], position))
        return plan.experts_to_copy[r].tolist(), (gate_e, down_e), replicated, [x.slots.local for x in rows]

    results = run_ranks(fn, R)
    if R > 1:
        assert any(e >= 0 for slots, *_ in results for e in slots), "skewed routing needs replicas"
    for slots, full, replicated, pools in results:
        assert len(slots) == (case.epn if R > 1 else 0)
        for w_e, rep, pool in zip(full, replicated, pools, strict=True):
            assert torch.equal(rep[: case.E], w_e)
            for j, expert in enumerate(slots):
                if expert >= 0:
                    assert torch.equal(rep[case.E + j], w_e[expert]) and torch.equal(pool[j], w_e[expert])
                else:
                    assert not rep[case.E + j].any()


@pytest.mark.parametrize("position", ["down", "up"])
@pytest.mark.parametrize("form", ["replicated", "expert_rows"])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_reduce_grad_sums_replicas_into_home(R, form, position):
    case = Case(R=R, S=16, H=8, K=2, E=8, tp=4, kind="skewed", invalid=0.0)

    def fn(world):
        buf = case.buffer(world)
        _, _, _, plan = dispatch(buf, case.inputs(world.rank))
        r, B, epn = world.rank, buf.B, case.epn
        gen = torch.Generator().manual_seed(7 + r)
        used = torch.tensor([e >= 0 for e in plan.experts_to_copy[r].tolist()], dtype=torch.bool)
        grads = []
        for name, shape in (("gate", GATE_NK), ("down", DOWN_NK)):
            home = torch.randint(-50, 51, (epn, *shape), generator=gen).to(F64)
            slots = torch.randint(-50, 51, (B, *shape), generator=gen).to(F64) * used[:, None, None]
            if form == "replicated":
                full = torch.randint(-50, 51, (case.E + B, *shape), generator=gen).to(F64)
                full[r * epn:(r + 1) * epn], full[case.E:] = home, slots
                staging = world.symmetric(f"test/stage/{name}", torch.zeros(B, *shape, dtype=F64))
                grads.append((full, staging, (home.clone(), slots.clone(), full.clone())))
            else:
                home_t = world.symmetric(f"test/grad/{name}", home.clone())
                pool = slot_grad_pool(world, (B, *shape), F64)
                pool.local.copy_(slots)
                grads.append((ExpertRows(home_t, pool), None, (home.clone(), slots.clone(), None)))
        (gate, gate_stage, gate_before), (down, down_stage, down_before) = grads
        buf.reduce_grad(plan, *projections(gate, down, position), gate_reduce_buffer=gate_stage,
                        **{f"{position}_reduce_buffer": down_stage})
        after = [(g.home.local, g.slots.local) if form == "expert_rows"
                 else (g[r * epn:(r + 1) * epn], g[case.E:]) for g in (gate, down)]
        untouched = [g if form == "replicated" else None for g in (gate, down)]
        return plan.experts_to_copy, [gate_before, down_before], after, untouched, used

    results = run_ranks(fn, R)
    table = results[0][0].tolist()
    for p in range(2):  # projections
        for r, (_, before, after, untouched, used) in enumerate(results):
            home_before, _, full_before = before[p]
            home_after, slots_after = after[p]
            expected = home_before.clone()
            for d, experts in enumerate(table):
                for j, expert in enumerate(experts):
                    if expert >= 0 and expert // case.epn == r:
                        expected[expert % case.epn] += results[d][1][p][1][j]
            assert torch.equal(home_after, expected)
            assert not slots_after[used].any(), "used slots are cleared"
            if full_before is not None:  # the replicated form leaves the non-home expert rows alone
                others = torch.ones(case.E, dtype=torch.bool)
                others[r * case.epn:(r + 1) * case.epn] = False
                assert torch.equal(untouched[p][: case.E][others], full_before[: case.E][others])
    if R > 1:
        assert any(e >= 0 for row in table for e in row), "skewed routing needs replicas"


# -- bad input ---------------------------------------------------------------------------------------------

ONE = Case(R=1, S=16, H=8, K=2, E=8, tp=4, invalid=0.0)


@pytest.fixture
def one():
    buf = ONE.buffer(single_world())
    yield buf, ONE.inputs(0)
    buf.destroy()


def test_error_hidden_dtype(one):
    buf, x = one
    with pytest.raises(ValueError, match="hidden_sh.*dtype"):
        buf.dispatch(x["hidden"].float(), x["weights"], x["topk"], x["tpe"])


def test_error_route_weights_shape(one):
    buf, x = one
    with pytest.raises(ValueError, match="route_weights_sk.*shape"):
        buf.dispatch(x["hidden"], x["weights"][:, :1], x["topk"], x["tpe"])


def test_error_device(one):
    buf, x = one
    with pytest.raises(ValueError, match="tokens_per_expert must be on cpu"):
        buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"].to("meta"))


@pytest.mark.parametrize("bad", [ONE.E, ONE.E + 5, -2])
def test_error_expert_ids(one, bad):
    buf, x = one
    x["topk"][3, 1] = bad
    with pytest.raises(ValueError, match=f"topk_experts_sk.*{bad}"):
        buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"])


def test_error_more_tokens_than_capacity(one):
    buf, _ = one
    x = Case(R=1, S=17, H=8, K=2, E=8).inputs(0)
    with pytest.raises(ValueError, match="hidden_sh.*S=16"):
        buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"])


def test_error_experts_not_divisible_by_ranks():
    with pytest.raises(ValueError, match="E=6.*num_ep_ranks=4"):
        Buffer(16, 8, 2, 6, 4, world=ThreadGroup(4).worlds[0], dtype=F64)


def test_error_too_many_slots():
    with pytest.raises(ValueError, match="B=5"):
        Buffer(16, 8, 2, 8, 2, B=5, world=ThreadGroup(2).worlds[0], dtype=F64)


def test_error_world_size_mismatch():
    with pytest.raises(ValueError, match="num_ep_ranks=2"):
        Buffer(16, 8, 2, 8, 2, world=single_world(), dtype=F64)


def test_error_plan_from_another_buffer(one):
    buf, x = one
    other = ONE.buffer(buf.world)
    rows, _, _, plan = dispatch(other, x)
    with pytest.raises(ValueError, match="plan"):
        buf.combine(plan, rows)
    with pytest.raises(ValueError, match="plan"):
        buf.dispatch(x["hidden"], None, None, None, plan=plan)


def test_zero_copy_rows_with_route_weights_of_another_tensor():
    """`combine(zero_copy=True)` takes the rows where the experts wrote them (the Buffer's view) and route
    weights from any tensor (copied into the Buffer; backward's route-weight gradients): both come back per
    route."""
    case = Case(R=2, S=16, H=8, K=2, E=8, tp=4)

    def fn(world):
        buf = case.buffer(world)
        x = case.inputs(world.rank)
        rows, weights_nvs, _, plan = dispatch(buf, x, zero_copy=True)
        rows.mul_(weights_nvs[:, None])  # the "expert" writes its output in place
        out, weights_sk, _ = buf.combine(plan, buf.hidden_nvsh_buffer_view, 3 * weights_nvs, zero_copy=True)
        return x, out, weights_sk

    for x, out, weights_sk in run_ranks(fn, case.R):
        assert torch.equal(out, (x["weights"] * valid_sk(x)).sum(1, keepdim=True) * x["hidden"])
        assert torch.equal(weights_sk, 3 * x["weights"] * valid_sk(x))


def test_error_combine_zero_copy_foreign_tensor(one):
    buf, x = one
    rows, _, _, plan = dispatch(buf, x)
    with pytest.raises(ValueError, match="hidden_nvsh"):
        buf.combine(plan, rows, zero_copy=True)


def test_use_after_destroy(one):
    buf, x = one
    _, _, _, plan = dispatch(buf, x)
    keys = list(buf.world.group._registry)
    assert keys
    buf.destroy()
    buf.destroy()
    assert buf.destroyed
    assert not any(k in buf.world.group._registry for k in keys)
    for call in (lambda: dispatch(buf, x), lambda: buf.combine(plan, torch.zeros(buf.NvS, buf.H, dtype=F64)),
                 lambda: buf.hidden_nvsh_buffer_view, lambda: buf.router_weight_buffer_view):
        with pytest.raises(RuntimeError, match="destroyed"):
            call()


def test_failed_call_leaves_buffer_usable():
    """Every rank passes a bad expert id, sees the error and then runs a correct step on the same Buffer;
    then rank 0 alone fails mid-group, and the same Buffers still run a correct step afterwards."""
    case = Case(R=2, S=16, H=8, K=2, E=8, tp=4)
    group = ThreadGroup(case.R)

    def exact_step(buf, world):
        x = case.inputs(world.rank)
        rows, _, _, plan = dispatch(buf, x)
        out, _, _ = buf.combine(plan, rows)
        assert torch.equal(out, valid_sk(x).sum(1, keepdim=True) * x["hidden"])

    def first(world):
        buf = case.buffer(world)
        x = case.inputs(world.rank)
        x["topk"][0, 0] = case.E
        with pytest.raises(ValueError, match="topk_experts_sk"):
            dispatch(buf, x)
        exact_step(buf, world)
        return buf

    buffers = run_ranks(first, case.R, group=group)

    def rank0_fails(world):
        x = case.inputs(world.rank)
        if world.rank == 0:
            x["topk"][0, 0] = -3
        dispatch(buffers[world.rank], x)

    with pytest.raises(RankFailedError, match="rank 0 failed: ValueError: .*topk_experts_sk"):
        run_ranks(rank0_fails, case.R, group=group)
    run_ranks(lambda world: exact_step(buffers[world.rank], world), case.R, group=group)


# -- plans, histograms and replicated weights that do not belong to the step -------------------------------


def test_operations_refuse_a_plan_older_than_the_latest_dispatch():
    """Dispatch A, dispatch B: A's plan no longer describes the Buffer's step (combining B's rows with it
    returned wrong rows, relative error 3.7). A backward dispatch(plan=A) makes A the latest again, which is
    what activation recomputation and pipeline schedules do, and its combine is exact."""
    case = Case(R=2, S=16, H=8, K=3, E=8, tp=4)
    other = Case(R=2, S=16, H=8, K=3, E=8, tp=4, kind="skewed", seed=5)

    def fn(world):
        buf = case.buffer(world)
        x, y = case.inputs(world.rank), other.inputs(world.rank)
        _, _, _, plan_a = dispatch(buf, x)
        rows_b, _, _, plan_b = dispatch(buf, y)
        with pytest.raises(ValueError, match=f"rank {world.rank}: plan is the plan of step 1 .* latest "
                                             "dispatch was step 2"):
            buf.combine(plan_a, rows_b)
        with pytest.raises(ValueError, match="plan of step 1"):
            buf.prefetch_weight(plan_a, None, None, None)
        grad_rows, _, _, _ = buf.dispatch(x["hidden"], plan=plan_a)  # backward of step A
        out_a, _, _ = buf.combine(plan_a, grad_rows)
        with pytest.raises(ValueError, match="plan of step 2 .* latest dispatch was step 1"):
            buf.combine(plan_b, rows_b)
        return x, out_a

    for x, out_a in run_ranks(fn, case.R):
        assert torch.equal(out_a, valid_sk(x).sum(1, keepdim=True) * x["hidden"])


def test_tokens_per_expert_is_counted_from_the_ids():
    """The plan comes from the ids, never from a histogram that disagrees with them (which gave wrong
    outputs); with `validate` such a histogram raises, naming it; None is accepted."""
    case = Case(R=2, S=16, H=8, K=3, E=8, tp=4, kind="skewed", invalid=0.1)

    def fn(world):
        x = case.inputs(world.rank)
        wrong = x["tpe"].flip(0).contiguous()
        strict = case.buffer(world)
        with pytest.raises(ValueError, match=f"rank {world.rank}: tokens_per_expert\\[.*topk_experts_sk"):
            strict.dispatch(x["hidden"], x["weights"], x["topk"], wrong)
        buf = case.buffer(world, validate=False)
        outs = []
        for tokens_per_expert in (wrong, None):
            rows, weights_nvs, _, plan = buf.dispatch(x["hidden"], x["weights"], x["topk"],
                                                      tokens_per_expert)
            outs.append(buf.combine(plan, rows * weights_nvs[:, None])[0])
        return x, outs

    for x, outs in run_ranks(fn, case.R):
        for out in outs:
            assert torch.equal(out, (x["weights"] * valid_sk(x)).sum(1, keepdim=True) * x["hidden"])


def test_prefetch_weight_refuses_replicated_rows_that_are_not_the_experts():
    """The replicated `[E+B, N, K]` form is read locally: a weight whose other ranks' rows are not those
    experts' weights (here zeros: only the home rows filled) raised nothing and filled the slots with
    them. With `validate` it raises on the rank whose slot would get the wrong expert."""
    case = Case(R=2, S=16, H=8, K=2, E=8, tp=4, kind="skewed", invalid=0.0)

    def fn(world):
        buf = case.buffer(world)
        _, _, _, plan = dispatch(buf, case.inputs(world.rank))
        gate_e = full_weights(case, GATE_NK, 1)
        home = slice(world.rank * case.epn, (world.rank + 1) * case.epn)
        only_home = torch.zeros(case.E + buf.B, *GATE_NK, dtype=F64)
        only_home[home] = gate_e[home]
        try:
            buf.prefetch_weight(plan, only_home, None, None)
        except ValueError as error:
            return str(error)
        return None

    errors = run_ranks(fn, case.R)
    assert errors[0] is None, "rank 0 holds the hot experts: it copies nothing"
    assert errors[1] is not None and "rank 1: full_gate_weight[" in errors[1] and "home rank 0" in errors[1]


# -- MoonEP's guide, as written ----------------------------------------------------------------------------


def test_guide_backward_dispatch_views_and_explicit_destroy():
    """The guide's backward call `dispatch(grad, plan=plan, async_finish=True)`, the views as properties,
    and `explicitly_destroy=True` without `destroy()`: a ResourceWarning naming the Buffer, then released."""
    case = Case(R=1, S=16, H=8, K=2, E=8, tp=4)
    world = single_world()
    buf = case.buffer(world, explicitly_destroy=True)
    x = case.inputs(0)
    rows, _, _, plan = dispatch(buf, x)
    buf.combine(plan, rows)
    grad, weights, cu_seqlens, same, event = buf.dispatch(x["hidden"], plan=plan, async_finish=True)
    event.wait()
    assert same is plan and weights is None and cu_seqlens is None
    assert buf.hidden_nvsh_buffer_view.shape == (buf.NvS, case.H)
    assert buf.router_weight_buffer_view.shape == (buf.NvS,)
    keys, name = list(buf._keys), f"Buffer {buf.id} on rank 0"
    assert all(k in world.group._registry for k in keys)
    with pytest.warns(ResourceWarning, match=f"{name} was created with explicitly_destroy=True"):
        del buf
        gc.collect()
    assert not any(k in world.group._registry for k in keys), "released after the warning"


def test_guide_call_shapes():
    """The guide's unpacking of every operation: a synchronous dispatch returns `(hidden_nvsh,
    route_weights_nvs, cu_seqlens, plan)` and appends its event only with `async_finish`; combine returns
    `(hidden_sh, route_weights_sk, event)`, the event None when synchronous; prefetch_weight and reduce_grad
    return None synchronously and their event with `async_finish` (a `CommEvent`, finished off CUDA: its
    `event` is None, `query()` True)."""
    case = Case(R=1, S=16, H=8, K=2, E=8, tp=4)
    world = single_world()
    buf = case.buffer(world)
    x = case.inputs(0)
    gate = ExpertRows(world.symmetric("test/event/gate", torch.zeros(case.epn, *GATE_NK, dtype=F64)),
                      slot_pool(world, (buf.B, *GATE_NK), F64))
    hidden_nvsh, route_weights_nvs, cu_seqlens, plan = dispatch(buf, x)
    assert hidden_nvsh.shape == (buf.NvS, case.H) and route_weights_nvs.shape == (buf.NvS,)
    assert cu_seqlens.shape == (case.E + buf.B,) and plan.step == 1
    hidden_sh, route_weights_sk, event = buf.combine(plan, hidden_nvsh, route_weights_nvs)
    assert hidden_sh.shape == (16, case.H) and route_weights_sk.shape == (16, case.K) and event is None
    grad_nvsh, no_weights, no_cu_seqlens, same = buf.dispatch(x["hidden"], plan=plan)
    assert same is plan and no_weights is None and no_cu_seqlens is None
    assert buf.prefetch_weight(plan, gate, None, None) is None
    assert buf.reduce_grad(plan, gate, None, None) is None
    events = []
    *_, plan, event = dispatch(buf, x, async_finish=True)
    events.append(event)
    *_, event = buf.combine(plan, torch.zeros(buf.NvS, case.H, dtype=F64), async_finish=True)
    events.append(event)
    *_, plan, event = buf.dispatch(x["hidden"], plan=plan, async_finish=True)
    events.append(event)
    events.append(buf.prefetch_weight(plan, gate, None, None, async_finish=True))
    events.append(buf.reduce_grad(plan, gate, None, None, async_finish=True))
    assert all(isinstance(e, CommEvent) and e.event is None and e.query() for e in events), events


GROUP_CASE = Case(R=1, S=16, H=8, K=2, E=8, tp=4)
GROUP_SHAPE = dict(S=GROUP_CASE.S, H=GROUP_CASE.H, K=GROUP_CASE.K, E=GROUP_CASE.E, num_ep_ranks=1,
                   token_padding=GROUP_CASE.tp, dtype=F64)


def assert_buffer_of_a_group_runs_the_guide(backend: str, device: torch.device, world_name: str,
                                            world_type: type) -> None:
    """A Buffer built from a one-rank `backend` group lives on the group's world (`world_of_group`'s
    `world_name`, a `world_type`), and the guide's dispatch and combine on it equal the threads world's."""
    x = {name: value.to(device) for name, value in GROUP_CASE.inputs(0).items()}
    threads = Buffer(**GROUP_SHAPE, world=single_world(device))
    rows, weights_nvs, _, plan = dispatch(threads, x)
    want_sh, _, _ = threads.combine(plan, rows * weights_nvs[:, None])
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        buf = Buffer(**GROUP_SHAPE, group=group)
        assert isinstance(buf.world, world_type) and buf.world is world_of_group(world_name, group)
        hidden_nvsh, route_weights_nvs, _, plan = dispatch(buf, x)
        out_sh, _, event = buf.combine(plan, hidden_nvsh * route_weights_nvs[:, None])
        assert torch.equal(out_sh, want_sh) and event is None
        buf.destroy()
    finally:
        dist.destroy_process_group()


def test_guide_buffer_of_a_process_group():
    """MoonEP builds its Buffer from a process group (`group=`, None: the default group): the world is
    derived from it (gloo: the collective world `world_of_group` gives every layer of that group) and the
    guide's steps run on it, equal to the same Buffer on the threads world. Without torch.distributed, or
    with both a world and a group, one line says what to pass."""
    from moonep_moe.transport.collective import CollectiveWorld

    with pytest.raises(ValueError, match="torch.distributed is not initialised.*pass world="):
        Buffer(**GROUP_SHAPE)
    with pytest.raises(ValueError, match="not both"):
        Buffer(**GROUP_SHAPE, world=single_world(), group=object())
    assert_buffer_of_a_group_runs_the_guide("gloo", torch.device("cpu"), "collective", CollectiveWorld)


@pytest.mark.gpu
def test_guide_buffer_of_an_nccl_group_is_on_symmetric_memory():
    """An NCCL group (one rank here) stands for MoonEP's setting, one NVLink domain: the Buffer built from
    it lives on the group's `SymmetricWorld`, and the guide's steps equal the threads world's on the GPU."""
    from moonep_moe.transport.symmetric import SymmetricWorld

    device = torch.device("cuda", torch.cuda.current_device())
    assert_buffer_of_a_group_runs_the_guide("nccl", device, "symmetric", SymmetricWorld)


def test_guide_options_after_num_ep_ranks_are_keyword_only():
    """MoonEP's sixth positional argument is `num_sms`, this Buffer's was `B`: every option after
    `num_ep_ranks` is keyword-only, so a positional call raises instead of meaning something else."""
    with pytest.raises(TypeError, match="positional"):
        Buffer(16, 8, 2, 8, 1, 32, world=single_world(), dtype=F64)


def test_guide_reduce_buffer_form_is_named():
    """The guide's `*_reduce_buffer` is a `[R, B, H, H']` view of every rank's reduce buffer, which a world
    without one address space for all ranks cannot be given: passing it raises one line naming the form
    taken here (this rank's `[B, N, K]` as a SymmetricTensor)."""
    case = Case(R=2, S=16, H=8, K=2, E=8, tp=4, kind="skewed", invalid=0.0)

    def fn(world):
        buf = case.buffer(world)
        _, _, _, plan = dispatch(buf, case.inputs(world.rank))
        full = torch.zeros(case.E + buf.B, *GATE_NK, dtype=F64)
        try:
            buf.reduce_grad(plan, full, None, None, gate_reduce_buffer=torch.zeros(case.R, buf.B, *GATE_NK,
                                                                                   dtype=F64))
        except ValueError as error:
            return str(error)
        return None

    for message in run_ranks(fn, case.R):
        assert message is not None and "[B, N, K] SymmetricTensor" in message, message
        assert "not MoonEP's [R, B, N, K] view" in message and "got a tensor [2, 4, 6, 4]" in message, message


def test_buffer_takes_only_options_that_run():
    """No stored-but-unused options: `enable_pdl` (never read) is not accepted. (`prefetch_weight(scales=)`
    moves FP8 weights' block scales: tests/test_fp8_prefetch.py.)"""
    case = Case(R=1, S=16, H=8, K=2, E=8, tp=4)
    with pytest.raises(TypeError, match="enable_pdl"):
        case.buffer(single_world(), enable_pdl=True)


def test_errors_name_the_rank():
    case = Case(R=2, S=16, H=8, K=2, E=8, tp=4)

    def fn(world):
        buf = case.buffer(world)
        x = case.inputs(world.rank)
        if world.rank == 1:
            dispatch(buf, dict(x, hidden=x["hidden"].float()))
        dispatch(buf, x)

    with pytest.raises(RankFailedError, match="rank 1 failed: ValueError: rank 1: hidden_sh must have dtype"):
        run_ranks(fn, case.R)
    with pytest.raises(ValueError, match="rank 0: B=5"):
        Buffer(16, 8, 2, 8, 2, B=5, world=ThreadGroup(2).worlds[0], dtype=F64)
