"""The Triton weight gradient's tile configs on one EP rank's slot groups: each config's time on each layout
of rows, which config the autotuner picks when it tunes on each layout, and torch's grouped GEMM on the same
groups.

    python -m bench.wgrad_tiles             # DeepSeek-V3's expert shape (an H200: under 30 s)
    python -m bench.wgrad_tiles --smoke     # CPU, Triton's interpreter, tiny shapes: every code path

The layer computes the weight gradients of its prefetch slots' groups with the Triton kernel
(`moonep_moe.gemm.kernels.wgrad`, overwriting, from group epn on) wherever the home groups go to a GEMM that
cannot start at a row known only on the device. Its tile config is autotuned per `(cols, inner)` and dtypes
before its first call, on a launch of its own (`kernel._tune`: the `tuning` layout below), and kept on disk.
The layouts (`layouts`), from
the real planner balancing the model's whole EP group (`bench.gemm.plan_segments`, the rank hosting the most
replicas; segments padded to 128):

- `maxvio 0` and `maxvio 20`: that rank's slot groups at the routing skew (maxvio 20: a few slots holding most
  of its rows);
- `even`: maxvio 20's home groups, and its slot rows dealt evenly over every slot (each padded to 128): the
  same work in equal groups, what a tuning run could stand in for the real ones with;
- `tuning`: what `grouped_wgrad_triton` tunes on before its first call (`kernel.tuning_ends`: every row of dy
  dealt evenly over `kernel.TUNING_GROUPS` groups), here as slot groups after empty home groups;
- `no replica`: the home groups of maxvio 0 and every slot empty, a rank the plan gives no replica (the
  launch's programs exit at once).

For each projection (`gate_up`: dy `[rows, 2H']`, x `[rows, H]`; `down`: dy `[rows, H]`, x `[rows, H']`),
each layout and each tile config of the kernel (forced, no autotuning): the launch's time, arms alternated
round by round (`bench.common.alternated_timings`, an L2 flush before each call), median and min-max of
`--repeat`, and TFLOP/s on the slot groups' rows; `torch._grouped_mm` on the same groups (bf16 out, the
slots sliced on the host: what CUTLASS makes of the same FLOPs). Then, per layout, the config the
autotuner picks when it times the configs on that layout's launch (its disk cache off, its memory cache
cleared), and what that pick costs on every layout against the best config there.

Writes `bench/results/wgrad-tiles-<device>-<date>-<commit>.json` (`--out DIR`: elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import triton

from bench.common import alternated_timings, l2_flush, median_spread, model_shape, write_record
from bench.ep_rank import ep_rank_groups
from bench.gemm import PAD, plan_segments
from moonep_moe.base.interpreter import INTERPRETED
from moonep_moe.gemm.kernels import wgrad as kernel

PROJECTIONS = ("gate_up", "down")
LAYOUTS = ("maxvio 0", "maxvio 20", "even", "tuning", "no replica")


def layouts(model: str, device: str) -> tuple[dict[str, torch.Tensor], int, dict]:
    """`({layout: [epn + B] int32 padded group ends}, epn, {layout: what the plan says})` of `LAYOUTS`."""
    shape = model_shape(model)
    epn, _ = ep_rank_groups(shape["experts"], shape["ep_size"])
    out, notes = {}, {}
    for maxvio in (0.0, 20.0):
        ends, note = plan_segments(model, maxvio, device)
        out[f"maxvio {maxvio:g}"], notes[f"maxvio {maxvio:g}"] = ends.to(device), note
    home, skewed = out["maxvio 0"][:epn], out["maxvio 20"]
    slots = skewed.numel() - epn
    each = -(-int(skewed[-1] - skewed[epn - 1]) // (slots * PAD)) * PAD
    steps = torch.arange(1, slots + 1, device=device, dtype=torch.int32)
    out["even"] = torch.cat([skewed[:epn], skewed[epn - 1] + each * steps])
    notes["even"] = {"slots_used": slots, "rows_per_slot": each}
    out["no replica"] = torch.cat([home, home[-1:].expand(slots)])
    notes["no replica"] = {"slots_used": 0}
    return with_tuning(out, epn, notes)


def with_tuning(ends_by: dict[str, torch.Tensor], epn: int, notes: dict) -> tuple[dict, int, dict]:
    """`ends_by` with the `tuning` layout inserted before `no replica`, over the largest layout's rows."""
    rows = max(int(ends[-1]) for ends in ends_by.values())
    some = next(iter(ends_by.values()))
    tuning = kernel.tuning_ends(rows, some.device)
    slots = some.numel() - epn
    ends = torch.cat([some.new_zeros(epn), tuning, tuning[-1:].expand(slots - tuning.numel())])
    order = [name for name in LAYOUTS if name in ends_by or name == "tuning"]
    ends_by = {**ends_by, "tuning": ends}
    notes = {**notes, "tuning": {"slots_used": kernel.TUNING_GROUPS, "rows_per_slot": int(tuning[0])}}
    return {name: ends_by[name] for name in order}, epn, {name: notes[name] for name in order}


