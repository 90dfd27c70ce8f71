"""FP8 weights in checkpoints: the DeepSeek-V3 format (`weight` e4m3 + `weight_scale_inv`, one fp32 scale per
128x128 block) read into a model's weights, dequantised chunk by chunk (`copy_checkpoint_weight_`), with the
scales' key (`SCALE_SUFFIX`), layout and values (finite) checked."""

from __future__ import annotations

from collections.abc import Mapping
from types import EllipsisType

import torch

from moonep_moe.fp8.format import BLOCK, FP8_DTYPE, block_scales_shape, dequantise_blocks

SCALE_SUFFIX = "_scale_inv"
"""A checkpoint's FP8 weight ``key`` keeps its fp32 block scales under ``key + SCALE_SUFFIX``."""
DEQUANTISE_CHUNK_BYTES = 16 << 20
"""The most bytes of fp32 values `copy_checkpoint_weight_` dequantises at once (unless one 128x128 block,
64 KiB, is more): a DeepSeek-V3 expert's gate_up ``[4096, 7168]`` goes in 8 chunks of ``[512, 7168]``
(14.7 MB; the e4m3 values and the scales widened to fp32 are a chunk's size too, while it is made)."""


def checkpoint_scales(tensors: Mapping[str, torch.Tensor], key: str, parts: int = 1) -> torch.Tensor | None:
    """The block scales ``tensors[key + SCALE_SUFFIX]`` of the FP8 (e4m3) weight ``tensors[key]``, checked:
    float32 ``block_scales_shape(weight.shape, parts)``; None for a weight that is not FP8.

    Raises:
        ValueError naming the key: an FP8 weight without its scales, scales of another shape or dtype, NaN or
        infinite scales, or scales beside a weight that is not FP8.
    """
    weight, scale_key = tensors[key], key + SCALE_SUFFIX
    scales = tensors.get(scale_key)
    if weight.dtype != FP8_DTYPE:
        if scales is not None:
            raise ValueError(f"{scale_key}: block scales beside a {str(weight.dtype).removeprefix('torch.')} "
                             f"weight; scales belong to float8_e4m3fn weights")
        return None
    expected = block_scales_shape(weight.shape, parts)
    if scales is None:
        raise ValueError(f"{key}: a float8_e4m3fn weight needs its block scales {scale_key} (float32 "
                         f"{list(expected)}, one per 128x128 block); not found")
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected:
        raise ValueError(f"{scale_key}: expected float32 {list(expected)} (one scale per 128x128 block of "
                         f"{key} {list(weight.shape)}), got {scales.dtype} {list(scales.shape)}")
    check_finite_scales(scales, scale_key)
    return scales


def check_finite_scales(scales: torch.Tensor, scale_key: str) -> None:
    """Raise ValueError naming ``scale_key`` (a weight's key + ``SCALE_SUFFIX``) where its block scales hold
    NaN or infinite values, which would dequantise to NaN or infinite weights. A host read (loading only)."""
    bad = ~torch.isfinite(scales)
    if bad.any():
        raise ValueError(f"{scale_key}: {int(bad.sum())} of {scales.numel()} block scales are NaN or "
                         f"infinite (the first at index {bad.nonzero()[0].tolist()}); "
                         f"{scale_key.removesuffix(SCALE_SUFFIX)} would load as NaN or infinite weights")


def copy_checkpoint_weight_(out: torch.Tensor, tensors: Mapping[str, torch.Tensor], key: str, parts: int = 1,
                            index: int | slice | EllipsisType = ...) -> torch.Tensor:
    """Copy ``tensors[key][index]`` into ``out`` as the checkpoint means it; returns ``out``.

    ``out`` has the selected weight's shape, in any dtype, on any device, with any strides (a transposed view
    takes a weight stored transposed). An FP8 weight's value is its e4m3 values times its block scales
    (`checkpoint_scales`) in float32, as the format defines it (DeepSeek-V3: ``weight.float() *
    weight_scale_inv`` per block), rounded to ``out``'s dtype; any other weight is copied as stored.
    ``index`` selects along the first dimension first (e.g. one expert of ``[E, N, K]``).

    FP8 weights are dequantised chunk by chunk (`DEQUANTISE_CHUNK_BYTES`), each chunk copied into ``out``
    before the next is made: no fp32 temporary of the whole weight (a DeepSeek-V3 expert's gate_up is
    117 MB in fp32), and the same bits as dequantising it at once, since every value is its e4m3 value
    times its own block's scale either way. Raises as `checkpoint_scales`."""
    scales = checkpoint_scales(tensors, key, parts)
    weight = tensors[key][index]
    if scales is None:
        return out.copy_(weight)
    scales = scales[index]
    rows, blocks = weight.shape[-2] // parts, scales.shape[-2] // parts
    for p in range(parts):  # stacked projections, each with blocks of its own (`block_scales_shape`)
        part_rows, part_blocks = slice(p * rows, (p + 1) * rows), slice(p * blocks, (p + 1) * blocks)
        _dequantise_into(out[..., part_rows, :], weight[..., part_rows, :], scales[..., part_blocks, :])
    return out


def _dequantise_into(out_nk: torch.Tensor, q_nk: torch.Tensor, scales_nk: torch.Tensor) -> None:
    """``out = q * scale`` per 128x128 block for ``q [..., N, K]``, in chunks of whole blocks (full-width
    row bands where 128 rows fit in `DEQUANTISE_CHUNK_BYTES`, else column bands too) of at most that many
    bytes of fp32 values, or one block where a block is more."""
    if q_nk.dim() > 2:
        for out, q, scales in zip(out_nk, q_nk, scales_nk, strict=True):
            _dequantise_into(out, q, scales)
        return
    n, k = q_nk.shape
    budget = DEQUANTISE_CHUNK_BYTES // torch.float32.itemsize  # fp32 values
    cols = k if BLOCK * k <= budget else max(BLOCK, budget // BLOCK // BLOCK * BLOCK)
    rows = max(BLOCK, budget // cols // BLOCK * BLOCK)
    for r in range(0, n, rows):  # r, c, rows and cols (unless cols == k) are multiples of BLOCK
        for c in range(0, k, cols):
            scales = scales_nk[r // BLOCK:-(-(r + rows) // BLOCK), c // BLOCK:-(-(c + cols) // BLOCK)]
            chunk = dequantise_blocks(q_nk[r:r + rows, c:c + cols], scales, torch.float32)
            out_nk[r:r + rows, c:c + cols].copy_(chunk)
