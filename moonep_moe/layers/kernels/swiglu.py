"""Triton kernels of the expert block's elementwise middle (the contract is `moonep_moe.layers.swiglu`).

Shapes use the suffix letters of DESIGN.md, "Notation" (rows: dispatched rows, `nv`). `ab_nv2f` holds gate
(columns [0, F)) and up ([F, 2F)).

- forward: one pass reads `ab` and `w`, writes `hw = silu(a) * b * w`, or instead `hw` as FP8 rows (e4m3
  per 1x128 tile, the bytes `fp8.cast.cast_rows` makes of the bf16 hw) for an FP8 down GEMM;
- backward: one pass reads `u` (the gradient w.r.t. `hw`), `ab` and `w`, writes `dab`, the route-weight
  gradient `rowsum(u * silu(a) * b)` and, recomputed, `hw` (the down projection's weight gradient needs it),
  so backward never re-reads `ab` for a separate forward; for an FP8 gate_up dgrad also `dab` as FP8 rows.

Columns go in blocks of `NT` tiles of `T` columns (128 where F allows), the same with and without the FP8
outputs, so both give the same bits.

Both compute in fp32 and skip the rows at and past `num_rows` (a device scalar, e.g. `cu_seqlens[-1]`: no
host sync), leaving them unwritten. The grid is the rows' capacity up to `ROW_PROGRAMS` programs, each
taking every `ROW_PROGRAMS`-th row below `num_rows`: a Buffer sized for every route of the group (`balance`
other than exact: R*S*K rows, of which a rank fills about S*K) launches no more programs than an exact one,
instead of a program per capacity row that only reads `num_rows` and exits. Row offsets are int64 (rows * 2F
may pass 2^31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep_moe.base.sizes import next_power_of_2
from moonep_moe.comm.kernels.common import as_int64
from moonep_moe.fp8.cast import cast_constants, empty_rows, quantise_row_tiles
from moonep_moe.fp8.format import TILE

BLOCK_F = 512
ROW_PROGRAMS = 2**16
"""The most programs a launch has: a DeepSeek-V3 rank's S*K = 65536 rows get one program each."""


@triton.jit
def _columns(start, NT: tl.constexpr, T: tl.constexpr):
    """`[NT, T]` column indices from `start`: a block of `NT` tiles of `T` columns (1x128 FP8 tiles when
    `T` is 128)."""
    return start + tl.arange(0, NT)[:, None] * T + tl.arange(0, T)[None, :]


