"""The pure logic of bench/gemm.py: the model shapes at EP=8, the `--preset ep8` rows, the segments (a real
plan's for the preset), the gradient modes, and the EP=8 rank's targets computed from a row's timings."""

import pytest
import torch

from bench.gemm import (
    FP8_TARGETS,
    PAD,
    PRESETS,
    TARGETS,
    Case,
    cases,
    expert_shape,
    format_row,
    gemm_targets,
    main,
    plan_segments,
    segment_ends,
    weight_grads,
)


def test_expert_shapes_at_ep8_come_from_the_configs():
    assert expert_shape("deepseek-v3") == (7168, 2048, 32)
    assert expert_shape("kimi-k2") == (7168, 2048, 48)
    assert expert_shape("qwen3-moe-30b-a3b") == (2048, 768, 16)
    assert expert_shape("mixtral-8x7b") == (4096, 14336, 1)


def test_preset_ep8_is_one_rank_of_a_real_plan_in_every_gradient_mode():
    preset = PRESETS["ep8"]
    runs = cases(preset["shapes"], preset["rows"], [0.0], preset["maxvios"])
    assert runs == [Case("deepseek-v3", 65536, maxvio=0.0), Case("deepseek-v3", 65536, maxvio=20.0),
                    Case("kimi-k2", 65536, maxvio=0.0), Case("kimi-k2", 65536, maxvio=20.0)], "S*K = 8192*8"
    assert [2 * expert_shape(case.shape)[2] for case in runs[::2]] == [64, 96], "32+32 and 48+48 groups"
    assert preset["layouts"] == ["arena"], "the weights as the layer has them"
    assert preset["grads"] == ["param", "param_add", "main_grad"], "the default gradient mode first"
    assert [case.label for case in runs[:2]] == ["maxvio=0", "maxvio=20"]


@pytest.mark.parametrize(("shape", "maxvio"), [("deepseek-v3", 0.0), ("kimi-k2", 20.0)])
def test_plan_segments_are_one_ranks_share_of_the_groups_plan(shape, maxvio):
    """epn home then B = epn slot groups, every one of the rank's S*K routes in them, each group padded;
    at maxvio 20 the rank's home groups are skewed and some slots filled, at 0 its home groups near even."""
    _, _, epn = expert_shape(shape)
    ends, info = plan_segments(shape, maxvio, device="cpu")
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    assert ends.shape == (2 * epn,) and bool((sizes % PAD == 0).all())
    assert 65536 <= int(ends[-1]) <= 65536 + 2 * epn * (PAD - 1)
    assert info["slots_used"] == int((sizes[epn:] > 0).sum()) >= 1
    home = sizes[:epn].double()
    assert (float(home.max() / home.mean()) > 2.0) == (maxvio > 0), home.tolist()


@pytest.mark.parametrize("parts", [(5,), (2, 3)])
def test_weight_grads_split_home_and_slots_per_mode(parts):
    """However the weights are laid out (one joined tensor, or home and slots), the gradients are the
    layer's (home, slots) pair: in "param" the home part made fresh by the GEMM (None) and the slots' in the
    weights' dtype, in "param_add" both zeroed in the weights' dtype and in "main_grad" both zeroed fp32,
    added into."""
    weights = tuple(torch.ones(n, 3, 4, dtype=torch.bfloat16) for n in parts)
    home, slots = weight_grads(weights, 2, "param")
    assert home is None and slots.dtype == torch.bfloat16 and slots.shape == (3, 3, 4)
    for mode, dtype in (("param_add", torch.bfloat16), ("main_grad", torch.float32)):
        grads = weight_grads(weights, 2, mode)
        assert [(g.dtype, tuple(g.shape)) for g in grads] == [(dtype, (2, 3, 4)), (dtype, (3, 3, 4))]
        assert not any(g.any() for g in grads)


