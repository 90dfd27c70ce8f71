"""The EP world: which rank this is, and how ranks see each other's memory.

Every backend implements the small `EPWorld` protocol below; the Buffer and the weight pools use nothing
else, so the same layer code runs on every transport:

- `all_gather(t)`: the small collective of a step (the `[E]` histograms become `[R, E]`);
- `symmetric(key, tensor)`: a collective registration (like `symm_mem.rendezvous`) after which every rank
  can read and write every other rank's tensor of that key through `SymmetricTensor.peer(r)`;
- `scatter_rows(target, rank_n, row_n, values_n)` / `gather_rows(source, rank_n, row_n)`: the collective
  row exchanges every Buffer operation is made of (write rows into, or read rows from, other ranks'
  symmetric tensors). Their index tensors have a length fixed by the config: an entry whose rank is -1
  means "nothing" (not written; read back as a zero row), so callers never mask and nothing in an exchange
  reads a device value on the host;
- `barrier()`: orders the phases of an exchange (writes before reads, reads before the next writes);
- `globals`: this process's state shared by all layers (the slot pools live there).

Notation and suffixes: DESIGN.md, "Notation"; in the row exchanges `n` counts the entries of one call (routes,
slots or ranks, as the Buffer calls them) and `c` is the call's `capacity`.

The backends: `threads` (thread ranks), `symmetric` (torch symmetric memory), `collective`
(torch.distributed); `registry` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

import torch

BARRIER_TIMEOUT_S = 300.0
"""A rank that waits longer than this at a barrier raises instead of hanging the whole group (the last resort:
a deadlock a world can see, such as a thread-rank waiting for a rank that has finished, raises at once)."""


class RankFailedError(RuntimeError):
    """A rank's failure, reported by someone other than that rank (a peer, or `run_ranks` on the caller's
    thread): the message names the rank(s) and what went wrong; the failed rank's own exception, where there
    is one, is the `__cause__`."""


def indexed_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device, a bare "cuda" given the current device's index: what a world holds, so
    that it compares equal to its tensors' devices (they report their index)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def failure_message(rank: int, error: BaseException) -> str:
    """`rank r failed: <type>: <message>`: how every world reports a rank's exception."""
    return f"rank {rank} failed: {type(error).__name__}: {error}"


def call_site(frame: FrameType | None, skip: Callable[[FrameType], bool]) -> str:
    """`"f <- g"`: the qualified names of the innermost two functions of the stack at `frame` (`frame`, then
    its callers) that `skip` does not pass over; "unknown" without a frame."""
    names = []
    while frame is not None and len(names) < 2:
        if not skip(frame):
            names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    return " <- ".join(names) or "unknown"


class EPWorld(Protocol):
    """What the comm core needs from a transport. `rank` in [0, size); `device` holds this rank's tensors."""

    rank: int
    size: int
    device: torch.device
    globals: dict[Any, Any]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[*shape]` on every rank -> `[size, *shape]`, identical on every rank (a fresh tensor)."""
        ...

    def barrier(self) -> None:
        """Returns once every rank has reached it and the work this rank queued before it is done."""
        ...

    def symmetric(self, key: str, tensor: torch.Tensor) -> SymmetricTensor:
        """Collective: every rank registers its `tensor` under `key` (same shape and dtype on every rank).
        The result's `local` is `tensor` itself: a world that needs special memory moves the contents there
        and re-points `tensor` at it, so register a tensor before taking views of it."""
        ...

    def scatter_rows(self, target: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor,
                     values_n: torch.Tensor, *, capacity: int | None = None) -> None:
        """Collective: `target` on rank `rank_n[i]` gets `values_n[i]` at row `row_n[i]` (`[n]` int64 ranks
        and rows, `[n, *row shape]` values); entries with rank -1 are ignored (their row may be anything).
        n is a static length (e.g. all N routes); no two real entries of the group write the same row.
        Starts once every rank is done with `target`'s previous contents; returns once every write into
        this rank's `target` has landed. `capacity`: the most real entries any rank sends to any one rank
        in this call, identical on every rank (a static bound: transports with fixed-size messages size
        them by it; others ignore it)."""
        ...

    def gather_rows(self, source: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor, *,
                    capacity: int | None = None) -> torch.Tensor:
        """Collective: `[n, *row shape]` rows `source[row_n[i]]` of rank `rank_n[i]`, a zero row where
        `rank_n[i]` is -1 (n static, as in `scatter_rows`). Starts once every rank's `source` is final;
        returns once every rank is done reading this rank's `source`. `capacity`: the most real entries
        any rank reads from any one rank in this call (as in `scatter_rows`)."""
        ...

    def release(self, key: str) -> None:
        """Forget this rank's registration of `key` (after `destroy()`). Collective where ranks map each
        other's memory (symmetric memory: it returns once no rank's queued work can still use the key's
        memory): every rank releases the same keys in the same order."""
        ...


@dataclass(frozen=True)
class SymmetricTensor:
    """One tensor per rank under one key: `local` is this rank's, `peer(r)` aliases rank r's memory.

    A transport without shared memory (the collective world) holds only `local`: its other entries are None
    and `peer(r)` raises; such worlds move rows with `scatter_rows` / `gather_rows` only."""

    key: str
    rank: int
    peers: tuple[torch.Tensor | None, ...]

    @property
    def local(self) -> torch.Tensor:
        return self.peers[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        tensor = self.peers[rank]
        if tensor is None:
            raise RuntimeError(f"symmetric tensor {self.key!r}: rank {rank}'s memory is not mapped on rank "
                               f"{self.rank} (this world has no shared memory; use scatter_rows/gather_rows)")
        return tensor

    def as_rows(self, width: int, dtype: torch.dtype) -> SymmetricTensor:
        """The same memory on every rank seen as `[rows, width]` rows of `dtype` (rows: `local`'s), under the
        same key: a view, not a registration (worlds map it onto the registered tensor, `reinterpret_rows`).
        Every rank's tensor must be contiguous and hold that many bytes."""
        rows = self.local.shape[0]
        return SymmetricTensor(self.key, self.rank, tuple(
            None if peer is None else reinterpret_rows(peer, rows, width, dtype) for peer in self.peers))


def reinterpret_rows(tensor: torch.Tensor, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """`[rows, width]` of `dtype` over the first `rows * width * dtype.itemsize` bytes of the contiguous
    `tensor`'s memory (a view: writes land in `tensor`)."""
    flat = tensor.view(-1).view(torch.uint8)
    return flat[:rows * width * dtype.itemsize].view(dtype).view(rows, width)


# -- the peer exchange --------------------------------------------------------------------------------------


# -- the threads world --------------------------------------------------------------------------------------


