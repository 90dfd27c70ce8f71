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
- `record_duplicates`: after the barrier, local, one program: the received duplicate pairs become the
  plan's dup tables (the pairs mark their primary rows, the rows the plan fills are scanned in order).
- `expand_duplicates`: after the barrier, local: primary rows are copied into their duplicate rows.

Work follows the step's tokens, not the capacity: every kernel reads its counts (padding rows per group,
duplicate groups, rows the plan fills) on the device and loops over those only, so a CUDA graph captured for
a capacity bucket and replayed with fewer tokens moves only their rows.
- `copy_rows`: local, combine of expert outputs that are not the Buffer's own rows: the rows the plan fills
  (up to `cu_seqlens[-1]`, read on the device) into the Buffer's rows.
- `pre_reduce_duplicates`: local, before combine's barrier: each duplicate group summed into its primary
  row in fp32, in row order (the order of the reference's `index_add_`).
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

import functools

import torch
import triton
import triton.language as tl

from moonep_moe.comm.world import SymmetricTensor
from moonep_moe.triton_interpreter import launching

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float64: tl.float64}

ALIGNMENT = 16
"""Bytes every peer base address must be a multiple of (what the kernels promise the compiler)."""


# -- host side: pointer tables, launch parameters ------------------------------------------------------------


def pointer_table(tensor: SymmetricTensor) -> torch.Tensor:
    """`[R]` int64 on the tensor's device: every rank's base address of `tensor` (all peers mapped).

    Cached by the addresses and the current stream, so it is built once per symmetric tensor and stream;
    built with one `fill_` per rank (no host-to-device copy, so no sync, and capturable in a CUDA graph).
    The fills are queued on the current stream, so only kernels on that stream are ordered after them: a
    table shared across streams (the thread-ranks of one GPU all map the same addresses; a rank's comm
    stream and its caller's stream) could be read before its fills ran. A table built while a CUDA graph
    is captured is filled by the graph's replays only: it is the graph's own, never cached."""
    if any(peer is None for peer in tensor.peers):
        raise RuntimeError(f"rank {tensor.rank}: symmetric tensor {tensor.key!r}: the row kernels need every "
                           "peer mapped")
    addresses = tuple(peer.data_ptr() for peer in tensor.peers)
    if any(address % ALIGNMENT for address in addresses):
        raise ValueError(f"rank {tensor.rank}: symmetric tensor {tensor.key!r}: peer addresses must be "
                         f"{ALIGNMENT}-byte aligned")
    device = tensor.local.device
    if device.type != "cuda":
        return _table(str(device), 0, addresses)
    if torch.cuda.is_current_stream_capturing():  # its fills run at each replay, not now: never cached
        return _table.__wrapped__(str(device), 0, addresses)
    return _table(str(device), torch.cuda.current_stream(device).cuda_stream, addresses)


@functools.lru_cache(maxsize=4096)
def _table(device: str, stream: int, addresses: tuple[int, ...]) -> torch.Tensor:
    """The table of `addresses`, filled on `stream` (the current one: the caller's cache key)."""
    table_r = torch.empty(len(addresses), dtype=torch.int64, device=device)
    for rank, address in enumerate(addresses):
        table_r[rank].fill_(address)
    return table_r


ROW_BLOCK_BYTES = 8192
"""Largest row block one program moves (`bench.rows --row-block-bytes` sweeps it; on the H200 8 KiB moved
DeepSeek-V3 rows at 65% / 60% of copy in dispatch / combine, 4 KiB at 53% / 53%, 16 KiB at 64% / 59%)."""


