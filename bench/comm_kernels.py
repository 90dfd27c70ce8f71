"""Where one rank's serving communication goes, kernel by kernel: the device time of every kernel of one
R = 1 `MoECommunicator.dispatch` + `combine(..., out=)` for s = 1, 2, 4, ... S tokens (the serving
target's 40 us bound is spent on these).

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
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import captured_graph, cuda_kernels, spread, timings, write_record
from bench.serving import comm_step, static_expert_out, step_inputs, token_counts
from moonep_moe.engine.communicator import MoECommunicator
from moonep_moe.transport.threads import single_world


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
    """Microseconds per step of each kernel `run()` launches (`steps` runs profiled), most first: device
    time on CUDA (`cuda_kernels`); on the CPU each top-level torch op's host time."""
    times: dict[str, float] = {}
    if cuda:
        for name, ms in cuda_kernels(lambda: [run() for _ in range(steps)]):
            times[name] = times.get(name, 0.0) + ms * 1e3 / steps
    else:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                run()
        for event in prof.events():
            if event.cpu_parent is None:
                times[event.name] = times.get(event.name, 0.0) + event.cpu_time / steps
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def row_for(comm: MoECommunicator, s: int, router_he: torch.Tensor, gen: torch.Generator, reps: int) -> dict:
    """One token count's row: the step's kernels (eager; and replayed, with the replay time, on CUDA)."""
    inputs = step_inputs(comm, s, router_he, gen)
    expert_out_nvsh = static_expert_out(comm, inputs)
    step = functools.partial(comm_step, comm, inputs, expert_out_nvsh)
    cuda = router_he.is_cuda
    row = dict(tokens=s, capacity=inputs[-1], rows=expert_out_nvsh.shape[0],
               eager=kernel_times(step, reps, cuda))
    if cuda:
        graph = captured_graph(step)
        row["graph"] = spread(timings(graph.replay, 3, reps))
        row["replayed"] = kernel_times(graph.replay, reps, cuda)
    return row


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    device = torch.device(args.device)
    padding = {} if args.token_padding is None else {"token_padding": args.token_padding}
    comm = MoECommunicator(world=single_world(device), hidden_size=args.hidden, num_experts=args.experts,
                           top_k=args.top_k, max_tokens_per_rank=args.tokens, dtype=args.dtype,
                           check_expert_ids=False, **padding)
    gen = torch.Generator(device).manual_seed(0)
    router_he = torch.randn(args.hidden, args.experts, generator=gen, device=device)
    with torch.no_grad():
        rows = [row_for(comm, s, router_he, gen, args.reps) for s in token_counts(args.tokens)]
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
