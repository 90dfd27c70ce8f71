"""The arms of bench.ep_group's run, each one rank's step at one maxvio, and how each is timed and recorded:
`RankArm`, a policy's layer (one replayed training step, `bench.rank_replay.replay_step`, its plan checked
against the group's, `check_plan`; for `exact` also the expert block alone right after it, `expert_block`,
`BLOCK_CALLS`), and `NativeArm`, torch-native plain EP eager or compiled (`bench.native_ep`). Each timed step
goes into the arm's `Samples` with the host's enqueue time (`keep`, `host_fields`); from them the arm's row
of the record, the link as local copies and as the NVLink model (`RankArm.row`, `native_row`, by
bench.link_model), and its progress line (`rank_line`). Also how many steps an arm runs (`Repeats`) and
whether two policies planned a group step alike (`same_plans`). Which arms alternate, on which rank, and
when their layers are built is the run's (`bench.ep_group.run_ranks`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.common import HostAhead, median_spread, seconds_between, spread, stamp
from bench.link_model import (
    BESIDE_GEMM,
    bytes_summary,
    layer_link_seconds,
    link_bytes,
    link_seconds,
    native_link_bytes,
    over_link,
    prefetch_rooms,
)
from bench.native_ep import NativePlainEPRank
from bench.rank_replay import (
    OPEN_ENDED,
    PHASES,
    GroupStep,
    ReplayWorld,
    rank_inputs,
    rank_traffic,
    replay_step,
    replica_counts,
)
from moonep_moe.comm.buffer import BEHIND
from moonep_moe.layers.function import compute_offsets
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.layers.swiglu import swiglu_weighted, swiglu_weighted_backward


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BLOCK_CALLS = ("fwd gate_up", "swiglu", "fwd down", "dgrad down", "swiglu backward", "wgrad down",
               "dgrad gate_up", "wgrad gate_up")
"""The expert block's calls in one training step, in order (`expert_block`)."""
SHARED_CALLS = ("shared experts fwd", "shared experts bwd")
"""The block's calls after `BLOCK_CALLS` where the layer has shared experts."""


def expert_block(layer: MoonEPMoELayer, cu_seqlens: torch.Tensor, hidden_sh: torch.Tensor,
                 grad_sh: torch.Tensor) -> list[float]:
    """Seconds of each call of the expert block of one training step (`BLOCK_CALLS`, then `SHARED_CALLS`
    where the layer has shared experts) on this rank's rows alone: the calls `MoonEPExperts` makes (fwd,
    SwiGLU, fwd; dgrad, SwiGLU backward, wgrad, dgrad, wgrad), on the layer's GEMM backend, its weights (home
    experts and slots) and the segments of `cu_seqlens` (the rank's plan), reading the Buffer's rows; then
    the shared experts' forward and backward on the rank's tokens `hidden_sh [S, H]` (output gradient
    `grad_sh`). The slot and shared gradients it writes are cleared after (untimed)."""
    state, experts, buffer = layer._state, layer.experts, layer.buffer
    gemm, device = state.gemm, layer.world.device
    offs_g = compute_offsets(cu_seqlens, layer.world.rank, buffer.epn, buffer.E)
    x_nvsh, w_nvs = buffer.hidden_nvsh_buffer_view, buffer.router_weight_buffer_view
    gate_up_w, down_w = experts.compute_weights(gemm.joined_weights)
    gate_up_slots, down_slots = (pool.local for pool in experts.slot_grads)
    marks = [stamp(device)]

    def timed(call: Callable[[], object]):
        result = call()
        marks.append(stamp(device))
        return result

    with torch.no_grad():
        # the first GEMMs split where the layer splits them (home groups, then slots; nothing to wait for)
        slots_ready = state.slots_ready()
        ab_nv2f = timed(lambda: gemm.fwd(x_nvsh, gate_up_w, offs_g, slots_ready))
        hw_nvf = timed(lambda: swiglu_weighted(ab_nv2f, w_nvs, offs_g[-1:]))
        timed(lambda: gemm.fwd(hw_nvf, down_w, offs_g))
        u_nvf = timed(lambda: gemm.dgrad(x_nvsh, down_w, offs_g, slots_ready))
        dab_nv2f, _, hw_nvf = timed(lambda: swiglu_weighted_backward(u_nvf, ab_nv2f, w_nvs, offs_g[-1:]))
        timed(lambda: gemm.wgrad(x_nvsh, hw_nvf, offs_g, (None, down_slots), False))
        timed(lambda: gemm.dgrad(dab_nv2f, gate_up_w, offs_g))
        timed(lambda: gemm.wgrad(dab_nv2f, x_nvsh, offs_g, (None, gate_up_slots), False))
    if layer.shared_experts is not None:
        x_sh = hidden_sh.detach().requires_grad_()
        shared_sh = timed(lambda: layer.shared_experts(x_sh))
        timed(lambda: shared_sh.backward(grad_sh))
    sync(device)
    gate_up_slots.zero_()
    down_slots.zero_()
    if layer.shared_experts is not None:
        layer.shared_experts.zero_grad(set_to_none=True)
    return [seconds_between(a, b) for a, b in zip(marks, marks[1:], strict=False)]


