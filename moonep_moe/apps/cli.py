"""The `moonep-moe` command: `demo`, `train` and `configs`.

`--config` takes a packaged config's name (`moonep-moe configs` lists them) or a YAML file's path. Errors of
the user's making (an argument, a config, a checkpoint, a missing extra) are found before any work starts
and print one line, `moonep-moe: error: ...`, with exit status 2, as argparse's own errors do; `--debug`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic
import torch
from pydantic_core import ErrorDetails

from moonep_moe import __version__
from moonep_moe.config import available_configs, load_config, packaged_configs_folder, with_derived_defaults

if TYPE_CHECKING:
    from moonep_moe.apps.train import TrainConfig


DEFAULT_PLOT = Path("moonep-out") / "moonep-demo.png"
"""`demo`'s plot without `--out`, relative to the current folder; its folder is made if missing."""


class UsageError(Exception):
    """An error of the user's making found by the command: printed as one line, exit status 2."""


def one_line(error: BaseException) -> str:
    """`error`'s message on one line; a pydantic error as `Model: field: message (got value); ...`."""
    if isinstance(error, pydantic.ValidationError):
        return f"{error.title}: " + "; ".join(field_error(e) for e in error.errors(include_url=False))
    return " ".join(str(error).split()) or type(error).__name__


def field_error(error: ErrorDetails) -> str:
    """One pydantic error entry as `field.path: message (got value)`."""
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:
        return message
    shown = error["type"] != "missing" and not isinstance(error["input"], dict)
    got = f" (got {error['input']!r})" if shown else ""
    return f"{'.'.join(map(str, error['loc']))}: {message}{got}"


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def load(loader: Callable[..., Any], config: str, overrides: dict[str, Any], given: str) -> Any:
    """`loader(config, **overrides)`; an invalid config becomes one line naming `--config` and `given`, the
    flags that set `overrides`."""
    try:
        return loader(config, **overrides)
    except pydantic.ValidationError as error:
        raise UsageError(f"--config {config}{given}: {one_line(error)}") from error


def check_writable(path: str, flag: str) -> None:
    """Refuse `path` (the value of `flag`) unless a file can be written there: its folder must exist (it is
    not created, so that a typo makes no folders) and be writable, and `path` must not be a folder."""
    folder = Path(path).parent
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file path")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: folder {str(folder)!r} does not exist (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write in folder {str(folder)!r}")


def check_plot_path(path: str) -> None:
    """`check_writable`, and a suffix matplotlib can write (none: PNG)."""
    from matplotlib.backend_bases import FigureCanvasBase

    check_writable(path, "--out")
    suffix, formats = Path(path).suffix.removeprefix(".").lower(), FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UsageError(f"--out {path}: matplotlib cannot write .{suffix} files; use one of "
                         f"{', '.join(sorted(formats))}")


def require_transformers() -> None:
    """Refuse `train` at once, saying what to install, where the `hf` extra is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        raise UsageError("train needs transformers (the hf extra): pip install 'moonep-moe[hf]'") from error


def describe_model(cfg: TrainConfig) -> str:
    """The shape of a training config's model, from its YAML (`?`: left to transformers' default), its dtype
    and, when they are FP8, its experts' GEMMs."""
    model = cfg.model
    shape = ", ".join(f"{label}={model.get(key, '?')}" for label, key in (
        ("H", "hidden_size"), ("E", "num_experts"), ("K", "num_experts_per_tok"), ("vocab", "vocab_size")))
    fp8 = ", fp8 experts" if cfg.moe.get("precision") == "fp8" else ""
    return f"Qwen3-MoE with {model.get('num_hidden_layers', '?')} layers, {shape}, {cfg.train.dtype}{fp8}"


def with_precision(cfg: TrainConfig, precision: str, device: str, config: str) -> TrainConfig:
    """`cfg` with its experts' GEMMs in `precision` (`--precision`), refused in one line where fp8 cannot
    run: a model that is not bfloat16, or a machine without a GPU with FP8 tensor cores."""
    if precision == "fp8":
        if cfg.train.dtype != "bfloat16":
            raise UsageError(f"--precision fp8: config {config} trains in {cfg.train.dtype}; FP8 experts "
                             "need a bfloat16 model (train.dtype: bfloat16, as in small-transformer)")
        from moonep_moe.gemm.registry import fp8_unsupported_reason

        padding = with_derived_defaults({**cfg.moe, "precision": "fp8"})["token_padding"]  # the fp8 layer's
        reason = fp8_unsupported_reason(torch.device(device), torch.bfloat16, padding)
        if reason is not None:
            raise UsageError(f"--precision fp8 cannot run here: {reason}")
    return cfg.with_moe(precision=precision)


def torchrun_processes(given: str, command: str) -> int:
    """The number of processes of the torchrun job this process is one of (torchrun's `WORLD_SIZE`). Outside
    torchrun, refuses `given` (the flags that asked for ranks as processes), saying how to start `command`
    under torchrun."""
    size = int(os.environ.get("WORLD_SIZE", 0))
    if not size:
        raise UsageError(f"{given}: the ranks are processes; run it under torchrun, e.g. torchrun "
                         f"--nproc-per-node 4 -m moonep_moe.apps.cli {command}")
    return size


