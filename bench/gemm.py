"""Grouped-GEMM backends on the expert shapes of real models, against the dense bf16 rate of the same run.

    python -m bench.gemm                    # all shapes, uniform and skewed segments (an H200: ~6 min)
    python -m bench.gemm --shapes deepseek-v3 --rows 65536 --layouts plain arena

For each model's expert shape at EP=8 (epn home + B = epn slot groups, rows = the routes of one rank,
each segment padded to 128) and each backend: TFLOP/s (on the used rows) of fwd, dgrad and wgrad of both
projections, as a ratio to the dense bf16 rate, with the weights given as a (home, slots) pair (the GEMM
backend copies them together), as one ordinary tensor ("plain": what an EP=1 layer has), and as one arena
tensor (`moonep_moe.weights.arena`: two VMM allocations mapped back to back, no copy); the weight
gradient against its floor (its FLOPs at the dense rate, or its bytes at the copy bandwidth: the fp32
gradients written (overwrite, as the layer runs it), the bf16 inputs read; the larger); and the whole expert
block forward + backward (the layer's own code path) against the sum of its GEMMs.

Backends: torch, deep_gemm (fwd/dgrad; wgrad on torch), triton (wgrad on the Triton kernel; fwd/dgrad on
torch) and auto (each op and shape on the backend measured fastest, as the layer's "auto" picks it; the
picks are printed and recorded).
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch

from bench.common import measure_limits, timed, write_record
from moonep_moe.layers.grouped_gemm import GemmProblem, MeasuredGroupedGemm, select_grouped_gemm
from moonep_moe.layers.swiglu import swiglu_weighted, swiglu_weighted_backward
from moonep_moe.weights.arena import PhysicalRows, expert_arena_reason, joined_rows

SHAPES = {  # name: (H, H', experts per rank at EP=8)
    "deepseek-v3": (7168, 2048, 32),
    "kimi-k2": (7168, 2048, 48),
    "qwen3-moe-30b-a3b": (2048, 768, 16),
    "mixtral-8x7b": (4096, 14336, 1),
}
PAD = 128


def segment_ends(groups: int, routes: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """`[G]` int32 padded end offsets of `routes` rows spread over `groups` by lognormal(0, skew) shares."""
    share = torch.exp(skew * torch.randn(groups, generator=gen, dtype=torch.float64))
    counts = torch.distributions.Multinomial(routes, share / share.sum()).sample().long()
    padded = (counts + PAD - 1) // PAD * PAD
    return torch.cumsum(padded, 0).to(torch.int32)


def block(gemm, x, w, offs, gate_up, down, g):
    """The layer's expert block, forward and backward (as `MoonEPExperts` runs it)."""
    ab = gemm.fwd(x, gate_up, offs)
    hw = swiglu_weighted(ab, w, offs[-1:])
    gemm.fwd(hw, down, offs)
    u = gemm.dgrad(g, down, offs)
    dab, _, hw = swiglu_weighted_backward(u, ab, w, offs[-1:])
    gate_up_grads, down_grads = fp32_grads(gate_up), fp32_grads(down)
    gemm.wgrad(g, hw, offs, down_grads, accumulate=False)
    gemm.wgrad(dab, x, offs, gate_up_grads, accumulate=False)
    gemm.dgrad(dab, gate_up, offs)


