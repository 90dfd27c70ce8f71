"""An EP group's training step under routing skew, rank by rank, on one GPU: MoonEP's replication against
plain EP, for the group's slowest rank.

    python -m bench.ep_group                # DeepSeek-V3 R=8, Kimi-K2 R=8 and 16: about 7 min, an H200
    python -m bench.ep_group --groups kimi-k2:16 --maxvio 0 20
    python -m bench.ep_group --smoke        # CPU, tiny shapes, seconds: every code path, no timing

For each group (`GROUPS`: the model's H, H', E and K from moonep_moe/configs/<model>.yaml, R ranks, S tokens
per rank) and each routing skew (`MAXVIO`: the expert-level maxvio of the demo's generator over the whole
group, `skewed_routing`):

1. Plan the whole group once with the real planner (`bench.rank_replay.plan_group`: every rank's
   `plan_routes`, as its dispatch computes it; the global part is the same on every rank), under each
   policy (`POLICIES`: `balance` exact, cost_aware and off = plain EP).
2. For each rank d, one after another on the same GPU: build the unchanged `MoonEPMoELayer` of rank d on a
   `bench.rank_replay.ReplayWorld` and time its routed step (`moe.routed_step`: the layer's planner, row
   kernels, prefetch, grouped GEMMs as the layer selects them, SwiGLU, combine, reduce_grad) forward and
   backward on the routes the plan gives it, the router's choice given (the router is left out, the same
   for every policy and for torch-native), each step timed on the GPU with the host ahead
   (`bench.common.HostAhead`: the GPU held in a device-side wait until the host has queued the step, as the
   layers before it hold it in a model; the host's enqueue time is recorded, `host_ms`). The peers'
   writes into its Buffer are staged copies of their real rows, their reads of its memory copies into
   scratch, both on a side stream in the windows of the exchange calls where they happen
   (`bench.rank_replay`). Each rank's plan is checked against the group's.
   The arms a target compares alternate (`run_ranks`): a policy's maxvio arms step by step on one layer,
   each round in another order, and the policies' segments (and torch-native's, on the ranks it runs on)
   in one order for half the steps and in the mirrored order for the rest, so whatever drifts over seconds
   (clocks and temperature, at a power limit an H200 can reach under these GEMMs) falls alike on the arms
   a target compares. The GPU's clocks, power, temperature and peak memory after each rank's pass are in
   the record (`gpu`).
3. The link (`bench.link_model`), per rank and exchange call (`link_bytes`): dispatch rows in and out (a row
   per token and destination rank, route weights, duplicate pairs), combine rows, replica weights in
   (prefetch, forward and backward) and out (the replicas of its experts that peers pull), replica gradients
   (fp32) in and out. Timed two ways: `local`, the measured step with those bytes copied on one GPU (the side
   stream, overlapped where a real group overlaps them: within the exchange call's window, with the rank's own
   comm kernels); `nvlink`, that step with each exchange call stretched to the time NVLink takes for the
   larger direction of its bytes at `NVLINK_BYTES_PER_S` (450 GB/s a direction: H200 NVLink's spec, not
   measured) where the window was shorter. Every window is charged as if it blocked the step, except
   backward's combine (`BESIDE_GEMM`): it runs on the comm stream beside gate_up's weight gradient, and the
   caller's stream waits for it only before reduce_grad, so its link time delays the step only where it
   outlasts both its window and the time until reduce_grad began (`over_link`'s room), and the prefetch
   (`OPEN_ENDED`, one barrier), which runs on the comm stream beside the home experts' groups of the first
   GEMM: the rank waits for the replicas it pulls in only where their link time outlasts the time from the
   prefetch's start to the caller's wait for them (`prefetch_rooms`, measured in each step), and not for the
   peers' pulls of its own experts, which run beside its GEMMs until the next call's first barrier, where its
   window ends (`layer_link_seconds`). The prefetch kernel's SMs are held for its local copies' time, not for
   the link's (`LEFT_OUT`). (A model that ran the link as GPU-side waits beside each window,
   `torch.cuda._sleep` on a side stream, was tried on the H200 at 41a79be and added 0.2-2.9 ms more per step
   (median 1.4 over 48 rank steps) than the blocking windows' own link time, under every policy: biased, so
   not used.)
4. The group's step is its slowest rank (the ranks meet in every exchange call): per repetition i the
   maximum over ranks of their i-th step, then the median and min-max over repetitions.
5. The baseline (`bench.native_ep`): torch-native plain EP (`NativePlainEPRank`: bench.layer's
   `torch._grouped_mm` experts, eager and under `torch.compile` (dynamic shapes, compiled once per process),
   the faster one counts) on the `off` plan's hottest rank, its four all-to-alls (a row per route, no
   deduplication) blocking, stood in for and modelled the same way, timed among that rank's arms.
6. For `exact`, every rank's expert block alone (`expert_block`: the six GEMMs and two SwiGLU calls of
   `MoonEPExperts` on its rows), alternated with its steps: the time beyond it (planner, comm kernels,
   copies, link time not hidden) is the step minus the block.

With `--shared-experts` each rank's step also runs the model's shared experts on its tokens (`Group.shared`):
in our layers as the layer runs them, on a side stream beside the routed step (`moe.experts_step`,
`overlap_shared_experts`: MoonEP hides planning, dispatch and prefetch behind them), in torch-native's after
its routed experts (`NativePlainEPRank`'s `shared`); the expert block times them too (`SHARED_CALLS`), so
what hides under their GEMMs counts as hidden.

With `--overlap-reduce-grad` our layers leave reduce_grad running behind the backward pass
(`MoEConfig.overlap_reduce_grad`): each step is timed to where the layer's backward hands the caller's stream
back (`handed_back`), the reduction's rest is recorded per rank (`reduce_behind`), and its link time is left
to the layers before it in a model, which this bench does not run (`REDUCE_BEHIND_LEFT_OUT`).

Left out (`LEFT_OUT`): the peers' SMs, contention on real links, NVLink latency, the peers' skew in reaching
a barrier, the histogram all-gather's latency, the router, shared experts. The link model assumes a window's
two directions move at once, each at the spec rate.

Budget on an H200 (the defaults): about 3,100 rank steps of 20-200 ms (most near 40 ms; 6 timed and 2
warm-up steps per arm), 770 expert blocks, 192 layer builds, torch-native's 4 skews x 2 arms and one
compilation, three GEMM measurements of the layer's `auto`: about 7 minutes (436 s at 67706b4). Peak
memory: a rank of Kimi-K2 R=16 under `off` (its Buffer sized for R*S*K routes, about 15 GB of rows, copied
once in forward) with the peers' stand-in, 103 GB at 67706b4; one arm's staged peer traffic is held at a
time.

Targets (`TARGET_BOUNDS`, on the `nvlink` step; the same checks on the `local` step are recorded beside them),
each with its median, min-max, bound and pass, as bench.layer records its targets:
- `exact` at maxvio 20 within 1.05x of maxvio 0, per group;
- `exact` at maxvio 20 at most 0.65x of torch-native plain EP's slowest rank, and at maxvio 0 at most 1.00x;
- `cost_aware` never slower than the better of `exact` and `off`, at every maxvio;
- `exact`: the time beyond the expert block (GEMMs and SwiGLU; the step minus `expert_block`) at most 5%
  of the step, on every rank (the worst rank checked), at every maxvio.

The record (`bench.common.write_record`, `bench/results/ep-group-<device>-<date>-<commit>.json`, rewritten
after each group): `setup` (shapes, policies, maxvio, repetitions, link model and its source, `left_out`,
`per_rank_step`), `targets`, `targets_local`, `results` (per group: `model`, `ranks`, shapes, `routing`
(per maxvio: target, achieved, sigma), `policies` {policy: [per maxvio: `ranks` (per rank: routes, slots,
replicas out, `bytes`, `link_ms` per exchange call (its larger direction; `waited_ms`: the part charged
whole), `local` and `nvlink` timings, `host_ms` (the host's enqueue time of a step) and `host_behind`
(timed steps whose host fell behind the GPU's hold), `windows_ms`, `room_ms`
(backward's combine's, `over_link`), and for exact `gemm`, `swiglu`, `block_calls` (each call of the
expert block, `BLOCK_CALLS`), `beyond_share` and the part of it in the exchange windows the step waits in,
`exchange_share`, of which their link time alone `link_share`; `reduce_behind` with `--overlap-reduce-grad`),
`slowest` (`local`, `nvlink`: the group's step; `rank`)]},
`native` (per maxvio: the rank, its routes and bytes, `eager`, `compiled` (each with `host_ms`,
`host_behind`), `baseline`), `compile_s`,
`gpu` (per rank and pass: `gpu_state`), `gemm` (per policy, the grouped GEMMs the layer chose),
`cost_aware_plan_as` (per maxvio, the policy whose plan cost_aware's equals on every rank, or None; its
target names it as `same_plan_as`; cost_aware is then not timed apart: the same plan is the same work, and
that policy's rows stand for it, each with `timed_as` naming it, so the comparison is not two samples of
one step's noise)).
Beside it a PNG of the slowest rank against maxvio (one panel per group) and `ep-group.md`, the table
for the docs.

Where the parts live: the arms a rank runs, how each is timed and the row it records (`RankArm`,
`NativeArm`, `expert_block`, `Repeats`) in bench.ep_group_arms; the targets, the table and the plot
(`TARGET_BOUNDS`, `group_targets`, `markdown`, `plot`, with `POLICIES` and `LEFT_OUT`) in
bench.ep_group_report; the link model in bench.link_model; the torch-native baseline in bench.native_ep; the
replayed rank and its peers in bench.rank_replay. Here: the groups (`Group`), the run of every rank's arms
(`run_ranks`, `Segment`) and of each group (`run_group`), and the record.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import RESULTS, cuda_timeline, gpu_state, measure_limits, spread, write_record
from bench.ep_group_arms import NativeArm, RankArm, Repeats, native_row, rank_line, same_plans, sync
from bench.ep_group_report import (
    LEFT_OUT,
    POLICIES,
    REDUCE_BEHIND_LEFT_OUT,
    SHARED_LEFT_OUT,
    group_targets,
    markdown,
    plot,
    target_line,
)
from bench.kernel_profile import print_profile, timeline_profile
from bench.link_model import NVLINK_BYTES_PER_S, NVLINK_SOURCE
from bench.native_ep import (
    NativeEPExperts,
    NativePlainEPRank,
    compiled_native_ep_experts,
    hottest_rank,
    native_ep_experts,
    native_shared_experts,
)
from bench.rank_replay import (
    GroupStep,
    ReplayWorld,
    StandIns,
    group_step,
    rank_inputs,
    rank_traffic,
    replay_layer,
    replay_step,
    replica_counts,
)
from bench.skew import skewed_routing
from moonep_moe.config import MoEConfig, load_config
from moonep_moe.layers.moe import MoonEPMoELayer

GROUPS = (("deepseek-v3", 8), ("kimi-k2", 8), ("kimi-k2", 16))
"""`(model, R)`: the groups run by default."""
MAXVIO = (0.0, 1.0, 5.0, 20.0)
PER_RANK_STEP = ("bench.rank_replay: rank d's unchanged MoonEPMoELayer on a ReplayWorld (R ranks, only d "
                 "runs), moe.routed_step forward + backward with the group's routing: the layer's planner "
                 "(its dispatch plans from the group's histogram), row kernels, prefetch, grouped GEMM "
                 "backend (as the layer selects it), SwiGLU, combine and reduce_grad on the rows the plan "
                 "gives d; peers' memory: shared stand-ins for the Buffer's rows, route weights and "
                 "duplicate pairs, d's own tensors for home experts and slot gradients; peers' writes into "
                 "d's Buffer staged (their real rows) and their reads of d's memory as copies, on a side "
                 "stream within each exchange call's window")
SMOKE = {"tokens": 16, "hidden": 64, "ffn": 32}
"""--smoke: per-rank tokens, H and H' (the models' E, K and R kept: maxvio 20 needs E > 21 K)."""
SPREAD = "min-max over the repetitions; the group's step in repetition i is its slowest rank's i-th step"


# -- the group ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One group of the bench: a packaged model's shapes (`moonep_moe/configs/<model>.yaml`) at R ranks, with
    `overrides` (MoEConfig fields) in place of its shapes. Pure description."""

    model: str
    ranks: int
    overrides: tuple[tuple[str, int], ...] = ()
    shared: bool = False
    """Keep the model's shared experts (each of the routed experts' width), which the layer runs beside the
    routed step (`overlap_shared_experts`); else routed experts only."""

    def config(self, policy: str) -> MoEConfig:
        """The layer config of one rank under `policy`: the model's, routed experts only unless `shared` (the
        router is not run: the routing is given)."""
        shared = {"ffn_hidden_size": None} if self.shared else {"num_shared_experts": 0}
        return load_config(self.model, ep_size=self.ranks, balance=policy, **dict(self.overrides),
                           shared_experts=shared,
                           router={"n_group": 1, "topk_group": 1, "expert_bias": False})

    @property
    def label(self) -> str:
        return f"{self.model} R={self.ranks}"


