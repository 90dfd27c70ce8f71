"""Expert rows of one projection, and the process-global prefetch-slot pools.

The logical row space of a projection is `[E+B, out, in]` (one expert's matrix in nn.Linear layout: `[2F, H]`
for gate_up, `[H, F]` for down): rows [0, E) the group's experts, rows [E, E+B) this rank's prefetch slots.
Physically (`ExpertRows`) a rank holds only its `epn` home experts (peers read them through the EP world) and
B slots. Slots are shared by every layer of the same shape on this rank: `slot_pool` hands out one
`[B, out, in]` tensor per (shape, dtype), and `slot_grad_pool` one fp32 gradient tensor, which peers pull in
`Buffer.reduce_grad` where the home gradients are fp32 (`main_grad`; otherwise the replicas' gradients
overwrite the slot weights themselves: `HomeExperts.grads_in_slots`). Neither is a parameter: optimizers,
data-parallel grad reduction and checkpoints never see them. Because later layers overwrite the pool, backward
prefetches again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moonep_moe.transport.arena import PhysicalRows, expert_arena_reason, joined_rows
from moonep_moe.transport.world import EPWorld, SymmetricTensor


@dataclass(frozen=True)
class ExpertRows:
    """One projection: `home [epn, out, in]` (this rank's experts, symmetric) and `slots [B, out, in]`;
    `compute` is both as one `[epn + B, out, in]` tensor without a copy (`transport.arena`), or None where
    unavailable."""

    home: SymmetricTensor
    slots: SymmetricTensor
    compute: torch.Tensor | None = None

    def compute_weights(self, joined: bool = True) -> tuple[torch.Tensor, ...]:
        """The weights of this rank's compute groups (home experts, then slots) for a grouped GEMM: one
        tensor when the arena joins them (`joined`) or there are no slots (B = 0, e.g. EP = 1), else the two
        parts (the GEMM backend then copies them, unless it wants them apart:
        `GroupedGemm.joined_weights`)."""
        if joined and self.compute is not None:
            return (self.compute,)
        return tuple(t for t in (self.home.local, self.slots.local) if t.shape[0])


def _arena_reason(world: EPWorld, region_bytes: list[int]) -> str | None:
    """Why this world's weight pools cannot use the arena, or None when they can. A world that moves the
    tensors it registers into memory of its own (`moves_registered_tensors`, e.g. symmetric memory) would
    leave the arena's joined view pointing at the old memory."""
    if getattr(world, "moves_registered_tensors", False):
        return f"{type(world).__name__} moves registered tensors into its own memory"
    return expert_arena_reason(world.device, region_bytes)


def _pool(world: EPWorld, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricTensor:
    key = (kind, shape, dtype)
    if key not in world.globals:
        name = f"pool/{kind}/{'x'.join(map(str, shape))}/{dtype}".replace("torch.", "")
        device = world.device
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        if kind == "slots" and shape[0] and _arena_reason(world, [_nbytes(shape, dtype)]) is None:
            physical = PhysicalRows(shape[0], shape[1:], dtype, device)  # the arena maps it after home rows
            world.globals[("slots_physical", shape, dtype)] = physical
            tensor = physical.tensor.zero_()
        world.globals[key] = world.symmetric(name, tensor)
    return world.globals[key]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def allocate_home(world: EPWorld, num_home: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                  num_slots: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's home experts `[epn, *row_shape]` (uninitialised) and, where the arena can join them with the
    slot pool of that shape, the `[epn + B, *row_shape]` compute view over both (else None)."""
    slots_shape = (num_slots, *row_shape)
    slot_pool(world, slots_shape, dtype)
    physical = world.globals.get(("slots_physical", slots_shape, dtype))
    home_shape = (num_home, *row_shape)
    if physical is None or _arena_reason(world, [_nbytes(home_shape, dtype)]) is not None:
        return torch.empty(home_shape, dtype=dtype, device=world.device), None
    home = PhysicalRows(num_home, row_shape, dtype, world.device)
    return home.tensor, joined_rows(home, physical)


def slot_pool(world: EPWorld, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricTensor:
    """This rank's `[B, out, in]` slot weights shared by every layer with that shape and dtype (collective on
    first use: every rank must build its layers in the same order)."""
    return _pool(world, "slots", tuple(shape), dtype)


def slot_scale_pool(world: EPWorld, shape: tuple[int, ...]) -> SymmetricTensor:
    """This rank's fp32 `[B, ceil(out/128), ceil(in/128)]` block scales of FP8 slot weights
    (`fp8.format`), shared like `slot_pool`; a pool of its own, never an fp32 weight pool."""
    return _pool(world, "slot_scales", tuple(shape), torch.float32)


def slot_grad_pool(world: EPWorld, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricTensor:
    """This rank's fp32 (float64 for float64 weights) `[B, out, in]` slot gradients, zero between steps."""
    return _pool(world, "slot_grads", tuple(shape), torch.promote_types(dtype, torch.float32))
