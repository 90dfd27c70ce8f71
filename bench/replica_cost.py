"""What a replica costs a rank's step, fitted from `bench.ep_group` records: the measurement behind
`balance='cost_aware'`'s `replica_cost` (c, in routes).

    python -m bench.replica_cost bench/results/ep-group-shared-reduce-behind-NVIDIA_H200-20261205-929a38a.json

A CPU analysis of GPU records (nothing is timed here). Every rank of every policy and maxvio a record timed
is one observation (rows a policy took from another's timing, `timed_as`, are left out: they repeat it):
its step on the NVLink model (`nvlink`, the median of its steps, ms) against the routes it computes, the
replicas it receives (`slots_used`) and the replicas of its own experts that peers pull (`replicas_out`),
fitted by least squares:

    step_ms = base + per_route * routes + per_slot * slots_used + per_replica_out * replicas_out

`per_slot` and `per_replica_out` divided by `per_route` are a replica's costs in routes on the receiving
and on the sending rank, what the planner's c stands for (`modelled_load` charges c on both sides, as if no
transfer overlapped anything). Each coefficient comes with its standard error (from the residuals' spread):
the ranks' steps vary by about a millisecond run to run, so a record of 80-100 rank steps bounds a
replica's cost to a few hundred routes either way. The plans differ from rank to rank in more than these
three numbers (which experts, how many rows a slot holds), which the residuals also carry.

Writes `bench/results/replica-cost-cpu-<date>-<commit>.json`: per record its setup (the options it ran
with), the record's own c (`replica_cost["cost_aware"]`) and the fit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.common import write_record

TERMS = ("base", "per_route", "per_slot", "per_replica_out")
"""The fitted coefficients, in the order of `observations`' columns (ms, ms per route, ms per replica)."""


def observations(record: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x [n, 4], step_ms [n])` float64: one row per rank step the record timed (`TERMS`' columns: 1,
    routes, slots_used, replicas_out), over every group, policy and maxvio; rows timed as another
    policy's (`timed_as`) left out."""
    rows, steps = [], []
    for group in record["results"]:
        for runs in group["policies"].values():
            for run in runs:
                for rank in run["ranks"]:
                    if rank.get("timed_as"):
                        continue
                    rows.append([1.0, rank["routes"], rank["slots_used"], rank["replicas_out"]])
                    steps.append(rank["nvlink"]["ms"])
    return torch.tensor(rows, dtype=torch.float64), torch.tensor(steps, dtype=torch.float64)


def fit(x: torch.Tensor, step_ms: torch.Tensor) -> dict:
    """Least squares of `step_ms` on `x`: each of `TERMS` with its standard error (`<term>_se`), the
    residuals' standard deviation (`residual_ms`) and the replica's costs in routes (`slot_routes`,
    `replica_out_routes`, each with `_se` by first-order propagation over `per_route`). Raises ValueError
    where the observations cannot fix four coefficients (fewer rows, or columns that never vary)."""
    n, terms = x.shape
    if n <= terms or torch.linalg.matrix_rank(x) < terms:
        raise ValueError(f"{n} rank steps cannot fit {terms} coefficients: the routes, slots and replicas "
                         "out must vary across them (a record with exact and off, several maxvio)")
    coef = torch.linalg.lstsq(x, step_ms[:, None]).solution.squeeze(1)
    residual = step_ms - x @ coef
    variance = float(residual.square().sum()) / (n - terms)
    cov = variance * torch.linalg.inv(x.T @ x)
    se = cov.diagonal().sqrt()
    out = {name: float(coef[i]) for i, name in enumerate(TERMS)}
    out |= {f"{name}_se": float(se[i]) for i, name in enumerate(TERMS)}
    out["residual_ms"] = variance ** 0.5
    out["observations"] = n
    per_route = float(coef[1])
    for name, i in (("slot_routes", 2), ("replica_out_routes", 3)):
        ratio = float(coef[i]) / per_route
        # d(a/b) = da/b - a db/b^2, with the covariance of a and b
        var = (cov[i, i] / per_route ** 2 - 2 * ratio * cov[i, 1] / per_route ** 2
               + ratio ** 2 * cov[1, 1] / per_route ** 2)
        out[name], out[f"{name}_se"] = ratio, float(var.clamp(min=0).sqrt())
    return out


def record_row(path: Path) -> dict:
    """One record's row: its name, device, commit, the options it ran with, its own c and the fit."""
    record = json.loads(path.read_text())
    setup = record.get("setup", {})
    groups = record["results"]
    return {"record": path.name, "device": record.get("device"), "commit": record.get("commit"),
            "groups": [f"{g['model']}:{g['ranks']}" for g in groups],
            "options": {key: setup.get(key) for key in ("shared_experts", "overlap_prefetch",
                                                        "overlap_reduce_grad")},
            "replica_cost": [g.get("replica_cost", {}).get("cost_aware") for g in groups],
            "fit": fit(*observations(record))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", type=Path, help="bench.ep_group records (JSON)")
    parser.add_argument("--out", type=Path, default=None, help="folder of the record (default bench/results)")
    args = parser.parse_args(argv)
    rows = [record_row(path) for path in args.records]
    for row in rows:
        f = row["fit"]
        print(f"{row['record']}: {f['observations']} rank steps, {f['per_route'] * 1e3:.4f} "
              f"(+-{f['per_route_se'] * 1e3:.4f}) ms per 1000 routes; a replica received "
              f"{f['per_slot']:.3f} (+-{f['per_slot_se']:.3f}) ms = {f['slot_routes']:.0f} "
              f"(+-{f['slot_routes_se']:.0f}) routes, sent {f['per_replica_out']:.3f} "
              f"(+-{f['per_replica_out_se']:.3f}) ms = {f['replica_out_routes']:.0f} "
              f"(+-{f['replica_out_routes_se']:.0f}) routes; residuals {f['residual_ms']:.2f} ms; "
              f"the record's c {row['replica_cost']}", flush=True)
    path = write_record("replica-cost", {}, rows, args.out, ran_on="cpu", terms=list(TERMS))
    print(f"record: {path}")


if __name__ == "__main__":
    main()
