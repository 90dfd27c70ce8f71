"""The threads world's failures: named, never hung.

A rank that raises is named by `run_ranks` (its exception the cause); ranks that can no longer meet at a
barrier (one calls a collective more often than its peers, or waits for a peer stuck elsewhere) stop within
seconds with each rank's state, not after `BARRIER_TIMEOUT_S` with an empty `BrokenBarrierError`; ranks
that meet at a barrier in different operations stop at once, named with their operations.

The messages name ranks, their states and their operations; where a rank waits is also given as the
innermost functions of its stack, which wrappers (the stress mode's, tests/stress.py) change: the tests
check what the messages must say, with and without the stress mode's wrappers installed.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from stress import Stress
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


@pytest.fixture(params=["plain", "stress-wrapped"])
def entry_points(request):
    """The comm entry points as they are, and wrapped by the stress mode (on the CPU its wrappers delay
    nothing, but add their frames to every rank's stack, as `MOONEP_STRESS=1` does on a GPU)."""
    stress = Stress(cycles=1, sleep=lambda cycles: None).install() if request.param != "plain" else None
    yield
    if stress is not None:
        stress.uninstall()


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


def test_rank_gathering_once_more_than_its_peer_stops_at_once_naming_each_rank(entry_points):
    group = ThreadGroup(2)
    error, seconds = timed_failure(lambda world: gather_times(world, 3 - world.rank), 2, group)
    states = re.fullmatch(r"deadlock: every barrier needs all 2 ranks, and a rank that finished reaches "
                          r"none: rank 0 waits in barrier #7 of all_gather \(([^)]*)\); rank 1 finished "
                          r"after 6 barriers", str(error))
    assert states and "ThreadsWorld.all_gather" in states[1], str(error)
    assert seconds < 5, f"took {seconds:.1f} s"
    again = run_ranks(lambda world: gather_times(world, 2), 2, group=group)  # the group is usable again
    assert all(torch.equal(g, torch.tensor([[0], [1]])) for rank in again for g in rank)


def test_rank_calling_forward_once_more_than_its_peer_stops_at_once(entry_points):
    cfg = make_config(2)
    p = make_problem(cfg, seed=0)

    def fn(world):
        layer = MoonEPMoELayer(cfg, world)
        for _ in range(2 - world.rank):
            layer(p.hidden[world.rank])

    error, seconds = timed_failure(fn, 2)
    states = re.fullmatch(r"deadlock: .*: rank 0 waits in barrier #(\d+) of all_gather \([^)]*\); rank 1 "
                          r"finished after (\d+) barriers", str(error))
    assert states, str(error)
    waiting, finished = map(int, states.groups())
    assert waiting == finished + 1, "rank 0 waits in the first barrier of its second forward"
    assert seconds < 5, f"took {seconds:.1f} s"


def test_wait_past_the_timeout_lists_each_rank(monkeypatch, entry_points):
    """The last resort: rank 1 is busy elsewhere (not at a barrier, not finished) longer than the timeout."""
    monkeypatch.setattr(world_module, "BARRIER_TIMEOUT_S", 0.5)

    def fn(world):
        if world.rank == 1:
            time.sleep(1.5)
        gather_times(world, 1)

    error, _ = timed_failure(fn, 2)
    states = re.fullmatch(r"rank 0 waited 0\.5 s at a barrier: rank 0 waits in barrier #1 of all_gather "
                          r"\(([^)]*)\); rank 1 runs ([^;]*) after 0 barriers", str(error))
    assert states and "ThreadsWorld.all_gather" in states[1], str(error)
    assert states[2].startswith("test_wait_past_the_timeout_lists_each_rank.<locals>.fn"), str(error)


def post_stale_gather(world) -> torch.Tensor | None:
    """Both ranks gather once; then rank 0 gathers again while rank 1 calls three barriers of its own. Paired
    barrier by barrier, rank 0's second gather would return rank 1's first tensor, which is still on the
    board, as if rank 1 had posted it again."""
    world.all_gather(torch.tensor([world.rank]))
    if world.rank == 0:
        return world.all_gather(torch.tensor([10]))
    for _ in range(3):
        world.barrier()
    return None


def gather_against_scatter(world) -> None:
    target = world.symmetric("test/target", torch.zeros(4, 2))
    if world.rank == 0:
        world.all_gather(torch.zeros(2))
    else:
        world.scatter_rows(target, torch.tensor([0]), torch.tensor([1]), torch.ones(1, 2))


@pytest.mark.parametrize(("fn", "operations"), [
    (post_stale_gather, "rank 0 in all_gather; rank 1 in barrier"),
    (gather_against_scatter, "rank 0 in all_gather; rank 1 in scatter_rows"),
], ids=["gather-against-barriers", "gather-against-scatter"])
def test_ranks_in_different_operations_at_a_barrier_raise_naming_them(fn, operations):
    error, seconds = timed_failure(fn, 2)
    pattern = (rf"ranks met at barrier #\d+ in different operations: {operations} \(every rank must call "
               r"the same collective operations in the same order\)")
    assert re.fullmatch(pattern, str(error)), str(error)
    assert seconds < 5, f"took {seconds:.1f} s"
