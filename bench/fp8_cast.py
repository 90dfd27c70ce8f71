"""The FP8 cast kernels alone, against the run's device copy bandwidth (what an FP8 training step pays
to cast, and which warp count the kernels should use).

    python -m bench.fp8_cast                          # DeepSeek-V3 and Kimi-K2 experts, 64 groups (one EP=8
                                                      # rank: 32 home + 32 slots), 65536 rows (about 30 s)
    python -m bench.fp8_cast --groups 256             # every expert of an EP=1 layer

Rows, each at every warp count in `--warps`:
- `weights`: `cast_blocks` of each projection's bf16 experts (gate_up `[G, 2H', H]`, down `[G, H, H']`) in
  the forward orientation (`q`, what `Fp8WeightCache` casts in forward), the transposed one (`qt`, dgrad's,
  cast in backward) and both in one pass.
- `activations`: `cast_rows` of the rows a GEMM reads (`x [rows, H]`, `hw [rows, H']`), every row used.
- `swiglu`: the expert block's SwiGLU with the FP8 rows of the GEMM after it, forward (`hw [rows, H']`) and
  backward (`dab [rows, 2H']`), two ways: SwiGLU then `cast_rows` of its bf16 output (`orientation`
  "apart", the baseline), and the fused kernel that casts in its own pass (`swiglu_weighted_fp8`,
  `swiglu_weighted_backward_fp8`: "fused", what an fp8 layer runs), with `vs_apart` the fused row's speed
  over the baseline's, both timed in the same run. Their `bytes` are the fused kernel's least traffic.

Each row's bytes are what the kernel must move at least (bf16 read, e4m3 written per orientation, fp32
scales); `vs_copy` is those bytes per second over the run's device copy bandwidth (bytes read + written per
second, `measure_limits`). Medians of `--repeat` CUDA-event timings with the min-max spread. The record
goes to `bench/results/fp8-cast-...json`.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import measure_limits, model_shape, spread, timings, write_record
from moonep_moe.fp8 import cast as fp8_cast
from moonep_moe.fp8.format import FP8_DTYPE, TILE, block_scales_shape
from moonep_moe.layers.swiglu import (
    swiglu_weighted,
    swiglu_weighted_backward,
    swiglu_weighted_backward_fp8,
    swiglu_weighted_fp8,
)

ORIENTATIONS = {"q": (True, False), "qt": (False, True), "q+qt": (True, True)}


def weight_rows(name: str, w_gnk: torch.Tensor, warps: list[int], repeat: int) -> list[dict]:
    """`cast_blocks` of one projection `w [G, N, K]` in each orientation, at each warp count."""
    g, n, k = w_gnk.shape
    scales = torch.empty(block_scales_shape((g, n, k)), device=w_gnk.device, dtype=torch.float32)
    q = torch.empty(g, n, k, device=w_gnk.device, dtype=FP8_DTYPE)
    qt = torch.empty(g, k, n, device=w_gnk.device, dtype=FP8_DTYPE)
    rows = []
    for orientation, (write_q, write_qt) in ORIENTATIONS.items():
        moved = w_gnk.numel() * (2 + write_q + write_qt) + scales.numel() * 4
        for num_warps in warps:
            def cast(write_q=write_q, write_qt=write_qt, num_warps=num_warps):
                fp8_cast.cast_blocks(w_gnk, scales, q if write_q else None, qt if write_qt else None,
                                     num_warps=num_warps)
            rows.append({"kind": "weights", "tensor": name, "shape": [g, n, k], "orientation": orientation,
                         "num_warps": num_warps, "bytes": moved, **spread(timings(cast, repeat=repeat))})
    return rows


def activation_rows(name: str, x_mk: torch.Tensor, warps: list[int], repeat: int) -> list[dict]:
    """`cast_rows` of every row of `x [rows, K]`, at each warp count."""
    offs_g = torch.tensor([x_mk.shape[0]], dtype=torch.int32, device=x_mk.device)
    moved = x_mk.numel() * 3 + x_mk.shape[0] * -(-x_mk.shape[1] // TILE) * 4
    return [{"kind": "activations", "tensor": name, "shape": list(x_mk.shape), "orientation": "rows",
             "num_warps": num_warps, "bytes": moved,
             **spread(timings(lambda num_warps=num_warps: fp8_cast.cast_rows(x_mk, offs_g, num_warps),
                              repeat=repeat))}
            for num_warps in warps]


def swiglu_rows(h: int, f: int, rows: int, repeat: int, gen: torch.Generator) -> list[dict]:
    """SwiGLU forward and backward with the next GEMM's FP8 rows, cast apart and fused (`swiglu`)."""
    ab = torch.randn(rows, 2 * f, device="cuda", dtype=torch.bfloat16, generator=gen)
    u = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.rand(rows, device="cuda", generator=gen)
    ends = torch.tensor([rows], dtype=torch.int32, device="cuda")
    scales = rows * f // TILE * 4
    calls = {
        ("forward", "apart"): lambda: fp8_cast.cast_rows(swiglu_weighted(ab, w, ends), ends),
        ("forward", "fused"): lambda: swiglu_weighted_fp8(ab, w, ends),
        ("backward", "apart"): lambda: fp8_cast.cast_rows(swiglu_weighted_backward(u, ab, w, ends)[0], ends),
        ("backward", "fused"): lambda: swiglu_weighted_backward_fp8(u, ab, w, ends),
    }
    # least traffic of the fused kernels: forward reads ab, writes q and scales; backward reads u and ab,
    # writes dab, hw, their FP8 rows and scales
    moved = {"forward": rows * (4 * f + f + 4) + scales, "backward": rows * (2 * f + 4 * f + 4 * f + 2 * f
                                                                            + 2 * f + 8) + 2 * scales}
    out = [{"kind": "swiglu", "tensor": f"{direction}", "shape": [rows, 2 * f], "orientation": how,
            "num_warps": 4, "bytes": moved[direction], **spread(timings(call, repeat=repeat))}
           for (direction, how), call in calls.items()]
    for fused, apart in zip(out[1::2], out[::2], strict=True):
        fused["vs_apart"] = apart["ms"] / fused["ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["deepseek-v3", "kimi-k2"])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.fp8_cast times Triton kernels on a GPU: no CUDA device here")
    limits = measure_limits()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model in args.models:
        shape = model_shape(model)
        h, f = shape["hidden"], shape["ffn"]
        tensors = {"gate_up": (args.groups, 2 * f, h), "down": (args.groups, h, f)}
        for name, size in tensors.items():
            w = torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen)
            rows += [{"model": model, **row} for row in weight_rows(name, w, args.warps, args.repeat)]
            del w
        for name, width in (("x", h), ("hw", f)):
            x = torch.randn(args.rows, width, device="cuda", dtype=torch.bfloat16, generator=gen)
            rows += [{"model": model, **row} for row in activation_rows(name, x, args.warps, args.repeat)]
            del x
        rows += [{"model": model, **row} for row in swiglu_rows(h, f, args.rows, args.repeat, gen)]
    for row in rows:
        row["vs_copy"] = row["bytes"] / (row["ms"] / 1e3) / limits["copy_bytes_per_s"]
        print(f"{row['model']:12} {row['kind']:11} {row['tensor']:8} {str(row['shape']):22} "
              f"{row['orientation']:5} warps={row['num_warps']:2}  {row['ms']:7.3f} ms "
              f"({row['ms_min']:.3f}-{row['ms_max']:.3f})  {row['vs_copy']:.2f} of copy bandwidth"
              + (f", {row['vs_apart']:.2f}x apart" if "vs_apart" in row else ""))
    path = write_record("fp8-cast", limits, rows, setup=vars(args),
                        defaults={"cast_blocks": fp8_cast.BLOCKS_WARPS, "cast_rows": fp8_cast.ROWS_WARPS})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
