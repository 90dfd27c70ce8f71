"""Triton kernels of the expert block's elementwise middle (the contract is `moonep_moe.layers.swiglu`).

Shapes use the suffix letters of DESIGN.md, "Notation" (rows: dispatched rows, `nv`). `ab_nv2f` holds gate
(columns [0, F)) and up ([F, 2F)).

- forward: one pass reads `ab` and `w`, writes `hw = silu(a) * b * w`;
- backward: one pass reads `u` (the gradient w.r.t. `hw`), `ab` and `w`, writes `dab`, the route-weight
  gradient `rowsum(u * silu(a) * b)` and, recomputed, `hw` (the down projection's weight gradient needs it),
  so backward never re-reads `ab` for a separate forward.

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

BLOCK_F = 512
ROW_PROGRAMS = 2**16
"""The most programs a launch has: a DeepSeek-V3 rank's S*K = 65536 rows get one program each."""


@triton.jit
def _swiglu_fwd_kernel(ab_ptr, w_ptr, hw_ptr, num_rows_ptr, stride_ab, stride_hw, F: tl.constexpr,
                       BLOCK: tl.constexpr):
    num_rows = tl.load(num_rows_ptr)
    for row32 in tl.range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row = as_int64(row32)
        w = tl.load(w_ptr + row).to(tl.float32)
        for start in range(0, F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < F
            a = tl.load(ab_ptr + row * stride_ab + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(ab_ptr + row * stride_ab + F + cols, mask=mask, other=0.0).to(tl.float32)
            hw = a * tl.sigmoid(a) * b * w
            tl.store(hw_ptr + row * stride_hw + cols, hw.to(hw_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(u_ptr, ab_ptr, w_ptr, dab_ptr, gw_ptr, hw_ptr, num_rows_ptr, stride_u, stride_ab,
                       stride_dab, stride_hw, F: tl.constexpr, BLOCK: tl.constexpr):
    num_rows = tl.load(num_rows_ptr)
    for row32 in tl.range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row = as_int64(row32)
        w = tl.load(w_ptr + row).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < F
            u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
            a = tl.load(ab_ptr + row * stride_ab + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(ab_ptr + row * stride_ab + F + cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(a)
            silu = a * sig
            h = silu * b
            acc += u * h
            dh = u * w
            da = dh * b * sig * (1.0 + a * (1.0 - sig))
            tl.store(dab_ptr + row * stride_dab + cols, da.to(dab_ptr.dtype.element_ty), mask=mask)
            tl.store(dab_ptr + row * stride_dab + F + cols, (dh * silu).to(dab_ptr.dtype.element_ty),
                     mask=mask)
            tl.store(hw_ptr + row * stride_hw + cols, (h * w).to(hw_ptr.dtype.element_ty), mask=mask)
        tl.store(gw_ptr + row, tl.sum(acc, axis=0).to(gw_ptr.dtype.element_ty))


def _block(f: int) -> int:
    return min(BLOCK_F, next_power_of_2(f))


def _num_rows(num_rows: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    return torch.full((1,), rows, dtype=torch.int32, device=device) if num_rows is None else num_rows


def swiglu_weighted_triton(ab_nv2f: torch.Tensor, route_weights_nvs: torch.Tensor,
                           num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`[NvS, 2F]`, `[NvS]` -> `hw [NvS, F]` in `ab`'s dtype; rows >= `num_rows` (int32 device scalar)
    unwritten."""
    rows, f = ab_nv2f.shape[0], ab_nv2f.shape[1] // 2
    hw_nvf = ab_nv2f.new_empty(rows, f)
    if rows:
        _swiglu_fwd_kernel[(min(rows, ROW_PROGRAMS),)](ab_nv2f, route_weights_nvs, hw_nvf,
                                    _num_rows(num_rows, rows, ab_nv2f.device), ab_nv2f.stride(0),
                                    hw_nvf.stride(0), F=f, BLOCK=_block(f))
    return hw_nvf


def swiglu_weighted_backward_triton(u_nvf: torch.Tensor, ab_nv2f: torch.Tensor,
                                    route_weights_nvs: torch.Tensor, num_rows: torch.Tensor | None = None,
                                    over_ab: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> `(dab [NvS, 2F], grad_route_weights [NvS] in w's dtype, hw [NvS, F])`; rows >= `num_rows`
    unwritten; `over_ab`: dab written over `ab_nv2f` (each program loads its row's columns of a and b before
    it stores dab's there)."""
    rows, f = ab_nv2f.shape[0], ab_nv2f.shape[1] // 2
    dab_nv2f = ab_nv2f if over_ab else torch.empty_like(ab_nv2f)
    hw_nvf = ab_nv2f.new_empty(rows, f)
    gw_nvs = torch.empty_like(route_weights_nvs)
    if rows:
        _swiglu_bwd_kernel[(min(rows, ROW_PROGRAMS),)](u_nvf, ab_nv2f, route_weights_nvs, dab_nv2f, gw_nvs,
                                                       hw_nvf,
                                    _num_rows(num_rows, rows, ab_nv2f.device), u_nvf.stride(0),
                                    ab_nv2f.stride(0), dab_nv2f.stride(0), hw_nvf.stride(0), F=f,
                                    BLOCK=_block(f))
    return dab_nv2f, gw_nvs, hw_nvf
