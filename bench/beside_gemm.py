"""A grouped GEMM with a memory-bound copy running beside it on another stream: what it costs to run the comm
kernels beside the expert GEMMs on this GPU, with and without an SM carve-out for the GEMM, and what the
driver's memcpy (which may run on a copy engine, holding no SM) costs it.

    python -m bench.beside_gemm                  # one EP=8 DeepSeek-V3 rank's gate_up GEMMs (about a minute)
    python -m bench.beside_gemm --carveouts 0 16 --grids 0 16 32

The GEMMs are one EP=8 DeepSeek-V3 rank's gate_up products (65536 rows over 32 groups of 2048, H=7168,
2H'=4096, bf16, `torch._grouped_mm`): the forward (`x @ w^T`) and the weight gradient (`dab^T @ x`). The copy
stands in for a comm kernel (`_copy_kernel`: a 512 MiB bf16 copy, read and written once, on `grid` programs,
the way the row kernels run on a grid of their own; grid 0: `Tensor.copy_`, one `cudaMemcpyAsync` device to
device, the driver's memcpy instead of a kernel of ours, as a copy-engine transport of contiguous segments
over NVLink would issue it; whether it holds SMs is what its `both` shows). For each carve-out c (SMs the GEMM
leaves free: `torch._C._set_sm_carveout_experimental`, which torch's CUTLASS grouped GEMM honours; 0 = none)
and grid g, three arms in rotated turns (`bench.common.alternated_timings`, the GPU's clocks and power logged
per case): the GEMM alone under c, the copy alone on g programs, and both at once (the copy launched first on
a side stream, then the GEMM; the events span both). `gain` = (GEMM alone + copy alone) / both: above 1 where
the copy hides beside the GEMM, below 1 where the two slow each other more than they overlap. A second
baseline row per case: the GEMM alone without a carve-out.

Left out: a real link. A comm kernel over NVLink mostly waits on the link (bytes at 450 GB/s a direction), not
on HBM; this copy moves its bytes at HBM speed and so competes with the GEMM for memory bandwidth and power.
The record (`bench/results/beside-gemm-<device>-<date>-<commit>.json`, or $MOONEP_BENCH_OUT) holds every case.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.common import alternated_timings, gpu_state, measure_limits, spread, write_record

ROWS, GROUPS, HIDDEN, GATE_UP = 65536, 32, 7168, 4096
"""One EP=8 DeepSeek-V3 rank's routed rows (S*K), its 32 home experts (uniform groups of 2048 rows), H and
2H'."""
COPY_ELEMENTS = 256 * 2**20
"""bf16 elements the copy moves (512 MiB read, 512 MiB written)."""


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """`dst[:n] = src[:n]`, each program striding over blocks of `BLOCK` (any grid size)."""
    start = tl.program_id(0) * BLOCK
    step = tl.num_programs(0) * BLOCK
    for first in range(start, n, step):
        offsets = first + tl.arange(0, BLOCK)
        live = offsets < n
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=live), mask=live)


def gain(gemm_s: float, copy_s: float, both_s: float) -> float:
    """(GEMM alone + copy alone) / both at once: above 1, running them together saved time."""
    return (gemm_s + copy_s) / both_s


def cases(carveouts: list[int], grids: list[int], sm_count: int) -> list[tuple[int, int]]:
    """Every (carve-out, grid) pair to time; a carve-out must leave the GEMM at least one SM."""
    bad = [c for c in carveouts if not 0 <= c < sm_count]
    if bad:
        raise ValueError(f"--carveouts must be in [0, {sm_count}) on this GPU ({sm_count} SMs), got {bad}")
    if any(g < 0 for g in grids):
        raise ValueError(f"--grids must be >= 1 programs, or 0 for the copy engine, got {grids}")
    return [(c, g) for c in carveouts for g in grids]


