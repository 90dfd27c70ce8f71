"""Triton grouped weight gradient: ``out[g] = dy[s:e]^T @ x[s:e]`` accumulated in fp32, written straight into
the gradients (fp32, or the parameters' dtype).

Legend: m rows (grouped by expert), n output features, k input features, g groups (home experts, then
prefetch slots). The contract is ``GroupedGemm.wgrad`` (`moonep_moe.layers.grouped_gemm`).

Why a kernel: for the expert shapes of large models the fp32 gradient write dominates the weight gradient
(DeepSeek-V3, ~256 rows per expert: each expert's ``[2048, 7168]`` fp32 gradient is 59 MB to write against
7.5 GFLOP). ``torch._grouped_mm`` must output bf16, so its wgrad writes bf16 products and a second pass reads
them and writes (or adds into) the fp32 gradients. Here each program owns one ``[BLOCK_N, BLOCK_K]`` tile of
one group's gradient, accumulates ``dy^T x`` over the group's rows in fp32 on the tensor cores (bf16 or fp16
inputs) and writes the tile once, rounded to the output's dtype: overwrite, or add to what is there in fp32
(``accumulate``).

Grid: one program per (group, tile), 1D, group-major, tiles swizzled in bands of ``SWIZZLE`` tile rows so the
programs running at once share both operands in L2. A group's rows are data (``offs_g`` on the device, no
host read): an empty group's programs store zeros (overwrite) or exit (accumulate) at once.

Groups live in up to two output tensors per launch (home gradients, then the slot-gradient pool), passed as
two base pointers and the first one's group count (the two may differ in dtype, e.g. bf16 home gradients and
fp32 slot gradients): no concatenation, no pointer table to upload. More parts take one launch per pair.

Tile configs are autotuned per ``(N, K)`` and dtypes on the first call (host syncs then; Triton caches the
choice on disk). Timing runs in accumulate mode would add into the gradients, so an accumulating call first
tunes on an overwriting launch over scratch outputs of a few groups (same dtypes, so the same autotuner key):
no copy of the gradients (a copy of a DeepSeek-V3 layer's fp32 gate_up gradient is 28 GiB, and ran the H200
out of memory in `main_grad` mode).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

SWIZZLE = 8
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs() -> list[triton.Config]:
    """sm90 tiles (the accumulator is ``[BLOCK_N, BLOCK_K]`` fp32, rows consumed ``BLOCK_M`` at a time); the
    interpreter gets one small tile so CPU tests cover several tiles and masked tails."""
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_M": 64}, num_warps=4, num_stages=1)]
    tiles = [  # (BLOCK_N, BLOCK_K, BLOCK_M, num_warps, num_stages)
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
    ]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_M": bm}, num_warps=w, num_stages=s)
            for bn, bk, bm, w, s in tiles]


@triton.autotune(configs=_configs(), key=["N", "K"], cache_results=True)
@triton.jit
def _grouped_wgrad_kernel(dy_ptr, x_ptr, offs_ptr, out0_ptr, out1_ptr, groups0, first_group, N, K, stride_dy,
                          stride_x, stride_out0, stride_out1, ACCUMULATE: tl.constexpr, SWIZZLE: tl.constexpr,
                          INTERPRET_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles = tiles_n * tiles_k
    group = pid // tiles
    tile = pid % tiles
    band_tiles = SWIZZLE * tiles_k
    band_first_n = (tile // band_tiles) * SWIZZLE
    band_rows = tl.minimum(tiles_n - band_first_n, SWIZZLE)
    tile_n = band_first_n + (tile % band_tiles) % band_rows
    tile_k = (tile % band_tiles) // band_rows

    segment = first_group + group
    end = tl.load(offs_ptr + segment)
    start = tl.load(offs_ptr + segment - 1, mask=segment > 0, other=0)
    count = end - start
    if ACCUMULATE:
        if count <= 0:
            return

    cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    live_n = cols_n < N
    live_k = cols_k < K
    dy_rows = dy_ptr + start.to(tl.int64) * stride_dy
    x_rows = x_ptr + start.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # INTERPRET_ROWS is 0 when compiled. Triton's interpreter (3.6, numpy 2.4) can neither loop to a device
    # value nor multiply bf16 in tl.dot: there it is M, the loop visits all rows (masked) and the tiles are
    # widened to fp32 first (exact: the products of bf16 values are exact in fp32 either way).
    for first_row in range(0, INTERPRET_ROWS if INTERPRET_ROWS else count, BLOCK_M):
        rows = first_row + tl.arange(0, BLOCK_M)
        live_m = rows < count
        dy_mn = tl.load(dy_rows + rows[:, None] * stride_dy + cols_n[None, :],
                        mask=live_m[:, None] & live_n[None, :], other=0.0)
        x_mk = tl.load(x_rows + rows[:, None] * stride_x + cols_k[None, :],
                       mask=live_m[:, None] & live_k[None, :], other=0.0)
        if INTERPRET_ROWS:
            dy_mn, x_mk = dy_mn.to(tl.float32), x_mk.to(tl.float32)
        acc = tl.dot(tl.trans(dy_mn), x_mk, acc)

    if group < groups0:
        _store_tile(out0_ptr + group.to(tl.int64) * stride_out0, acc, cols_n, cols_k, K, live_n, live_k,
                    ACCUMULATE)
    else:
        _store_tile(out1_ptr + (group - groups0).to(tl.int64) * stride_out1, acc, cols_n, cols_k, K, live_n,
                    live_k, ACCUMULATE)


@triton.jit
def _store_tile(out_ptr, acc, cols_n, cols_k, K, live_n, live_k, ACCUMULATE: tl.constexpr):
    """Write (or add in fp32 into) one ``[BLOCK_N, BLOCK_K]`` tile of a ``[N, K]`` matrix of any float dtype
    (a function so the two output parts may differ in dtype)."""
    out_nk = out_ptr + cols_n[:, None] * K + cols_k[None, :]
    live_nk = live_n[:, None] & live_k[None, :]
    if ACCUMULATE:
        acc += tl.load(out_nk, mask=live_nk, other=0.0).to(tl.float32)
    tl.store(out_nk, acc.to(out_ptr.dtype.element_ty), mask=live_nk)


def _check(dy_mn: torch.Tensor, x_mk: torch.Tensor, offs_g: torch.Tensor,
           out_gnk: Sequence[torch.Tensor]) -> None:
    """Shapes, dtypes and layouts the kernel assumes (no host read of device data)."""
    if dy_mn.dtype not in (torch.bfloat16, torch.float16) or x_mk.dtype != dy_mn.dtype:
        raise ValueError(f"dy_mn and x_mk must both be bfloat16 or float16, got {dy_mn.dtype}, {x_mk.dtype}")
    if dy_mn.dim() != 2 or x_mk.dim() != 2 or dy_mn.shape[0] != x_mk.shape[0]:
        raise ValueError(f"dy_mn [M, N] and x_mk [M, K] must share M, got {list(dy_mn.shape)}, "
                         f"{list(x_mk.shape)}")
    if dy_mn.stride(1) != 1 or x_mk.stride(1) != 1:
        raise ValueError("dy_mn and x_mk must have unit column stride")
    n, k = dy_mn.shape[1], x_mk.shape[1]
    for out in out_gnk:
        if out.dtype not in OUT_DTYPES or out.shape[1:] != (n, k) or out.stride()[1:] != (k, 1):
            raise ValueError(f"every out_gnk part must be [g, {n}, {k}] of {OUT_DTYPES} with contiguous "
                             f"[n, k] matrices, got {out.dtype} {list(out.shape)} strides {out.stride()}")
    if offs_g.dtype != torch.int32 or offs_g.numel() != sum(out.shape[0] for out in out_gnk):
        raise ValueError(f"offs_g must be int32 [G], G = groups in out_gnk; got {offs_g.dtype} "
                         f"{list(offs_g.shape)}")


def grouped_wgrad_triton(dy_mn: torch.Tensor, x_mk: torch.Tensor, offs_g: torch.Tensor,
                         out_gnk: Sequence[torch.Tensor], accumulate: bool) -> None:
    """``out[g] (+)= dy[s:e]^T @ x[s:e]`` for every group g, accumulated in fp32.

    Args:
        dy_mn: ``[M, N]`` bf16/fp16 output gradients, rows grouped by ``offs_g``.
        x_mk: ``[M, K]`` inputs of the same dtype.
        offs_g: int32 ``[G]`` group end offsets (device); rows at and past ``offs_g[-1]`` are never read.
        out_gnk: ``[g_i, N, K]`` parts (float32, bfloat16 or float16, each ``[N, K]`` matrix contiguous) whose
            groups concatenate to G (home gradients, then slots).
        accumulate: add into ``out_gnk``; False overwrites every group (empty ones with zeros).
    """
    _check(dy_mn, x_mk, offs_g, out_gnk)
    first_group = 0
    for pair in (out_gnk[i:i + 2] for i in range(0, len(out_gnk), 2)):
        out0, out1 = pair[0], pair[-1]
        groups0 = out0.shape[0]
        groups = groups0 + (out1.shape[0] if len(pair) == 2 else 0)
        if groups and accumulate:
            _tune_overwriting(dy_mn, x_mk, offs_g, out0, out1, first_group)
        if groups:
            _launch(dy_mn, x_mk, offs_g, out0, out1, groups, groups0, first_group, accumulate)
        first_group += groups


def _launch(dy_mn: torch.Tensor, x_mk: torch.Tensor, offs_g: torch.Tensor, out0: torch.Tensor,
            out1: torch.Tensor, groups: int, groups0: int, first_group: int, accumulate: bool) -> None:
    """One launch over groups `[first_group, first_group + groups)`, the first `groups0` in `out0`."""
    n, k = dy_mn.shape[1], x_mk.shape[1]
    grid = lambda meta: (groups * triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"]),)
    _grouped_wgrad_kernel[grid](dy_mn, x_mk, offs_g, out0, out1, groups0, first_group, n, k, dy_mn.stride(0),
                                x_mk.stride(0), out0.stride(0), out1.stride(0), ACCUMULATE=accumulate,
                                SWIZZLE=SWIZZLE, INTERPRET_ROWS=dy_mn.shape[0] if _INTERPRET else 0)


_TUNING_GROUPS = 8
_TUNED: set[tuple] = set()


def _tune_overwriting(dy_mn: torch.Tensor, x_mk: torch.Tensor, offs_g: torch.Tensor, out0: torch.Tensor,
                      out1: torch.Tensor, first_group: int) -> None:
    """Before the first accumulating launch of a shape and dtypes in this process: an overwriting launch over
    the first `_TUNING_GROUPS` groups into scratch outputs of `out0`'s and `out1`'s dtypes, which runs the
    autotuner (or loads its disk cache) for the key the accumulating launch uses."""
    key = (dy_mn.dtype, dy_mn.shape[1], x_mk.shape[1], out0.dtype, out1.dtype, dy_mn.device)
    if key in _TUNED:
        return
    rows = (dy_mn.shape[1], x_mk.shape[1])
    scratch0 = torch.empty((_TUNING_GROUPS - 1, *rows), dtype=out0.dtype, device=out0.device)
    scratch1 = torch.empty((1, *rows), dtype=out1.dtype, device=out1.device)
    groups = min(_TUNING_GROUPS, offs_g.numel() - first_group)
    _launch(dy_mn, x_mk, offs_g, scratch0, scratch1, groups, min(groups, _TUNING_GROUPS - 1), first_group,
            accumulate=False)
    _TUNED.add(key)
