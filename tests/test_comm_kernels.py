"""The Buffer's Triton row kernels (`comm.kernels.rows`) against its torch reference, bit for bit.

Every rank of a threads world holds two Buffers of the same shape, one forced onto the kernels
(`kernels=True`; on the CPU they run in Triton's interpreter, which conftest turns on) and one onto the
reference (`kernels=False`), and runs the same step on both from fresh random inputs: dispatch, combine
(with and without route weights, copy and zero-copy), the backward dispatch through the plan,
prefetch_weight and reduce_grad in both weight forms. Every output, the plan's dup tables and the state
left in the slots and home gradients must be equal (`torch.equal`): the kernels add in the reference's
order (combine's fp32 sum in k order, duplicates in row order, replicas in (slot, rank) order), so even
bf16 results are exact. Skewed routing sends every route to rank 0's experts: replicas and duplicate
routes are then guaranteed.

On a GPU (`@pytest.mark.gpu`) the kernels run on CUDA thread-ranks with larger shapes and are compared with
the reference run on the CPU from the same inputs (the CUDA reference's `index_add_` adds in no fixed
order); a one-rank step also runs under `torch.cuda.set_sync_debug_mode("error")`, and `async_finish`
results are compared with synchronous ones after `event.wait()`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.exchange import ReferenceExchange
from moonep_moe.transport.threads import run_ranks, single_world
from moonep_moe.weights.pool import ExpertRows

GATE_NK, DOWN_NK = (6, 8), (8, 6)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the small cases run the kernels: compiled on CUDA, else in Triton's interpreter on CPU tensors."""


def routes_from_histogram(counts_e: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """`[s, K]` int64 routes with this histogram `counts_e [E]` (each count <= s, total <= s*K): the routes
    expert by expert, dealt to the tokens round robin (route i is token i % s's k = i // s, so a token's
    experts are distinct), the rest -1."""
    experts = torch.repeat_interleave(torch.arange(len(counts_e)), counts_e)
    topk = torch.full((top_k * num_tokens,), -1, dtype=torch.int64)
    topk[:len(experts)] = experts
    return topk.view(top_k, num_tokens).t().contiguous()


def mixed(shape: tuple[int, ...], gen: torch.Generator, spread: int) -> torch.Tensor:
    """`randn(shape)` fp32, each value times 2^j, j uniform in [-spread, spread] (spread=0: plain `randn`, the
    same draws): mixed magnitudes make fp32 sums order-sensitive."""
    values = torch.randn(shape, generator=gen)
    if spread:
        values = values * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=gen).float())
    return values


@dataclass(frozen=True)
class Step:
    """One EP group's step: R ranks, capacity S, `tokens` per rank (None: S), H, K, E, tp, routing `kind`
    ("uniform" or "skewed": every route to rank 0's experts), a share of invalid routes, row dtype.

    `histogram` (`[R][E]`: routes from each rank to each expert) replaces the random routing: rank r's
    routes come from `routes_from_histogram(histogram[r])`. Expert outputs and gradients span 2^+-`spread`
    (`mixed`)."""

    R: int
    S: int = 16
    H: int = 16
    K: int = 3
    E: int = 8
    tp: int = 4
    kind: str = "uniform"
    invalid: float = 0.2
    dtype: torch.dtype = torch.bfloat16
    tokens: tuple[int, ...] | None = None
    seed: int = 0
    histogram: tuple[tuple[int, ...], ...] | None = None
    spread: int = 0

    @property
    def epn(self) -> int:
        return self.E // self.R

    def buffer(self, world, kernels: bool, **kwargs) -> Buffer:
        return Buffer(self.S, self.H, self.K, self.E, self.R, token_padding=self.tp, world=world,
                      dtype=self.dtype, kernels=kernels, **kwargs)

    def inputs(self, rank: int) -> dict[str, torch.Tensor]:
        """Random hidden `[s, H]`, route weights `[s, K]`, distinct experts per token `[s, K]` with -1s,
        the histogram `[E]`, expert outputs `[NvS, H]`, a gradient `[s, H]`, per-row values `[NvS]`."""
        s = self.S if self.tokens is None else self.tokens[rank]
        gen = torch.Generator().manual_seed(1000 * self.seed + rank)
        if self.histogram is not None:
            topk = routes_from_histogram(torch.tensor(self.histogram[rank]), s, self.K)
        else:
            p_e = torch.ones(self.E)
            if self.kind == "skewed":
                p_e[self.epn:] = 0
            topk = torch.empty(0, self.K, dtype=torch.long)
            if s:
                topk = torch.multinomial(p_e.expand(s, -1), self.K, generator=gen)
            topk[torch.rand(s, self.K, generator=gen) < self.invalid] = -1
        weight_dtype = torch.promote_types(self.dtype, torch.float32)
        return dict(hidden=torch.randn(s, self.H, generator=gen).to(self.dtype),
                    weights=torch.rand(s, self.K, generator=gen, dtype=weight_dtype),
                    topk=topk.int(), tpe=torch.bincount(topk[topk >= 0], minlength=self.E).int(),
                    grad=torch.randn(s, self.H, generator=gen).to(self.dtype))


