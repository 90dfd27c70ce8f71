"""Triton grouped GEMM over the groups from a given one on: ``out[start:end] = a[start:end] @ b[g - first]``
for every group ``g >= first`` of ``offs_g``, accumulated in fp32, written in ``out``'s dtype. The groups
before ``first`` are neither read nor written.

Why a kernel: the layer's first GEMM of forward (gate_up) and of backward (down's dgrad) starts on the home
experts while the replicas' weights are still arriving in the slots (`GroupedGemm`'s ``slots_ready``).
``torch._grouped_mm`` computes the home groups alone (``offs=offs_g[:epn]``: rows past the last given end are
ignored), but cannot start at a row known only on the device, where the slot groups begin. This kernel does,
with no host read.

Grid: persistent, a fixed number of programs (a few per SM) looping over the tiles of the rows from the first
group's start to the last group's end, ``BLOCK_M`` rows by ``BLOCK_N`` columns each, column tiles of one row
block next to each other so the programs running at once share the rows in L2. Groups need no alignment: a
row block lying across group ends is computed once per group it meets, each row stored by its own group's
pass. A program past the last tile exits at once, so an empty slot range (no replica) costs one launch.

Aligned groups (every group end from the first computed group's start on a multiple of `ALIGNED_BLOCK_M`
rows, as the layer's segments are with ``token_padding`` a multiple of 128, DeepGEMM's requirement) take a
second kernel, `_groups_from_aligned_kernel`: each row block lies in one group, so a tile is one plain
product, its operands loaded and its output stored by the Hopper's tensor memory accelerator (host-made
tensor descriptors of ``a``, the weights and ``out``; out-of-bounds rows and columns read as zeros and are
not stored) instead of masked pointer loads, and the group of a tile is one comparison over the ends. The
caller says the alignment (``row_alignment``): the kernel cannot check it without a host read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moonep_moe.base.interpreter import INTERPRETED, launching
from moonep_moe.base.sizes import next_power_of_2

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PROGRAMS_PER_SM = 2


def tiles() -> dict:
    """Launch shape. The interpreter gets small tiles so CPU tests cover several blocks and masked tails."""
    if INTERPRETED:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}


ALIGNED_BLOCK_M = 128
"""Row block of the aligned kernel: groups whose ends are multiples of it take that kernel."""


def aligned_tiles() -> dict:
    """Launch shape of the aligned kernel (`ALIGNED_BLOCK_M` rows; the interpreter gets narrow columns)."""
    if INTERPRETED:
        return {"BLOCK_M": ALIGNED_BLOCK_M, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": ALIGNED_BLOCK_M, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


@triton.jit
def _tiles_from(offs_ptr, first, groups, n, GROUPS_POW2: tl.constexpr, INTERPRET_TILES: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Both kernels' tiling of the rows from group ``first``'s start to the last end: ``(group_ids, ends,
    start, end, blocks_n, tiles_bound)``, ``ends [GROUPS_POW2]`` (past the groups: int32's max),
    ``tiles_bound`` the bound of the persistent tile loop."""
    group_ids = tl.arange(0, GROUPS_POW2)
    ends = tl.load(offs_ptr + group_ids, mask=group_ids < groups, other=2147483647)
    # ends of the earlier groups picked from the vector, not loaded under a mask (the interpreter takes no
    # scalar masks)
    start = tl.max(tl.where(group_ids < first, ends, 0), axis=0)
    end = tl.max(tl.where(group_ids < groups, ends, 0), axis=0)
    blocks_n = tl.cdiv(n, BLOCK_N)
    num_tiles = tl.cdiv(tl.maximum(end - start, 0), BLOCK_M) * blocks_n
    # INTERPRET_TILES is 0 when compiled. Triton's interpreter (3.6) cannot loop to a device value: there it
    # bounds the tiles on the host, and a tile past num_tiles has no live row (it starts at or past `end`)
    return group_ids, ends, start, end, blocks_n, INTERPRET_TILES if INTERPRET_TILES else num_tiles


