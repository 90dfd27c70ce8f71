"""`grouped_gemm='auto'`: time every backend that can run, per primitive and weight shape, and keep the
fastest (`MeasuredGroupedGemm`); the choices are cached in process and in a JSON file
(`ChoiceCache`, `default_choice_cache`), so later processes read them instead of timing. The ranks of an EP
group run rank 0's choices (`agreed_choices`): timing noise must not make ranks compute the same experts
with different kernels."""

import itertools
import json
import logging
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from moonep_moe.base.sizes import align_up, next_power_of_2
from moonep_moe.base.triton import triton_version
from moonep_moe.gemm.base import OPS, GemmProblem, GroupedGemm, SlotsReady
from moonep_moe.transport.world import EPWorld

logger = logging.getLogger(__name__)  # a child of "moonep_moe"


WGRAD_ADD = "wgrad add"
"""The choice, apart from "wgrad", for a wgrad that adds into given home gradients in a layer whose wgrad
otherwise makes them ("param" mode from a step's second micro-batch on:
`layers.function.accumulating_grads`): the fastest backend at making a gradient need not be the fastest
at adding into one."""


class MeasuredGroupedGemm:
    """Sends each call to the backend measured fastest for its primitive and weight shape ``[cols, inner]``
    (built by ``measure_grouped_gemm``; a wgrad given its home part goes to the ``WGRAD_ADD`` choice where
    there is one); shapes that were not measured go to ``fallback``. Pure dispatch: a dict look-up per call,
    no host sync."""

    name = "auto"
    ops = OPS
    joined_weights = True

    def __init__(self, chosen: dict[tuple[str, int, int], GroupedGemm], fallback: GroupedGemm) -> None:
        self.chosen = chosen
        """``(op, cols, inner) -> backend``."""
        self.fallback = fallback

    def _for(self, op: str, cols: int, inner: int) -> GroupedGemm:
        return self.chosen.get((op, cols, inner), self.fallback)

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
            slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        return self._for("fwd", *weights[0].shape[-2:]).fwd(x, weights, offs_g, slots_ready, out)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
              slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        return self._for("dgrad", *weights[0].shape[-2:]).dgrad(dy, weights, offs_g, slots_ready, out)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        cols, inner = dy.shape[-1], x.shape[-1]
        adding = self.chosen.get((WGRAD_ADD, cols, inner)) if out[0] is not None else None
        return (adding or self._for("wgrad", cols, inner)).wgrad(dy, x, offs_g, out, accumulate)

    def describe(self) -> str:
        """``"fwd 4096x7168: deep_gemm, ..."``: each primitive and weight shape with its backend."""
        return ", ".join(f"{op} {cols}x{inner}: {gemm.name}"
                         for (op, cols, inner), gemm in self.chosen.items())

    def __repr__(self) -> str:
        return f"MeasuredGroupedGemm({self.describe()})"


Timer = Callable[[str, int, int, int, tuple[int, int], Sequence[GroupedGemm]], Sequence[float]]
"""``timer(op, cols, inner, rows_per_group, (home, slot) groups, backends)`` -> seconds of one ``op`` call
per backend (``op``: a primitive, or ``WGRAD_ADD``)."""


class ChoiceCache:
    """Measured winners by key: in this process, and in a JSON file ``{key: backend name}`` that later
    processes read instead of timing again (``path`` None: this process only). A write merges with the
    file and replaces it atomically; an unreadable file counts as empty, an unwritable one warns."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._choices: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        if key not in self._choices and self.path is not None:
            self._choices = {**self._read(), **self._choices}
        return self._choices.get(key)

    def put(self, key: str, name: str) -> None:
        self._choices[key] = name
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as tmp:
                json.dump({**self._read(), key: name}, tmp, indent=1, sort_keys=True)
            os.replace(tmp.name, self.path)
        except OSError as error:
            warnings.warn(f"grouped-GEMM choice not saved to {self.path}: {error}", stacklevel=2)

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


_DEFAULT_CACHE: ChoiceCache | None = None


_MEASURE_LOCK = threading.Lock()  # thread-ranks build their layers at once: one times, the others read


def default_choice_cache() -> ChoiceCache:
    """The process's cache; its file is ``$MOONEP_MOE_CACHE/gemm.json``, per user by default
    (``$XDG_CACHE_HOME/moonep-moe``, else ``~/.cache/moonep-moe``), none with ``MOONEP_MOE_CACHE=off``."""
    global _DEFAULT_CACHE
    if _DEFAULT_CACHE is None:
        user_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        folder = os.environ.get("MOONEP_MOE_CACHE", str(Path(user_cache) / "moonep-moe"))
        _DEFAULT_CACHE = ChoiceCache(None if folder == "off" else Path(folder) / "gemm.json")
    return _DEFAULT_CACHE


def rows_bucket(rows_per_group: int, align: int) -> int:
    """The rows per group timed for ``rows_per_group``: the next power of two, rounded up to ``align``."""
    return align_up(next_power_of_2(rows_per_group), align)


MAX_TIMED_GROUPS = 32
"""Enough groups that a grouped GEMM's scheduling and tails show (8 said little about 256 groups)."""