def prepare(step: Step, world, kernels: bool, **buffer_kwargs) -> dict:
    """A Buffer and every input of `operate` on the world's device (fresh random values, fixed seeds)."""
    device, r, epn = world.device, world.rank, step.epn
    buf = step.buffer(world, kernels, **buffer_kwargs)
    assert buf.uses_kernels == kernels
    B, tag = buf.B, f"test/{next(world.globals.setdefault('test_serial', itertools.count()))}"
    gen = torch.Generator().manual_seed(77 + r)
    experts = [torch.randn(step.E, *shape, generator=torch.Generator().manual_seed(5 + i)).to(step.dtype)
               for i, shape in enumerate((GATE_NK, DOWN_NK))]  # the same group experts on every rank

    def symmetric(name, tensor):
        return world.symmetric(f"{tag}/{name}", tensor.to(device))

    return dict(
        buf=buf, x={k: v.to(device) for k, v in step.inputs(r).items()},
        expert_out=mixed((buf.NvS, step.H), gen, step.spread).to(step.dtype).to(device),
        values=torch.randn(buf.NvS, generator=gen, dtype=buf.weight_dtype).to(device),
        rows=[ExpertRows(symmetric(f"home{i}", w[r * epn:(r + 1) * epn].clone()),
                         symmetric(f"slots{i}", torch.full((B, *w.shape[1:]), 7.0, dtype=step.dtype)))
              for i, w in enumerate(experts)],
        replicated=torch.cat([experts[0], torch.full((B, *GATE_NK), 7.0, dtype=step.dtype)]).to(device),
        # fp32 home gradients, and home gradients in the row dtype (bf16 parameters' own grads)
        grads=[ExpertRows(symmetric(f"grad{i}", mixed((epn, *shape), gen, step.spread).to(home_dtype)),
                          symmetric(f"slot_grads{i}", mixed((B, *shape), gen, step.spread)))
               for i, (shape, home_dtype) in enumerate(((GATE_NK, torch.float32), (DOWN_NK, step.dtype)))],
        full=mixed((step.E + B, *DOWN_NK), gen, step.spread).to(device),
        staging=symmetric("staging", torch.zeros(B, *DOWN_NK)))


def filled(rows_nvsh: torch.Tensor, plan) -> torch.Tensor:
    """The rows a copying dispatch defines, those up to `cu_seqlens[-1]`; the rest (unspecified) as zeros,
    without a host read."""
    inside_nvs = torch.arange(rows_nvsh.shape[0], device=rows_nvsh.device) < plan.cu_seqlens[-1]
    return torch.where(inside_nvs[:, None], rows_nvsh, 0)