BEHIND_PASS = PHASES.index("add_replicas")
"""The exchange call `MoEConfig.overlap_reduce_grad` leaves running behind the backward pass: reduce_grad."""


def handed_back(layer: MoonEPMoELayer) -> list:
    """Where the layer's next backward hands the caller's stream back with its reduce_grad still running
    behind (`Buffer.wait_behind` at the end of the backward pass, with a reduction pending): a list the
    layer's Buffer appends a stamp of that stream to (an attribute over its method, replaced by the next
    call; bench-only). Stays empty for a layer without `overlap_reduce_grad`."""
    handed: list = []
    if not layer.config.overlap_reduce_grad:
        return handed
    buffer, world = layer._state.buffer, layer.world

    def wait_behind() -> None:
        if world.globals.get(BEHIND):
            handed.append(stamp(world.device))
        type(buffer).wait_behind(buffer)

    buffer.wait_behind = wait_behind
    return handed


PLAN_FIELDS = ("dst", "cu_seqlens", "experts_to_copy", "compute_groups", "rank_load")
"""The plan fields that decide what a rank computes and moves."""


def same_plans(a: GroupStep, b: GroupStep) -> bool:
    """Whether two policies planned the same group step alike on every rank (`PLAN_FIELDS`): then they run
    the same work, and their timings differ by the run's spread only."""
    return all(torch.equal(getattr(x, name), getattr(y, name)) for x, y in zip(a.plans, b.plans, strict=True)
               for name in PLAN_FIELDS)


def check_plan(layer: MoonEPMoELayer, step: GroupStep, rank: int) -> None:
    """Raise unless the plan rank `rank`'s dispatch made equals the group's plan of that rank."""
    made, want = layer._state.last_plan, step.plans[rank]
    for name in PLAN_FIELDS:
        if not torch.equal(getattr(made, name), getattr(want, name)):
            raise RuntimeError(f"rank {rank}: its dispatch planned another {name} than the group's plan")


@dataclass
class Repeats:
    """How many steps to run and time per arm: `warmup` untimed rounds in each pass, then `repeat` timed
    steps over the two passes (`split`)."""

    warmup: int
    repeat: int

    def split(self) -> tuple[int, int]:
        """Timed rounds of the first and the mirrored second pass."""
        return (self.repeat + 1) // 2, self.repeat // 2


@dataclass
class Samples:
    """One arm's timed steps, gathered over both passes: step seconds, each step's exchange windows (s) and,
    for `exact`, its expert block (GEMM seconds, SwiGLU seconds, every call's seconds)."""

    totals: list[float] = field(default_factory=list)
    hosts: list[float] = field(default_factory=list)
    """Each timed step's enqueue time on the host (s), as `totals`."""
    behind: int = 0
    """Timed steps whose host took longer than the GPU was held (`HostAhead`)."""
    windows: list[list[float]] = field(default_factory=list)
    rooms: list[list[float]] = field(default_factory=list)
    hidden: list[list[float]] = field(default_factory=list)
    """Per timed step and exchange call, the time a prefetch's incoming link time hides under
    (`prefetch_rooms`)."""
    blocks: list[tuple[float, float, list[float]]] = field(default_factory=list)
    reduce_behind: list[float] = field(default_factory=list)
    """Per timed step whose reduce_grad ran behind the backward pass (`MoEConfig.overlap_reduce_grad`), the
    seconds it still ran after the layer's backward gave the caller's stream back."""


