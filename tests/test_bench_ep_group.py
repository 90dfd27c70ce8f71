"""bench.ep_group and the modules it is made of (bench.ep_group_arms, bench.ep_group_report,
bench.link_model, bench.native_ep): the link's bytes, the group's step and its targets, the routing
generator, the torch-native plain-EP rank, the CPU smoke run and the command line."""

from __future__ import annotations

import json

import pytest
import torch
from test_bench_rank_replay import E, F, H, K, R, S, config, skewed_inputs

from bench.common import idle_gaps
from bench.ep_group import Group, Segment, group_spread, main, slowest
from bench.ep_group_arms import Repeats, same_plans
from bench.ep_group_report import POLICIES, group_targets
from bench.link_model import (
    NVLINK_BYTES_PER_S,
    layer_link_seconds,
    link_bytes,
    native_link_bytes,
    over_link,
    prefetch_rooms,
)
from bench.native_ep import NativeEPExperts, NativePlainEPRank
from bench.rank_replay import PHASES, group_step, route_matrices
from bench.skew import skewed_routing
from moonep_moe.config import MoEConfig


def test_link_bytes_balance_between_senders_and_receivers():
    inputs = skewed_inputs(seed=5)
    row = H * 8  # float64 rows
    for balance in POLICIES:
        step = group_step(config(balance), inputs["topk"], inputs["weights"], inputs["hidden"],
                          inputs["grad_out"])
        phases = link_bytes(step)
        assert len(phases) == R and all(len(p) == len(PHASES) for p in phases)
        for i, phase in enumerate(PHASES):
            into = sum(p[i][0] for p in phases)
            out = sum(p[i][1] for p in phases)
            assert into == out, f"{balance}: {phase}: what the ranks send is what they receive"
        payload = route_matrices(step)["payload"].fill_diagonal_(0)
        assert [p[3] for p in phases] == [(int(payload[:, d].sum()) * row, int(payload[d].sum()) * row)
                                          for d in range(R)], "the backward dispatch: payload rows only"
        if balance == "off":
            assert all(p[1] == (0, 0) and p[6] == (0, 0) for p in phases), "plain EP moves no weights"
    expert = 3 * H * F * 8
    exact = link_bytes(group_step(config("exact"), inputs["topk"], inputs["weights"], inputs["hidden"],
                                  inputs["grad_out"]))
    assert sum(p[1][0] for p in exact) > 0 and all(p[1][0] % expert == 0 for p in exact)
    assert all(p[6] == p[1][::-1] for p in exact), "float64: the replicas' gradients weigh what they do"


def test_native_link_bytes_are_a_row_per_remote_route():
    inputs = skewed_inputs()
    step = group_step(config("off"), inputs["topk"], inputs["weights"], inputs["hidden"], inputs["grad_out"])
    routes = route_matrices(step)["routes"].fill_diagonal_(0)
    row, weight = H * 8, 8
    for d, phases in enumerate(native_link_bytes(step)):
        got, sent = int(routes[:, d].sum()), int(routes[d].sum())
        assert phases == [(got * (row + weight), sent * (row + weight)), (sent * row, got * row),
                          (got * row, sent * row), (sent * (row + weight), got * (row + weight))]


def test_the_link_stretches_only_windows_shorter_than_it():
    assert over_link(10.0, [1.0, 2.0, 0.5], [0.5, 3.0, 0.5]) == pytest.approx(11.0)
    assert over_link(10.0, [1.0], [0.2]) == 10.0
    # a window beside a GEMM: its link time is hidden up to the room before the step waits for it
    assert over_link(10.0, [1.0, 0.5], [2.0, 3.0], [0.0, 2.5]) == pytest.approx(11.5)
    assert over_link(10.0, [1.0, 0.5], [2.0, 2.0], [0.0, 2.5]) == pytest.approx(11.0)


def test_a_prefetch_waits_for_the_replicas_it_pulls_not_for_its_peers_pulls():
    """The prefetch's window (one barrier) lasts until the next call: its bytes in are charged whole, its
    bytes out only beyond that window; every other call's larger direction beyond its window."""
    rate = NVLINK_BYTES_PER_S
    prefetches = [i for i, phase in enumerate(PHASES) if phase == "copy_experts"]
    assert len(prefetches) == 2  # forward's and backward's
    phases = [(int(rate * (0.25 if i in prefetches else 1.0)), int(rate * (3.0 if i in prefetches else 2.0)))
              for i in range(len(PHASES))]
    waited, link = layer_link_seconds(phases)
    for i in range(len(PHASES)):
        want = (0.25, 3.0) if i in prefetches else (0.0, 2.0)
        assert (waited[i], link[i]) == pytest.approx(want), PHASES[i]
    windows = [2.0] * len(PHASES)  # every other call as long as its link time: nothing added there
    for i in prefetches:
        windows[i] = 5.0  # through the GEMMs that follow it: the peers' pulls hide under them
    assert over_link(10.0, windows, link, waited_s=waited) == pytest.approx(10.5)
    windows[prefetches[0]] = 1.0
    assert over_link(10.0, windows, link, waited_s=waited) == pytest.approx(12.5)


