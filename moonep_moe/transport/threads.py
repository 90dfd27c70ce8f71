"""The threads world: R ranks as R Python threads in one process, on the CPU or on
one GPU, sharing tensors through a registry. It runs the unchanged layer code, so tests and the demo can use
an 8-rank EP group anywhere. `single_world()` is the trivial R = 1 world. `run_ranks(fn, R)` runs
`fn(world)` on R thread-ranks and returns their results in rank order; a rank that fails, or ranks that can
no longer meet at a barrier, raise `RankFailedError` naming the ranks instead of hanging.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import torch

from moonep_moe.transport.peer import PeerWorld, place_rows
from moonep_moe.transport.world import (
    BARRIER_TIMEOUT_S,
    RankFailedError,
    SymmetricTensor,
    call_site,
    failure_message,
    indexed_device,
)

T = TypeVar("T")


class ThreadGroup:
    """The shared state of R thread-ranks: a barrier, a registry of symmetric tensors, a gather board.

    Not an nn.Module and owns no tensors of its own: ranks register theirs. The barrier knows what each rank
    is doing (running, waiting at its n-th barrier, finished, where the thread is), so a group that can no
    longer meet raises `RankFailedError` on every waiting rank instead of hanging:
    - a rank that fails aborts the group (`abort(reason)`); its waiting peers raise with the reason;
    - every barrier needs all R ranks, so a rank waiting while another has finished its work (`finish`) is a
      deadlock, raised at once with each rank's state ("rank 0 waits in barrier #8 of all_gather
      (ThreadsWorld.all_gather <- Buffer._dispatch.<locals>.op); rank 1 finished after 7 barriers");
    - a wait longer than `BARRIER_TIMEOUT_S` (a peer stuck elsewhere) raises with the same list;
    - ranks that meet at a barrier while in different operations (rank 0 in `all_gather`, rank 1 in
      `scatter_rows`) raise at once, naming the ranks and their operations, instead of pairing their
      barriers and reading each other's board entries as their own.
    `reset()` makes the group usable again. `run_ranks` does all of it; with threads of your own, only the
    abort and the timeout apply (the group does not know when they finish, nor where they are).
    """

    _ids = itertools.count()

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.device = indexed_device(device)
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
            self._operations = ["barrier"] * self.size
            """The operation each rank is in at its latest barrier (`ThreadsWorld`'s method name)."""
            self._board: list[Any] = [None] * self.size
            """One entry per rank: its tensor of an `all_gather`, its `(rank_n, row_n, values_n)` of a
            scatter."""

    def wait(self, rank: int, operation: str = "barrier") -> None:
        """Rank `rank` waits until every rank has called `wait` (one barrier) for `operation` (the world's
        operation that calls it: "all_gather", "scatter_rows", ..., "barrier" for a barrier of its own).

        Raises:
            RankFailedError when the group stopped: a rank failed (`abort`), a rank has finished while this
            one waits (deadlock), the ranks meet in different operations, or the wait lasted
            `BARRIER_TIMEOUT_S`.
        """
        with self._turn:
            if self._stopped is not None:
                raise RankFailedError(self._stopped)
            passed = self._passed
            self._entered[rank] += 1
            self._operations[rank] = operation
            self._arrived += 1
            if self._arrived == self.size:
                if len(set(self._operations)) > 1:
                    self._stop(self._mismatch(passed + 1))
                    raise RankFailedError(self._stopped)
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

    def _mismatch(self, barrier: int) -> str:
        """The message of ranks that met at barrier #`barrier` in different operations."""
        ranks_by_operation: dict[str, list[int]] = {}
        for rank, operation in enumerate(self._operations):
            ranks_by_operation.setdefault(operation, []).append(rank)
        where = "; ".join(f"{_ranks(ranks)} in {operation}"
                          for operation, ranks in ranks_by_operation.items())
        return (f"ranks met at barrier #{barrier} in different operations: {where} (every rank must call the "
                "same collective operations in the same order)")

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
                states.append(f"rank {rank} waits in barrier #{entered} of {self._operations[rank]} "
                              f"({where})")
            else:
                states.append(f"rank {rank} runs {where} after {entered} barriers")
        return "; ".join(states)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


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
    operation: str = "barrier"
    """The operation this rank's barriers are part of ("barrier" outside the world's own operations): the
    group checks that every rank meets each barrier in the same one."""

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
        self.group.wait(self.rank, self.operation)

    @contextlib.contextmanager
    def _operating(self, operation: str) -> Iterator[None]:
        """This rank's barriers inside the block belong to `operation` (what the group compares)."""
        outer, self.operation = self.operation, operation
        try:
            yield
        finally:
            self.operation = outer

    def scatter_rows(self, target: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor,
                     values_n: torch.Tensor, *, capacity: int | None = None) -> None:
        """Receiver-side writes: every rank posts its `[n]` entries on the board, then writes the entries
        addressed to it into its own `target` (`place_rows`: fixed shapes, no write races, no host read).
        Costs R * n row writes per rank (the simulation's price for static shapes)."""
        with self._operating("scatter_rows"):
            self.barrier()  # every rank is done with target's previous contents, and the board is free
            self.group._board[self.rank] = (rank_n, row_n, values_n)
            self.barrier()
            local = target.local
            for sender_n, sender_row_n, sender_values_n in self.group._board:
                place_rows(local, torch.where(sender_n == self.rank, sender_row_n, -1),
                           sender_values_n.to(local.dtype))
            self.barrier()  # every rank has read the board (senders may reuse their values)

    def gather_rows(self, source: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor, *,
                    capacity: int | None = None) -> torch.Tensor:
        """`PeerWorld.gather_rows`, its barriers marked as this operation's."""
        with self._operating("gather_rows"):
            return super().gather_rows(source, rank_n, row_n, capacity=capacity)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank posts its tensor on the board and stacks the board on its own stream. Returns once
        every rank's stack has run: a posted tensor may be freed and its memory reused on its owner's
        stream as soon as the call returns, whichever stream the next collective runs on."""
        with self._operating("all_gather"):
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
        with self._operating("symmetric"):
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
