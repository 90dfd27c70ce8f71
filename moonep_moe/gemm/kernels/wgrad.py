"""Triton grouped weight gradient: ``out[g] = dy[start:end]^T @ x[start:end]`` accumulated in fp32, written
straight into the gradients (fp32, or the parameters' dtype).

The contract is ``GroupedGemm.wgrad`` (`moonep_moe.gemm.base`), and so are the names: suffix letters
of DESIGN.md, "Notation" (``g`` groups: home experts, then prefetch slots), the GEMM's own sizes spelled out
after the forward product, ``dy [rows, cols]``, ``x [rows, inner]``, ``out[g] [cols, inner]``.

Why a kernel: for the expert shapes of large models the fp32 gradient write dominates the weight gradient
(DeepSeek-V3, ~256 rows per expert: each expert's ``[2048, 7168]`` fp32 gradient is 59 MB to write against
7.5 GFLOP). ``torch._grouped_mm`` must output bf16, so its wgrad writes bf16 products and a second pass reads
them and writes (or adds into) the fp32 gradients. Here each program owns one ``[BLOCK_COLS, BLOCK_INNER]``
tile of one group's gradient, accumulates ``dy^T x`` over the group's rows in fp32 on the tensor cores (bf16
or fp16 inputs) and writes the tile once, rounded to the output's dtype: overwrite, or add to what is there in
fp32 (``accumulate``).

Grid: one program per (group, tile), 1D, group-major, tiles swizzled in bands of ``SWIZZLE`` tile rows so the
programs running at once share both operands in L2. A group's rows are data (``offs_g`` on the device, no
host read): an empty group's programs store zeros (overwrite) or exit (accumulate, and an unused prefetch
slot's: ``zeroed_groups``) at once.

Groups live in up to two output tensors per launch (home gradients, then the slot-gradient pool), passed as
two base pointers and the first one's group count (the two may differ in dtype, e.g. bf16 home gradients and
fp32 slot gradients): no concatenation, no pointer table to upload. More parts take one launch per pair.

Tile configs are autotuned per ``(cols, inner)`` and dtypes before the first call (host syncs then; Triton
caches the choice on disk), on a launch of its own (`_tune`): every row of ``dy`` and ``x`` dealt evenly over
`TUNING_GROUPS` groups (`tuning_ends`), overwriting scratch outputs of the call's dtypes (the same autotuner
key). Not on the call's own rows: those are data the host does not see, and a first call often has few or
none (the slot groups of a rank the plan gives one replica or none, whose programs exit at once), where the
timings say nothing of the tiles. Not into the call's outputs: an accumulating call's timing runs would add
into the gradients, and a copy of them costs memory (a DeepSeek-V3 layer's fp32 gate_up gradient is 28 GiB,
and its copy ran the H200 out of memory in `main_grad` mode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from moonep_moe.base.interpreter import INTERPRETED, launching
from moonep_moe.base.sizes import cdiv

SWIZZLE = 8
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _configs() -> list[triton.Config]:
    """sm90 tiles (the accumulator is ``[BLOCK_COLS, BLOCK_INNER]`` fp32, rows consumed ``BLOCK_ROWS`` at a
    time); the interpreter gets one small tile so CPU tests cover several tiles and masked tails."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_COLS": 32, "BLOCK_INNER": 32, "BLOCK_ROWS": 64}, num_warps=4,
                              num_stages=1)]
    tiles = [  # (BLOCK_COLS, BLOCK_INNER, BLOCK_ROWS, num_warps, num_stages)
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
    ]
    return [triton.Config({"BLOCK_COLS": bc, "BLOCK_INNER": bi, "BLOCK_ROWS": br}, num_warps=w, num_stages=s)
            for bc, bi, br, w, s in tiles]


