"""bench/wgrad_tiles.py: its forced-config launch computes the layer's slot gradients, and its CPU smoke run
records every config on every layout with the autotuner's picks."""

from __future__ import annotations

import json

import pytest
import torch

from bench.wgrad_tiles import LAYOUTS, PROJECTIONS, autotuned_pick, config_name, forced, main, smoke_layouts
from moonep_moe.gemm.kernels import wgrad as kernel


@pytest.mark.interpreter
def test_a_forced_config_writes_the_used_slots_gradients_and_leaves_unused_slots_alone():
    ends_by, epn, _ = smoke_layouts("cpu")
    ends = ends_by["maxvio 20"]
    rows = int(ends[-1])
    dy, x = torch.randn(rows, 48).bfloat16(), torch.randn(rows, 40).bfloat16()
    out = torch.full((ends.numel() - epn, 48, 40), 7.0, dtype=torch.bfloat16)
    forced(kernel._grouped_wgrad_kernel.configs[0], dy, x, ends, epn, out)()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    for slot in range(out.shape[0]):
        lo, hi = int(starts[epn + slot]), int(ends[epn + slot])
        if hi > lo:
            want = dy[lo:hi].double().T @ x[lo:hi].double()
            torch.testing.assert_close(out[slot].double(), want, rtol=1e-2, atol=1e-1)
        else:
            assert bool((out[slot] == 7.0).all()), f"unused slot {slot} was written"


def test_the_autotuned_pick_is_tuned_on_the_layout_given_not_on_the_kernels_tuning_launch(monkeypatch):
    """`grouped_wgrad_triton` tunes on its own launch (every row in even groups) before a shape's first call;
    the bench's pick for a layout must come from timing that layout's launch, so it bypasses that tuning."""
    ends_by, epn, _ = smoke_layouts("cpu")
    ends = ends_by["maxvio 20"]
    dy, x = torch.randn(int(ends[-1]), 48).bfloat16(), torch.randn(int(ends[-1]), 40).bfloat16()
    out = torch.zeros(ends.numel() - epn, 48, 40, dtype=torch.bfloat16)
    launched = []
    monkeypatch.setattr(kernel, "_tune", lambda *args: pytest.fail("the kernel's tuning launch ran"))
    monkeypatch.setattr(kernel, "_launch", lambda *args, **kwargs: launched.append((args, kwargs)))
    picked = kernel._grouped_wgrad_kernel.configs[0]
    monkeypatch.setattr(kernel._grouped_wgrad_kernel, "best_config", picked, raising=False)
    assert autotuned_pick(dy, x, ends, epn, out) is picked
    [(args, kwargs)] = launched
    assert args[2] is ends and args[3] is out and args[7] == epn and kwargs == dict(accumulate=False,
                                                                                    zeroed_groups=epn)


@pytest.mark.interpreter
def test_smoke_run_records_every_config_on_every_layout_and_the_autotuned_picks(tmp_path, capsys):
    path = main(["--smoke", "--repeat", "1", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    [row] = record["results"]
    names = [config_name(c) for c in kernel._grouped_wgrad_kernel.configs]
    for projection in PROJECTIONS:
        layouts = row[projection]["layouts"]
        assert list(layouts) == list(LAYOUTS)
        assert [layouts[name]["slot_rows"] for name in LAYOUTS] == [16, 128, 128, 256, 0]
        assert [layouts[name]["slots_used"] for name in LAYOUTS] == [1, 2, 8, 8, 0]
        for layout in layouts.values():
            want = names + (["torch._grouped_mm"] if layout["slot_rows"] else [])
            assert list(layout["arms"]) == want
            assert all(arm["min"] <= arm["median"] <= arm["max"] for arm in layout["arms"].values())
        picks = row[projection]["autotuned_on"]
        assert set(picks) == set(LAYOUTS) and all(pick["config"] in names for pick in picks.values())
        assert all(cost >= 1.0 for pick in picks.values() for cost in pick["cost"].values())
    assert record["setup"]["layouts"]["maxvio 20"]["slots_used"] == 2
    assert "tuned on no replica" in capsys.readouterr().out