def parse_group(text: str) -> tuple[str, int]:
    """`"kimi-k2:16"` -> `("kimi-k2", 16)`."""
    model, _, ranks = text.partition(":")
    if not ranks.isdigit():
        raise argparse.ArgumentTypeError(f"a group is MODEL:RANKS (e.g. kimi-k2:16), got {text!r}")
    return model, int(ranks)


def group_inputs(cfg: MoEConfig, seed: int, device: torch.device) -> tuple[list, list]:
    """Every rank's tokens and output gradient `[S, H]` in the layer's dtype (drawn once per group)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (cfg.max_tokens_per_rank, cfg.hidden_size)

    def draw() -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=cfg.torch_dtype)

    return [draw() for _ in range(cfg.ep_size)], [draw() for _ in range(cfg.ep_size)]


# -- the run: every rank's arms, alternating -----------------------------------------------------------------


def group_spread(ranks: list[dict], key: str) -> dict:
    """The group's step from its ranks' timings under `key` ("local" or "nvlink"): per repetition i the
    slowest rank's i-th step, as a `spread` (ms)."""
    samples = zip(*(r[key]["ms_samples"] for r in ranks), strict=True)
    return spread([max(values) / 1e3 for values in samples])


def slowest(ranks: list[dict]) -> dict:
    """`local` and `nvlink`: the group's step (`group_spread`); `rank`: the slowest rank (nvlink median)."""
    worst = max(ranks, key=lambda r: (r["nvlink"]["ms"], -r["rank"]))
    return {"local": group_spread(ranks, "local"), "nvlink": group_spread(ranks, "nvlink"),
            "rank": worst["rank"]}


