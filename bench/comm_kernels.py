"""Where one rank's serving communication goes, kernel by kernel: the device time of every kernel of one
R = 1 `MoECommunicator.dispatch` + `combine(..., out=)` for s = 1, 2, 4, ... S tokens (issue 14's 40 us
bound is spent on these).

Per token count: the step (dispatch + combine of a static expert-output tensor, as `bench.serving`'s comm
graph) is captured in a CUDA graph; its replay is timed with CUDA events (median of `--reps`), then
`torch.profiler` records `--reps` eager steps and `--reps` replays, and each kernel's device time is
averaged per step. The gap between the replay time and the kernels' sum is the graph's launch overhead.

    python -m bench.comm_kernels                   # CPU smoke test (tiny shapes; torch ops, host time)
    python -m bench.comm_kernels --device cuda --hidden 7168 --experts 256 --top-k 8 --tokens 512

Writes `bench/results/comm-kernels-<device>-<date>-<commit>.json` and prints the table. On the CPU there is
no graph and no kernel: the smoke test profiles the eager step's top-level torch ops on the host.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import captured_graph, spread, timings, write_record
from bench.serving import token_counts
from moonep_moe.comm.world import single_world
from moonep_moe.communicator import MoECommunicator


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8, help="S, the largest step (the last row)")
    parser.add_argument("--token-padding", type=int, default=None, help="default: the communicator's")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=10, help="timed replays and profiled steps (>= 5)")
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results)")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error(f"--reps {args.reps}: at least 5 (a median and its spread)")
    return args


def kernel_times(run: Callable[[], object], steps: int, cuda: bool) -> dict[str, float]:
    """Microseconds per step of each kernel `run()` launches (`steps` runs profiled): device time on CUDA;
    on the CPU each top-level torch op's host time."""
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            run()
        if cuda:
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and (event.device_type != torch.autograd.DeviceType.CPU or event.cpu_parent is not None):
            continue
        us = event.device_time if cuda else event.cpu_time
        times[event.name] = times.get(event.name, 0.0) + us / steps
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def row_for(comm: MoECommunicator, s: int, args: argparse.Namespace, gen: torch.Generator) -> dict:
    """One token count's row: the step's kernels (eager; and replayed, with the replay time, on CUDA)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hidden_sh = torch.randn(s, args.hidden, generator=gen, device=device, dtype=dtype)
    router_he = torch.randn(args.hidden, args.experts, generator=gen, device=device)
    scores_sk, ids_sk = torch.topk(hidden_sh.float() @ router_he, args.top_k, dim=-1)
    weights_sk, ids_sk, out_sh = torch.softmax(scores_sk, -1), ids_sk.int(), torch.empty_like(hidden_sh)
    bucket = comm.capacity_for(s)
    out, handle = comm.dispatch(hidden_sh, ids_sk, weights_sk, capacity=bucket)
    expert_out_nvsh = out.tokens_nvsh.clone()  # an engine's expert outputs: a static tensor
    comm.combine(expert_out_nvsh, handle, out=out_sh)

    def step() -> None:
        _, step_handle = comm.dispatch(hidden_sh, ids_sk, weights_sk, capacity=bucket)
        comm.combine(expert_out_nvsh, step_handle, out=out_sh)

    cuda = device.type == "cuda"
    row = dict(tokens=s, capacity=bucket, rows=expert_out_nvsh.shape[0],
               eager=kernel_times(step, args.reps, cuda))
    if cuda:
        graph = captured_graph(step)
        row["graph"] = spread(timings(graph.replay, 3, args.reps))
        row["replayed"] = kernel_times(graph.replay, args.reps, cuda)
    return row


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    device = torch.device(args.device)
    padding = {} if args.token_padding is None else {"token_padding": args.token_padding}
    comm = MoECommunicator(world=single_world(device), hidden_size=args.hidden, num_experts=args.experts,
                           top_k=args.top_k, max_tokens_per_rank=args.tokens, dtype=args.dtype,
                           check_expert_ids=False, **padding)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        rows = [row_for(comm, s, args, gen) for s in token_counts(args.tokens)]
    comm.destroy()
    shape = dict(H=args.hidden, E=args.experts, K=args.top_k, S=args.tokens, dtype=args.dtype,
                 token_padding=comm.config.token_padding)
    path = write_record("comm-kernels", {}, rows, args.out, ran_on=device, shape=shape, reps=args.reps,
                        note=("CPU smoke test: host time of torch ops, these numbers mean nothing"
                              if device.type == "cpu" else
                              "device time per step, us; graph: replay time, ms"))
    for row in rows:
        kernels = row.get("replayed", row["eager"])
        head = f"s={row['tokens']:>5} ({row['rows']} rows): kernels {sum(kernels.values()):7.1f} us"
        if "graph" in row:
            head += f", graph replay {row['graph']['ms'] * 1e3:7.1f} us"
        print(head)
        for name, us in kernels.items():
            print(f"    {us:8.2f} us  {name[:100]}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
