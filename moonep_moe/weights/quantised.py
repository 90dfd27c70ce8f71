"""FP8 expert weights as they are stored and moved: e4m3 values with one fp32 scale per 128x128 block (the
DeepSeek-V3 recipe and checkpoint format: `weight` e4m3 + `weight_scale_inv`), so `weight ~= q * scale` per
block. The quantisers and the FP8 GEMMs are `moonep_moe.layers.fp8`; this module holds what the comm core
needs to move such weights: the format's constants, the scales' shape, and byte views.

Moving FP8 weights is moving bytes: prefetch copies an expert's e4m3 bytes and its block scales unchanged
(half the bytes of bf16, plus 4 bytes per 128x128 block), so the copy equals quantising the moved bf16
weights, block by block. torch has no CPU kernels for most ops on float8 tensors (`index_copy_`,
`masked_fill_`), and gloo no float8 collectives: the exchanges move them as `uint8` views (`as_bytes`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moonep_moe.comm.world import SymmetricTensor
from moonep_moe.weights.pool import ExpertRows

FP8_DTYPE = torch.float8_e4m3fn
"""The FP8 format of expert weights and activations (e4m3: 3 mantissa bits, largest finite 448)."""
BLOCK = 128
"""Weights: one scale per ``BLOCK x BLOCK`` block; activations: one per row per ``BLOCK`` columns."""


def block_scales_shape(weight_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The fp32 block scales' shape of FP8 weights ``[G, N, K]``: ``[G, ceil(N/128), ceil(K/128)]`` (tail
    blocks of ``N % 128`` rows or ``K % 128`` columns have their own scale)."""
    *groups, n, k = weight_shape
    return (*groups, -(-n // BLOCK), -(-k // BLOCK))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as a ``uint8`` view of the same memory (what the exchanges move); any other as is."""
    return tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor


def rows_as_bytes(rows: ExpertRows) -> ExpertRows:
    """`ExpertRows` whose home (every peer's) and slots are `as_bytes` views of `rows`' (the same memory)."""

    def view(tensor: SymmetricTensor) -> SymmetricTensor:
        return replace(tensor, peers=tuple(None if p is None else as_bytes(p) for p in tensor.peers))

    compute = None if rows.compute is None else as_bytes(rows.compute)
    return ExpertRows(view(rows.home), view(rows.slots), compute)
