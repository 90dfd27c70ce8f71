"""Triton FP8 grouped GEMM: ``out[rows of g] = (q_a * scales_a) @ (q_w[g] * scales_w[g])^T`` per segment, the
operands e4m3 with DeepSeek-V3's fp32 scales (1x128 tiles for the activations, 128x128 blocks for the
weights), accumulated in fp32, written in the output's dtype. It takes exactly what DeepGEMM's
``m_grouped_fp8_gemm_nt_contiguous`` takes on the psum layout (`moonep_moe.gemm.fp8` states the layouts), so
`Fp8GroupedGemm` runs on it wherever DeepGEMM cannot: not installed, or a GPU other than sm90 with FP8
tensor cores (sm89, sm100).

Segments start at multiples of 128 (``token_padding`` a multiple of 128, as for DeepGEMM), so a
``BLOCK_M``-row block (``BLOCK_M`` divides 128) lies in one segment. Its segment is data: the number of
segment ends ``offs_g`` at or below its first row, read on the device (no host read). Rows at and past a
segment's end (unaligned ends) and blocks at and past ``offs_g[-1]`` are neither read nor written.

Each ``128``-wide step of the inner dimension is one ``tl.dot`` of e4m3 tiles into a fresh fp32 tile, which
is multiplied by the row scales times the block scale and added to the fp32 accumulator: the scales are
applied per 128 inner elements, where both operands' scales are constant, as DeepGEMM promotes its partial
sums. Grid: one program per (row block, column block), row blocks swizzled in bands of ``SWIZZLE`` so the
programs running at once share weight tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep_moe.base.interpreter import INTERPRETED, launching
from moonep_moe.base.sizes import cdiv, next_power_of_2
from moonep_moe.fp8.format import BLOCK, FP8_DTYPE

SWIZZLE = 8
"""Row blocks per band of the grid's swizzle."""
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def tiles() -> dict:
    """Launch shape: ``BLOCK_M`` rows x ``BLOCK_N`` columns per program, 128 inner elements per step (one
    scale tile). 128 x 128 with 8 warps is within the run-to-run spread of the fastest launch
    `python -m bench.fp8_gemm` found on the H200 (0.73-0.87 of the dense bf16 rate on DeepSeek-V3's
    experts; 4 warps at this tile ran 4-5x slower, 256 columns 3x; `bench/results/fp8-gemm-*.json`). The
    interpreter gets smaller tiles so CPU tests cover several blocks and masked tails."""
    if INTERPRETED:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