TIMING_BYTES = 6 << 30
"""Cap on the tensors one timing allocates (``timed_groups``)."""


FILLED_SLOTS = 1
"""Slot groups given rows when a problem with slots is timed: a balanced plan fills few of a rank's slots
(the busiest rank of a DeepSeek-V3 EP=8 plan at S=8192 fills 1 at maxvio 0 and 2 at maxvio 20, `bench.gemm
--preset ep8`) and the rest carry no rows."""


def timed_groups(problem: GemmProblem, cols: int, inner: int, rows: int) -> tuple[int, int]:
    """The ``(home, slot)`` groups timed for one weight shape: ``min(home, MAX_TIMED_GROUPS)`` home groups and
    ``FILLED_SLOTS`` slot groups where the problem has slots (a plan's share), fewer home groups where one
    group's tensors times the count would pass ``TIMING_BYTES`` (bf16 rows of x and dy, and at most a bf16
    weight or made gradient plus an fp32 gradient per group: ``2 rows (cols + inner) + 6 cols inner`` bytes;
    DeepSeek-V3's gate_up at 2048 rows: 222 MB, so 29 groups); at least one group."""
    home, slots = problem.groups
    per_group = 2 * rows * (cols + inner) + 6 * cols * inner
    cap = max(1, min(MAX_TIMED_GROUPS, TIMING_BYTES // per_group))
    if not home:
        return 0, min(slots, cap)
    timed_slots = min(slots, FILLED_SLOTS, cap - 1)
    return min(home, cap - timed_slots), timed_slots


def measure_grouped_gemm(backends: Sequence[GroupedGemm], problem: GemmProblem, context: str, timer: Timer,
                         cache: ChoiceCache, align: int = 1, world: EPWorld | None = None
                         ) -> MeasuredGroupedGemm:
    """For every primitive and weight shape of ``problem``: the cached winner, or the fastest by ``timer`` of
    the backends that compute that primitive themselves (then cached); with a ``world`` of several ranks,
    rank 0's choices on every rank (collective: ``agreed_choices``), while each rank's cache keeps what it
    measured.

    Args:
        backends: the candidates; the first is also the fallback for shapes not measured.
        context: what else the speed depends on (device name, versions, dtype); part of every cache key,
            with the primitive, ``cols`` (``n=`` in the key), ``inner`` (``k=``), the timed rows per group,
            the timed ``(home, slot)`` groups (``groups=h+s``), the candidates' names and, for wgrad,
            ``problem.grad_dtype`` where it is given and the mode (``fresh`` or ``add``; a problem of fresh
            home gradients also times the ``add`` form, as ``WGRAD_ADD``: the calls that add into them).
            Keys without ``groups=`` (before wgrad was timed in the layer's mode, on 8 groups) are never
            read again.
        timer: ``timer(op, cols, inner, rows_per_group, groups, backends)`` -> seconds each (``cuda_timer``
            on a GPU).
        cache: where winners are looked up and stored.
        align: the segment alignment (``token_padding``); the timed rows per group are a multiple of it.
        world: the EP group whose ranks must run the same backends (None: this process alone).
    """
    by_name = {gemm.name: gemm for gemm in backends}
    shapes_nk = dict.fromkeys(problem.shapes_nk)
    forms = (*OPS, WGRAD_ADD) if problem.fresh_home_grads else OPS
    slots = [(form, cols, inner) for form, (cols, inner) in itertools.product(forms, shapes_nk)]
    rows = rows_bucket(problem.rows_per_group, align)
    where = str(cache.path) if cache.path is not None else "this process only (MOONEP_MOE_CACHE=off)"
    chosen, timed = {}, 0
    with _MEASURE_LOCK:
        for form, cols, inner in slots:
            op = form.split()[0]
            rivals = [gemm for gemm in backends if op in gemm.ops]
            if not rivals:
                continue
            names = "/".join(gemm.name for gemm in rivals)
            groups = timed_groups(problem, cols, inner, rows)
            key = f"{context}|{op}|n={cols}|k={inner}|rows={rows}|groups={groups[0]}+{groups[1]}|{names}"
            if op == "wgrad" and problem.grad_dtype is not None:
                key += f"|grad={str(problem.grad_dtype).removeprefix('torch.')}"
            if op == "wgrad":
                key += "|fresh" if problem.fresh_home_grads and form == op else "|add"
            name = cache.get(key) if len(rivals) > 1 else rivals[0].name
            if name not in by_name:
                logger.info("grouped_gemm=auto: timing %s %s on [%d, %d] weights, %d + %d groups of %d rows "
                            "(%s), once: the winner is kept in %s", names, op, cols, inner, *groups, rows,
                            context, where)
                start = time.perf_counter()
                timings = list(zip(timer(form, cols, inner, rows, groups, rivals), names.split("/"),
                                   strict=True))
                name = min(timings)[1]
                logger.info("grouped_gemm=auto: %s %dx%d -> %s (%s; timed in %.1f s)", form, cols, inner,
                            name, ", ".join(f"{rival} {t * 1e3:.3f} ms" for t, rival in timings),
                            time.perf_counter() - start)
                cache.put(key, name)
                timed += 1
            chosen[(form, cols, inner)] = by_name[name]
    if world is not None and world.size > 1:  # outside the lock: thread-ranks meet at the world's barriers
        chosen = agreed_choices(chosen, backends, slots, world)
    gemm = MeasuredGroupedGemm(chosen, fallback=backends[0])
    logger.info("grouped_gemm=auto (%s, %d rows per group): %s; %d timed, the rest from the cache %s "
                "(MOONEP_MOE_CACHE=<folder> moves it, =off disables it)", context, rows,
                gemm.describe(), timed, where)
    return gemm


NAME_BYTES = 32
"""Bytes of a backend's name in `agreed_choices`' all-gather (names are shorter)."""


Choices = dict[tuple[str, int, int], GroupedGemm]
"""``(op, cols, inner) -> backend``: a measured choice per primitive and weight shape."""


def agreed_choices(chosen: Choices, backends: Sequence[GroupedGemm], slots: Sequence[tuple[str, int, int]],
                   world: EPWorld) -> Choices:
    """Rank 0's ``chosen`` on every rank (collective): one all-gather of each rank's choice for every
    ``(op, cols, inner)`` of ``slots`` (the same list on every rank) as the backend's name in
    ``NAME_BYTES`` bytes, empty where it has none (the fallback, ``backends[0]``, runs it), read on the host
    (construction time).

    Raises:
        ValueError naming the rank, the primitive and the backend where rank 0 chose one this rank lacks.
    """
    mine = torch.zeros(len(slots), NAME_BYTES, dtype=torch.uint8)
    for i, slot in enumerate(slots):
        if slot in chosen:
            name = chosen[slot].name.encode()
            mine[i, :len(name)] = torch.tensor(list(name[:NAME_BYTES]), dtype=torch.uint8)
    first = world.all_gather(mine.to(world.device))[0].cpu()
    by_name = {gemm.name: gemm for gemm in backends}
    agreed = {}
    for (op, cols, inner), name_b in zip(slots, first, strict=True):
        name = bytes(name_b.tolist()).rstrip(b"\0").decode()
        if not name:
            continue
        if name not in by_name:
            raise ValueError(f"rank {world.rank}: grouped_gemm='auto': rank 0 runs {name} for {op} "
                             f"{cols}x{inner}, which this rank cannot run (its candidates: "
                             f"{', '.join(by_name)})")
        agreed[(op, cols, inner)] = by_name[name]
    if agreed != chosen:
        logger.info("grouped_gemm=auto: rank %d runs rank 0's choices; it measured %s", world.rank,
                    MeasuredGroupedGemm(chosen, backends[0]).describe())
    return agreed


def choice_context(device_name: str, dtype: torch.dtype) -> str:
    """What a measured choice depends on besides the problem: the device's name, the torch and Triton
    versions and the dtype (the first part of every ``ChoiceCache`` key)."""
    return f"{device_name}|torch {torch.__version__}|triton {triton_version()}|{dtype}".replace("torch.", "")


def cuda_timer(device: torch.device, dtype: torch.dtype, grad_dtype: torch.dtype, fresh_home_grads: bool,
               warmup: int = 2, repeat: int = 5) -> Timer:
    """A ``Timer`` on synthetic uniform segments of the given rows and groups, random data, the weights as
    one tensor, wgrad as the layer calls it (``timed_calls``); the backends timed in turns on CUDA events
    (``seconds_in_turns``: median of ``repeat`` rounds after ``warmup`` calls each)."""

    def timer(op: str, cols: int, inner: int, rows: int, groups: tuple[int, int],
              backends: Sequence[GroupedGemm]) -> list[float]:
        calls = timed_calls(op, cols, inner, rows, groups, backends, device, dtype, grad_dtype,
                            fresh_home_grads)
        return seconds_in_turns(calls, [f"{gemm.name} {op} {cols}x{inner}" for gemm in backends], warmup,
                                repeat, CudaClock())

    return timer


def timed_calls(op: str, cols: int, inner: int, rows: int, groups: tuple[int, int],
                backends: Sequence[GroupedGemm], device: torch.device, dtype: torch.dtype,
                grad_dtype: torch.dtype, fresh_home_grads: bool) -> list[Callable[[], object]]:
    """One call of ``op`` per backend on ``home + slot`` groups of ``rows`` rows each. wgrad runs the way the
    layer runs it: with ``fresh_home_grads`` the home part None (made by the backend) and the slot gradients
    (of ``grad_dtype``, as the home ones) overwritten; else, and for ``WGRAD_ADD``, adding into home and slot
    gradients of ``grad_dtype``."""
    home, slots = groups
    offs_g = torch.arange(1, home + slots + 1, dtype=torch.int32, device=device) * rows
    x = torch.randn((home + slots) * rows, inner, device=device, dtype=dtype)
    dy = torch.randn((home + slots) * rows, cols, device=device, dtype=dtype)
    if op in ("wgrad", WGRAD_ADD):
        slot_grads = torch.zeros(slots, cols, inner, device=device, dtype=grad_dtype)
        if fresh_home_grads and op == "wgrad":
            return [lambda g=gemm: g.wgrad(dy, x, offs_g, (None, slot_grads), accumulate=False)
                    for gemm in backends]
        home_grads = torch.zeros(home, cols, inner, device=device, dtype=grad_dtype)
        return [lambda g=gemm: g.wgrad(dy, x, offs_g, (home_grads, slot_grads), accumulate=True)
                for gemm in backends]
    w = torch.randn(home + slots, cols, inner, device=device, dtype=dtype) / inner**0.5
    a = x if op == "fwd" else dy
    return [lambda g=gemm: getattr(g, op)(a, (w,), offs_g) for gemm in backends]


class CudaClock:
    """Marks on the current CUDA stream (recorded events) and the seconds between two of them."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def seconds_in_turns(calls: Sequence[Callable[[], object]], names: Sequence[str], warmup: int, repeat: int,
                     clock) -> list[float]:
    """Median seconds of one call of each of ``calls``, timed in turns: every call runs ``warmup`` times
    first (compilation, autotuning), then each of ``repeat`` rounds runs every call once, so no candidate is
    timed on a GPU warmer or cooler than another's (one candidate after another, the first would run on the
    coolest GPU and the near ties between backends would follow the order). The rounds are queued without a
    host wait; ``clock`` marks the stream around each call and reads the seconds between marks at the end. A
    call that raises is reported (``names``) and counts as infinitely slow."""
    failed: set[int] = set()

    def run(i: int) -> bool:
        try:
            calls[i]()
        except Exception as error:  # noqa: BLE001 - a candidate that fails here is not chosen
            warnings.warn(f"grouped-GEMM candidate {names[i]} failed while timed: {error!r}", stacklevel=3)
            failed.add(i)
        return i not in failed

    for i in range(len(calls)):
        for _ in range(warmup):
            if not run(i):
                break
    marks: list[list[tuple[object, object]]] = [[] for _ in calls]
    for _ in range(repeat):
        for i in range(len(calls)):
            if i not in failed:
                start = clock.mark()
                if run(i):
                    marks[i].append((start, clock.mark()))
    try:
        seconds = [[clock.seconds(start, end) for start, end in pairs] for pairs in marks]
    except Exception as error:  # noqa: BLE001 - an asynchronous failure surfaces at the read
        warnings.warn(f"grouped-GEMM candidates {list(names)} failed while timed: {error!r}", stacklevel=2)
        return [float("inf")] * len(calls)
    return [float("inf") if i in failed or not times else statistics.median(times)
            for i, times in enumerate(seconds)]