def operate(state: dict) -> dict:
    """Every Buffer operation on one rank; returns everything they produce or leave behind (no host read,
    so it can run under `set_sync_debug_mode("error")`)."""
    buf, x = state["buf"], state["x"]
    out = {}
    rows, weights, cu, plan = buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"])
    out.update(rows=filled(rows, plan), weights=weights, cu=cu, dst=plan.dst, dup_groups=plan.dup_groups,
               dup_loffs=plan.dup_loffs, dup_counts=plan.dup_counts, experts_to_copy=plan.experts_to_copy)
    out["combined"], out["no_values"], _ = buf.combine(plan, state["expert_out"])
    out["combined_again"], out["values_sk"], _ = buf.combine(plan, state["expert_out"], state["values"])
    grad_rows, out["grad_weights"], out["grad_cu"], _ = buf.dispatch(x["grad"], None, None, None, plan=plan)
    out["grad_rows"] = filled(grad_rows, plan)
    # zero copy: the "expert" writes in place into the Buffer's own views
    rows, weights, _, plan = buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"], zero_copy=True,
                                          router_weights_zero_copy=True)
    rows.mul_(2)
    weights.add_(1)
    out["zero_copy"], out["zero_copy_sk"], _ = buf.combine(plan, rows, weights, zero_copy=True)
    gate, down = state["rows"]
    buf.prefetch_weight(plan, gate, None, down)
    buf.prefetch_weight(plan, state["replicated"], None, None)
    buf.reduce_grad(plan, state["grads"][0], None, state["grads"][1])
    buf.reduce_grad(plan, None, None, state["full"], down_reduce_buffer=state["staging"])
    out.update(slots0=gate.slots.local, slots1=down.slots.local, replicated=state["replicated"],
               home_grad0=state["grads"][0].home.local, slot_grad0=state["grads"][0].slots.local,
               home_grad1=state["grads"][1].home.local, full_grad=state["full"])
    rows.fill_(7)  # garbage in every row and weight: the next dispatch must zero its padding again
    weights.fill_(7)
    over_garbage, out["over_garbage_w"], _, plan = buf.dispatch(x["hidden"], x["weights"], x["topk"],
                                                                   x["tpe"])
    out["over_garbage"] = filled(over_garbage, plan)
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def run_step(step: Step, world, kernels: bool) -> dict:
    return operate(prepare(step, world, kernels))


def both_paths(step: Step, device: str = "cpu") -> list[tuple[dict, dict]]:
    """(kernels, reference) results of every rank; the reference runs on the CPU."""
    kernels = run_ranks(lambda world: run_step(step, world, kernels=True), step.R, device=device)
    reference = run_ranks(lambda world: run_step(step, world, kernels=False), step.R)
    return list(zip(kernels, reference, strict=True))


def assert_equal(step: Step, results: list[tuple[dict, dict]], covers_duplicates: bool = True) -> None:
    """Every result of the kernels equals the reference's; with `covers_duplicates`, a skewed step of
    several ranks must also have used replicas and duplicate routes (a drawn step may be too small to)."""
    for rank, (kernels, reference) in enumerate(results):
        assert kernels.keys() == reference.keys()
        for key, want in reference.items():
            got = kernels[key]
            if isinstance(want, torch.Tensor):
                got = got.cpu()
                assert got.dtype == want.dtype and got.shape == want.shape, (rank, key)
                wrong = int((got != want).sum())
                assert wrong == 0, f"rank {rank}: {wrong} {key} values differ (kernels vs reference)"
            else:
                assert got == want, (rank, key)
    if covers_duplicates and step.kind == "skewed" and step.R > 1:
        reference = [res for _, res in results]
        assert bool((reference[0]["experts_to_copy"] >= 0).any()), "skewed routing uses replicas"
        assert sum(int(res["dup_counts"][1]) for res in reference) > 0, "and duplicate routes"


# -- Both: compiled on a GPU, in the interpreter on the CPU ----------------------------------------------


ONCE = {(1, "skewed"), (2, "uniform")}
"""The cases of `test_kernels_equal_reference` that CI reruns under the oldest Triton (`oldest_triton`):
one rank and several, with the other row kernels' modes launched by the tests marked beside them."""


@pytest.mark.parametrize("R, kind", [
    pytest.param(R, kind, marks=[pytest.mark.oldest_triton] if (R, kind) in ONCE else [])
    for R in (1, 2, 4) for kind in ("uniform", "skewed")])
def test_kernels_equal_reference(R, kind):
    step = Step(R=R, S=16 if R < 4 else 8, E=8 if R < 4 else 16, K=3 if R < 4 else 4, kind=kind, seed=R)
    assert_equal(step, both_paths(step, KERNEL_DEVICE))


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_kernels_equal_reference_fp32_rows(kind):
    step = Step(R=2, S=12, K=4, kind=kind, dtype=torch.float32, seed=5)
    assert_equal(step, both_paths(step, KERNEL_DEVICE))