@triton.autotune(configs=_configs(), key=["cols", "inner"], cache_results=True)
@triton.jit
def _grouped_wgrad_kernel(dy_ptr, x_ptr, offs_ptr, out0_ptr, out1_ptr, groups0, first_group, zeroed_groups,
                          cols, inner, stride_dy, stride_x, stride_out0, stride_out1,
                          ACCUMULATE: tl.constexpr, SWIZZLE: tl.constexpr, INTERPRET_ROWS: tl.constexpr,
                          BLOCK_COLS: tl.constexpr, BLOCK_INNER: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    tiles_cols = tl.cdiv(cols, BLOCK_COLS)
    tiles_inner = tl.cdiv(inner, BLOCK_INNER)
    tiles = tiles_cols * tiles_inner
    group = pid // tiles
    tile = pid % tiles
    band_tiles = SWIZZLE * tiles_inner
    band_first_col = (tile // band_tiles) * SWIZZLE
    band_rows = tl.minimum(tiles_cols - band_first_col, SWIZZLE)
    tile_col = band_first_col + (tile % band_tiles) % band_rows
    tile_inner = (tile % band_tiles) // band_rows

    segment = first_group + group
    end = tl.load(offs_ptr + segment)
    start = tl.load(offs_ptr + segment - 1, mask=segment > 0, other=0)
    count = end - start
    if (count <= 0) & (segment >= zeroed_groups):  # nothing to add, or an unused slot's gradient: no store
        return

    col_ids = tile_col * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    inner_ids = tile_inner * BLOCK_INNER + tl.arange(0, BLOCK_INNER)
    live_cols = col_ids < cols
    live_inner = inner_ids < inner
    dy_rows = dy_ptr + start.to(tl.int64) * stride_dy
    x_rows = x_ptr + start.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_COLS, BLOCK_INNER), dtype=tl.float32)
    # INTERPRET_ROWS is 0 when compiled. Triton's interpreter (3.6, numpy 2.4) can neither loop to a device
    # value nor multiply bf16 in tl.dot: there it is the row count of dy and x, the loop visits all rows
    # (masked) and the tiles are widened to fp32 first (exact: the products of bf16 values are exact in fp32
    # either way).
    for first_row in range(0, INTERPRET_ROWS if INTERPRET_ROWS else count, BLOCK_ROWS):
        rows = first_row + tl.arange(0, BLOCK_ROWS)
        live_rows = rows < count
        dy_tile = tl.load(dy_rows + rows[:, None] * stride_dy + col_ids[None, :],
                          mask=live_rows[:, None] & live_cols[None, :], other=0.0)
        x_tile = tl.load(x_rows + rows[:, None] * stride_x + inner_ids[None, :],
                         mask=live_rows[:, None] & live_inner[None, :], other=0.0)
        if INTERPRET_ROWS:
            dy_tile, x_tile = dy_tile.to(tl.float32), x_tile.to(tl.float32)
        acc = tl.dot(tl.trans(dy_tile), x_tile, acc)

    if group < groups0:
        _store_tile(out0_ptr + group.to(tl.int64) * stride_out0, acc, col_ids, inner_ids, inner, live_cols,
                    live_inner, ACCUMULATE)
    else:
        _store_tile(out1_ptr + (group - groups0).to(tl.int64) * stride_out1, acc, col_ids, inner_ids, inner,
                    live_cols, live_inner, ACCUMULATE)


@triton.jit
def _store_tile(out_ptr, acc, col_ids, inner_ids, inner, live_cols, live_inner, ACCUMULATE: tl.constexpr):
    """Write (or add in fp32 into) one ``[BLOCK_COLS, BLOCK_INNER]`` tile of a ``[cols, inner]`` matrix of any
    float dtype (a function so the two output parts may differ in dtype)."""
    tile_ptrs = out_ptr + col_ids[:, None] * inner + inner_ids[None, :]
    live_tile = live_cols[:, None] & live_inner[None, :]
    if ACCUMULATE:
        acc += tl.load(tile_ptrs, mask=live_tile, other=0.0).to(tl.float32)
    tl.store(tile_ptrs, acc.to(out_ptr.dtype.element_ty), mask=live_tile)


