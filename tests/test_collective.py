"""The collective EP world with real processes: gloo, 2 and 4 processes on the CPU.

Each process is one EP rank running the unchanged layer through `CollectiveWorld` (static-shape mode and
exact-size mode). Every rank's plan must equal the threads world's bit for bit, its outputs and gradients
must equal the threads world's and match the dense float64 reference. A rank that fails, and ranks that
disagree on the config, must give a clear error naming the rank, not a hang.

Spawning is slow (each process imports torch), so one spawned run per group size carries every check, in a
module-scoped fixture; results come back through files. Every wait is bounded.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import spawn_ranks
from test_layer import TOL, make_config, make_problem, rank_step, run_dense, run_moonep

from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.collective import (
    HEARTBEAT_S,
    CollectiveWorld,
    Heartbeat,
    collective_world,
    fail_fast,
    init_collective,
)
from moonep_moe.transport.world import RankFailedError

COLLECTIVE_TIMEOUT_S = 30.0
"""The process groups' timeout: longer than any check here, far shorter than the run's bound."""
RUN_TIMEOUT_S = 120.0
"""A spawned run that takes longer fails the test (and its processes are killed)."""
SKEWED = 100.0

# (name, problem arguments, config overrides, exact_size); run on every group size
CASES = [
    ("uniform", dict(seed=1), {}, False),
    ("skewed", dict(seed=2, skew=SKEWED), {}, False),
    ("skewed-exact", dict(seed=2, skew=SKEWED), {}, True),
    ("padding-exact", dict(seed=3, skew=3.0, tokens=35, padding=7), {}, True),
    ("no-replicas", dict(seed=4, skew=SKEWED), dict(num_prefetch_slots=0), False),
]


def problem(R: int, args: dict, overrides: dict):
    return make_problem(make_config(R, **overrides), **args)


# -- what runs in the spawned processes ---------------------------------------------------------------------


def checks_job(world: CollectiveWorld) -> dict:
    """Every case through the layer, then a layer built from `world="collective"` alone, then ranks that
    disagree on the config (every rank must raise, naming rank 1), then a rank that fails (rank 1 raises
    before a step; rank 0, inside the step, must get `RankFailedError` naming it within seconds)."""
    results: dict = {}
    for name, args, overrides, exact_size in CASES:
        case_world = collective_world(None, exact_size=True) if exact_size else world
        results[name] = rank_step(problem(world.size, args, overrides), case_world)
    layer = MoonEPMoELayer(make_config(world.size, world="collective"))
    results["default_world"] = layer.world is world
    cfg = make_config(world.size, top_k=3 if world.rank == 1 else 2)
    try:
        MoonEPMoELayer(cfg, world)
    except ValueError as error:
        results["mismatch"] = str(error)
    p = problem(world.size, dict(seed=5), {})
    layer = MoonEPMoELayer(p.cfg, world)
    start = time.perf_counter()
    try:
        with fail_fast():
            if world.rank == 1:
                raise ValueError("rank 1 fails on purpose")
            layer(p.hidden[0])
    except RankFailedError as error:
        results["failure"] = (str(error), time.perf_counter() - start)
    except ValueError as error:
        results["failure"] = (f"own: {error}", time.perf_counter() - start)
    return results


def dying_job(world: CollectiveWorld, dying: int) -> dict:
    """One step on every rank, then rank `dying` exits without raising (`os._exit(1)`, as a crash or a kill
    would); the others, in their next step, must raise `RankFailedError` naming it, within seconds."""
    p = problem(world.size, dict(seed=6), dict(num_experts=30))  # E divisible by 3 ranks
    layer = MoonEPMoELayer(p.cfg, world)
    start = time.perf_counter()
    try:
        with fail_fast():
            layer(p.hidden[world.rank])
            if world.rank == dying:
                os._exit(1)
            start = time.perf_counter()
            layer(p.hidden[world.rank])
    except RankFailedError as error:
        return {"failure": (str(error), time.perf_counter() - start)}
    return {"failure": None}


SLOW_S = 5.0
"""How long the slow rank of `slow_and_dying_job` computes before its next step: well past the 2 s after
which a rank that neither reported nor showed a heartbeat counts as stopped."""


def slow_and_dying_job(world: CollectiveWorld, **fail_fast_args) -> dict:
    """One step on every rank; then rank 1 exits without raising while rank 2, alive, computes for `SLOW_S`
    (in Python, holding the interpreter between switches) before its next step, and rank 0 goes straight
    into its next step, whose collective fails when rank 1's connection closes."""
    p = problem(world.size, dict(seed=6), dict(num_experts=30))  # E divisible by 3 ranks
    layer = MoonEPMoELayer(p.cfg, world)
    start = time.perf_counter()
    try:
        with fail_fast(**fail_fast_args):
            layer(p.hidden[world.rank])
            if world.rank == 1:
                os._exit(1)
            start = time.perf_counter()
            while world.rank == 2 and time.perf_counter() < start + SLOW_S:
                pass
            layer(p.hidden[world.rank])
    except RankFailedError as error:
        return {"failure": (str(error), time.perf_counter() - start)}
    return {"failure": None}


