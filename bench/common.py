"""What every benchmark shares: the machine's measured limits, a CUDA-event timer and the spread of its
repetitions, calls timed in turns (each after an L2 flush, if asked), ratios of spreads and targets checked
on them, the models' shapes, and the JSON record.

Every result file holds the device, the commit, the command line and the baselines measured in the same run
(`limits`: device-to-device copy bandwidth and dense bf16 GEMM rate), so every speed can be stated as a ratio.

A `Span` is `(median, min, max)` of repeated timings (or of a ratio of them); a target is checked on the
median and recorded with the spread beside it (`check`).
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from moonep_moe.config import load_config
from moonep_moe.transport.arena import physical_bytes

RESULTS = Path(os.environ.get("MOONEP_BENCH_OUT") or Path(__file__).resolve().parent / "results")
"""Where records go: bench/results, or $MOONEP_BENCH_OUT (e.g. a remote machine's output folder)."""


def timings(fn: Callable[[], object], warmup: int = 3, repeat: int = 10) -> list[float]:
    """Seconds of each of `repeat` runs of `fn()` after `warmup`, each timed with its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


SLEEP_CYCLES_PER_S = 1.98e9
"""`torch.cuda._sleep` counts SM cycles: this many a second at the H200's top SM clock (1980 MHz); at a lower
clock a wait lasts longer."""


@dataclass
class HostAhead:
    """Runs timed on the GPU with the host ahead, as a layer runs inside a model.

    Before each run the GPU is held in a device-side wait (`torch.cuda._sleep`) longer than the host took to
    enqueue the slowest of the last `window` runs (`margin` times that, between `min_hold_s` and
    `max_hold_s`: one slow run, a first call that compiles or autotunes, lengthens only the next few
    holds), so the host has queued the whole run before the GPU reaches it: the run's events then time its
    kernels and the waits between them, not the host's launch latency. In a model the host enqueues a layer
    while the GPU works through the layers before it, so a layer with no host sync inside runs like this as
    long as the host keeps up, which `host_s` (each run's enqueue time on the host) shows. A run whose host
    took longer than its hold (`held_s`) is `behind`: it may include launch latency (the next run holds
    longer). A run with a host sync inside is timed as it runs: after the sync the GPU waits on the host,
    and the host's time includes the hold and the GPU's work, so such runs are behind every hold and the
    hold stays at `max_hold_s`. On the CPU nothing is held and the host clock times the run.

    Use: `start = ahead.start()`, the run, `end = ahead.end()`, then wait for `end`."""

    device: torch.device
    min_hold_s: float = 0.005
    max_hold_s: float = 0.1
    margin: float = 1.5
    window: int = 3
    hold_s: float = 0.0
    host_s: list[float] = field(default_factory=list)
    held_s: list[float] = field(default_factory=list)
    _recent: list[float] = field(default_factory=list)
    _enqueued: float = 0.0

    def start(self) -> Stamp:
        """The GPU idle and held (CUDA), then the run's start stamp; the host clock starts."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.hold_s = max(self.hold_s, self.min_hold_s)
            torch.cuda._sleep(int(self.hold_s * SLEEP_CYCLES_PER_S))
        start = stamp(self.device)
        self._enqueued = time.perf_counter()
        return start

    def end(self) -> Stamp:
        """The run's end stamp; its host enqueue time and hold kept, the next hold sized from the last
        `window` runs."""
        host = time.perf_counter() - self._enqueued
        end = stamp(self.device)
        self.host_s.append(host)
        self.held_s.append(self.hold_s if self.device.type == "cuda" else math.inf)
        self._recent = [*self._recent, host][-self.window:]
        self.hold_s = min(max(self.margin * max(self._recent), self.min_hold_s), self.max_hold_s)
        return end

    def forget(self) -> None:
        """Drop the runs kept so far (warm-up runs); the holds they sized stay."""
        self.host_s.clear()
        self.held_s.clear()

    @property
    def behind(self) -> int:
        """The kept runs whose host took longer than the GPU was held."""
        return sum(host > held for host, held in zip(self.host_s, self.held_s, strict=True))

    def describe(self) -> dict[str, float | int]:
        """The record's view of the kept runs: the host's enqueue time (ms, median and max), the runs it fell
        behind its hold, and the last hold (ms; 0 on the CPU)."""
        ms = [s * 1e3 for s in self.host_s] or [0.0]
        hold = self.hold_s * 1e3 if self.device.type == "cuda" else 0.0
        return {"host_ms": statistics.median(ms), "host_ms_max": max(ms), "host_behind": self.behind,
                "hold_ms": hold}


def queued_timings(fn: Callable[[], object], warmup: int = 3, repeat: int = 10,
                   device: torch.device | str = "cuda") -> tuple[list[float], HostAhead]:
    """Seconds of each of `repeat` runs of `fn()` after `warmup`, each with the host ahead (`HostAhead`,
    which the warm-up runs size and which is returned holding the timed runs' host times)."""
    ahead = HostAhead(torch.device(device))
    times = []
    for i in range(warmup + repeat):
        if i == warmup:
            ahead.forget()
        start = ahead.start()
        fn()
        end = ahead.end()
        if isinstance(end, torch.cuda.Event):
            end.synchronize()
        if i >= warmup:
            times.append(seconds_between(start, end))
    return times, ahead


def alternated_timings(calls: Sequence[Callable[[], object]], repeat: int, warmup: int = 2,
                       before: Sequence[Callable[[], object] | None] | None = None,
                       device: torch.device | str = "cuda") -> list[list[float]]:
    """Seconds of each of `calls` timed in turns, so that a drift of the GPU's clocks or temperature during
    the run falls on every call alike: `warmup` untimed rounds, then `repeat` timed ones, each round running
    every call once in rotated order (round r, warmup rounds counted, starts with call r mod n: A B, B A,
    A B, ... for two), so no call always runs first. Before each run of call i, `before[i]()` runs untimed
    (an L2 flush, the call that precedes it in its step; None: nothing); on CUDA only the call is inside
    the events (one pair of events per run, then a sync), on the CPU the host clock times it.

    Returns `[[seconds of round 0, round 1, ...] for each call]`; index r of every list is round r."""
    before = list(before) if before is not None else [None] * len(calls)
    if len(before) != len(calls):
        raise ValueError(f"alternated_timings: {len(calls)} calls but {len(before)} befores")
    device = torch.device(device)
    times: list[list[float]] = [[] for _ in calls]
    for r in range(warmup + repeat):
        for i in ((r + j) % len(calls) for j in range(len(calls))):
            if before[i] is not None:
                before[i]()
            start = stamp(device)
            calls[i]()
            end = stamp(device)
            if isinstance(end, torch.cuda.Event):
                end.synchronize()
            if r >= warmup:
                times[i].append(seconds_between(start, end))
    return times


def l2_flush(mib: int = 256, idle_ms: float = 0.0) -> Callable[[], None]:
    """A function that empties the current GPU's L2 cache as DeepGEMM's benchmarks do: it writes zeros over
    a `mib` MiB buffer (allocated once here; several times the H200's L2), so the next call reads its
    operands from HBM, as a call amid a training step does. `idle_ms` > 0 first holds the GPU
    in a device-side wait (`torch.cuda._sleep`, cycles at the H200's 1980 MHz top SM clock: longer at a lower
    clock): an idle gap that lets clocks and power settle. For `alternated_timings`' `before`."""
    buffer = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda") if mib > 0 else None
    cycles = int(idle_ms * 1.98e6)

    def flush() -> None:
        if cycles > 0:
            torch.cuda._sleep(cycles)
        if buffer is not None:
            buffer.zero_()

    return flush


def timed(fn: Callable[[], object], warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds of `fn()` over `repeat` runs after `warmup` (`timings`)."""
    return statistics.median(timings(fn, warmup, repeat))


def spread(seconds: list[float]) -> dict[str, float | list[float]]:
    """Repeated timings in ms: `ms` (the median), `ms_min` and `ms_max` (the spread: min-max, every run
    counted) and `ms_samples` (each run, in the order run)."""
    if not seconds:
        raise ValueError("spread needs at least one timing, got none")
    ms = [s * 1e3 for s in seconds]
    return {"ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms), "ms_samples": ms}


def median_spread(values: list[float]) -> dict[str, float]:
    """`{"median", "min", "max"}` of per-step (or per-round) values: shares, ratios."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


Span = tuple[float, float, float]
"""`(median, min, max)`: repeated timings (`span`) or a ratio of them (`ratio`)."""


def span(row: dict, prefix: str = "") -> Span:
    """The `(median, min, max)` of a `spread` stored in `row` under `prefix` (`fwd_ms`, `fwd_ms_min`, ...)."""
    return row[f"{prefix}ms"], row[f"{prefix}ms_min"], row[f"{prefix}ms_max"]


def as_span(value: Span | float) -> Span:
    """A number measured once (a peak, a rate, a floor) as a Span without spread."""
    return value if isinstance(value, tuple) else (value, value, value)


def ratio(num: Span | float, den: Span | float) -> Span:
    """`num / den`: the medians' ratio, and the range over every pairing of their runs (num's min over den's
    max, num's max over den's min). A number is a value measured once (no spread)."""
    (n, n_min, n_max), (d, d_min, d_max) = as_span(num), as_span(den)
    return n / d, n_min / d_max, n_max / d_min


def total(*spans: Span) -> Span:
    """The sum of several timed things: medians, minima and maxima each summed."""
    return tuple(sum(values) for values in zip(*spans, strict=True))


OPS = {">=": operator.ge, "<=": operator.le}
"""A target's comparison, of the median against the bound."""


def check(target: str, value: Span | float, op: str, bound: float, **fields: object) -> dict:
    """One target measured: `{"target", "median", "min", "max", "op", "bound", "pass", **fields}`; `pass`
    compares the median with `bound` (`op` is ">=" or "<="), the min-max is the spread beside it."""
    if op not in OPS:
        raise ValueError(f"check: op must be one of {sorted(OPS)}, got {op!r}")
    median, low, high = (float(v) for v in as_span(value))
    return {"target": target, "median": median, "min": low, "max": high, "op": op, "bound": bound,
            "pass": bool(OPS[op](median, bound)), **fields}


def format_check(result: dict) -> str:
    """One printed line: `PASS` or `MISS`, the target, its median (min-max) and the bound."""
    verdict = "PASS" if result["pass"] else "MISS"
    return (f"{verdict}  {result['target']}: {result['median']:.3f} ({result['min']:.3f}-{result['max']:.3f})"
            f", target {result['op']} {result['bound']}")


MODELS = ("deepseek-v3", "kimi-k2", "qwen3-moe-30b-a3b", "mixtral-8x7b")
"""The models of bench.layer's tables, each a packaged layer config (`moonep_moe/configs/<name>.yaml`)."""


def config_field(text: str) -> tuple[str, object]:
    """`FIELD=VALUE` (an argparse type) -> `(FIELD, VALUE parsed as YAML)`: `token_padding=128` gives the int
    128. The benches' `--config` takes MoEConfig fields this way."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return field, yaml.safe_load(value)


def config_suffix(fields: dict[str, object]) -> str:
    """`-FIELD-VALUE` per field, for a record's name: a variant's record never takes a DEFAULT record's."""
    return "".join(f"-{key}-{value}" for key, value in fields.items())


def model_shape(name: str) -> dict[str, int]:
    """A packaged config's shapes, the one source of truth for the benchmarks: `hidden` (H), `ffn` (H'),
    `experts` (E), `top_k` (K), `tokens` (S, `max_tokens_per_rank`) and `ep_size` (R)."""
    cfg = load_config(name)
    return {"hidden": cfg.hidden_size, "ffn": cfg.ffn_hidden_size, "experts": cfg.num_experts,
            "top_k": cfg.top_k, "tokens": cfg.max_tokens_per_rank, "ep_size": cfg.ep_size}


Stamp = torch.cuda.Event | float
"""A point in time: a recorded CUDA event, or the host clock's seconds (CPU)."""


def stamp(device: torch.device) -> Stamp:
    """A point in time on this thread's current stream (CUDA event) or on the host clock (CPU)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start: Stamp, end: Stamp) -> float:
    """Seconds from `start` to `end` (CUDA events: both recorded and complete)."""
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3


def cuda_kernels(run: Callable[[], object]) -> list[tuple[str, float]]:
    """`[(name, ms)]`: every GPU kernel, copy and fill `run()` launches, one entry per launch
    (torch.profiler's CUDA activity; user annotations left out)."""
    return [(name, end - start) for name, start, end in cuda_timeline(run)]


def cuda_timeline(run: Callable[[], object]) -> list[tuple[str, float, float]]:
    """`[(name, start_ms, end_ms)]`: `cuda_kernels` with each launch's start and end on the profiler's
    clock (any stream)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [(event.name, event.time_range.start / 1e3, event.time_range.end / 1e3) for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(event, "is_user_annotation", False)]


def idle_gaps(timeline: list[tuple[str, float, float]], top: int = 8) -> dict:
    """Where a `cuda_timeline` leaves the GPU running nothing: `span_ms` (first start to last end), `busy_ms`
    (the union of the launches' intervals over every stream), `idle_ms` (the rest) and the `top` longest
    gaps (`ms`, the kernel that ended before it, `after`, and the one that started after it, `before`).
    Under the profiler each launch costs the host a little more, so gaps read somewhat longer than in an
    unprofiled run."""
    if not timeline:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    ordered = sorted(timeline, key=lambda launch: launch[1])
    busy, gaps = 0.0, []
    current_name, current_start, current_end = ordered[0]
    for name, start, end in ordered[1:]:
        if start > current_end:
            busy += current_end - current_start
            gaps.append({"ms": start - current_end, "after": current_name, "before": name})
            current_start = start
        if end >= current_end:
            current_name, current_end = name, end
    busy += current_end - current_start
    span = current_end - ordered[0][1]
    gaps.sort(key=lambda gap: -gap["ms"])
    return {"span_ms": span, "busy_ms": busy, "idle_ms": span - busy, "gaps": gaps[:top]}


def captured_graph(step: Callable[[], object], runs: int = 2) -> torch.cuda.CUDAGraph:
    """`step` captured once in a CUDA graph, after `runs` eager runs on a side stream (compilation, lazy
    allocations and comm streams made off the capturing stream, as capture asks). Replay it for new inputs
    copied into the tensors `step` reads."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(runs):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graph_timed(fn: Callable[[], object], warmup: int = 3, repeat: int = 10, calls: int = 20) -> float:
    """Median seconds of one `fn()` on the device alone: `calls` calls captured in one CUDA graph, the graph
    replayed `repeat` times (after `warmup`) and timed with CUDA events; no host launch time is counted.
    `fn` must be capturable (no host sync) and run once before capture (compilation)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timed(graph.replay, warmup, repeat) / calls


def measure_limits() -> dict[str, float]:
    """The two ceilings: device copy bandwidth (bytes read + written per second, 4 GiB copy) and the dense
    bf16 GEMM rate (8192^3 through torch.matmul, random data)."""
    src = torch.empty(2**30, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gemm_s = timed(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * 4 * 2**30 / copy_s, "dense_bf16_flops_per_s": 2 * 8192**3 / gemm_s}


GPU_QUERY = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
"""What `gpu_state` reads (nvidia-smi's names): SM and memory clocks (MHz), power (W), temperature (C)."""


def gpu_state(device: torch.device) -> dict[str, object]:
    """The GPU's clocks, power and temperature now (`GPU_QUERY`, through nvidia-smi), the peak memory the
    caching allocator gave out since the last reset and the expert arena's memory beside it (GB): logged
    beside timings, since a GPU at its power limit clocks down as it heats up and a median depends on when
    it was taken. {} off CUDA; without nvidia-smi only the memory."""
    if device.type != "cuda":
        return {}
    state: dict[str, object] = {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9,
                                "arena_memory_gb": physical_bytes(device) / 1e9}
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    try:
        lines = subprocess.run(["nvidia-smi", f"--query-gpu=uuid,{','.join(GPU_QUERY)}",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                               check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return state
    for line in lines:
        fields = [field.strip() for field in line.split(",")]
        if fields[0].removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            state.update(zip(GPU_QUERY, fields[1:], strict=False))
    return state


def commit() -> str:
    """The checked-out commit (`-dirty` with uncommitted changes); `MOONEP_COMMIT` where there is no git
    (a copied tree on a device machine)."""
    if "MOONEP_COMMIT" in os.environ:
        return os.environ["MOONEP_COMMIT"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_record(name: str, limits: dict[str, float], rows: list[dict], out_dir: Path | None = None,
                 ran_on: str | torch.device | None = None, **fields: object) -> Path:
    """`bench/results/<name>-<device>-<date>-<commit>.json` (or under `out_dir`) with device, commit,
    command, the limits measured in the run, the rows and any further `fields` (setup, baselines); one file
    per commit and day, so a later run at another commit never overwrites an earlier record. `ran_on`: the
    device the run measured (default: the GPU when there is one); a CPU run is named "cpu" on any machine."""
    on_cuda = torch.cuda.is_available() if ran_on is None else torch.device(ran_on).type == "cuda"
    device = torch.cuda.get_device_name() if on_cuda else "cpu"
    record = {"benchmark": name, "device": device, "commit": commit(), "command": " ".join(sys.argv),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "limits": limits,
              **fields, "results": rows}
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{device.replace(' ', '_')}-{time.strftime('%Y%m%d')}-{record['commit']}.json"
    path.write_text(json.dumps(record, indent=1))
    return path
