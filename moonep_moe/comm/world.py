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

Worlds whose symmetric tensors map every peer (threads here, symmetric memory in `comm.symmetric`) share
one peer exchange: `PeerWorld.gather_rows` reads peers' rows directly (`read_peer_rows`), and a world whose
targets carry a dump row writes peers' rows directly (`write_peer_rows`: the symmetric world allocates its
tensors, dump row included; the threads world registers the caller's tensors as they are, so its
`scatter_rows` stays receiver-side). Both move `R * c` rows per rank (c = the call's `capacity`), with each
rank's entries grouped by peer (`entries_by_rank`); nothing reads a device value on the host.

This module also holds the threads backend: R ranks as R Python threads in one process, on the CPU or on
one GPU, sharing tensors through a registry. It runs the unchanged layer code, so tests and the demo can use
an 8-rank EP group anywhere. `single_world()` is the trivial R = 1 world. `run_ranks(fn, R)` runs
`fn(world)` on R thread-ranks and returns their results in rank order; a rank that fails, or ranks that can
no longer meet at a barrier, raise `RankFailedError` naming the ranks instead of hanging.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")

BARRIER_TIMEOUT_S = 300.0
"""A rank that waits longer than this at a barrier raises instead of hanging the whole group (the last resort:
a deadlock a world can see, such as a thread-rank waiting for a rank that has finished, raises at once)."""


class RankFailedError(RuntimeError):
    """A rank's failure, reported by someone other than that rank (a peer, or `run_ranks` on the caller's
    thread): the message names the rank(s) and what went wrong; the failed rank's own exception, where there
    is one, is the `__cause__`."""


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
        """Forget this rank's registration of `key` (after `destroy()`)."""
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


class PeerWorld:
    """What worlds whose `SymmetricTensor`s map every peer share: `gather_rows` reads peers' rows directly.

    A mixin for `EPWorld` implementations: subclasses provide `size` and `barrier()` (which must order each
    rank's earlier work before every rank's later work). Not an nn.Module; owns nothing.
    """

    size: int

    def barrier(self) -> None:
        raise NotImplementedError

    def gather_rows(self, source: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor, *,
                    capacity: int | None = None) -> torch.Tensor:
        """`[n, *row]` rows `source.peer(rank_n[i])[row_n[i]]`, zero where `rank_n[i]` is -1, read directly
        from the peers (`read_peer_rows`, `R * capacity` row reads); between two barriers."""
        self.barrier()  # every rank's source is final
        rows = read_peer_rows(source, rank_n, row_n, capacity)
        self.barrier()  # every rank is done reading this rank's source
        return rows


def order_by_rank(rank_n: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order `[n]` of the entries by rank (rank -1 last), and the entries per rank `[R + 1]` (the last
    counts rank -1). No host read."""
    key_n = torch.where(rank_n >= 0, rank_n, size)
    count_r = torch.zeros(size + 1, dtype=torch.int64, device=rank_n.device)
    count_r.scatter_add_(0, key_n, torch.ones_like(key_n))
    return torch.argsort(key_n, stable=True), count_r


def entries_by_rank(rank_n: torch.Tensor, size: int, capacity: int | None) -> torch.Tensor:
    """`[R, c]` int64: row d lists the entries (indices into `rank_n [n]`) addressed to rank d, in order,
    then n (no entry) in the slots left over; c = min(capacity, n) (capacity None = n). Entries beyond the
    capacity are left out: the capacity is the caller's promise (nothing here reads the device to check
    it). Fixed shapes, no host read."""
    n = len(rank_n)
    c = n if capacity is None else min(capacity, n)
    rank_n = rank_n.long()
    order_n, count_r = order_by_rank(rank_n, size)
    start_r = torch.cumsum(count_r, 0) - count_r
    slot_c = torch.arange(c, device=rank_n.device)
    position_rc = start_r[:size, None] + slot_c
    real_rc = slot_c < count_r[:size, None]
    entry_rc = order_n.index_select(0, position_rc.clamp(max=max(n - 1, 0)).view(-1)).view(size, c)
    return torch.where(real_rc, entry_rc, n)


def read_peer_rows(source: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor,
                   capacity: int | None = None) -> torch.Tensor:
    """`[n, *row]`: row `row_n[i]` of `source.peer(rank_n[i])`, a zero row where `rank_n[i]` is -1. Per peer,
    one fixed-shape `[c]` read of its rows and one local write of them (c from `capacity`, as in
    `entries_by_rank`); slots without an entry read row 0 into a dump row that is cut off. The caller orders
    it between barriers."""
    local = source.local
    n = len(rank_n)
    rows = local.new_zeros((n + 1, *local.shape[1:]))  # row n: the dump of the slots without an entry
    if n and local.shape[0]:
        entry_rc = entries_by_rank(rank_n, len(source.peers), capacity)
        row_n = row_n.long()
        for rank, entry_c in enumerate(entry_rc):
            read_c = torch.where(entry_c < n, row_n.index_select(0, entry_c.clamp(max=n - 1)), 0)
            rows.index_copy_(0, entry_c, source.peer(rank).index_select(0, read_c))
    return rows[:n]


def write_peer_rows(targets: tuple[torch.Tensor, ...], rank_n: torch.Tensor, row_n: torch.Tensor,
                    values_n: torch.Tensor, capacity: int | None = None) -> None:
    """`targets[rank_n[i]][row_n[i]] = values_n[i]` for every entry with rank >= 0, written straight into the
    peers' memory: per peer one fixed-shape `[c]` write (c from `capacity`). `targets[r]` is rank r's tensor
    with one extra last row, the dump row, which takes the writes of the slots without an entry (so no
    write needs a mask and no two writers race on a real row). The caller orders it between barriers."""
    n = len(rank_n)
    if not n:
        return
    dump = targets[0].shape[0] - 1
    entry_rc = entries_by_rank(rank_n, len(targets), capacity)
    row_n = row_n.long()
    for target, entry_c in zip(targets, entry_rc, strict=True):
        entry_c, real_c = entry_c.clamp(max=n - 1), entry_c < n
        target.index_copy_(0, torch.where(real_c, row_n.index_select(0, entry_c), dump),
                           values_n.index_select(0, entry_c).to(target.dtype))


# -- the threads world --------------------------------------------------------------------------------------


class ThreadGroup:
    """The shared state of R thread-ranks: a barrier, a registry of symmetric tensors, a gather board.

    Not an nn.Module and owns no tensors of its own: ranks register theirs. The barrier knows what each rank
    is doing (running, waiting at its n-th barrier, finished, where the thread is), so a group that can no
    longer meet raises `RankFailedError` on every waiting rank instead of hanging:
    - a rank that fails aborts the group (`abort(reason)`); its waiting peers raise with the reason;
    - every barrier needs all R ranks, so a rank waiting while another has finished its work (`finish`) is a
      deadlock, raised at once with each rank's state ("rank 0 waits in barrier #8 (ThreadsWorld.all_gather
      <- Buffer.dispatch); rank 1 finished after 7 barriers");
    - a wait longer than `BARRIER_TIMEOUT_S` (a peer stuck elsewhere) raises with the same list.
    `reset()` makes the group usable again. `run_ranks` does all of it; with threads of your own, only the
    abort and the timeout apply (the group does not know when they finish, nor where they are).
    """

    _ids = itertools.count()

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # tensors report their index
        self.device = device
        self.uid = next(ThreadGroup._ids)
        self._turn = threading.Condition()
        """Guards the barrier's state below; waiting ranks sleep on it."""
        self._lock = threading.Lock()
        self._registry: dict[str, list[torch.Tensor | None]] = {}
        self.worlds = [ThreadsWorld(self, r) for r in range(size)]
        self.reset()

    def reset(self) -> None:
        """Forget the barrier's state and the board (after `abort`, or to run the ranks again)."""
        with self._turn:
            self._stopped: str | None = None
            """Why the group stopped (every later wait raises it), None while it runs."""
            self._arrived = 0
            self._passed = 0
            """Barriers the group has passed."""
            self._entered = [0] * self.size
            """Barriers each rank has entered."""
            self._waiting = [False] * self.size
            self._finished = [False] * self.size
            self._board: list[Any] = [None] * self.size
            """One entry per rank: its tensor of an `all_gather`, its `(rank_n, row_n, values_n)` of a
            scatter."""

    def wait(self, rank: int) -> None:
        """Rank `rank` waits until every rank has called `wait` (one barrier).

        Raises:
            RankFailedError when the group stopped: a rank failed (`abort`), a rank has finished while this
            one waits (deadlock), or the wait lasted `BARRIER_TIMEOUT_S`.
        """
        with self._turn:
            if self._stopped is not None:
                raise RankFailedError(self._stopped)
            passed = self._passed
            self._entered[rank] += 1
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived, self._passed = 0, passed + 1
                self._waiting = [False] * self.size
                self._turn.notify_all()
                return
            self._waiting[rank] = True
            self._stop_if_deadlocked()
            deadline = time.monotonic() + BARRIER_TIMEOUT_S
            while self._passed == passed and self._stopped is None:
                left = deadline - time.monotonic()
                if left > 0:
                    self._turn.wait(left)
                else:
                    self._stop(f"rank {rank} waited {BARRIER_TIMEOUT_S:g} s at a barrier: {self._states()}")
            if self._passed == passed:
                raise RankFailedError(self._stopped)

    def finish(self, rank: int) -> None:
        """Rank `rank`'s work is done: it reaches no more barriers (a peer waiting for it is deadlocked)."""
        with self._turn:
            self._finished[rank] = True
            self._stop_if_deadlocked()

    def abort(self, reason: str = "the group was aborted") -> None:
        """Stop the group (a rank failed): every waiting rank, and every later wait, raises `reason`."""
        with self._turn:
            self._stop(reason)

    def _stop(self, reason: str) -> None:
        if self._stopped is None:
            self._stopped = reason
            self._turn.notify_all()

    def _stop_if_deadlocked(self) -> None:
        if any(self._finished) and any(self._waiting):
            self._stop(f"deadlock: every barrier needs all {self.size} ranks, and a rank that finished "
                       f"reaches none: {self._states()}")

    def _states(self) -> str:
        """Each rank's state: finished, waiting at its n-th barrier, or running; where known (the threads of
        `run_ranks`), the innermost two functions of its thread outside the barrier."""
        frames = sys._current_frames()
        states = []
        for rank, world in enumerate(self.worlds):
            entered = self._entered[rank]
            where = call_site(frames.get(world.thread), _in_barrier)
            if self._finished[rank]:
                states.append(f"rank {rank} finished after {entered} barriers")
            elif self._waiting[rank]:
                states.append(f"rank {rank} waits in barrier #{entered} ({where})")
            else:
                states.append(f"rank {rank} runs {where} after {entered} barriers")
        return "; ".join(states)