@triton.jit
def _groups_from_kernel(a_ptr, b_ptr, offs_ptr, out_ptr, first, groups, n, k,
                        stride_am, stride_bg, stride_bk, stride_bn, stride_om,
                        GROUPS_POW2: tl.constexpr, INTERPRET_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    group_ids, ends, start, end, blocks_n, tiles_bound = _tiles_from(offs_ptr, first, groups, n, GROUPS_POW2,
                                                                      INTERPRET_TILES, BLOCK_M, BLOCK_N)
    for tile in range(tl.program_id(0), tiles_bound, tl.num_programs(0)):
        first_row = start + (tile // blocks_n) * BLOCK_M
        cols = (tile % blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        live_cols = cols < n  # a tile past num_tiles (the interpreter's) has no live row: first_row >= end
        rows = first_row + tl.arange(0, BLOCK_M)
        last_row = tl.minimum(first_row + BLOCK_M, end) - 1
        group_lo = tl.sum((ends <= first_row).to(tl.int32), axis=0)
        group_hi = tl.sum((ends <= last_row).to(tl.int32), axis=0)
        # the interpreter visits every group, those outside [group_lo, group_hi] masked out
        for group in range(0 if INTERPRET_TILES else group_lo,
                           GROUPS_POW2 if INTERPRET_TILES else tl.minimum(group_hi, groups - 1) + 1):
            meets = (group >= group_lo) & (group <= group_hi)  # group_hi < groups: last_row < the last end
            group_start = tl.max(tl.where(group_ids < group, ends, 0), axis=0)
            group_end = tl.where(meets, tl.sum(tl.where(group_ids == group, ends, 0), axis=0), 0)
            live_rows = (rows >= group_start) & (rows < group_end)
            a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
            # a group the block does not meet (the interpreter's) reads a valid weight, stores no row
            weight = tl.minimum(tl.maximum(group - first, 0), groups - first - 1)
            b_group = b_ptr + weight.to(tl.int64) * stride_bg + cols.to(tl.int64)[None, :] * stride_bn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(0, tl.cdiv(k, BLOCK_K)):
                inner = step * BLOCK_K + tl.arange(0, BLOCK_K)
                live_k = inner < k
                a = tl.load(a_rows + inner[None, :], mask=live_rows[:, None] & live_k[None, :], other=0.0)
                b = tl.load(b_group + inner.to(tl.int64)[:, None] * stride_bk,
                            mask=live_k[:, None] & live_cols[None, :], other=0.0)
                if INTERPRET_TILES:  # the interpreter's numpy cannot multiply bf16: widened (exact)
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b, acc)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=live_rows[:, None] & live_cols[None, :])


@triton.jit
def _groups_from_aligned_kernel(a_desc, b_desc, out_desc, offs_ptr, first, groups, n, k,
                                B_NK: tl.constexpr, GROUPS_POW2: tl.constexpr, INTERPRET_TILES: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_groups_from_kernel`'s product where every row block lies in one group (`ALIGNED_BLOCK_M`), through
    tensor descriptors: ``a_desc`` over ``a [rows, k]``, ``b_desc`` over the weights ``[G - first, n, k]``
    (``B_NK``: a forward's ``w`` as stored) or ``[G - first, k, n]``, ``out_desc`` over ``out [rows, n]``."""
    _, ends, start, end, blocks_n, tiles_bound = _tiles_from(offs_ptr, first, groups, n, GROUPS_POW2,
                                                             INTERPRET_TILES, BLOCK_M, BLOCK_N)
    for tile in range(tl.program_id(0), tiles_bound, tl.num_programs(0)):
        first_row = start + (tile // blocks_n) * BLOCK_M
        first_col = (tile % blocks_n) * BLOCK_N
        # the group holding the block: the ends at or before its first row are the earlier groups'
        weight = tl.minimum(tl.sum((ends <= first_row).to(tl.int32), axis=0), groups - 1) - first
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, tl.cdiv(k, BLOCK_K)):
            a = a_desc.load([first_row, step * BLOCK_K])
            if B_NK:
                b = tl.trans(b_desc.load([weight, first_col, step * BLOCK_K]).reshape(BLOCK_N, BLOCK_K))
            else:
                b = b_desc.load([weight, step * BLOCK_K, first_col]).reshape(BLOCK_K, BLOCK_N)
            if INTERPRET_TILES:  # the interpreter's numpy cannot multiply bf16: widened (exact)
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if first_row < end:
            out_desc.store([first_row, first_col], acc.to(out_desc.dtype))


def groups_from_gemm(a_mk: torch.Tensor, b_gkn: torch.Tensor, offs_g: torch.Tensor, first: int,
                     out_mn: torch.Tensor, launch: dict | None = None, row_alignment: int = 1) -> None:
    """``out[start:end] = a[start:end] @ b[g - first]`` for every group ``g >= first``; other rows untouched.

    Args:
        a_mk: ``[rows, k]`` bf16/fp16, contiguous rows.
        b_gkn: ``[G - first, k, n]`` of a's dtype, any strides (a forward's ``w.transpose(-2, -1)`` of
            ``w [G - first, n, k]``, or a dgrad's ``w`` itself).
        offs_g: int32 ``[G]`` group ends on the device (no host read); groups need no alignment.
        first: the first group computed; the rows before its start are not read or written.
        out_mn: ``[rows, n]`` (bf16, fp16 or fp32) with contiguous rows.
        launch: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` instead of `tiles` or
            `aligned_tiles` (a bench's sweep).
        row_alignment: every group end from group ``first - 1`` on is a multiple of it (the caller's
            promise: the ends live on the device). A multiple of `ALIGNED_BLOCK_M` takes the aligned kernel
            where the operands suit tensor descriptors (`_descriptors`).
    """
    rows, k = a_mk.shape
    n = b_gkn.shape[2]
    groups = offs_g.numel()
    if a_mk.dtype not in (torch.bfloat16, torch.float16) or b_gkn.dtype != a_mk.dtype:
        raise ValueError(f"a and b must both be bfloat16 or float16, got {a_mk.dtype} and {b_gkn.dtype}")
    if a_mk.stride(1) != 1 or b_gkn.dim() != 3 or b_gkn.shape[1] != k:
        raise ValueError(f"a [rows, k] with contiguous rows and b [G - first, k, n] must share k, got "
                         f"{list(a_mk.shape)} strides {a_mk.stride()} and {list(b_gkn.shape)}")
    if offs_g.dtype != torch.int32 or offs_g.dim() != 1 or b_gkn.shape[0] != groups - first or first < 0:
        raise ValueError(f"offs_g must be int32 [G] with G - first ({groups} - {first}) = b's groups "
                         f"({b_gkn.shape[0]}), got {offs_g.dtype} {list(offs_g.shape)}")
    if out_mn.dtype not in OUT_DTYPES or tuple(out_mn.shape) != (rows, n) or out_mn.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {n}] of {OUT_DTYPES} with contiguous rows, got "
                         f"{out_mn.dtype} {list(out_mn.shape)}")
    if not (rows and n and groups > first):
        return
    b_nk = _descriptor_layout(a_mk, b_gkn, out_mn)
    aligned = row_alignment % ALIGNED_BLOCK_M == 0 and b_nk is not None
    launch = (aligned_tiles() if aligned else tiles()) if launch is None else launch
    if INTERPRETED:
        programs = 2
        bound = triton.cdiv(rows, launch["BLOCK_M"]) * triton.cdiv(n, launch["BLOCK_N"])
    else:
        sms = torch.cuda.get_device_properties(a_mk.device).multi_processor_count
        programs = sms if aligned else PROGRAMS_PER_SM * sms
        bound = 0
    with launching():
        if aligned:
            _groups_from_aligned_kernel[(programs,)](*_descriptors(a_mk, b_gkn, out_mn, b_nk, launch), offs_g,
                                                     first, groups, n, k, B_NK=b_nk,
                                                     GROUPS_POW2=next_power_of_2(groups),
                                                     INTERPRET_TILES=bound, **launch)
        else:
            _groups_from_kernel[(programs,)](a_mk, b_gkn, offs_g, out_mn, first, groups, n, k, a_mk.stride(0),
                                             *b_gkn.stride(), out_mn.stride(0),
                                             GROUPS_POW2=next_power_of_2(groups), INTERPRET_TILES=bound,
                                             **launch)


def _descriptor_layout(a_mk: torch.Tensor, b_gkn: torch.Tensor, out_mn: torch.Tensor) -> bool | None:
    """How the weights lie for tensor descriptors: True where ``b`` is a forward's ``w [G, n, k]``
    transposed, False where it is ``[G, k, n]`` as stored, None where an operand does not suit a descriptor
    (a weight matrix not contiguous either way, or a base address or row stride not a multiple of 16
    bytes)."""
    if b_gkn.transpose(-2, -1).is_contiguous():
        weights, nk = b_gkn.transpose(-2, -1), True
    elif b_gkn.is_contiguous():
        weights, nk = b_gkn, False
    else:
        return None
    suits = all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(-2) * t.element_size() % 16 == 0
                for t in (a_mk, weights, out_mn))
    return nk if suits else None


def _descriptors(a_mk: torch.Tensor, b_gkn: torch.Tensor, out_mn: torch.Tensor, b_nk: bool,
                 launch: dict) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """The aligned kernel's tensor descriptors of ``a``, the weights as stored (``b_nk``:
    `_descriptor_layout`) and ``out``, in the launch's blocks."""
    block_m, block_n, block_k = launch["BLOCK_M"], launch["BLOCK_N"], launch["BLOCK_K"]
    if b_nk:
        b_desc = TensorDescriptor.from_tensor(b_gkn.transpose(-2, -1), [1, block_n, block_k])
    else:
        b_desc = TensorDescriptor.from_tensor(b_gkn, [1, block_k, block_n])
    return (TensorDescriptor.from_tensor(a_mk, [block_m, block_k]), b_desc,
            TensorDescriptor.from_tensor(out_mn, [block_m, block_n]))
