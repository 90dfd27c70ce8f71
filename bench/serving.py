"""Serving benchmark: what one EP rank pays per MoE step, phase by phase, as its tokens fall from S to 1.

Every rank of an EP group runs `s` tokens per step through `MoECommunicator` the way an engine does (the
bucket named: `dispatch(..., capacity=bucket)`, `check_expert_ids=False`), for s = 1, 2, 4, ... up to S:

1. plan + dispatch (`comm.dispatch`: the histogram all-gather, the plan, the row exchange);
2. prefetch (`comm.prefetch_weights`: the replicated experts' weights into this rank's slots);
3. experts (grouped-GEMM SwiGLU over the dispatched rows, route weights applied);
4. combine (`comm.combine(..., out=)`: each token's K rows summed into the caller's `[s, H]` tensor).

Communication alone ("comm": dispatch + combine, what the serving targets bound) is recorded beside the step:
in eager the sum of the two phases per repetition, in CUDA-graph replay a second graph holding only
`dispatch` and `combine` (of a static expert-output tensor, as an engine's workspace). The record's `targets`
say pass or miss (None where not measured: no graph): one rank (R = 1), s <= 128 tokens, dispatch + combine
within 40 us in graph replay; a decode step's communication (s = 1) at most 5% of the s = S step's (graph).

Eager: each phase timed on rank 0 by stamps on its own stream (CUDA events; the host clock on the CPU), each
repetition started from an idle device after a barrier, so host launch time is counted. CUDA graph (where the
world can capture a step: one rank, or the symmetric world): the whole step captured once per bucket and its
replay timed with CUDA events (device time, no launch cost). Every time is the median of `--reps` >= 5
repetitions with its min-max; `vs_full` divides each by the same time of the s = S step (the reference).

Worlds (`--world`):
- `threads`: R thread-ranks in one process (one device), sharing one Python interpreter: eager only;
- `symmetric`: one process per rank over symmetric memory (spawned here on `cuda:rank % GPUs`, or the
  processes of a torchrun job). Ranks that share a GPU use a gloo group and
  `TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`, as the tests do: they time-slice the chip, so absolute times
  are the group's on one chip, not one rank's on its own GPU;
- `single`: R = 1 in this process: what one rank pays with nothing to wait for.

Rank 0 writes `bench/results/serving-<world>-r<R>-<device>-<date>-<commit>.json` (`MOONEP_COMMIT` names the
commit where there is no git) and prints the table. On the CPU (`--device cpu`, threads or single, eager
only) the run is a smoke test of the script: its numbers mean nothing.

    python -m bench.serving                                   # CPU smoke test (threads, tiny shapes)
    python -m bench.serving --world single --ranks 1          # CPU smoke test, one rank

On the H200 (DeepSeek-V3's MoE layer; E=256 on one rank holds 256 experts: 22 GiB in bf16, plus slots):

    V3="--device cuda --hidden 7168 --ffn 2048 --experts 256 --top-k 8 --tokens 512 --dtype bfloat16"
    python -m bench.serving $V3 --world single --ranks 1                     # tp = CommConfig's default (16)
    python -m bench.serving $V3 --world single --ranks 1 --token-padding 128 # a DeepGEMM engine's tp
    python -m bench.serving $V3 --world symmetric --ranks 8   # 8 processes sharing the one GPU
    python -m bench.serving $V3 --world threads --ranks 8     # the threads-world numbers beside them
    torchrun --nproc-per-node 8 -m bench.serving $V3 --world symmetric   # or under torchrun
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common import Stamp, captured_graph, seconds_between, spread, stamp, timings, write_record
from moonep_moe.engine.communicator import CommunicatorConfig, MoECommunicator
from moonep_moe.engine.layout import ExpertLayout
from moonep_moe.gemm.registry import select_grouped_gemm
from moonep_moe.layers.swiglu import swiglu_weighted
from moonep_moe.transport.threads import run_ranks, single_world
from moonep_moe.transport.world import EPWorld

WORLDS = ("threads", "symmetric", "single")
PHASES = ("dispatch", "prefetch", "experts", "combine")
"""The eager phases in step order ("dispatch" includes the plan); "step" is their sum."""
MIN_REPS = 5
TARGET_COMM_MS = 0.040
"""Serving target: one rank's (R = 1) dispatch + combine in CUDA-graph replay for steps of <=
`TARGET_TOKENS`."""
TARGET_TOKENS = 128
TARGET_DECODE_RATIO = 0.05
"""Serving target: a decode step's (s = 1) communication over the s = S step's, in CUDA-graph replay."""
DEFAULT_TOKEN_PADDING = CommunicatorConfig.model_fields["token_padding"].default
"""What a serving user gets without choosing: the config's default (recorded in the record's `shape`)."""
SPAWN_TIMEOUT_S = 3600.0
"""A spawned symmetric run still going after this is killed."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", default="threads", choices=WORLDS,
                        help="how the ranks run (default threads)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="R (default 4; 1 for --world single; torchrun's processes under torchrun)")
    parser.add_argument("--hidden", type=int, default=64, help="H (default 64)")
    parser.add_argument("--ffn", type=int, default=32, help="I, expert FFN size (default 32)")
    parser.add_argument("--experts", type=int, default=16, help="E (default 16)")
    parser.add_argument("--top-k", type=int, default=4, help="K (default 4)")
    parser.add_argument("--tokens", type=int, default=16, help="S, token capacity per rank (default 16)")
    parser.add_argument("--slots", type=int, default=None, help="B slots per rank (default E/R)")
    parser.add_argument("--token-padding", type=int, default=DEFAULT_TOKEN_PADDING,
                        help=f"tp (default {DEFAULT_TOKEN_PADDING}, CommConfig's; DeepGEMM engines use 128)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10, help=f"timed repetitions (>= {MIN_REPS}; default 10)")
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results)")
    args = parser.parse_args(argv)
    try:
        args.ranks = resolve_ranks(args.world, args.ranks, args.device, launched_size())
        if args.reps < MIN_REPS:
            raise ValueError(f"--reps {args.reps}: at least {MIN_REPS} repetitions (a median and its spread)")
    except ValueError as error:
        parser.error(str(error))
    return args


def launched_size() -> int | None:
    """The process count of the torchrun job this process belongs to, None outside torchrun."""
    size = os.environ.get("WORLD_SIZE")
    return int(size) if size else None


def resolve_ranks(world: str, ranks: int | None, device: str, launched: int | None) -> int:
    """R for `--world world --ranks ranks --device device`, `launched` being torchrun's process count (None
    outside torchrun). Raises ValueError naming the flag that cannot hold."""
    if world == "symmetric" and torch.device(device).type != "cuda":
        raise ValueError(f"--world symmetric needs --device cuda (symmetric memory), got --device {device}")
    if launched is not None and world != "symmetric":
        raise ValueError(f"--world {world} runs in one process; under torchrun use --world symmetric")
    if world == "single":
        if ranks not in (None, 1):
            raise ValueError(f"--ranks {ranks}: --world single is one rank (R = 1)")
        return 1
    if launched is not None:
        if ranks not in (None, launched):
            raise ValueError(f"--ranks {ranks}: under torchrun the ranks are its {launched} processes")
        return launched
    ranks = 4 if ranks is None else ranks
    if ranks < 1:
        raise ValueError(f"--ranks {ranks}: at least one rank")
    return ranks


def symmetric_backend(size: int, gpus: int) -> tuple[str, bool]:
    """The process group's backend for `size` ranks on `gpus` GPUs, and whether ranks share a GPU (then gloo
    and `TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`, as the tests run them; else NCCL)."""
    if gpus < 1:
        raise ValueError("--world symmetric needs a CUDA device, found none")
    shared = size > gpus
    return ("gloo" if shared else "nccl"), shared


def token_counts(capacity: int) -> list[int]:
    """1, 2, 4, ... below `capacity`, then `capacity` itself (the reference)."""
    return [1 << i for i in range(capacity.bit_length()) if 1 << i < capacity] + [capacity]


# -- timing -------------------------------------------------------------------------------------------------

def phase_seconds(stamps: Sequence[Stamp]) -> dict[str, float]:
    """One repetition's `len(PHASES) + 1` stamps (before the first phase, after each) -> seconds per phase
    and of the whole "step"."""
    if len(stamps) != len(PHASES) + 1:
        raise ValueError(f"stamps: {len(PHASES) + 1} points (before and after {PHASES}), got {len(stamps)}")
    times = {name: seconds_between(a, b) for name, a, b in zip(PHASES, stamps[:-1], stamps[1:], strict=True)}
    return {**times, "step": seconds_between(stamps[0], stamps[-1])}


def phase_spreads(reps: Sequence[dict[str, float]]) -> dict[str, dict]:
    """Every repetition's `phase_seconds` -> per phase (and "step") its `spread` in ms."""
    if not reps:
        raise ValueError("phase_spreads needs at least one repetition, got none")
    return {name: spread([rep[name] for rep in reps]) for name in reps[0]}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add `vs_full` to every row: each median (eager phases and step, graph step) over the same median of
    the last row (s = S, the reference). A time the reference lacks (no graph) gets no ratio."""
    reference = rows[-1]
    for row in rows:
        row["vs_full"] = {f"{mode}_{name}": timed["ms"] / reference[mode][name]["ms"]
                          for mode in ("eager", "graph") if row.get(mode) and reference.get(mode)
                          for name, timed in row[mode].items()}
    return rows


def comm_targets(rows: list[dict], ranks: int) -> dict:
    """The serving targets from the rows' `comm` times (rows ascending in tokens, the last s = S); adds each
    row's `comm["vs_full"]` (its comm median over the s = S one, per mode). `pass` is None where the
    target's measurement is missing (no CUDA graph; or R > 1 for the 40 us bound, which is one rank's)."""
    full = rows[-1]["comm"]
    for row in rows:
        row["comm"]["vs_full"] = {mode: row["comm"][mode]["ms"] / full[mode]["ms"]
                                  for mode in ("eager", "graph") if row["comm"][mode] and full[mode]}
    small_ms = {row["tokens"]: row["comm"]["graph"]["ms"] for row in rows
                if row["tokens"] <= TARGET_TOKENS and row["comm"]["graph"]}
    within = dict(bound_ms=TARGET_COMM_MS, tokens_up_to=TARGET_TOKENS, ranks=ranks, worst_ms=None,
                  missed_tokens=None, **{"pass": None})
    if ranks == 1 and small_ms:
        misses = [s for s, ms in small_ms.items() if ms > TARGET_COMM_MS]
        within.update(worst_ms=max(small_ms.values()), missed_tokens=misses, **{"pass": not misses})
    ratios = next(row for row in rows if row["tokens"] == 1)["comm"]["vs_full"]
    graph_ratio = ratios.get("graph")
    decode = dict(bound=TARGET_DECODE_RATIO, graph_ratio=graph_ratio, eager_ratio=ratios["eager"],
                  **{"pass": None if graph_ratio is None else graph_ratio <= TARGET_DECODE_RATIO})
    return {"comm_within_40us": within, "decode_within_5pct": decode}


def verdict(target: dict) -> str:
    return {True: "pass", False: "MISS", None: "not measured"}[target["pass"]]


# -- one rank -----------------------------------------------------------------------------------------------


def can_capture(world: EPWorld, args: argparse.Namespace) -> bool:
    """Whether a step can be captured in a CUDA graph here: on CUDA, with device-side barriers (one rank, or
    the symmetric world); the threads world's barriers with R > 1 block the host."""
    return world.device.type == "cuda" and (world.size == 1 or args.world == "symmetric")