@settings(max_examples=4, deadline=None)
@given(st.data())
def test_kernels_equal_reference_on_drawn_steps(data):
    """Drawn steps (ranks, experts per rank, K, capacity, width, padding, routing, invalid routes, tokens per
    rank, row dtype, mixed magnitudes): every output bit for bit as the reference's."""
    R = data.draw(st.sampled_from([1, 2, 3]), "R")
    E = R * data.draw(st.integers(1, 3), "epn")
    S = data.draw(st.integers(1, 8), "S")
    step = Step(R=R, S=S, H=data.draw(st.sampled_from([8, 20, 24]), "H"),
                K=data.draw(st.integers(1, min(E, 4)), "K"), E=E,
                tp=data.draw(st.sampled_from([1, 2, 4, 8]), "tp"),
                kind=data.draw(st.sampled_from(["uniform", "skewed"]), "kind"),
                invalid=data.draw(st.sampled_from([0.0, 0.3]), "invalid"),
                dtype=data.draw(st.sampled_from([torch.bfloat16, torch.float32]), "dtype"),
                tokens=tuple(data.draw(st.integers(0, S), f"tokens {r}") for r in range(R)),
                seed=data.draw(st.integers(0, 2**16), "seed"),
                spread=data.draw(st.sampled_from([0, 20]), "spread"))
    assert_equal(step, both_paths(step, KERNEL_DEVICE), covers_duplicates=False)


@pytest.mark.oldest_triton
def test_fewer_tokens_and_invalid_routes():
    """s < S on every rank (one rank with no token at all), many invalid routes, H with a masked tail."""
    step = Step(R=4, S=8, H=20, K=2, E=8, tp=8, kind="skewed", invalid=0.5, tokens=(5, 8, 0, 1), seed=9)
    assert_equal(step, both_paths(step, KERNEL_DEVICE))


@pytest.mark.oldest_triton
def test_wide_rows_span_several_blocks():
    """H larger than one kernel block (several programs per row), duplicates K - 1 deep."""
    step = Step(R=2, S=4, H=2048 + 64, K=4, E=8, tp=4, kind="skewed", invalid=0.0, dtype=torch.float32)
    assert_equal(step, both_paths(step, KERNEL_DEVICE))


def test_a_prefetch_that_does_not_wait_for_its_readers_drops_only_the_closing_barrier():
    """`prefetch_weight(wait_for_readers=False)` (the layer's: combine follows) makes one barrier, the one
    before it reads its peers' experts, where the default makes a second after them; the slots get the same
    bits (skewed routing: rank 1 replicates rank 0's experts). The combine after it is the call whose opening
    barrier orders the peers' reads."""
    step = Step(R=2, kind="skewed", seed=3)

    def run(world) -> tuple[list[int], list[torch.Tensor]]:
        state = prepare(step, world, kernels=True)
        buf, x = state["buf"], state["x"]
        _, _, _, plan = buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"])
        gate, down = state["rows"]
        barriers, slots = [], []
        counted = world.barrier

        def barrier() -> None:
            barriers[-1] += 1
            counted()

        world.barrier = barrier
        for wait in (True, False):
            barriers.append(0)
            gate.slots.local.fill_(7)
            down.slots.local.fill_(7)
            buf.prefetch_weight(plan, gate, None, down, wait_for_readers=wait)
            slots.append(torch.cat([gate.slots.local.flatten(), down.slots.local.flatten()]).cpu())
        barriers.append(0)
        buf.combine(plan, state["expert_out"])
        assert bool((plan.experts_to_copy[1] >= 0).any()), "the skewed plan replicates onto rank 1"
        return barriers[:2], slots

    for rank, (barriers, (waited, not_waited)) in enumerate(run_ranks(run, step.R, device=KERNEL_DEVICE)):
        assert barriers == [2, 1], f"rank {rank}: barriers per prefetch {barriers}"
        assert torch.equal(waited, not_waited), f"rank {rank}: the slots differ"