def arena_weights(home: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`home` and `slots` copied into two VMM allocations mapped back to back: one tensor, as the layer's
    arena gives the grouped GEMM (no per-call copy)."""
    device = torch.device("cuda", torch.cuda.current_device())
    parts = [PhysicalRows(t.shape[0], tuple(t.shape[1:]), t.dtype, device) for t in (home, slots)]
    for part, t in zip(parts, (home, slots), strict=True):
        part.tensor.copy_(t)
    return joined_rows(*parts)


def fp32_grads(parts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Uninitialised fp32 gradients like `parts` (the wgrads below overwrite them, as the layer does)."""
    return [torch.empty(p.shape, dtype=torch.float32, device="cuda") for p in parts]


def gemm_ops(gemm, x, dab, g, hw, offs, gate_up, down) -> dict:
    """The six GEMMs of the expert block, as three timed pairs (both projections each)."""
    grads = fp32_grads(gate_up), fp32_grads(down)
    return {
        "fwd": lambda: (gemm.fwd(x, gate_up, offs), gemm.fwd(hw, down, offs)),
        "dgrad": lambda: (gemm.dgrad(dab, gate_up, offs), gemm.dgrad(g, down, offs)),
        "wgrad": lambda: (gemm.wgrad(dab, x, offs, grads[0], accumulate=False),
                          gemm.wgrad(g, hw, offs, grads[1], accumulate=False)),
    }


def bench_shape(name: str, rows: int, skew: float, backends: list[str], limits: dict,
                wanted_layouts: list[str]) -> list[dict]:
    h, f, epn = SHAPES[name]
    groups = 2 * epn
    gen = torch.Generator().manual_seed(0)
    offs = segment_ends(groups, rows, skew, gen).cuda()
    m_total = int(offs[-1])

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / math.sqrt(shape[-1])

    x, g = rand(m_total, h), rand(m_total, h)
    w = torch.rand(m_total, device="cuda")
    layouts = {"pair": ((rand(epn, 2 * f, h), rand(groups - epn, 2 * f, h)),
                        (rand(epn, h, f), rand(groups - epn, h, f)))}
    layouts["plain"] = tuple((torch.cat(pair),) for pair in layouts["pair"])
    if expert_arena_reason(torch.device("cuda", 0), [epn * 2 * f * h * 2, epn * h * f * 2]) is None:
        layouts["arena"] = tuple((arena_weights(*pair),) for pair in layouts["pair"])
    layouts = {name: weights for name, weights in layouts.items() if name in wanted_layouts}
    dab, hw = rand(m_total, 2 * f), rand(m_total, f)
    flops = 2 * rows * 3 * f * h  # per op pair, on the real rows (not the padding)
    dense, copy = limits["dense_bf16_flops_per_s"], limits["copy_bytes_per_s"]
    grad_bytes = groups * 3 * f * h * 4 + m_total * (3 * f + 2 * h) * 2  # fp32 written, bf16 read
    wgrad_floor = max(flops / dense, grad_bytes / copy)
    problem = GemmProblem(((2 * f, h), (h, f)), rows_per_group=rows // groups)  # what "auto" measures
    out = []
    for backend, (layout, (gate_up, down)) in itertools.product(backends, layouts.items()):
        gemm = select_grouped_gemm(backend, torch.device("cuda"), torch.bfloat16, k=math.gcd(h, f),
                                   token_padding=PAD, problem=problem)
        row = {"shape": name, "rows": rows, "padded_rows": m_total, "groups": groups, "skew": skew,
               "backend": gemm.name, "weights": layout}
        if isinstance(gemm, MeasuredGroupedGemm):
            row["picks"] = {f"{op} {n}x{k}": pick.name for (op, n, k), pick in gemm.chosen.items()}
            print(f"{name:18} auto picks: {row['picks']}", flush=True)
        gemm_total = 0.0
        for op, fn in gemm_ops(gemm, x, dab, g, hw, offs, gate_up, down).items():
            seconds = timed(fn)
            gemm_total += seconds
            row[f"{op}_ms"] = seconds * 1e3
            row[f"{op}_tflops"] = flops / seconds / 1e12
            row[f"{op}_vs_dense"] = flops / seconds / dense
        row["wgrad_vs_floor"] = row["wgrad_ms"] / 1e3 / wgrad_floor
        block_s = timed(lambda gm=gemm, gu=gate_up, dn=down: block(gm, x, w, offs, gu, dn, g))
        row["block_ms"] = block_s * 1e3
        row["block_vs_gemms"] = block_s / gemm_total
        out.append(row)
        print(f"{name:18} rows={rows:6} skew={skew:3.1f} {gemm.name:9} {layout:5} "
              f"fwd {row['fwd_tflops']:5.0f} TF/s ({row['fwd_vs_dense']:.2f} dense)  "
              f"dgrad {row['dgrad_tflops']:5.0f} ({row['dgrad_vs_dense']:.2f})  "
              f"wgrad {row['wgrad_tflops']:5.0f} ({row['wgrad_vs_floor']:.2f}x floor)  "
              f"block {row['block_ms']:6.2f} ms ({row['block_vs_gemms']:.2f}x gemms)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--rows", nargs="*", type=int, default=[16384, 65536])
    parser.add_argument("--skews", nargs="*", type=float, default=[0.0, 1.5])
    parser.add_argument("--backends", nargs="*", default=["torch", "deep_gemm", "triton", "auto"])
    parser.add_argument("--layouts", nargs="*", default=["pair", "plain", "arena"],
                        help="(home, slots) copied per call, one ordinary tensor, or the VMM arena")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args()
    limits = measure_limits()
    print(f"copy {limits['copy_bytes_per_s'] / 1e12:.2f} TB/s, dense bf16 "
          f"{limits['dense_bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    backends = []
    for name in args.backends:
        try:
            select_grouped_gemm(name, torch.device("cuda"), torch.bfloat16, k=128, token_padding=PAD)
            backends.append(name)
        except (ValueError, ImportError) as error:
            print(f"skipping backend {name}: {error}")
    rows = [r for shape in args.shapes for m in args.rows for skew in args.skews
            for r in bench_shape(shape, m, skew, backends, limits, args.layouts)]
    print("results:", write_record("gemm", limits, rows, Path(args.out) if args.out else None))


if __name__ == "__main__":
    main()