def demo(args: argparse.Namespace) -> int:
    from moonep_moe.apps.demo import TOLERANCE, format_table, plot, run_demo

    torch.set_num_threads(1)  # the thread-ranks are the parallelism; nested OpenMP would oversubscribe
    overrides = {"ep_size": args.ranks} if args.ranks else {}
    given = f" --ranks {args.ranks}" if args.ranks else ""
    world, ranks_as, guard = None, "threads on the CPU", contextlib.nullcontext()
    if args.world == "collective":  # one process per rank (torchrun); rank 0 prints and plots
        if args.ranks is not None:
            raise UsageError(f"--ranks {args.ranks}: with --world collective the ranks are torchrun's "
                             "processes (torchrun --nproc-per-node)")
        torchrun_processes("--world collective", "demo --world collective")
        from moonep_moe.transport.collective import fail_fast, init_collective

        world, guard = init_collective(), fail_fast()
        overrides = {"ep_size": world.size, "world": "collective"}
        given = f" on {world.size} processes"
        ranks_as = f"processes ({torch.distributed.get_backend()}) on {world.device.type}"
    lead = world is None or world.rank == 0
    print = builtins.print if lead else lambda *_, **__: None  # only rank 0 reports
    cfg = load(load_config, args.config, overrides, given)
    if args.out is None:  # made only now that the config is valid; a given --out's folder must exist
        args.out = str(DEFAULT_PLOT)
        DEFAULT_PLOT.parent.mkdir(exist_ok=True)
    check_plot_path(args.out)
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


def process_layout(args: argparse.Namespace) -> tuple[int, int] | None:
    """`train --dp N`: `(dp, ep)` of the torchrun job this process belongs to (ep = its processes / N), or
    None without `--dp` (thread-ranks). Refuses what cannot run with processes, before any work."""
    if args.dp is None:
        return None
    if args.ranks is not None:
        raise UsageError(f"--ranks {args.ranks}: with --dp the ranks are torchrun's processes "
                         "(torchrun --nproc-per-node)")
    for flag, value in (("--save", args.save), ("--resume", args.resume)):
        if value:
            raise UsageError(f"{flag} {value}: checkpoints need thread-ranks (train without --dp)")
    size = torchrun_processes(f"--dp {args.dp}", f"train --dp {args.dp}")
    if size % args.dp:
        raise UsageError(f"--dp {args.dp} does not divide the {size} processes (ep = processes / dp)")
    return args.dp, size // args.dp


def join_processes(device: str, size: int) -> str:
    """Join torchrun's process group for `train --dp`; returns how the ranks run, for the header. On the CPU
    gloo (the collective EP world); on CUDA the symmetric EP world over NCCL with a GPU per rank, else over
    gloo with ranks sharing the GPUs (`TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`, set here)."""
    from moonep_moe.transport.collective import init_collective

    backend = "gloo"
    if device == "cuda" and torch.cuda.device_count() >= size:
        backend = "nccl"
    elif device == "cuda":
        os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    init_collective(backend)
    return f"processes ({backend}) on the {device}"


def train(args: argparse.Namespace) -> int:
    require_transformers()
    if args.save:
        check_writable(args.save, "--save")
    from tqdm import tqdm

    from moonep_moe.apps.train import load_checkpoint, load_train_config, resumed_config
    from moonep_moe.apps.train import train as run_training

    torch.set_num_threads(1)  # the thread-ranks are the parallelism; nested OpenMP would oversubscribe
    device, ranks = ("cuda" if torch.cuda.is_available() else "cpu"), args.ranks
    layout = process_layout(args)
    if layout:
        ranks = layout[1]
    elif device == "cuda":  # the threads world cannot run a multi-rank backward on one GPU
        if ranks not in (None, 1):
            raise UsageError(f"--ranks {ranks}: on a GPU, train runs one rank (the threads world cannot run "
                             "several ranks' backward on one device); use --dp with torchrun for more")
        ranks = 1
    overrides = {k: v for k, v in (("ep_size", ranks), ("steps", args.steps)) if v is not None}
    given = "".join(f" {flag} {v}" for flag, v in (("--ranks", args.ranks), ("--dp", args.dp),
                                                   ("--steps", args.steps)) if v)
    cfg = load(load_train_config, args.config, overrides, given)
    if args.precision:
        cfg = with_precision(cfg, args.precision, device, args.config)
    start, batch_from = 0, ""
    if args.resume:
        checkpoint = load_checkpoint(args.resume)
        try:
            cfg = resumed_config(cfg, checkpoint)
        except ValueError as error:
            raise UsageError(f"--resume {args.resume}: {error}") from error
        start = checkpoint["step"]
        batch_from = f" (the checkpoint's global batch of {checkpoint['global_batch']})"
    tc = cfg.train
    ranks_as = f"{tc.ep_size} EP ranks as threads on the {device}"
    guard, lead = contextlib.nullcontext(), True
    if layout:
        from moonep_moe.transport.collective import fail_fast

        dp, ep = layout
        ranks_as = f"DP {dp} x EP {ep} = {dp * ep} ranks as {join_processes(device, dp * ep)}"
        guard, lead = fail_fast(), torch.distributed.get_rank() == 0
    print = builtins.print if lead else lambda *_, **__: None  # only rank 0 reports
    print(f"moonep-moe train: config {args.config}, {describe_model(cfg)}; {ranks_as}, {tc.batch_size} "
          f"sequences of {tc.seq_len} tokens per rank{batch_from}, steps {start} -> {tc.steps}"
          + (f", resuming {args.resume}" if args.resume else ""))
    begin = time.perf_counter()
    with guard:
        result = run_training(cfg, device=device, save=args.save, resume=args.resume,
                              log=None if args.quiet else tqdm.write, dp=layout[0] if layout else None)
    if result["losses"]:
        print(f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}   "
              f"time: {time.perf_counter() - begin:.1f} s" + (f"   saved: {args.save}" if args.save else ""))
    return 0


