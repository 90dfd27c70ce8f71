"""Expert rows as one tensor without copies: a layer's home experts and the shared slot pool, mapped back
to back in virtual memory (CUDA VMM).

Grouped GEMMs take one `[groups, out, in]` weight tensor, but a rank's compute groups live in two places: the
layer's `epn` home experts and the `B` prefetch slots shared by every layer of that shape. Joining them with
`torch.cat` copies `epn + B` experts on every GEMM call. Instead, each layer reserves a virtual range of
`epn + B` experts and maps two physical allocations into it: its own home experts, then the process-wide
slot pool (the same physical memory for every layer, also mapped once on its own for prefetch writes). The
result is an ordinary `[epn + B, out, in]` tensor whose first `epn` rows are the parameters and whose last `B`
rows are the slots. `with_scratch_rows` joins the same way a layer's own rows to scratch rows that many layers
share (the FP8 copies of the slots, cast before each GEMM that reads them).

Needs CUDA, the `cuda-python` driver bindings (`cuda.bindings.driver`) and region sizes that are multiples of
the allocation granularity (2 MiB: true of the real models' expert shapes). `expert_arena_reason` says why
not otherwise, and callers fall back to separate tensors and a copy.

Owns memory outside PyTorch's caching allocator: `PhysicalRows` and `ArenaView` free it when collected.
`torch.cuda.memory_allocated` does not count it; `physical_bytes` does.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Hashable

import torch

from moonep_moe.base.sizes import align_up

_GRANULARITY: dict[int, int] = {}
_PHYSICAL_BYTES: dict[int, int] = {}
"""Bytes of the live `PhysicalRows` per device index."""


def physical_bytes(device: torch.device | str) -> int:
    """Bytes of device memory the arena holds on `device` now (every live `PhysicalRows`): memory that
    `torch.cuda.memory_allocated` and `max_memory_allocated` leave out, constant between layer builds."""
    device = torch.device(device)
    if device.type != "cuda" or not _PHYSICAL_BYTES:
        return 0
    return _PHYSICAL_BYTES.get(_index(device), 0)


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _released(device_index: int, nbytes: int, release, handle) -> None:
    _PHYSICAL_BYTES[device_index] -= nbytes
    release(handle)


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result):
    """cuda-python returns `(CUresult, *values)`: raise on an error, return the values."""
    error, *values = result
    if int(error) != 0:
        raise RuntimeError(f"CUDA driver call failed: {error}")
    return values[0] if len(values) == 1 else values


def _properties(device: torch.device):
    cu = _driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device.index
    return prop


def granularity(device: torch.device) -> int:
    """Bytes every mapped region must be a multiple of on `device`."""
    if device.index not in _GRANULARITY:
        cu = _driver()
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        _GRANULARITY[device.index] = int(_check(cu.cuMemGetAllocationGranularity(_properties(device), flag)))
    return _GRANULARITY[device.index]


def expert_arena_reason(device: torch.device, region_bytes: list[int]) -> str | None:
    """Why the arena cannot hold regions of these sizes on `device`, or None when it can."""
    if device.type != "cuda":
        return "the arena maps CUDA memory"
    try:
        _driver()
    except ImportError:
        return "cuda-python (cuda.bindings.driver) is not installed"
    unit = granularity(device)
    if any(size % unit for size in region_bytes):
        return f"region sizes {region_bytes} are not multiples of the {unit}-byte VMM granularity"
    return None


def _as_tensor(pointer: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
               owner: object) -> torch.Tensor:
    """A tensor over `pointer`'s memory that keeps `owner` alive."""

    class _Memory:
        __cuda_array_interface__ = {"data": (pointer, False), "shape": (math.prod(shape) * dtype.itemsize,),
                                    "typestr": "|u1", "version": 3}

        def __init__(self):
            self.owner = owner

    return torch.as_tensor(_Memory(), device=device).view(dtype).view(shape)