def received_duplicates(R: int, S: int, K: int, end: int, gen: torch.Generator, every_route: bool = False
                        ) -> torch.Tensor:
    """`[R*S*K, 2]` int32 duplicate pairs as `send_routes` leaves them on a rank whose plan fills `end` rows:
    each (source rank, token) window, in random order, sends 0..K of its K routes (all K with `every_route`:
    skewed routing, each group K - 1 duplicates deep) to rows drawn at random below `end` until they run
    out; its first one is the primary, each later one a pair (its row, the primary's row) at its slot, the
    rest -1."""
    pairs_p2 = torch.full((R * S * K, 2), -1, dtype=torch.int32)
    free = torch.randperm(end, generator=gen).tolist()
    for window in torch.randperm(R * S, generator=gen).tolist():
        routes = K if every_route else int(torch.randint(0, K + 1, (), generator=gen))
        ks = sorted(torch.randperm(K, generator=gen)[:min(routes, len(free))].tolist())
        rows = [free.pop() for _ in ks]
        for k, row in zip(ks[1:], rows[1:], strict=True):
            pairs_p2[window * K + k] = torch.tensor([row, rows[0]])
    return pairs_p2


def empty_dup_tables(nvs: int, device) -> SimpleNamespace:
    """A plan's zero `[NvS, 3]`, `[NvS]`, `[2]` int32 dup tables (as the planner leaves them) on `device`."""
    int32 = dict(dtype=torch.int32, device=device)
    return SimpleNamespace(rows_per_rank=nvs, dup_groups=torch.zeros(nvs, 3, **int32),
                           dup_loffs=torch.zeros(nvs, **int32), dup_counts=torch.zeros(2, **int32))


def reference_dup_tables(pairs_p2: torch.Tensor, nvs: int) -> SimpleNamespace:
    """The dup tables the torch reference builds (on the CPU) from received duplicate pairs `[R*S*K, 2]`."""
    tables = empty_dup_tables(nvs, "cpu")
    ReferenceExchange(SimpleNamespace(dup_pairs=SimpleNamespace(local=pairs_p2.clone()))).record_duplicates(
        tables)
    return tables


@pytest.mark.oldest_triton
@pytest.mark.parametrize("constants", [None, (16, 8, 2)], ids=["default", "small"])
def test_record_duplicates_over_several_pair_programs_and_row_blocks(constants, monkeypatch):
    """`record_duplicates` with the pairs of several programs of its first launch (the last one partial),
    the rows of several row blocks (the last one partial) and row blocks past the end (the plan fills fewer
    rows than NvS); with small constants (`RECORD_SLOTS`, `RECORD_ROWS`, `RECORD_BLOCKS`) more blocks than
    one step of the earlier blocks' sum. Its tables equal the reference's, bit for bit, and it leaves the
    pairs all -1 and the marks all 0."""
    from moonep_moe.comm.kernels import rows

    if constants is not None:
        for name, value in zip(("RECORD_SLOTS", "RECORD_ROWS", "RECORD_BLOCKS"), constants, strict=True):
            monkeypatch.setattr(rows, name, value)
    R, K = 4, 3
    S = 2 * rows.RECORD_SLOTS // (R * K) + 1  # pairs for 3 programs
    end = 4 * rows.RECORD_ROWS + 5  # rows for 5 blocks
    nvs = end + 2 * rows.RECORD_ROWS + 3  # and 2 blocks past the end
    pairs_p2 = received_duplicates(R, S, K, end, torch.Generator().manual_seed(11))

    want = reference_dup_tables(pairs_p2, nvs)
    got, got_pairs_p2 = empty_dup_tables(nvs, KERNEL_DEVICE), pairs_p2.to(KERNEL_DEVICE)
    marks_nvs = torch.zeros(nvs, dtype=torch.int32, device=KERNEL_DEVICE)
    end_1 = torch.tensor([end], dtype=torch.int32, device=KERNEL_DEVICE)
    rows.record_duplicates(got_pairs_p2, marks_nvs, end_1, got.dup_groups, got.dup_loffs, got.dup_counts, K)
    for name in ("dup_groups", "dup_loffs", "dup_counts"):
        wrong = int((getattr(got, name).cpu() != getattr(want, name)).sum())
        assert wrong == 0, f"{wrong} {name} values differ (kernel vs reference)"
    assert bool((got_pairs_p2 == -1).all()), "every pair reset"
    assert not bool(marks_nvs.any()), "every mark reset"
    groups = int(want.dup_counts[0])
    blocks = set((want.dup_groups[:groups, 0] // rows.RECORD_ROWS).tolist())
    assert len(blocks) >= 4 and int(want.dup_counts[1]) > groups, "groups in most row blocks, some of 2+"


def bits(values: torch.Tensor) -> torch.Tensor:
    """`values` as same-width integers: equal bit for bit (-0.0 is not +0.0)."""
    return values.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()])