def _in_barrier(frame: FrameType) -> bool:
    """Whether `frame` belongs to a thread-rank's barrier: `ThreadsWorld.barrier`, what it calls (the group's
    methods, `threading`)."""
    module, code = frame.f_globals.get("__name__"), frame.f_code
    return (module == "threading" or code is ThreadsWorld.barrier.__code__
            or module == __name__ and code.co_qualname.startswith("ThreadGroup."))


@dataclass(eq=False)
class ThreadsWorld(PeerWorld):
    """Rank `rank` of a `ThreadGroup`. Barrier = synchronise this thread's stream + the group's barrier (a
    host sync on a GPU, so only a one-rank threads world, whose barrier is a no-op, can run a step under
    `torch.cuda.set_sync_debug_mode("error")` or in a CUDA graph)."""

    group: ThreadGroup
    rank: int
    globals: dict[Any, Any] = field(default_factory=dict)
    thread: int | None = None
    """Ident of the thread running this rank (set by `run_ranks`)."""

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def device(self) -> torch.device:
        return self.group.device

    def barrier(self) -> None:
        if self.size > 1 and self.thread is not None and threading.get_ident() != self.thread:
            # PyTorch runs the autograd backward of CUDA tensors on one worker thread per device, shared by
            # every thread-rank: a rank waiting here would block the others' backward forever.
            raise RuntimeError(
                f"rank {self.rank} of a {self.size}-rank threads world reached a barrier outside its own "
                "thread (CUDA autograd backward runs on a shared device thread). On one GPU, the threads "
                "world supports forward and direct Buffer calls with several ranks; train with several "
                "ranks through a process world, or with one rank.")
        if self.size == 1:
            return  # one rank: its stream already orders its work (no sync, so a step can be graph-captured)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.group.wait(self.rank)

    def scatter_rows(self, target: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor,
                     values_n: torch.Tensor, *, capacity: int | None = None) -> None:
        """Receiver-side writes: every rank posts its `[n]` entries on the board, then writes the entries
        addressed to it into its own `target` (`place_rows`: fixed shapes, no write races, no host read).
        Costs R * n row writes per rank (the simulation's price for static shapes)."""
        self.barrier()  # every rank is done with target's previous contents, and the board is free
        self.group._board[self.rank] = (rank_n, row_n, values_n)
        self.barrier()
        local = target.local
        for sender_n, sender_row_n, sender_values_n in self.group._board:
            place_rows(local, torch.where(sender_n == self.rank, sender_row_n, -1),
                       sender_values_n.to(local.dtype))
        self.barrier()  # every rank has read the board (senders may reuse their values)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank posts its tensor on the board and stacks the board on its own stream. Returns once
        every rank's stack has run: a posted tensor may be freed and its memory reused on its owner's
        stream as soon as the call returns, whichever stream the next collective runs on."""
        self.barrier()  # the board is free: every rank has read the previous gather
        self.group._board[self.rank] = tensor
        self.barrier()
        gathered = torch.stack([t.to(tensor.device) for t in self.group._board])
        self.barrier()  # every rank's stack has run (a barrier synchronises each rank's current stream)
        return gathered

    def symmetric(self, key: str, tensor: torch.Tensor) -> SymmetricTensor:
        with self.group._lock:
            slots = self.group._registry.setdefault(key, [None] * self.size)
            if slots[self.rank] is not None:
                raise ValueError(f"symmetric key {key!r} is already registered on rank {self.rank}")
            slots[self.rank] = tensor
        self.barrier()
        peers = tuple(self.group._registry[key])
        self.barrier()  # every rank holds the peers before any may release (`release` drops the entry)
        first = peers[0]
        for r, t in enumerate(peers):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    f"symmetric key {key!r}: rank {r} registered {tuple(t.shape)} {t.dtype}, "
                    f"rank 0 registered {tuple(first.shape)} {first.dtype}"
                )
        return SymmetricTensor(key, self.rank, peers)

    def release(self, key: str) -> None:
        with self.group._lock:
            slots = self.group._registry.get(key)
            if slots is not None:
                slots[self.rank] = None
                if all(t is None for t in slots):
                    del self.group._registry[key]


def place_rows(target: torch.Tensor, rows_m: torch.Tensor, values_m: torch.Tensor) -> None:
    """`target[rows_m[i]] = values_m[i]` for every `rows_m[i] >= 0` (`[m]` rows, `[m, *row]` values), with
    fixed shapes and no host read: entries of -1 rewrite the first real entry's row with its own value (or
    row 0 with itself when none is real), so every repeated write carries identical bytes. Only the owner
    of `target` may call it while peers could write it (the rewrite of row 0 reads it first)."""
    if not len(rows_m) or not target.shape[0]:
        return
    real_m = rows_m >= 0
    first_1 = torch.argmax(real_m.to(torch.uint8)).view(1)
    fill_row_1 = rows_m.index_select(0, first_1).clamp(min=0)
    expand = (-1,) + (1,) * (values_m.dim() - 1)
    fill_value_1 = torch.where(real_m.index_select(0, first_1).view(expand),
                               values_m.index_select(0, first_1), target.index_select(0, fill_row_1))
    target.index_copy_(0, torch.where(real_m, rows_m, fill_row_1),
                       torch.where(real_m.view(expand), values_m, fill_value_1))


def single_world(device: torch.device | str = "cpu") -> ThreadsWorld:
    """The trivial world of one rank (R = 1): gathers stack one tensor, barriers do nothing."""
    return ThreadGroup(1, device).worlds[0]


def run_ranks(fn: Callable[[ThreadsWorld], T], size: int, device: torch.device | str = "cpu",
              group: ThreadGroup | None = None) -> list[T]:
    """Run `fn(world)` on `size` thread-ranks of `group` (a new one by default); results in rank order.

    The first exception raised on any rank aborts the group (peers stop waiting); a rank that returns while
    a peer waits at a barrier stops the group at once (a deadlock: see `ThreadGroup`). The group is reset
    afterwards, so a later call can reuse it. On CUDA every thread runs on its own stream, so ranks overlap
    the way processes would.

    Raises:
        RankFailedError "rank r failed: <type>: <message>" from the exception of the lowest rank that raised
            one of its own (not a peer's failure seen at a barrier), or, where the ranks only stopped at
            barriers (a deadlock), the message listing every rank's state.
    """
    group = group or ThreadGroup(size, device)
    if group.size != size:
        raise ValueError(f"group has {group.size} ranks, asked for size={size}")
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        group.worlds[rank].thread = threading.get_ident()
        try:
            if group.device.type == "cuda":
                with torch.cuda.device(group.device), torch.cuda.stream(torch.cuda.Stream(group.device)):
                    results[rank] = fn(group.worlds[rank])
                    torch.cuda.current_stream().synchronize()
            else:
                results[rank] = fn(group.worlds[rank])
        except BaseException as error:  # noqa: B036 - re-raised on the caller's thread below
            errors.append((rank, error))
            group.abort(failure_message(rank, error))
        else:
            group.finish(rank)

    threads = [threading.Thread(target=body, args=(r,), name=f"ep-rank-{r}") for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    group.reset()
    if errors:
        errors.sort(key=lambda e: e[0])
        peers = RankFailedError | threading.BrokenBarrierError  # a peer's failure, seen at a barrier
        own = [(rank, error) for rank, error in errors if not isinstance(error, peers)]
        if not own:
            raise errors[0][1]
        rank, error = own[0]
        also = f" (ranks {[r for r, _ in own[1:]]} failed too)" if len(own) > 1 else ""
        raise RankFailedError(failure_message(rank, error) + also) from error
    return results