def rank_bench(world: EPWorld, args: argparse.Namespace) -> dict:
    """One rank's part: its communicator, home experts and routing, then every token count timed in eager
    (and in CUDA-graph replay where `can_capture`). Returns `rows` (rank 0's numbers are the record's),
    `slowest_eager_step_ms` per row (the slowest rank's median) and the pool's `stats`."""
    dtype, device = getattr(torch, args.dtype), world.device
    H, F, E, K, S = args.hidden, args.ffn, args.experts, args.top_k, args.tokens
    comm = MoECommunicator(world=world, hidden_size=H, num_experts=E, top_k=K, max_tokens_per_rank=S,
                           num_prefetch_slots=args.slots, token_padding=args.token_padding, dtype=args.dtype,
                           check_expert_ids=False)
    gen = torch.Generator(device).manual_seed(world.rank)

    def expert_weights(expert: int):  # random weights, made on the device one home expert at a time
        return tuple(torch.randn(n, k, generator=gen, device=device, dtype=dtype) * H ** -0.5
                     for n, k in ((F, H), (F, H), (H, F)))

    layout = ExpertLayout.from_experts(world, expert_weights, E, num_slots=comm.num_slots,
                                       name="bench-serving", dtype=dtype)
    gemm = select_grouped_gemm("auto", device, dtype, k=math.gcd(H, F))
    w_router_he = torch.randn(H, E, generator=gen, device=device, dtype=torch.float32)

    def step(hidden_sh, topk_sk, weights_sk, out_sh, bucket: int, mark: Callable[[], object]) -> None:
        mark()
        out, handle = comm.dispatch(hidden_sh, topk_sk, weights_sk, capacity=bucket)
        mark()
        comm.prefetch_weights(handle, layout)
        mark()
        ab_nv2f = gemm.fwd(out.tokens_nvsh, (layout.gate_up.home.local, layout.gate_up.slots.local),
                           out.offsets_g)
        y_nvsh = gemm.fwd(swiglu_weighted(ab_nv2f, out.weights_nvs),
                          (layout.down.home.local, layout.down.slots.local), out.offsets_g)
        mark()
        comm.combine(y_nvsh, handle, out=out_sh)
        mark()

    rows = []
    with torch.no_grad():
        for s in token_counts(S):
            inputs = step_inputs(comm, s, w_router_he, gen)
            reps = eager_reps(world, lambda marks, inputs=inputs: step(*inputs, lambda: marks.append(
                stamp(device))), args.warmup, args.reps)
            comm_ms = spread([rep["dispatch"] + rep["combine"] for rep in reps])
            row = dict(tokens=s, capacity=inputs[-1], eager=phase_spreads(reps), graph=None,
                       comm=dict(eager=comm_ms, graph=None))
            if can_capture(world, args):
                replays = graph_replays(lambda inputs=inputs: step(*inputs, lambda: None), args.warmup,
                                        args.reps)
                row["graph"] = {"step": spread(replays)}
                expert_out_nvsh = static_expert_out(comm, inputs)
                replays = graph_replays(lambda inputs=inputs, y=expert_out_nvsh: comm_step(comm, inputs, y),
                                        args.warmup, args.reps)
                row["comm"]["graph"] = spread(replays)
                del expert_out_nvsh
            rows.append(row)
    medians = [row["eager"]["step"]["ms"] for row in rows]
    medians_r = world.all_gather(torch.tensor(medians, dtype=torch.float64, device=device))
    slowest = medians_r.reshape(world.size, -1).amax(0).tolist()
    stats = comm.stats()
    comm.destroy()
    return dict(rows=rows, slowest_eager_step_ms=slowest, pool=stats)


