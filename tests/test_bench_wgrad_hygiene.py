"""bench/wgrad_hygiene.py on the CPU (`torch._grouped_mm` runs bf16 there): the wgrad calls it captures are
the ones the layers make (ours: `TorchGroupedGemm.wgrad`'s operands themselves, the groups its plan gives;
torch-native: the call that makes autograd's gradient), its derived arms replay the same product, the smoke
run goes through every arm and condition that can run without a GPU, and the conclusions are computed from
the timings."""

import argparse
import json

import pytest
import torch

from bench.common import spread
from bench.grouped_mm_calls import run_call
from bench.layer_step import step_inputs
from bench.layer_tables import make_table, table_rank_plan
from bench.wgrad_hygiene import (
    ARMS,
    CONDITIONS,
    SMOKE,
    WGRAD_ROLES,
    build_layers,
    capture,
    conclusions,
    main,
    print_role,
    role_arms,
    run,
    steps_ratios,
    wgrad_index,
    wgrad_kernel,
    with_operands,
)

CPU = torch.device("cpu")
TABLES = {"ep1": (None, 16), "ep8-rank": (8, 64)}
"""`(ep_rank_of, experts)` of the tables tested: DeepSeek-V3's K on `SMOKE` shapes with fewer experts (the
CPU's grouped GEMM walks its groups one by one); at one rank of EP=8, 8 home experts and 8 slots."""


def smoke_table(ep_rank_of, experts):
    return make_table("deepseek-v3", ep_rank_of, {**SMOKE, "experts": experts})


def sizes(offs: torch.Tensor) -> torch.Tensor:
    return torch.diff(offs, prepend=offs.new_zeros(1))


def align_up(rows: torch.Tensor, padding: int) -> torch.Tensor:
    return (rows + padding - 1) // padding * padding


def spy_wgrad(layer, monkeypatch) -> list[dict]:
    """Every call of ours' backend's wgrad from here on: its arguments, and copies of what it read and of the
    home gradient it made, taken when it returned (the step reuses the rows and adds into that gradient)."""
    gemm, seen = layer._state.gemm, []
    real = gemm.wgrad

    def wgrad(dy, x, offs_g, out, accumulate=True):
        made = real(dy, x, offs_g, out, accumulate)
        seen.append({"dy": dy, "x": x, "offs_g": offs_g, "out": list(out), "read": (dy.clone(), x.clone()),
                     "made": made[0].clone()})
        return made

    monkeypatch.setattr(gemm, "wgrad", wgrad)
    return seen


@pytest.mark.parametrize("which", TABLES)
def test_captured_wgrads_are_what_each_layer_passes(which, monkeypatch):
    table = smoke_table(*TABLES[which])
    layers = build_layers(table, CPU)
    try:
        seen = spy_wgrad(layers["ours"], monkeypatch)
        captured = capture(layers, *step_inputs(table.tokens, table.hidden, CPU), table.hidden, table.ffn)
        padding = layers["ours"].config.token_padding
        routes = table.tokens * table.top_k
        native_layer = layers["native"]
        for role in WGRAD_ROLES:
            ours = captured["ours"]["calls"][wgrad_index(captured["ours"], role)]
            native = captured["native"]["calls"][wgrad_index(captured["native"], role)]
            # ours: TorchGroupedGemm.wgrad's own dy^T and x (this step's), the home groups' offs
            real = next(s for s in reversed(seen) if s["dy"].shape[1] == ours["a"].shape[0])
            dy, x, offs_g = real["dy"], real["x"], real["offs_g"]
            assert real["out"][0] is None, "param mode: the backend makes the home gradients"
            home = offs_g.numel() - sum(part.shape[0] for part in real["out"][1:])
            assert (ours["a"].data_ptr(), ours["a"].shape, ours["a"].stride()) == \
                (dy.data_ptr(), dy.t().shape, dy.t().stride())
            assert (ours["b"].data_ptr(), ours["b"].shape, ours["b"].stride()) == \
                (x.data_ptr(), x.shape, x.stride())
            assert torch.equal(ours["offs"], offs_g[:home])
            dy_read, x_read = real["read"]
            replayed = run_call(with_operands(ours, dy_read.t(), x_read, ours["offs"]))
            assert torch.equal(replayed, real["made"]), "the captured call on what it read: the real gradient"
            # torch-native: the call that makes autograd's gradient, over every routed row
            grad = (native_layer.gate_up if role == "wgrad gate_up" else native_layer.down).grad
            out = run_call(native)
            assert torch.equal(out, grad) or torch.equal(out.transpose(-2, -1), grad)
            assert int(native["offs"][-1]) == native["a"].shape[1] == routes
            assert native["offs"].numel() == table.shapes["num_experts"]
            # one gradient shape per group; ours' rows: its groups' routes, padded, within its row buffer
            assert ours["a"].shape[0] == native["a"].shape[0] and ours["b"].shape[1] == native["b"].shape[1]
            if table.ep_rank_of is None:  # the same router, weights and tokens: the same groups, padded
                assert home == native["offs"].numel()
                assert torch.equal(sizes(ours["offs"]), align_up(sizes(native["offs"]), padding))
            else:  # the rank's home experts, with the routes its plan gives them
                plan = table_rank_plan(table, CPU)
                assert home == plan.epn == native["offs"].numel() // 2
                home_routes = torch.tensor(plan.home_routes, dtype=torch.int32)
                assert torch.equal(sizes(ours["offs"]), align_up(home_routes, padding))
            assert ours["a"].shape[1] >= int(ours["offs"][-1])
    finally:
        layers["ours"].destroy()