def test_cases_without_rows_take_each_models_routes():
    assert cases(["mixtral-8x7b", "qwen3-moe-30b-a3b"], None, [0.0, 1.5]) == [
        Case("mixtral-8x7b", 16384, 0.0), Case("mixtral-8x7b", 16384, 1.5),  # K=2
        Case("qwen3-moe-30b-a3b", 65536, 0.0), Case("qwen3-moe-30b-a3b", 65536, 1.5)]
    assert cases(["deepseek-v3"], [100, 200], [0.0]) == [Case("deepseek-v3", 100, 0.0),
                                                         Case("deepseek-v3", 200, 0.0)]
    assert Case("deepseek-v3", 100, 1.5).label == "skew=1.5"


@pytest.mark.parametrize("skew", [0.0, 1.5])
def test_segment_ends_cover_every_route_in_padded_segments(skew):
    ends = segment_ends(64, 65536, skew, torch.Generator().manual_seed(0))
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    assert ends.dtype == torch.int32 and ends.shape == (64,)
    assert bool((sizes % PAD == 0).all()) and bool((sizes >= 0).all())
    assert 65536 <= int(ends[-1]) <= 65536 + 64 * (PAD - 1)


def row_of(fwd, dgrad, wgrad, block):
    """A gemm row with each op's (median, min, max) ms."""
    row = {"shape": "deepseek-v3", "rows": 65536, "segments": "maxvio=0", "backend": "auto",
           "weights": "arena", "grads": "param"}
    for op, (ms, low, high) in {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad, "block": block}.items():
        row.update({f"{op}_ms": ms, f"{op}_ms_min": low, f"{op}_ms_max": high})
    return row


def test_gemm_targets_from_a_rows_timings():
    flops, dense = 1e12, 100e12  # 10 ms at the dense rate
    row = row_of(fwd=(10.5, 10.0, 11.0), dgrad=(12.5, 12.0, 13.0), wgrad=(11.0, 10.0, 12.0),
                 block=(36.0, 35.0, 40.0))
    targets = {t["target"]: t for t in gemm_targets(row, flops, dense, wgrad_floor_s=10e-3)}
    assert list(targets) == [what for what, _, _ in TARGETS]
    assert [(t["op"], t["bound"]) for t in targets.values()] == [(">=", 0.92), (">=", 0.92), ("<=", 1.15),
                                                                 ("<=", 1.08)]
    fwd = targets["fwd of dense"]
    assert (fwd["median"], fwd["min"], fwd["max"]) == pytest.approx((10 / 10.5, 10 / 11, 10 / 10))
    assert fwd["pass"], "0.952 >= 0.92"
    assert not targets["dgrad of dense"]["pass"] and targets["dgrad of dense"]["median"] == pytest.approx(0.8)
    wgrad = targets["wgrad vs its floor"]
    assert (wgrad["median"], wgrad["min"], wgrad["max"]) == pytest.approx((1.1, 1.0, 1.2)) and wgrad["pass"]
    block = targets["block vs its GEMMs"]  # the GEMMs: 34 (32-36) ms
    assert (block["median"], block["min"], block["max"]) == pytest.approx((36 / 34, 35 / 36, 40 / 32))
    assert block["pass"], "1.059 <= 1.08"
    assert {t["row"] for t in targets.values()} == {"deepseek-v3 rows=65536 maxvio=0 auto arena param"}