@triton.jit
def _store_fp8_tiles(q_ptr, s_ptr, row, x, part, start, stride_s, F: tl.constexpr, ROW: tl.constexpr,
                     NT: tl.constexpr, T: tl.constexpr, MAX_EXP_FIELD: tl.constexpr,
                     MAX_MANTISSA: tl.constexpr, MIN_AMAX: tl.constexpr, HARDWARE_ROUNDING: tl.constexpr):
    """`x [NT, T]` (T = 128): fp32 values of one row's F-column part starting at column `part` of the row, its
    columns `_columns(start, NT, T)` (those past F masked), cast to e4m3 per 1x128 tile into `q` (rows of
    `ROW` columns) and the tiles' scales (MN-major, `stride_s` apart)."""
    q, scale = quantise_row_tiles(x, q_ptr.dtype.element_ty, MAX_EXP_FIELD, MAX_MANTISSA, MIN_AMAX,
                                  HARDWARE_ROUNDING)
    cols = _columns(start, NT, T)
    tl.store(q_ptr + row * ROW + part + cols, q, mask=cols < F)
    first = start + tl.arange(0, NT) * T
    tl.store(s_ptr + (part + first) // T * stride_s + row, scale, mask=first < F)


@triton.jit
def _swiglu_fwd_kernel(ab_ptr, w_ptr, hw_ptr, s_ptr, num_rows_ptr, stride_ab, stride_hw, stride_s,
                       MAX_EXP_FIELD: tl.constexpr, MAX_MANTISSA: tl.constexpr, MIN_AMAX: tl.constexpr,
                       HARDWARE_ROUNDING: tl.constexpr, FP8: tl.constexpr, F: tl.constexpr,
                       NT: tl.constexpr, T: tl.constexpr):
    num_rows = tl.load(num_rows_ptr)
    for row32 in tl.range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row = as_int64(row32)
        w = tl.load(w_ptr + row).to(tl.float32)
        for start in range(0, F, NT * T):
            cols = _columns(start, NT, T)
            mask = cols < F
            a = tl.load(ab_ptr + row * stride_ab + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(ab_ptr + row * stride_ab + F + cols, mask=mask, other=0.0).to(tl.float32)
            hw = a * tl.sigmoid(a) * b * w
            if FP8:  # the bits a cast of hw in ab's dtype reads
                hw = hw.to(ab_ptr.dtype.element_ty).to(tl.float32)
                _store_fp8_tiles(hw_ptr, s_ptr, row, hw, 0, start, stride_s, F, F, NT, T, MAX_EXP_FIELD,
                                 MAX_MANTISSA, MIN_AMAX, HARDWARE_ROUNDING)
            else:
                tl.store(hw_ptr + row * stride_hw + cols, hw.to(hw_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(u_ptr, ab_ptr, w_ptr, dab_ptr, gw_ptr, hw_ptr, q_ptr, s_ptr, num_rows_ptr, stride_u,
                       stride_ab, stride_dab, stride_hw, stride_s, MAX_EXP_FIELD: tl.constexpr,
                       MAX_MANTISSA: tl.constexpr, MIN_AMAX: tl.constexpr, HARDWARE_ROUNDING: tl.constexpr,
                       FP8: tl.constexpr, F: tl.constexpr, NT: tl.constexpr, T: tl.constexpr):
    num_rows = tl.load(num_rows_ptr)
    for row32 in tl.range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row = as_int64(row32)
        w = tl.load(w_ptr + row).to(tl.float32)
        acc = tl.zeros([NT, T], dtype=tl.float32)
        for start in range(0, F, NT * T):
            cols = _columns(start, NT, T)
            mask = cols < F
            u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
            a = tl.load(ab_ptr + row * stride_ab + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(ab_ptr + row * stride_ab + F + cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(a)
            silu = a * sig
            h = silu * b
            acc += u * h
            dh = u * w
            da = (dh * b * sig * (1.0 + a * (1.0 - sig))).to(dab_ptr.dtype.element_ty)
            db = (dh * silu).to(dab_ptr.dtype.element_ty)
            tl.store(dab_ptr + row * stride_dab + cols, da, mask=mask)
            tl.store(dab_ptr + row * stride_dab + F + cols, db, mask=mask)
            tl.store(hw_ptr + row * stride_hw + cols, (h * w).to(hw_ptr.dtype.element_ty), mask=mask)
            if FP8:  # dab as gate_up's dgrad reads it: e4m3 per 1x128 tile of the 2F columns
                _store_fp8_tiles(q_ptr, s_ptr, row, da.to(tl.float32), 0, start, stride_s, F, 2 * F, NT, T,
                                 MAX_EXP_FIELD, MAX_MANTISSA, MIN_AMAX, HARDWARE_ROUNDING)
                _store_fp8_tiles(q_ptr, s_ptr, row, db.to(tl.float32), F, start, stride_s, F, 2 * F, NT, T,
                                 MAX_EXP_FIELD, MAX_MANTISSA, MIN_AMAX, HARDWARE_ROUNDING)
        tl.store(gw_ptr + row, tl.sum(tl.sum(acc, axis=1), axis=0).to(gw_ptr.dtype.element_ty))


def _tiles(f: int, fp8: bool) -> dict:
    """The column blocking: `NT` tiles of `T` columns a block, `BLOCK_F` columns at most (a power of two up to
    F); FP8 tiles are 128 columns. The same for both, so the kernels give the same bits with and without
    their FP8 outputs."""
    block = min(BLOCK_F, next_power_of_2(f))
    t = min(TILE, block)
    if fp8:
        block, t = max(block, TILE), TILE
    return {"NT": block // t, "T": t}


def _num_rows(num_rows: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    return torch.full((1,), rows, dtype=torch.int32, device=device) if num_rows is None else num_rows


def swiglu_weighted_triton(ab_nv2f: torch.Tensor, route_weights_nvs: torch.Tensor,
                           num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`[NvS, 2F]`, `[NvS]` -> `hw [NvS, F]` in `ab`'s dtype; rows >= `num_rows` (int32 device scalar)
    unwritten."""
    rows, f = ab_nv2f.shape[0], ab_nv2f.shape[1] // 2
    hw_nvf = ab_nv2f.new_empty(rows, f)
    _forward(ab_nv2f, route_weights_nvs, num_rows, hw_nvf, hw_nvf, fp8=False)
    return hw_nvf


def swiglu_weighted_fp8_triton(ab_nv2f: torch.Tensor, route_weights_nvs: torch.Tensor,
                               num_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[NvS, 2F]`, `[NvS]` -> `hw` as FP8 rows `(q [NvS, F] e4m3, scales [NvS, F/128])`, the bytes and
    layout `fp8.cast.cast_rows` gives for `swiglu_weighted_triton`'s hw, without writing hw; rows >=
    `num_rows` unwritten. F must be a multiple of 128 (`layers.swiglu.fp8_tiles_reason`)."""
    rows, f = ab_nv2f.shape[0], ab_nv2f.shape[1] // 2
    q_nvf, scales = empty_rows(rows, f, ab_nv2f.device)
    _forward(ab_nv2f, route_weights_nvs, num_rows, q_nvf, scales, fp8=True)
    return q_nvf, scales


def _forward(ab_nv2f, route_weights_nvs, num_rows, out, scales, fp8: bool) -> None:
    rows, f = ab_nv2f.shape[0], ab_nv2f.shape[1] // 2
    if rows:
        _swiglu_fwd_kernel[(min(rows, ROW_PROGRAMS),)](
            ab_nv2f, route_weights_nvs, out, scales, _num_rows(num_rows, rows, ab_nv2f.device),
            ab_nv2f.stride(0), out.stride(0), scales.stride(-1), FP8=fp8, F=f, **_tiles(f, fp8),
            **cast_constants())


def swiglu_weighted_backward_triton(u_nvf: torch.Tensor, ab_nv2f: torch.Tensor,
                                    route_weights_nvs: torch.Tensor, num_rows: torch.Tensor | None = None,
                                    over_ab: bool = False, fp8_dab: bool = False) -> tuple:
    """-> `(dab [NvS, 2F], grad_route_weights [NvS] in w's dtype, hw [NvS, F])`, and with `fp8_dab` also dab
    as FP8 rows `(q [NvS, 2F] e4m3, scales [NvS, 2F/128])`, the bytes and layout `fp8.cast.cast_rows` gives
    for dab (F a multiple of 128); rows >= `num_rows` unwritten; `over_ab`: dab written
    over `ab_nv2f` (each program loads its row's columns of a and b before it stores dab's there)."""
    rows, f = ab_nv2f.shape[0], ab_nv2f.shape[1] // 2
    dab_nv2f = ab_nv2f if over_ab else torch.empty_like(ab_nv2f)
    hw_nvf = ab_nv2f.new_empty(rows, f)
    gw_nvs = torch.empty_like(route_weights_nvs)
    if fp8_dab:
        q_nv2f, scales = empty_rows(rows, 2 * f, ab_nv2f.device)
    else:
        q_nv2f = scales = hw_nvf  # not read: FP8 off
    if rows:
        _swiglu_bwd_kernel[(min(rows, ROW_PROGRAMS),)](
            u_nvf, ab_nv2f, route_weights_nvs, dab_nv2f, gw_nvs, hw_nvf, q_nv2f, scales,
            _num_rows(num_rows, rows, ab_nv2f.device), u_nvf.stride(0), ab_nv2f.stride(0), dab_nv2f.stride(0),
            hw_nvf.stride(0), scales.stride(-1), FP8=fp8_dab, F=f, **_tiles(f, fp8_dab), **cast_constants())
    return (dab_nv2f, gw_nvs, hw_nvf, (q_nv2f, scales)) if fp8_dab else (dab_nv2f, gw_nvs, hw_nvf)
