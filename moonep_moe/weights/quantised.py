"""FP8 expert weights as they are stored and moved: e4m3 values with one fp32 scale per 128x128 block (the
DeepSeek-V3 recipe and checkpoint format: `weight` e4m3 + `weight_scale_inv`), so `weight ~= q * scale` per
block. The activation cast and the FP8 GEMMs are `moonep_moe.layers.fp8`; this module holds what the comm
core needs to move such weights (the format's constants, the scales' shape, byte views), the reference
weight cast (`quantise_blocks`), what loading a checkpoint of that format needs (`checkpoint_weight`: the
weights dequantised with their scales) and what a grouped GEMM takes of experts kept FP8 (`Fp8Weights`).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import EllipsisType

import torch
import torch.nn.functional as F

from moonep_moe.comm.world import SymmetricTensor
from moonep_moe.weights.pool import ExpertRows

FP8_DTYPE = torch.float8_e4m3fn
"""The FP8 format of expert weights and activations (e4m3: 3 mantissa bits, largest finite 448)."""
BLOCK = 128
"""Weights: one scale per ``BLOCK x BLOCK`` block; activations: one per row per ``BLOCK`` columns."""
SCALE_SUFFIX = "_scale_inv"
"""A checkpoint's FP8 weight ``key`` keeps its fp32 block scales under ``key + SCALE_SUFFIX``."""
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

@dataclass(frozen=True)
class Fp8Weights:
    """Grouped FP8 weights as stored, for a grouped GEMM (`layers.fp8`): ``q`` parts ``[g_i, N, K]`` e4m3
    whose groups concatenate to G (e.g. home experts, then prefetch slots) and ``scales`` parts
    ``[g_i, ceil(N/128), ceil(K/128)]`` fp32, split alike; ``weight ~= q * scale`` per 128x128 block."""

    q: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]

    def joined(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [G, N, K], scales [G, ceil(N/128), ceil(K/128)])``, each one contiguous tensor: the part
        itself where there is one, else a copy of the parts (FP8 bytes and fp32 scales, no wider copy)."""
        def join(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
            if len(parts) == 1:
                return parts[0]
            return torch.cat([as_bytes(part) for part in parts]).view(parts[0].dtype)

        return join(self.q), join(self.scales)



def rows_as_bytes(rows: ExpertRows) -> ExpertRows:
    """`ExpertRows` whose home (every peer's) and slots are `as_bytes` views of `rows`' (the same memory)."""

    def view(tensor: SymmetricTensor) -> SymmetricTensor:
        return replace(tensor, peers=tuple(None if p is None else as_bytes(p) for p in tensor.peers))

    compute = None if rows.compute is None else as_bytes(rows.compute)
    return ExpertRows(view(rows.home), view(rows.slots), compute)