def test_a_prefetchs_replicas_are_charged_only_beyond_the_home_gemm_they_arrive_beside():
    """The replicas a prefetch pulls in delay the step only where their link time outlasts the time from the
    prefetch's start to the caller's wait for them (the home groups' GEMM): `prefetch_rooms` measures it from
    the step's stamps, `over_link` charges the rest."""
    prefetches = [i for i, phase in enumerate(PHASES) if phase == "copy_experts"]
    starts = {i: 1.0 + i for i in range(len(PHASES))}  # clock stamps (s): call i starts at 1 + i
    windows = [(phase, starts[i], starts[i] + 0.5) for i, phase in enumerate(PHASES)]
    waits = [starts[prefetches[0]] + 0.3, starts[prefetches[1]] + 0.1]
    hidden = prefetch_rooms(windows, waits)
    want = [0.0] * len(PHASES)
    want[prefetches[0]], want[prefetches[1]] = 0.3, 0.1
    assert hidden == pytest.approx(want)
    waited = [0.0] * len(PHASES)
    waited[prefetches[0]] = waited[prefetches[1]] = 0.2
    zeros = [0.0] * len(PHASES)
    # forward's 0.2 s of replicas hide under its 0.3 s; backward's outlast its 0.1 s by 0.1 s
    assert over_link(10.0, zeros, zeros, waited_s=waited, hidden_s=hidden) == pytest.approx(10.1)
    assert over_link(10.0, zeros, zeros, waited_s=waited) == pytest.approx(10.4)
    assert prefetch_rooms(windows[:-1], waits) == zeros, "a step without every window: nothing hidden"


