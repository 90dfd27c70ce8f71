"""FP8 weights in checkpoints: the DeepSeek-V3 format (`weight` e4m3 + `weight_scale_inv`, one fp32 scale per
128x128 block) read back as dequantised weights (`checkpoint_weight`), with the scales' key
(`SCALE_SUFFIX`), layout and values (finite) checked."""

from __future__ import annotations

from collections.abc import Mapping
from types import EllipsisType

import torch

from moonep_moe.fp8.format import FP8_DTYPE, block_scales_shape, dequantise_blocks

SCALE_SUFFIX = "_scale_inv"
"""A checkpoint's FP8 weight ``key`` keeps its fp32 block scales under ``key + SCALE_SUFFIX``."""


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


def checkpoint_weight(tensors: Mapping[str, torch.Tensor], key: str, parts: int = 1,
                      index: int | slice | EllipsisType = ...) -> torch.Tensor:
    """``tensors[key][index]`` as the checkpoint means it: an FP8 weight times its block scales
    (`checkpoint_scales`) in float32, as the format defines it (DeepSeek-V3: ``weight.float() *
    weight_scale_inv`` per block); any other weight as stored. ``index`` selects along the first dimension
    before dequantising (e.g. one expert of ``[E, N, K]``). Raises as `checkpoint_scales`."""
    scales = checkpoint_scales(tensors, key, parts)
    weight = tensors[key][index]
    return weight if scales is None else dequantise_blocks(weight, scales[index], torch.float32, parts)