def test_arms_replay_one_product_on_their_own_operands():
    table = smoke_table(*TABLES["ep8-rank"])
    layers = build_layers(table, CPU)
    try:
        captured = capture(layers, *step_inputs(table.tokens, table.hidden, CPU), table.hidden, table.ffn)
        for role in WGRAD_ROLES:
            arms, at = role_arms(captured, role)
            assert list(arms) == list(ARMS)
            assert at["ours"] == wgrad_index(captured["ours"], role)
            ours, fresh, cut, native = (arms[arm] for arm in ARMS)
            assert arms["ours"] is captured["ours"]["calls"][at["ours"]]
            assert native is captured["native"]["calls"][at["native"]]
            for name in ("a", "b"):
                assert fresh[name].data_ptr() != ours[name].data_ptr(), "fresh: new memory"
                assert (fresh[name].shape, fresh[name].stride()) == (ours[name].shape, ours[name].stride())
                assert cut[name].data_ptr() != ours[name].data_ptr()
            end = int(ours["offs"][-1])
            assert cut["a"].shape[1] == cut["b"].shape[0] == end < ours["a"].shape[1], \
                "trimmed: the rows past the last group dropped"
            assert cut["a"].t().is_contiguous() == native["a"].t().is_contiguous()
            assert cut["b"].is_contiguous() == native["b"].is_contiguous()
            assert cut["offs"].data_ptr() != ours["offs"].data_ptr()
            assert torch.equal(cut["offs"], ours["offs"])
            made = run_call(ours)
            assert torch.equal(run_call(fresh), made) and torch.equal(run_call(cut), made)
    finally:
        layers["ours"].destroy()


def test_smoke_run_goes_through_every_arm_and_cpu_condition(capsys):
    args = argparse.Namespace(smoke=True, repeat=1, flush_mib=256, idle_ms=20.0)
    record = run(smoke_table(*TABLES["ep1"]), args)
    json.dumps(record)  # what write_record stores on the GPU
    assert record["name"] == "wgrad-hygiene-deepseek-v3-custom"
    assert "needs a GPU" in record["in_step"]["skipped"]
    assert [row["role"] for row in record["results"]] == list(WGRAD_ROLES)
    on_cpu = ("back_to_back", "after_preceding", "after_step_gemms")
    for row in record["results"]:
        assert list(row["arms"]) == list(ARMS) and list(row["conditions"]) == list(CONDITIONS)
        assert row["arms"]["ours_trimmed"]["rows"] == row["arms"]["ours"]["offs_last"]
        assert row["after"]["native"][-1] != row["role"]
        for condition, measured in row["conditions"].items():
            if condition in on_cpu:
                assert all(len(measured[arm]["ms_samples"]) == 1 for arm in ARMS)
                assert "ours/native" in measured["ratios"] and measured["gpu_start"] == {}
            else:
                assert "no L2 to flush" in measured["skipped"]
        found = record["conclusions"][row["role"]]
        assert found["in_step"] is None and set(found["operands"]) == set(on_cpu)
        assert found["conditions"] == {}, "nothing to divide by without the flushed reference"
    capsys.readouterr()
    timed = spread([5e-3, 6e-3])
    print_role(record["results"][0], {"ours": {**timed, "before_kernels": ["silu_backward"]},
                                      "native": {**timed, "before_kernels": ["index_add"]},
                                      "ratio": {"median": 1.0, "min": 0.9, "max": 1.1}, "gpu_start": {},
                                      "gpu_end": {}})
    printed = capsys.readouterr().out
    assert "in its step, ours/native" in printed and "after silu_backward" in printed
    assert "l2_flushed         skipped: needs a GPU" in printed and "ours/ours_fresh" in printed


