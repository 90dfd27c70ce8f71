"""The link model of `bench.ep_group`: the bytes each rank of an EP group moves in each exchange call of one
step, and a step's time with each call's window stretched to NVLink's time for those bytes.

For rank d and each exchange call of our layer's step (`bench.rank_replay.PHASES`), `link_bytes` counts the
bytes in and out: dispatch rows (a row per token and remote destination rank, route weights, duplicate
pairs), replica weights in (prefetch, forward and backward) and out (the replicas of its experts that peers
pull), combine rows, replica gradients in and out; `native_link_bytes` the same for torch-native plain EP's
four all-to-alls. `over_link` charges each window (first barrier to second, measured on the GPU by
`bench.rank_replay.ReplayWorld`: local work before a call's first barrier is outside it, charged in full)
where the link, at `NVLINK_BYTES_PER_S` for the larger direction, outlasts it; backward's combine
(`BESIDE_GEMM`) and the prefetches (`OPEN_ENDED`) only where the link outlasts the GEMM they run beside
(`prefetch_rooms`, `layer_link_seconds`). A spec figure, not a measured rate: what it leaves out is in
`bench.ep_group_report.LEFT_OUT`.
"""

from __future__ import annotations

import torch

from bench.common import Stamp, seconds_between
from bench.rank_replay import OPEN_ENDED, PHASES, GroupStep, replica_counts, route_matrices

NVLINK_BYTES_PER_S = 450e9
NVLINK_SOURCE = ("H200 NVLink: 900 GB/s bidirectional, 450 GB/s a direction (NVIDIA's spec figure, not "
                 "measured here; DeepEP reports under 380 GB/s reached in practice)")


def link_bytes(step: GroupStep) -> list[list[tuple[int, int]]]:
    """`[R][len(PHASES)]` (bytes in, bytes out) of each rank's link in each exchange call of one step:
    dispatch rows (a row per token and remote destination rank; in the forward also a route weight per
    remote route and a duplicate pair per remote duplicate route), prefetch (the experts it replicates in,
    the replicas of its own experts out, forward and backward), combine (its tokens' rows computed
    elsewhere in, the rows peers' tokens read out; in the backward also the route weights' gradients) and
    reduce_grad (the gradients of its experts' replicas in, of its own replicas out, in
    `MoEConfig.replica_grad_dtype`)."""
    cfg = step.cfg
    row = cfg.hidden_size * cfg.torch_dtype.itemsize
    weight = torch.promote_types(cfg.torch_dtype, torch.float32).itemsize
    params = 3 * cfg.hidden_size * cfg.ffn_hidden_size
    expert, grads = params * cfg.torch_dtype.itemsize, params * cfg.replica_grad_dtype.itemsize
    m = {name: t.fill_diagonal_(0) for name, t in route_matrices(step).items()}  # remote only
    hosted, replicated = replica_counts(step)
    out = []
    for d in range(step.num_ranks):
        sent = {name: int(t[d].sum()) for name, t in m.items()}
        got = {name: int(t[:, d].sum()) for name, t in m.items()}
        dispatch = (got["payload"] * row + got["routes"] * weight + got["duplicates"] * 8,
                    sent["payload"] * row + sent["routes"] * weight + sent["duplicates"] * 8)
        prefetch = (int(hosted[d]) * expert, int(replicated[d]) * expert)
        combine = (sent["payload"] * row, got["payload"] * row)
        out.append([dispatch, prefetch, combine, (got["payload"] * row, sent["payload"] * row), prefetch,
                    (combine[0] + sent["routes"] * weight, combine[1] + got["routes"] * weight),
                    (int(replicated[d]) * grads, int(hosted[d]) * grads)])
    return out


def native_link_bytes(step: GroupStep) -> list[list[tuple[int, int]]]:
    """`[R][4]` (bytes in, bytes out) of each rank of torch-native plain EP in its four all-to-alls (forward
    dispatch, forward combine, backward dispatch, backward combine): a row per remote route (no
    deduplication), with its route weight forward and its weight's gradient back. `step`: the `off` plan."""
    cfg = step.cfg
    row = cfg.hidden_size * cfg.torch_dtype.itemsize
    weight = torch.promote_types(cfg.torch_dtype, torch.float32).itemsize
    routes = route_matrices(step)["routes"].fill_diagonal_(0)
    out = []
    for d in range(step.num_ranks):
        sent, got = int(routes[d].sum()), int(routes[:, d].sum())
        out.append([(got * (row + weight), sent * (row + weight)), (sent * row, got * row),
                    (got * row, sent * row), (sent * (row + weight), got * (row + weight))])
    return out


