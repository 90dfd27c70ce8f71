"""FP8 expert weights as they are stored and moved: e4m3 values with one fp32 scale per 128x128 block (the
DeepSeek-V3 recipe and checkpoint format: `weight` e4m3 + `weight_scale_inv`), so `weight ~= q * scale` per
block. The activation cast and the FP8 GEMMs are `moonep_moe.gemm.fp8`; this module holds what the comm
core needs to move such weights (the format's constants, the scales' shape, byte views), the reference
weight cast (`quantise_blocks`) and its inverse (`dequantise_blocks`, with which `fp8.checkpoint` reads
checkpoints of that format).

Checkpoints keep an FP8 weight's scales under the weight's key plus `SCALE_SUFFIX`: DeepSeek-V3's released
per-expert `...experts.{e}.down_proj.weight` + `...weight_scale_inv`, and transformers' fused FP8 experts
(`FP8Experts`) `experts.gate_up_proj` + `experts.gate_up_proj_scale_inv`, `experts.down_proj` +
`experts.down_proj_scale_inv`. transformers builds a fused tensor by stacking the projections (gate's rows,
then up's) and stacks their scales the same way, so a fused `gate_up_proj [E, 2F, H]` has scales
`[E, 2 * ceil(F/128), ceil(H/128)]`: two parts with blocks of their own (`parts=2` below), which differs from
the blocks of the joined matrix when F is not a multiple of 128.

Moving FP8 weights is moving bytes: prefetch copies an expert's e4m3 bytes and its block scales unchanged
(half the bytes of bf16, plus 4 bytes per 128x128 block), so the copy equals quantising the moved bf16
weights, block by block. torch has no CPU kernels for most ops on float8 tensors (`index_copy_`,
`masked_fill_`), and gloo no float8 collectives: the exchanges move them as `uint8` views (`as_bytes`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
"""The FP8 format of expert weights and activations (e4m3: 3 mantissa bits, largest finite 448)."""
BLOCK = 128
"""Weights: one scale per ``BLOCK x BLOCK`` block; activations: one per row per ``BLOCK`` columns."""
WEIGHT_BYTES = 1 + 4 / BLOCK**2
"""Bytes an FP8 weight element takes with its share of its block's fp32 scale (what prefetch moves)."""
E4M3_MAX = 448.0
"""The largest finite e4m3 value, ``1.75 * 2^8``."""
MIN_AMAX = 2.0**-100
"""Blocks (and tiles) whose amax is below this are scaled as if it were this (an all-zero one gets a finite
scale)."""
MAX_BITS = struct.unpack("<i", struct.pack("<f", E4M3_MAX))[0]
"""``E4M3_MAX``'s fp32 bits: exponent field ``MAX_BITS >> 23``, significand bits ``MAX_BITS & 0x7FFFFF``."""


