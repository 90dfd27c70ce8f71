"""The stress mode's machinery (CPU: what it wraps, the order of its delays, results unchanged) and the
cross-stream orderings it is there to catch, each in a GPU test that fails deterministically without the
wait it checks (see tests/stress.py for `MOONEP_STRESS=1`, which runs the whole GPU suite delayed)."""

from __future__ import annotations

import pytest
import torch
from stress import DEFAULT_CYCLES, ENV, TARGETS, Stress, _entry_points, cycles_from_env
from test_buffer import Case, assert_roundtrip, roundtrip

from moonep_moe.transport.threads import single_world


def test_cycles_from_env(monkeypatch):
    for value, cycles in (("", None), ("0", None), ("1", DEFAULT_CYCLES), ("5000", 5000)):
        monkeypatch.setenv(ENV, value)
        assert cycles_from_env() == cycles


def test_install_wraps_every_entry_point_once_and_uninstall_restores_them():
    before = [(owner, name, vars(owner)[name]) for owner, name, _ in _entry_points()]
    names = {f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in before}
    assert {"ThreadsWorld.all_gather", "PeerWorld.gather_rows", "Buffer.combine",
            "MoECommunicator.dispatch"} <= names
    stress = Stress(cycles=1).install()
    again = Stress(cycles=1).install()  # already wrapped: nothing wrapped twice
    try:
        assert not again._originals
        assert all(getattr(vars(owner)[name], "__stressed__", False) for owner, name, _ in before)
    finally:
        stress.uninstall()
    assert all(vars(owner)[name] is original for owner, name, original in before)


def test_each_thread_delays_the_targets_in_turn():
    stress = Stress(cycles=1)
    assert [stress.next_target() for _ in range(2 * len(TARGETS))] == list(TARGETS) * 2


def test_results_are_unchanged_under_stress_and_cpu_tensors_are_never_delayed():
    slept = []
    stress = Stress(cycles=7, sleep=slept.append).install()
    try:
        case = Case(R=2, S=16, H=8, K=3, E=8, tp=4, kind="skewed")
        assert_roundtrip(case, roundtrip(case))
    finally:
        stress.uninstall()
    assert slept == [], "only CUDA streams are delayed"


@pytest.mark.gpu
def test_pointer_table_is_filled_before_any_stream_reads_it():
    """A row kernel's pointer table was cached across streams: built (one fill per rank) on one stream,
    it was read by kernels on others (every thread-rank of one GPU maps the same addresses) before the
    fills ran. With the building stream delayed, another stream's read of the table must still see the
    addresses."""
    from moonep_moe.comm.kernels import common

    world = single_world("cuda")
    tensor = world.symmetric("test/pointer_table", torch.zeros(4, 8, device="cuda"))
    builder, reader = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(builder):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the fills run after it
        common.pointer_table(tensor)
    with torch.cuda.stream(reader):
        seen = common.pointer_table(tensor).clone()
    torch.cuda.synchronize()
    assert seen.tolist() == [tensor.local.data_ptr()]
