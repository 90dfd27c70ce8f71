"""Triton kernels that move the Buffer's rows between ranks through per-rank pointer tables.

A pointer table is an int64 `[R]` device tensor holding `peers[r].data_ptr()` of one symmetric tensor
(`pointer_table`, built once per tensor and cached), so a kernel on rank r loads rank d's base address and
reads or writes rank d's memory directly. It needs a world whose symmetric tensors have every peer mapped:
the threads world (one process, one device) and the symmetric-memory world (NVLink peer mappings).

These kernels only move bytes; the Buffer orders them with `world.barrier()` where its torch reference
orders its phases, and builds every index both paths share (the plan's `dst`, dup tables, slot tables):

- `send_routes`: each token row is read once and written once per destination rank, straight into its
  expert-grouped row there (primary routes); every route's weight; duplicates record their primary row.
  The programs past the tokens zero this rank's padding rows and their weights (local rows no route
  writes): one launch for both.
- `record_duplicates`: after the barrier, local, three launches: the received duplicate pairs become the
  plan's dup tables (the pairs mark their primary rows; the rows the plan fills, in blocks, count their
  groups, then write them after the earlier blocks' ones).
- `expand_duplicates`: after the barrier, local: primary rows are copied into their duplicate rows.

Work follows the step's tokens, not the capacity: every kernel reads its counts (padding rows per group,
duplicate groups, rows the plan fills) on the device and loops over those only, so a CUDA graph captured for
a capacity bucket and replayed with fewer tokens moves only their rows.
- `pre_reduce_duplicates`: local, before combine's barrier: each duplicate group summed into its primary row
  in place, in fp32 and row order (the order of the reference's `index_add_`), so the same bits. Where the
  expert outputs are not the Buffer's own rows, `copy_rows` first copies them in (the rows the plan fills).
- `copy_rows`: local, the rows the plan fills copied (a copying dispatch's rows, `filled_copy`; combine's
  expert outputs into the Buffer's rows).
- `gather_routes`: per token its K rows pulled from their ranks and summed in fp32 in k order (the
  reference's order, so the result is identical bit for bit), and optionally every route's weight.
- `copy_experts`: each prefetch slot gets its expert's rows from the home rank's weights.
- `add_replicas`: each home expert's fp32 gradient gets its replicas' slot gradients added, in the order
  of `replica_sources` (the reference's order).

With one rank (R = 1) `send_routes` and `gather_routes` take the local tensors instead of pointer tables;
its plans hold no duplicates (every route primary), so the exchange runs neither `record_duplicates`,
`expand_duplicates` nor `pre_reduce_duplicates`, and `gather_routes` reads the expert outputs where they are
(no `copy_rows`).

Speed: rows are moved in blocks of up to `ROW_BLOCK_BYTES` per program (16-byte vector accesses: the peer
base addresses are 16-byte aligned, asserted when a table is built, and told to the compiler), with grids of
tokens x row blocks (or slots x row chunks) that fill every SM; inner loops have trip counts fixed at
compile time (K, R, the padding tile) and index math once per row, never per element. Everything a kernel
reads from the plan is read on the device: no host sync.

bf16 is widened and rounded (to nearest even) by bit operations: exact on the GPU, where they equal the
hardware conversions, and in Triton's CPU interpreter, whose own bf16 conversions are not (they truncate
or mis-round), so the interpreter tests compare bit for bit too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep_moe.base.interpreter import launching
from moonep_moe.base.sizes import cdiv, next_power_of_2
from moonep_moe.comm.kernels import common
from moonep_moe.comm.kernels.common import TL_DTYPES, as_int64, base, both, narrow, pointer_tables, widen
from moonep_moe.transport.world import SymmetricTensor

# -- host side: pointer tables, launch parameters ------------------------------------------------------------


ROW_BLOCK_BYTES = 8192
"""Largest row block one program moves (`bench.rows --row-block-bytes` sweeps it; on the H200 8 KiB moved
DeepSeek-V3 rows at 65% / 60% of copy in dispatch / combine, 4 KiB at 53% / 53%, 16 KiB at 64% / 59%)."""


def _row_block(width: int, itemsize: int) -> tuple[int, int]:
    """(elements per program, warps) for rows of `width` elements: `ROW_BLOCK_BYTES` blocks at most, halved
    when that divides the row exactly, 16 bytes per thread and access, at most 8 warps (larger blocks give
    each thread several accesses in flight)."""
    block = min(next_power_of_2(width), ROW_BLOCK_BYTES // itemsize)
    if width % block and width % (block // 2) == 0 and block >= 512:
        block //= 2
    return block, max(1, min(8, block * itemsize // 512))


def _group_programs(capacity: int, device: torch.device, num_sms: int | None) -> tuple[int, int]:
    """(programs, iterations) of a grid-stride loop over at most `capacity` items counted on the device."""
    programs = common.device_programs(capacity, device, 4, num_sms)
    return programs, cdiv(capacity, programs)


# -- device helpers ------------------------------------------------------------------------------------------


@triton.jit
def _decode(dst_ptr, rows_per_rank):
    """One int32 `dst` entry -> (destination rank, int64 row, is primary, is valid); rank and row 0 when
    invalid. In int32 (the plan keeps `R * NvS` below 2^31): one division per route, not a 64-bit one."""
    dst = tl.load(dst_ptr)
    valid = dst != -2147483648
    primary = dst >= 0
    raw = tl.where(valid, tl.where(primary, dst, ~dst), 0)  # ~dst == -dst - 1
    rank = raw // rows_per_rank
    return rank, (raw - rank * rows_per_rank).to(tl.int64), primary, valid


# -- dispatch ------------------------------------------------------------------------------------------------


@triton.jit
def _zero_group_padding(rows_ptr, weights_ptr, zero_fill_ptr, group, block, offs, inside, H,
                        TILE: tl.constexpr, BLOCK_H: tl.constexpr):
    """This rank's padding rows of group `group` (`zero_fill[group]`: first row, count < tp) and their
    weights become zero, row block `block` of them; none for an empty group."""
    first = tl.load(zero_fill_ptr + 2 * group).to(tl.int64)
    count = tl.load(zero_fill_ptr + 2 * group + 1)
    zeros = tl.zeros([TILE, BLOCK_H], dtype=rows_ptr.dtype.element_ty)
    for start in tl.range(0, count, TILE):
        pad = start + tl.arange(0, TILE)
        padding = pad < count
        tl.store(rows_ptr + (first + pad)[:, None] * H + offs[None, :], zeros,
                 mask=both(padding[:, None], inside[None, :]))
        tl.store(weights_ptr + first + pad, tl.zeros([TILE], dtype=weights_ptr.dtype.element_ty),
                 mask=both(padding, block == 0))


@triton.jit
def _send_routes_kernel(hidden_ptr, weights_ptr, dst_ptr,
                        rows_table, weights_table, pairs_table, rows_like, weights_like, pairs_like,
                        zero_fill_ptr, num_tokens, H, rows_per_rank, pairs_offset, K: tl.constexpr,
                        WEIGHTS: tl.constexpr, RECORD: tl.constexpr, ONE_RANK: tl.constexpr,
                        PAD_TILE: tl.constexpr, BLOCK_H: tl.constexpr):
    program = tl.program_id(0)
    block = tl.program_id(1)
    offs = block * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = offs < H
    if program < num_tokens:
        _send_token(hidden_ptr, weights_ptr, dst_ptr, rows_table, weights_table, pairs_table, rows_like,
                    weights_like, pairs_like, program, block, offs, inside, H, rows_per_rank, pairs_offset, K,
                    WEIGHTS, RECORD, ONE_RANK)
    else:  # the programs past the tokens zero this rank's padding rows, a group each
        _zero_group_padding(rows_like, weights_like, zero_fill_ptr, program - num_tokens, block, offs, inside,
                            H, PAD_TILE, BLOCK_H)


@triton.jit
def _send_token(hidden_ptr, weights_ptr, dst_ptr, rows_table, weights_table, pairs_table, rows_like,
                weights_like, pairs_like, token, block, offs, inside, H, rows_per_rank, pairs_offset,
                K: tl.constexpr, WEIGHTS: tl.constexpr, RECORD: tl.constexpr, ONE_RANK: tl.constexpr):
    """Token `token`'s row block `block` to each of its primary routes' rows; its weights and duplicate
    pairs from the first block."""
    x = tl.load(hidden_ptr + token.to(tl.int64) * H + offs, mask=inside)
    first_block = block == 0
    for k in tl.static_range(K):
        route = token * K + k
        dest, row, primary, valid = _decode(dst_ptr + route, rows_per_rank)
        rows_ptr = base(rows_table, dest, rows_like, ONE_RANK)
        tl.store(rows_ptr + row * H + offs, x, mask=both(inside, primary))
        if WEIGHTS:
            tl.store(base(weights_table, dest, weights_like, ONE_RANK) + row, tl.load(weights_ptr + route),
                     mask=valid & first_block)
        if RECORD:
            # a duplicate's source: the token's primary route to the same rank, an earlier k
            source = row
            for j in tl.static_range(k):
                dest_j, row_j, primary_j, _ = _decode(dst_ptr + token * K + j, rows_per_rank)
                source = tl.where(primary_j & (dest_j == dest), row_j, source)
            pair_ptr = base(pairs_table, dest, pairs_like, ONE_RANK) + 2 * (pairs_offset + route)
            duplicate = valid & ~primary & first_block
            tl.store(pair_ptr, row.to(tl.int32), mask=duplicate)
            tl.store(pair_ptr + 1, source.to(tl.int32), mask=duplicate)


def send_routes(hidden_sh: torch.Tensor, route_weights_sk: torch.Tensor | None, dst_n: torch.Tensor,
                record: bool, rows: SymmetricTensor, weights: SymmetricTensor, pairs: SymmetricTensor,
                pairs_offset: int = 0, zero_fill_g2: torch.Tensor | None = None, token_padding: int = 1
                ) -> None:
    """Every route of this rank to its destination rank's rows (peer writes; the caller barriers), and in
    the same launch this rank's padding rows and their weights zeroed (local: no route writes them).

    Args:
        hidden_sh: `[s, H]` rows, contiguous. route_weights_sk: `[s, K]` or None (no weights sent).
        dst_n: `[s*K]` int32 the plan's destinations. record: record the duplicates (below) or not.
        rows, weights, pairs: the Buffer's symmetric `[NvS, H]` rows, `[NvS]` weights, `[R*S*K, 2]` int32
            duplicate pairs: with `record`, duplicate route i writes (its row, the row of its token's
            primary route to the same rank, found among the token's earlier routes) at pair
            `pairs_offset + i` of its destination (`pairs_offset`: this rank's `rank * S * K`, so every slot
            has one writer).
        zero_fill_g2: `[G, 2]` int32 this rank's (first padding row, padding rows) per group, read on the
            device (`plan.zero_fill_ranges`), or None: no padding. token_padding: tp (1: no padding rows).
    """
    num_tokens, width = hidden_sh.shape
    pad_groups = 0 if zero_fill_g2 is None or token_padding == 1 else zero_fill_g2.shape[0]
    if num_tokens + pad_groups == 0:
        return
    block, warps = _row_block(width, hidden_sh.element_size())
    tables, one_rank = pointer_tables(rows, weights, pairs)
    with launching():
        _send_routes_kernel[(num_tokens + pad_groups, cdiv(width, block))](
            hidden_sh, route_weights_sk if route_weights_sk is not None else hidden_sh, dst_n, *tables,
            rows.local, weights.local, pairs.local, zero_fill_g2 if pad_groups else dst_n, num_tokens, width,
            rows.local.shape[0], pairs_offset, K=dst_n.numel() // max(num_tokens, 1),
            WEIGHTS=route_weights_sk is not None, RECORD=bool(record), ONE_RANK=one_rank,
            PAD_TILE=min(16, next_power_of_2(token_padding)), BLOCK_H=block, num_warps=warps)


RECORD_SLOTS = 2048
"""Duplicate pairs one program of `record_duplicates`' first launch reads."""
RECORD_ROWS = 256
"""Rows one program of `record_duplicates`' second and third launches scans (x K_P pair slots in registers):
a block of the rows the plan fills."""
RECORD_BLOCKS = 1024
"""Row blocks' counts the third launch sums per step, where it finds its block's first entries."""


@triton.jit
def _mark_primaries_kernel(pairs_ptr, num_pairs, marks_ptr, K: tl.constexpr, SLOTS: tl.constexpr):
    # each received duplicate marks its primary row with its window + 1: the K pair slots of its (source
    # rank, token), where every duplicate of that token on this rank sits (one primary each, so one window
    # per marked row: the row blocks below touch disjoint windows)
    pair = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
    primary = tl.load(pairs_ptr + 2 * pair.to(tl.int64) + 1, mask=pair < num_pairs, other=-1)
    tl.store(marks_ptr + primary, pair // K + 1, mask=primary >= 0)


@triton.jit
def _row_block_windows(pairs_ptr, marks_ptr, end, block, K: tl.constexpr, K_P: tl.constexpr,
                       ROWS: tl.constexpr):
    """Row block `block` of the rows up to `end` -> (rows `[ROWS]`, marked `[ROWS]`, their windows' pair
    slots `[ROWS, K_P]` int64, in a window `[ROWS, K_P]`, duplicate rows `[ROWS, K_P]` (-1: none), duplicates
    per row `[ROWS]`)."""
    row_c = block * ROWS + tl.arange(0, ROWS)
    window_c = tl.load(marks_ptr + row_c, mask=row_c < end, other=0) - 1
    marked_c = window_c >= 0
    j_1j = tl.arange(0, K_P)[None, :]
    slot_cj = window_c.to(tl.int64)[:, None] * K + j_1j  # 2 * slot may pass 2^31
    in_window_cj = both(marked_c[:, None], j_1j < K)
    dup_cj = tl.load(pairs_ptr + 2 * slot_cj, mask=in_window_cj, other=-1)
    return row_c, marked_c, slot_cj, in_window_cj, dup_cj, tl.sum((dup_cj >= 0).to(tl.int32), 1)


@triton.jit
def _count_duplicates_kernel(pairs_ptr, marks_ptr, end_ptr, block_counts_ptr, K: tl.constexpr,
                             K_P: tl.constexpr, ROWS: tl.constexpr):
    # per row block up to the end: its groups (marked rows) and duplicates; the blocks past it do nothing
    block = tl.program_id(0)
    end = tl.load(end_ptr)
    if block * ROWS < end:
        _, marked_c, _, _, _, count_c = _row_block_windows(pairs_ptr, marks_ptr, end, block, K, K_P, ROWS)
        tl.store(block_counts_ptr + 2 * block, tl.sum(marked_c.to(tl.int32), 0))
        tl.store(block_counts_ptr + 2 * block + 1, tl.sum(count_c, 0))


@triton.jit
def _blocks_total(block_counts_ptr, blocks, BLOCKS: tl.constexpr):
    """(groups, duplicates) of row blocks 0 .. `blocks` - 1, as `_count_duplicates_kernel` counted them."""
    groups = tl.zeros([], tl.int32)
    duplicates = tl.zeros([], tl.int32)
    for b0 in range(0, blocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        groups += tl.sum(tl.load(block_counts_ptr + 2 * b, mask=b < blocks, other=0), 0)
        duplicates += tl.sum(tl.load(block_counts_ptr + 2 * b + 1, mask=b < blocks, other=0), 0)
    return groups, duplicates


@triton.jit
def _record_duplicates_kernel(pairs_ptr, marks_ptr, end_ptr, block_counts_ptr, groups_ptr, loffs_ptr,
                              counts_ptr, K: tl.constexpr, K_P: tl.constexpr, ROWS: tl.constexpr,
                              BLOCKS: tl.constexpr):
    # per row block up to the end, in row order: a marked row is the next group's primary; its window's
    # duplicate rows, sorted, are the next entries of dup_loffs, after the earlier blocks' ones. Marks and
    # pairs are reset behind.
    block = tl.program_id(0)
    end = tl.load(end_ptr)
    if block * ROWS < end:
        groups, duplicates = _blocks_total(block_counts_ptr, block, BLOCKS)
        row_c, marked_c, slot_cj, in_window_cj, dup_cj, count_c = _row_block_windows(
            pairs_ptr, marks_ptr, end, block, K, K_P, ROWS)
        j_1j = tl.arange(0, K_P)[None, :]
        sorted_cj = tl.sort(tl.where(dup_cj >= 0, dup_cj, 2147483647), dim=1)
        group_c = (groups + tl.cumsum(marked_c.to(tl.int32), 0) - 1).to(tl.int64)  # 3 * group may pass 2^31
        first_c = duplicates + tl.cumsum(count_c, 0) - count_c
        tl.store(groups_ptr + 3 * group_c, row_c, mask=marked_c)
        tl.store(groups_ptr + 3 * group_c + 1, first_c, mask=marked_c)
        tl.store(groups_ptr + 3 * group_c + 2, count_c, mask=marked_c)
        tl.store(loffs_ptr + first_c[:, None] + j_1j, sorted_cj, mask=both(marked_c[:, None],
                                                                           j_1j < count_c[:, None]))
        tl.store(pairs_ptr + 2 * slot_cj, tl.full([ROWS, K_P], -1, tl.int32), mask=in_window_cj)
        tl.store(pairs_ptr + 2 * slot_cj + 1, tl.full([ROWS, K_P], -1, tl.int32), mask=in_window_cj)
        tl.store(marks_ptr + row_c, tl.zeros([ROWS], tl.int32), mask=marked_c)
    if block == 0:  # the counts, every block's (zero without rows)
        groups, duplicates = _blocks_total(block_counts_ptr, tl.cdiv(end, ROWS), BLOCKS)
        tl.store(counts_ptr, groups)
        tl.store(counts_ptr + 1, duplicates)


def record_duplicates(pairs_p2: torch.Tensor, marks_nvs: torch.Tensor, end_1: torch.Tensor,
                      dup_groups: torch.Tensor, dup_loffs: torch.Tensor, dup_counts: torch.Tensor,
                      top_k: int) -> None:
    """The plan's dup tables from this rank's received duplicate pairs, in three launches, equal to the torch
    reference's (`ReferenceExchange.record_duplicates`): groups in primary-row order, each group's duplicate
    rows ascending. The pairs mark their primary rows (`RECORD_SLOTS` pairs a program); then the rows the plan
    fills (up to `end_1[0]`, read on the device; never NvS) in blocks of `RECORD_ROWS`, a program each: each
    block counts its groups and duplicates, then writes its entries after the earlier blocks' ones (it sums
    their counts) and resets the pairs it read to -1 and its marks to 0; block 0 writes the counts. No host
    read, capturable: the grids are sized for the static R*S*K and NvS (the blocks past the end do nothing),
    the blocks' counts go to a `[cdiv(NvS, RECORD_ROWS), 2]` int32 scratch allocated here.

    Args:
        pairs_p2: `[R*S*K, 2]` int32 (row, primary row) of each received duplicate at its sender's slot, -1
            where none. marks_nvs: `[NvS]` int32 all zero (scratch). end_1: `[1]` int32, `cu_seqlens[-1:]`.
        dup_groups, dup_loffs, dup_counts: the plan's `[NvS, 3]`, `[NvS]`, `[2]` int32 tables, zero.
    """
    num_pairs, num_rows = pairs_p2.shape[0], marks_nvs.shape[0]
    blocks = max(cdiv(num_rows, RECORD_ROWS), 1)
    block_counts = torch.empty(blocks, 2, dtype=torch.int32, device=pairs_p2.device)
    rows_launch = dict(K=top_k, K_P=next_power_of_2(top_k), ROWS=RECORD_ROWS, num_warps=4)
    with launching():
        _mark_primaries_kernel[(max(cdiv(num_pairs, RECORD_SLOTS), 1),)](
            pairs_p2, num_pairs, marks_nvs, K=top_k, SLOTS=RECORD_SLOTS, num_warps=4)
        _count_duplicates_kernel[(blocks,)](pairs_p2, marks_nvs, end_1, block_counts, **rows_launch)
        _record_duplicates_kernel[(blocks,)](pairs_p2, marks_nvs, end_1, block_counts, dup_groups, dup_loffs,
                                             dup_counts, BLOCKS=RECORD_BLOCKS, **rows_launch)


@triton.jit
def _duplicate_group(groups_ptr, group):
    """Group `group` of the dup tables -> (primary row, first dup_loffs index, duplicates)."""
    return (tl.load(groups_ptr + 3 * group).to(tl.int64), tl.load(groups_ptr + 3 * group + 1),
            tl.load(groups_ptr + 3 * group + 2))


@triton.jit
def _expand_duplicates_kernel(rows_ptr, groups_ptr, loffs_ptr, counts_ptr, H, MAX_DUPS: tl.constexpr,
                              ITERATIONS: tl.constexpr, BLOCK_H: tl.constexpr):
    block = tl.program_id(1)
    offs = block * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = offs < H
    for iteration in tl.range(ITERATIONS):
        group = tl.program_id(0) + iteration * tl.num_programs(0)
        if group < tl.load(counts_ptr):
            primary, first, count = _duplicate_group(groups_ptr, group)
            x = tl.load(rows_ptr + primary * H + offs, mask=inside)
            for i in tl.static_range(MAX_DUPS):
                has = i < count
                row = tl.load(loffs_ptr + first + i, mask=has, other=0).to(tl.int64)
                tl.store(rows_ptr + row * H + offs, x, mask=both(inside, has))


def _duplicate_groups_launch(rows_nvsh: torch.Tensor, itemsize: int, max_groups: int,
                             num_sms: int | None) -> tuple[tuple[int, int], dict[str, int]]:
    """(grid, launch constants) of a kernel over the dup tables: a grid-stride loop over at most
    `max_groups` groups x row blocks sized for `itemsize`-byte elements."""
    block, warps = _row_block(rows_nvsh.shape[1], itemsize)
    programs, iterations = _group_programs(max_groups, rows_nvsh.device, num_sms)
    return ((programs, cdiv(rows_nvsh.shape[1], block)),
            dict(ITERATIONS=iterations, BLOCK_H=block, num_warps=warps))


def expand_duplicates(rows_nvsh: torch.Tensor, dup_groups: torch.Tensor, dup_loffs: torch.Tensor,
                      dup_counts: torch.Tensor, max_duplicates: int, max_groups: int,
                      num_sms: int | None = None) -> None:
    """Copy each duplicate group's primary row into its duplicate rows (the plan's dup tables, read on the
    device; at most `max_groups` groups of at most `max_duplicates` rows: static bounds)."""
    if max_duplicates == 0 or max_groups == 0:
        return
    grid, launch = _duplicate_groups_launch(rows_nvsh, rows_nvsh.element_size(), max_groups, num_sms)
    with launching():
        _expand_duplicates_kernel[grid](rows_nvsh, dup_groups, dup_loffs, dup_counts, rows_nvsh.shape[1],
                                        MAX_DUPS=max_duplicates, **launch)


# -- combine -------------------------------------------------------------------------------------------------


@triton.jit
def _copy_rows_kernel(target_ptr, source_ptr, end_ptr, H, target_stride, source_stride,
                      BLOCK_H: tl.constexpr):
    block = tl.program_id(1)
    offs = block * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = offs < H
    for row in tl.range(tl.program_id(0), tl.load(end_ptr), tl.num_programs(0)):  # rows the plan fills
        row = as_int64(row)  # NvS * H may pass 2^31
        tl.store(target_ptr + row * target_stride + offs,
                 tl.load(source_ptr + row * source_stride + offs, mask=inside), mask=inside)


def copy_rows(target_nvsh: torch.Tensor, source_nvsh: torch.Tensor, end_1: torch.Tensor,
              num_sms: int | None = None) -> None:
    """`target_nvsh[:end] = source_nvsh[:end]` with `end = end_1[0]` read on the device (the plan's
    `cu_seqlens[-1:]`): a grid-stride loop over the rows the plan fills, whatever NvS is; the rows past
    `end` are not touched.

    Args:
        target_nvsh, source_nvsh: `[NvS, H]`, same dtype, each with unit column stride and any row stride
            (e.g. the e4m3 rows or scales viewed inside packed FP8 rows). end_1: `[1]` int32 on their device.
    """
    num_rows, width = target_nvsh.shape
    if num_rows == 0 or width == 0:
        return
    block, warps = _row_block(width, target_nvsh.element_size())
    programs, _ = _group_programs(num_rows, target_nvsh.device, num_sms)
    with launching():
        _copy_rows_kernel[(programs, cdiv(width, block))](
            target_nvsh, source_nvsh, end_1, width, target_nvsh.stride(0), source_nvsh.stride(0),
            BLOCK_H=block, num_warps=warps)


@triton.jit
def _group_sum(rows_ptr, primary, first, count, loffs_ptr, offs, inside, H, ACC: tl.constexpr,
               MAX_DUPS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row block `offs` of a duplicate group of `rows_ptr`'s rows (the primary row `primary`, int64, and the
    `count` duplicate rows at `loffs[first:]`, ascending) summed in `ACC`, in ascending row order (the
    reference's `index_add_` order): `[BLOCK_H]`."""
    x_primary = widen(tl.load(rows_ptr + primary * H + offs, mask=inside, other=0.0), ACC)  # read once
    # the duplicates are sorted; the primary slots in where it belongs. +0.0 is added where nothing is
    # (exact: the sum starts at +0.0, so is never -0.0)
    total = tl.zeros([BLOCK_H], dtype=ACC)
    added = tl.full([], 0, tl.int1)
    for i in tl.static_range(MAX_DUPS):
        has = i < count
        row = tl.load(loffs_ptr + first + i, mask=has, other=0).to(tl.int64)
        primary_now = has & (row > primary) & ~added
        total += tl.where(primary_now, x_primary, 0.0)
        added = added | primary_now
        total += widen(tl.load(rows_ptr + row * H + offs, mask=both(inside, has), other=0.0), ACC)
    total += tl.where(added, 0.0, x_primary)
    return total


@triton.jit
def _pre_reduce_kernel(rows_ptr, groups_ptr, loffs_ptr, counts_ptr, H, ACC: tl.constexpr,
                       MAX_DUPS: tl.constexpr, ITERATIONS: tl.constexpr, BLOCK_H: tl.constexpr):
    block = tl.program_id(1)
    offs = block * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = offs < H
    for iteration in tl.range(ITERATIONS):
        group = tl.program_id(0) + iteration * tl.num_programs(0)
        if group < tl.load(counts_ptr):
            primary, first, count = _duplicate_group(groups_ptr, group)
            total = _group_sum(rows_ptr, primary, first, count, loffs_ptr, offs, inside, H, ACC, MAX_DUPS,
                               BLOCK_H)
            tl.store(rows_ptr + primary * H + offs, narrow(total, rows_ptr.dtype.element_ty), mask=inside)


def pre_reduce_duplicates(rows_nvsh: torch.Tensor, dup_groups: torch.Tensor, dup_loffs: torch.Tensor,
                          dup_counts: torch.Tensor, max_duplicates: int, max_groups: int,
                          accumulate: torch.dtype, num_sms: int | None = None) -> None:
    """In place: each duplicate group's rows (primary and duplicates) summed in `accumulate`, in ascending
    row order, into the primary row. Duplicate rows are left as they are (combine reads primaries only)."""
    if max_duplicates == 0 or max_groups == 0:
        return
    grid, launch = _duplicate_groups_launch(rows_nvsh, 4, max_groups, num_sms)
    with launching():
        _pre_reduce_kernel[grid](rows_nvsh, dup_groups, dup_loffs, dup_counts, rows_nvsh.shape[1],
                                 ACC=TL_DTYPES[accumulate], MAX_DUPS=max_duplicates, **launch)


@triton.jit
def _gather_routes_kernel(out_ptr, weights_out_ptr, dst_ptr, rows_table, weights_table, rows_like,
                          weights_like, H, rows_per_rank, ACC: tl.constexpr, K: tl.constexpr,
                          WEIGHTS: tl.constexpr, ONE_RANK: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    block = tl.program_id(1)
    offs = block * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = offs < H
    first_block = block == 0
    total = tl.zeros([BLOCK_H], dtype=ACC)
    for k in tl.static_range(K):  # in k order, +0.0 for duplicates and invalid routes: the reference's sum
        route = token * K + k
        dest, row, primary, valid = _decode(dst_ptr + route, rows_per_rank)
        rows_ptr = base(rows_table, dest, rows_like, ONE_RANK)
        x = tl.load(rows_ptr + row * H + offs, mask=both(inside, primary), other=0.0)
        total += widen(x, ACC)
        if WEIGHTS:
            weight = tl.load(base(weights_table, dest, weights_like, ONE_RANK) + row,
                             mask=valid & first_block,
                             other=0.0)
            tl.store(weights_out_ptr + route, weight, mask=first_block)
    tl.store(out_ptr + token.to(tl.int64) * H + offs, narrow(total, out_ptr.dtype.element_ty), mask=inside)


def gather_routes(dst_n: torch.Tensor, rows: SymmetricTensor | torch.Tensor, weights: SymmetricTensor | None,
                  out_sh: torch.Tensor, weights_out_sk: torch.Tensor | None, accumulate: torch.dtype) -> None:
    """`out_sh[t] = sum_k rows[dst[t, k]]` over primary routes, in `accumulate` and k order (peer reads;
    the caller barriers); with `weights`, `weights_out_sk[t, k]` = the weight at every valid route's row
    (0 for invalid routes).

    Args:
        dst_n: `[s*K]` int32. rows: `[NvS, H]` symmetric (pre-reduced), or with one rank a contiguous local
            tensor (the rows where the experts wrote them). weights: `[NvS]` symmetric or None.
        out_sh: `[s, H]` contiguous output. weights_out_sk: `[s, K]` contiguous output or None.
    """
    num_tokens, width = out_sh.shape
    if num_tokens == 0:
        return
    block, warps = _row_block(width, 4)
    with_weights = weights is not None
    tables, one_rank = pointer_tables(rows, *([weights] if with_weights else []))
    rows_nvsh = tables[0] if one_rank else rows.local
    with launching():
        _gather_routes_kernel[(num_tokens, cdiv(width, block))](
            out_sh, weights_out_sk if with_weights else out_sh, dst_n, tables[0], tables[-1], rows_nvsh,
            weights.local if with_weights else rows_nvsh, width, rows_nvsh.shape[0],
            ACC=TL_DTYPES[accumulate], K=dst_n.numel() // num_tokens, WEIGHTS=with_weights,
            ONE_RANK=one_rank, BLOCK_H=block, num_warps=warps)


# -- weights -------------------------------------------------------------------------------------------------