def test_fp8_row_is_checked_against_issue_16s_targets():
    flops, dense = 1e12, 100e12  # 10 ms at the dense rate; 1.7x is 5.88 ms
    row = {**row_of(fwd=(5.5, 5.4, 5.6), dgrad=(6.0, 5.9, 6.1), wgrad=(11.0, 10.0, 12.0),
                    block=(24.0, 23.5, 24.5)), "backend": "fp8"}
    targets = {t["target"]: t for t in gemm_targets(row, flops, dense, wgrad_floor_s=10e-3)}
    assert [(t["target"], t["op"], t["bound"]) for t in targets.values()] == list(FP8_TARGETS)
    assert [(op, bound) for _, op, bound in FP8_TARGETS] == [(">=", 1.7), (">=", 1.7), ("<=", 1.15),
                                                             ("<=", 1.08)]
    assert targets["fwd of dense"]["median"] == pytest.approx(10 / 5.5) and targets["fwd of dense"]["pass"]
    dgrad = targets["dgrad of dense"]
    assert dgrad["median"] == pytest.approx(10 / 6) and not dgrad["pass"], "1.67 < 1.7"
    assert targets["block vs its GEMMs"]["pass"], "24 <= 1.08 * 22.5"
    assert {t["row"] for t in targets.values()} == {"deepseek-v3 rows=65536 maxvio=0 fp8 arena param"}
    bf16 = {t["target"]: t for t in gemm_targets({**row, "backend": "auto"}, flops, dense, 10e-3)}
    assert bf16["fwd of dense"]["bound"] == 0.92, "every other backend keeps the bf16 bounds"


def test_format_row_shows_each_ops_spread():
    row = row_of(fwd=(10.5, 10.0, 11.0), dgrad=(12.5, 12.0, 13.0), wgrad=(11.0, 10.0, 12.0),
                 block=(36.0, 35.0, 40.0))
    row.update(fwd_tflops=95.2, fwd_vs_dense=0.95, dgrad_tflops=80.0, dgrad_vs_dense=0.8, wgrad_tflops=90.9,
               wgrad_vs_floor=1.1, block_vs_gemms=1.06)
    line = format_row(row)
    for text in ("fwd   95 TF/s (0.95 dense) 10.50 (10.00-11.00) ms",
                 "dgrad   80 (0.80) 12.50 (12.00-13.00) ms",
                 "wgrad   91 (1.10x floor) 11.00 (10.00-12.00) ms",
                 "block 36.00 (35.00-40.00) ms (1.06x gemms)"):
        assert text in line, line
    assert "casts" not in line
    for op, (ms, low, high) in {"fwd_cast": (0.4, 0.3, 0.5), "dgrad_cast": (0.6, 0.5, 0.7),
                                "weight_cast_fwd": (2.0, 1.9, 2.1),
                                "weight_cast_dgrad": (2.5, 2.4, 2.6)}.items():
        row.update({f"{op}_ms": ms, f"{op}_ms_min": low, f"{op}_ms_max": high})
    assert ("casts in the row: activations fwd 0.40 (0.30-0.50) ms, dgrad 0.60 (0.50-0.70) ms; weights fwd "
            "2.00 (1.90-2.10) ms, dgrad 2.50 (2.40-2.60) ms") in format_row(row)


@pytest.mark.parametrize(("argv", "message"), [(["--repeat", "4"], "--repeat must be >= 5"),
                                               (["--preset", "ep4"], "invalid choice: 'ep4'"),
                                               (["--shapes", "gpt-oss"], "invalid choice: 'gpt-oss'"),
                                               (["--grads", "fp32"], "invalid choice: 'fp32'")])
def test_bad_command_lines_fail_before_any_work(monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["bench.gemm", *argv])
    with pytest.raises(SystemExit):
        main()
    assert message in capsys.readouterr().err


def test_rows_are_timed_in_turns_after_every_rows_warmup():
    """`in_turns`: every op of every row warmed up first, then each round runs every row's every op once, so
    the rows share the GPU's drift; each op gets `repeat` times, in its own list."""
    from bench.gemm import in_turns

    order = []

    def timer(fn, warmup, repeat):
        for _ in range(warmup + repeat):
            fn()
        return [float(len(order))] * repeat

    calls = [{op: (lambda r=r, op=op: order.append(f"{r}{op}")) for op in ("fwd", "wgrad")} for r in "ab"]
    seconds = in_turns(calls, warmup=1, repeat=2, timer=timer)
    assert order == ["afwd", "awgrad", "bfwd", "bwgrad"] * 3
    assert seconds == [{"fwd": [5.0, 9.0], "wgrad": [6.0, 10.0]}, {"fwd": [7.0, 11.0], "wgrad": [8.0, 12.0]}]