def _check(dy: torch.Tensor, x: torch.Tensor, offs_g: torch.Tensor, out: Sequence[torch.Tensor],
           first_group: int) -> None:
    """Shapes, dtypes and layouts the kernel assumes (no host read of device data)."""
    if dy.dtype not in (torch.bfloat16, torch.float16) or x.dtype != dy.dtype:
        raise ValueError(f"dy and x must both be bfloat16 or float16, got {dy.dtype}, {x.dtype}")
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy [rows, cols] and x [rows, inner] must share rows, got {list(dy.shape)}, "
                         f"{list(x.shape)}")
    if dy.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("dy and x must have unit column stride")
    cols, inner = dy.shape[1], x.shape[1]
    for part in out:
        if part.dtype not in OUT_DTYPES or part.shape[1:] != (cols, inner) or part.stride()[1:] != (inner, 1):
            raise ValueError(f"every out part must be [g, {cols}, {inner}] of {OUT_DTYPES} with contiguous "
                             f"[cols, inner] matrices, got {part.dtype} {list(part.shape)} strides "
                             f"{part.stride()}")
    if offs_g.dtype != torch.int32 or offs_g.numel() != first_group + sum(part.shape[0] for part in out):
        raise ValueError(f"offs_g must be int32 [G], G = first_group ({first_group}) + groups in out; got "
                         f"{offs_g.dtype} {list(offs_g.shape)}")


def grouped_wgrad_triton(dy: torch.Tensor, x: torch.Tensor, offs_g: torch.Tensor, out: Sequence[torch.Tensor],
                         accumulate: bool, first_group: int = 0, slot_groups_from: int | None = None) -> None:
    """``out[g] (+)= dy[start:end]^T @ x[start:end]`` for every group g >= ``first_group``, accumulated in
    fp32.

    Args:
        dy: ``[rows, cols]`` bf16/fp16 output gradients, rows grouped by ``offs_g``.
        x: ``[rows, inner]`` inputs of the same dtype.
        offs_g: int32 ``[G]`` group end offsets (device); rows at and past ``offs_g[-1]`` are never read.
        out: ``[g_i, cols, inner]`` parts (float32, bfloat16 or float16, each ``[cols, inner]`` matrix
            contiguous) whose groups concatenate to groups ``[first_group, G)`` (home gradients, then slots).
        accumulate: add into ``out``; False overwrites every group (empty ones with zeros), except the
            empty groups from ``slot_groups_from`` on.
        first_group: the groups before it are not computed (e.g. the slots alone, the home experts'
            gradients being made by another GEMM); their rows are never read.
        slot_groups_from: the first prefetch-slot group (in ``offs_g``'s numbering): an empty slot group is
            an unused slot, whose gradient nothing reads (every slot a plan fills has rows), so it is not
            written, not even on overwrite: zeros the size of an fp32 gradient per unused slot would be
            stored for nothing. None: no slot groups, every empty group is written with zeros on overwrite.
    """
    _check(dy, x, offs_g, out, first_group)
    zeroed_groups = 0 if accumulate else offs_g.numel() if slot_groups_from is None else slot_groups_from
    for pair in (out[i:i + 2] for i in range(0, len(out), 2)):
        out0, out1 = pair[0], pair[-1]
        groups0 = out0.shape[0]
        groups = groups0 + (out1.shape[0] if len(pair) == 2 else 0)
        if groups:
            _tune(dy, x, out0, out1)
            _launch(dy, x, offs_g, out0, out1, groups, groups0, first_group, accumulate, zeroed_groups)
        first_group += groups


def _launch(dy: torch.Tensor, x: torch.Tensor, offs_g: torch.Tensor, out0: torch.Tensor, out1: torch.Tensor,
            groups: int, groups0: int, first_group: int, accumulate: bool, zeroed_groups: int) -> None:
    """One launch over groups `[first_group, first_group + groups)`, the first `groups0` in `out0`; an empty
    group is written (zeros) only below `zeroed_groups`."""
    cols, inner = dy.shape[1], x.shape[1]
    grid = lambda meta: (
        groups * cdiv(cols, meta["BLOCK_COLS"]) * cdiv(inner, meta["BLOCK_INNER"]),)
    _grouped_wgrad_kernel[grid](dy, x, offs_g, out0, out1, groups0, first_group, zeroed_groups, cols, inner,
                                dy.stride(0), x.stride(0), out0.stride(0), out1.stride(0),
                                ACCUMULATE=accumulate, SWIZZLE=SWIZZLE,
                                INTERPRET_ROWS=dy.shape[0] if INTERPRETED else 0)