@pytest.mark.oldest_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=["bf16", "fp16", "fp32", "fp64"])
@pytest.mark.parametrize("structure", ["random", "every_route", "none"])
def test_combines_local_phase_copies_the_rows_and_sums_each_group_in_row_order(dtype, structure, monkeypatch):
    """Combine's local phase for expert outputs that are not the Buffer's rows (`copy_rows`, then
    `pre_reduce_duplicates`) leaves every row combine reads (the non-duplicate rows below the plan's end)
    bit for bit as a sequential torch sum of each group's rows in ascending row order from +0.0, from expert
    outputs of mixed magnitudes (fp32 sums that depend on their order), with a plain row and a whole group
    of -0.0; it writes no row past the end. Rows in every row dtype, summed in fp32 (float64 for float64
    rows); dup tables: random groups, every group K - 1 duplicates deep (skewed routing), none; rows of
    several blocks (a small `ROW_BLOCK_BYTES`, the last block partial), several rows per program in the
    interpreter."""
    from moonep_moe.comm.kernels import rows

    monkeypatch.setattr(rows, "ROW_BLOCK_BYTES", 64)
    accumulate = torch.promote_types(dtype, torch.float32)  # the Buffer's: fp32, float64 for float64 rows
    R, S, K, H, end = 2, 12, 4, 40, 110
    nvs = end + 37
    gen = torch.Generator().manual_seed(21)
    pairs_p2 = (torch.full((R * S * K, 2), -1, dtype=torch.int32) if structure == "none" else
                received_duplicates(R, S, K, end, gen, every_route=structure == "every_route"))
    tables = reference_dup_tables(pairs_p2, nvs)
    groups, duplicates = tables.dup_counts.tolist()
    source_nvsh = mixed((nvs, H), gen, 8).to(dtype)
    duplicate_v = torch.zeros(nvs, dtype=torch.bool)
    duplicate_v[tables.dup_loffs[:duplicates].long()] = True
    plain_v = ~duplicate_v
    plain_v[tables.dup_groups[:groups, 0].long()] = False
    plain_v[end:] = False
    source_nvsh[int(plain_v.nonzero()[0])] = -0.0
    if groups:
        primary, first, count = tables.dup_groups[0].tolist()
        source_nvsh[[primary, *tables.dup_loffs[first:first + count].tolist()]] = -0.0
    sentinel_nvsh = mixed((nvs, H), gen, 0).to(dtype)
    if structure == "every_route":
        assert bool((tables.dup_groups[:groups, 2] == K - 1).all()) and groups > 10
    elif structure == "random":
        assert set(tables.dup_groups[:groups, 2].tolist()) == set(range(1, K)), "groups of every depth"

    device = dict(device=KERNEL_DEVICE)
    source, end_1 = source_nvsh.to(**device), torch.tensor([end], dtype=torch.int32, **device)
    dup_tables = [t.to(**device) for t in (tables.dup_groups, tables.dup_loffs, tables.dup_counts)]
    want_nvsh = sentinel_nvsh.clone()
    want_nvsh[:end] = source_nvsh[:end]
    for primary, first, count in tables.dup_groups[:groups].tolist():
        total = torch.zeros(H, dtype=accumulate)
        for row in sorted([primary, *tables.dup_loffs[first:first + count].tolist()]):
            total = total + source_nvsh[row].to(accumulate)
        want_nvsh[primary] = total.to(dtype)
    got_nvsh = sentinel_nvsh.to(**device, copy=True)
    rows.copy_rows(got_nvsh, source, end_1)
    rows.pre_reduce_duplicates(got_nvsh, *dup_tables, K - 1, min(nvs // 2, R * S), accumulate)

    read_v = ~duplicate_v
    read_v[end:] = False
    got_nvsh = got_nvsh.cpu()
    wrong = int((bits(got_nvsh[read_v]) != bits(want_nvsh[read_v])).sum())
    assert wrong == 0, f"{wrong} values of the rows combine reads differ from the sequential sums"
    assert torch.equal(bits(got_nvsh[end:]), bits(sentinel_nvsh[end:])), "rows past the end"
    assert int(read_v.sum()) == end - duplicates


@pytest.mark.oldest_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_kernels_move_every_used_slot_whole_on_a_grid_smaller_than_their_accesses(dtype):
    """copy_experts, clear_slots and add_replicas deal the used slots' (or home experts') accesses over a
    grid sized for the device, not one program per access: slots of several accesses each, used ones between
    unused ones, more accesses than programs (4 on the CPU, 8 per SM on a GPU). Each used slot must come out
    whole, each unused one untouched (a sentinel), bit for bit."""
    from moonep_moe.comm.kernels import experts
    from moonep_moe.transport.world import SymmetricTensor

    gen = torch.Generator().manual_seed(3)
    block = experts.SLOT_BLOCK_BYTES // dtype.itemsize
    numel = (3 if KERNEL_DEVICE == "cpu" else 300) * block + 5  # several accesses, the last one partial
    ranks, epn, slots_used = 2, 3, [-1, 5, -1, -1, 2, 0]  # global experts; expert e lives on rank e // epn
    home = [mixed((epn, numel), gen, 4).to(dtype).to(KERNEL_DEVICE) for _ in range(ranks)]
    experts_b = torch.tensor(slots_used, dtype=torch.int32, device=KERNEL_DEVICE)
    sentinel_b = mixed((len(slots_used), numel), gen, 0).to(dtype).to(KERNEL_DEVICE)

    slots_b = sentinel_b.clone()
    experts.copy_experts(SymmetricTensor("home", 0, tuple(home)), slots_b, experts_b)
    for j, expert in enumerate(slots_used):
        want = sentinel_b[j] if expert < 0 else home[expert // epn][expert % epn]
        assert torch.equal(slots_b[j], want), f"copy_experts: slot {j} (expert {expert})"

    cleared_b = sentinel_b.clone()
    experts.clear_slots(cleared_b, experts_b)
    for j, expert in enumerate(slots_used):
        want = sentinel_b[j] if expert < 0 else torch.zeros_like(sentinel_b[j])
        assert torch.equal(cleared_b[j], want), f"clear_slots: slot {j} (expert {expert})"

    # replicas of rank 0's home experts: expert 2 in slot 4 of rank 1 and slot 1 of rank 0, expert 0 in slot
    # 5 of rank 1; expert 1 has none (its gradient must stay untouched)
    slots = [mixed((len(slots_used), numel), gen, 4).to(dtype).to(KERNEL_DEVICE) for _ in range(ranks)]
    num_slots = len(slots_used)
    sources_xr = torch.tensor([[1 * num_slots + 5, -1], [-1, -1], [0 * num_slots + 1, 1 * num_slots + 4]],
                              dtype=torch.int32, device=KERNEL_DEVICE)
    home_x = mixed((epn, numel), gen, 4).to(dtype).to(KERNEL_DEVICE)
    want_x = home_x.clone()
    for x, sources in enumerate(sources_xr.tolist()):  # each replica rounded to the home dtype, then added
        for source in sources:
            if source >= 0:
                replica = slots[source // num_slots][source % num_slots].to(dtype)
                want_x[x] = (want_x[x].float() + replica.float()).to(dtype)
    experts.add_replicas(home_x, SymmetricTensor("slots", 0, tuple(slots)), sources_xr)
    for x in range(epn):
        assert torch.equal(home_x[x], want_x[x]), f"add_replicas: home expert {x}"


# -- CPU: the interpreter ---------------------------------------------------------------------------------


@pytest.mark.interpreter
def test_auto_selection_and_forcing():
    cpu = single_world()
    assert not Step(R=1).buffer(cpu, kernels=None).uses_kernels, "the reference is the CPU default"
    assert Step(R=1).buffer(cpu, kernels=True).uses_kernels, "the interpreter runs them on CPU tensors"
    meta = single_world("meta")
    with pytest.raises(ValueError, match="kernels=True"):
        Step(R=1).buffer(meta, kernels=True)


@pytest.mark.interpreter
@pytest.mark.oldest_triton
def test_async_finish_off_cuda_returns_a_finished_event():
    step = Step(R=1)
    buf = step.buffer(single_world(), kernels=True)
    x = step.inputs(0)
    *_, plan, event = buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"], async_finish=True)
    assert event.event is None
    event.wait()


# -- GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_cuda_kernels_equal_reference(R, kind):
    step = Step(R=R, S=256, H=1024 + 128, K=8, E=64, tp=128, kind=kind, invalid=0.1, seed=R,
                tokens=tuple(256 - 17 * r for r in range(R)))
    assert_equal(step, both_paths(step, device="cuda"))


@pytest.mark.gpu
def test_cuda_kernels_equal_reference_on_every_repetition():
    """Two ranks, uniform routing (deep duplicate groups on both ranks, their kernels side by side on one
    GPU), 20 times against one reference: a kernel whose result depends on how its programs happen to be
    scheduled is wrong in some runs only, so one run is not enough to see it."""
    step = Step(R=2, S=256, H=1024 + 128, K=8, E=64, tp=128, kind="uniform", invalid=0.1, seed=2,
                tokens=(256, 239))
    reference = run_ranks(lambda world: run_step(step, world, kernels=False), step.R)
    for _ in range(20):
        kernels = run_ranks(lambda world: run_step(step, world, kernels=True), step.R, device="cuda")
        assert_equal(step, list(zip(kernels, reference, strict=True)))


@pytest.mark.gpu
def test_cuda_fp32_rows_equal_reference():
    step = Step(R=4, S=64, H=7168, K=8, E=32, tp=128, kind="skewed", dtype=torch.float32)
    assert_equal(step, both_paths(step, device="cuda"))


@pytest.mark.gpu
def test_cuda_one_rank_kernels_run_under_sync_debug_error():
    """A one-rank step on the kernels (every operation) under `set_sync_debug_mode("error")`, after a
    warm-up step that compiles the kernels."""
    step = Step(R=1, S=64, H=1024, K=4, E=8, tp=16, kind="skewed")
    world = single_world("cuda")
    operate(prepare(step, world, kernels=True, validate=False))
    state = prepare(step, world, kernels=True, validate=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = operate(state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_equal(step, [(result, run_step(step, single_world(), kernels=False))])


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
def test_cuda_async_finish_orders_on_the_comm_stream(kernels):
    """Every operation with `async_finish=True` (comm stream, priority -1) equals the synchronous result
    once the caller waits on its event; the inputs are produced by a long kernel on the caller's stream
    just before, so an operation that did not wait for the caller's stream would read stale inputs."""
    step = Step(R=2, S=128, H=2048, K=4, E=16, tp=32, kind="skewed")

    def fn(world):
        sync = step.buffer(world, kernels)
        asyn = step.buffer(world, kernels, comm_stream_priority=-1)
        x = {k: v.cuda() for k, v in step.inputs(world.rank).items()}
        rows, weights, _, plan = sync.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"])
        out, _, _ = sync.combine(plan, rows)
        slow = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            slow = slow @ slow / 64  # keeps the caller's stream busy
        hidden = x["hidden"] + slow[0, 0].to(x["hidden"].dtype) * 0
        *result, event = asyn.dispatch(hidden, x["weights"], x["topk"], x["tpe"], async_finish=True)
        event.wait()
        rows_a, weights_a, _, plan_a = result
        filled_nv = int(plan.cu_seqlens[-1])  # a copying dispatch leaves the rows past it unspecified
        assert torch.equal(plan_a.cu_seqlens, plan.cu_seqlens)
        assert torch.equal(rows_a[:filled_nv], rows[:filled_nv])
        assert torch.equal(weights_a[:filled_nv], weights[:filled_nv])
        out_a, _, event = asyn.combine(plan_a, rows_a, async_finish=True)
        assert event.event is not None
        event.wait()
        assert torch.equal(out_a, out)
        return True

    assert all(run_ranks(fn, step.R, device="cuda"))
