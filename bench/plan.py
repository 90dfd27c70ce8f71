"""Planner benchmark: time to build a rank's plan, host reference vs the sync-free device planner.

For R ranks with S tokens each routing to K of E experts (expert popularity `exp(N(0, sigma))`, one draw
shared by the group, tokens drawn without replacement per rank), it times on rank 0's routes:

- `reference_global_s`: `plan_global(counts_re.tolist(), ...)`, the host reference of the global part
  (on CUDA including the device-to-host read of the histogram);
- `device_global_s`: `plan_global_device`, the same global plan computed with fixed-shape device ops;
- `route_destinations_s`: the rank's `dst` from the global plan;
- `plan_routes_s`: the whole plan as a step builds it (`plan_routes`: on CUDA the Triton planner, elsewhere
  `plan_global_device` + `route_destinations`);
- `plan_routes_graph_s` (CUDA only): the same, captured once in a CUDA graph and replayed.

On CUDA also the Triton planner (`moonep_moe.plan.triton`, target 20 us for the whole plan at S=8192
K=8 E=384 R=8 B=48 tp=128), each result checked field by field against the torch planner first. Kernel
times are device times (`bench.common.graph_timed`: 20 calls captured in a CUDA graph and replayed, no host
launch time):

- `triton_global_s`: launch 1 (the global plan beside the token blocks' positions and histograms);
- `triton_destinations_s`: launch 2 (every route's `dst`);
- `triton_plan_s`: both launches (the planner's device time: what the 20 us target is about); one launch
  when one rank's routes fit one token block (a decode step: `constants["FUSED"]`), and then
  `triton_plan_unfused_s`, the same plan as two launches, its baseline;
- `triton_plan_routes_s`: the whole `plan_routes_triton` (allocation + both launches), eager, host included;
- `triton_sweep`: `triton_plan_s` of every launch shape in `--sweep` (the product of the values it lists for
  `prepare`'s tuning arguments), each plan checked field by field first; the package's defaults are set
  from it.

Medians over `--iters` runs after `--warmup`: CUDA events on CUDA (`bench.common.timed`), wall clock on the
CPU. Every device result is checked against the reference before timing.

    python -m bench.plan                                   # CPU, S=8192 K=8 E=384 R=8
    python -m bench.plan --device cuda                     # the 20 us target is on an H200
    python -m bench.plan --device cuda --ranks 1 --experts 256 --tokens 1 2 4 8 16 --token-padding 16 \
        --sweep '{}'                                       # decode steps: the fused one-program plan

Writes `bench/results/plan-<device>-<date>-<commit>.json` (device, commit, command, rows per sigma).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch

from bench.common import graph_timed, measure_limits, timed, write_record
from moonep_moe.base.sizes import default_slots, rows_capacity
from moonep_moe.plan.device import plan_global_device, route_destinations
from moonep_moe.plan.planner import plan_routes
from moonep_moe.plan.reference import plan_global
from moonep_moe.plan.types import MoonEPCommPlan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--ranks", type=int, default=8, help="R (default 8)")
    parser.add_argument("--experts", type=int, default=384, help="E (default 384)")
    parser.add_argument("--top-k", type=int, default=8, help="K (default 8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192],
                        help="S tokens per rank, one row per value and sigma (default 8192)")
    parser.add_argument("--slots", type=int, default=None, help="B slots per rank (default E/R)")
    parser.add_argument("--token-padding", type=int, default=128, help="tp (default 128)")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 1.0, 3.0],
                        help="expert popularity skews exp(N(0, sigma)) (default 0 1 3)")
    sweep = {"routes_per_block": [256, 512, 1024], "plan_warps": [2, 4, 8], "segment_ranks": [2, 8]}
    parser.add_argument("--sweep", type=json.loads, default=sweep,
                        help="JSON {tuning argument of prepare: [values]}: the launch shapes to time")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results)")
    return parser.parse_args(argv)


def routing(args: argparse.Namespace, tokens: int, sigma: float,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(counts_re [R, E] int64, topk_experts_sk [S, K] int64 of rank 0)` on `device`, S = `tokens`."""
    gen = torch.Generator().manual_seed(0)
    popularity_e = torch.exp(torch.randn(args.experts, generator=gen, dtype=torch.float64) * sigma)
    topk_rsk = [torch.multinomial(popularity_e.expand(tokens, -1), args.top_k, generator=gen)
                for _ in range(args.ranks)]
    counts_re = torch.stack([torch.zeros(args.experts, dtype=torch.int64).scatter_add_(
        0, topk_sk.reshape(-1), torch.ones(topk_sk.numel(), dtype=torch.int64)) for topk_sk in topk_rsk])
    return counts_re.to(device), topk_rsk[0].to(device)