def rank_main(job: Callable, rank: int, size: int, folder: str, init_method: str | None = None) -> None:
    """One spawned rank: join the gloo group (`init_method`, default a file store in `folder`), run
    `job(world)`, save its result or error."""
    torch.set_num_threads(1)
    try:
        world = init_collective("gloo", init_method=init_method or f"file://{folder}/store", rank=rank,
                                world_size=size, timeout_s=COLLECTIVE_TIMEOUT_S)
        result = job(world)
    except BaseException:  # noqa: B036 - reported to the parent, which fails the test
        result = {"error": traceback.format_exc()}
    torch.save(result, f"{folder}/rank{rank}.pt")


def spawn(job: Callable, size: int, folder: Path, dying: tuple[int, ...] = (),
          init_method: str | None = None) -> list[dict | None]:
    """`job` on `size` gloo processes (joined through `init_method`, as `rank_main`); their results in rank
    order (None for the `dying` ranks, which must exit without one). Fails on any error or past the bound."""
    main = functools.partial(rank_main, init_method=init_method)
    return spawn_ranks(main, job, size, folder, RUN_TIMEOUT_S, dying)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-processes", "4-processes"])
def group_run(request, tmp_path_factory) -> tuple[int, list[dict]]:
    size = request.param
    return size, spawn(checks_job, size, tmp_path_factory.mktemp(f"collective{size}"))


# -- checks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_plan_and_results_as_threads_and_dense(group_run, case):
    size, results = group_run
    name, args, overrides, _ = case
    p = problem(size, args, overrides)
    threads = run_moonep(p)
    want, grad_gate_up, grad_down, maxvio = run_dense(p)
    epn = p.cfg.num_experts // size
    for rank, (got, ref, dense) in enumerate(zip((r[name] for r in results), threads, want, strict=True)):
        assert got.keys() == ref.keys()
        for key in got:  # the plan bit for bit, outputs, gradients and stats exactly
            assert torch.equal(got[key], ref[key]), f"{name}: {key} on rank {rank} differs from threads"
        for key in ("out", "grad_x", "grad_router"):
            torch.testing.assert_close(got[key], dense[key], **TOL)
        home = slice(rank * epn, (rank + 1) * epn)
        torch.testing.assert_close(got["grad_gate_up"], grad_gate_up[home], **TOL)
        torch.testing.assert_close(got["grad_down"], grad_down[home], **TOL)
    if args.get("skew") == SKEWED:
        assert maxvio >= 5 and int(results[0][name]["slots_used"].sum()) > 0 or not p.cfg.prefetch_slots
    if p.cfg.prefetch_slots:
        load_r = results[0][name]["rank_load"]
        assert int(load_r.max() - load_r.min()) <= 1


def test_collective_config_builds_the_default_group_world(group_run):
    assert all(r["default_world"] for r in group_run[1])


def test_ranks_disagreeing_on_the_config_raise_naming_them(group_run):
    for r in group_run[1]:
        assert "MoEConfig differs" in r["mismatch"] and "rank(s) [1]" in r["mismatch"], r["mismatch"]


def test_failing_rank_stops_the_group_with_its_name(group_run):
    size, results = group_run
    assert results[1]["failure"][0] == "own: rank 1 fails on purpose"
    for rank in [0, *range(2, size)]:
        message, seconds = results[rank]["failure"]
        assert message == "rank 1 failed: ValueError: rank 1 fails on purpose", message
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s to learn of the failure"


STOPPED = (r"rank 1 stopped without raising an error \(it exited or was killed: no report and no heartbeat "
           r"for 2 s\)")
WAITED = r" while rank [02] waited in torch\.distributed\.\w+ \(CollectiveWorld\.\w+ <- .*\)"


