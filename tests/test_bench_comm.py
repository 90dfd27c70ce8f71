"""The helpers of bench/comm.py: skewed routing hits its maxvio, byte counts and timings add up by hand."""

import pytest
import torch

from bench.comm import collective_seconds, expert_skew, hottest_offsets, op_bytes, skewed_routes
from moonep_moe.base.sizes import rows_capacity
from moonep_moe.plan.planner import plan_routes

CPU = torch.device("cpu")


def test_skewed_routes_hit_their_maxvio():
    tokens, experts, top_k = 8192, 64, 2  # mean load 256: maxvio moves in steps of 1/256
    targets = [0.0, 0.5, 1.0, 10.0, 20.0]
    routes = skewed_routes(targets, tokens, experts, top_k, seed=3, device=CPU)
    for target, (sigma, topk_tk) in zip(targets, routes, strict=True):
        assert topk_tk.shape == (tokens, top_k)
        assert (topk_tk.sort(1).values.diff(dim=1) > 0).all(), "a token's experts must be distinct"
        assert expert_skew(topk_tk, experts) == pytest.approx(target, abs=2 / 256)
        assert (sigma is None) == (target == 0)
    again = skewed_routes(targets, tokens, experts, top_k, seed=3, device=CPU)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(routes, again, strict=True)), "seeded"
    with pytest.raises(ValueError, match="out of reach"):
        skewed_routes([40.0], tokens, experts, top_k, seed=3, device=CPU)  # at most E/K - 1 = 31


def plans(topk_rsk: list[list[list[int]]], num_experts: int, num_slots: int) -> list:
    """Every rank's plan of a tiny step (token padding 1)."""
    topk = [torch.tensor(t) for t in topk_rsk]
    counts_re = torch.stack([torch.bincount(t.reshape(-1), minlength=num_experts) for t in topk])
    S, K = topk[0].shape
    NvS = rows_capacity(S, K, len(topk), num_experts, num_slots, 1)
    return [plan_routes(counts_re, t, rank=r, num_slots=num_slots, token_padding=1, rows_per_rank=NvS)
            for r, t in enumerate(topk)]


def test_op_bytes_balanced_step_by_hand():
    # R=2, E=4 (rank 0 homes experts 0, 1; rank 1 experts 2, 3), S=2, K=2: every rank computes 4 routes
    plans_r = plans([[[0, 2], [1, 3]], [[0, 1], [2, 3]]], num_experts=4, num_slots=2)
    assert (plans_r[0].experts_to_copy == -1).all()
    H = 8
    # payload rows: rank 0's tokens visit both ranks (2 + 2), rank 1's one rank each (1 + 1) -> 6 rows,
    # 8 route weights, 2 duplicate routes (rank 1's second routes)
    assert op_bytes(plans_r, H, {"prefetch": 10, "reduce_grad": 6}) == {
        "plan": 2 * 2 * 4 * 8, "dispatch_fwd": 6 * H * 2 + 8 * 4 + 2 * 4, "dispatch": 6 * H * 2 + 8 * 4,
        "combine": 6 * H * 2, "prefetch": 0, "reduce_grad": 0}


def test_op_bytes_and_hottest_rank_of_a_replicated_step_by_hand():
    # every token of both ranks routes to experts 0 and 1 (rank 0's): rank 1 computes expert 0 from a slot
    plans_r = plans([[[0, 1], [0, 1]], [[0, 1], [0, 1]]], num_experts=4, num_slots=2)
    assert plans_r[0].experts_to_copy.tolist() == [[-1, -1], [0, -1]]
    H = 8
    # each of the 4 tokens sends one row to each rank (expert 1 on rank 0, expert 0 on rank 1); one slot
    assert op_bytes(plans_r, H, {"prefetch": 10, "reduce_grad": 6}) == {
        "plan": 2 * 2 * 4 * 8, "dispatch_fwd": 8 * H * 2 + 8 * 4, "dispatch": 8 * H * 2 + 8 * 4,
        "combine": 8 * H * 2, "prefetch": 1 * 10 * 2, "reduce_grad": 1 * 6 * 4}
    hottest = hottest_offsets(plans_r, token_padding=1)
    assert int(hottest["moonep"][-1]) == 4  # 4 routes on either rank
    assert hottest["plain_ep"].tolist() == [4, 8]  # rank 0 keeps all 8


def test_collective_seconds_spans_first_start_to_last_end():
    stamps_ri = [[(0.0, 1.0), (10.0, 10.5)],  # rank 0: two runs of (start, end)
                 [(0.1, 2.0), (10.2, 10.4)]]  # rank 1
    assert collective_seconds(stamps_ri) == pytest.approx((2.0 + 0.5) / 2)