def step_inputs(comm: MoECommunicator, s: int, router_he: torch.Tensor, gen: torch.Generator) -> tuple:
    """One step of `s` tokens as an engine feeds it: `(hidden_sh, topk_sk, weights_sk, out_sh, bucket)`,
    random rows in the communicator's dtype, a router's top-K of `router_he [H, E]` (fp32) and its softmax
    weights, an output tensor and the smallest bucket that holds them."""
    hidden_sh = torch.randn(s, comm.config.hidden_size, generator=gen, device=router_he.device,
                            dtype=comm.dtype)
    scores_sk, topk_sk = torch.topk(hidden_sh.float() @ router_he, comm.config.top_k, dim=-1)
    return (hidden_sh, topk_sk.int(), torch.softmax(scores_sk, dim=-1), torch.empty_like(hidden_sh),
            comm.capacity_for(s))


def static_expert_out(comm: MoECommunicator, inputs: tuple) -> torch.Tensor:
    """An engine's expert-output workspace for `inputs`' bucket (`[NvS, H]`, the dispatched rows' copy),
    made by one dispatch + combine."""
    out, handle = comm.dispatch(*inputs[:3], capacity=inputs[-1])
    expert_out_nvsh = out.tokens_nvsh.clone()
    comm.combine(expert_out_nvsh, handle, out=inputs[3])
    return expert_out_nvsh


