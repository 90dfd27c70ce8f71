"""The slot groups' GEMM of `MoEConfig.overlap_prefetch` (`moonep_moe.gemm.kernels.groups_from`, Triton) at
each launch shape, against `torch._grouped_mm` on the same rows and weights (the layer's GEMM without it).

    python -m bench.groups_from          # DeepSeek-V3's experts: gate_up forward, down dgrad (about 30 s)

Each case is one EP=8 rank's rows: 32 home groups of 2048 rows (never computed here: the kernel starts at the
first slot group, a row it reads on the device) and `slots` slot groups of `rows` rows each. The baseline is
`torch._grouped_mm` over the slot rows alone, sliced on the host (what it would cost if the start were known
there). Rows: per case and launch shape, for the masked kernel and the aligned one (the cases' segments are
multiples of 128 rows, as the layer's are under DeepGEMM), the median of `--repeat` CUDA-event timings with
the min-max, the rate (2 rows N K per second) and its ratio to the baseline's (and to DeepGEMM's psum GEMM on
the same slot rows, `deep_gemm`, where it runs: the layer's GEMM without the split); `same_bits` says whether
the kernel's output equals the baseline's bit for bit. The record goes to `bench/results/groups-from-...json`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import measure_limits, model_shape, spread, timings, write_record
from moonep_moe.gemm.kernels.groups_from import aligned_tiles, groups_from_gemm, tiles

LAUNCHES = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
            (128, 128, 128, 8, 3), (128, 256, 64, 8, 4), (64, 256, 64, 4, 4), (128, 128, 64, 4, 4)]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) swept beside `tiles()`."""
ALIGNED_LAUNCHES = [(128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 128, 128, 8, 3), (128, 128, 128, 8, 2),
                    (128, 128, 64, 4, 4)]
"""The aligned kernel's (the rows are 128-row segments) swept beside `aligned_tiles()`."""
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
    deep_gemm = deep_gemm_call(a_mk[start:], w[HOME_GROUPS:], slot_offs, transposed)
    if deep_gemm is not None:
        dg = spread(timings(deep_gemm, repeat=repeat))
        row["deep_gemm"] = {**dg, "tflops": flops / dg["ms"] / 1e9}
    as_launch = lambda shape: dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), shape,
                                       strict=True))
    launches = ([(tiles(), 1)] + [(as_launch(t), 1) for t in LAUNCHES] + [(aligned_tiles(), 128)]
                + [(as_launch(t), 128) for t in ALIGNED_LAUNCHES])
    for launch, alignment in launches:
        ms = spread(timings(lambda launch=launch, alignment=alignment: groups_from_gemm(
            a_mk, b_gkn, offs_g, HOME_GROUPS, out_mn, launch, row_alignment=alignment), repeat=repeat))
        row["launches"].append({"launch": launch, "aligned": alignment == 128, **ms,
                                "tflops": flops / ms["ms"] / 1e9, "vs_torch": base["ms"] / ms["ms"],
                                **({"vs_deep_gemm": row["deep_gemm"]["ms"] / ms["ms"]} if deep_gemm else {}),
                                "same_bits": bool(torch.equal(out_mn[start:], baseline))})
    return row


def deep_gemm_call(a_mk: torch.Tensor, w: torch.Tensor, offs_g: torch.Tensor, transposed: bool):
    """DeepGEMM's bf16 psum-layout GEMM over the slot rows alone (sliced on the host), the layer's GEMM on
    the rows without the split; None where DeepGEMM cannot run."""
    from moonep_moe.gemm.deep_gemm import import_deep_gemm, unsupported_reason

    if unsupported_reason(a_mk.device, a_mk.dtype, a_mk.shape[1], 128) is not None:
        return None
    deep_gemm = import_deep_gemm()
    kernel = (deep_gemm.m_grouped_bf16_gemm_nt_contiguous if transposed
              else deep_gemm.m_grouped_bf16_gemm_nn_contiguous)
    d = torch.empty(a_mk.shape[0], w.shape[1 if transposed else 2], device=a_mk.device, dtype=a_mk.dtype)
    return lambda: kernel(a_mk, w, d, offs_g, use_psum_layout=True)


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
            aligned = next(r for r in row["launches"] if r["aligned"])
            dg = f", DeepGEMM {row['deep_gemm']['tflops']:.0f}" if "deep_gemm" in row else ""
            print(f"{op} {slots}x{rows_each}: torch {row['torch']['tflops']:.0f}{dg} TFLOP/s; default launch "
                  f"{row['launches'][0]['vs_torch']:.2f}x, aligned default {aligned['vs_torch']:.2f}x "
                  f"({aligned['tflops']:.0f} TFLOP/s), best {best['vs_torch']:.2f}x ({best['launch']}, "
                  f"aligned {best['aligned']})", flush=True)
            rows.append(row)
    path = write_record("groups-from", limits, rows, None if args.out is None else Path(args.out),
                        model=args.model)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
