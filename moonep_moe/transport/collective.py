"""The collective EP world: `EPWorld` over `torch.distributed` (NCCL across nodes, gloo on the CPU).

Beyond one NVLink domain ranks cannot map each other's memory, so `symmetric(key, tensor)` registers only
this rank's tensor (after checking that every rank registered the same shape and dtype under the same key)
and every row that crosses ranks travels in an all-to-all. Notation and suffixes: DESIGN.md, "Notation";
as in the world protocol, `n` counts the entries of one exchange (rows this rank sends or requests: routes,
slots or ranks, as the Buffer calls it), `c` is the call's `capacity` (rows any rank exchanges with any one
rank) and `*row` the row shape.

Two modes:
- static (default): every rank sends every rank a fixed block of c rows, padded, with the rows' target
  indices alongside (-1 = padding); one equal-split `all_to_all_single` for the rows and one for the indices,
  then a fixed-shape `index_copy_` on the receiver (`place_rows`). Ignored entries (rank -1) go to a dump
  row past the blocks that is never sent. `gather_rows` is one all-to-all of requests and one of replies.
  Message sizes depend only on the config, so nothing reads device values on the host (CUDA-graph friendly),
  at the price of sending `R * c` rows whatever the routing. (On the CPU a block overflow raises: a check
  that reads the per-rank counts, free there.)
- exact size (`exact_size=True`): only the real rows travel, with variable splits. The per-destination row
  counts are exchanged first and read on the host: one small device-to-host read of `2R` ints per
  exchange (a sync on a GPU), worth it when bandwidth between nodes matters more than the sync.

Launching: one process per rank (`torchrun`), `init_collective()` (or your own `init_process_group` with a
timeout and `CollectiveWorld()`), and the rank's work inside `fail_fast()`, so that a rank that raises aborts
the group: its peers raise `RankFailedError` naming it within about a second instead of hanging until the
timeout. A rank that stops without raising (it crashed, was killed, or returned early and exited) is named
by its peers too, about `SILENCE_S` after their collective failed; a rank that is alive but slow (its
heartbeat runs) is waited for, up to `fail_fast`'s `timeout_s`, and never named as stopped.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from moonep_moe.transport.peer import order_by_rank, place_rows
from moonep_moe.transport.world import EPWorld, RankFailedError, SymmetricTensor, call_site, failure_message

DEFAULT_TIMEOUT_S = 300.0
"""Collectives that wait longer than this raise (the process-group timeout of `init_collective`)."""

SILENCE_S = 2.0
"""A peer that has neither reported to `fail_fast` nor shown a heartbeat for this long, while a rank whose
collective failed waits, is named as the one that stopped (it exited or was killed)."""
HEARTBEAT_S = 0.25
"""How often a rank inside `fail_fast` looks for a failure announced in the store, and once there is one,
shows that it is alive (well under `SILENCE_S`)."""
LIVE_WAIT_S = 60.0
"""`fail_fast`'s default `timeout_s`: how long a rank whose collective failed waits for a peer that is alive
(its heartbeat runs) but has not reported. A slow peer reports as soon as it reaches a `torch.distributed`
call, which fails at once once the group is aborted; one that never does is named as slow or stuck."""

_MAX_DIMS = 8
"""Most dimensions of a symmetric tensor (its shape travels in a fixed-size signature)."""


class CollectiveWorld:
    """Rank `rank` of an EP group made of a `torch.distributed` process group (default: the WORLD group).

    Owns no tensors: layers register theirs with `symmetric`. `device` follows the backend: `cuda:LOCAL_RANK`
    for NCCL, the CPU otherwise. Every method except the attributes is collective: every rank calls them in
    the same order.

    Args:
        group: the process group of the EP ranks (rank = group rank); default the WORLD group, which must be
            initialised (`init_collective`).
        exact_size: send only real rows, at the cost of one small device-to-host read per exchange (above).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, exact_size: bool = False):
        self.group, self.rank, self.size = joined_group(group, "collective", "collective.init_collective")
        self.exact_size = exact_size
        if dist.get_backend(self.group) == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", self.rank % torch.cuda.device_count()))
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        self.globals: dict[Any, Any] = {}
        self._keys: set[str] = set()

    # -- small collectives ----------------------------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[*shape]` on every rank -> `[size, *shape]`, identical on every rank (a fresh tensor)."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)  # the list form: gloo and torch 2.11
        return torch.stack(parts)

    def barrier(self) -> None:
        if self.device.type == "cuda":
            dist.barrier(group=self.group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.group)

    def symmetric(self, key: str, tensor: torch.Tensor) -> SymmetricTensor:
        """Register `tensor` under `key`; only `local` is available (`peer(r)` of another rank raises).

        Checks that every rank registered the same key, shape and dtype (`check_same_registration`), which
        also catches ranks that build different layers or disagree on the config.
        """
        if key in self._keys:
            raise ValueError(f"symmetric key {key!r} is already registered on rank {self.rank}")
        if tensor.device != self.device:
            raise ValueError(f"symmetric key {key!r}: tensor must be on {self.device}, got {tensor.device}")
        check_same_registration(self, key, tensor)
        self._keys.add(key)
        return SymmetricTensor(key, self.rank, tuple(tensor if r == self.rank else None
                                                     for r in range(self.size)))

    def release(self, key: str) -> None:
        self._keys.discard(key)

    # -- row exchanges --------------------------------------------------------------------------------------

    def scatter_rows(self, target: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor,
                     values_n: torch.Tensor, *, capacity: int | None = None) -> None:
        """Rank `rank_n[i]`'s `target` gets `values_n [n, *row]` at row `row_n[i]`; entries with rank -1 are
        ignored. `capacity` default: the target's rows (each row written at most once per exchange)."""
        local = target.local
        rank_n, row_n, values_n = rank_n.long(), row_n.long(), values_n.to(local.dtype)
        if self.exact_size:
            order_m, send_r, recv_r = self._exact_splits(rank_n)
            recv_m = self._all_to_all(values_n[order_m], send_r, recv_r)
            rows_m = self._all_to_all(row_n[order_m], send_r, recv_r)
            local.index_copy_(0, rows_m, recv_m)
            return
        capacity = local.shape[0] if capacity is None else capacity
        if capacity == 0:
            return
        block_n = self._blocks(rank_n, capacity)
        blocks = self.size * capacity
        send_m = values_n.new_zeros((blocks + 1, *values_n.shape[1:])).index_copy_(0, block_n, values_n)
        rows_m = row_n.new_full((blocks + 1,), -1).index_copy_(0, block_n, row_n)
        place_rows(local, self._all_to_all(rows_m[:blocks]), self._all_to_all(send_m[:blocks]))

    def gather_rows(self, source: SymmetricTensor, rank_n: torch.Tensor, row_n: torch.Tensor, *,
                    capacity: int | None = None) -> torch.Tensor:
        """`[n, *row]` rows `source[row_n[i]]` of rank `rank_n[i]` (zero where the rank is -1): one all-to-all
        of requests, one of replies. `capacity` default: the source's rows (each read at most once)."""
        local = source.local
        rank_n, row_n = rank_n.long(), row_n.long()
        if self.exact_size:
            order_m, send_r, recv_r = self._exact_splits(rank_n)
            requests_m = self._all_to_all(row_n[order_m], send_r, recv_r)
            replies_m = self._all_to_all(local[requests_m], recv_r, send_r)
            return replies_m.new_zeros((len(rank_n), *local.shape[1:])).index_copy_(0, order_m, replies_m)
        capacity = local.shape[0] if capacity is None else capacity
        if capacity == 0:
            return local.new_zeros((len(rank_n), *local.shape[1:]))
        block_n = self._blocks(rank_n, capacity)
        blocks = self.size * capacity
        requests_m = row_n.new_full((blocks + 1,), -1).index_copy_(0, block_n, row_n)
        requests_m = self._all_to_all(requests_m[:blocks])
        replies_m = self._all_to_all(local[requests_m.clamp(min=0)])  # padding requests read row 0
        # the dump entry reads a zero row
        return torch.cat([replies_m, replies_m.new_zeros((1, *replies_m.shape[1:]))])[block_n]

    def _blocks(self, rank_n: torch.Tensor, capacity: int) -> torch.Tensor:
        """`[n]` each entry's place in the `[R * capacity + 1]` send buffer: `rank * capacity + i`, where i
        counts the earlier entries to the same rank; `R * capacity` (the dump row, never sent) for rank -1.
        On the CPU an overflow raises (a free check there)."""
        order_n, count_r = order_by_rank(rank_n, self.size)
        start_r = torch.cumsum(count_r, 0) - count_r
        key_n = torch.where(rank_n >= 0, rank_n, self.size)
        within_n = torch.empty_like(rank_n)
        within_n[order_n] = torch.arange(len(rank_n), device=rank_n.device) - start_r[key_n[order_n]]
        if rank_n.device.type == "cpu" and len(rank_n) and int(count_r[:self.size].max()) > capacity:
            raise ValueError(f"rank {self.rank} exchanges {int(count_r[:self.size].max())} rows with rank "
                             f"{int(count_r[:self.size].argmax())}, more than capacity={capacity}")
        return torch.where(rank_n >= 0, rank_n * capacity + within_n, self.size * capacity)

    def _exact_splits(self, rank_n: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """The real entries `[m]` in order of destination rank, and the rows this rank sends to / receives
        from each rank. NOTE: the one device-to-host read of the exact-size mode (`2R` ints)."""
        order_n, count_r = order_by_rank(rank_n, self.size)
        splits = torch.cat([count_r[:self.size], self._all_to_all(count_r[:self.size])]).tolist()
        send_r, recv_r = splits[:self.size], splits[self.size:]
        return order_n[:sum(send_r)], send_r, recv_r

    def _all_to_all(self, send_m: torch.Tensor, send_r: list[int] | None = None,
                    recv_r: list[int] | None = None) -> torch.Tensor:
        """Equal splits by default; with `send_r` / `recv_r` rows per rank, variable splits."""
        rows = len(send_m) if recv_r is None else sum(recv_r)
        recv_m = send_m.new_empty((rows, *send_m.shape[1:]))
        dist.all_to_all_single(recv_m, send_m.contiguous(), output_split_sizes=recv_r,
                               input_split_sizes=send_r, group=self.group)
        return recv_m


def joined_group(group: dist.ProcessGroup | None, world: str,
                 init: str) -> tuple[dist.ProcessGroup, int, int]:
    """`(group, rank, size)` of a process-group EP world: `group`, or the default group where it is None.

    Raises:
        RuntimeError naming the `world` and its `init` function (in `moonep_moe.comm`) when torch.distributed
        has no initialised process group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"the {world} EP world needs an initialised torch.distributed process group: call "
                           f"moonep_moe.comm.{init}() (or torch.distributed.init_process_group) first, e.g. "
                           "under torchrun")
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def check_same_registration(world: EPWorld, key: str, tensor: torch.Tensor) -> None:
    """Collective: raise on every rank, naming the ranks, unless every rank registers `tensor` with the same
    key, shape and dtype (one all-gather of a `[3 + 8]` signature, read on the host: construction time)."""
    signature_r = world.all_gather(_signature(key, tensor).to(world.device)).cpu()
    mine = signature_r[world.rank]
    differ = [r for r in range(world.size) if not torch.equal(signature_r[r], mine)]
    if differ:
        raise ValueError(
            f"symmetric key {key!r}: rank {world.rank} registered {_describe(mine)}, rank(s) {differ} "
            f"registered {', '.join(_describe(signature_r[r]) for r in differ)}: every rank must build "
            "the same layers in the same order from the same config")


def _signature(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """`[3 + 8]` int64: crc32 of the key and of the dtype, the number of dims, the shape (-1 padded)."""
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"symmetric key {key!r}: at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    shape = list(tensor.shape) + [-1] * (_MAX_DIMS - tensor.dim())
    return torch.tensor([zlib.crc32(key.encode()), zlib.crc32(str(tensor.dtype).encode()), tensor.dim(),
                         *shape], dtype=torch.int64)


def _describe(signature: torch.Tensor) -> str:
    key_crc, dtype_crc, dims, *shape = signature.tolist()
    return f"key crc {key_crc:#010x} shape {tuple(shape[:dims])} dtype crc {dtype_crc:#010x}"


# -- process groups, failures ------------------------------------------------------------------------------


_worlds: dict[tuple[dist.ProcessGroup | None, bool], CollectiveWorld] = {}


def collective_world(group: dist.ProcessGroup | None = None, exact_size: bool = False) -> CollectiveWorld:
    """This process's `CollectiveWorld` of `group` (one per group and mode, so that every layer shares its
    slot pools); `MoonEPMoELayer(config)` with `config.world == "collective"` uses the WORLD group's."""
    key = (group, exact_size)
    if key not in _worlds:
        _worlds[key] = CollectiveWorld(group, exact_size=exact_size)
    return _worlds[key]


