"""Where one training step's peak memory goes: our layer (DEFAULT) and torch-native, block by block.

`python -m bench.memory --model deepseek-v3 [--ep-rank-of 8 [--maxvio 20]]` builds each layer as
`bench.layer` does (the same weights; for one EP rank its plan's slots and stand-ins, `as_ep_rank`), runs two
steps, then one more, while PyTorch's caching allocator records every allocation and free from before the
layer was built (`torch.cuda.memory._record_memory_history`). `--config FIELD=VALUE ...` adds a row of ours
with those MoEConfig fields (e.g. `precision=fp8`) beside the DEFAULT; `--micro-batches N` makes each step
N forwards and backwards (gradient accumulation, where an fp8 layer keeps its weights' FP8 copies across
them), as `bench.layer`'s per-step rows. Replaying that trace gives the moment of the
last step's peak and the blocks live then, grouped by where they were allocated: the innermost frame in
`moonep_moe/` or `bench/` and its caller. The VMM arena's expert weights (`transport.arena.physical_bytes`)
are outside the allocator: reported beside, and counted in the peak as `bench.layer` counts them. GPU only.

Record (`bench.common.write_record`:
`memory-<model>[-ep<R>-rank[-maxvio<m>]][-mb<N>][-FIELD-VALUE...]-<device>-<date>-<commit>.json`):
`setup` (the table's shapes), `results`, one row per layer: `layer`, `peak_gib` (the allocator's peak during
the step above what was allocated before the build, plus the arena: `bench.layer`'s measure), `arena_gib`,
`held_gib` (allocated between steps, `.grad` included), `traced_peak_gib` (the replayed peak above the
build's start) and `at_peak` (the groups, largest first: `where`, `gib`, `blocks`).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import config_field, config_suffix, write_record
from bench.layer_measure import free_memory
from bench.layer_step import step, step_inputs, with_layer_weights
from bench.layer_tables import add_table_arguments, table_from_arguments, table_rank_plan
from bench.native_layer import native_layer
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.arena import physical_bytes
from moonep_moe.transport.threads import single_world

OURS = ("moonep_moe/", "bench/")
"""Frames that name an allocation: the innermost one in either tree, and its caller."""
GIB = 2**30


def allocated_at(frames: list[dict]) -> str:
    """`file:line function <- file:line function` of the innermost two frames of ours (`OURS`), or
    "outside moonep_moe and bench" (torch's own, e.g. autograd's gradient buffers)."""
    ours = [frame for frame in frames if any(part in frame["filename"] for part in OURS)]
    if not ours:
        return "outside moonep_moe and bench"

    def name(frame: dict) -> str:
        path = frame["filename"]
        for part in OURS:
            if part in path:
                path = part + path.rsplit(part, 1)[1]
        return f"{path}:{frame['line']} {frame['name']}"

    return " <- ".join(name(frame) for frame in ours[:2])


def live_at_peak(trace: list[dict], start: int = 0) -> tuple[int, dict[int, tuple[int, str]]]:
    """Replay a device trace of the caching allocator (`_snapshot()["device_traces"][i]`): the most bytes
    allocated at once at or after event `start` (above what was live when the trace began) and the blocks
    live then, `{address: (bytes, allocated_at)}`. A free of a block allocated before the trace is skipped."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_best: dict[int, tuple[int, str]] = {}
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], allocated_at(event.get("frames", [])))
            total += event["size"]
            if i >= start and total > best:
                best, at_best = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return best, at_best


def grouped(blocks: dict[int, tuple[int, str]]) -> list[dict]:
    """The blocks by where they were allocated, largest first: `[{where, gib, blocks}]`."""
    groups: dict[str, list[int]] = {}
    for size, where in blocks.values():
        groups.setdefault(where, []).append(size)
    return sorted(({"where": where, "gib": sum(sizes) / GIB, "blocks": len(sizes)}
                   for where, sizes in groups.items()), key=lambda group: -group["gib"])


def traced_step(build: Callable[[], torch.nn.Module], x_th: torch.Tensor, grad_th: torch.Tensor,
                name: str, micro_batches: int = 1) -> dict:
    """Build a layer, two steps, then one traced step, each of `micro_batches` forwards and backwards: its row
    (module docstring)."""
    before = free_memory()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        layer = build()
        for _ in range(2):
            step(layer, x_th, grad_th, micro_batches)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() + physical_bytes("cuda") - before
        start = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        torch.cuda.reset_peak_memory_stats()
        step(layer, x_th, grad_th, micro_batches)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() + physical_bytes("cuda") - before
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traced, blocks = live_at_peak(trace, start)
    row = {"layer": name, "peak_gib": peak / GIB, "arena_gib": physical_bytes("cuda") / GIB,
           "held_gib": held / GIB, "traced_peak_gib": traced / GIB, "at_peak": grouped(blocks)}
    if hasattr(layer, "destroy"):
        layer.destroy()
    del layer
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_table_arguments(parser)
    parser.add_argument("--top", type=int, default=12, help="groups printed per layer")
    parser.add_argument("--config", nargs="*", type=config_field, default=[], metavar="FIELD=VALUE",
                        help="a row of ours with these MoEConfig fields beside the DEFAULT's (a value parsed "
                             "as YAML)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="forwards and backwards in each step (gradient accumulation)")
    parser.add_argument("--out", default=None, help="folder of the JSON record (default bench/results)")
    args = parser.parse_args()
    args.config = dict(args.config)
    if args.micro_batches < 1:
        parser.error(f"--micro-batches must be at least 1, got {args.micro_batches}")
    if not torch.cuda.is_available():
        parser.error("bench.memory reads the CUDA caching allocator's trace: it needs a GPU")
    table = table_from_arguments(parser, args)
    shapes, plan = table.shapes, table_rank_plan(table, "cuda")
    x_th, grad_th = step_inputs(table.tokens, table.hidden)

    def ours(fields: dict) -> Callable[[], MoonEPMoELayer]:
        return lambda: with_layer_weights(MoonEPMoELayer(table.config(fields), single_world("cuda")), plan)

    def native() -> torch.nn.Module:
        return native_layer(table.hidden, table.ffn, shapes["num_experts"], table.top_k)

    layers = [(ours({}), "moonep DEFAULT"), (native, "torch-native")]
    if args.config:
        fields = " ".join(f"{key}={value}" for key, value in args.config.items())
        layers.insert(1, (ours(args.config), f"moonep {fields}"))
    rows = [traced_step(build, x_th, grad_th, name, args.micro_batches) for build, name in layers]
    for row in rows:
        print(f"{row['layer']}: peak {row['peak_gib']:.2f} GiB (arena {row['arena_gib']:.2f}), held between "
              f"steps {row['held_gib']:.2f}; at the traced peak ({row['traced_peak_gib']:.2f} GiB):",
              flush=True)
        for group in row["at_peak"][:args.top]:
            print(f"  {group['gib']:7.3f} GiB {group['blocks']:4d}x  {group['where']}", flush=True)
    setup = {**table.setup, "ep_rank_plan": None if plan is None else plan.describe(), "config": args.config,
             "micro_batches": args.micro_batches}
    name = table.record_name.replace("layer-", "memory-", 1)
    name += (f"-mb{args.micro_batches}" if args.micro_batches > 1 else "") + config_suffix(args.config)
    path = write_record(name, {}, rows, Path(args.out) if args.out else None, setup=setup)
    print("record:", path)


if __name__ == "__main__":
    main()