def comm_step(comm: MoECommunicator, inputs: tuple, expert_out_nvsh: torch.Tensor) -> None:
    """Communication alone: `inputs` (`step_inputs`) dispatched, then the static `expert_out_nvsh`
    combined into their output tensor."""
    hidden_sh, topk_sk, weights_sk, out_sh, bucket = inputs
    _, handle = comm.dispatch(hidden_sh, topk_sk, weights_sk, capacity=bucket)
    comm.combine(expert_out_nvsh, handle, out=out_sh)


def eager_reps(world: EPWorld, run: Callable[[list], object], warmup: int, reps: int
               ) -> list[dict[str, float]]:
    """`run(marks)` `warmup + reps` times, each after a barrier with this rank's device idle (so host launch
    time counts); the timed repetitions' `phase_seconds` from the stamps `run` appends to `marks`."""
    stamps = []
    for i in range(warmup + reps):
        world.barrier()
        if world.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        marks: list[Stamp] = []
        run(marks)
        if i >= warmup:
            stamps.append(marks)
    world.barrier()
    if world.device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    return [phase_seconds(marks) for marks in stamps]


def graph_replays(step: Callable[[], object], warmup: int, reps: int) -> list[float]:
    """Seconds of each of `reps` replays of `step` captured once in a CUDA graph (after two runs on a side
    stream and `warmup` replays), timed with CUDA events: device time, no launch cost."""
    return timings(captured_graph(step).replay, warmup, reps)