def block_scales_shape(weight_shape: torch.Size | tuple[int, ...], parts: int = 1) -> tuple[int, ...]:
    """The fp32 block scales' shape of FP8 weights ``[G, N, K]``: ``[G, ceil(N/128), ceil(K/128)]`` (tail
    blocks of ``N % 128`` rows or ``K % 128`` columns have their own scale). ``parts``: the weights stack
    that many projections of ``N / parts`` rows, each with blocks and scales of its own, stacked the same
    way: ``[G, parts * ceil(N/parts/128), ceil(K/128)]``."""
    *groups, n, k = weight_shape
    return (*groups, parts * -(-n // (parts * BLOCK)), -(-k // BLOCK))


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two ``s``, the smallest with ``amax / s <= E4M3_MAX`` (amax floored at ``MIN_AMAX``).

    Read from amax's fp32 bits: with ``E4M3_MAX = 1.75 * 2^8``, ``s = 2^(e - 8)`` when amax's significand is
    at most 1.75, else ``2^(e - 7)`` (``e`` the exponent of amax)."""
    bits = amax.to(torch.float32).clamp(min=MIN_AMAX).view(torch.int32)
    over = ((bits & 0x7FFFFF) > (MAX_BITS & 0x7FFFFF)).to(torch.int32)
    return (((bits >> 23) - (MAX_BITS >> 23) + 127 + over) << 23).view(torch.float32)


def pad_to_blocks(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``x`` in fp32 with each of ``dims`` zero-padded to a multiple of ``BLOCK``."""
    pad = [0] * (2 * x.dim())
    for dim in dims:
        pad[2 * (x.dim() - 1 - dim) + 1] = -x.shape[dim] % BLOCK
    return F.pad(x.to(torch.float32), pad)


def quantise_blocks(w_gnk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference weight cast: ``w [G, N, K]`` -> ``(q [G, N, K] e4m3, scales [G, ceil(N/128), ceil(K/128)]
    fp32)``, one power-of-two scale per 128x128 block (`pow2_scales`; tail blocks of ``N % 128`` rows or
    ``K % 128`` columns get their own)."""
    g, n, k = w_gnk.shape
    padded = pad_to_blocks(w_gnk, [1, 2])
    blocks = padded.view(g, padded.shape[1] // BLOCK, BLOCK, padded.shape[2] // BLOCK, BLOCK)
    scales_gnk = pow2_scales(blocks.abs().amax((2, 4)))
    q = (blocks / scales_gnk[:, :, None, :, None]).to(FP8_DTYPE)
    return q.view(padded.shape)[:, :n, :k].contiguous(), scales_gnk


def dequantise_blocks(q_gnk: torch.Tensor, scales_gnk: torch.Tensor, dtype: torch.dtype = torch.float64,
                      parts: int = 1) -> torch.Tensor:
    """``q * scale`` per 128x128 block, in ``dtype``: ``[..., N, K]`` from e4m3 ``q [..., N, K]`` and scales
    ``block_scales_shape(q.shape, parts)``."""
    if parts > 1:
        pairs = zip(q_gnk.chunk(parts, -2), scales_gnk.chunk(parts, -2), strict=True)
        return torch.cat([dequantise_blocks(q, scales, dtype) for q, scales in pairs], -2)
    n, k = q_gnk.shape[-2:]
    full = scales_gnk.to(dtype).repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return q_gnk.to(dtype) * full[..., :n, :k]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as a ``uint8`` view of the same memory (what the exchanges move); any other as is."""
    return tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor


TILE = BLOCK
"""Activations: one scale per row per ``TILE`` columns; weights: one per ``TILE x TILE`` block."""


def quantise_rows(x_mk: Tensor) -> tuple[Tensor, Tensor]:
    """Reference activation cast: ``x [rows, K]`` (any floating dtype, rounded to fp32 first) -> ``(q [rows,
    K] e4m3, scales [rows, Kb] fp32)`` with ``x ~= q * scales`` per 1x128 tile; a tail tile of ``K % 128``
    columns gets its own scale. The scales are contiguous (see `to_deep_gemm_row_scales`)."""
    rows, k = x_mk.shape
    padded = pad_to_blocks(x_mk, [1])
    tiles_mkt = padded.view(rows, padded.shape[1] // TILE, TILE)
    scales_mk = pow2_scales(tiles_mkt.abs().amax(-1))
    q_mkt = (tiles_mkt / scales_mk[..., None]).to(FP8_DTYPE)
    return q_mkt.view(rows, padded.shape[1])[:, :k].contiguous(), scales_mk


def dequantise_rows(q_mk: Tensor, scales_mk: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """``q * scale`` per 1x128 tile, in ``dtype``: ``[rows, K]`` (scales of any strides), multiplied in place
    tile by tile, so the only ``[rows, K]`` tensor made is the result. Exact in bf16 too: an e4m3 value has
    4 significant bits and the scales are powers of two within bf16's exponent range."""
    rows, k = q_mk.shape
    x_mk = q_mk.to(dtype)
    full = k // TILE
    if full:
        x_mk[:, :full * TILE].view(rows, full, TILE).mul_(scales_mk[:, :full, None].to(dtype))
    if k % TILE:
        x_mk[:, full * TILE:].mul_(scales_mk[:, full:full + 1].to(dtype))
    return x_mk


def transpose_blocks(q_gnk: Tensor, scales_gnk: Tensor) -> tuple[Tensor, Tensor]:
    """The K-major copy of ``W^T`` for dgrad on sm90: ``(q [G, K, N] contiguous, scales [G, Kb, ceil(N/128)]``
    as a transposed view, the layout DeepGEMM's SFB check accepts)."""
    return q_gnk.transpose(1, 2).contiguous(), scales_gnk.transpose(1, 2)


def tma_aligned_rows(rows: int) -> int:
    """The row stride of MN-major fp32 scales: ``rows`` rounded up to 4 (16 bytes, TMA's alignment)."""
    return -(-rows // 4) * 4


def empty_mn_major_scales(rows: int, tiles: int, device: torch.device) -> Tensor:
    """Uninitialised fp32 scales ``[rows, tiles]`` in DeepGEMM's sm90 scale layout: MN-major, ``stride = (1,
    tma_aligned_rows(rows))`` (what the casts in `fp8.cast` write)."""
    stride = tma_aligned_rows(rows)
    flat = torch.empty(tiles * stride, dtype=torch.float32, device=device)
    return flat.as_strided((rows, tiles), (1, stride))


def to_deep_gemm_row_scales(scales_mk: Tensor) -> Tensor:
    """``[rows, Kb]`` scales in DeepGEMM's sm90 SFA layout (`empty_mn_major_scales`): ``scales_mk`` itself
    where it has that layout and starts 16-byte aligned (TMA's alignment), else a copy."""
    rows, tiles = scales_mk.shape
    if scales_mk.stride() == (1, tma_aligned_rows(rows)) and scales_mk.data_ptr() % 16 == 0:
        return scales_mk
    return empty_mn_major_scales(rows, tiles, scales_mk.device).copy_(scales_mk)


def quantise_columns(x_mk: Tensor, sizes: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Reference cast of a weight gradient's operand (``dy`` or ``x`` of ``dW[g] = dy_g^T x_g``) for
    DeepGEMM's sm90 k-grouped FP8 GEMM: ``x [rows, C]`` whose first ``sum(sizes)`` rows are groups of
    ``sizes`` rows back to back (each a multiple of 128) -> ``(q [rows * C] e4m3, scales [C, rows / 128]
    fp32)``. Group g (rows ``[s, s + k)``) is stored transposed, K-major: ``q[s * C:(s + k) * C]`` is its
    ``[C, k]`` matrix row by row; ``scales[:, s / 128:(s + k) / 128]`` hold one power-of-two scale
    (`pow2_scales`) per column per 128 of its rows. What lies past the groups is zero. ``rows``: a multiple
    of 128."""
    rows, cols = x_mk.shape
    if rows % BLOCK or any(size % BLOCK for size in sizes) or sum(sizes) > rows:
        raise ValueError(f"rows ({rows}) and every group size ({list(sizes)}) must be multiples of {BLOCK}, "
                         f"the groups within the rows")
    q = torch.zeros(rows * cols, dtype=FP8_DTYPE, device=x_mk.device)
    scales = torch.zeros(cols, rows // BLOCK, dtype=torch.float32, device=x_mk.device)
    start = 0
    for size in sizes:  # a group's transpose cast as rows: one scale per column per 128 of the group's rows
        q_ck, scales_ck = quantise_rows(x_mk[start:start + size].t())
        as_bytes(q)[start * cols:(start + size) * cols] = as_bytes(q_ck).flatten()
        scales[:, start // BLOCK:(start + size) // BLOCK] = scales_ck
        start += size
    return q, scales


def dequantise_columns(q: Tensor, scales_cb: Tensor, sizes: Sequence[int],
                       dtype: torch.dtype = torch.float64) -> list[Tensor]:
    """`quantise_columns` undone: each group's ``[k, C]`` rows as ``q * scale``, in ``dtype`` (exact: 4
    significant bits times a power of two); ``scales_cb [C, rows / 128]`` of any strides."""
    cols, start, groups = scales_cb.shape[0], 0, []
    for size in sizes:
        q_ck = q[start * cols:(start + size) * cols].view(cols, size)
        groups.append(dequantise_rows(q_ck, scales_cb[:, start // BLOCK:(start + size) // BLOCK], dtype).t())
        start += size
    return groups
