"""Triton casts to FP8 e4m3 with power-of-two fp32 scales, and back (the contract and the torch reference
are `moonep_moe.gemm.fp8`; these kernels match the reference bit for bit, fp8 bytes and scales).

- `cast_rows`: activations, one pass: reads `x [rows, K]` (bf16 or fp32), writes `q [rows, K]` e4m3 and
  one scale per row per 128 columns in DeepGEMM's sm90 layout (MN-major, rows padded to 4). Row blocks at
  and past `offs_g[-1]` (a device scalar: no host read) are skipped, their outputs left unwritten.
- `cast_blocks`: weights, one pass per 128x128 block of `w [G, N, K]`: writes the scale and, as asked, the
  e4m3 block (`q [G, N, K]`) and its transpose (`qt [G, K, N]`, the K-major copy dgrad needs on sm90).
- `cast_columns`: a weight gradient's operand (`dy` or `x` of `dW[g] = dy_g^T x_g`) for DeepGEMM's sm90
  k-grouped FP8 GEMM, one pass: a range of the segments of `x [rows, C]`, each transposed to K-major
  (`[C, k]` row by row), packed from the start of `q`, one scale per column per 128 rows.
- `dequantise_rows`: `cast_rows` undone, one pass: reads e4m3 rows and their 1x128 scales (any strides: e.g.
  views of the packed rows a dispatch received) and writes `q * scale` in bf16 or fp32, exact in both (an
  e4m3 value has 4 significant bits, the scales are powers of two within the formats' exponent range). What
  a layer with `MoEConfig.fp8_dispatch` multiplies in gate_up's weight gradient; rows past `offs_g[-1]` are
  skipped as in `cast_rows`.

Rounding to e4m3 (to nearest, ties to even, as the reference): compiled, one hardware conversion per two
values (sm90's `cvt.rn.satfinite.e4m3x2.f32`; the scaled values are within +-448, so saturation never
applies); under Triton's interpreter in integer arithmetic (`_round_to_e4m3`), whose result the conversion
then only has to copy, because the interpreter rounds fp32 -> fp8 wrongly when rounding carries into the next
binade (e.g. 126.77 -> 64 instead of 128: checked against torch while writing this). The integer path costs
about 25 integer operations a value, which made the compiled casts compute-bound (0.45-0.60 of the copy
bandwidth on the H200 at 4efa8f0, `bench/results/fp8-cast-*-4efa8f0.json`); the conversion is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep_moe.base.interpreter import INTERPRETED, launching
from moonep_moe.base.sizes import align_up, cdiv, next_power_of_2
from moonep_moe.fp8.format import FP8_DTYPE, MAX_BITS, MIN_AMAX, TILE, empty_mn_major_scales

HARDWARE_ROUNDING = not INTERPRETED
"""Compiled kernels round with the hardware conversion; the interpreter with `_round_to_e4m3`."""
BLOCK_ROWS = 32
"""Rows per program of `cast_rows` (a divisor of 128, so no block straddles a segment's padded end)."""
ROWS_WARPS = 4
"""Warps per `cast_rows` program (32 x 128 values: 32 a thread)."""
COLUMNS_TILE = 64
"""Columns per `cast_columns` program (128 rows x 64 columns: 64 values a thread at 4 warps)."""
BLOCKS_WARPS = 4
"""Warps per `cast_blocks` program: its 128 x 128 block is held whole in registers between the amax and the
rounding (128 fp32 values a thread at 4 warps, 64 at 8). `python -m bench.fp8_cast --warps 4 8` on the
H200 (`bench/results/fp8-cast-NVIDIA_H200-20261205-6dd0eca.json`): both orientations in one pass, what
`Fp8WeightCache` casts once it keeps both, 2.21 ms at 4 warps against 2.76 at 8 (DeepSeek-V3's gate_up, 64
groups; Kimi-K2's 2.18 against 2.77); one orientation within 4% either way."""


@triton.jit
def _pow2_scale(amax, MAX_EXP_FIELD: tl.constexpr, MAX_MANTISSA: tl.constexpr, MIN_AMAX: tl.constexpr):
    """`(scale, 1 / scale)`: the smallest power of two with `amax / scale <= E4M3_MAX`, from amax's bits."""
    bits = tl.maximum(amax, MIN_AMAX).to(tl.int32, bitcast=True)
    field = (bits >> 23) - MAX_EXP_FIELD + 127 + ((bits & 0x7FFFFF) > MAX_MANTISSA).to(tl.int32)
    return (field << 23).to(tl.float32, bitcast=True), ((254 - field) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(v):
    """fp32 `v` with `|v| <= 448` -> the nearest e4m3 value (ties to even), as fp32: the significand is
    shifted right to the format's ulp (2^(e-3) for normal values, 2^-9 below 2^-6) with round-to-even."""
    bits = v.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    exponent = (magnitude >> 23) - 127
    significand = (magnitude & 0x7FFFFF) | 0x800000
    ulp_exponent = tl.maximum(exponent, -6) - 3
    shift = tl.minimum(ulp_exponent - exponent + 23, 25)  # >= 20; 25 rounds every significand to zero
    rounded = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    value = rounded.to(tl.float32) * ((ulp_exponent + 127) << 23).to(tl.float32, bitcast=True)
    # the sign as a bit, not `where(bits < 0, -value, value)`: compiled for sm90 that lost the sign of values
    # rounding to zero (+0 where the reference keeps -0), though the interpreter kept it
    return (value.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v, dtype: tl.constexpr, HARDWARE_ROUNDING: tl.constexpr):
    """fp32 `v` with `|v| <= 448` -> `dtype` (e4m3), rounded to nearest, ties to even."""
    if HARDWARE_ROUNDING:
        return v.to(dtype, fp_downcast_rounding="rtne")
    return _round_to_e4m3(v).to(dtype)


@triton.jit
def quantise_row_tiles(x, dtype: tl.constexpr, MAX_EXP_FIELD: tl.constexpr, MAX_MANTISSA: tl.constexpr,
                       MIN_AMAX: tl.constexpr, HARDWARE_ROUNDING: tl.constexpr):
    """fp32 `x [n, 128]`, one 1x128 tile a row -> `(q [n, 128] of dtype (e4m3), scale [n])`: each tile's
    power-of-two scale and its values over it rounded to e4m3, the bytes `cast_rows` writes. For kernels that
    make activations and cast them in the same pass (`cast_constants()` gives the constexprs)."""
    scale, inverse = _pow2_scale(tl.max(tl.abs(x), axis=1), MAX_EXP_FIELD, MAX_MANTISSA, MIN_AMAX)
    return _to_e4m3(x * inverse[:, None], dtype, HARDWARE_ROUNDING), scale


@triton.jit
def _cast_rows_kernel(x_ptr, q_ptr, s_ptr, offs_ptr, last_group, rows, cols, stride_x, stride_s,
                      MAX_EXP_FIELD: tl.constexpr, MAX_MANTISSA: tl.constexpr, MIN_AMAX: tl.constexpr,
                      HARDWARE_ROUNDING: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    block, tile = tl.program_id(0), tl.program_id(1)
    if block * BLOCK < tl.load(offs_ptr + last_group):
        row = (block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        col = tile * TILE + tl.arange(0, TILE)
        mask = (row < rows)[:, None] & (col < cols)[None, :]
        x = tl.load(x_ptr + row[:, None] * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
        q, scale = quantise_row_tiles(x, q_ptr.dtype.element_ty, MAX_EXP_FIELD, MAX_MANTISSA, MIN_AMAX,
                                      HARDWARE_ROUNDING)
        tl.store(q_ptr + row[:, None] * cols + col[None, :], q, mask=mask)
        tl.store(s_ptr + tile * stride_s + row, scale, mask=row < rows)


@triton.jit
def _cast_columns_kernel(x_ptr, q_ptr, s_ptr, offs_ptr, first_group, last_group, rows, cols, stride_x,
                         stride_s, MAX_EXP_FIELD: tl.constexpr, MAX_MANTISSA: tl.constexpr,
                         MIN_AMAX: tl.constexpr, HARDWARE_ROUNDING: tl.constexpr, GROUPS_P: tl.constexpr,
                         BLOCK: tl.constexpr, TILE: tl.constexpr):
    # one 128-row block of one segment x TILE columns: its segment found from the ends on the device, the
    # block's per-column scales, its e4m3 values stored transposed at the segment's K-major place
    block, tile = tl.program_id(0), tl.program_id(1)
    row0 = block * BLOCK
    g_i = tl.arange(0, GROUPS_P)
    ends = tl.load(offs_ptr + g_i, mask=g_i < last_group, other=2147483647)
    group = tl.sum((ends <= row0).to(tl.int32), 0)  # the segment holding row0 (ends are ascending)
    if group >= first_group and group < last_group:
        base = tl.load(offs_ptr + first_group - 1, mask=first_group > 0, other=0)
        start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
        size = tl.load(offs_ptr + group) - start
        row = row0 + tl.arange(0, BLOCK)
        col = tile * TILE + tl.arange(0, TILE)
        mask = (row < rows)[:, None] & (col < cols)[None, :]
        x = tl.load(x_ptr + row.to(tl.int64)[:, None] * stride_x + col[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        scale, inverse = _pow2_scale(tl.max(tl.abs(x), axis=0), MAX_EXP_FIELD, MAX_MANTISSA, MIN_AMAX)
        q = _to_e4m3(x * inverse[None, :], q_ptr.dtype.element_ty, HARDWARE_ROUNDING)
        at = (start - base).to(tl.int64) * cols + (row0 - start)  # the segment's [C, size] matrix, this block
        tl.store(q_ptr + at + col.to(tl.int64)[None, :] * size + tl.arange(0, BLOCK)[:, None], q, mask=mask)
        tl.store(s_ptr + ((row0 - base) // BLOCK).to(tl.int64) * stride_s + col, scale, mask=col < cols)


@triton.jit
def _dequantise_rows_kernel(q_ptr, s_ptr, out_ptr, offs_ptr, last_group, rows, cols, stride_q, stride_s_row,
                            stride_s_tile, BLOCK: tl.constexpr, TILE: tl.constexpr):
    block, tile = tl.program_id(0), tl.program_id(1)
    if block * BLOCK < tl.load(offs_ptr + last_group):
        row = (block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        col = tile * TILE + tl.arange(0, TILE)
        mask = (row < rows)[:, None] & (col < cols)[None, :]
        q = tl.load(q_ptr + row[:, None] * stride_q + col[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(s_ptr + row * stride_s_row + tile * stride_s_tile, mask=row < rows, other=0.0)
        x = (q * scale[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row[:, None] * cols + col[None, :], x, mask=mask)


@triton.jit
def _cast_blocks_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, offs_ptr, first_group, n, k, stride_g, stride_n,
                        stride_k,
                        MAX_EXP_FIELD: tl.constexpr, MAX_MANTISSA: tl.constexpr, MIN_AMAX: tl.constexpr,
                        HARDWARE_ROUNDING: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                        SKIP_EMPTY: tl.constexpr, TILE: tl.constexpr):
    g, n_block, k_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if SKIP_EMPTY:  # a group no row multiplies: nothing to write (its blocks keep what they hold)
        at = first_group + g
        start = tl.load(offs_ptr + at - 1, mask=at > 0, other=0)
        if tl.load(offs_ptr + at) == start:
            return
    g64 = g.to(tl.int64)
    rn = n_block * TILE + tl.arange(0, TILE)
    rk = k_block * TILE + tl.arange(0, TILE)
    mask = (rn < n)[:, None] & (rk < k)[None, :]
    w = tl.load(w_ptr + g64 * stride_g + rn[:, None].to(tl.int64) * stride_n + rk[None, :] * stride_k,
                mask=mask, other=0.0).to(tl.float32)
    scale, inverse = _pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0), MAX_EXP_FIELD, MAX_MANTISSA,
                                 MIN_AMAX)
    q = _to_e4m3(w * inverse, q_ptr.dtype.element_ty, HARDWARE_ROUNDING)
    base = g64 * n * k
    if WRITE_Q:
        tl.store(q_ptr + base + rn[:, None] * k + rk[None, :], q, mask=mask)
    if WRITE_QT:
        tl.store(qt_ptr + base + rk[:, None] * n + rn[None, :], tl.trans(q),
                 mask=(rk < k)[:, None] & (rn < n)[None, :])
    tl.store(s_ptr + (g64 * tl.num_programs(1) + n_block) * tl.num_programs(2) + k_block, scale)


def cast_constants() -> dict:
    """The e4m3 format's constexprs every cast kernel takes (and `quantise_row_tiles` in other kernels)."""
    return {"MAX_EXP_FIELD": MAX_BITS >> 23, "MAX_MANTISSA": MAX_BITS & 0x7FFFFF, "MIN_AMAX": MIN_AMAX,
            "HARDWARE_ROUNDING": HARDWARE_ROUNDING}


def cast_rows(x_mk: torch.Tensor, offs_g: torch.Tensor,
              num_warps: int = ROWS_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `x [rows, K]` (bf16 or fp32, rows contiguous) -> `(q [rows, K] e4m3, scales [rows,
    ceil(K/128)] fp32)`, the scales MN-major with a row stride of `tma_aligned_rows(rows)` (DeepGEMM's sm90
    SFA layout, taken without a transpose). Only rows below `offs_g[-1]` (int32 [G] segment ends, on the
    device) are written: the others are unspecified."""
    rows, cols = x_mk.shape
    if x_mk.stride(1) != 1:
        raise ValueError(f"x must have contiguous rows (stride(1) == 1), got strides {x_mk.stride()}")
    q_mk, scales = empty_rows(rows, cols, x_mk.device)
    if rows and cols:
        grid = (cdiv(rows, BLOCK_ROWS), scales.shape[1])
        with launching():
            _cast_rows_kernel[grid](x_mk, q_mk, scales, offs_g, offs_g.numel() - 1, rows, cols,
                                    x_mk.stride(0), scales.stride(1), BLOCK=BLOCK_ROWS, TILE=TILE,
                                    num_warps=num_warps, **cast_constants())
    return q_mk, scales


def empty_rows(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised FP8 rows as `cast_rows` makes them: `q [rows, cols]` e4m3 and `scales [rows,
    ceil(cols/128)]` fp32, MN-major with a row stride of `tma_aligned_rows(rows)`."""
    return (torch.empty(rows, cols, dtype=FP8_DTYPE, device=device),
            empty_mn_major_scales(rows, cdiv(cols, TILE), device))


def cast_columns(x_mk: torch.Tensor, offs_g: torch.Tensor, first_group: int, last_group: int,
                 num_warps: int = ROWS_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight gradient's operand for DeepGEMM's sm90 k-grouped FP8 GEMM, `fp8.format.quantise_columns`'
    layout and bytes: the segments `first_group <= g < last_group` of `x [rows, C]` (bf16 or fp32, rows
    contiguous; `offs_g` int32 [G] segment ends on the device, each segment a multiple of 128 rows), packed
    from row 0 of the part (the first segment's start subtracted, read on the device: no host read) ->
    `(q [P * C] e4m3, scales [C, P / 128] fp32)` with `P = rows` rounded up to 128 (the part's capacity).
    Each segment's `[C, k]` transpose is stored row by row at `q[s * C:]` (s: its first row within the
    part); its scales, one power of two per column per 128 rows, are MN-major (`C` contiguous, stride
    `tma_aligned_rows(C)` between row blocks: DeepGEMM's sm90 scale layout, taken without a copy). What lies
    past the part's segments is unspecified."""
    rows, cols = x_mk.shape
    if x_mk.stride(1) != 1:
        raise ValueError(f"x must have contiguous rows (stride(1) == 1), got strides {x_mk.stride()}")
    if not 0 <= first_group <= last_group <= offs_g.numel():
        raise ValueError(f"need 0 <= first_group <= last_group <= {offs_g.numel()} segments, got "
                         f"{first_group} and {last_group}")
    capacity = align_up(rows, TILE)
    q = torch.empty(capacity * cols, dtype=FP8_DTYPE, device=x_mk.device)
    scales = empty_mn_major_scales(cols, capacity // TILE, x_mk.device)
    if rows and cols and last_group > first_group:
        grid = (capacity // TILE, cdiv(cols, COLUMNS_TILE))
        with launching():
            _cast_columns_kernel[grid](x_mk, q, scales, offs_g, first_group, last_group, rows, cols,
                                       x_mk.stride(0), scales.stride(1), GROUPS_P=next_power_of_2(last_group),
                                       BLOCK=TILE, TILE=COLUMNS_TILE, num_warps=num_warps,
                                       **cast_constants())
    return q, scales


def cast_blocks(w_gnk: torch.Tensor, scales_out: torch.Tensor, q_out: torch.Tensor | None = None,
                qt_out: torch.Tensor | None = None, num_warps: int = BLOCKS_WARPS,
                offs_g: torch.Tensor | None = None, first_group: int = 0) -> None:
    """Weights `w [G, N, K]` (bf16 or fp32, any strides) -> 128x128-block scales into `scales_out [G,
    ceil(N/128), ceil(K/128)]` fp32 and, where given, the e4m3 blocks into `q_out [G, N, K]` and their
    transpose into `qt_out [G, K, N]` (contiguous tensors, e.g. a group range of a larger buffer).

    With `offs_g` (int32 segment ends of a grouped GEMM, on the device; `w`'s group i is the GEMM's group
    `first_group + i`), the groups whose segment is empty are skipped, read on the device: no GEMM reads
    their weights, and their part of the outputs keeps what it holds."""
    groups, n, k = w_gnk.shape
    grid = (groups, cdiv(n, TILE), cdiv(k, TILE))
    if q_out is None and qt_out is None:
        raise ValueError("cast_blocks needs q_out, qt_out or both")
    for out, shape, name in ((scales_out, grid, "scales_out"), (q_out, (groups, n, k), "q_out"),
                             (qt_out, (groups, k, n), "qt_out")):
        if out is not None and (tuple(out.shape) != shape or not out.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {list(shape)} tensor, got {list(out.shape)} "
                             f"with strides {out.stride()}")
    if groups and n and k:
        with launching():
            _cast_blocks_kernel[grid](w_gnk, q_out if q_out is not None else qt_out,
                                      qt_out if qt_out is not None else q_out, scales_out,
                                      scales_out if offs_g is None else offs_g, first_group, n, k,
                                      *w_gnk.stride(), WRITE_Q=q_out is not None, WRITE_QT=qt_out is not None,
                                      SKIP_EMPTY=offs_g is not None, TILE=TILE, num_warps=num_warps,
                                      **cast_constants())


def dequantise_rows(q_mk: torch.Tensor, scales_mk: torch.Tensor, offs_g: torch.Tensor,
                    dtype: torch.dtype = torch.bfloat16, num_warps: int = ROWS_WARPS) -> torch.Tensor:
    """e4m3 rows `q [rows, K]` (rows contiguous, any row stride) and their scales `[rows, ceil(K/128)]` fp32
    (any strides) -> `q * scale` per 1x128 tile, a contiguous `[rows, K]` tensor of `dtype` (bf16 or fp32),
    equal bit for bit to `gemm.fp8.dequantise_rows`. Only rows below `offs_g[-1]` (int32 [G] segment ends,
    on the device) are written: the others are unspecified."""
    rows, cols = q_mk.shape
    if q_mk.dtype != FP8_DTYPE or q_mk.stride(1) != 1:
        raise ValueError(f"q must be {FP8_DTYPE} rows with contiguous columns (stride(1) == 1), got "
                         f"{q_mk.dtype} with strides {q_mk.stride()}")
    tiles = cdiv(cols, TILE)
    if tuple(scales_mk.shape) != (rows, tiles) or scales_mk.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [{rows}, {tiles}], got {scales_mk.dtype} "
                         f"{list(scales_mk.shape)}")
    x_mk = torch.empty(rows, cols, dtype=dtype, device=q_mk.device)
    if rows and cols:
        with launching():
            _dequantise_rows_kernel[(cdiv(rows, BLOCK_ROWS), tiles)](
                q_mk, scales_mk, x_mk, offs_g, offs_g.numel() - 1, rows, cols, q_mk.stride(0),
                *scales_mk.stride(), BLOCK=BLOCK_ROWS, TILE=TILE, num_warps=num_warps)
    return x_mk