def carved(call, carveout: int):
    """`call` with the GEMMs it launches leaving `carveout` SMs free (0: none), the setting restored after."""
    def run() -> None:
        torch._C._set_sm_carveout_experimental(carveout or None)
        try:
            call()
        finally:
            torch._C._set_sm_carveout_experimental(None)
    return run


def time_case(gemm, carveout: int, grid: int, copy_src: torch.Tensor, copy_dst: torch.Tensor,
              side: torch.cuda.Stream, repeat: int) -> dict:
    """One case's four arms in rotated turns (module docstring): `gemm`, `copy`, `both`, `gemm_no_carveout`
    (`spread`s), its `gain` and the GPU's state before and after."""
    device = copy_src.device

    def copy() -> None:
        if grid == 0:
            copy_dst.copy_(copy_src)  # contiguous, one dtype, one device: a cudaMemcpyAsync
        else:
            _copy_kernel[(grid,)](copy_src, copy_dst, copy_src.numel(), BLOCK=8192, num_warps=8)

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            copy()
        gemm()
        torch.cuda.current_stream(device).wait_stream(side)

    start = gpu_state(device)
    arms = [carved(gemm, carveout), copy, carved(both, carveout), gemm]
    gemm_c, copy_g, both_cg, gemm_0 = (spread(t) for t in alternated_timings(arms, repeat, device=device))
    return {"carveout": carveout, "grid": grid, "gemm": gemm_c, "copy": copy_g, "both": both_cg,
            "gemm_no_carveout": gemm_0, "gain": gain(gemm_c["ms"], copy_g["ms"], both_cg["ms"]),
            "gpu_start": start, "gpu_end": gpu_state(device)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--carveouts", type=int, nargs="+", default=[0, 16, 32])
    parser.add_argument("--grids", type=int, nargs="+", default=[0, 16, 32, 132],
                        help="the copy's programs; 0: the copy engine (cudaMemcpyAsync)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.beside_gemm needs a GPU (it times CUDA streams side by side)")
    device = torch.device("cuda")
    todo = cases(args.carveouts, args.grids, torch.cuda.get_device_properties(device).multi_processor_count)
    limits = measure_limits()
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(ROWS, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen)
    dab = torch.randn(ROWS, GATE_UP, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(GROUPS, GATE_UP, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen)
    offs = torch.arange(1, GROUPS + 1, device=device, dtype=torch.int32) * (ROWS // GROUPS)
    src = torch.randn(COPY_ELEMENTS, device=device, dtype=torch.bfloat16, generator=gen)
    dst = torch.empty_like(src)
    gemms = {"fwd gate_up": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
             "wgrad gate_up": lambda: torch._grouped_mm(dab.T, x, offs=offs)}
    side = torch.cuda.Stream(device)
    rows = []
    for op, gemm in gemms.items():
        for carveout, grid in todo:
            row = {"op": op, **time_case(gemm, carveout, grid, src, dst, side, args.repeat)}
            rows.append(row)
            ms = {arm: row[arm]["ms"] for arm in ("gemm", "gemm_no_carveout", "copy", "both")}
            where = "the copy engine" if grid == 0 else f"{grid:4} programs"
            print(f"{op:13} carve-out {carveout:3} SMs, copy on {where}: GEMM {ms['gemm']:.3f} ms "
                  f"(no carve-out {ms['gemm_no_carveout']:.3f}), copy {ms['copy']:.3f}, "
                  f"both {ms['both']:.3f}: gain {row['gain']:.2f}", flush=True)
    setup = {"rows": ROWS, "groups": GROUPS, "hidden": HIDDEN, "gate_up": GATE_UP,
             "copy_bytes": 2 * COPY_ELEMENTS * 2, "repeat": args.repeat,
             "grid_0": "Tensor.copy_: one cudaMemcpyAsync device to device",
             "order": "rotated turns: GEMM under the carve-out, copy, both, GEMM without"}
    out = None if args.out is None else Path(args.out)
    print(write_record("beside-gemm", limits, rows, out, setup=setup))


if __name__ == "__main__":
    main()
