"""Expert rows of one projection, and the process-global prefetch-slot pools.

The logical row space of a projection is `[E+B, N, K]`: rows [0, E) the group's experts, rows [E, E+B)
this rank's prefetch slots. Physically (`ExpertRows`) a rank holds only its `epn` home experts (peers read
them through the EP world) and B slots. Slots are shared by every layer of the same shape on this rank:
`slot_pool` hands out one `[B, N, K]` tensor per (shape, dtype), and `slot_grad_pool` one fp32 gradient
tensor, which peers pull in `Buffer.reduce_grad`. Neither is a parameter: optimizers, data-parallel grad
reduction and checkpoints never see them. Because later layers overwrite the pool, backward prefetches again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonep_moe.comm.world import EPWorld, SymmetricTensor


@dataclass(frozen=True)
class ExpertRows:
    """One projection: `home [epn, N, K]` (this rank's experts, symmetric) and `slots [B, N, K]`."""

    home: SymmetricTensor
    slots: SymmetricTensor


def _pool(world: EPWorld, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricTensor:
    key = (kind, shape, dtype)
    if key not in world.globals:
        name = f"pool/{kind}/{'x'.join(map(str, shape))}/{dtype}".replace("torch.", "")
        world.globals[key] = world.symmetric(name, torch.zeros(shape, dtype=dtype, device=world.device))
    return world.globals[key]


def slot_pool(world: EPWorld, shape_bnk: tuple[int, ...], dtype: torch.dtype) -> SymmetricTensor:
    """This rank's `[B, N, K]` slot weights shared by every layer with that shape and dtype (collective on
    first use: every rank must build its layers in the same order)."""
    return _pool(world, "slots", tuple(shape_bnk), dtype)


def slot_grad_pool(world: EPWorld, shape_bnk: tuple[int, ...], dtype: torch.dtype) -> SymmetricTensor:
    """This rank's fp32 (float64 for float64 weights) `[B, N, K]` slot gradients, zero between steps."""
    return _pool(world, "slot_grads", tuple(shape_bnk), torch.promote_types(dtype, torch.float32))
