"""`bench.replica_cost`: the fit of a replica's cost from `bench.ep_group` records, on synthetic records whose
rank steps follow known coefficients."""

import json

import pytest
import torch

from bench.replica_cost import fit, main, observations

BASE, PER_ROUTE, PER_SLOT, PER_OUT = 5.0, 4e-4, 0.4, 0.1  # ms, ms per route, ms per replica in / out


def synthetic_record(noise_ms: float, seed: int = 0) -> dict:
    """Two policies over three maxvio of eight ranks each, the steps `BASE + PER_ROUTE routes + PER_SLOT
    slots + PER_OUT replicas out` plus Gaussian noise; a third policy timed as `off` (a copy to skip)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    runs = {}
    for policy in ("exact", "off"):
        runs[policy] = []
        for _ in range(3):
            ranks = []
            for rank in range(8):
                routes = draw(50_000, 80_000) if policy == "off" else 65_536
                slots = 0 if policy == "off" else draw(0, 5)
                out = 0 if policy == "off" else draw(0, 5)
                ms = BASE + PER_ROUTE * routes + PER_SLOT * slots + PER_OUT * out
                ms += noise_ms * float(torch.randn(1, generator=gen))
                ranks.append({"rank": rank, "routes": routes, "slots_used": slots, "replicas_out": out,
                              "nvlink": {"ms": ms}})
            runs[policy].append({"ranks": ranks})
    runs["cost_aware"] = [{"ranks": [{**r, "timed_as": "off", "nvlink": {"ms": 1e6}} for r in run["ranks"]]}
                          for run in runs["off"]]
    return {"device": "NVIDIA H200", "commit": "abc1234", "setup": {"overlap_prefetch": False},
            "results": [{"model": "deepseek-v3", "ranks": 8, "policies": runs,
                         "replica_cost": {"cost_aware": 1724}}]}


def test_the_fit_recovers_exact_coefficients_and_skips_rows_timed_as_another_policy():
    x, steps = observations(synthetic_record(noise_ms=0.0))
    assert x.shape == (48, 4), "two timed policies x three maxvio x eight ranks; cost_aware's copies left out"
    result = fit(x, steps)
    for name, want in zip(("base", "per_route", "per_slot", "per_replica_out"),
                          (BASE, PER_ROUTE, PER_SLOT, PER_OUT), strict=True):
        assert result[name] == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert result["slot_routes"] == pytest.approx(PER_SLOT / PER_ROUTE, rel=1e-6)
    assert result["replica_out_routes"] == pytest.approx(PER_OUT / PER_ROUTE, rel=1e-6)


def test_with_noise_the_standard_errors_cover_the_true_costs():
    """Over several noisy records the true cost of a replica received lies within three standard errors of
    the fit, and the errors shrink with less noise."""
    for seed in range(5):
        noisy = fit(*observations(synthetic_record(noise_ms=0.3, seed=seed)))
        assert abs(noisy["slot_routes"] - PER_SLOT / PER_ROUTE) < 3 * noisy["slot_routes_se"]
        quiet = fit(*observations(synthetic_record(noise_ms=0.03, seed=seed)))
        assert quiet["slot_routes_se"] < noisy["slot_routes_se"] / 5


def test_a_record_whose_ranks_never_vary_in_replicas_cannot_be_fitted():
    record = synthetic_record(noise_ms=0.0)
    del record["results"][0]["policies"]["exact"]  # off alone: no slot, no replica out
    with pytest.raises(ValueError, match="must vary"):
        fit(*observations(record))


def test_the_command_writes_a_record_per_input(tmp_path, capsys):
    path = tmp_path / "ep-group-a.json"
    path.write_text(json.dumps(synthetic_record(noise_ms=0.1)))
    main([str(path), "--out", str(tmp_path / "out")])
    [written] = (tmp_path / "out").glob("replica-cost-cpu-*.json")
    row = json.loads(written.read_text())["results"][0]
    assert row["record"] == "ep-group-a.json" and row["replica_cost"] == [1724]
    assert row["fit"]["observations"] == 48
    assert "routes" in capsys.readouterr().out
