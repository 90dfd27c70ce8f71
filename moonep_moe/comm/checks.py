"""Argument checks of the comm core: one-line errors naming the rank and the argument as the caller called
it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import torch

from moonep_moe.plan.types import MoonEPCommPlan
from moonep_moe.transport.world import SymmetricTensor
from moonep_moe.weights.pool import ExpertRows


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `value`: tensors, tuples/lists of them, and a plan's tensor fields."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, MoonEPCommPlan):
        for field in fields(value):
            yield from _tensors(getattr(value, field.name))
    elif isinstance(value, ExpertRows):
        yield from _tensors((value.home.local, value.slots.local))
    elif isinstance(value, SymmetricTensor):
        yield value.local


def check_tensor(tensor: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype | tuple,
           device: torch.device, rank: int) -> None:
    """Raise a ValueError naming `rank` and `name` unless `tensor` has this shape (None = any size), dtype
    and device."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"rank {rank}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if tensor.dtype not in dtypes:
        raise ValueError(f"rank {rank}: {name} must have dtype {' or '.join(map(str, dtypes))}, "
                         f"got {tensor.dtype}")
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape,
                                                                                  strict=True)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"rank {rank}: {name} must have shape {expected}, got {list(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"rank {rank}: {name} must be on {device}, got {tensor.device}")


def row_fingerprints(rows_c: torch.Tensor) -> torch.Tensor:
    """`[c, *row]` -> `[c, 2]` int64: per row the sum of its elements' bit patterns and their sum weighted by
    position (wrapping integer sums: exact and independent of the summation order, so two ranks holding
    the same row get the same fingerprint bit for bit, and a zero or permuted row gets another)."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[rows_c.element_size()]
    values_cm = rows_c.flatten(1).view(bits).long()
    position_m = torch.arange(1, values_cm.shape[1] + 1, device=rows_c.device)
    return torch.stack([values_cm.sum(1), (values_cm * position_m).sum(1)], 1)