def host_fields(samples: Samples) -> dict[str, float | int]:
    """A row's `host_ms` (the host's enqueue time of a step: median) and `host_behind` (timed steps whose host
    fell behind the GPU's hold)."""
    return {"host_ms": statistics.median(samples.hosts) * 1e3, "host_behind": samples.behind}


def keep(samples: Samples, ahead: HostAhead, seconds: float) -> None:
    """A timed step's seconds into `samples`, with its host enqueue time and whether the host fell behind
    its hold (the last run `ahead` kept)."""
    samples.totals.append(seconds)
    samples.hosts.append(ahead.host_s[-1])
    samples.behind += ahead.host_s[-1] > ahead.held_s[-1]


@dataclass(eq=False)
class RankArm:
    """One arm of one rank: its policy's layer at one maxvio (`step`). The layer and its world are attached
    while the policy's segment is open (`open` / `close`)."""

    step: GroupStep
    rank: int
    block: bool
    samples: Samples = field(default_factory=Samples)
    live: tuple | None = None
    checked: bool = False
    ahead: HostAhead | None = None

    def open(self, layer: MoonEPMoELayer, world: ReplayWorld) -> None:
        self.live = (layer, world)

    def close(self) -> None:
        self.live = None

    def run(self, timed: bool) -> None:
        """One replayed training step (`replay_step`), checked against the group's plan the first time; timed:
        its seconds and windows, and with `block` the expert block alone right after it. The peers' traffic
        is staged before the step, untimed, and dropped after it: one arm's staged rows in memory at a time
        (a hot rank's under `off` take gigabytes beside its step's own)."""
        layer, world = self.live
        device = world.device
        traffic, inputs = rank_traffic(self.step, self.rank, layer, world), rank_inputs(self.step, self.rank)
        self.ahead = self.ahead or HostAhead(device)
        handed = handed_back(layer)  # this step's (the layer is shared by the rank's maxvio arms)
        start = self.ahead.start()
        replay_step(layer, world, self.step, inputs, traffic)
        end = self.ahead.end()
        sync(device)
        del traffic
        if not self.checked:
            check_plan(layer, self.step, self.rank)
            self.checked = True
        if not timed:
            return
        # with reduce_grad behind the backward pass, the step ends where the layer handed the caller's
        # stream back: the reduction's rest runs beside the layers before it in a model
        keep(self.samples, self.ahead, seconds_between(start, handed[-1] if handed else end))
        if handed:
            self.samples.reduce_behind.append(seconds_between(handed[-1], end))
        # the torch reference exchange (the CPU's) has no barriers: no window, all link time unhidden
        self.samples.windows.append([seconds for _, seconds in world.window_seconds()] or [0.0] * len(PHASES))
        rooms = [0.0] * len(PHASES)
        if len(world.windows) == len(PHASES):  # from backward's combine to reduce_grad, on either stream
            marks = world.windows
            rooms[BESIDE_GEMM] = seconds_between(marks[BESIDE_GEMM][1], marks[BESIDE_GEMM + 1][1])
        self.samples.rooms.append(rooms)
        self.samples.hidden.append(prefetch_rooms(world.windows, world.slot_waits))
        if self.block:
            calls = expert_block(layer, self.step.plans[self.rank].cu_seqlens, self.step.hidden[self.rank],
                                 self.step.grad_out[self.rank])
            swiglu = calls[BLOCK_CALLS.index("swiglu")] + calls[BLOCK_CALLS.index("swiglu backward")]
            self.samples.blocks.append((sum(calls) - swiglu, swiglu, calls))

    def row(self) -> dict:
        """The rank's timings under this arm (`local` and `nvlink`, `spread`), the median window of each
        exchange call, its routes, slots, replicas and link bytes; with `block`, the expert block's GEMMs,
        SwiGLU and calls, the share of each step beyond the block (`beyond_share` on the nvlink step,
        `beyond_share_local`), the share in the exchange windows the step waits in (`exchange_share`,
        `exchange_share_local`: `waited_windows`), part of the time beyond the block, and the share their link
        time alone takes of the NVLink step (`link_share`: what stays beyond the block however fast the
        rank's own kernels, unless those exchanges run beside the GEMMs)."""
        step, rank, samples = self.step, self.rank, self.samples
        phases = link_bytes(step)[rank]
        waited_s, link_s = layer_link_seconds(phases)
        totals, windows, blocks = samples.totals, samples.windows, samples.blocks
        hosted, replicated = replica_counts(step)
        rooms = samples.rooms
        if samples.reduce_behind:  # reduce_grad's link time is left to the layers before it, as its rest
            rooms = [[float("inf") if i == BEHIND_PASS else r for i, r in enumerate(room)] for room in rooms]
        nvlink = [over_link(t, w, link_s, r, waited_s, h)
                  for t, w, r, h in zip(totals, windows, rooms, samples.hidden, strict=True)]
        row = {"rank": rank, "routes": int(step.plans[0].rank_load[rank]), "home_routes":
               int(step.plans[0].home_load[rank]), "slots_used": int(hosted[rank]), "replicas_out":
               int(replicated[rank]), "bytes": bytes_summary(phases),
               "link_ms": [s * 1e3 for s in link_seconds(phases)], "waited_ms": [s * 1e3 for s in waited_s],
               "local": spread(totals), "nvlink": spread(nvlink), **host_fields(samples),
               "windows_ms": [statistics.median(w[i] for w in windows) * 1e3 for i in range(len(PHASES))],
               "room_ms": statistics.median(r[BESIDE_GEMM] for r in samples.rooms) * 1e3,
               "prefetch_hidden_ms": [statistics.median(h[i] for h in samples.hidden) * 1e3
                                      for i, phase in enumerate(PHASES) if phase in OPEN_ENDED]}
        if samples.reduce_behind:
            row["reduce_behind"] = spread(samples.reduce_behind)
        if self.block:
            row["gemm"] = spread([g for g, _, _ in blocks])
            row["swiglu"] = spread([s for _, s, _ in blocks])
            row["block_calls"] = {name: spread([calls[i] for _, _, calls in blocks])
                                  for i, name in enumerate(BLOCK_CALLS + SHARED_CALLS[:len(blocks[0][2])
                                                                                    - len(BLOCK_CALLS)])}
            waits = waited_windows(bool(samples.reduce_behind))
            waited = {"nvlink": [sum(max(w[i], link_s[i]) for i in waits) for w in windows],
                      "local": [sum(w[i] for i in waits) for w in windows]}
            for suffix, link, steps in (("", "nvlink", nvlink), ("_local", "local", totals)):
                row["beyond_share" + suffix] = median_spread(
                    [(t - g - s) / t for t, (g, s, _) in zip(steps, blocks, strict=True)])
                row["exchange_share" + suffix] = median_spread(
                    [e / t for e, t in zip(waited[link], steps, strict=True)])
            row["link_share"] = median_spread([sum(link_s[i] for i in waits) / t for t in nvlink])
        return row


