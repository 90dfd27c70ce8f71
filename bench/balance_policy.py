"""Replication policies in a cost model: the hottest rank's modelled time and the bytes moved per layer step.

A MODEL, computed on the CPU (no GPU is timed): for R ranks with s tokens each (s = 1, 2, 4, ... S) routing
to K of E experts with a given expert-level maxvio (the hottest expert's load / the mean - 1: `hot` experts,
all homed on rank 0, each take (1 + maxvio) x the mean, capped at s per source rank as top-k routing
allows; the other routes spread evenly), it plans the group's global part (`plan_global_device`) under
`exact` (c = 0), `cost_aware` (c = `replica_cost_routes`) and `off` (plain EP) and reports per policy:

- `hottest_us`: max over ranks of (routes computed x t_route + weight transfers over the rank's link x
  t_transfer); transfers are assumed to overlap with nothing (the worst case) and a donor's transfers to
  share its link;
- `moved_bytes`: weight bytes moved in the group (replicas x W_e); `hottest_link_bytes`: those over the
  hottest rank's link.

Two models: `serving` (forward only: t_route = 6 H H' / rate, W_e = 3 H H' bytes) and `training` (forward and
backward: 3x the FLOPs a route; prefetched twice and fp32 gradients back: W_e = 3 H H' (2 bytes + 4)).

Assumed rates (stated in the record): the GEMM rate is the dense bf16 rate measured on the H200
(bench/results/gemm-NVIDIA_H200-20261129.json, `limits.dense_bf16_flops_per_s` = 775.8 TFLOP/s; the grouped
GEMMs reached 537 there); the link bandwidth is H200 NVLink's 900 GB/s bidirectional SPEC number, 450 GB/s a
direction, not measured here. The linear GEMM model is optimistic for few routes (a decode GEMM reads the
whole expert's weights whatever its rows), so it overstates what replication saves at small s.

    python -m bench.balance_policy                       # DeepSeek-V3 shape, R=8, s = 1 .. 4096
    python -m bench.balance_policy --link-gbs 900 --gemm-tflops 537

Writes `bench/results/balance_policy-cpu-<date>-<commit>.json`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from bench.common import write_record
from moonep_moe.plan.device import plan_global_device
from moonep_moe.plan.policies import NO_REPLICATION, replica_cost_routes

MEASURED_GEMM_TFLOPS = 775.8
"""Dense bf16 GEMM rate on the H200, bench/results/gemm-NVIDIA_H200-20261129.json (`limits`)."""
NVLINK_SPEC_GBS = 450.0
"""H200 NVLink: 900 GB/s bidirectional (spec), 450 GB/s a direction."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="S: the largest s (tokens per rank)")
    parser.add_argument("--maxvio", type=float, nargs="+", default=[0, 1, 2, 5, 10, 20])
    parser.add_argument("--hot", type=int, default=4, help="hot experts (homed on rank 0)")
    parser.add_argument("--link-gbs", type=float, default=NVLINK_SPEC_GBS)
    parser.add_argument("--gemm-tflops", type=float, default=MEASURED_GEMM_TFLOPS)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def histogram(R: int, E: int, K: int, s: int, maxvio: float, hot: int) -> torch.Tensor:
    """`[R, E]`: every rank sends `hot` experts (1 + maxvio) x the mean each (at most s), the rest evenly."""
    routes = s * K
    hot_each = min(s, round((1 + maxvio) * routes / E))
    rest = routes - hot * hot_each
    counts_re = torch.zeros(R, E, dtype=torch.int64)
    counts_re[:, :hot] = hot_each
    counts_re[:, hot:] = rest // (E - hot)
    for r in range(R):  # the remainder one route each, starting at a different expert on every rank
        cold = hot + (torch.arange(rest % (E - hot)) + r * 37) % (E - hot)
        counts_re[r, cold] += 1
    return counts_re


def model(args: argparse.Namespace, training: bool) -> dict[str, float]:
    """t_route, t_transfer (s) and the transfer's bytes of one model, and its c (routes a transfer)."""
    hh = args.hidden * args.ffn
    passes = 3 if training else 1
    weight_bytes = 3 * hh * (2 * args.dtype_bytes + 4 if training else args.dtype_bytes)
    t_route = passes * 6 * hh / (args.gemm_tflops * 1e12)
    t_transfer = weight_bytes / (args.link_gbs * 1e9)
    return dict(t_route_s=t_route, t_transfer_s=t_transfer, transfer_bytes=weight_bytes,
                replica_cost=max(1, math.ceil(t_transfer / t_route)))


