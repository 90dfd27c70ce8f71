"""The threads world's failures: named, never hung.

A rank that raises is named by `run_ranks` (its exception the cause); ranks that can no longer meet at a
barrier (one calls a collective more often than its peers, or waits for a peer stuck elsewhere) stop within
seconds with each rank's state, not after `BARRIER_TIMEOUT_S` with an empty `BrokenBarrierError`.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from test_layer import make_config, make_problem

from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport import threads as world_module
from moonep_moe.transport.threads import ThreadGroup, run_ranks
from moonep_moe.transport.world import RankFailedError

TIMEOUT_S = 20.0
"""The barrier timeout while these tests run: a hang the group fails to detect fails the test this late."""


@pytest.fixture(autouse=True)
def bounded_barriers(monkeypatch):
    monkeypatch.setattr(world_module, "BARRIER_TIMEOUT_S", TIMEOUT_S)


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


def test_rank_gathering_once_more_than_its_peer_stops_at_once_naming_each_rank():
    group = ThreadGroup(2)
    error, seconds = timed_failure(lambda world: gather_times(world, 3 - world.rank), 2, group)
    assert str(error) == (
        "deadlock: every barrier needs all 2 ranks, and a rank that finished reaches none: rank 0 waits in "
        "barrier #7 (ThreadsWorld.all_gather <- gather_times); rank 1 finished after 6 barriers")
    assert seconds < 5, f"took {seconds:.1f} s"
    again = run_ranks(lambda world: gather_times(world, 2), 2, group=group)  # the group is usable again
    assert all(torch.equal(g, torch.tensor([[0], [1]])) for rank in again for g in rank)


def test_rank_calling_forward_once_more_than_its_peer_stops_at_once():
    cfg = make_config(2)
    p = make_problem(cfg, seed=0)

    def fn(world):
        layer = MoonEPMoELayer(cfg, world)
        for _ in range(2 - world.rank):
            layer(p.hidden[world.rank])

    error, seconds = timed_failure(fn, 2)
    states = re.fullmatch(r"deadlock: .*: rank 0 waits in barrier #(\d+) \(ThreadsWorld\.all_gather <- "
                          r"Buffer\._dispatch\.<locals>\.op\); rank 1 finished after (\d+) barriers",
                          str(error))
    assert states, str(error)
    waiting, finished = map(int, states.groups())
    assert waiting == finished + 1, "rank 0 waits in the first barrier of its second forward"
    assert seconds < 5, f"took {seconds:.1f} s"


def test_wait_past_the_timeout_lists_each_rank(monkeypatch):
    """The last resort: rank 1 is busy elsewhere (not at a barrier, not finished) longer than the timeout."""
    monkeypatch.setattr(world_module, "BARRIER_TIMEOUT_S", 0.5)

    def fn(world):
        if world.rank == 1:
            time.sleep(1.5)
        gather_times(world, 1)

    error, _ = timed_failure(fn, 2)
    assert str(error) == (
        "rank 0 waited 0.5 s at a barrier: rank 0 waits in barrier #1 (ThreadsWorld.all_gather <- "
        "gather_times); rank 1 runs test_wait_past_the_timeout_lists_each_rank.<locals>.fn <- "
        "run_ranks.<locals>.body after 0 barriers")