@triton.jit
def _grouped_fp8_gemm_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, offs_ptr, out_ptr, groups, rows_total, n, k,
                             stride_a, stride_sa_m, stride_sa_k, stride_wg, stride_wn,
                             stride_swg, stride_swn, stride_swk, stride_out,
                             GROUPS_POW2: tl.constexpr, SWIZZLE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(rows_total, BLOCK_M)
    blocks_n = tl.cdiv(n, BLOCK_N)
    band = pid // (SWIZZLE * blocks_n)
    band_rows = tl.minimum(blocks_m - band * SWIZZLE, SWIZZLE)
    block_m = band * SWIZZLE + (pid % (SWIZZLE * blocks_n)) % band_rows
    block_n = (pid % (SWIZZLE * blocks_n)) // band_rows

    first_row = block_m * BLOCK_M
    group_ids = tl.arange(0, GROUPS_POW2)
    ends = tl.load(offs_ptr + group_ids, mask=group_ids < groups, other=2147483647)
    if first_row >= tl.load(offs_ptr + groups - 1):
        return
    group = tl.sum((ends <= first_row).to(tl.int32), axis=0)
    rows = first_row + tl.arange(0, BLOCK_M)
    live_rows = rows < tl.load(offs_ptr + group)  # a segment's end needs no alignment
    rows = rows.to(tl.int64)
    group = group.to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_cols = cols < n
    inner = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows[:, None] * stride_a
    w_rows = w_ptr + group * stride_wg + cols[:, None].to(tl.int64) * stride_wn
    sa_rows = sa_ptr + rows * stride_sa_m
    sw_cols = sw_ptr + group * stride_swg + (cols // BLOCK_K) * stride_swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(k, BLOCK_K)):
        ks = step * BLOCK_K + inner
        live_k = ks < k
        a = tl.load(a_rows + ks[None, :], mask=live_rows[:, None] & live_k[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=live_cols[:, None] & live_k[None, :], other=0.0)
        scale_a = tl.load(sa_rows + step * stride_sa_k, mask=live_rows, other=0.0)
        scale_w = tl.load(sw_cols + step * stride_swk, mask=live_cols, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * (scale_a[:, None] * scale_w[None, :])
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live_rows[:, None] & live_cols[None, :])


def grouped_fp8_gemm(a: tuple[torch.Tensor, torch.Tensor], w: tuple[torch.Tensor, torch.Tensor],
                     out: torch.Tensor, offs_g: torch.Tensor, launch: dict | None = None) -> None:
    """``out[start:end] = dequant(a)[start:end] @ dequant(w[g])^T`` for every segment g, fp32 accumulation.

    Args:
        a: ``(q [rows, k] e4m3, scales [rows, ceil(k/128)] fp32)``, any scale strides (e.g. `cast_rows`'
            MN-major layout); rows contiguous.
        w: ``(q [G, n, k] e4m3, scales [G, ceil(n/128), ceil(k/128)] fp32)``, any scale strides (e.g. the
            transposed view dgrad takes); each ``[n, k]`` matrix with contiguous rows.
        out: ``[rows, n]`` (bf16, fp16 or fp32, contiguous rows); rows at and past ``offs_g[-1]`` are not
            written.
        offs_g: int32 ``[G]`` segment ends on the device, each segment starting at a multiple of 128.
        launch: ``BLOCK_M`` (a divisor of 128), ``BLOCK_N``, ``num_warps``, ``num_stages`` instead of
            `tiles` (`bench.fp8_gemm` sweeps them).
    """
    (q_a, scales_a), (q_w, scales_w) = a, w
    rows, k = q_a.shape
    groups, n = q_w.shape[:2]
    if q_a.dtype != FP8_DTYPE or q_w.dtype != FP8_DTYPE:
        raise ValueError(f"a and w must be {FP8_DTYPE}, got {q_a.dtype} and {q_w.dtype}")
    if q_w.shape[2] != k or q_a.stride(1) != 1 or q_w.stride(2) != 1:
        raise ValueError(f"a [rows, k] and w [G, n, k] must share k with contiguous rows, got "
                         f"{list(q_a.shape)} and {list(q_w.shape)}")
    kb = cdiv(k, BLOCK)
    if tuple(scales_a.shape) != (rows, kb) or tuple(scales_w.shape) != (groups, cdiv(n, BLOCK), kb):
        raise ValueError(f"scales must be [rows, {kb}] and [G, {cdiv(n, BLOCK)}, {kb}], got "
                         f"{list(scales_a.shape)} and {list(scales_w.shape)}")
    if out.dtype not in OUT_DTYPES or tuple(out.shape) != (rows, n) or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {n}] of {OUT_DTYPES} with contiguous rows, got {out.dtype} "
                         f"{list(out.shape)}")
    if offs_g.dtype != torch.int32 or offs_g.shape != (groups,):
        raise ValueError(f"offs_g must be int32 [{groups}], got {offs_g.dtype} {list(offs_g.shape)}")
    launch = tiles() if launch is None else launch
    if 128 % launch["BLOCK_M"]:
        raise ValueError(f"BLOCK_M must divide 128 (a block must not straddle two segments), got {launch}")
    if not (rows and n and groups):
        return
    grid = (cdiv(rows, launch["BLOCK_M"]) * cdiv(n, launch["BLOCK_N"]),)
    with launching():
        _grouped_fp8_gemm_kernel[grid](q_a, scales_a, q_w, scales_w, offs_g, out, groups, rows, n, k,
                                       q_a.stride(0), *scales_a.stride(), q_w.stride(0), q_w.stride(1),
                                       *scales_w.stride(), out.stride(0),
                                       GROUPS_POW2=next_power_of_2(groups), SWIZZLE=SWIZZLE,
                                       BLOCK_K=BLOCK, **launch)