def configs(args: argparse.Namespace) -> int:
    from moonep_moe.apps.train import load_train_config

    rows = [("name", "H", "H'", "E", "K", "R", "S", "B", "tp", "dtype")]
    for name in available_configs():
        c = load_config(name)
        rows.append((name, c.hidden_size, c.ffn_hidden_size, c.num_experts, c.top_k, c.ep_size,
                     c.max_tokens_per_rank, c.prefetch_slots, c.token_padding, c.dtype))
    print("layer configs (moonep-moe demo --config NAME; in Python, load_config(NAME)):")
    for row in rows:
        print("  " + f"{row[0]:<20}" + "".join(f"{v:>7}" for v in row[1:-1]) + f"  {row[-1]}")
    print("  (H hidden, H' expert FFN, E experts, K top-k, R EP ranks, S tokens/rank, B slots/rank, "
          "tp token padding)")
    print("training configs (moonep-moe train --config NAME):")
    for name in available_configs("train"):
        cfg = load_train_config(name)
        tc = cfg.train
        print(f"  {name:<20}{describe_model(cfg)}; {tc.ep_size} EP ranks, "
              f"{tc.batch_size} sequences of {tc.seq_len} tokens per rank, {tc.steps} steps")
    print(f"files: {packaged_configs_folder()}/NAME.yaml (--config also takes the path of your own YAML)")
    return 0


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    main_parser = argparse.ArgumentParser(prog="moonep-moe", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    main_parser.add_argument("--version", action="version",
                             version=f"moonep-moe {__version__} (torch {torch.__version__})")
    commands = main_parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", parents=[common],
                            help="per-rank load with replicas vs plain EP, checked against float64")
    p.add_argument("--config", default="tiny-cpu", help="packaged layer config name or YAML path (tiny-cpu)")
    p.add_argument("--ranks", type=positive_int, help="EP ranks (threads); default: the config's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help=f"where to write the plot (its folder must exist); default: {DEFAULT_PLOT} "
                                 "in the current folder, made if missing")
    p.add_argument("--world", choices=["threads", "collective"], default="threads",
                   help="threads: R ranks in this process; collective: one rank per process under "
                        "torchrun (gloo on the CPU, NCCL on GPUs): torchrun --nproc-per-node 4 -m "
                        "moonep_moe.apps.cli demo --world collective")
    p.set_defaults(run=demo)
    p = commands.add_parser("train", parents=[common],
                            help="train a tiny HF MoE transformer with MoonEP layers (needs the hf extra)")
    p.add_argument("--config", default="tiny-transformer",
                   help="packaged training config name or YAML path (tiny-transformer)")
    p.add_argument("--ranks", type=positive_int, help="EP ranks (threads); default: the config's")
    p.add_argument("--dp", type=positive_int,
                   help="data-parallel replicas: the ranks are torchrun's processes, DP x EP with EP = "
                        "processes / DP (gloo on the CPU): torchrun --nproc-per-node 4 -m "
                        "moonep_moe.apps.cli train --dp 2")
    p.add_argument("--steps", type=positive_int,
                   help="total steps, counted from 0 (a resumed run continues to it); default: the config's")
    p.add_argument("--save", default=None, help="write a checkpoint here at the end (its folder must exist)")
    p.add_argument("--resume", default=None,
                   help="continue from this checkpoint, at any EP size, keeping its global batch")
    p.add_argument("--precision", choices=["bf16", "fp8"],
                   help="the routed experts' GEMMs (MoEConfig.precision); default: the config's moe section, "
                        "else bf16. fp8 needs a GPU with FP8 tensor cores (DeepGEMM's kernels on Hopper "
                        "where installed, else Triton's) and a bfloat16 model: --config small-transformer")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.set_defaults(run=train)
    p = commands.add_parser("configs", parents=[common], help="list the packaged configs and their shapes")
    p.set_defaults(run=configs)
    return main_parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ValueError, OSError) as error:
        if args.debug:
            raise
        print(f"moonep-moe: error: {one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