class _Mapping:
    """A reserved virtual range with regions mapped into it; unmapped and freed when collected."""

    def __init__(self, device: torch.device, regions: list[tuple[object, int]]):
        cu = _driver()
        self.size = sum(size for _, size in regions)
        self.pointer = int(_check(cu.cuMemAddressReserve(self.size, granularity(device), 0, 0)))
        offset = 0
        for handle, size in regions:
            _check(cu.cuMemMap(cu.CUdeviceptr(self.pointer + offset), size, 0, handle, 0))
            offset += size
        access = cu.CUmemAccessDesc()
        access.location = _properties(device).location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(cu.CUdeviceptr(self.pointer), self.size, [access], 1))
        self.handles = [handle for handle, _ in regions]  # the physical memory outlives the mapping
        weakref.finalize(self, _unmap, self.pointer, self.size)


def _unmap(pointer: int, size: int) -> None:
    cu = _driver()
    torch.cuda.synchronize()
    cu.cuMemUnmap(cu.CUdeviceptr(pointer), size)
    cu.cuMemAddressFree(cu.CUdeviceptr(pointer), size)


class PhysicalRows:
    """`rows` expert matrices of `row_shape` (`[out, in]`) in one physical allocation, plus its own mapping
    as `tensor`."""

    def __init__(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        cu = _driver()
        self.rows, self.row_shape, self.dtype, self.device = rows, tuple(row_shape), dtype, device
        self.nbytes = rows * math.prod(row_shape) * dtype.itemsize
        self.handle = _check(cu.cuMemCreate(self.nbytes, _properties(device), 0))
        index = _index(device)
        _PHYSICAL_BYTES[index] = _PHYSICAL_BYTES.get(index, 0) + self.nbytes
        weakref.finalize(self, _released, index, self.nbytes, cu.cuMemRelease, self.handle)
        mapping = _Mapping(device, [(self.handle, self.nbytes)])
        self.tensor = _as_tensor(mapping.pointer, (rows, *self.row_shape), dtype, device, mapping)


def joined_rows(first: PhysicalRows, second: PhysicalRows) -> torch.Tensor:
    """`[first.rows + second.rows, out, in]`: both allocations back to back, no copy (writes to either are
    seen through it)."""
    mapping = _Mapping(first.device, [(first.handle, first.nbytes), (second.handle, second.nbytes)])
    return _as_tensor(mapping.pointer, (first.rows + second.rows, *first.row_shape), first.dtype,
                      first.device, (mapping, first, second))


_SCRATCH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""`(device index, key)` -> the `PhysicalRows` that `with_scratch_rows` maps for that key, while a tensor
mapping it lives."""


def with_scratch_rows(first: PhysicalRows, rows: int, key: Hashable) -> torch.Tensor:
    """`[first.rows + rows, out, in]`: `first`'s memory, then `rows` rows of scratch memory that every tensor
    made with the same `key` on `first`'s device maps too (no copy). `first.nbytes` must be a multiple of the
    granularity (`expert_arena_reason`).

    For rows that live from a write to the reads after it, in one stream's order (e.g. a GEMM's operand cast
    just before it): a write through any tensor of that key overwrites them. The scratch is one allocation of
    the most bytes asked for so far, rounded up to the granularity; a larger request makes a new one (the
    tensors made before keep the old)."""
    device = first.device
    nbytes = align_up(rows * math.prod(first.row_shape) * first.dtype.itemsize, granularity(device))
    index = (_index(device), key)
    scratch = _SCRATCH.get(index)
    if scratch is None or scratch.nbytes < nbytes:
        scratch = _SCRATCH[index] = PhysicalRows(1, (nbytes,), torch.uint8, device)
    # the whole scratch is mapped: the driver maps no part of an allocation (CUDA_ERROR_NOT_SUPPORTED)
    mapping = _Mapping(device, [(first.handle, first.nbytes), (scratch.handle, scratch.nbytes)])
    return _as_tensor(mapping.pointer, (first.rows + rows, *first.row_shape), first.dtype, device,
                      (mapping, first, scratch))