def free_memory() -> None:
    """Give a finished rank's device memory back before the next rank's layer is built (CUDA only)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def profile_step(layer: MoonEPMoELayer, world: ReplayWorld, step: GroupStep, rank: int) -> dict:
    """The `timeline_profile` (bench.kernel_profile) of one replayed step of `rank`, after one untimed step:
    its kernels and copies, grouped, and where the GPU idled in it."""
    traffic, inputs = rank_traffic(step, rank, layer, world), rank_inputs(step, rank)
    replay_step(layer, world, step, inputs, traffic)
    sync(world.device)
    return timeline_profile(cuda_timeline(lambda: replay_step(layer, world, step, inputs, traffic)))


def busiest_rank(step: GroupStep) -> int:
    """The rank hosting the most replicas (ties: the lowest)."""
    hosted, _ = replica_counts(step)
    return int(torch.argmax(hosted * step.num_ranks - torch.arange(step.num_ranks)))


@dataclass(eq=False)
class Segment:
    """The arms of one rank that share what `open` builds (a policy's layer, or torch-native's experts),
    timed round by round, each round in another order (`rounds`)."""

    name: str
    arms: list
    open: Callable[[], None]
    close: Callable[[], None]

    def rounds(self, warmup: int, timed: int) -> None:
        """`warmup` untimed rounds, then `timed` timed ones; round i runs the arms from the (i mod n)-th on,
        so each arm takes every place in the order equally often."""
        for i in range(warmup + timed):
            shift = i % len(self.arms)
            for arm in self.arms[shift:] + self.arms[:shift]:
                arm.run(timed=i >= warmup)


def run_ranks(group: Group, steps: dict[str, list[GroupStep]], off: list[GroupStep], maxvio: list[float],
              device: torch.device, reps: Repeats, compile_too: bool, record: dict, profile: dict | None,
              say: Callable[[str], None], timed_as: dict[str, list[str | None]] | None = None
              ) -> tuple[dict[str, list[dict]], list[dict], list[dict]]:
    """Every rank of `group` under every policy (`steps`: per policy, one group step per maxvio reached,
    `maxvio`) and torch-native plain EP (on `off`, the `off` policy's steps), timed as alternating arms.
    `timed_as[policy][i]`: another policy whose plan equals this one's on every rank at maxvio i
    (`same_plans`): the same work, timed once, under that policy; this policy's rows are its rows with
    `timed_as` naming it.

    Rank by rank, each rank's segments (one per policy: its layer, the maxvio arms interleaved round by
    round; and torch-native's on the ranks it runs on) run in one order and then in the mirrored order
    (`Repeats.split`), so the GPU's drift in clocks and temperature over seconds falls alike on every arm a
    target compares (a policy's maxvio 0 and 20, the policies at one maxvio, exact and torch-native).

    torch-native runs on the `off` plan's hottest rank of each maxvio (`hottest_rank`), eager and, with
    `compile_too`, compiled (`compiled_native_ep_experts`; the first compiled step, which compiles where
    this process has not yet, is timed apart into `record["compile_s"]`; an error is recorded as
    `record["compile_error"]` and eager counts).

    Returns `(policies, native, gpu)`: per policy and maxvio `{"ranks": [RankArm.row per rank], "slowest":
    slowest(...)}`; per maxvio torch-native's rank, its routes, bytes and link time, `eager`, `compiled`
    and `baseline` (the faster, NVLink model); and the GPU's state after each rank's pass (`gpu_state`).
    The peers' stand-ins are shared by the policies (keyed by shape). With `profile`, the kernels of one
    step of `exact`'s busiest rank at the last maxvio go there."""
    stand_ins = StandIns()
    stands_for = {policy: (timed_as or {}).get(policy) or [None] * len(policy_steps)
                  for policy, policy_steps in steps.items()}
    arms = {policy: [[None if stands_for[policy][i] else RankArm(step, rank, block=policy == "exact")
                      for i, step in enumerate(policy_steps)] for rank in range(group.ranks)]
            for policy, policy_steps in steps.items()}
    hot = [hottest_rank(step) for step in off]
    native_arms = [[NativeArm(step, rank, kind) for kind in ("eager", "compiled")[:1 + compile_too]]
                   for step, rank in zip(off, hot, strict=True)]
    record["compile_s"] = None
    gpu, rows = [], {policy: [] for policy in steps}  # rows: per policy, per rank, per maxvio
    first, second = reps.split()
    for rank in range(group.ranks):
        segments = [policy_segment(policy, policy_steps[0].cfg, [arm for arm in arms[policy][rank] if arm],
                                   rank, stand_ins, device, record.setdefault("gemm", {}))
                    for policy, policy_steps in steps.items() if any(arms[policy][rank])]
        mine = [i for i, r in enumerate(hot) if r == rank]
        if mine:
            segments.append(native_segment(off[0].cfg, [native_arms[i] for i in mine], device, record, say))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for number, (order, timed) in enumerate(((segments, first), (segments[::-1], second))):
            if timed == 0:
                continue
            for segment in order:
                segment.open()
                segment.rounds(reps.warmup, timed)
                segment.close()
            gpu.append({"rank": rank, "pass": number + 1, **gpu_state(device)})
        for policy in steps:
            rows[policy].append([arm.row() if arm else None for arm in arms[policy][rank]])
        for policy in steps:
            for i, arm in enumerate(arms[policy][rank]):
                if arm is None:
                    other = stands_for[policy][i]
                    rows[policy][-1][i] = {**rows[other][-1][i], "timed_as": other}
                say(rank_line(policy, maxvio[i], rows[policy][-1][i], group.ranks))
        if profile is not None and "exact" in steps and rank == busiest_rank(steps["exact"][-1]):
            layer, world = replay_layer(steps["exact"][-1].cfg, rank, stand_ins, device)
            profile[f"{group.label} exact rank {rank}"] = profile_step(layer, world, steps["exact"][-1], rank)
            layer.destroy()
            del layer, world
            free_memory()
    policies = {policy: [{"ranks": list(ranks), "slowest": slowest(list(ranks))}
                         for ranks in zip(*per_rank, strict=True)] for policy, per_rank in rows.items()}
    native = [native_row(step, rank, pair, reached, say)
              for step, rank, pair, reached in zip(off, hot, native_arms, maxvio, strict=True)]
    return policies, native, gpu


def policy_segment(policy: str, cfg: MoEConfig, arms: list[RankArm], rank: int, stand_ins: StandIns,
                   device: torch.device, chosen: dict[str, str]) -> Segment:
    """The segment of one rank under one policy: its layer built (`replay_layer`) and the maxvio arms
    attached on `open`, destroyed on `close`. `chosen[policy]`: the grouped GEMMs the first layer of the
    policy runs (`grouped_gemm: auto`'s choice per primitive and shape)."""
    held: list = []

    def open_() -> None:
        layer, world = replay_layer(cfg, rank, stand_ins, device)
        held[:] = [layer]
        gemm = layer._state.gemm
        chosen.setdefault(policy, gemm.describe() if hasattr(gemm, "describe") else gemm.name)
        for arm in arms:
            arm.open(layer, world)

    def close() -> None:
        for arm in arms:
            arm.close()
        held.pop().destroy()
        free_memory()

    return Segment(policy, arms, open_, close)


def native_segment(cfg: MoEConfig, pairs: list[list[NativeArm]], device: torch.device, record: dict,
                   say: Callable[[str], None]) -> Segment:
    """torch-native's segment on one rank: its experts (`NativeEPExperts`) and each arm's staged rank built
    on `open` (the compilation, where it is still to be made, timed apart then), freed on `close`."""
    arms = [arm for pair in pairs for arm in pair]

    def open_() -> None:
        experts = NativeEPExperts(cfg.experts_per_rank, cfg.hidden_size, cfg.ffn_hidden_size, cfg.torch_dtype,
                                  device)
        shared = native_shared_experts(cfg, device)
        for pair in pairs:
            native = NativePlainEPRank(pair[0].step, pair[0].rank, experts, shared)
            pair[0].open(native, native_ep_experts)
            if len(pair) == 2 and "compile_error" not in record:
                compiled = compiled_native_ep_experts()
                if record["compile_s"] is None:
                    try:
                        experts.run = compiled
                        start = time.perf_counter()
                        native.step()
                        sync(device)
                        record["compile_s"] = time.perf_counter() - start
                    except Exception as error:  # noqa: BLE001 - recorded; the eager layer stays the baseline
                        record["compile_error"] = f"{type(error).__name__}: {error}"[:2000]
                        say(f"  torch.compile baseline failed, eager only: {record['compile_error'][:300]}")
                        continue
                pair[1].open(native, compiled)
        segment.arms = [arm for arm in arms if arm.live is not None]

    def close() -> None:
        for arm in arms:
            arm.close()
        free_memory()

    segment = Segment("torch-native", arms, open_, close)
    return segment


# -- one group ----------------------------------------------------------------------------------------------


def run_group(group: Group, args: argparse.Namespace, device: torch.device, record: dict,
              say: Callable[[str], None]) -> dict:
    """Every policy's ranks and the torch-native baseline of one group (module docstring): its table."""
    overlap = {"overlap_prefetch": args.overlap_prefetch, "overlap_reduce_grad": args.overlap_reduce_grad}
    cfgs = {policy: group.config(policy).model_copy(update=overlap) for policy in args.policies}
    cfg = next(iter(cfgs.values()))
    hidden, grads = group_inputs(cfg, args.seed, device)
    weight_dtype = torch.promote_types(cfg.torch_dtype, torch.float32)
    routings = []
    for maxvio in args.maxvio:
        routing = skewed_routing(group.ranks, cfg.num_experts, cfg.top_k, cfg.max_tokens_per_rank, maxvio,
                                 args.seed, device)
        routing.weights = [w.to(weight_dtype) for w in routing.weights]
        routings.append(routing)
        say(f"{group.label}: maxvio {maxvio:g}: reached {routing.maxvio:.2f} (sigma {routing.sigma:.4f})")
    reached = [r.maxvio for r in routings]
    steps = {policy: [group_step(c, r.topk, r.weights, hidden, grads) for r in routings]
             for policy, c in cfgs.items()}
    table = {"model": group.model, "ranks": group.ranks, "experts": cfg.num_experts,
             "hidden": cfg.hidden_size, "ffn": cfg.ffn_hidden_size, "top_k": cfg.top_k,
             "tokens": cfg.max_tokens_per_rank, "experts_per_rank": cfg.experts_per_rank,
             "slots": cfg.prefetch_slots, "token_padding": cfg.token_padding, "dtype": cfg.dtype,
             "maxvio_targets": list(args.maxvio),
             "routing": [{"target": t, "maxvio": r.maxvio, "sigma": r.sigma}
                         for t, r in zip(args.maxvio, routings, strict=True)],
             "rows_per_rank": {p: c.rows_per_rank for p, c in cfgs.items()},
             "replica_cost": {p: c.replica_cost for p, c in cfgs.items()}}
    reps = Repeats(args.warmup, args.repeat)
    say(f"{group.label}: {group.ranks} ranks, each under {', '.join(args.policies)}, "
        f"{len(args.maxvio)} maxvio each, and torch-native plain EP on the off plan's hottest ranks")
    off = steps.get("off") or [group_step(group.config("off"), r.topk, r.weights, hidden, grads)
                               for r in routings]
    timed_as = {}
    if "cost_aware" in steps:
        mine = steps["cost_aware"]
        table["cost_aware_plan_as"] = timed_as["cost_aware"] = [
            next((p for p in ("exact", "off") if p in steps and same_plans(step, steps[p][i])), None)
            for i, step in enumerate(mine)]
    table["policies"], table["native"], table["gpu"] = run_ranks(
        group, steps, off, reached, device, reps, not args.no_compile, table, record.get("profile"), say,
        timed_as)
    for policy, runs in table["policies"].items():
        for maxvio, summary in zip(args.maxvio, runs, strict=True):
            best = summary["slowest"]["nvlink"]
            local = summary["slowest"]["local"]["ms"]
            say(f"  {policy} maxvio {maxvio:g}: the group's step {best['ms']:.2f} ms nvlink "
                f"({best['ms_min']:.2f}-{best['ms_max']:.2f}), {local:.2f} local; slowest rank "
                f"{summary['slowest']['rank']}")
    return table


def make_groups(pairs: list[tuple[str, int]], smoke: bool, tokens: int | None, shared: bool = False
                ) -> list[Group]:
    """The `Group` of each `(model, R)`, with the smoke shapes (`SMOKE`), a --tokens override and the shared
    experts where `shared`. Raises ValueError (or FileNotFoundError) naming the group where its config does
    not validate."""
    groups = []
    for model, ranks in pairs:
        overrides = {}
        if smoke:
            overrides = {"max_tokens_per_rank": SMOKE["tokens"], "hidden_size": SMOKE["hidden"],
                         "ffn_hidden_size": SMOKE["ffn"]}
        if tokens is not None:
            overrides["max_tokens_per_rank"] = tokens
        group = Group(model, ranks, tuple(overrides.items()), shared)
        try:
            group.config("exact")
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"--groups {model}:{ranks}: {str(error).splitlines()[0]}") from error
        groups.append(group)
    return groups


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", type=parse_group, default=list(GROUPS), metavar="MODEL:R",
                        help="groups to run (default deepseek-v3:8 kimi-k2:8 kimi-k2:16)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--maxvio", nargs="+", type=float, default=list(MAXVIO),
                        help="routing skews (the group's expert maxvio), default 0 1 5 20")
    parser.add_argument("--tokens", type=int, default=None, help="S per rank (default: the model's, 8192)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of a segment's arms per pass")
    parser.add_argument("--repeat", type=int, default=6,
                        help="timed steps per arm over the two mirrored passes (>= 5; the median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="skip torch-native's torch.compile")
    parser.add_argument("--profile", action="store_true",
                        help="also one step's kernels of exact's busiest rank at the last maxvio, per group")
    parser.add_argument("--overlap-prefetch", action="store_true",
                        help="our layers with MoEConfig.overlap_prefetch (record: ep-group-overlap-...)")
    parser.add_argument("--overlap-reduce-grad", action="store_true",
                        help="our layers with MoEConfig.overlap_reduce_grad: each step ends where the "
                             "layer's backward hands the stream back (record: ep-group-reduce-behind-...)")
    parser.add_argument("--shared-experts", action="store_true",
                        help="keep the models' shared experts: beside the routed step in our layers (as "
                             "the layer runs them), after it in torch-native's (record: ep-group-shared-...)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"CPU, tiny shapes ({SMOKE}), one step per rank: every code path, no timing")
    parser.add_argument("--out", default=None,
                        help="folder of the record, plot and table (default bench/results)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.warmup, args.repeat, args.no_compile, args.profile = 0, 1, True, False
    elif args.repeat < 5:
        parser.error(f"--repeat must be >= 5 (a median with its spread), got {args.repeat}")
    elif not torch.cuda.is_available():
        parser.error("bench.ep_group times a GPU: run it where CUDA is, or --smoke on the CPU")
    try:
        args.groups = make_groups(args.groups, args.smoke, args.tokens, args.shared_experts)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.smoke:  # tiny ops: threads would only contend
        torch.set_num_threads(1)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(args.out) if args.out else RESULTS
    started = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {line}", flush=True)

    limits = {} if args.smoke else measure_limits()
    setup = {"groups": [g.label for g in args.groups], "policies": args.policies, "maxvio": args.maxvio,
             "warmup": args.warmup, "repeat": args.repeat, "seed": args.seed, "smoke": args.smoke,
             "link": {"bytes_per_s": NVLINK_BYTES_PER_S, "source": NVLINK_SOURCE}, "left_out": LEFT_OUT,
             "per_rank_step": PER_RANK_STEP, "spread": SPREAD, "overlap_prefetch": args.overlap_prefetch,
             "overlap_reduce_grad": args.overlap_reduce_grad, "shared_experts": args.shared_experts}
    if args.shared_experts:
        setup["left_out"] = setup["left_out"].replace(SHARED_LEFT_OUT, "the router")
    if args.overlap_reduce_grad:
        setup["left_out"] += "; " + REDUCE_BEHIND_LEFT_OUT
    record = {"setup": setup,
              "targets": [], "targets_local": []}
    if args.profile:
        record["profile"] = {}
    name = "-".join(["ep-group-smoke" if args.smoke else "ep-group"] + ["shared"] * args.shared_experts
                    + ["overlap"] * args.overlap_prefetch + ["reduce-behind"] * args.overlap_reduce_grad)
    tables: list[dict] = []
    for group in args.groups:
        tables.append(run_group(group, args, device, record, say))
        record["targets"] = [t for table in tables for t in group_targets(table, "nvlink")]
        record["targets_local"] = [t for table in tables for t in group_targets(table, "local")]
        path = write_record(name, limits, tables, out_dir, ran_on=device, **record)
    for label, summary in record.get("profile", {}).items():
        print_profile(label, summary)
    print(f"\ntargets, the link as the NVLink model (median (min-max) of {args.repeat} steps per rank):")
    for target in record["targets"]:
        print(f"  {target_line(target)}", flush=True)
    local = record["targets_local"]
    print(f"the same with the link as local copies: {sum(t['pass'] for t in local)} of {len(local)} pass "
          "(the record's targets_local)")
    table_md = markdown(tables, path.name, "cpu" if args.smoke else torch.cuda.get_device_name(device),
                        setup["left_out"], args.shared_experts)
    print("\n" + table_md, flush=True)
    (out_dir / f"{name}.md").write_text(table_md)
    plot(tables, path.with_suffix(".png"))
    print(f"record: {path}\nplot: {path.with_suffix('.png')}\ntable: {out_dir / f'{name}.md'}", flush=True)


if __name__ == "__main__":
    main()
