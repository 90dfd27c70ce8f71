"""The `moonep-moe` command."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from moonep_moe.config import load_config


def demo(args: argparse.Namespace) -> int:
    from moonep_moe.demo import TOLERANCE, format_table, plot, run_demo

    torch.set_num_threads(1)  # the thread-ranks are the parallelism; nested OpenMP would oversubscribe
    overrides = {"ep_size": args.ranks} if args.ranks else {}
    cfg = load_config(args.config, **overrides)
    print(f"moonep-moe demo: config {args.config}, {cfg.ep_size} EP ranks as threads on the CPU, "
          f"S={cfg.max_tokens_per_rank} tokens/rank, H={cfg.hidden_size}, H'={cfg.ffn_hidden_size}, "
          f"E={cfg.num_experts}, K={cfg.top_k}, B={cfg.prefetch_slots} slots/rank, {cfg.dtype}")
    start = time.perf_counter()
    results = run_demo(cfg, seed=args.seed)
    print(format_table(cfg, results))
    plot(cfg, results, args.out)
    worst = max(r.max_error for r in results)
    print(f"outputs and gradients vs the dense float64 reference: worst relative error {worst:.1e} "
          f"({'ok' if worst < TOLERANCE else 'FAIL'}, tolerance {TOLERANCE:g})")
    print(f"plot: {args.out}   time: {time.perf_counter() - start:.1f} s")
    return 0 if worst < TOLERANCE else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moonep-moe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="per-rank load with replicas vs plain EP, checked against float64")
    p.add_argument("--config", default="tiny-cpu", help="packaged config name or YAML path (tiny-cpu)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (threads); default: the config's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="moonep-demo.png", help="where to write the PNG plot")
    p.set_defaults(run=demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
