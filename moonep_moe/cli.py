"""The `moonep-moe` command."""

from __future__ import annotations

import argparse
import builtins
import contextlib
import sys
import time

import torch

from moonep_moe.config import load_config


def demo(args: argparse.Namespace) -> int:
    from moonep_moe.demo import TOLERANCE, format_table, plot, run_demo

    torch.set_num_threads(1)  # the thread-ranks are the parallelism; nested OpenMP would oversubscribe
    overrides = {"ep_size": args.ranks} if args.ranks else {}
    world, ranks_as, guard = None, "threads on the CPU", contextlib.nullcontext()
    if args.world == "collective":  # one process per rank (torchrun); rank 0 prints and plots
        from moonep_moe.comm.collective import fail_fast, init_collective

        world, guard = init_collective(), fail_fast()
        overrides = {"ep_size": world.size, "world": "collective"}
        ranks_as = f"processes ({torch.distributed.get_backend()}) on {world.device.type}"
    lead = world is None or world.rank == 0
    print = builtins.print if lead else lambda *_, **__: None  # only rank 0 reports
    cfg = load_config(args.config, **overrides)
    print(f"moonep-moe demo: config {args.config}, {cfg.ep_size} EP ranks as {ranks_as}, "
          f"S={cfg.max_tokens_per_rank} tokens/rank, H={cfg.hidden_size}, H'={cfg.ffn_hidden_size}, "
          f"E={cfg.num_experts}, K={cfg.top_k}, B={cfg.prefetch_slots} slots/rank, {cfg.dtype}")
    start = time.perf_counter()
    with guard:
        results = run_demo(cfg, seed=args.seed, world=world)
    print(format_table(cfg, results))
    if lead:
        plot(cfg, results, args.out)
    worst = max(r.max_error for r in results)
    print(f"outputs and gradients vs the dense float64 reference: worst relative error {worst:.1e} "
          f"({'ok' if worst < TOLERANCE else 'FAIL'}, tolerance {TOLERANCE:g})")
    print(f"plot: {args.out}   time: {time.perf_counter() - start:.1f} s")
    return 0 if worst < TOLERANCE else 1


def train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from moonep_moe.train import load_train_config
    from moonep_moe.train import train as run_training

    torch.set_num_threads(1)  # the thread-ranks are the parallelism; nested OpenMP would oversubscribe
    overrides = {k: v for k, v in (("ep_size", args.ranks), ("steps", args.steps)) if v is not None}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        overrides["ep_size"] = 1  # the threads world cannot run a multi-rank backward on one GPU
    cfg = load_train_config(args.config, **overrides)
    print(f"moonep-moe train: {args.config}, Qwen3-MoE {cfg.model}, {cfg.train.ep_size} EP ranks as threads "
          f"on the {device}, {cfg.train.steps} steps" + (f", resuming {args.resume}" if args.resume else ""))
    start = time.perf_counter()
    result = run_training(cfg, device=device, save=args.save, resume=args.resume,
                          log=None if args.quiet else tqdm.write)
    if result["losses"]:
        print(f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}   "
              f"time: {time.perf_counter() - start:.1f} s" + (f"   saved: {args.save}" if args.save else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moonep-moe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="per-rank load with replicas vs plain EP, checked against float64")
    p.add_argument("--config", default="tiny-cpu", help="packaged config name or YAML path (tiny-cpu)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (threads); default: the config's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="moonep-demo.png", help="where to write the PNG plot")
    p.add_argument("--world", choices=["threads", "collective"], default="threads",
                   help="threads: R ranks in this process; collective: one rank per process under "
                        "torchrun (gloo on the CPU, NCCL on GPUs): torchrun --nproc-per-node 4 -m "
                        "moonep_moe.cli demo --world collective")
    p.set_defaults(run=demo)
    p = commands.add_parser("train", help="train a tiny HF MoE transformer with MoonEP layers (needs [hf])")
    p.add_argument("--config", default="configs/tiny-transformer.yaml", help="training YAML")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (threads); default: the config's")
    p.add_argument("--steps", type=int, default=None, help="total steps; default: the config's")
    p.add_argument("--save", default=None, help="write a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="continue from this checkpoint")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.set_defaults(run=train)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