def wall_time(fn: Callable[[], object], warmup: int, repeat: int) -> float:
    """Median wall-clock seconds of `fn()` (the CPU counterpart of `bench.common.timed`)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_plan(args: argparse.Namespace, tokens: int, sigma: float) -> dict[str, float]:
    """One row: S = `tokens`, the routing's skew and the median time of each planner stage (module
    docstring)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    num_slots = default_slots(args.experts, args.ranks) if args.slots is None else args.slots
    tp = args.token_padding
    NvS = rows_capacity(tokens, args.top_k, args.ranks, args.experts, num_slots, tp)
    kwargs = dict(rank=0, num_slots=num_slots, token_padding=tp, rows_per_rank=NvS)
    counts_re, topk_sk = routing(args, tokens, sigma, device)
    ref = plan_global(counts_re.tolist(), num_slots, tp)
    glob = plan_global_device(counts_re, num_slots, tp)
    if glob.alloc_re.tolist() != ref.alloc or glob.cu_seqlens_rg.tolist() != ref.cu_seqlens:
        raise AssertionError(f"sigma={sigma}: the device plan differs from the reference")

    def measure(fn: Callable[[], object]) -> float:
        return timed(fn, args.warmup, args.iters) if cuda else wall_time(fn, args.warmup, args.iters)

    expert_load_e = counts_re.sum(0).double()
    row = dict(R=args.ranks, E=args.experts, K=args.top_k, S=tokens, B=num_slots, tp=tp, NvS=NvS,
               sigma=sigma, maxvio=float(expert_load_e.max() / expert_load_e.mean() - 1),
               reference_global_s=measure(lambda: plan_global(counts_re.tolist(), num_slots, tp)),
               device_global_s=measure(lambda: plan_global_device(counts_re, num_slots, tp)),
               route_destinations_s=measure(lambda: route_destinations(
                   topk_sk, counts_re, glob.alloc_re, glob.row_base_re, 0, NvS)),
               plan_routes_s=measure(lambda: plan_routes(counts_re, topk_sk, **kwargs)))
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan_routes(counts_re, topk_sk, **kwargs)
        row["plan_routes_graph_s"] = measure(graph.replay)
        row.update(time_triton(counts_re, topk_sk, kwargs, measure, args.iters, args.sweep))
    return row


def time_triton(counts_re: torch.Tensor, topk_sk: torch.Tensor, kwargs: dict,
                measure: Callable[[Callable[[], object]], float], iters: int,
                sweep: dict[str, list]) -> dict[str, object]:
    """The Triton planner's launches (module docstring), after checking its plan against the torch planner."""
    from moonep_moe.plan.triton import PlanLaunch, plan_routes_triton, prepare

    expected = plan_routes(counts_re.cpu(), topk_sk.cpu(), **kwargs)

    def check(plan: MoonEPCommPlan, what: str) -> None:
        for name in (f.name for f in fields(MoonEPCommPlan)):
            a, b = getattr(plan, name), getattr(expected, name)
            if not (torch.equal(a.cpu(), b) if isinstance(b, torch.Tensor) else a == b):
                raise AssertionError(f"the Triton plan ({what}) differs from the torch plan in {name}")

    check(plan_routes_triton(counts_re, topk_sk, **kwargs), "defaults")
    launch = prepare(counts_re, topk_sk, **kwargs)

    def both(launch: PlanLaunch) -> Callable[[], None]:
        def run() -> None:
            launch.plan_group()
            launch.route_destinations()
        return run

    row = dict(triton_global_s=graph_timed(launch.plan_group, repeat=iters),
               triton_destinations_s=graph_timed(launch.route_destinations, repeat=iters),
               triton_plan_s=graph_timed(both(launch), repeat=iters),
               triton_plan_routes_s=measure(lambda: plan_routes_triton(counts_re, topk_sk, **kwargs)))
    row["triton_meets_20us"] = row["triton_plan_s"] <= 20e-6
    if launch.constants["FUSED"]:  # the same launch as two: the fused program's baseline, checked first
        unfused = prepare(counts_re, topk_sk, **kwargs)
        unfused.constants["FUSED"] = False
        both(unfused)()
        check(unfused.plan, "unfused")
        row["triton_plan_unfused_s"] = graph_timed(both(unfused), repeat=iters)
    row["triton_sweep"] = []
    for values in itertools.product(*sweep.values()):
        tuning = dict(zip(sweep, values, strict=True))
        launch = prepare(counts_re, topk_sk, **kwargs, **tuning)
        both(launch)()
        check(launch.plan, str(tuning))
        row["triton_sweep"].append(dict(**tuning, triton_plan_s=graph_timed(both(launch), repeat=iters)))
    return row


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    rows = []
    for tokens, sigma in itertools.product(args.tokens, args.sigmas):
        rows.append(time_plan(args, tokens, sigma))
        print({k: f"{v * 1e6:.1f} us" if k.endswith("_s") else v for k, v in rows[-1].items()
               if k != "triton_sweep"})
        for shape in rows[-1].get("triton_sweep", []):
            print(f"  sweep {shape}")
    limits = measure_limits() if args.device.startswith("cuda") else {}
    path = write_record("plan", limits, rows, args.out, ran_on=args.device)
    print(path)
    return path


if __name__ == "__main__":
    main()
