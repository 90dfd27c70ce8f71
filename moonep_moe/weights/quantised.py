"""FP8 expert weights as they are stored and moved: e4m3 values with one fp32 scale per 128x128 block (the
DeepSeek-V3 recipe and checkpoint format: `weight` e4m3 + `weight_scale_inv`), so `weight ~= q * scale` per
block. The quantisers and the FP8 GEMMs are `moonep_moe.layers.fp8`; this module holds what the comm core
needs to move such weights (the format's constants, the scales' shape, byte views) and what loading a
checkpoint of that format needs (`checkpoint_weight`: the weights dequantised with their scales).

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

from collections.abc import Mapping
from dataclasses import replace
from types import EllipsisType

import torch

from moonep_moe.comm.world import SymmetricTensor
from moonep_moe.weights.pool import ExpertRows

FP8_DTYPE = torch.float8_e4m3fn
"""The FP8 format of expert weights and activations (e4m3: 3 mantissa bits, largest finite 448)."""
BLOCK = 128
"""Weights: one scale per ``BLOCK x BLOCK`` block; activations: one per row per ``BLOCK`` columns."""
SCALE_SUFFIX = "_scale_inv"
"""A checkpoint's FP8 weight ``key`` keeps its fp32 block scales under ``key + SCALE_SUFFIX``."""


def block_scales_shape(weight_shape: torch.Size | tuple[int, ...], parts: int = 1) -> tuple[int, ...]:
    """The fp32 block scales' shape of FP8 weights ``[G, N, K]``: ``[G, ceil(N/128), ceil(K/128)]`` (tail
    blocks of ``N % 128`` rows or ``K % 128`` columns have their own scale). ``parts``: the weights stack
    that many projections of ``N / parts`` rows, each with blocks and scales of its own, stacked the same
    way: ``[G, parts * ceil(N/parts/128), ceil(K/128)]``."""
    *groups, n, k = weight_shape
    return (*groups, parts * -(-n // (parts * BLOCK)), -(-k // BLOCK))


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


def checkpoint_scales(tensors: Mapping[str, torch.Tensor], key: str, parts: int = 1) -> torch.Tensor | None:
    """The block scales ``tensors[key + SCALE_SUFFIX]`` of the FP8 (e4m3) weight ``tensors[key]``, checked:
    float32 ``block_scales_shape(weight.shape, parts)``; None for a weight that is not FP8.

    Raises:
        ValueError naming the key: an FP8 weight without its scales, scales of another shape or dtype, or
        scales beside a weight that is not FP8.
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
    return scales


def checkpoint_weight(tensors: Mapping[str, torch.Tensor], key: str, parts: int = 1,
                      index: int | slice | EllipsisType = ...) -> torch.Tensor:
    """``tensors[key][index]`` as the checkpoint means it: an FP8 weight times its block scales
    (`checkpoint_scales`) in float32, as the format defines it (DeepSeek-V3: ``weight.float() *
    weight_scale_inv`` per block); any other weight as stored. ``index`` selects along the first dimension
    before dequantising (e.g. one expert of ``[E, N, K]``). Raises as `checkpoint_scales`."""
    scales = checkpoint_scales(tensors, key, parts)
    weight = tensors[key][index]
    return weight if scales is None else dequantise_blocks(weight, scales[index], torch.float32, parts)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as a ``uint8`` view of the same memory (what the exchanges move); any other as is."""
    return tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor


def rows_as_bytes(rows: ExpertRows) -> ExpertRows:
    """`ExpertRows` whose home (every peer's) and slots are `as_bytes` views of `rows`' (the same memory)."""

    def view(tensor: SymmetricTensor) -> SymmetricTensor:
        return replace(tensor, peers=tuple(None if p is None else as_bytes(p) for p in tensor.peers))

    compute = None if rows.compute is None else as_bytes(rows.compute)
    return ExpertRows(view(rows.home), view(rows.slots), compute)