# -- the worlds ---------------------------------------------------------------------------------------------


def run_world(args: argparse.Namespace) -> Path | None:
    """Run the bench in `args.world`; the record's path where this process wrote it (rank 0)."""
    device = torch.device(args.device)
    if args.world == "symmetric":
        if launched_size() is not None:
            return symmetric_rank(args, None, None, None)
        with tempfile.TemporaryDirectory() as folder:
            spawn_symmetric(args, folder)
            written = Path(folder) / "record"
            return Path(written.read_text()) if written.exists() else None
    if args.world == "single":
        return report(args, rank_bench(single_world(device), args))
    return report(args, run_ranks(lambda world: rank_bench(world, args), args.ranks, device)[0])


def spawn_symmetric(args: argparse.Namespace, folder: str) -> None:
    """`args.ranks` processes, each one rank of a symmetric world over a file-store process group; waits
    for them and raises if any failed."""
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=symmetric_rank, args=(args, rank, args.ranks, folder))
                 for rank in range(args.ranks)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.1))
    for process in processes:
        if process.is_alive():
            process.kill()
    failed = [rank for rank, process in enumerate(processes) if process.exitcode != 0]
    if failed:
        raise RuntimeError(f"symmetric ranks {failed} failed or hung (exit codes "
                           f"{[p.exitcode for p in processes]}); their errors are above")


def symmetric_rank(args: argparse.Namespace, rank: int | None, size: int | None, folder: str | None
                   ) -> Path | None:
    """One process's rank of the symmetric world: spawned here (`rank`, `size`, a file store in `folder`)
    or a torchrun process (all None: its environment). Rank 0 writes the record (and its path to `folder`)."""
    from moonep_moe.transport.symmetric import init_symmetric

    size = size or launched_size()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    local = int(os.environ.get("LOCAL_RANK", rank))
    backend, shared = symmetric_backend(size, torch.cuda.device_count())
    if shared:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    init_method = f"file://{folder}/store" if folder else None
    world = init_symmetric(backend, init_method=init_method, rank=rank, world_size=size, timeout_s=600.0,
                           device=device)
    result = rank_bench(world, args)
    torch.cuda.synchronize()
    if rank != 0:
        return None
    path = report(args, result)
    if folder:
        (Path(folder) / "record").write_text(str(path))
    return path


