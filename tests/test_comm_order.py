"""The order of the Buffer's fp32 sums, on both implementations, where the order changes the result.

`test_comm_kernels` compares the row kernels with the torch reference bit for bit, but a sum of two terms
is the same in either order and bf16 rounding hides most reorderings of three: a change of order in the
kernels, in the reference, or in both, could pass it. Here rows are float32, expert outputs and gradients
span 2^+-24 (so a reordered sum differs: each test checks that it does), and the routing is built so that
tokens have three primary routes on distinct ranks plus duplicates, and one expert has two replicas whose
(slot, rank) order is not their rank order. The kernels (`kernels=True`: compiled on a GPU, Triton's
interpreter on the CPU) must equal the reference, and both must equal the order DESIGN.md defines,
written out here from the inputs:

- combine: every token's K rows summed in fp32 in k order, each primary route carrying its duplicate
  group (its own row and its duplicates' rows on the same rank) pre-reduced in fp32 in ascending row order;
- reduce_grad: each home expert's gradient plus its replicas' slot gradients in (slot, rank) order.

A bound on the dup tables (`Buffer._max_dup_groups`, `min(NvS // 2, R * S)`) sizes the kernels' loops over
duplicate groups: a routing that fills it exactly, where `NvS // 2` is the smaller term as at production
shapes (S=4096, K=8, R=8), checks that no group is skipped.
"""

from __future__ import annotations

import pytest
import torch
from test_comm_kernels import KERNEL_DEVICE, Step, assert_equal, operate, prepare

from moonep_moe.plan.types import decode_dst
from moonep_moe.transport.threads import run_ranks

ORDER_HISTOGRAM = (
    # rank 0's experts        rank 1's        rank 2's        rank 3's
    (3, 8, 3, 2, 1, 0, 1, 0, 1, 1, 0, 0, 2, 2, 1, 1),
    (3, 4, 2, 1, 4, 3, 2, 0, 0, 1, 0, 0, 1, 2, 1, 2),
    (1, 8, 2, 3, 1, 0, 0, 1, 0, 1, 2, 0, 2, 0, 2, 1),
    (2, 6, 2, 2, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2),
)
"""Routes from each of 4 ranks (8 tokens, K=4) to each of 16 experts: 96 routes, 24 per rank. Home loads
(52, 14, 7, 23): rank 2 takes 17 routes of the hottest expert 1 (26) into slot 0; rank 1 all 9 of expert
0, then 1 of expert 1 (slots 0 and 1: ascending id); rank 3 1 of expert 2. So expert 1's replicas come in
(slot, rank) order rank 2 then rank 1. Dealt round robin, most tokens reach three ranks, and rank 1's
tokens 0-2 send expert 0 (rank 1's slot 0) and, at later k, two of rank 1's home experts (lower rows):
duplicate groups whose primary row comes after both duplicates."""

ORDER_STEP = Step(R=4, S=8, H=8, K=4, E=16, tp=2, dtype=torch.float32, histogram=ORDER_HISTOGRAM, spread=24)


def run_path(step: Step, kernels: bool, device: str = "cpu") -> list[tuple[dict, dict]]:
    """Every rank's (inputs it was given, results of `operate`) on one implementation."""

    def fn(world):
        state = prepare(step, world, kernels)
        copy = lambda tensor: tensor.detach().to("cpu", copy=True)
        given = dict(expert_out=copy(state["expert_out"]), full=copy(state["full"]),
                     grads=[(copy(g.home.local), copy(g.slots.local)) for g in state["grads"]])
        result = operate(state)  # updates the gradients in place
        return given, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()}

    return run_ranks(fn, step.R, device=device)


def both_paths_with_inputs(step: Step) -> tuple[list[dict], list[dict], list[dict]]:
    """(inputs, kernel results, reference results) per rank; the kernels on `KERNEL_DEVICE`, the reference
    on the CPU from the same inputs, compared bit for bit (every output and state left behind)."""
    kernels = run_path(step, True, KERNEL_DEVICE)
    reference = run_path(step, False)
    assert_equal(step, [(k, r) for (_, k), (_, r) in zip(kernels, reference, strict=True)])
    return [g for g, _ in reference], [k for _, k in kernels], [r for _, r in reference]


def duplicates_before_primary(result: dict) -> int:
    """The most duplicate rows below their primary row in one duplicate group of a rank."""
    groups, loffs = result["dup_groups"], result["dup_loffs"]
    return max((sum(int(loffs[first + i]) < primary for i in range(count))
                for primary, first, count in groups[:int(result["dup_counts"][0])].tolist()), default=0)


def combine_in_order(step: Step, inputs: list[dict], results: list[dict], rank: int, reverse_k: bool = False,
                     reverse_rows: bool = False) -> torch.Tensor:
    """`[S, H]` what `combine(plan, expert_out)` of `rank` must return, in the order DESIGN.md defines
    (`reverse_*`: the same sum in another order, to show that order matters)."""
    NvS, K = results[rank]["rows"].shape[0], step.K
    dest_n, row_n, primary_n, valid_n = decode_dst(results[rank]["dst"], NvS)
    out_sh = torch.zeros(step.S, step.H)
    for token in range(step.S):
        routes = range(token * K, (token + 1) * K)
        for n in reversed(routes) if reverse_k else routes:
            if not (valid_n[n] and primary_n[n]):
                out_sh[token] += 0.0  # duplicates and invalid routes add a zero row
                continue
            dest = int(dest_n[n])
            group = sorted(int(row_n[m]) for m in routes if valid_n[m] and int(dest_n[m]) == dest)
            rows = inputs[dest]["expert_out"]
            group_h = torch.zeros(step.H)
            for row in reversed(group) if reverse_rows else group:
                group_h += rows[row]
            out_sh[token] += group_h
    return out_sh