def test_main_smoke_writes_no_record(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench.wgrad_hygiene", "--smoke", "--model", "mixtral-8x7b",
                                     "--out", str(tmp_path)])
    main()
    assert "no timing on CPU" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_main_refuses_to_time_without_a_gpu(monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench.wgrad_hygiene"])
    with pytest.raises(SystemExit, match="needs a GPU"):
        main()


def test_wgrad_kernel_takes_the_matched_call_and_what_ran_before_it():
    kernels = [("router", 0.1), ("prepare_grouped_gemm_data", 0.002), ("cutlass fwd", 7.0), ("silu", 0.3),
               ("index_add", 0.2), ("prepare_grouped_gemm_data", 0.002), ("cutlass wgrad", 5.0)]
    assert wgrad_kernel(kernels, 1, calls=2) == (5.0, ["cutlass fwd", "silu", "index_add"])
    assert wgrad_kernel(kernels, 0, calls=2) == (7.0, ["router"])
    assert wgrad_kernel(kernels, 1, calls=3) is None, "a step that does not match its recorded calls"


def measured(ms_by_arm: dict[str, list[float]]) -> dict:
    """A condition as `measure_role` stores it, from each arm's ms per round."""
    row = {arm: spread([ms / 1e3 for ms in times]) for arm, times in ms_by_arm.items()}
    return {**row, "ratios": steps_ratios({arm: row[arm]["ms_samples"] for arm in ARMS})}


def test_conclusions_are_ratios_of_the_measured_times():
    rows = [{"role": "wgrad down", "conditions": {
        "back_to_back": measured({"ours": [6.0, 6.0, 9.0], "ours_fresh": [6.0, 6.0, 6.0],
                                  "ours_trimmed": [4.0, 4.0, 4.0], "native": [4.0, 4.0, 4.0]}),
        "l2_flushed": measured({"ours": [4.0, 4.0, 4.0], "ours_fresh": [4.0, 4.0, 4.0],
                                "ours_trimmed": [4.0, 4.0, 4.0], "native": [4.0, 5.0, 4.0]}),
        "idle_then_flushed": {"skipped": "not here"}}}]
    steps = {"wgrad down": {"ours": spread([15e-3, 16e-3, 14e-3]), "native": spread([12e-3, 13e-3, 12e-3]),
                            "ratio": {"median": 1.25, "min": 1.1, "max": 1.3, "rounds": []}}}
    found = conclusions(rows, steps)["wgrad down"]
    assert found["in_step"] == (1.25, 1.1, 1.3)
    assert set(found["operands"]) == {"back_to_back", "l2_flushed"}
    back = found["operands"]["back_to_back"]
    assert back["ours/native"] == pytest.approx((1.5, 1.5, 2.25))
    assert back["ours/ours_fresh"] == pytest.approx((1.0, 1.0, 1.5))
    assert back["ours_fresh/ours_trimmed"] == pytest.approx((1.5, 1.5, 1.5))
    assert back["ours_trimmed/native"] == pytest.approx((1.0, 1.0, 1.0))
    assert found["operands"]["l2_flushed"]["ours/native"] == pytest.approx((1.0, 0.8, 1.0))
    ours, native = found["conditions"]["ours"], found["conditions"]["native"]
    assert ours["back_to_back/l2_flushed"] == pytest.approx((1.5, 1.5, 2.25))
    assert ours["in_step/l2_flushed"] == pytest.approx((3.75, 3.5, 4.0))
    assert native["in_step/l2_flushed"] == pytest.approx((3.0, 12 / 5, 13 / 4))
    assert "in_step/l2_flushed" not in found["conditions"]["ours_fresh"], "only the layers run in a step"