def link_seconds(phases: list[tuple[int, int]]) -> list[float]:
    """Each window's time on the link: the larger direction's bytes at `NVLINK_BYTES_PER_S`."""
    return [max(pair) / NVLINK_BYTES_PER_S for pair in phases]


def layer_link_seconds(phases: list[tuple[int, int]]) -> tuple[list[float], list[float]]:
    """`(waited, link)` per exchange call of our layer's step (`PHASES`), for `over_link`. A call between two
    barriers waits for both directions: (0, `link_seconds`). A prefetch (`OPEN_ENDED`) waits for what it
    pulls in (its slots' weights, which the slot groups' GEMM reads), at the caller's wait after the home
    groups' GEMM (`over_link`'s `hidden_s`), and not for its peers' pulls of its own experts (out), which may
    take until the next call's first barrier, where its window ends."""
    waited, link = [], []
    for phase, (bytes_in, bytes_out) in zip(PHASES, phases, strict=True):
        open_ended = phase in OPEN_ENDED
        waited.append(bytes_in / NVLINK_BYTES_PER_S if open_ended else 0.0)
        link.append((bytes_out if open_ended else max(bytes_in, bytes_out)) / NVLINK_BYTES_PER_S)
    return waited, link


def prefetch_rooms(windows: list[tuple[str, Stamp, Stamp]], slot_waits: list[Stamp]) -> list[float]:
    """Per exchange call (`PHASES`), the time a prefetch's incoming link time can hide under: from the
    prefetch's start (on the comm stream) to the caller's wait for its replicas (after the home experts'
    groups of the first GEMM); 0 for the other calls, and for a step without those stamps (the torch
    reference exchange has no windows)."""
    hidden = [0.0] * len(PHASES)
    prefetches = [i for i, phase in enumerate(PHASES) if phase in OPEN_ENDED]
    if len(windows) == len(PHASES) and len(slot_waits) == len(prefetches):  # windows[i]: PHASES[i]'s
        for i, waited in zip(prefetches, slot_waits, strict=True):
            hidden[i] = max(0.0, seconds_between(windows[i][1], waited))
    return hidden


BESIDE_GEMM = PHASES.index("add_replicas") - 1
"""The exchange call that runs beside a GEMM: backward's combine, on the comm stream beside gate_up's weight
gradient (`MoonEPExperts.backward`); the caller's stream waits for it only before reduce_grad."""


def over_link(total_s: float, windows_s: list[float], link_s: list[float], room_s: list[float] | None = None,
              waited_s: list[float] | None = None, hidden_s: list[float] | None = None) -> float:
    """A step's time with each exchange window stretched to its link time where it was shorter. `room_s`:
    per window, the time from its start until the caller's stream went on past it (0 for a window the step
    waits on; `BESIDE_GEMM`'s: until reduce_grad began, the GEMM beside it done): a window's link time
    delays the step only where it is longer than both the window and that room. `waited_s`: per window, link
    time the step waits for whatever the window's length (`layer_link_seconds`), added where it is longer
    than `hidden_s` (a prefetch's: the home groups' GEMM it ran beside, `prefetch_rooms`)."""
    room_s = room_s or [0.0] * len(windows_s)
    waited_s = waited_s or [0.0] * len(windows_s)
    hidden_s = hidden_s or [0.0] * len(windows_s)
    calls = zip(windows_s, link_s, room_s, waited_s, hidden_s, strict=True)
    return total_s + sum(max(0.0, waited - hidden) + max(0.0, link - max(window, room))
                         for window, link, room, waited, hidden in calls)


def bytes_summary(phases: list[tuple[int, int]]) -> dict[str, int]:
    """One rank's step bytes by kind: dispatch and combine rows (forward + backward), replica weights,
    replica gradients, each in and out."""
    kinds = {"dispatch": (0, 3), "weights": (1, 4), "combine": (2, 5), "grads": (6,)}
    return {f"{kind}_{way}": sum(phases[i][j] for i in index) for kind, index in kinds.items()
            for j, way in enumerate(("in", "out"))}
