"""The threads world's failures: a rank that raises is named by `run_ranks` (its exception the cause)."""

from __future__ import annotations

import time

import pytest
import torch

from moonep_moe.comm.world import RankFailedError, ThreadGroup, run_ranks


def gather_times(world, times: int) -> list[torch.Tensor]:
    """`times` all-gathers of this rank's id (a loop, not a comprehension: its frame shows in messages)."""
    gathered = []
    for _ in range(times):
        gathered.append(world.all_gather(torch.tensor([world.rank])))
    return gathered


def timed_failure(fn, size: int, group: ThreadGroup | None = None) -> tuple[RankFailedError, float]:
    start = time.perf_counter()
    with pytest.raises(RankFailedError) as failure:
        run_ranks(fn, size, group=group)
    return failure.value, time.perf_counter() - start


def test_rank_that_raises_is_named_with_its_error_as_the_cause():
    def fn(world):
        gather_times(world, 1)
        if world.rank == 1:
            raise ValueError("rank 1 fails on purpose")
        gather_times(world, 1)

    error, _ = timed_failure(fn, 3)
    assert str(error) == "rank 1 failed: ValueError: rank 1 fails on purpose"
    assert isinstance(error.__cause__, ValueError), "the rank's own exception, not a peer's barrier error"


def test_every_rank_that_raised_is_listed():
    def fn(world):
        if world.rank > 0:
            raise KeyError(world.rank)
        gather_times(world, 1)

    error, _ = timed_failure(fn, 3)
    assert str(error) == "rank 1 failed: KeyError: 1 (ranks [2] failed too)"
