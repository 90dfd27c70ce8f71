"""Stress mode for the GPU tests: every comm operation first delays a stream, so a missing wait between two
streams (or two thread-ranks) reads stale or garbage data every time instead of once in a while under load.

Switch it on with `MOONEP_STRESS=1` (or `MOONEP_STRESS=<cycles>`, the length of each delay in GPU clock
cycles; 1 means `DEFAULT_CYCLES`, about 10 ms on an H200): `tests/conftest.py` installs it for the whole
pytest session, and spawned rank processes install it themselves (`install_from_env`, called by
`test_symmetric.rank_main`). Off CUDA it changes nothing.

What it does (`Stress.install`): it wraps every comm entry point (`ENTRY_POINTS`: the three EP worlds'
barrier and exchanges, the Buffer's operations, the communicator's calls, the Triton row kernels) so that
before and after each call `torch.cuda._sleep(cycles)` is queued on one kind of stream, in turn
(`TARGETS`, per thread):

- "current": the calling thread's current stream (the caller's stream, or the comm stream inside an
  `async_finish` operation): work queued next on it starts late, so a reader on another stream that does
  not wait for it reads too early;
- "comm": every comm stream of the caller's world (`comm_streams`): results of an `async_finish` operation
  land late, so a caller that does not wait for its event reads too early;
- "peers": the streams of the other thread-ranks of the caller's group, as last seen by their own calls:
  a rank that reads a peer's memory without a barrier reads it before the peer's writes land.

A delay never changes a result where every consumer waits for its producer, so the suite must pass
unchanged in stress mode; what fails there is a missing wait.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

ENV = "MOONEP_STRESS"
DEFAULT_CYCLES = 20_000_000
"""About 10 ms at the H200's 1.98 GHz: far longer than any launch latency a racing reader sees."""
TARGETS = ("current", "comm", "peers")
"""The kinds of stream delayed in turn, one per wrapped call (and again after it returns)."""
ENTRY_POINTS = {
    "moonep_moe.transport.threads": {"ThreadsWorld": ("all_gather", "scatter_rows", "barrier")},
    "moonep_moe.transport.peer": {"PeerWorld": ("gather_rows",)},
    "moonep_moe.transport.symmetric": {"SymmetricWorld": ("all_gather", "scatter_rows", "barrier")},
    "moonep_moe.transport.collective": {"CollectiveWorld": ("all_gather", "scatter_rows", "gather_rows",
                                                       "barrier")},
    "moonep_moe.comm.buffer": {"Buffer": ("dispatch", "combine", "prefetch_weight", "reduce_grad",
                                          "_dispatch", "_combine")},
    "moonep_moe.engine.communicator": {"MoECommunicator": ("dispatch", "dispatch_async", "combine",
                                                    "combine_async", "prefetch_weights")},
    "moonep_moe.comm.kernels.rows": {None: ("send_routes", "record_duplicates",
                                            "expand_duplicates", "copy_rows", "pre_reduce_duplicates",
                                            "gather_routes")},
    "moonep_moe.comm.kernels.experts": {None: ("copy_experts", "add_replicas", "clear_slots")},
}
"""module -> class (None: the module's functions) -> names wrapped. Modules that cannot be imported here
(torch.distributed's symmetric memory, Triton) are skipped."""


def comm_streams(world: Any) -> list[torch.cuda.Stream]:
    """The comm streams (`Buffer._comm_stream`) created so far in `world.globals`."""
    return [value for key, value in getattr(world, "globals", {}).items()
            if isinstance(key, tuple) and key and key[0] == "comm_stream"]


def _world_of(target: Any) -> Any:
    """The EP world of a wrapped call's `self` (a world, a Buffer or a communicator), else None."""
    if hasattr(target, "barrier") and hasattr(target, "rank"):
        return target
    return getattr(target, "world", None)


class Stress:
    """Installs the delays (see the module docstring); `uninstall()` restores every entry point.

    Args:
        cycles: length of each delay in GPU clock cycles.
        sleep: queues a delay on the current stream (`torch.cuda._sleep`; tests pass a recorder).
    """

    def __init__(self, cycles: int = DEFAULT_CYCLES, sleep: Callable[[int], None] | None = None):
        self.cycles = cycles
        self.sleep = sleep or torch.cuda._sleep
        self._local = threading.local()
        self._lock = threading.Lock()
        self._rank_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        """(thread group uid, rank) -> that thread-rank's stream at its latest wrapped call."""
        self._originals: list[tuple[Any, str, Any]] = []

    # -- which streams --------------------------------------------------------------------------------------

    def next_target(self) -> str:
        """The kind of stream this thread delays next (`TARGETS` in turn, per thread)."""
        counter = getattr(self._local, "counter", None)
        if counter is None:
            counter = self._local.counter = itertools.count()
        return TARGETS[next(counter) % len(TARGETS)]

    def streams(self, target: str, world: Any) -> list[torch.cuda.Stream]:
        """The CUDA streams of `target` for a call of `world`'s rank on this thread (none off CUDA)."""
        device = getattr(world, "device", None)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if device is None or torch.device(device).type != "cuda":
            return []
        current = torch.cuda.current_stream(device)
        group = getattr(world, "group", None)
        key = (getattr(group, "uid", None), getattr(world, "rank", None))
        if key[0] is not None:
            with self._lock:
                self._rank_streams[key] = current
        if target == "current":
            return [current]
        if torch.cuda.is_current_stream_capturing():
            return []  # a graph being captured: only its own stream is delayed (the delay is captured too)
        if target == "comm":
            return comm_streams(world)
        with self._lock:
            return [stream for (uid, rank), stream in self._rank_streams.items()
                    if uid == key[0] and uid is not None and rank != key[1] and stream != current]

    def delay(self, world: Any) -> None:
        """Queue one delay on the streams of this thread's next target."""
        for stream in self.streams(self.next_target(), world):
            with torch.cuda.stream(stream):
                self.sleep(self.cycles)

    # -- wrapping -------------------------------------------------------------------------------------------

    def wrap(self, fn: Callable, method: bool) -> Callable:
        @functools.wraps(fn)
        def stressed(*args, **kwargs):
            world = _world_of(args[0]) if method and args else None
            self.delay(world)
            result = fn(*args, **kwargs)
            self.delay(world)
            return result

        stressed.__stressed__ = True
        return stressed

    def install(self) -> Stress:
        for owner, name, method in _entry_points():
            original = vars(owner)[name]
            if getattr(original, "__stressed__", False):
                continue
            self._originals.append((owner, name, original))
            setattr(owner, name, self.wrap(original, method))
        return self

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()


def _entry_points() -> Iterator[tuple[Any, str, bool]]:
    """(class or module, attribute, is a method) of every `ENTRY_POINTS` entry whose module imports here."""
    for module_name, owners in ENTRY_POINTS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for class_name, names in owners.items():
            owner = module if class_name is None else getattr(module, class_name)
            for name in names:
                if class_name is None or name in owner.__dict__:
                    yield owner, name, class_name is not None


def cycles_from_env() -> int | None:
    """`MOONEP_STRESS` as delay cycles: None when unset or 0, `DEFAULT_CYCLES` for 1."""
    value = int(os.environ.get(ENV, "0") or 0)
    if value <= 0:
        return None
    return DEFAULT_CYCLES if value == 1 else value


def install_from_env() -> Stress | None:
    """Install the stress mode where `MOONEP_STRESS` asks for it and CUDA is available."""
    cycles = cycles_from_env()
    if cycles is None or not torch.cuda.is_available():
        return None
    return Stress(cycles).install()