def evaluate(counts_re: torch.Tensor, cost: int, m: dict[str, float]) -> dict[str, float]:
    """The plan under `cost` and its modelled hottest rank."""
    R, E = counts_re.shape
    plan = plan_global_device(counts_re, E // R, 1, cost)
    home_re = torch.arange(E)[None, :] // (E // R) == torch.arange(R)[:, None]
    replica_re = (plan.alloc_re > 0) & ~home_re
    transfers_r = replica_re.sum(1) + replica_re.sum(0).view(R, -1).sum(1)
    time_r = plan.alloc_re.sum(1) * m["t_route_s"] + transfers_r * m["t_transfer_s"]
    hottest = int(time_r.argmax())
    return dict(hottest_us=float(time_r.max()) * 1e6, hottest_routes=int(plan.alloc_re[hottest].sum()),
                replicas=int(replica_re.sum()), moved_bytes=int(replica_re.sum()) * m["transfer_bytes"],
                hottest_link_bytes=int(transfers_r[hottest]) * m["transfer_bytes"])


def rows(args: argparse.Namespace) -> list[dict]:
    out = []
    sizes = [2**i for i in range(int(math.log2(args.tokens)) + 1)]
    for mode in ("serving", "training"):
        m = model(args, training=mode == "training")
        policies = dict(exact=0, cost_aware=m["replica_cost"], off=NO_REPLICATION)
        for maxvio in args.maxvio:
            for s in sizes:
                counts_re = histogram(args.ranks, args.experts, args.top_k, s, maxvio, args.hot)
                load_e = counts_re.sum(0).double()
                row = dict(mode=mode, s=s, maxvio=maxvio,
                           maxvio_achieved=float(load_e.max() / load_e.mean() - 1))
                for name, cost in policies.items():
                    row[name] = evaluate(counts_re, cost, m)
                out.append(row)
    return out


def print_table(results: list[dict]) -> None:
    print("MODEL (CPU, no GPU timed): hottest rank's modelled time in us / weight bytes moved in the group")
    print(f"{'mode':8} {'maxvio':>6} {'s':>5} | {'exact':>22} | {'cost_aware':>22} | {'off (plain EP)':>14}")
    for r in results:
        cells = [f"{r[p]['hottest_us']:9.1f} {r[p]['moved_bytes'] / 1e9:8.2f} GB"
                 for p in ("exact", "cost_aware")]
        print(f"{r['mode']:8} {r['maxvio']:6.0f} {r['s']:5d} | {cells[0]:>22} | {cells[1]:>22} | "
              f"{r['off']['hottest_us']:9.1f} us")


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    results = rows(args)
    print_table(results)
    spec = "H200 NVLink 900 GB/s bidirectional SPEC, 450 GB/s a direction (not measured)"
    assumptions = dict(
        kind="model: computed on the CPU from the planner's plans and a linear cost model; nothing timed",
        gemm_tflops=args.gemm_tflops, gemm_source=("dense bf16 rate measured on the H200, bench/results/"
                                                   "gemm-NVIDIA_H200-20261129.json limits"
                                                   if args.gemm_tflops == MEASURED_GEMM_TFLOPS else "given"),
        link_gbs=args.link_gbs, link_source=spec if args.link_gbs == NVLINK_SPEC_GBS else "given",
        overlap="none: transfers overlap with nothing (worst case); a donor's transfers share its link",
        serving=model(args, training=False), training=model(args, training=True),
        replica_cost_config=replica_cost_routes(args.dtype_bytes, args.link_gbs * 1e9,
                                                args.gemm_tflops * 1e12))
    setup = dict(ranks=args.ranks, experts=args.experts, top_k=args.top_k, hidden=args.hidden, ffn=args.ffn,
                 dtype_bytes=args.dtype_bytes, slots=args.experts // args.ranks, hot_experts=args.hot)
    path = write_record("balance_policy", {}, results, args.out, model=True, assumptions=assumptions,
                        setup=setup)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
