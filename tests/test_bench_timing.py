"""bench/common.py's timing with the host ahead (`HostAhead`, `queued_timings`): the GPU is held long enough
for the host to queue each run, the hold follows the slowest host so far, and a run the host fell behind
is counted; on the CPU the host clock times the run and nothing is held."""

import time
from types import SimpleNamespace

import pytest
import torch

import bench.common as common
from bench.common import SLEEP_CYCLES_PER_S, HostAhead, queued_timings


def test_cpu_runs_are_timed_by_the_host_clock_with_no_hold():
    calls = []

    def run():
        calls.append(1)
        time.sleep(0.002)

    times, ahead = queued_timings(run, warmup=2, repeat=3, device="cpu")
    assert len(calls) == 5 and len(times) == 3 and min(times) >= 0.002
    assert len(ahead.host_s) == 3 and ahead.behind == 0
    assert ahead.describe()["hold_ms"] == 0.0 and ahead.describe()["host_ms"] >= 2.0


def test_the_hold_grows_past_the_slowest_host_and_counts_runs_it_fell_behind(monkeypatch):
    """The host's enqueue times come from a stand-in clock, so a loaded machine cannot stretch them."""
    hosts_s = (0.001, 0.010, 0.001, 0.001, 0.001)
    slept, clock = [], iter(range(1000))
    host_clock = iter(t for host_s in hosts_s for t in (0.0, host_s))  # each run's start, then its end
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    monkeypatch.setattr(common, "stamp", lambda device: float(next(clock)))
    monkeypatch.setattr(common, "time", SimpleNamespace(perf_counter=lambda: next(host_clock)))
    ahead = HostAhead(torch.device("cuda"), min_hold_s=0.004, margin=2.0, window=2)
    for _ in hosts_s:
        ahead.start()
        ahead.end()
    assert slept[0] == int(0.004 * SLEEP_CYCLES_PER_S)  # the first run: the minimum hold
    assert slept[1] == slept[0]  # a 1 ms host stays inside it
    assert slept[2] >= int(2 * 0.010 * SLEEP_CYCLES_PER_S)  # after a 10 ms host: twice that
    assert slept[3] >= int(2 * 0.010 * SLEEP_CYCLES_PER_S)  # still within the window of 2 runs
    assert slept[4] < int(0.010 * SLEEP_CYCLES_PER_S), "the slow run left the window: the hold shrinks"
    assert ahead.behind == 1 and ahead.held_s[1] == 0.004
    ahead.forget()
    assert ahead.behind == 0 and ahead.host_s == [] and ahead.hold_s >= 0.004


def test_a_run_with_a_host_sync_stops_the_hold_at_its_maximum(monkeypatch):
    """A host sync makes the host wait out the hold and the GPU's work: the hold must not chase it."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(common, "stamp", lambda device: 0.0)
    ahead = HostAhead(torch.device("cuda"), min_hold_s=0.004, max_hold_s=0.02, margin=2.0)
    for _ in range(4):
        ahead.start()
        time.sleep(ahead.hold_s + 0.005)  # as a synced run: the hold, then the work
        ahead.end()
    assert ahead.hold_s == 0.02 and ahead.behind == 4


@pytest.mark.gpu
def test_on_the_gpu_a_queued_run_of_small_launches_skips_their_host_latency():
    x = torch.zeros(16, device="cuda")

    def launches():
        for _ in range(400):
            x.add_(1)

    queued, ahead = queued_timings(launches, warmup=2, repeat=5)
    synced = common.timings(launches, warmup=2, repeat=5)
    assert ahead.behind == 0
    # synced, the GPU waits on each launch's host latency; queued, it runs the kernels back to back
    assert sorted(queued)[2] < 0.8 * sorted(synced)[2]