def world_description(args: argparse.Namespace) -> str:
    kind = torch.device(args.device).type
    if args.world == "threads":
        return f"threads: {args.ranks} thread-ranks in one process on one {kind} device"
    if args.world == "single":
        return f"single: one rank (R = 1) on one {kind} device"
    gpus = torch.cuda.device_count()
    shared = symmetric_backend(args.ranks, gpus)[1]
    return (f"symmetric: {args.ranks} processes on {min(args.ranks, gpus)} GPU(s)"
            + (" (sharing: gloo, overlapping devices; they time-slice the chip)" if shared else " (NCCL)"))


def report(args: argparse.Namespace, result: dict) -> Path:
    """Write rank 0's `result` as the record and print its table; the record's path."""
    rows = add_ratios(result["rows"])
    targets = comm_targets(rows, args.ranks)
    for row, slowest in zip(rows, result["slowest_eager_step_ms"], strict=True):
        row["slowest_rank_eager_step_ms"] = slowest
    note = ("CPU smoke test: these numbers mean nothing" if args.device == "cpu" else
            "eager: rank 0's stream per phase, after an idle barrier; graph: whole-step replay, device time")
    out = write_record(
        f"serving-{args.world}-r{args.ranks}", {}, rows, args.out, ran_on=args.device,
        world=world_description(args), world_kind=args.world, ranks=args.ranks,
        shape=dict(H=args.hidden, I=args.ffn, E=args.experts, K=args.top_k, S=args.tokens, B=args.slots,
                   token_padding=args.token_padding, dtype=args.dtype),
        warmup=args.warmup, reps=args.reps, reference_tokens=rows[-1]["tokens"], note=note,
        pool=result["pool"], targets=targets)
    print(world_description(args) + f"; medians of {args.reps} reps in ms (min-max of the step)")
    print(f"{'tokens':>6} {'cap':>5} " + " ".join(f"{name:>9}" for name in PHASES)
          + f" {'step':>21} {'step/full':>9} {'comm':>9} {'graph':>9} {'graph/full':>10} {'comm graph':>10}"
          + f" {'comm/full':>9}")
    for row in rows:
        eager, graph = row["eager"], row["graph"]
        step = eager["step"]
        line = (f"{row['tokens']:>6} {row['capacity']:>5} "
                + " ".join(f"{eager[name]['ms']:>9.3f}" for name in PHASES)
                + f" {step['ms']:>9.3f} ({step['ms_min']:.3f}-{step['ms_max']:.3f})".ljust(22)
                + f" {row['vs_full']['eager_step']:>9.2f} {row['comm']['eager']['ms']:>9.3f}")
        if graph:
            line += (f" {graph['step']['ms']:>9.3f} {row['vs_full']['graph_step']:>10.2f}"
                     f" {row['comm']['graph']['ms']:>10.4f} {row['comm']['vs_full']['graph']:>9.3f}")
        print(line)
    within, decode = targets["comm_within_40us"], targets["decode_within_5pct"]
    bound_us = TARGET_COMM_MS * 1e3
    print(f"target R=1, s<={TARGET_TOKENS}, dispatch+combine in graph replay <= {bound_us:.0f} us: "
          f"{verdict(within)}" + (f" (worst {within['worst_ms'] * 1e3:.1f} us; missed at s = "
                                  f"{within['missed_tokens']})" if within["pass"] is not None else ""))
    ratio = decode["graph_ratio"]
    print(f"target comm(s=1) / comm(s=S) in graph replay <= {TARGET_DECODE_RATIO:.0%}: {verdict(decode)}"
          + (f" ({ratio:.1%})" if ratio is not None else "") + f"; eager {decode['eager_ratio']:.1%}")
    print(note)
    print(f"wrote {out}")
    return out


def main(argv: list[str] | None = None) -> Path | None:
    return run_world(parse_args(argv))


if __name__ == "__main__":
    main()