def ms_row(rank: int, samples: list[float], key: str = "nvlink") -> dict:
    return {"rank": rank, key: {"ms": sorted(samples)[len(samples) // 2], "ms_samples": samples}}


def test_the_groups_step_is_its_slowest_rank_per_repetition():
    ranks = [{**ms_row(0, [10.0, 30.0, 10.0]), **ms_row(0, [1.0, 1.0, 1.0], "local")},
             {**ms_row(1, [20.0, 20.0, 20.0]), **ms_row(1, [2.0, 2.0, 2.0], "local")}]
    step = group_spread(ranks, "nvlink")
    assert step["ms_samples"] == pytest.approx([20.0, 30.0, 20.0])
    assert (step["ms"], step["ms_min"], step["ms_max"]) == pytest.approx((20.0, 20.0, 30.0))
    assert slowest(ranks)["rank"] == 1, "by median"


def summary(ms: float) -> dict:
    times = {"ms": ms, "ms_min": ms * 0.9, "ms_max": ms * 1.1}
    return {"slowest": {key: times for key in ("nvlink", "local")},
            "ranks": [{"rank": 0, "beyond_share": {"median": 0.03, "min": 0.02, "max": 0.04},
                       "beyond_share_local": {"median": 0.06, "min": 0.05, "max": 0.07},
                       "exchange_share": {"median": 0.02, "min": 0.01, "max": 0.03},
                       "exchange_share_local": {"median": 0.01, "min": 0.01, "max": 0.01}}]}


def test_targets_of_a_group():
    table = {"model": "m", "ranks": 8, "maxvio_targets": [0.0, 20.0],
             "policies": {"exact": [summary(40.0), summary(41.0)],
                          "cost_aware": [summary(45.0), summary(41.5)],
                          "off": [summary(39.0), summary(120.0)]},
             "native": [{"baseline": "compiled", "compiled": summary(38.0)["slowest"]},
                        {"baseline": "eager", "eager": summary(100.0)["slowest"]}]}
    targets = group_targets(table, "nvlink")
    by_name = [(t["target"], t.get("maxvio"), round(t["median"], 4), t["pass"]) for t in targets]
    assert by_name == [
        ("exact: maxvio 20 over maxvio 0", None, round(41 / 40, 4), True),
        ("exact over torch-native plain EP", 20.0, 0.41, True),
        ("exact over torch-native plain EP", 0.0, round(40 / 38, 4), False),
        ("cost_aware over the better of exact and off", 0.0, round(45 / 39, 4), False),
        ("cost_aware over the better of exact and off", 20.0, round(41.5 / 41, 4), False),
        ("exact: time beyond the expert block over the step, worst rank", 0.0, 0.03, True),
        ("exact: time beyond the expert block over the step, worst rank", 20.0, 0.03, True)]
    assert [t["better"] for t in targets if "better" in t] == ["off", "exact"]
    assert [t["same_plan_as"] for t in targets if "better" in t] == [None, None]
    table["cost_aware_plan_as"] = ["off", None]
    assert [t["same_plan_as"] for t in group_targets(table, "nvlink") if "better" in t] == ["off", None]
    del table["cost_aware_plan_as"]
    assert all(t["link"] == "nvlink" and t["model"] == "m" and t["ranks"] == 8 for t in targets)
    spread = targets[1]
    assert (spread["min"], spread["max"]) == pytest.approx((41 * 0.9 / 110, 41 * 1.1 / 90))
    assert [t["in_waited_exchanges"] for t in targets[-2:]] == [0.02, 0.02], "the beyond target's split"
    local = group_targets(table, "local")
    assert [t["pass"] for t in local][-2:] == [False, False], "the local copies' shares: 6% > 5%"
    assert [t["in_waited_exchanges"] for t in local[-2:]] == [0.01, 0.01]
    del table["native"], table["policies"]["off"]
    beyond = "exact: time beyond the expert block over the step, worst rank"
    left = [t["target"] for t in group_targets(table, "nvlink")]
    assert left == ["exact: maxvio 20 over maxvio 0", beyond, beyond], "without torch-native and off"


def test_skewed_routing_reaches_its_maxvio():
    balanced = skewed_routing(4, 64, 4, 256, 0.0, seed=0, device="cpu")
    assert balanced.sigma == 0.0 and balanced.maxvio < 1.0
    skewed = skewed_routing(4, 64, 4, 256, 5.0, seed=0, device="cpu")
    assert skewed.maxvio == pytest.approx(5.0, rel=0.1) and skewed.sigma > 0
    again = skewed_routing(4, 64, 4, 256, 5.0, seed=0, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(skewed.topk, again.topk, strict=True)), "deterministic"
    assert len(skewed.topk) == 4 and skewed.topk[0].shape == (256, 4) and skewed.topk[0].dtype == torch.int32


def test_native_experts_are_each_rows_expert_in_arrival_order():
    torch.manual_seed(0)
    experts = NativeEPExperts(3, 32, 16, torch.float32, torch.device("cpu"))
    x, e, w = torch.randn(20, 32), torch.randint(0, 3, (20,)), torch.rand(20)
    with torch.no_grad():
        got = experts(x, e, w)
        for i in range(20):
            gate, up = (experts.gate_up[e[i]] @ x[i]).chunk(2)
            want = experts.down[e[i]] @ (torch.nn.functional.silu(gate) * up * w[i])
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)


def test_native_rank_receives_every_route_to_its_home_experts():
    inputs = skewed_inputs()
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, ep_size=R,
                    max_tokens_per_rank=S, token_padding=4, dtype="float32", balance="off")
    hidden = [x.float() for x in inputs["hidden"]]
    step = group_step(cfg, inputs["topk"], [w.float() for w in inputs["weights"]], hidden,
                      [g.float() for g in inputs["grad_out"]])
    experts = NativeEPExperts(cfg.experts_per_rank, H, F, torch.float32, torch.device("cpu"))
    for rank in range(R):
        native = NativePlainEPRank(step, rank, experts)
        assert native.routes == int(step.plans[0].home_load[rank]) == int(step.plans[0].rank_load[rank])
        windows = native.step()
        assert len(windows) == 4 and all(end >= start for start, end in windows)
        assert native.leaf_x.grad.shape == (native.routes, H)
        assert len(native.send_token_n) == S * K
        assert int(native.remote_send_m.numel()) == int(route_matrices(step)["routes"][rank].sum()
                                                        - route_matrices(step)["routes"][rank, rank])


def test_smoke_run_writes_the_record_plot_and_table(tmp_path, capsys):
    main(["--smoke", "--groups", "deepseek-v3:8", "--maxvio", "0", "20", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    [record_path] = tmp_path.glob("ep-group-smoke-cpu-*.json")
    record = json.loads(record_path.read_text())
    assert record_path.with_suffix(".png").exists() and (tmp_path / "ep-group-smoke.md").exists()
    assert record["setup"]["link"]["bytes_per_s"] == 450e9 and "spec" in record["setup"]["link"]["source"]
    assert "NVLink latency" in record["setup"]["left_out"]
    [table] = record["results"]
    assert (table["model"], table["ranks"], table["experts"], table["top_k"]) == ("deepseek-v3", 8, 256, 8)
    assert [r["target"] for r in table["routing"]] == [0.0, 20.0]
    for policy in POLICIES:
        for run in table["policies"][policy]:
            assert [r["rank"] for r in run["ranks"]] == list(range(8))
            assert sum(r["routes"] for r in run["ranks"]) == 8 * 16 * 8, "the ranks' routes: the group's"
            assert run["slowest"]["nvlink"]["ms"] >= max(r["nvlink"]["ms"] for r in run["ranks"]) * 0.999
            assert all(set(r["bytes"]) == {f"{k}_{w}" for k in ("dispatch", "combine", "weights", "grads")
                                           for w in ("in", "out")} for r in run["ranks"])
    assert all("beyond_share" in r for run in table["policies"]["exact"] for r in run["ranks"])
    for rank in (r for run in table["policies"]["exact"] for r in run["ranks"]):
        waited = [i for i in range(len(PHASES)) if i not in (1, 4, 5)]  # no prefetch, nothing beside a GEMM
        # the CPU's reference exchange has no barriers: no window, so the waited exchanges' share is their
        # link time alone on the NVLink step, and nothing on the local one
        link_ms = sum(rank["link_ms"][i] for i in waited)
        assert rank["exchange_share"]["median"] == pytest.approx(link_ms / rank["nvlink"]["ms"], rel=1e-6)
        assert rank["exchange_share_local"] == {"median": 0.0, "min": 0.0, "max": 0.0}
        assert rank["link_share"] == rank["exchange_share"], "windows of no time: the link time alone"
    assert [n["baseline"] for n in table["native"]] == ["eager", "eager"], "smoke: no torch.compile"
    assert len(record["targets"]) == len(record["targets_local"]) == 1 + 2 + 2 + 2
    assert {t["link"] for t in record["targets"]} == {"nvlink"}
    assert "| deepseek-v3 R=8 | 20 (" in (tmp_path / "ep-group-smoke.md").read_text()
    assert [(g["rank"], g["pass"]) for g in table["gpu"]] == [(r, 1) for r in range(8)], "smoke: one pass"
    native_ranks = {n["rank"] for n in table["native"]}
    assert all(all(len(r["local"]["ms_samples"]) == 1 for r in run["ranks"]) for runs in
               table["policies"].values() for run in runs) and native_ranks <= set(range(8))
    same = table["cost_aware_plan_as"]
    assert len(same) == 2 and set(same) <= {"exact", "off", None}
    for i, other in enumerate(same):  # the same plan is timed once, under the other policy
        mine = table["policies"]["cost_aware"][i]["ranks"]
        assert [r.get("timed_as") for r in mine] == [other] * 8
        if other is not None:
            theirs = table["policies"][other][i]["ranks"]
            assert [r["nvlink"] for r in mine] == [r["nvlink"] for r in theirs]
    assert "PASS" in out or "MISS" in out


def test_smoke_run_with_the_prefetch_overlapped_records_it(tmp_path):
    """`--overlap-prefetch`: our layers split their first GEMMs (the torch backend's home groups, the wait,
    the slot groups): every code path runs, the record says so and each rank's row carries the time its
    prefetches hid under."""
    main(["--smoke", "--groups", "deepseek-v3:8", "--maxvio", "20", "--policies", "exact", "--out",
          str(tmp_path), "--overlap-prefetch"])
    [record_path] = tmp_path.glob("ep-group-smoke-overlap-cpu-*.json")
    record = json.loads(record_path.read_text())
    assert record["setup"]["overlap_prefetch"] is True
    [run] = record["results"][0]["policies"]["exact"]
    assert all(len(r["prefetch_hidden_ms"]) == 2 for r in run["ranks"])
    assert sum(r["slots_used"] for r in run["ranks"]) > 0, "maxvio 20: the plan fills slots"


def test_smoke_run_with_reduce_grad_behind_times_each_step_to_where_the_layer_hands_the_stream_back(tmp_path):
    """`--overlap-reduce-grad`: every rank's step of every maxvio arm (the arms share the rank's layer)
    records the time its reduce_grad ran on after the layer's backward returned (`reduce_behind`), and the
    record says what that leaves to the layers before it."""
    main(["--smoke", "--groups", "deepseek-v3:8", "--maxvio", "0", "20", "--policies", "exact", "--out",
          str(tmp_path), "--overlap-reduce-grad"])
    [record_path] = tmp_path.glob("ep-group-smoke-reduce-behind-cpu-*.json")
    record = json.loads(record_path.read_text())
    assert record["setup"]["overlap_reduce_grad"] is True
    assert "overlap_reduce_grad" in record["setup"]["left_out"]
    runs = record["results"][0]["policies"]["exact"]
    assert len(runs) == 2
    assert all(len(r["reduce_behind"]["ms_samples"]) == 1 for run in runs for r in run["ranks"])


def test_smoke_run_with_shared_experts_times_them_in_every_step_and_block(tmp_path):
    """`--shared-experts`: our layers keep the model's shared experts (beside the routed step where the
    layer overlaps them), torch-native's run them after its routed experts; every exact rank's expert block
    times them too (`block_calls`), and the record no longer lists them as left out."""
    main(["--smoke", "--groups", "deepseek-v3:8", "--maxvio", "20", "--policies", "exact", "--out",
          str(tmp_path), "--shared-experts"])
    [record_path] = tmp_path.glob("ep-group-smoke-shared-cpu-*.json")
    record = json.loads(record_path.read_text())
    assert record["setup"]["shared_experts"] is True
    assert "shared experts" not in record["setup"]["left_out"] and "the router" in record["setup"]["left_out"]
    [run] = record["results"][0]["policies"]["exact"]
    for row in run["ranks"]:
        assert list(row["block_calls"])[-2:] == ["shared experts fwd", "shared experts bwd"]
    assert "routed and shared experts" in (tmp_path / "ep-group-smoke-shared.md").read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (["--repeat", "4"], "--repeat must be >= 5"),
    (["--smoke", "--groups", "kimi-k2:5"], "--groups kimi-k2:5"),
    (["--smoke", "--groups", "kimi-k2"], "a group is MODEL:RANKS"),
])
def test_bad_command_lines_fail_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_group_configs_keep_the_models_shapes_and_drop_shared_experts():
    cfg = Group("kimi-k2", 16).config("cost_aware")
    assert (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, cfg.top_k, cfg.ep_size) == (
        7168, 2048, 384, 8, 16)
    assert cfg.max_tokens_per_rank == 8192 and cfg.balance == "cost_aware"
    assert cfg.shared_experts.num_shared_experts == 0 and cfg.prefetch_slots == 24
    assert Repeats(1, 5).repeat == 5


class Arm:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def run(self, timed: bool) -> None:
        self.log.append((self.name, timed))


def test_a_segments_arms_alternate_and_take_every_place_equally():
    log: list = []
    Segment("p", [Arm(a, log) for a in "abc"], lambda: None, lambda: None).rounds(warmup=1, timed=3)
    assert log[:3] == [("a", False), ("b", False), ("c", False)], "one untimed round first"
    rounds = ["".join(name for name, _ in log[i:i + 3]) for i in range(3, 12, 3)]
    assert rounds == ["bca", "cab", "abc"] and all(timed for _, timed in log[3:])


@pytest.mark.parametrize(("repeat", "split"), [(6, (3, 3)), (5, (3, 2)), (1, (1, 0))])
def test_the_timed_steps_split_over_two_mirrored_passes(repeat, split):
    assert Repeats(1, repeat).split() == split and sum(split) == repeat


def test_idle_gaps_are_the_time_no_launch_covers():
    timeline = [("a", 0.0, 2.0), ("side", 1.0, 3.0), ("b", 4.0, 5.0), ("c", 5.0, 6.0), ("d", 8.5, 9.0)]
    idle = idle_gaps(timeline, top=1)
    assert (idle["span_ms"], idle["busy_ms"], idle["idle_ms"]) == (9.0, 5.5, 3.5)
    assert idle["gaps"] == [{"ms": 2.5, "after": "c", "before": "d"}]
    assert idle_gaps([])["idle_ms"] == 0.0


def test_same_plans_compares_every_rank_of_two_policies():
    inputs = skewed_inputs(seed=1)

    def step(balance: str):
        return group_step(config(balance), inputs["topk"], inputs["weights"], inputs["hidden"],
                          inputs["grad_out"])

    exact, off = step("exact"), step("off")
    assert same_plans(exact, step("exact")) and same_plans(off, step("off"))
    assert not same_plans(exact, off), "skewed routing: exact replicates, off does not"
