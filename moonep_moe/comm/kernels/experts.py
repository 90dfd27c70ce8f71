"""Triton kernels that move expert weights and gradients between ranks through per-rank pointer tables:
`copy_experts` (prefetch: home experts into this rank's slots), `add_replicas` (reduce_grad: every
replica's gradient into its home expert's, in a fixed order) and `clear_slots`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep_moe.base.interpreter import launching
from moonep_moe.comm.kernels import common
from moonep_moe.comm.kernels.common import TL_DTYPES, both, narrow, peer, widen
from moonep_moe.transport.world import SymmetricTensor


def _flat_block(numel: int, itemsize: int) -> tuple[int, int, int]:
    """(elements per access, accesses per program, warps) to copy rows of `numel` elements."""
    block = min(triton.next_power_of_2(numel), 4096 // itemsize)
    return block, min(8, triton.cdiv(numel, block)), max(1, min(8, block * itemsize // 512))


@triton.jit
def _copy_experts_kernel(slots_ptr, experts_ptr, home_table, home_like, numel, experts_per_rank,
                         BLOCK: tl.constexpr, ITERATIONS: tl.constexpr):
    chunk = tl.program_id(0)
    slot = tl.program_id(1)
    expert = tl.load(experts_ptr + slot)
    if expert < 0:
        return  # an unused slot is not written: its group is empty, nothing reads it
    source = peer(home_table, expert // experts_per_rank, home_like) + (expert % experts_per_rank).to(
        tl.int64) * numel
    target = slots_ptr + slot.to(tl.int64) * numel
    for i in tl.range(ITERATIONS):
        offs = (chunk * ITERATIONS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        tl.store(target + offs, tl.load(source + offs, mask=inside), mask=inside)


def copy_experts(home: SymmetricTensor, slots_b: torch.Tensor, experts_b: torch.Tensor) -> None:
    """`slots_b[j] = home expert experts_b[j]` from its home rank (expert e lives on rank e // epn at
    index e % epn of `home`); a slot whose `experts_b[j]` is -1 is not written (its programs exit at once),
    so the launch moves the used slots' bytes only (peer reads; the caller barriers).

    Args:
        home: symmetric `[epn, *row]` home experts. slots_b: `[B, *row]` contiguous, same dtype.
        experts_b: `[B]` int32 global expert per slot, -1 = unused.
    """
    num_slots = slots_b.shape[0]
    numel = slots_b[0].numel() if num_slots else 0
    if num_slots == 0 or numel == 0:
        return
    block, iterations, warps = _flat_block(numel, slots_b.element_size())
    with launching():
        _copy_experts_kernel[(triton.cdiv(numel, block * iterations), num_slots)](
            slots_b, experts_b, common.pointer_table(home), home.local, numel, home.local.shape[0],
            BLOCK=block, ITERATIONS=iterations, num_warps=warps)


@triton.jit
def _clear_slots_kernel(slots_ptr, experts_ptr, numel, BLOCK: tl.constexpr, ITERATIONS: tl.constexpr):
    chunk = tl.program_id(0)
    slot = tl.program_id(1)
    if tl.load(experts_ptr + slot) < 0:
        return  # an unused slot holds nothing to clear
    target = slots_ptr + slot.to(tl.int64) * numel
    zeros = tl.zeros([BLOCK], dtype=slots_ptr.dtype.element_ty)
    for i in tl.range(ITERATIONS):
        offs = (chunk * ITERATIONS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(target + offs, zeros, mask=offs < numel)


def clear_slots(slots_b: torch.Tensor, experts_b: torch.Tensor) -> None:
    """`slots_b[j] = 0` for every used slot (`experts_b[j] >= 0`), in one launch; unused slots are not
    touched (the reference's `masked_fill_` reads and writes every slot).

    Args:
        slots_b: `[B, *row]` contiguous slot gradients. experts_b: `[B]` int32 expert per slot, -1 = unused.
    """
    num_slots = slots_b.shape[0]
    numel = slots_b[0].numel() if num_slots else 0
    if num_slots == 0 or numel == 0:
        return
    block, iterations, warps = _flat_block(numel, slots_b.element_size())
    with launching():
        _clear_slots_kernel[(triton.cdiv(numel, block * iterations), num_slots)](
            slots_b, experts_b, numel, BLOCK=block, ITERATIONS=iterations, num_warps=warps)


@triton.jit
def _add_replicas_kernel(home_ptr, sources_ptr, slots_table, slots_like, numel, num_slots, ACC: tl.constexpr,
                         MAX_REPLICAS: tl.constexpr, BLOCK: tl.constexpr, ITERATIONS: tl.constexpr):
    chunk = tl.program_id(0)
    expert = tl.program_id(1)
    if tl.load(sources_ptr + expert * MAX_REPLICAS) < 0:
        return  # no replica: the home gradient stays as it is (no read, no write)
    HOME: tl.constexpr = home_ptr.dtype.element_ty
    target = home_ptr + expert.to(tl.int64) * numel
    for i in tl.range(ITERATIONS):
        offs = (chunk * ITERATIONS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        total = widen(tl.load(target + offs, mask=inside), ACC)
        for j in tl.static_range(MAX_REPLICAS):
            source = tl.load(sources_ptr + expert * MAX_REPLICAS + j)
            has = source >= 0
            source = tl.maximum(source, 0)
            replica = peer(slots_table, source // num_slots, slots_like) + (source % num_slots).to(
                tl.int64) * numel
            # the reference's exchange of one slot index: `home += replica.to(home dtype)` for every rank
            # holding the expert in that slot, summed in ACC and rounded to the home dtype once
            x = narrow(widen(tl.load(replica + offs, mask=both(inside, has), other=0.0), ACC), HOME)
            total += widen(x, ACC)
            if j + 1 < MAX_REPLICAS:
                following = tl.load(sources_ptr + expert * MAX_REPLICAS + j + 1)
                last_of_slot = (following < 0) | (following % num_slots != source % num_slots)
                total = tl.where(last_of_slot, widen(narrow(total, HOME), ACC), total)
        tl.store(target + offs, narrow(total, HOME), mask=inside)


def add_replicas(home_x: torch.Tensor, slots: SymmetricTensor, sources_xr: torch.Tensor) -> None:
    """`home_x[x] += slots(rank)[slot]` for each `sources_xr[x, i] = rank * B + slot` (-1: none), in i
    order (peer reads; the caller barriers); experts without replicas are not touched. Like the reference's
    one `index_add_` per slot index: each replica is rounded to the home dtype, and the sum to it once per
    slot index (sources are sorted by slot); with fp32 home gradients that is a plain fp32 sum.

    Args:
        home_x: `[epn, *row]` contiguous home gradients. slots: symmetric `[B, *row]` slot gradients.
        sources_xr: `[epn, R]` int32 replica sources of each home expert, in the order they are added.
    """
    num_home, max_replicas = sources_xr.shape
    numel = home_x[0].numel() if num_home else 0
    if num_home == 0 or numel == 0 or slots.local.shape[0] == 0:
        return
    block, iterations, warps = _flat_block(numel, home_x.element_size())
    accumulate = torch.promote_types(torch.promote_types(home_x.dtype, slots.local.dtype), torch.float32)
    with launching():
        _add_replicas_kernel[(triton.cdiv(numel, block * iterations), num_home)](
            home_x, sources_xr, common.pointer_table(slots), slots.local, numel, slots.local.shape[0],
            ACC=TL_DTYPES[accumulate], MAX_REPLICAS=max_replicas, BLOCK=block, ITERATIONS=iterations,
            num_warps=warps)