def test_rank_that_dies_is_named_by_its_peers(tmp_path):
    """Three processes, so that two peers must agree on whom to blame (not on each other)."""
    results = spawn(functools.partial(dying_job, dying=1), 3, tmp_path, dying=(1,))
    (message, _), (other, _) = results[0]["failure"], results[2]["failure"]
    assert message == other, "every peer raises the same message"
    assert re.fullmatch(STOPPED + WAITED, message), message
    for rank in (0, 2):
        seconds = results[rank]["failure"][1]
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s to learn of the failure"


@pytest.mark.parametrize(("fail_fast_args", "blamed"), [
    ({}, ""),
    ({"timeout_s": 1.0}, r"; rank 2 is alive \(its heartbeat runs\) but did not report within 2 s \(slow, or "
                         r"stuck outside torch\.distributed\)"),
], ids=["default-timeout", "timeout-1s"])
def test_rank_that_is_slow_but_alive_is_not_named_as_stopped(tmp_path, fail_fast_args, blamed):
    """Rank 1 dies while rank 2 is busy for `SLOW_S`: rank 0, whose collective fails at once, waits for the
    live rank 2 to report (its heartbeat runs), and names only rank 1; given a timeout shorter than rank 2's
    computation, it names rank 2 as alive but silent after at least the 2 s that tell the dead apart."""
    job = functools.partial(slow_and_dying_job, **fail_fast_args)
    results = spawn(job, 3, tmp_path, dying=(1,))
    (message, seconds), (other, _) = results[0]["failure"], results[2]["failure"]
    assert message == other, "every peer raises the same message"
    assert re.fullmatch(STOPPED + blamed + WAITED, message), message
    limit = 4 if blamed else SLOW_S + 5
    assert seconds < limit, f"rank 0 took {seconds:.1f} s to learn of the failure"


def test_rank_hosting_the_store_that_dies_is_named(tmp_path):
    """With `tcp://`, rank 0 serves the store: when it dies its peer cannot report there, and says so."""
    results = spawn(functools.partial(dying_job, dying=0), 2, tmp_path, dying=(0,),
                    init_method=f"tcp://127.0.0.1:{free_port()}")
    message, seconds = results[1]["failure"]
    pattern = (r"rank 0 \(or the launcher serving the store\) stopped: the process group's store is "
               r"unreachable \(\w+: .*\) and rank 1's collective failed \(RuntimeError: .*\)")
    assert re.fullmatch(pattern, message), message
    assert seconds < 10, f"rank 1 took {seconds:.1f} s to learn of the failure"


# -- in this process ----------------------------------------------------------------------------------------


class SlowStore(dist.Store):
    """A store whose `check` takes `seconds` (a loaded store host), recording when a request is in flight."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.in_flight = seconds, threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.in_flight.set()
        time.sleep(self.seconds)
        self.in_flight.clear()
        return False


def test_heartbeat_stop_waits_for_a_store_request_in_flight():
    """A heartbeat thread still inside a store request when the interpreter exits aborts the process
    ("terminate called without an active exception"), so `stop` returns only after the request, here one
    that takes several heartbeat periods."""
    store = SlowStore(seconds=8 * HEARTBEAT_S)
    heartbeat = Heartbeat(store, rank=0)
    heartbeat._thread.start()
    assert store.in_flight.wait(timeout=10), "the heartbeat thread never asked the store"
    heartbeat.stop()
    assert not heartbeat._thread.is_alive() and not store.in_flight.is_set()


def test_heartbeat_stop_warns_when_a_store_request_outlasts_the_store_timeout():
    """A store request stuck past the store's own timeout (a wedged store host) does not hold `stop` for
    ever: it returns after the timeout and says the process may abort at exit."""
    store = SlowStore(seconds=16 * HEARTBEAT_S)
    store.set_timeout(datetime.timedelta(seconds=HEARTBEAT_S))
    heartbeat = Heartbeat(store, rank=3)
    heartbeat._thread.start()
    assert store.in_flight.wait(timeout=10), "the heartbeat thread never asked the store"
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match="rank 3: fail_fast's heartbeat thread is still inside a store"):
        heartbeat.stop()
    assert time.monotonic() - started < 8 * HEARTBEAT_S
    heartbeat._thread.join()  # the slow request ends on its own (a Python sleep here)


def test_collective_world_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_collective"):
        MoonEPMoELayer(make_config(1, world="collective"))