def _row_block(width: int, itemsize: int) -> tuple[int, int]:
    """(elements per program, warps) for rows of `width` elements: `ROW_BLOCK_BYTES` blocks at most, halved
    when that divides the row exactly, 16 bytes per thread and access, at most 8 warps (larger blocks give
    each thread several accesses in flight)."""
    block = min(triton.next_power_of_2(width), ROW_BLOCK_BYTES // itemsize)
    if width % block and width % (block // 2) == 0 and block >= 512:
        block //= 2
    return block, max(1, min(8, block * itemsize // 512))


def _group_programs(capacity: int, device: torch.device, num_sms: int | None) -> tuple[int, int]:
    """(programs, iterations) of a grid-stride loop over at most `capacity` items counted on the device."""
    if device.type == "cuda":
        num_sms = num_sms or torch.cuda.get_device_properties(device).multi_processor_count
        programs = min(capacity, 4 * num_sms)
    else:
        programs = min(capacity, 4)
    programs = max(programs, 1)
    return programs, triton.cdiv(capacity, programs)


# -- device helpers ------------------------------------------------------------------------------------------


@triton.jit
def _peer(table_ptr, rank, like_ptr):
    """Rank `rank`'s base pointer from a pointer table, typed like `like_ptr`."""
    address = tl.load(table_ptr + rank)
    return tl.multiple_of(address.to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)


@triton.jit
def _base(table_ptr, rank, like_ptr, ONE_RANK: tl.constexpr):
    """`_peer`, or `like_ptr` itself where the world has one rank (every access is to this rank's own
    tensor, which needs no pointer table)."""
    # if/else, not an early return: compiled (not interpreted), Triton 3.6 also built the code after a return
    # under a constexpr-true `if`, and `_peer` then cast the local tensor's values to a pointer
    if ONE_RANK:
        base = like_ptr
    else:
        base = _peer(table_ptr, rank, like_ptr)
    return base


def _tables(*tensors: SymmetricTensor | torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """(a pointer table per tensor, ONE_RANK): with one rank the local tensors stand in for the tables
    (`_base` reads none), so no table is filled: not even a CUDA graph's own, whose fills each replay
    runs (`pointer_table`). A plain tensor is a one-rank world's local tensor."""
    if isinstance(tensors[0], torch.Tensor) or len(tensors[0].peers) == 1:
        return [tensor if isinstance(tensor, torch.Tensor) else tensor.local for tensor in tensors], True
    return [pointer_table(tensor) for tensor in tensors], False


@triton.jit
def _both(a, b):
    """`a & b` for int1 masks of broadcastable shapes (a block and a scalar, a column and a row). Not `&`:
    Triton 3.9's interpreter broadcasts int1 into int32 blocks, which its loads and stores reject."""
    return tl.where(a, b, False)


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


@triton.jit
def _widen(x, ACC: tl.constexpr):
    """Rows -> the accumulation dtype, exactly (bf16 by its bits)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(ACC)
    return x.to(ACC)


@triton.jit
def _narrow(acc, OUT: tl.constexpr):
    """The accumulation dtype -> rows, rounded to nearest even (bf16 by its bits; NaN stays NaN)."""
    if OUT == tl.bfloat16:
        bits = acc.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(acc != acc, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return acc.to(OUT)


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
                 mask=_both(padding[:, None], inside[None, :]))
        tl.store(weights_ptr + first + pad, tl.zeros([TILE], dtype=weights_ptr.dtype.element_ty),
                 mask=_both(padding, block == 0))


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
        rows_ptr = _base(rows_table, dest, rows_like, ONE_RANK)
        tl.store(rows_ptr + row * H + offs, x, mask=_both(inside, primary))
        if WEIGHTS:
            tl.store(_base(weights_table, dest, weights_like, ONE_RANK) + row, tl.load(weights_ptr + route),
                     mask=valid & first_block)
        if RECORD:
            # a duplicate's source: the token's primary route to the same rank, an earlier k
            source = row
            for j in tl.static_range(k):
                dest_j, row_j, primary_j, _ = _decode(dst_ptr + token * K + j, rows_per_rank)
                source = tl.where(primary_j & (dest_j == dest), row_j, source)
            pair_ptr = _base(pairs_table, dest, pairs_like, ONE_RANK) + 2 * (pairs_offset + route)
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
    tables, one_rank = _tables(rows, weights, pairs)
    with launching():
        _send_routes_kernel[(num_tokens + pad_groups, triton.cdiv(width, block))](
            hidden_sh, route_weights_sk if route_weights_sk is not None else hidden_sh, dst_n, *tables,
            rows.local, weights.local, pairs.local, zero_fill_g2 if pad_groups else dst_n, num_tokens, width,
            rows.local.shape[0], pairs_offset, K=dst_n.numel() // max(num_tokens, 1),
            WEIGHTS=route_weights_sk is not None, RECORD=bool(record), ONE_RANK=one_rank,
            PAD_TILE=min(16, triton.next_power_of_2(token_padding)), BLOCK_H=block, num_warps=warps)


RECORD_SLOTS = 4096
"""Duplicate pairs `record_duplicates` reads per step of its first loop."""
RECORD_ROWS = 1024
"""Rows `record_duplicates` scans per step of its second loop (x K_P pair slots in registers)."""


@triton.jit
def _record_duplicates_kernel(pairs_ptr, num_pairs, marks_ptr, end_ptr, groups_ptr, loffs_ptr, counts_ptr,
                              K: tl.constexpr, K_P: tl.constexpr, SLOTS: tl.constexpr, ROWS: tl.constexpr):
    # 1. Each received duplicate marks its primary row with its window + 1: the K pair slots of its
    # (source rank, token), where every duplicate of that token on this rank sits (one primary each).
    for p0 in range(0, num_pairs, SLOTS):
        pair = p0 + tl.arange(0, SLOTS)
        primary = tl.load(pairs_ptr + 2 * pair + 1, mask=pair < num_pairs, other=-1)
        tl.store(marks_ptr + primary, pair // K + 1, mask=primary >= 0)
    tl.debug_barrier()  # every mark lands before the rows are scanned
    # 2. The rows the plan fills, in row order: a marked row is the next group's primary; its window's
    # duplicate rows, sorted, are the next entries of dup_loffs. Marks and pairs are reset behind.
    j_1j = tl.arange(0, K_P)[None, :]
    groups = tl.zeros([], tl.int32)
    duplicates = tl.zeros([], tl.int32)
    for r0 in range(0, tl.load(end_ptr), ROWS):
        row_c = r0 + tl.arange(0, ROWS)
        window_c = tl.load(marks_ptr + row_c, mask=row_c < tl.load(end_ptr), other=0) - 1
        marked_c = window_c >= 0
        slot_cj = window_c[:, None] * K + j_1j
        in_window_cj = _both(marked_c[:, None], j_1j < K)
        dup_cj = tl.load(pairs_ptr + 2 * slot_cj, mask=in_window_cj, other=-1)
        count_c = tl.sum((dup_cj >= 0).to(tl.int32), 1)
        sorted_cj = tl.sort(tl.where(dup_cj >= 0, dup_cj, 2147483647), dim=1)
        group_c = groups + tl.cumsum(marked_c.to(tl.int32), 0) - 1
        first_c = duplicates + tl.cumsum(count_c, 0) - count_c
        tl.store(groups_ptr + 3 * group_c, row_c, mask=marked_c)
        tl.store(groups_ptr + 3 * group_c + 1, first_c, mask=marked_c)
        tl.store(groups_ptr + 3 * group_c + 2, count_c, mask=marked_c)
        tl.store(loffs_ptr + first_c[:, None] + j_1j, sorted_cj, mask=_both(marked_c[:, None],
                                                                           j_1j < count_c[:, None]))
        tl.store(pairs_ptr + 2 * slot_cj, tl.full([ROWS, K_P], -1, tl.int32), mask=in_window_cj)
        tl.store(pairs_ptr + 2 * slot_cj + 1, tl.full([ROWS, K_P], -1, tl.int32), mask=in_window_cj)
        tl.store(marks_ptr + row_c, tl.zeros([ROWS], tl.int32), mask=marked_c)
        groups += tl.sum(marked_c.to(tl.int32), 0)
        duplicates += tl.sum(count_c, 0)
    tl.store(counts_ptr, groups)
    tl.store(counts_ptr + 1, duplicates)


def record_duplicates(pairs_p2: torch.Tensor, marks_nvs: torch.Tensor, end_1: torch.Tensor,
                      dup_groups: torch.Tensor, dup_loffs: torch.Tensor, dup_counts: torch.Tensor,
                      top_k: int) -> None:
    """The plan's dup tables from this rank's received duplicate pairs, in one launch of one program, equal
    to the torch reference's (`ReferenceExchange.record_duplicates`): groups in primary-row order, each
    group's duplicate rows ascending. Work: the `R*S*K` pairs once, then the rows the plan fills (up to
    `end_1[0]`, read on the device), never NvS. Resets the pairs it read to -1 and the marks to 0.

    Args:
        pairs_p2: `[R*S*K, 2]` int32 (row, primary row) of each received duplicate at its sender's slot, -1
            where none. marks_nvs: `[NvS]` int32 all zero (scratch). end_1: `[1]` int32, `cu_seqlens[-1:]`.
        dup_groups, dup_loffs, dup_counts: the plan's `[NvS, 3]`, `[NvS]`, `[2]` int32 tables, zero.
    """
    with launching():
        _record_duplicates_kernel[(1,)](pairs_p2, pairs_p2.shape[0], marks_nvs, end_1, dup_groups, dup_loffs,
                                        dup_counts, K=top_k, K_P=triton.next_power_of_2(top_k),
                                        SLOTS=RECORD_SLOTS, ROWS=RECORD_ROWS, num_warps=8)


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
                tl.store(rows_ptr + row * H + offs, x, mask=_both(inside, has))


def _duplicate_groups_launch(rows_nvsh: torch.Tensor, itemsize: int, max_groups: int,
                             num_sms: int | None) -> tuple[tuple[int, int], dict[str, int]]:
    """(grid, launch constants) of a kernel over the dup tables: a grid-stride loop over at most
    `max_groups` groups x row blocks sized for `itemsize`-byte elements."""
    block, warps = _row_block(rows_nvsh.shape[1], itemsize)
    programs, iterations = _group_programs(max_groups, rows_nvsh.device, num_sms)
    return ((programs, triton.cdiv(rows_nvsh.shape[1], block)),
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
def _pre_reduce_copy_kernel(target_ptr, source_ptr, end_ptr, H, BLOCK_H: tl.constexpr):
    block = tl.program_id(1)
    offs = block * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = offs < H
    wide = tl.zeros([], tl.int64)  # row offsets in int64 (NvS * H may pass 2^31)
    for row in tl.range(tl.program_id(0), tl.load(end_ptr), tl.num_programs(0)):  # rows the plan fills
        at = (row + wide) * H + offs
        tl.store(target_ptr + at, tl.load(source_ptr + at, mask=inside), mask=inside)


def copy_rows(target_nvsh: torch.Tensor, source_nvsh: torch.Tensor, end_1: torch.Tensor,
              num_sms: int | None = None) -> None:
    """`target_nvsh[:end] = source_nvsh[:end]` with `end = end_1[0]` read on the device (the plan's
    `cu_seqlens[-1:]`): a grid-stride loop over the rows the plan fills, whatever NvS is; the rows past
    `end` are not touched.

    Args:
        target_nvsh, source_nvsh: `[NvS, H]` contiguous, same dtype. end_1: `[1]` int32 on their device.
    """
    num_rows, width = target_nvsh.shape
    if num_rows == 0 or width == 0:
        return
    block, warps = _row_block(width, target_nvsh.element_size())
    programs, _ = _group_programs(num_rows, target_nvsh.device, num_sms)
    with launching():
        _pre_reduce_copy_kernel[(programs, triton.cdiv(width, block))](
            target_nvsh, source_nvsh, end_1, width, BLOCK_H=block, num_warps=warps)



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
            primary_ptrs = rows_ptr + primary * H + offs
            # the group's rows in ascending row order (duplicates are sorted; the primary slots in where it
            # belongs); +0.0 is added where nothing is (exact: the sum starts at +0.0, so is never -0.0)
            total = tl.zeros([BLOCK_H], dtype=ACC)
            added = tl.full([], 0, tl.int1)
            for i in tl.static_range(MAX_DUPS):
                has = i < count
                row = tl.load(loffs_ptr + first + i, mask=has, other=0).to(tl.int64)
                primary_now = has & (row > primary) & ~added
                total += _widen(tl.load(primary_ptrs, mask=_both(inside, primary_now), other=0.0), ACC)
                added = added | primary_now
                total += _widen(tl.load(rows_ptr + row * H + offs, mask=_both(inside, has), other=0.0), ACC)
            total += _widen(tl.load(primary_ptrs, mask=_both(inside, ~added), other=0.0), ACC)
            tl.store(primary_ptrs, _narrow(total, rows_ptr.dtype.element_ty), mask=inside)


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
                                 ACC=_TL_DTYPES[accumulate], MAX_DUPS=max_duplicates, **launch)


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
        rows_ptr = _base(rows_table, dest, rows_like, ONE_RANK)
        x = tl.load(rows_ptr + row * H + offs, mask=_both(inside, primary), other=0.0)
        total += _widen(x, ACC)
        if WEIGHTS:
            weight = tl.load(_base(weights_table, dest, weights_like, ONE_RANK) + row,
                             mask=valid & first_block,
                             other=0.0)
            tl.store(weights_out_ptr + route, weight, mask=first_block)
    tl.store(out_ptr + token.to(tl.int64) * H + offs, _narrow(total, out_ptr.dtype.element_ty), mask=inside)


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
    tables, one_rank = _tables(rows, *([weights] if with_weights else []))
    rows_nvsh = tables[0] if one_rank else rows.local
    with launching():
        _gather_routes_kernel[(num_tokens, triton.cdiv(width, block))](
            out_sh, weights_out_sk if with_weights else out_sh, dst_n, tables[0], tables[-1], rows_nvsh,
            weights.local if with_weights else rows_nvsh, width, rows_nvsh.shape[0],
            ACC=_TL_DTYPES[accumulate], K=dst_n.numel() // num_tokens, WEIGHTS=with_weights,
            ONE_RANK=one_rank, BLOCK_H=block, num_warps=warps)


# -- weights -------------------------------------------------------------------------------------------------


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
    used = expert >= 0
    expert = tl.maximum(expert, 0)
    source = _peer(home_table, expert // experts_per_rank, home_like) + (expert % experts_per_rank).to(
        tl.int64) * numel
    target = slots_ptr + slot.to(tl.int64) * numel
    for i in tl.range(ITERATIONS):
        offs = (chunk * ITERATIONS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        tl.store(target + offs, tl.load(source + offs, mask=_both(inside, used), other=0.0), mask=inside)


def copy_experts(home: SymmetricTensor, slots_b: torch.Tensor, experts_b: torch.Tensor) -> None:
    """`slots_b[j] = home expert experts_b[j]` from its home rank (expert e lives on rank e // epn at
    index e % epn of `home`), a zero row where `experts_b[j]` is -1 (peer reads; the caller barriers).

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
            slots_b, experts_b, pointer_table(home), home.local, numel, home.local.shape[0], BLOCK=block,
            ITERATIONS=iterations, num_warps=warps)


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
        total = _widen(tl.load(target + offs, mask=inside), ACC)
        for j in tl.static_range(MAX_REPLICAS):
            source = tl.load(sources_ptr + expert * MAX_REPLICAS + j)
            has = source >= 0
            source = tl.maximum(source, 0)
            replica = _peer(slots_table, source // num_slots, slots_like) + (source % num_slots).to(
                tl.int64) * numel
            # the reference's exchange of one slot index: `home += replica.to(home dtype)` for every rank
            # holding the expert in that slot, summed in ACC and rounded to the home dtype once
            x = _narrow(_widen(tl.load(replica + offs, mask=_both(inside, has), other=0.0), ACC), HOME)
            total += _widen(x, ACC)
            if j + 1 < MAX_REPLICAS:
                following = tl.load(sources_ptr + expert * MAX_REPLICAS + j + 1)
                last_of_slot = (following < 0) | (following % num_slots != source % num_slots)
                total = tl.where(last_of_slot, _widen(_narrow(total, HOME), ACC), total)
        tl.store(target + offs, _narrow(total, HOME), mask=inside)


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
            home_x, sources_xr, pointer_table(slots), slots.local, numel, slots.local.shape[0],
            ACC=_TL_DTYPES[accumulate], MAX_REPLICAS=max_replicas, BLOCK=block, ITERATIONS=iterations,
            num_warps=warps)