def waited_windows(reduce_behind: bool) -> list[int]:
    """The exchange calls (indices into `PHASES`) the caller's stream waits in: every one but the prefetches
    (`OPEN_ENDED`, beside the home experts' GEMM), backward's combine (`BESIDE_GEMM`) and, left behind the
    backward pass, reduce_grad (`BEHIND_PASS`). Their windows, each at least its link time on the NVLink
    step, are the part of the time beyond the expert block that only running them beside the GEMMs hides."""
    beside = {BESIDE_GEMM} | ({BEHIND_PASS} if reduce_behind else set())
    return [i for i, phase in enumerate(PHASES) if phase not in OPEN_ENDED and i not in beside]


def rank_line(policy: str, maxvio: float, row: dict, ranks: int) -> str:
    """One rank's progress line: its timings, routes, slots, replicas and link bytes."""
    local, nvlink, b = row["local"], row["nvlink"], row["bytes"]
    link_in = sum(v for k, v in b.items() if k.endswith("_in")) / 1e9
    link_out = sum(v for k, v in b.items() if k.endswith("_out")) / 1e9
    extra = ""
    if "gemm" in row:
        extra = (f", GEMMs {row['gemm']['ms']:.2f} SwiGLU {row['swiglu']['ms']:.2f}, beyond "
                 f"{row['beyond_share']['median']:.1%} ({row['exchange_share']['median']:.1%} in waited "
                 "exchanges)")
    return (f"  {policy:10} maxvio {maxvio:5.2f} rank {row['rank']:2d}/{ranks}: {local['ms']:8.2f} ms "
            f"({local['ms_min']:.2f}-{local['ms_max']:.2f}) local, {nvlink['ms']:8.2f} nvlink; "
            f"{row['routes']} routes, {row['slots_used']} slots, {row['replicas_out']} replicas out, "
            f"link {link_in:.2f} GB in / {link_out:.2f} out{extra}")


