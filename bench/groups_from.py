"""The slot groups' GEMM of `MoEConfig.overlap_prefetch` (`moonep_moe.gemm.kernels.groups_from`, Triton) at
each launch shape, against `torch._grouped_mm` on the same rows and weights (the layer's GEMM without it).

    python -m bench.groups_from          # DeepSeek-V3's experts: gate_up forward, down dgrad (about 30 s)

Each case is one EP=8 rank's rows: 32 home groups of 2048 rows (never computed here: the kernel starts at the
first slot group, a row it reads on the device) and `slots` slot groups of `rows` rows each. The baseline is
`torch._grouped_mm` over the slot rows alone, sliced on the host (what it would cost if the start were known
there). Rows: per case and launch shape the median of `--repeat` CUDA-event timings with the min-max, the
rate (2 rows N K per second) and its ratio to the baseline's; `same_bits` says whether the kernel's output
equals the baseline's bit for bit. The record goes to `bench/results/groups-from-...json`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import measure_limits, model_shape, spread, timings, write_record
from moonep_moe.gemm.kernels.groups_from import groups_from_gemm, tiles

LAUNCHES = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
            (128, 128, 128, 8, 3), (128, 256, 64, 8, 4), (64, 256, 64, 4, 4), (128, 128, 64, 4, 4)]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) swept beside `tiles()`."""
HOME_GROUPS, HOME_ROWS = 32, 2048
CASES = ((4, 1024), (8, 2048))
"""(slot groups, rows each)."""


def case(op: str, n: int, k: int, transposed: bool, slots: int, rows_each: int, repeat: int) -> dict:
    """One row: `op`'s operands (``a [rows, k]``; ``b [G, k, n]``, a forward's transposed weights or a
    dgrad's as stored) over `HOME_GROUPS` home groups and `slots` slot groups of `rows_each` rows."""
    sizes = [HOME_ROWS] * HOME_GROUPS + [rows_each] * slots
    offs_g = torch.tensor(sizes, device="cuda").cumsum(0).int()
    start, rows = HOME_GROUPS * HOME_ROWS, sum(sizes)
    slot_offs = (offs_g[HOME_GROUPS:] - start).int()
    a_mk = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(HOME_GROUPS + slots, *((n, k) if transposed else (k, n)), device="cuda",
                    dtype=torch.bfloat16)
    b_gkn = (w.transpose(-2, -1) if transposed else w)[HOME_GROUPS:]
    out_mn = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * slots * rows_each * n * k
    baseline = torch._grouped_mm(a_mk[start:], b_gkn, offs=slot_offs)
    base = spread(timings(lambda: torch._grouped_mm(a_mk[start:], b_gkn, offs=slot_offs), repeat=repeat))
    row = {"op": op, "slots": slots, "rows_per_slot": rows_each, "n": n, "k": k,
           "torch": {**base, "tflops": flops / base["ms"] / 1e9}, "launches": []}
    launches = [tiles()] + [dict(BLOCK_M=m, BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st)
                            for m, bn, bk, wp, st in LAUNCHES]
    for launch in launches:
        ms = spread(timings(lambda launch=launch: groups_from_gemm(a_mk, b_gkn, offs_g, HOME_GROUPS, out_mn,
                                                                   launch), repeat=repeat))
        row["launches"].append({"launch": launch, **ms, "tflops": flops / ms["ms"] / 1e9,
                                "vs_torch": base["ms"] / ms["ms"],
                                "same_bits": bool(torch.equal(out_mn[start:], baseline))})
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--out", default=None, help="folder of the record (default bench/results)")
    args = parser.parse_args(argv)
    shape = model_shape(args.model)
    h, f = shape["hidden"], shape["ffn"]
    limits = measure_limits()
    rows = []
    for slots, rows_each in CASES:
        # gate_up forward: x [rows, H] @ w^T, w [2H', H]; down's dgrad: dy [rows, H] @ w, w [H, H']
        for op, n, k, transposed in (("gate_up fwd", 2 * f, h, True), ("down dgrad", f, h, False)):
            row = case(op, n, k, transposed, slots, rows_each, args.repeat)
            best = max(row["launches"], key=lambda r: r["vs_torch"])
            print(f"{op} {slots}x{rows_each}: torch {row['torch']['tflops']:.0f} TFLOP/s; default launch "
                  f"{row['launches'][0]['vs_torch']:.2f}x, best {best['vs_torch']:.2f}x ({best['launch']})",
                  flush=True)
            rows.append(row)
    path = write_record("groups-from", limits, rows, None if args.out is None else Path(args.out),
                        model=args.model)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
