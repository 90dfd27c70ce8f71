"""Triton helpers shared by the row, expert and elementwise kernels: peer pointer tables, dtype widening,
int64 offsets."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moonep_moe.transport.world import SymmetricTensor

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float64: tl.float64}


ALIGNMENT = 16
"""Bytes every peer base address must be a multiple of (what the kernels promise the compiler)."""


def device_programs(capacity: int, device: torch.device, per_sm: int, num_sms: int | None = None) -> int:
    """Programs of a grid-stride loop over at most `capacity` items: `per_sm` per SM of the CUDA device
    (`num_sms` of them, default the device's), 4 on the CPU (Triton's interpreter), never more than the
    items and at least one."""
    if device.type == "cuda":
        programs = per_sm * (num_sms or torch.cuda.get_device_properties(device).multi_processor_count)
    else:
        programs = 4
    return max(1, min(capacity, programs))


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


@triton.jit
def peer(table_ptr, rank, like_ptr):
    """Rank `rank`'s base pointer from a pointer table, typed like `like_ptr`."""
    address = tl.load(table_ptr + rank)
    return tl.multiple_of(address.to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)


@triton.jit
def base(table_ptr, rank, like_ptr, ONE_RANK: tl.constexpr):
    """`peer`, or `like_ptr` itself where the world has one rank (every access is to this rank's own
    tensor, which needs no pointer table)."""
    # if/else, not an early return: compiled (not interpreted), Triton 3.6 also built the code after a return
    # under a constexpr-true `if`, and `peer` then cast the local tensor's values to a pointer
    if ONE_RANK:
        base = like_ptr
    else:
        base = peer(table_ptr, rank, like_ptr)
    return base


def pointer_tables(*tensors: SymmetricTensor | torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """(a pointer table per tensor, ONE_RANK): with one rank the local tensors stand in for the tables
    (`base` reads none), so no table is filled: not even a CUDA graph's own, whose fills each replay
    runs (`pointer_table`). A plain tensor is a one-rank world's local tensor."""
    if isinstance(tensors[0], torch.Tensor) or len(tensors[0].peers) == 1:
        return [tensor if isinstance(tensor, torch.Tensor) else tensor.local for tensor in tensors], True
    return [pointer_table(tensor) for tensor in tensors], False


@triton.jit
def both(a, b):
    """`a & b` for int1 masks of broadcastable shapes (a block and a scalar, a column and a row). Not `&`:
    Triton 3.9's interpreter broadcasts int1 into int32 blocks, which its loads and stores reject."""
    return tl.where(a, b, False)


@triton.jit
def as_int64(index):
    """`index` as int64 (offsets past 2^31 elements); a loop counter is an int32 compiled and a Python int in
    the interpreter, so this adds, not casts."""
    return index + tl.zeros([], tl.int64)


@triton.jit
def widen(x, ACC: tl.constexpr):
    """Rows -> the accumulation dtype, exactly (bf16 by its bits)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(ACC)
    return x.to(ACC)


@triton.jit
def narrow(acc, OUT: tl.constexpr):
    """The accumulation dtype -> rows, rounded to nearest even (bf16 by its bits; NaN stays NaN)."""
    if OUT == tl.bfloat16:
        bits = acc.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(acc != acc, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return acc.to(OUT)