@dataclass(eq=False)
class NativeArm:
    """torch-native plain EP on one maxvio's `off` plan, eager or compiled (`kind`), on the rank that plan
    loads most (`hottest_rank`): its staged rank (`NativePlainEPRank`) is attached while the native segment
    is open."""

    step: GroupStep
    rank: int
    kind: str
    samples: Samples = field(default_factory=Samples)
    live: tuple | None = None
    ahead: HostAhead | None = None

    def open(self, native: NativePlainEPRank, run: Callable[..., torch.Tensor]) -> None:
        self.live = (native, run)

    def close(self) -> None:
        self.live = None

    def run(self, timed: bool) -> None:
        native, run = self.live
        native.experts.run = run
        self.ahead = self.ahead or HostAhead(native.device)
        start = self.ahead.start()
        windows = native.step()
        end = self.ahead.end()
        sync(native.device)
        if timed:
            keep(self.samples, self.ahead, seconds_between(start, end))
            self.samples.windows.append([seconds_between(a, b) for a, b in windows])

    def timings(self) -> dict:
        """`local` and `nvlink` (`spread`)."""
        link_s = link_seconds(native_link_bytes(self.step)[self.rank])
        nvlink = [over_link(t, w, link_s) for t, w in zip(self.samples.totals, self.samples.windows,
                                                          strict=True)]
        return {"local": spread(self.samples.totals), "nvlink": spread(nvlink), **host_fields(self.samples)}


def native_row(step: GroupStep, rank: int, pair: list[NativeArm], reached: float,
               say: Callable[[str], None]) -> dict:
    """torch-native's entry of one maxvio: its rank, routes, bytes and link time, `eager`, `compiled` (where
    it ran) and `baseline` (the faster on the NVLink model)."""
    phases = native_link_bytes(step)[rank]
    row = {"rank": rank, "routes": int(step.plans[0].home_load[rank]),
           "link_ms": [s * 1e3 for s in link_seconds(phases)],
           "bytes": {f"{kind}_{way}": phases[i][j] + phases[i + 2][j] for i, kind in
                     enumerate(("dispatch", "combine")) for j, way in enumerate(("in", "out"))}}
    for arm in pair:
        if arm.samples.totals:
            row[arm.kind] = arm.timings()
    row["baseline"] = min((k for k in ("eager", "compiled") if k in row),
                          key=lambda k: row[k]["nvlink"]["ms"])
    best = row[row["baseline"]]
    say(f"  torch-native {row['baseline']:8} maxvio {reached:5.2f} rank {rank:2d}: "
        f"{best['local']['ms']:8.2f} ms local, {best['nvlink']['ms']:8.2f} nvlink (eager "
        f"{row['eager']['nvlink']['ms']:.2f}); {row['routes']} routes")
    return row