def smoke_layouts(device: str) -> tuple[dict[str, torch.Tensor], int, dict]:
    """Tiny layouts of 4 home and `kernel.TUNING_GROUPS` slot groups (rows padded to 16) for the CPU run."""
    home, slots = [32, 48, 32, 32], kernel.TUNING_GROUPS
    rows = {"maxvio 0": home + [16] + [0] * (slots - 1),
            "maxvio 20": [16, 0, 16, 16, 96, 32] + [0] * (slots - 2),
            "even": home + [16] * slots, "no replica": home + [0] * slots}
    ends = {name: torch.tensor(r, device=device).cumsum(0).to(torch.int32) for name, r in rows.items()}
    return with_tuning(ends, 4, {name: {"slots_used": sum(n > 0 for n in r[4:])} for name, r in rows.items()})


def operands(projection: str, hidden: int, ffn: int, rows: int, slots: int, device: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dy [rows, cols], x [rows, inner], out [slots, cols, inner])` of one projection's weight gradient,
    bf16 (the slot gradients in the weights' dtype, as the layer's "param" mode writes them)."""
    cols, inner = (2 * ffn, hidden) if projection == "gate_up" else (hidden, ffn)
    dy = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    x = torch.randn(rows, inner, device=device, dtype=torch.bfloat16)
    return dy, x, torch.empty(slots, cols, inner, device=device, dtype=torch.bfloat16)


def config_name(config: triton.Config) -> str:
    """`BLOCK_COLSxBLOCK_INNERxBLOCK_ROWS/warps/stages`."""
    k = config.kwargs
    return f"{k['BLOCK_COLS']}x{k['BLOCK_INNER']}x{k['BLOCK_ROWS']}/w{config.num_warps}/s{config.num_stages}"


def forced(config: triton.Config, dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, epn: int,
           out: torch.Tensor):
    """The layer's slot launch (overwrite, groups from epn on, unused slots left alone) with `config`, no
    autotuning."""
    cols, inner, groups = dy.shape[1], x.shape[1], out.shape[0]
    k = config.kwargs
    grid = (groups * triton.cdiv(cols, k["BLOCK_COLS"]) * triton.cdiv(inner, k["BLOCK_INNER"]),)
    launch = dict(k) if INTERPRETED else dict(k, num_warps=config.num_warps, num_stages=config.num_stages)

    def call() -> None:
        kernel._grouped_wgrad_kernel.fn[grid](
            dy, x, ends, out, out, groups, epn, epn, cols, inner, dy.stride(0), x.stride(0), out.stride(0),
            out.stride(0), ACCUMULATE=False, SWIZZLE=kernel.SWIZZLE,
            INTERPRET_ROWS=dy.shape[0] if INTERPRETED else 0, **launch)

    return call


def torch_slots(dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, epn: int):
    """`torch._grouped_mm` over the slot groups alone, their rows sliced on the host (bf16 out)."""
    start = int(ends[epn - 1])
    offs = (ends[epn:] - start).to(torch.int32)
    dy_s, x_s = dy[start:], x[start:]
    return lambda: torch._grouped_mm(dy_s.T, x_s, offs=offs)


def autotuned_pick(dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, epn: int, out: torch.Tensor
                   ) -> triton.Config:
    """The config the autotuner picks when it times the configs on the slot launch of `ends`' rows: the
    kernel's launch itself (`kernel._launch`, as `grouped_wgrad_triton` makes it), not through
    `grouped_wgrad_triton`, whose own tuning launch (`kernel._tune`, the `tuning` layout) would pick first."""
    tuner = kernel._grouped_wgrad_kernel
    was = tuner.cache_results
    tuner.cache_results, tuner.cache = False, {}
    groups = out.shape[0]
    try:
        kernel._launch(dy, x, ends, out, out, groups, groups, epn, accumulate=False, zeroed_groups=epn)
        return tuner.best_config
    finally:
        tuner.cache_results, tuner.cache = was, {}


def projection_rows(projection: str, dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
                    ends_by: dict[str, torch.Tensor], epn: int, repeat: int, on_cuda: bool) -> dict:
    """Every config and torch on every layout, then the config the autotuner picks when it tunes on each."""
    configs = kernel._grouped_wgrad_kernel.configs
    names = [config_name(c) for c in configs]
    flush = l2_flush() if on_cuda else None
    cols, inner = dy.shape[1], x.shape[1]
    result: dict = {"cols": cols, "inner": inner, "layouts": {}}
    for layout, ends in ends_by.items():
        slot_rows = int(ends[-1] - ends[epn - 1])
        calls = [forced(c, dy, x, ends, epn, out) for c in configs]
        arms = [*names]
        if slot_rows:
            calls.append(torch_slots(dy, x, ends, epn))
            arms.append("torch._grouped_mm")
        times = alternated_timings(calls, repeat, before=[flush] * len(calls), device=dy.device)
        flops = 2 * slot_rows * cols * inner
        result["layouts"][layout] = {
            "slot_rows": slot_rows, "slots_used": int(((ends[epn:] - ends[epn - 1:-1]) > 0).sum()),
            "arms": {arm: {**median_spread([t * 1e3 for t in ts]),
                           "tflops": flops / statistics.median(ts) / 1e12} for arm, ts in zip(arms, times,
                                                                                              strict=True)}}
    picks = {}
    for layout, ends in ends_by.items():
        pick = config_name(autotuned_pick(dy, x, ends, epn, out))
        picks[layout] = {"config": pick, "cost": {
            where: row["arms"][pick]["median"] / min(row["arms"][n]["median"] for n in names)
            for where, row in result["layouts"].items()}}
    result["autotuned_on"] = picks
    return result


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3", help="a packaged config's expert shape and group")
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds (medians of them)")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--out", type=Path, default=None, help="write the record here")
    args = parser.parse_args(argv)
    on_cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if on_cuda else "cpu"
    if args.smoke:
        ends_by, epn, notes = smoke_layouts(device)
        hidden, ffn = 64, 32
    else:
        ends_by, epn, notes = layouts(args.model, device)
        shape = model_shape(args.model)
        hidden, ffn = shape["hidden"], shape["ffn"]
    rows = max(int(e[-1]) for e in ends_by.values())
    slots = next(iter(ends_by.values())).numel() - epn
    record: dict = {}
    for projection in PROJECTIONS:
        dy, x, out = operands(projection, hidden, ffn, rows, slots, device)
        record[projection] = projection_rows(projection, dy, x, out, ends_by, epn, args.repeat, on_cuda)
        del dy, x, out
        for layout, row in record[projection]["layouts"].items():
            arms = row["arms"]
            best = min((arm for arm in arms if arm != "torch._grouped_mm"),
                       key=lambda arm: arms[arm]["median"])
            torch_ms = (f", torch._grouped_mm {arms['torch._grouped_mm']['median']:.3f} ms"
                        if "torch._grouped_mm" in arms else "")
            print(f"{projection} {layout}: {row['slot_rows']} slot rows in {row['slots_used']} slots, "
                  f"best config {best} {arms[best]['median']:.3f} ms ({arms[best]['tflops']:.0f} TFLOP/s)"
                  f"{torch_ms}")
        for layout, pick in record[projection]["autotuned_on"].items():
            costs = ", ".join(f"{where} {cost:.2f}x" for where, cost in pick["cost"].items())
            print(f"{projection} tuned on {layout}: {pick['config']}; against the best config: {costs}")
    setup = {"model": "smoke" if args.smoke else args.model, "hidden": hidden, "ffn": ffn, "epn": epn,
             "pad": 16 if args.smoke else PAD, "repeat": args.repeat, "layouts": notes,
             "timing": "alternated rounds, a 256 MiB L2 flush before each call; CUDA events around the call"}
    name = "wgrad-tiles-smoke" if args.smoke else "wgrad-tiles"
    path = write_record(name, {}, [record], out_dir=args.out, ran_on=device, setup=setup)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
