"""Grouped-GEMM backends on the expert shapes of real models, against the dense bf16 rate of the same run.

    python -m bench.gemm --preset ep8       # one EP=8 rank's rows, with pass/miss (an H200: ~2 min)
    python -m bench.gemm                    # all shapes, uniform and skewed segments (an H200: ~6 min)
    python -m bench.gemm --shapes deepseek-v3 --rows 65536 --layouts plain arena
    python -m bench.gemm --preset ep8 --backends auto fp8   # fp8 beside bf16 (~1 min)

For each model's expert shape at EP=8 (its packaged config, `moonep_moe/configs/<name>.yaml`: H, H' and
epn = E / ep_size home + B = epn slot groups, rows = the routes of one rank, each segment padded to 128)
and each backend: TFLOP/s (on the used rows) of fwd, dgrad and wgrad of both projections, as a ratio to the
dense bf16 rate, with the weights given as a (home, slots) pair (the GEMM backend copies them together), as
one ordinary tensor ("plain": what an EP=1 layer has), and as one arena tensor (`moonep_moe.transport.arena`:
two VMM allocations mapped back to back, no copy); the weight gradient against its floor (its FLOPs at the
dense rate, or its bytes at the copy bandwidth: the gradients the mode moves, the bf16 inputs read; the
larger); and the whole expert block forward + backward (the layer's own code path) against the sum of its
GEMMs.

Every time is the median of --repeat runs (>= 5) after --warmup, with the min-max beside it; the rows of a
case (backends, layouts, gradient modes) are timed in turns, each round running every row's every op once
(`in_turns`), so none is measured on a GPU warmer than another's (records up to 73a226e timed them one row
after another, the first row on the coolest GPU); every ratio
is the medians' ratio with the range over the pairings of the runs (`bench.common.ratio`). Each row is
checked against the EP=8 rank's targets (`TARGETS`: fwd and dgrad >= 0.92 of dense, wgrad <= 1.15x its
floor, the block <= 1.08x its GEMMs), printed as PASS / MISS lines and recorded in the JSON's `targets`
(one entry per row and target, naming the row; computed from the row, never set by hand).

--preset ep8 runs one rank of an EP=8 group as a real plan makes it: S*K = 8192*8 = 65536 routes (each
config's max_tokens_per_rank * top_k) over DeepSeek-V3's 32 home + 32 slot groups and Kimi-K2's 48 + 48, the
routes per group those of the rank hosting the most replicas when the real planner balances the whole
group's routing at maxvio 0 and 20 (`bench.ep_rank.ep_rank_plan`: the slots it leaves empty are empty
groups), the weights on the arena as the layer has them, each gradient mode, every backend; recorded as
`gemm-ep8-<device>-<date>-<commit>.json` (the other runs: `gemm-...`). It is bounded by that: 2 shapes x 2
maxvios x 3 gradient modes x the backends, each of fwd, dgrad, wgrad and the block timed 3 + 10 times
(~10-40 ms a call at these shapes), ~1-2 s of timing per row; the rest is one-off start-up (the dense
limits, DeepGEMM's JIT, the Triton wgrad's autotuning and `auto`'s measurement: a minute or so on a fresh
machine, cached after).

Gradient modes (`--grads`, each a row of its own): "param", `expert_grad_dtype`'s default, has wgrad make
fresh gradients in the weights' dtype (bf16); "param_add" has it add into existing ones (what "param" does
from an optimizer step's second micro-batch on, `auto`'s `wgrad add` pick); "main_grad" has it add into fp32
gradients. The floor counts the gradient bytes each mode moves: bf16 written, bf16 read and written, or fp32
read and written.

Backends: torch (in "param" mode also `wgrad_home`: its wgrad's home groups alone, `torch._grouped_mm` over
the first epn segments of both projections, so wgrad minus it is what the slot groups' Triton launch costs),
deep_gemm (fwd, dgrad and the home groups' wgrad; the slots' wgrad on Triton; in "param" mode also
`wgrad_home`, its k-grouped kernel alone, and `wgrad_zero`, the zeroing of the fresh gradients before it),
triton (wgrad on the Triton kernel; fwd/dgrad on torch), auto (each op and shape on the backend measured
fastest, as the layer's "auto" picks it; the picks are printed and recorded), fp8
(`moonep_moe.gemm.fp8.Fp8GroupedGemm`, what a `precision="fp8"` layer runs: fwd and dgrad on DeepGEMM's FP8
GEMMs where it runs, wgrad in bf16 on auto's pick) and fp8_wgrad (the same with `fp8_wgrad`: wgrad as FP8
GEMMs on DeepGEMM's k-grouped kernel, into the fp32 gradients) and fp8_triton (the fp8 one on the package's
Triton FP8 GEMM, what runs where DeepGEMM cannot); neither is in the default list: `--backends auto fp8
fp8_wgrad fp8_triton`.

The fp8 row (targets `FP8_TARGETS`: fwd and dgrad >= 1.7x the dense bf16 rate, wgrad and
the block as for bf16) takes bf16 activations and bf16 weights as a training layer does, so its fwd and
dgrad times include every cast a training step makes for them: the activations' (x and hw in fwd, dy and
dab in dgrad, `cast_rows`) and the weights' (fwd: `q`; dgrad: the transposed `qt`; both on every call, as
for the prefetch slots: the row's weights are plain tensors, which `Fp8WeightCache` does not keep, so this
is one micro-batch per optimizer step). Each cast is also timed alone and recorded
(`fwd_cast_ms`, `dgrad_cast_ms`: activations; `weight_cast_fwd_ms`, `weight_cast_dgrad_ms`: every group of
both projections in one orientation), which says how much of each op is casting. The rates count the used
rows' FLOPs as for bf16, against the same run's dense bf16 rate.
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import NamedTuple

import torch

from bench.common import (
    MODELS,
    check,
    format_check,
    measure_limits,
    model_shape,
    ratio,
    span,
    spread,
    timings,
    total,
    write_record,
)
from bench.ep_rank import ep_rank_plan
from moonep_moe.gemm.autotune import MeasuredGroupedGemm
from moonep_moe.gemm.base import GemmProblem
from moonep_moe.gemm.fp8 import Fp8GroupedGemm
from moonep_moe.gemm.registry import fp8_grouped_gemm, fp8_unsupported_reason, select_grouped_gemm
from moonep_moe.layers.function import hands_fp8_rows
from moonep_moe.layers.swiglu import swiglu_backward_rows, swiglu_weighted, swiglu_weighted_fp8
from moonep_moe.transport.arena import PhysicalRows, expert_arena_reason, joined_rows

PAD = 128

PRESETS = {"ep8": {"shapes": ["deepseek-v3", "kimi-k2"], "rows": None, "maxvios": [0.0, 20.0],
                   "layouts": ["arena"], "grads": ["param", "param_add", "main_grad"]}}
"""`--preset NAME`: the shapes, rows (None: each model's S*K), the maxvios of the real plans whose
segments it times (instead of --skews), layouts and gradient modes it runs."""
GRAD_MODES = ("param", "param_add", "main_grad")
"""`--grads`: wgrad into fresh gradients in the weights' dtype (the default `expert_grad_dtype`), added into
existing ones of that dtype (its later micro-batches), or added into fp32 ones."""
GRAD_BYTES = {"param": 2, "param_add": 4, "main_grad": 8}
"""Bytes each gradient element moves per wgrad in each mode: bf16 written; bf16 read and written; fp32 read
and written."""

TARGETS = (  # (what, op, bound): one rank of an EP=8 group
    ("fwd of dense", ">=", 0.92),
    ("dgrad of dense", ">=", 0.92),
    ("wgrad vs its floor", "<=", 1.15),
    ("block vs its GEMMs", "<=", 1.08),
)
FP8_TARGETS = (("fwd of dense", ">=", 1.7), ("dgrad of dense", ">=", 1.7), *TARGETS[2:])
"""The fp8 row's: fwd and dgrad at 1.7x the dense bf16 rate; wgrad (bf16) and the block
as for bf16."""


def expert_shape(name: str) -> tuple[int, int, int]:
    """`(H, H', epn)` of a model's packaged config: epn = E / ep_size home experts per rank."""
    shape = model_shape(name)
    return shape["hidden"], shape["ffn"], shape["experts"] // shape["ep_size"]


class Case(NamedTuple):
    """One shape's segments: `rows` routes spread over the groups by lognormal(0, `skew`) shares, or, with
    `maxvio`, as a real plan of the model's EP group at that maxvio gives them to one rank (`rows`: S*K)."""

    shape: str
    rows: int
    skew: float | None = None
    maxvio: float | None = None

    @property
    def label(self) -> str:
        return f"skew={self.skew}" if self.maxvio is None else f"maxvio={self.maxvio:g}"


def cases(shapes: list[str], rows: list[int] | None, skews: list[float],
          maxvios: list[float] | None = None) -> list[Case]:
    """The cases in the order run; `rows` None: each model's S*K (one rank's routes); `maxvios` (real plans'
    segments at S*K) instead of `skews` where given."""
    out = []
    for name in shapes:
        shape = model_shape(name)
        for m in rows or [shape["tokens"] * shape["top_k"]]:
            if maxvios is not None:
                out.extend(Case(name, m, maxvio=maxvio) for maxvio in maxvios)
            else:
                out.extend(Case(name, m, skew=skew) for skew in skews)
    return out


def gemm_targets(row: dict, flops: int, dense: float, wgrad_floor_s: float) -> list[dict]:
    """`TARGETS` checked on one row's timings (`<op>_ms`, `_ms_min`, `_ms_max` for fwd, dgrad, wgrad and
    block): fwd and dgrad as `flops` (both projections, used rows) at the dense rate over their time, wgrad
    over `wgrad_floor_s`, the block over the sum of its GEMMs. Each entry names its row (`row`); the fp8
    row is checked against `FP8_TARGETS`, every other against `TARGETS`."""
    at_dense_ms = flops / dense * 1e3
    values = {"fwd of dense": ratio(at_dense_ms, span(row, "fwd_")),
              "dgrad of dense": ratio(at_dense_ms, span(row, "dgrad_")),
              "wgrad vs its floor": ratio(span(row, "wgrad_"), wgrad_floor_s * 1e3),
              "block vs its GEMMs": ratio(span(row, "block_"),
                                          total(*(span(row, f"{op}_") for op in ("fwd", "dgrad", "wgrad"))))}
    name = " ".join([row["shape"], f"rows={row['rows']}", row["segments"], row["backend"], row["weights"],
                     row["grads"]])
    targets = FP8_TARGETS if row["backend"].startswith("fp8") else TARGETS
    return [check(what, values[what], op, bound, row=name) for what, op, bound in targets]


def segment_ends(groups: int, routes: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """`[G]` int32 padded end offsets of `routes` rows spread over `groups` by lognormal(0, skew) shares."""
    share = torch.exp(skew * torch.randn(groups, generator=gen, dtype=torch.float64))
    counts = torch.distributions.Multinomial(routes, share / share.sum()).sample().long()
    return padded_ends(counts)


def padded_ends(counts_g: torch.Tensor) -> torch.Tensor:
    """`[G]` int32 end offsets of segments of `counts_g` rows, each padded to a multiple of `PAD`."""
    padded = (counts_g.long() + PAD - 1) // PAD * PAD
    return torch.cumsum(padded, 0).to(torch.int32)


def plan_segments(name: str, maxvio: float, device: str = "cuda") -> tuple[torch.Tensor, dict]:
    """The padded ends of one EP rank's `epn + B` groups (home, then slots) as the real planner balances the
    model's whole EP group at `maxvio` (`bench.ep_rank.ep_rank_plan`, B = epn), and what the record says of
    that plan."""
    shape = model_shape(name)
    plan = ep_rank_plan(shape["experts"], shape["ep_size"], shape["tokens"], shape["top_k"], maxvio, device)
    counts_g = torch.tensor(plan.home_routes + plan.slot_routes)
    return padded_ends(counts_g), {"maxvio_reached": plan.maxvio, "rank": plan.rank,
                                   "slots_used": sum(r > 0 for r in plan.slot_routes)}


def weight_grads(parts: tuple[torch.Tensor, ...], epn: int, grads: str) -> list[torch.Tensor | None]:
    """What the layer's wgrad of weights `parts` (`[G, cols, inner]` over all parts) writes into, as
    `(home, slots)` with `epn` home groups, in gradient mode `grads`: "param", the home gradients fresh (None:
    the GEMM's own output, in the weights' dtype) and the slot gradients written over a `[B, cols, inner]`
    tensor in the weights' dtype (the layer's slot weights); "param_add", zeroed gradients of both in the
    weights' dtype, added into (the home ones the `.grad` of earlier micro-batches, the slots cleared for
    the add); "main_grad", zeroed fp32 gradients of both, added into."""
    groups, cols, inner = sum(p.shape[0] for p in parts), parts[0].shape[1], parts[0].shape[2]
    device, dtype = parts[0].device, parts[0].dtype
    if grads == "param":
        return [None, torch.empty(groups - epn, cols, inner, dtype=dtype, device=device)]
    grad_dtype = dtype if grads == "param_add" else torch.float32
    return [torch.zeros(n, cols, inner, dtype=grad_dtype, device=device) for n in (epn, groups - epn)]


def block(gemm, x, w, offs, gate_up, down, g, outs: tuple[list, list], add: bool):
    """The layer's expert block, forward and backward (as `MoonEPExperts` runs it with peers: dab written
    over ab, both dgrads before the weight gradients), the weight gradients into `outs` (gate_up's, down's:
    `weight_grads`, made once, as the layer's slot and main_grad tensors persist), added into with `add`."""
    fp8_rows = hands_fp8_rows(gemm, down[0].shape[-1])  # SwiGLU casts the FP8 GEMMs' rows, as in the layer
    ab = gemm.fwd(x, gate_up, offs)
    hw = (swiglu_weighted_fp8 if fp8_rows else swiglu_weighted)(ab, w, offs[-1:])
    gemm.fwd(hw, down, offs)
    u = gemm.dgrad(g, down, offs)
    dab, _, hw, dab_rows = swiglu_backward_rows(u, ab, w, offs[-1:], over_ab=True, fp8_rows=fp8_rows)
    gemm.dgrad(dab_rows, gate_up, offs)
    gemm.wgrad(g, hw, offs, outs[1], accumulate=add)
    gemm.wgrad(dab, x, offs, outs[0], accumulate=add)


def arena_weights(home: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`home` and `slots` copied into two VMM allocations mapped back to back: one tensor, as the layer's
    arena gives the grouped GEMM (no per-call copy)."""
    device = torch.device("cuda", torch.cuda.current_device())
    parts = [PhysicalRows(t.shape[0], tuple(t.shape[1:]), t.dtype, device) for t in (home, slots)]
    for part, t in zip(parts, (home, slots), strict=True):
        part.tensor.copy_(t)
    return joined_rows(*parts)


def make_gemm(backend: str, k: int, problem: GemmProblem | None):
    """The grouped GEMM a layer with `grouped_gemm=backend` runs (bf16); "fp8": a `precision="fp8"` layer's
    (FP8 fwd and dgrad on the kernel it picks, wgrad on auto's pick); "fp8_wgrad": the same with
    `fp8_wgrad` (wgrad as FP8 GEMMs on DeepGEMM); "fp8_triton": the fp8 one on the Triton FP8 GEMM, what
    runs where DeepGEMM cannot. Raises ValueError where it cannot run here."""
    cuda = torch.device("cuda")
    if not backend.startswith("fp8"):
        return select_grouped_gemm(backend, cuda, torch.bfloat16, k=k, token_padding=PAD, problem=problem)
    wgrad = select_grouped_gemm("auto", cuda, torch.bfloat16, k=k, token_padding=PAD, problem=problem)
    if backend in ("fp8", "fp8_wgrad"):
        return fp8_grouped_gemm(wgrad, cuda, torch.bfloat16, PAD, fp8_wgrad=backend == "fp8_wgrad")
    return Fp8GroupedGemm(wgrad, kernel=backend.removeprefix("fp8_"))


def unavailable(backend: str) -> str | None:
    """Why `make_gemm(backend, ...)` cannot run here, or None."""
    if backend.startswith("fp8"):
        return fp8_unsupported_reason(torch.device("cuda"), torch.bfloat16, PAD)
    try:
        make_gemm(backend, 128, None)
    except (ValueError, ImportError) as error:
        return str(error)
    return None


def cast_ops(x, dab, g, hw, offs, gate_up, down) -> dict:
    """The FP8 casts inside the fp8 row, each timed alone: the activations of fwd (x, hw) and of dgrad (dy
    of both projections: g, dab), and the weights (every group of both projections) in fwd's orientation
    and in dgrad's transposed one."""
    from moonep_moe.fp8.cast import cast_blocks, cast_rows

    def cast_weights(transposed: bool) -> None:
        for part in (*gate_up, *down):
            groups, n, k = part.shape
            out = torch.empty((groups, k, n) if transposed else part.shape, dtype=torch.float8_e4m3fn,
                              device="cuda")
            scales = torch.empty(groups, -(-n // 128), -(-k // 128), device="cuda")
            cast_blocks(part, scales, None if transposed else out, out if transposed else None)

    return {"fwd_cast": lambda: (cast_rows(x, offs), cast_rows(hw, offs)),
            "dgrad_cast": lambda: (cast_rows(g, offs), cast_rows(dab, offs)),
            "weight_cast_fwd": lambda: cast_weights(False), "weight_cast_dgrad": lambda: cast_weights(True)}


def gemm_ops(gemm, x, dab, g, hw, offs, gate_up, down, outs: tuple[list, list], add: bool) -> dict:
    """The six GEMMs of the expert block, as three timed pairs (both projections each); wgrad into `outs`,
    added into with `add` (the adding modes: the same gradients every call, as micro-batches do)."""
    return {
        "fwd": lambda: (gemm.fwd(x, gate_up, offs), gemm.fwd(hw, down, offs)),
        "dgrad": lambda: (gemm.dgrad(dab, gate_up, offs), gemm.dgrad(g, down, offs)),
        "wgrad": lambda: (gemm.wgrad(dab, x, offs, outs[0], accumulate=add),
                          gemm.wgrad(g, hw, offs, outs[1], accumulate=add)),
    }


def bench_shape(case: Case, backends: list[str], limits: dict, wanted_layouts: list[str],
                grad_modes: list[str], warmup: int, repeat: int) -> list[dict]:
    """One row per backend, layout and gradient mode of one case, each with its `targets`."""
    name, rows = case.shape, case.rows
    h, f, epn = expert_shape(name)
    groups = 2 * epn
    if case.maxvio is None:
        offs, plan = segment_ends(groups, rows, case.skew, torch.Generator().manual_seed(0)), {}
    else:
        offs, plan = plan_segments(name, case.maxvio)
    offs = offs.cuda()
    m_total = int(offs[-1])

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / math.sqrt(shape[-1])

    x, g = rand(m_total, h), rand(m_total, h)
    w = torch.rand(m_total, device="cuda")
    layouts = {"pair": ((rand(epn, 2 * f, h), rand(groups - epn, 2 * f, h)),
                        (rand(epn, h, f), rand(groups - epn, h, f)))}
    layouts["plain"] = tuple((torch.cat(pair),) for pair in layouts["pair"])
    arena_reason = expert_arena_reason(torch.device("cuda", 0), [epn * 2 * f * h * 2, epn * h * f * 2])
    if arena_reason is None:
        layouts["arena"] = tuple((arena_weights(*pair),) for pair in layouts["pair"])
    elif "arena" in wanted_layouts:
        print(f"{name:18} no arena rows: {arena_reason}", flush=True)
    layouts = {name: weights for name, weights in layouts.items() if name in wanted_layouts}
    dab, hw = rand(m_total, 2 * f), rand(m_total, f)
    flops = 2 * rows * 3 * f * h  # per op pair, on the real rows (not the padding)
    dense, copy = limits["dense_bf16_flops_per_s"], limits["copy_bytes_per_s"]
    out, timed = [], []  # the rows and their calls, timed together in turns (`in_turns`)
    for backend, (layout, (gate_up, down)), grads in itertools.product(backends, layouts.items(), grad_modes):
        # what "auto" measures: the layer's problem in this gradient mode (`MoonEPMoELayer`'s)
        problem = GemmProblem(((2 * f, h), (h, f)), rows_per_group=rows // epn,
                              grad_dtype=torch.float32 if grads == "main_grad" else torch.bfloat16,
                              groups=(epn, groups - epn), fresh_home_grads=grads != "main_grad")
        # the gradients' bytes in this mode (`GRAD_BYTES`); the bf16 inputs read
        grad_bytes = groups * 3 * f * h * GRAD_BYTES[grads] + m_total * (3 * f + 2 * h) * 2
        wgrad_floor = max(flops / dense, grad_bytes / copy)
        gemm = make_gemm(backend, math.gcd(h, f), problem)
        row = {"shape": name, "rows": rows, "padded_rows": m_total, "groups": groups, "skew": case.skew,
               "maxvio": case.maxvio, "segments": case.label, **({"plan": plan} if plan else {}),
               "backend": gemm.name, "weights": layout, "grads": grads}
        if isinstance(gemm, MeasuredGroupedGemm):
            row["picks"] = {f"{op} {n}x{k}": pick.name for (op, n, k), pick in gemm.chosen.items()}
            print(f"{name:18} auto picks: {row['picks']}", flush=True)
        outs, add = (weight_grads(gate_up, epn, grads), weight_grads(down, epn, grads)), grads != "param"
        calls = gemm_ops(gemm, x, dab, g, hw, offs, gate_up, down, outs, add)
        calls["block"] = lambda gm=gemm, gu=gate_up, dn=down, o=outs, a=add: block(gm, x, w, offs, gu, dn, g,
                                                                                   o, a)
        if backend.startswith("fp8"):
            calls.update(cast_ops(x, dab, g, hw, offs, gate_up, down))
        if gemm.name == "torch" and grads == "param":  # its wgrad less the slot groups' Triton launch
            calls["wgrad_home"] = lambda: (torch._grouped_mm(dab.T, x, offs=offs[:epn]),
                                           torch._grouped_mm(g.T, hw, offs=offs[:epn]))
        if gemm.name == "deep_gemm" and grads == "param":  # its wgrad's kernel, and its zeroing, alone
            calls.update(deep_gemm_home_ops(gemm, x, dab, g, hw, offs, epn))
        timed.append((row, calls, wgrad_floor))
    seconds = in_turns([calls for _, calls, _ in timed], warmup, repeat)
    for (row, _, wgrad_floor), row_seconds in zip(timed, seconds, strict=True):
        for op, secs in row_seconds.items():
            row.update({f"{op}_{key}": value for key, value in spread(secs).items()})
        for op in ("fwd", "dgrad", "wgrad"):
            row[f"{op}_tflops"] = flops / row[f"{op}_ms"] * 1e3 / 1e12
            row[f"{op}_vs_dense"] = row[f"{op}_tflops"] * 1e12 / dense
        row["targets"] = gemm_targets(row, flops, dense, wgrad_floor)
        medians = {target["target"]: target["median"] for target in row["targets"]}
        row["wgrad_floor_ms"] = wgrad_floor * 1e3
        row["wgrad_vs_floor"] = medians["wgrad vs its floor"]
        row["block_vs_gemms"] = medians["block vs its GEMMs"]
        out.append(row)
        print(format_row(row), flush=True)
        for target in row["targets"]:
            print(f"    {format_check(target)}", flush=True)
    return out


def in_turns(calls: list[dict], warmup: int, repeat: int, timer=timings) -> list[dict[str, list[float]]]:
    """Seconds of `repeat` runs of every call of every row (`calls[i]`: op -> function), in turns: after
    `warmup` runs of each, each round times every row's every op once, so no row is measured on a cooler or
    hotter GPU than another (the clocks drift as it warms). `timer(fn, warmup, repeat)`: as
    `bench.common.timings`."""
    for row_calls in calls:
        for fn in row_calls.values():
            timer(fn, warmup, 0)
    seconds = [{op: [] for op in row_calls} for row_calls in calls]
    for _ in range(repeat):
        for row_calls, row_seconds in zip(calls, seconds, strict=True):
            for op, fn in row_calls.items():
                row_seconds[op] += timer(fn, 0, 1)
    return seconds


def deep_gemm_home_ops(gemm, x, dab, g, hw, offs, epn: int) -> dict:
    """The deep_gemm row's wgrad in parts ("param" mode): `wgrad_home`, the backend's wgrad over the home
    groups alone (`offs[:epn]`) of both projections adding into gradients made once (its k-grouped kernel, as
    it runs on gradients it has zeroed), and `wgrad_zero`, the zeroed bf16 gradients it makes first, each
    timed as a call of its own (the device time of each kernel inside the backend's call:
    `bench.deep_gemm_wgrad --kernels`)."""
    pairs = ((dab, x), (g, hw))
    grads = [a.new_zeros(epn, a.shape[1], b.shape[1]) for a, b in pairs]
    return {
        "wgrad_home": lambda: [gemm.wgrad(a, b, offs[:epn], [d], accumulate=True)
                               for (a, b), d in zip(pairs, grads, strict=True)],
        "wgrad_zero": lambda: [a.new_zeros(epn, a.shape[1], b.shape[1]) for a, b in pairs],
    }


def format_row(row: dict) -> str:
    """One printed line: each op's rate (median, its ratio) and time spread, the block's time and ratio."""
    def timing(op: str) -> str:
        return f"{row[op + '_ms']:.2f} ({row[op + '_ms_min']:.2f}-{row[op + '_ms_max']:.2f}) ms"

    casts = ""
    if "wgrad_home_ms" in row:  # the torch and deep_gemm rows in "param" mode
        casts = f"  wgrad's home groups alone {timing('wgrad_home')}"
    if "wgrad_zero_ms" in row:
        casts += f", its zeroing {timing('wgrad_zero')}"
    if "fwd_cast_ms" in row:  # the fp8 row
        casts = (f"  casts in the row: activations fwd {timing('fwd_cast')}, dgrad {timing('dgrad_cast')}; "
                 f"weights fwd {timing('weight_cast_fwd')}, dgrad {timing('weight_cast_dgrad')}")
    return (f"{row['shape']:18} rows={row['rows']:6} {row['segments']:9} {row['backend']:10} "
            f"{row['weights']:5} {row['grads']:9} "
            f"fwd {row['fwd_tflops']:4.0f} TF/s ({row['fwd_vs_dense']:.2f} dense) "
            f"{timing('fwd')}  dgrad {row['dgrad_tflops']:4.0f} ({row['dgrad_vs_dense']:.2f}) "
            f"{timing('dgrad')}"
            f"  wgrad {row['wgrad_tflops']:4.0f} ({row['wgrad_vs_floor']:.2f}x floor) {timing('wgrad')}"
            f"  block {timing('block')} ({row['block_vs_gemms']:.2f}x gemms){casts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="ep8: one EP=8 rank's production rows (instead of --shapes, --rows, --skews "
                             "and --layouts)")
    parser.add_argument("--shapes", nargs="*", choices=MODELS, default=list(MODELS))
    parser.add_argument("--rows", nargs="*", type=int, default=[16384, 65536])
    parser.add_argument("--skews", nargs="*", type=float, default=[0.0, 1.5])
    parser.add_argument("--backends", nargs="*", default=["torch", "deep_gemm", "triton", "auto", "fp8"])
    parser.add_argument("--layouts", nargs="*", default=["pair", "plain", "arena"],
                        help="(home, slots) copied per call, one ordinary tensor, or the VMM arena")
    parser.add_argument("--grads", nargs="*", choices=GRAD_MODES, default=["param"],
                        help="gradient modes: fresh gradients in the weights' dtype (the default), or added "
                             "into fp32 ones")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per op (the median of them, >= 5)")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args()
    if args.repeat < 5:
        parser.error(f"--repeat must be >= 5 (a median with a spread), got {args.repeat}")
    preset = PRESETS.get(args.preset, {})
    runs = cases(preset.get("shapes", args.shapes), preset["rows"] if preset else args.rows,
                 preset.get("skews", args.skews), preset.get("maxvios"))
    layouts, grad_modes = preset.get("layouts", args.layouts), preset.get("grads", args.grads)
    limits = measure_limits()
    print(f"copy {limits['copy_bytes_per_s'] / 1e12:.2f} TB/s, dense bf16 "
          f"{limits['dense_bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    backends = []
    for name in args.backends:
        reason = unavailable(name)
        if reason is None:
            backends.append(name)
        else:
            print(f"skipping backend {name}: {reason}")
    rows = [r for case in runs
            for r in bench_shape(case, backends, limits, layouts, grad_modes, args.warmup, args.repeat)]
    targets = [target for row in rows for target in row.pop("targets")]
    print(f"\nEP=8 rank targets (and the fp8 row's), median (min-max) of {args.repeat} "
          "runs:")
    for target in targets:
        print(f"  {format_check(target)}  [{target['row']}]")
    name = "gemm" if args.preset is None else f"gemm-{args.preset}"  # never overwrites the other's record
    path = write_record(name, limits, rows, Path(args.out) if args.out else None, preset=args.preset,
                        setup={"warmup": args.warmup, "repeat": args.repeat, "pad": PAD,
                               "cases": [case._asdict() for case in runs], "layouts": layouts,
                               "grads": grad_modes}, targets=targets)
    print("results:", path)


if __name__ == "__main__":
    main()
