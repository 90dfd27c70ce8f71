"""The pure logic of bench/serving.py (flags to ranks and backend, phase times, spreads and ratios to the
s = S step) checked by hand, and the script end to end on the CPU (threads and single worlds, eager only)."""

import json

import pytest

from bench.serving import (
    PHASES,
    add_ratios,
    comm_targets,
    main,
    parse_args,
    phase_seconds,
    phase_spreads,
    resolve_ranks,
    symmetric_backend,
    token_counts,
)
from moonep_moe.config import CommConfig


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


def comm_rows(graph_ms: dict[int, float | None]) -> list[dict]:
    """Rows of s tokens: eager comm s ms, graph comm as given (None: no graph)."""
    return [{"tokens": s, "comm": {"eager": {"ms": float(s)}, "graph": None if ms is None else {"ms": ms}}}
            for s, ms in graph_ms.items()]


def test_comm_targets_by_hand():
    """The serving targets: R = 1, s <= 128 within 40 us of graph replay; comm(s=1) <= 5% of comm(s=S)."""
    rows = comm_rows({1: 0.020, 2: 0.021, 128: 0.039, 256: 0.041, 512: 0.5})
    targets = comm_targets(rows, ranks=1)
    assert targets["comm_within_40us"] == {"bound_ms": 0.04, "tokens_up_to": 128, "ranks": 1,
                                           "worst_ms": 0.039, "missed_tokens": [], "pass": True}
    assert targets["decode_within_5pct"] == pytest.approx({"bound": 0.05, "graph_ratio": 0.04,
                                                           "eager_ratio": 1 / 512, "pass": True})
    assert rows[-1]["comm"]["vs_full"] == {"eager": 1.0, "graph": 1.0}
    missed = comm_targets(comm_rows({1: 0.030, 64: 0.045, 128: 0.039, 512: 0.5}), ranks=1)
    assert missed["comm_within_40us"]["missed_tokens"] == [64] and missed["comm_within_40us"]["pass"] is False
    assert missed["decode_within_5pct"]["pass"] is False, "0.030 / 0.5 = 6%"
    eight = comm_targets(comm_rows({1: 0.001, 512: 0.5}), ranks=8)
    assert eight["comm_within_40us"]["pass"] is None, "the 40 us bound is one rank's"
    assert eight["decode_within_5pct"]["pass"] is True
    eager_only = comm_targets(comm_rows({1: None, 8: None}), ranks=1)
    assert eager_only["comm_within_40us"]["pass"] is None and eager_only["decode_within_5pct"]["pass"] is None
    assert eager_only["decode_within_5pct"]["eager_ratio"] == pytest.approx(1 / 8)


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
    for row in rows:  # dispatch + combine per repetition, and the targets (no graph on the CPU)
        samples = [row["eager"]["dispatch"]["ms_samples"][i] + row["eager"]["combine"]["ms_samples"][i]
                   for i in range(5)]
        assert row["comm"]["eager"]["ms_samples"] == pytest.approx(samples) and row["comm"]["graph"] is None
    assert {target["pass"] for target in record["targets"].values()} == {None}
    printed = capsys.readouterr().out
    assert "wrote" in printed and "not measured" in printed


def test_token_padding_defaults_to_the_configs_and_is_recorded(tmp_path):
    """Without --token-padding the bench serves what a communicator built without one gets (CommConfig's
    default: 16, not DeepGEMM's 128), and the record's shape says which tp ran."""
    assert parse_args([]).token_padding == CommConfig.model_fields["token_padding"].default == 16
    assert parse_args(["--token-padding", "128"]).token_padding == 128
    path = main(["--world", "single", "--tokens", "2", "--hidden", "16", "--ffn", "8", "--experts", "8",
                 "--top-k", "2", "--warmup", "0", "--reps", "5", "--out", str(tmp_path)])
    assert json.loads(path.read_text())["shape"]["token_padding"] == 16
