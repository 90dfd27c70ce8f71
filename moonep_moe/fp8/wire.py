"""FP8 activations on the wire: an e4m3 row and its 1x128 fp32 scales packed into one byte row, so the
Buffer's row exchanges (every EP world, the torch reference and the Triton row kernels) move FP8 rows as
rows of another width, inside the memory of its own rows (no new memory).

The packed row of H e4m3 values with their C = ceil(H/128) scales (notation: DESIGN.md; `gemm.fp8`'s
`quantise_rows` and `kernels.fp8_cast.cast_rows` make such rows):

    bytes [0, H)                           the e4m3 values
    bytes [align4(H), align4(H) + 4*C)     the fp32 scales
    up to packed_width(H)                  padding, so every packed row starts 16-byte aligned

`packed_width(H) = align16(align4(H) + 4*C)`: DeepSeek-V3's H = 7168 packs into 7392 bytes, 51.6% of its
14336 bf16 bytes (the scales are 3.1% of the e4m3 bytes; the padding is 0 there). A dispatch is a copy, so
the received e4m3 bytes and scales are exactly the sender's.

Names: a packed row stands for a row of width H (`packed_sh`, `packed_nvsh`), its scales are named after the
rows they scale (`scales_sh [s, C]`, as `gemm.fp8` names them).
"""

from __future__ import annotations

import torch

from moonep_moe.fp8.format import BLOCK, FP8_DTYPE

SCALE_BYTES = torch.float32.itemsize
"""Bytes of one 1x128 tile's scale (fp32)."""
ROW_ALIGNMENT = 16
"""Packed rows start at multiples of this many bytes (16-byte vector accesses, TMA's alignment)."""


def scale_columns(hidden: int) -> int:
    """C: the 1x128 scales of a row of `hidden` values (a tail tile of `hidden % 128` has its own)."""
    return -(-hidden // BLOCK)


def _scales_offset(hidden: int) -> int:
    return -(-hidden // SCALE_BYTES) * SCALE_BYTES


def packed_width(hidden: int) -> int:
    """Bytes of the packed row of `hidden` e4m3 values and their scales (the layout above)."""
    end = _scales_offset(hidden) + SCALE_BYTES * scale_columns(hidden)
    return -(-end // ROW_ALIGNMENT) * ROW_ALIGNMENT


def unpack_rows(packed_nvsh: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of `[rows, packed_width(hidden)]` uint8 packed rows (contiguous rows, 16-byte aligned): the e4m3
    rows `[rows, hidden]` (row stride `packed_width`) and their fp32 scales `[rows, C]` (row stride
    `packed_width / 4`). Writing the views writes the packed rows."""
    start = _scales_offset(hidden)
    scales_bytes = packed_nvsh[:, start:start + SCALE_BYTES * scale_columns(hidden)]
    return packed_nvsh[:, :hidden].view(FP8_DTYPE), scales_bytes.view(torch.float32)


def pack_rows(q_sh: torch.Tensor, scales_sh: torch.Tensor) -> torch.Tensor:
    """`[s, packed_width(H)]` uint8 packed rows (contiguous, padding bytes zero) of e4m3 rows `q_sh [s, H]`
    and their fp32 scales `scales_sh [s, C]` (any strides, e.g. the GEMM's MN-major scales). Two copies of
    the rows' bytes, plus the zeroing of padding where a row has any."""
    num_tokens, hidden = q_sh.shape
    width = packed_width(hidden)
    packed_sh = torch.empty(num_tokens, width, dtype=torch.uint8, device=q_sh.device)
    q_view, scales_view = unpack_rows(packed_sh, hidden)
    q_view.view(torch.uint8).copy_(q_sh.view(torch.uint8))  # bytes: torch has few CPU float8 kernels
    scales_view.copy_(scales_sh)
    start, end = _scales_offset(hidden), _scales_offset(hidden) + scales_view.shape[1] * SCALE_BYTES
    for first, last in ((hidden, start), (end, width)):
        if first < last:
            packed_sh[:, first:last].zero_()
    return packed_sh
