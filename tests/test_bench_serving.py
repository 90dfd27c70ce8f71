"""The pure logic of bench/serving.py (flags to ranks and backend, phase times, spreads and ratios to the
s = S step) checked by hand, and the script end to end on the CPU (threads and single worlds, eager only)."""

import json

import pytest

from bench.serving import (
    PHASES,
    add_ratios,
    main,
    parse_args,
    phase_seconds,
    phase_spreads,
    resolve_ranks,
    symmetric_backend,
    token_counts,
)


def test_token_counts_double_up_to_the_capacity():
    assert token_counts(16) == [1, 2, 4, 8, 16]
    assert token_counts(12) == [1, 2, 4, 8, 12]
    assert token_counts(1) == [1]


@pytest.mark.parametrize("world, ranks, device, launched, want", [
    ("threads", None, "cpu", None, 4),
    ("threads", 8, "cuda", None, 8),
    ("single", None, "cpu", None, 1),
    ("single", 1, "cuda", None, 1),
    ("symmetric", 8, "cuda", None, 8),
    ("symmetric", None, "cuda", 8, 8),  # torchrun's processes
    ("symmetric", 8, "cuda", 8, 8),
])
def test_resolve_ranks(world, ranks, device, launched, want):
    assert resolve_ranks(world, ranks, device, launched) == want


@pytest.mark.parametrize("world, ranks, device, launched, match", [
    ("symmetric", 2, "cpu", None, "--world symmetric needs --device cuda"),
    ("single", 2, "cpu", None, "--ranks 2: --world single is one rank"),
    ("threads", None, "cpu", 2, "--world threads runs in one process"),
    ("symmetric", 4, "cuda", 8, "--ranks 4: under torchrun the ranks are its 8 processes"),
    ("threads", 0, "cpu", None, "--ranks 0: at least one rank"),
])
def test_resolve_ranks_names_the_flag(world, ranks, device, launched, match):
    with pytest.raises(ValueError, match=match):
        resolve_ranks(world, ranks, device, launched)


def test_too_few_reps_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--reps", "4"])
    assert "--reps 4: at least 5 repetitions" in capsys.readouterr().err


def test_symmetric_backend_shares_one_gpu_over_gloo():
    assert symmetric_backend(8, 1) == ("gloo", True)
    assert symmetric_backend(8, 8) == ("nccl", False)
    assert symmetric_backend(2, 8) == ("nccl", False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        symmetric_backend(2, 0)


def test_phase_seconds_by_hand():
    times = phase_seconds([10.0, 10.5, 10.75, 12.0, 12.25])
    assert list(times) == [*PHASES, "step"]
    assert times == {"dispatch": 0.5, "prefetch": 0.25, "experts": 1.25, "combine": 0.25, "step": 2.25}
    with pytest.raises(ValueError, match="stamps: 5 points"):
        phase_seconds([0.0, 1.0])


def test_spreads_and_ratios_to_the_full_step_by_hand():
    reps = [{"dispatch": d, "step": 2 * d} for d in (0.004, 0.001, 0.002, 0.003, 0.005)]
    spreads = phase_spreads(reps)
    assert spreads["dispatch"]["ms"] == pytest.approx(3.0)
    assert (spreads["dispatch"]["ms_min"], spreads["dispatch"]["ms_max"]) == pytest.approx((1.0, 5.0))
    assert spreads["step"]["ms"] == pytest.approx(6.0)
    assert spreads["step"]["ms_samples"] == pytest.approx([8.0, 2.0, 4.0, 6.0, 10.0]), "in the order run"
    with pytest.raises(ValueError, match="at least one repetition"):
        phase_spreads([])
    small = {"eager": {"step": {"ms": 1.0}}, "graph": {"step": {"ms": 0.02}}}
    full = {"eager": {"step": {"ms": 4.0}}, "graph": {"step": {"ms": 0.5}}}
    rows = add_ratios([small, full])
    assert rows[0]["vs_full"] == pytest.approx({"eager_step": 0.25, "graph_step": 0.04})
    assert rows[1]["vs_full"] == pytest.approx({"eager_step": 1.0, "graph_step": 1.0})
    eager_only = add_ratios([{"eager": {"step": {"ms": 1.0}}, "graph": None},
                             {"eager": {"step": {"ms": 2.0}}, "graph": None}])
    assert eager_only[0]["vs_full"] == {"eager_step": 0.5}, "no graph: no graph ratio"


@pytest.mark.parametrize("world, ranks", [("single", 1), ("threads", 2)])
def test_cpu_run_end_to_end(tmp_path, world, ranks, capsys):
    """Tiny shapes on the CPU: one record per world, every s up to S with five timed reps of every phase,
    phases adding up to the step, no graph (eager only off CUDA) and the s = S step as the reference."""
    path = main(["--world", world, "--ranks", str(ranks), "--tokens", "8", "--hidden", "16", "--ffn", "8",
                 "--experts", "8", "--top-k", "2", "--token-padding", "8", "--warmup", "0", "--reps", "5",
                 "--out", str(tmp_path)])
    assert path.parent == tmp_path and path.name.startswith(f"serving-{world}-r{ranks}-cpu-")
    record = json.loads(path.read_text())
    assert (record["world_kind"], record["ranks"], record["reference_tokens"]) == (world, ranks, 8)
    assert "mean nothing" in record["note"]
    rows = record["results"]
    assert [row["tokens"] for row in rows] == [1, 2, 4, 8]
    assert [row["capacity"] for row in rows] == [1, 2, 4, 8]
    for row in rows:
        assert row["graph"] is None
        assert set(row["eager"]) == {*PHASES, "step"}
        assert all(len(timed["ms_samples"]) == 5 for timed in row["eager"].values())
        for i in range(5):
            phases_ms = sum(row["eager"][name]["ms_samples"][i] for name in PHASES)
            assert phases_ms == pytest.approx(row["eager"]["step"]["ms_samples"][i])
        assert row["slowest_rank_eager_step_ms"] >= row["eager"]["step"]["ms"] * (1 - 1e-9)
    assert rows[-1]["vs_full"]["eager_step"] == 1.0
    assert "wrote" in capsys.readouterr().out
