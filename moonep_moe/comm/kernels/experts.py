"""Triton kernels that move expert weights and gradients between ranks through per-rank pointer tables:
`copy_experts` (prefetch: home experts into this rank's slots), `add_replicas` (reduce_grad: every
replica's gradient into its home expert's, in a fixed order) and `clear_slots`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep_moe.base.interpreter import launching
from moonep_moe.base.sizes import cdiv, next_power_of_2
from moonep_moe.comm.kernels import common
from moonep_moe.comm.kernels.common import TL_DTYPES, as_int64, both, narrow, peer, widen
from moonep_moe.transport.world import SymmetricTensor

SLOT_BLOCK_BYTES = 8192
"""Bytes one program moves per access in the slot kernels."""

PROGRAMS_PER_SM = 8
"""Programs per SM of the slot kernels' grid-stride loops (8 KB loads in flight each: enough to keep the
H200's DRAM busy)."""


def _slot_launch(numel: int, itemsize: int, items: int, device: torch.device) -> tuple[int, int, int, int]:
    """(programs, elements per access, accesses per item, warps) of a grid-stride loop over `items` items of
    `numel` elements each, only some of them used (which: read on the device).

    The grid is sized for the device, not for every item: one program per (item, access) would launch a
    program for each access of every unused item too (a DeepSeek-V3 rank's gate_up slot is 7168 accesses of
    8 KB, the rank has 32 slots and a plan fills one or two of them), and those programs, each exiting at
    once, cost more than the copy they surround."""
    block = min(next_power_of_2(numel), SLOT_BLOCK_BYTES // itemsize)
    chunks = cdiv(numel, block)
    programs = common.device_programs(items * chunks, device, PROGRAMS_PER_SM)
    return programs, block, chunks, max(1, min(8, block * itemsize // 1024))


@triton.jit
def _first_chunk(item, chunks):
    """The first of `item`'s accesses this program makes: the accesses of all items, counted item after
    item, are dealt to the programs in turn (access a to program a % programs), so the used items' accesses
    spread over every program whichever items are used."""
    programs = tl.num_programs(0)
    dealt = (as_int64(item) * chunks) % programs
    return (tl.program_id(0) - dealt + programs) % programs


@triton.jit
def _copy_experts_kernel(slots_ptr, experts_ptr, home_table, home_like, numel, num_slots, experts_per_rank,
                         chunks, BLOCK: tl.constexpr):
    for slot in range(num_slots):
        expert = tl.load(experts_ptr + slot)
        if expert >= 0:  # an unused slot is not written: its group is empty, nothing reads it
            source = peer(home_table, expert // experts_per_rank, home_like) + (expert % experts_per_rank).to(
                tl.int64) * numel
            target = slots_ptr + as_int64(slot) * numel
            for chunk in tl.range(_first_chunk(slot, chunks), chunks, tl.num_programs(0)):
                offs = as_int64(chunk) * BLOCK + tl.arange(0, BLOCK)
                inside = offs < numel
                tl.store(target + offs, tl.load(source + offs, mask=inside), mask=inside)


def copy_experts(home: SymmetricTensor, slots_b: torch.Tensor, experts_b: torch.Tensor) -> None:
    """`slots_b[j] = home expert experts_b[j]` from its home rank (expert e lives on rank e // epn at
    index e % epn of `home`); a slot whose `experts_b[j]` is -1 is not written, so the launch moves the used
    slots' bytes only, spread over the whole grid (peer reads; the caller barriers).

    Args:
        home: symmetric `[epn, *row]` home experts. slots_b: `[B, *row]` contiguous, same dtype.
        experts_b: `[B]` int32 global expert per slot, -1 = unused.
    """
    num_slots = slots_b.shape[0]
    numel = slots_b[0].numel() if num_slots else 0
    if num_slots == 0 or numel == 0:
        return
    programs, block, chunks, warps = _slot_launch(numel, slots_b.element_size(), num_slots, slots_b.device)
    with launching():
        _copy_experts_kernel[(programs,)](
            slots_b, experts_b, common.pointer_table(home), home.local, numel, num_slots, home.local.shape[0],
            chunks, BLOCK=block, num_warps=warps)


@triton.jit
def _clear_slots_kernel(slots_ptr, experts_ptr, numel, num_slots, chunks, BLOCK: tl.constexpr):
    zeros = tl.zeros([BLOCK], dtype=slots_ptr.dtype.element_ty)
    for slot in range(num_slots):
        if tl.load(experts_ptr + slot) >= 0:  # an unused slot holds nothing to clear
            target = slots_ptr + as_int64(slot) * numel
            for chunk in tl.range(_first_chunk(slot, chunks), chunks, tl.num_programs(0)):
                offs = as_int64(chunk) * BLOCK + tl.arange(0, BLOCK)
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
    programs, block, chunks, warps = _slot_launch(numel, slots_b.element_size(), num_slots, slots_b.device)
    with launching():
        _clear_slots_kernel[(programs,)](slots_b, experts_b, numel, num_slots, chunks, BLOCK=block,
                                         num_warps=warps)


@triton.jit
def _add_replicas_kernel(home_ptr, sources_ptr, slots_table, slots_like, numel, num_home, num_slots, chunks,
                         ACC: tl.constexpr, MAX_REPLICAS: tl.constexpr, BLOCK: tl.constexpr):
    HOME: tl.constexpr = home_ptr.dtype.element_ty
    for expert in range(num_home):
        if tl.load(sources_ptr + expert * MAX_REPLICAS) >= 0:  # no replica: no read, no write
            target = home_ptr + as_int64(expert) * numel
            for chunk in tl.range(_first_chunk(expert, chunks), chunks, tl.num_programs(0)):
                offs = as_int64(chunk) * BLOCK + tl.arange(0, BLOCK)
                inside = offs < numel
                total = widen(tl.load(target + offs, mask=inside), ACC)
                for j in tl.static_range(MAX_REPLICAS):
                    source = tl.load(sources_ptr + expert * MAX_REPLICAS + j)
                    has = source >= 0
                    source = tl.maximum(source, 0)
                    replica = peer(slots_table, source // num_slots, slots_like) + (source % num_slots).to(
                        tl.int64) * numel
                    # the reference's exchange of one slot index: `home += replica.to(home dtype)` for every
                    # rank holding the expert in that slot, summed in ACC and rounded to the home dtype once
                    x = narrow(widen(tl.load(replica + offs, mask=both(inside, has), other=0.0), ACC), HOME)
                    total += widen(x, ACC)
                    if j + 1 < MAX_REPLICAS:
                        following = tl.load(sources_ptr + expert * MAX_REPLICAS + j + 1)
                        last_of_slot = (following < 0) | (following % num_slots != source % num_slots)
                        total = tl.where(last_of_slot, widen(narrow(total, HOME), ACC), total)
                tl.store(target + offs, narrow(total, HOME), mask=inside)


def add_replicas(home_x: torch.Tensor, slots: SymmetricTensor, sources_xr: torch.Tensor) -> None:
    """`home_x[x] += slots(rank)[slot]` for each `sources_xr[x, i] = rank * B + slot` (-1: none), in i
    order (peer reads; the caller barriers); experts without replicas are not touched. Like the
    reference's one `index_add_` per slot index: each replica is rounded to the home dtype, and the sum to it
    once per slot index (sources are sorted by slot); with fp32 home gradients that is a plain fp32 sum.

    Args:
        home_x: `[epn, *row]` contiguous home gradients. slots: symmetric `[B, *row]` slot gradients.
        sources_xr: `[epn, R]` int32 replica sources of each home expert, in the order they are added.
    """
    num_home, max_replicas = sources_xr.shape
    numel = home_x[0].numel() if num_home else 0
    if num_home == 0 or numel == 0 or slots.local.shape[0] == 0:
        return
    programs, block, chunks, warps = _slot_launch(numel, home_x.element_size(), num_home, home_x.device)
    accumulate = torch.promote_types(torch.promote_types(home_x.dtype, slots.local.dtype), torch.float32)
    with launching():
        _add_replicas_kernel[(programs,)](
            home_x, sources_xr, common.pointer_table(slots), slots.local, numel, num_home,
            slots.local.shape[0], chunks, ACC=TL_DTYPES[accumulate], MAX_REPLICAS=max_replicas, BLOCK=block,
            num_warps=warps)
