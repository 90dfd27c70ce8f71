"""The Triton FP8 grouped GEMM (`moonep_moe.gemm.kernels.fp8_gemm`) at each launch shape, beside
DeepGEMM's FP8 GEMM on the same operands and the dense bf16 rate of the same run (the fallback
where DeepGEMM cannot run, and which tile it should use).

    python -m bench.fp8_gemm            # DeepSeek-V3's experts: one EP=8 rank (64 groups of 1024 rows) and
                                        # EP=1 (256 groups of 256), gate_up and down (about 2 min)

The operands are cast once before timing (e4m3 activations with 1x128 scales in DeepGEMM's layout, e4m3
weights with 128x128 block scales), so each row times the GEMM alone: `bench.gemm --backends fp8
fp8_triton` times what a training step pays, casts included. Rows: `kernel` "deep_gemm" (where it imports)
or "triton" with its `launch`; medians of `--repeat` CUDA-event timings with the min-max; `vs_dense` is the
rate (2 rows N K per second) over the run's dense bf16 rate; `same_bits_as_deep_gemm` says whether the
kernel's bf16 output equals DeepGEMM's bit for bit. The record goes to `bench/results/fp8-gemm-...json`.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import measure_limits, model_shape, spread, timings, write_record
from moonep_moe.fp8 import cast as fp8_cast
from moonep_moe.fp8.format import FP8_DTYPE, block_scales_shape
from moonep_moe.gemm.deep_gemm import import_deep_gemm
from moonep_moe.gemm.kernels import fp8_gemm
from moonep_moe.gemm.registry import fp8_kernel

OTHER_LAUNCHES = [(128, 128, 8, 4), (128, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 4),
                  (128, 256, 8, 3)]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) swept after `fp8_gemm.tiles`' choice."""


def launches() -> list[dict]:
    """The launches each shape runs: `fp8_gemm.tiles`' choice first, then `OTHER_LAUNCHES`."""
    default = fp8_gemm.tiles()
    others = [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
              for bm, bn, warps, stages in OTHER_LAUNCHES]
    return [default] + [launch for launch in others if launch != default]


def operands(groups: int, rows_per_group: int, n: int, k: int, gen: torch.Generator) -> tuple:
    """`(a, w, offs_g)`: e4m3 activations `[groups * rows_per_group, k]` and weights `[groups, n, k]` with
    their scales, uniform segments."""
    offs_g = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows_per_group
    x = torch.randn(groups * rows_per_group, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(groups, n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    q_w = torch.empty(groups, n, k, device="cuda", dtype=FP8_DTYPE)
    scales_w = torch.empty(block_scales_shape((groups, n, k)), device="cuda", dtype=torch.float32)
    fp8_cast.cast_blocks(w, scales_w, q_w)
    return fp8_cast.cast_rows(x, offs_g), (q_w, scales_w), offs_g


def shape_rows(base: dict, a: tuple, w: tuple, offs_g: torch.Tensor, deep_gemm, repeat: int) -> list[dict]:
    """DeepGEMM (where given) and the Triton kernel at each of `launches()` on one shape's operands."""
    rows, want = [], None
    out_shape = (a[0].shape[0], w[0].shape[1])
    if deep_gemm is not None:
        want = torch.empty(out_shape, device="cuda", dtype=torch.bfloat16)
        gemm = deep_gemm.m_grouped_fp8_gemm_nt_contiguous
        rows.append({**base, "kernel": "deep_gemm", **spread(timings(
            lambda: gemm(a, w, want, offs_g, disable_ue8m0_cast=True, use_psum_layout=True), repeat=repeat))})
    for launch in launches():
        got = torch.empty(out_shape, device="cuda", dtype=torch.bfloat16)
        call = lambda launch=launch, got=got: fp8_gemm.grouped_fp8_gemm(a, w, got, offs_g, launch)  # noqa: E731
        row = {**base, "kernel": "triton", "launch": launch, **spread(timings(call, repeat=repeat))}
        if want is not None:
            row["same_bits_as_deep_gemm"] = bool(torch.equal(got, want))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.fp8_gemm times GPU kernels: no CUDA device here")
    limits = measure_limits()
    deep_gemm = import_deep_gemm() if fp8_kernel(torch.device("cuda")) == "deep_gemm" else None
    shape = model_shape(args.model)
    h, f = shape["hidden"], shape["ffn"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for case, groups, per_group in (("one EP=8 rank", 64, 1024), ("EP=1", 256, 256)):
        for name, n, k in (("gate_up", 2 * f, h), ("down", h, f)):
            base = {"model": args.model, "case": case, "gemm": name, "groups": groups,
                    "rows_per_group": per_group, "n": n, "k": k}
            new = shape_rows(base, *operands(groups, per_group, n, k, gen), deep_gemm, args.repeat)
            for row in new:
                row["vs_dense"] = 2 * groups * per_group * n * k / (row["ms"] / 1e3) / limits[
                    "dense_bf16_flops_per_s"]
                launch = str(row.get("launch", ""))
                bits = "same bits" if row.get("same_bits_as_deep_gemm") else ""
                print(f"{case:14} {name:8} {row['kernel']:9} {launch:70} "
                      f"{row['ms']:7.3f} ms ({row['ms_min']:.3f}-{row['ms_max']:.3f})  {row['vs_dense']:.2f} "
                      f"of dense bf16  {bits}", flush=True)
            rows += new
    path = write_record("fp8-gemm", limits, rows, setup=vars(args), default_launch=fp8_gemm.tiles())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