TUNING_GROUPS = 8
"""Groups of the tuning launch (`tuning_ends`)."""
_TUNED: set[tuple] = set()


def tuning_ends(rows: int, device: torch.device | str) -> torch.Tensor:
    """``[TUNING_GROUPS]`` int32 ends of the tuning launch's groups: `rows` dealt evenly, each group a
    multiple of 16 rows (the layer's smallest segment alignment)."""
    each = rows // TUNING_GROUPS // 16 * 16
    return torch.arange(1, TUNING_GROUPS + 1, dtype=torch.int32, device=device) * each


def _tune(dy: torch.Tensor, x: torch.Tensor, out0: torch.Tensor, out1: torch.Tensor) -> None:
    """Before the first launch of a shape and dtypes in this process: an overwriting launch over every row of
    `dy` and `x` in `TUNING_GROUPS` even groups (`tuning_ends`), into scratch outputs of `out0`'s and `out1`'s
    dtypes, which runs the autotuner (or loads its disk cache) for the key the call's launch uses."""
    key = (dy.dtype, dy.shape[1], x.shape[1], out0.dtype, out1.dtype, dy.device)
    if key in _TUNED or INTERPRETED:  # the interpreter has one config: nothing to tune
        return
    matrix = (dy.shape[1], x.shape[1])  # [cols, inner]
    scratch0 = torch.empty((TUNING_GROUPS - 1, *matrix), dtype=out0.dtype, device=out0.device)
    scratch1 = torch.empty((1, *matrix), dtype=out1.dtype, device=out1.device)
    _launch(dy, x, tuning_ends(dy.shape[0], dy.device), scratch0, scratch1, TUNING_GROUPS, TUNING_GROUPS - 1,
            first_group=0, accumulate=False, zeroed_groups=TUNING_GROUPS)
    _TUNED.add(key)


@triton.jit
def _wgrad_zero_filled_kernel(out_ptr, offs_ptr, first_group, numel, BLOCK: tl.constexpr):
    group, program = tl.program_id(0), tl.program_id(1)
    at = first_group + group
    start = tl.load(offs_ptr + at - 1, mask=at > 0, other=0)
    if tl.load(offs_ptr + at) > start:  # an empty segment's matrix keeps what it holds
        base = group.to(tl.int64) * numel
        for chunk in tl.range(program * BLOCK, numel, tl.num_programs(1) * BLOCK):
            i = chunk + tl.arange(0, BLOCK)
            tl.store(out_ptr + base + i, tl.zeros([BLOCK], out_ptr.dtype.element_ty), mask=i < numel)


ZERO_BLOCK = 2048
"""Elements a `zero_filled_groups` program clears per step of its loop."""


def zero_filled_groups(out_gmn: torch.Tensor, offs_g: torch.Tensor, first_group: int = 0) -> None:
    """Zero the matrices of ``out [g, cols, inner]`` (contiguous; groups ``first_group..`` of ``offs_g``)
    whose segment has rows, read on the device (no host read); the others keep what they hold. What an
    overwrite of gradients costs where the GEMM can only add (DeepGEMM's sm90 k-grouped FP8 kernel): the
    used prefetch slots are cleared, not the whole slot pool."""
    groups, numel = out_gmn.shape[0], out_gmn[0].numel() if out_gmn.shape[0] else 0
    if not out_gmn.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out_gmn.stride()}")
    if groups and numel:
        grid = (groups, min(cdiv(numel, ZERO_BLOCK), 1024))
        with launching():
            _wgrad_zero_filled_kernel[grid](out_gmn, offs_g, first_group, numel, BLOCK=ZERO_BLOCK,
                                            num_warps=4)