def replicas_added(home: torch.Tensor, slots: list[torch.Tensor], experts_to_copy: torch.Tensor, rank: int,
                   rank_major: bool = False) -> torch.Tensor:
    """`rank`'s home gradients `[epn, ...]` plus every replica of its experts, `slots[d][j]` for slot j of
    rank d, added in (slot, rank) order (`rank_major`: (rank, slot), to show that order matters)."""
    num_ranks, num_slots = experts_to_copy.shape
    epn = home.shape[0]
    pairs = [(d, j) for d in range(num_ranks) for j in range(num_slots)]
    out = home.clone()
    for d, j in pairs if rank_major else sorted(pairs, key=lambda pair: pair[::-1]):
        expert = int(experts_to_copy[d, j])
        if expert >= 0 and expert // epn == rank:
            out[expert % epn] += slots[d][j]
    return out


@pytest.fixture(scope="module")
def order_step_paths() -> tuple[list[dict], list[dict], list[dict]]:
    """`both_paths_with_inputs(ORDER_STEP)`, run once for the two order tests: each reads the same step's
    inputs and results (combine's for one, reduce_grad's for the other) and changes none of them."""
    return both_paths_with_inputs(ORDER_STEP)


def test_combine_sums_in_k_order_and_duplicates_in_row_order(order_step_paths):
    step = ORDER_STEP
    inputs, kernels, reference = order_step_paths
    primaries = torch.stack([decode_dst(r["dst"], r["rows"].shape[0])[2].view(step.S, step.K).sum(1)
                             for r in reference])
    assert int(primaries.max()) >= 3, "some token must have three primary routes (order matters from 3 terms)"
    assert max(map(duplicates_before_primary, reference)) >= 2, \
        "a duplicate group must have its primary row after two duplicates (where moving it matters)"
    reordered = {"reverse_k": False, "reverse_rows": False}
    for rank in range(step.R):
        want = combine_in_order(step, inputs, reference, rank)
        for order in reordered:
            other = combine_in_order(step, inputs, reference, rank, **{order: True})
            reordered[order] |= not torch.equal(want, other)
        for path, results in (("kernels", kernels), ("reference", reference)):
            wrong = int((results[rank]["combined"] != want).sum())
            assert wrong == 0, f"{path}, rank {rank}: {wrong} combine values differ from the defined order"
    assert all(reordered.values()), f"the values must make both orders visible: {reordered}"


def given_gradients(step: Step, given: dict, key: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(home `[epn, ...]`, slots `[B, ...]`) that `rank` passed to the `reduce_grad` whose home gradients
    `operate` returns under `key` (the full `[E+B, ...]` form: its home rows and its rows E..)."""
    if key == "full_grad":
        return given["full"][rank * step.epn:(rank + 1) * step.epn], given["full"][step.E:]
    return given["grads"][int(key[-1])]


def test_reduce_grad_adds_replicas_in_slot_then_rank_order(order_step_paths):
    step = ORDER_STEP
    inputs, kernels, reference = order_step_paths
    experts_to_copy = reference[0]["experts_to_copy"]
    replicas = [[(j, d) for d in range(step.R) for j in range(step.epn) if int(experts_to_copy[d, j]) == e]
                for e in range(step.E)]
    assert any(len(r) >= 2 and sorted(r) != sorted(r, key=lambda s: s[::-1]) for r in replicas), \
        "an expert must have replicas whose (slot, rank) order is not their rank order"
    reordered = dict.fromkeys(("home_grad0", "home_grad1", "full_grad"), False)
    for key in reordered:
        slots = [given_gradients(step, given, key, rank)[1] for rank, given in enumerate(inputs)]
        for rank in range(step.R):
            home = given_gradients(step, inputs[rank], key, rank)[0]
            want = replicas_added(home, slots, experts_to_copy, rank)
            other = replicas_added(home, slots, experts_to_copy, rank, rank_major=True)
            reordered[key] |= not torch.equal(want, other)
            for path, results in (("kernels", kernels), ("reference", reference)):
                got = results[rank][key]
                got = got[rank * step.epn:(rank + 1) * step.epn] if key == "full_grad" else got
                wrong = int((got != want).sum())
                assert wrong == 0, f"{path}, rank {rank}: {wrong} {key} values not in (slot, rank) order"
    assert all(reordered.values()), f"the values must make the order of the replicas visible: {reordered}"


@pytest.mark.parametrize("tp", [1, 2])
def test_dup_groups_fill_the_bound_where_rows_decide_it(tp):
    """Rank r's 4 tokens each pick both experts of rank r + 1 (E=8, K=2): every rank receives 4 duplicate
    groups of 2 rows. With S=4, R=4, tp=1 the bound `min(NvS // 2, R * S)` is `NvS // 2 = 4`, exactly the
    groups received: a smaller bound leaves groups unexpanded in dispatch and unreduced in combine (tp=2:
    NvS // 2 = 6, groups above half of it)."""
    R, S, E = 4, 4, 8
    histogram = tuple(tuple(S if e // 2 == (r + 1) % R else 0 for e in range(E)) for r in range(R))
    step = Step(R=R, S=S, H=8, K=2, E=E, tp=tp, dtype=torch.float32, histogram=histogram, spread=24)
    inputs, kernels, reference = both_paths_with_inputs(step)
    for rank, result in enumerate(reference):
        NvS = result["rows"].shape[0]
        assert NvS // 2 < R * S and int(result["dup_counts"][0]) > NvS // 4, (rank, NvS, result["dup_counts"])
        want = combine_in_order(step, inputs, reference, rank)
        for path, results in (("kernels", kernels), ("reference", reference)):
            assert torch.equal(results[rank]["combined"], want), f"{path}, rank {rank}: combine"