def init_collective(backend: str | None = None, *, init_method: str | None = None, rank: int | None = None,
                    world_size: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                    exact_size: bool = False) -> CollectiveWorld:
    """Initialise the default process group (unless it is) with a timeout and return its world.

    Args:
        backend: "nccl" or "gloo"; default NCCL when CUDA is available, else gloo.
        init_method, rank, world_size: as `torch.distributed.init_process_group`; the defaults read
            torchrun's environment (`env://`).
        timeout_s: a collective that waits longer raises instead of hanging.
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        kwargs = {k: v for k, v in dict(init_method=init_method, rank=rank, world_size=world_size).items()
                  if v is not None}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return collective_world(None, exact_size)


@contextmanager
def fail_fast(*, timeout_s: float = LIVE_WAIT_S) -> Iterator[None]:
    """Run a rank's body so that a failure anywhere stops every rank with an error naming the failed rank.

    While the body runs, a heartbeat thread (`Heartbeat`) reads the default group's store every
    `HEARTBEAT_S`, and once a failure is announced there, shows that this rank is alive. On an exception,
    the rank reports to the store:
    1. a rank whose own code raised records `rank r failed: <error>` as the group's first failure (unless
       another rank's is there already) and aborts its process groups; its peers' pending and later
       collectives then fail at once (gloo: the connections close; NCCL: the communicators abort);
    2. a rank whose collective failed (a `torch.distributed` call raised: a peer aborted, exited or timed
       out) announces the failure and aborts too, so that ranks waiting on it learn of it, then waits until
       the first failure is recorded or every rank has reported. A peer that has neither reported nor shown
       a heartbeat for `SILENCE_S` stopped without raising (it crashed, was killed, or returned and exited
       while a peer still waited); a peer whose heartbeat runs is alive, and is waited for up to
       `timeout_s` (at least `SILENCE_S`). It records as the first failure `rank d stopped without raising
       an error ... while rank r waited in torch.distributed.<op> (<caller>)`, with `rank e is alive (its
       heartbeat runs) but did not report within t s ...` for live peers still silent at the end.
    Every rank then raises `RankFailedError` with the first failure's message, from its own exception; the
    rank that failed first re-raises its own. A rank whose collective failed and which cannot reach the store
    names the store's host instead (rank 0, unless a launcher such as torchrun serves the store).

    Args:
        timeout_s: how long a rank whose collective failed waits for a live peer to report (`LIVE_WAIT_S`
            by default); a slow peer reports as soon as it reaches a `torch.distributed` call.
    """
    heartbeat = Heartbeat.start() if dist.is_initialized() else None
    try:
        yield
    except BaseException as error:
        if not dist.is_initialized():
            raise
        rank = dist.get_rank()
        own = failure_message(rank, error)
        collective = _collective_frame(error)
        try:
            first = _record_failure(rank, own, collective, timeout_s)
        except dist.DistError as unreachable:
            first = own if collective is None else (
                "rank 0 (or the launcher serving the store) stopped: the process group's store is "
                f"unreachable ({type(unreachable).__name__}: {str(unreachable).splitlines()[0]}) and rank "
                f"{rank}'s collective failed ({type(error).__name__}: {error})")
        finally:
            if dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
        if first != own:
            raise RankFailedError(first) from error
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def _failure_store() -> dist.Store:
    return dist.PrefixStore("moonep/fail_fast", dist.distributed_c10d._get_default_store())


class Heartbeat:
    """This rank's sign of life for `fail_fast`: a daemon thread that checks the store for an announced
    failure every `HEARTBEAT_S` and, once there is one, adds 1 to the store's `heartbeat/<rank>` each time.
    Nothing is written while no rank has failed (a file store grows with every write). Stops when the store
    becomes unreachable (its host stopped)."""

    def __init__(self, store: dist.Store, rank: int):
        self.store, self.rank = store, rank
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"moonep-heartbeat-{rank}", daemon=True)

    @classmethod
    def start(cls) -> Heartbeat:
        heartbeat = cls(_failure_store(), dist.get_rank())
        heartbeat._thread.start()
        return heartbeat

    def stop(self) -> None:
        """Stop the thread, waiting for a store request in flight to finish (it returns or raises within the
        store's timeout): a thread still inside one when the interpreter exits aborts the process
        ("terminate called without an active exception"). Warns if the thread is still running after the
        store's timeout."""
        self._stopped.set()
        timeout_s = self.store.timeout.total_seconds() + 2 * HEARTBEAT_S
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            warnings.warn(f"rank {self.rank}: fail_fast's heartbeat thread is still inside a store request "
                          f"after {timeout_s:.0f} s (the store's timeout); the process may abort at exit",
                          RuntimeWarning, stacklevel=2)

    def _run(self) -> None:
        try:
            while not self._stopped.wait(HEARTBEAT_S):
                if self.store.check(["failing"]):
                    self.store.add(f"heartbeat/{self.rank}", 1)
        except dist.DistError:
            return  # the store's host stopped: nobody is left to read a heartbeat


def _record_failure(rank: int, own: str, collective: FrameType | None, timeout_s: float) -> str:
    """Report rank `rank`'s failure (message `own`; `collective`: the frame of the `torch.distributed` call
    that raised it, if one did) to the default group's store and record the group's first failure
    (`fail_fast`'s steps 1 and 2, waiting up to `timeout_s` for live peers); returns the first failure's
    message."""
    size = dist.get_world_size()
    store = _failure_store()
    store.set(f"reported/{rank}", "")
    store.add("reported", 1)
    if collective is None:  # recorded before the peers learn of it (the caller aborts)
        return store.compare_set("first", "", own).decode()
    store.set("failing", "")  # live peers show their heartbeats from now on
    dist.distributed_c10d._abort_process_group()  # a consequence, most likely: ranks waiting on this one fail
    blame = _blame_silent(store, rank, size, collective, timeout_s)
    return store.compare_set("first", "", blame or own).decode()


def _collective_frame(error: BaseException) -> FrameType | None:
    """The frame that raised `error` where it is a `torch.distributed` call (a collective that failed because
    of a peer, most likely), else None."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    if traceback is None or not _module(traceback.tb_frame).startswith("torch.distributed"):
        return None
    return traceback.tb_frame


def _module(frame: FrameType) -> str:
    return frame.f_globals.get("__name__", "")


def _blame_silent(store: dist.Store, rank: int, size: int, collective: FrameType,
                  timeout_s: float) -> str | None:
    """After rank `rank`'s collective (`collective`, its frame) failed: wait until a first failure is recorded
    or all `size` ranks have reported, while a peer that has not reported still shows a heartbeat, at most
    `max(timeout_s, SILENCE_S)`; then the message naming the peers that never reported (those silent for
    `SILENCE_S` as stopped, the others as alive but silent), or None if there is a first failure or every
    rank reported."""
    start = time.monotonic()
    beats: dict[int, tuple[int | None, float]] = {}
    """Rank -> (its heartbeat count, when this rank saw it change; first: when this rank started waiting)."""
    while True:
        if store.check(["first"]):
            return None
        silent = [r for r in range(size) if not store.check([f"reported/{r}"])]
        if not silent:
            return None
        now = time.monotonic()
        for r in silent:
            count = int(store.add(f"heartbeat/{r}", 0)) if store.check([f"heartbeat/{r}"]) else None
            if r not in beats or beats[r][0] != count:
                beats[r] = (count, start if r not in beats else now)
        stopped = [r for r in silent if now - beats[r][1] >= SILENCE_S]
        waited = now - start
        if len(stopped) == len(silent) or waited >= max(timeout_s, SILENCE_S):
            break
        time.sleep(0.02)
    alive = [r for r in silent if r not in stopped]
    parts = [f"{_ranks(stopped)} stopped without raising an error (it exited or was killed: no report and no "
             f"heartbeat for {SILENCE_S:g} s)"] if stopped else []
    if alive:
        verb = "is alive (its heartbeat runs)" if len(alive) == 1 else "are alive (their heartbeats run)"
        parts.append(f"{_ranks(alive)} {verb} but did not report within {waited:.0f} s (slow, or stuck "
                     "outside torch.distributed)")
    caller = call_site(collective, lambda frame: _module(frame).startswith("torch."))
    return (f"{'; '.join(parts)} while rank {rank} waited in torch.distributed.{collective.f_code.co_name} "
            f"({caller})")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
