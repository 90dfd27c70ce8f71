"""MoonEP's comm benchmark suite: every Buffer operation against routing skew, and what balancing buys.

The setup of MoonEP's `bench_vs_deepep.py` (REFERENCES.md): R=8 ranks, S=8192 tokens per rank, H=7168,
K=8, E=384, H'=2048, token padding 128. The R ranks are thread-ranks of the threads world on one device
(`run_ranks` with one `ThreadGroup`), so every time is the whole group's on one chip.

Skew: `maxvio = max_e T_e / mean_e T_e - 1` over the group's expert loads T_e (MoonEP's definition), for
maxvio in {0, 0.2, 1, 10, 20}. MoonEP draws each token's K experts with `torch.multinomial` without
replacement from popularities `exp(sigma * z_e)`, `z ~ N(0, 1)` shared by all ranks; here each token takes the
top-K of `sigma * z_e + g_te` with `g` standard Gumbel noise, which is the same distribution (the Gumbel
top-k trick) but keeps the noise fixed while sigma changes, so the log-scale bisection on sigma sees a
deterministic, nearly monotone maxvio. Everything is seeded. maxvio 0 is the round-robin routing (token t
takes experts `(t*K + k) % E`, relabelled by a seeded permutation), balanced up to the remainder of
`R*S*K / E`.

For each skew and operation it reports:
- time: CUDA events (wall clock on the CPU) from the barrier that starts the operation to the last rank's
  completion, median of `--iters` after `--warmup`;
- bytes the operation must move, counted from the plans of all ranks: a payload row once per (token,
  destination rank), an fp32 weight per valid route, an int32 duplicate source per duplicate route (the
  forward dispatch only), an expert's weights per used slot (prefetch), its fp32 gradients per used slot
  (reduce_grad), the `[R, E]` int64 histogram gathered on every rank (plan). Local rows count too: on one
  device every row is a copy;
- GB/s, and `pct_copy`: that rate as a share of the device's copy rate measured in the same run
  (`bench.common.measure_limits`; a copy of the same bytes = 100%).

Operations: `plan` (histogram all_gather + `plan_routes`, what a forward dispatch runs first),
`dispatch_fwd` (the whole forward `Buffer.dispatch`: plan, rows, weights, duplicate tables), `dispatch`
(with the plan: rows and weights only), `combine`, `prefetch` (`prefetch_weight`) and `reduce_grad`.

Plain expert parallelism (no replicas: every route on its home rank) side by side: the per-rank route load
max/mean of both, and the hottest rank's expert time of both: the forward grouped GEMMs (gate_up, then
down) of the segments of the rank with the most padded rows, through the package's grouped GEMM.

Memory: a DeepSeek-V3 expert is 3*7168*2048 bf16 = 88 MB. Home experts and slots of all 8 ranks (2 * 8 * 48
experts) take 67.6 GB, their fp32 gradients twice that, so prefetch and reduce_grad run one after the other,
each with its own weights, and with the projections that fit the free memory (`--projections` forces
them; the record names the ones timed).

    python -m bench.comm                  # the suite on one GPU (threads world, 8 ranks)
    python -m bench.comm --small          # a CPU smoke run: S=2048 H=64 H'=32 K=2 E=64 R=4

Writes `bench/results/comm-<device>-<date>-<commit>.json` (device, commit, command, copy baseline, setup,
one row per skew) and a PNG of the same name: MoonEP's operation times, and the hottest rank's expert time of
MoonEP and plain EP, against skew.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common import Stamp, measure_limits, seconds_between, stamp, timed, write_record
from bench.plan import wall_time
from moonep_moe.comm.buffer import Buffer
from moonep_moe.gemm.registry import select_grouped_gemm
from moonep_moe.layers.function import compute_offsets
from moonep_moe.plan.planner import plan_routes
from moonep_moe.plan.types import MoonEPCommPlan, decode_dst
from moonep_moe.transport.threads import ThreadGroup, ThreadsWorld, run_ranks
from moonep_moe.weights.pool import ExpertRows

FULL = dict(device="cuda", tokens=8192, hidden=7168, ffn=2048, top_k=8, experts=384, ranks=8)
SMALL = dict(device="cpu", tokens=2048, hidden=64, ffn=32, top_k=2, experts=64, ranks=4)
OPS = ("plan", "dispatch_fwd", "dispatch", "combine", "prefetch", "reduce_grad")
PROJECTIONS = {"gate_up": lambda H, F: (2 * F, H), "down": lambda H, F: (H, F)}
"""Row shape `[N, K]` of one expert's projection (nn.Linear layout), as the layer stores it."""
FITS = (("gate_up", "down"), ("gate_up",), ("down",))
"""Projection sets tried for prefetch and reduce_grad, largest first."""
MEMORY_MARGIN = 0.85
"""Share of the free device memory a weight phase may plan to use."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU smoke preset " + str(SMALL))
    parser.add_argument("--device", help=f"cpu or cuda (default {FULL['device']})")
    parser.add_argument("--tokens", type=int, help=f"S tokens per rank (default {FULL['tokens']})")
    parser.add_argument("--hidden", type=int, help=f"H (default {FULL['hidden']})")
    parser.add_argument("--ffn", type=int, help=f"H', expert FFN size (default {FULL['ffn']})")
    parser.add_argument("--top-k", type=int, help=f"K (default {FULL['top_k']})")
    parser.add_argument("--experts", type=int, help=f"E (default {FULL['experts']})")
    parser.add_argument("--ranks", type=int, help=f"R thread-ranks (default {FULL['ranks']})")
    parser.add_argument("--token-padding", type=int, default=128, help="tp (default 128)")
    parser.add_argument("--maxvio", type=float, nargs="+", default=[0.0, 0.2, 1.0, 10.0, 20.0],
                        help="skews, max expert load / mean - 1 (default 0 0.2 1 10 20)")
    parser.add_argument("--projections", nargs="+", choices=list(PROJECTIONS),
                        help="projections prefetched and reduced (default: the most that fit in memory)")
    parser.add_argument("--grouped-gemm", default="torch", help="expert GEMM backend (default torch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results)")
    args = parser.parse_args(argv)
    for key, value in (SMALL if args.small else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# -- routing with a given skew ------------------------------------------------------------------------------

def expert_skew(topk_tk: torch.Tensor, num_experts: int) -> float:
    """maxvio of `[T, K]` routes: max expert load / mean expert load - 1 (reads the loads on the host)."""
    load_e = torch.bincount(topk_tk.reshape(-1), minlength=num_experts).double()
    return float(load_e.max() / load_e.mean() - 1)


def round_robin_routes(num_tokens: int, top_k: int, label_e: torch.Tensor) -> torch.Tensor:
    """`[T, K]` int64: token t takes experts `label_e[(t*K + k) % E]` (K distinct experts when K <= E).
    Every expert gets `T*K // E` or one more routes; a random relabelling `label_e` spreads a token's K
    experts over home ranks the way random routing does (consecutive ids would share one rank)."""
    route_n = torch.arange(num_tokens * top_k, device=label_e.device)
    return label_e[route_n % len(label_e)].view(num_tokens, top_k)


def lognormal_routes(sigma: float, popularity_e: torch.Tensor, noise_te: torch.Tensor,
                     top_k: int) -> torch.Tensor:
    """`[T, K]` int64: each token's top-K of `sigma * popularity_e + noise_te` (module docstring)."""
    return torch.topk(sigma * popularity_e + noise_te, top_k, dim=1).indices


def tune_sigma(target: float, popularity_e: torch.Tensor, noise_te: torch.Tensor, top_k: int,
               steps: int = 40) -> float:
    """The sigma whose `lognormal_routes` come closest to maxvio `target`: bisection on log sigma in
    [1e-3, 1e2]. A target below the noise floor (maxvio at sigma = 1e-3) gives 1e-3.

    Raises ValueError when even sigma = 1e2 stays below the target (at most `E / K - 1` is reachable)."""
    num_experts = noise_te.shape[1]

    def skew(log_sigma: float) -> float:
        return expert_skew(lognormal_routes(math.exp(log_sigma), popularity_e, noise_te, top_k), num_experts)

    lo, hi = math.log(1e-3), math.log(1e2)
    if skew(hi) < target:
        raise ValueError(f"maxvio={target} is out of reach with E={num_experts}, K={top_k}: "
                         f"at most {skew(hi):.3f} (E/K - 1 = {num_experts / top_k - 1:.3f})")
    for _ in range(steps):
        mid = (lo + hi) / 2
        if skew(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.exp(min((lo, hi), key=lambda s: abs(skew(s) - target)))


def skewed_routes(targets: Sequence[float], num_tokens: int, num_experts: int, top_k: int, seed: int,
                  device: torch.device) -> list[tuple[float | None, torch.Tensor]]:
    """`(sigma, topk_tk [T, K] int64 on device)` per target maxvio; sigma None for the round-robin target 0.
    One seeded draw of popularities and noise serves every target."""
    gen = torch.Generator().manual_seed(seed)
    popularity_e = torch.randn(num_experts, generator=gen).to(device)
    uniform_te = torch.rand(num_tokens, num_experts, generator=gen).clamp_(min=1e-12)
    noise_te = (-torch.log(-torch.log(uniform_te))).to(device)
    label_e = torch.randperm(num_experts, generator=gen).to(device)
    routes = []
    for target in targets:
        if target == 0:
            routes.append((None, round_robin_routes(num_tokens, top_k, label_e)))
            continue
        sigma = tune_sigma(target, popularity_e, noise_te, top_k)
        routes.append((sigma, lognormal_routes(sigma, popularity_e, noise_te, top_k)))
    return routes


# -- bytes --------------------------------------------------------------------------------------------------

def op_bytes(plans_r: Sequence[MoonEPCommPlan], hidden: int, expert_elements: dict[str, int],
             element_bytes: int = 2) -> dict[str, int]:
    """Bytes each operation must move in one step of the group, from every rank's plan (module docstring).

    Args:
        plans_r: the plans of all R ranks of one step.
        hidden: H.
        expert_elements: `{"prefetch": n, "reduce_grad": n}`, elements of one expert's weights in the
            projections each of the two moves.
        element_bytes: bytes of a row or weight element (2 for bf16); gradients are fp32.
    """
    payload = routes = duplicates = 0
    for plan in plans_r:
        _, _, primary_n, valid_n = decode_dst(plan.dst, plan.NvS)
        payload += int((primary_n & valid_n).sum())
        routes += int(valid_n.sum())
        duplicates += int((valid_n & ~primary_n).sum())
    first = plans_r[0]
    slots = int((first.experts_to_copy >= 0).sum())
    rows = payload * hidden * element_bytes + routes * 4
    return {"plan": first.R * first.R * first.E * 8,
            "dispatch_fwd": rows + duplicates * 4,
            "dispatch": rows,
            "combine": payload * hidden * element_bytes,
            "prefetch": slots * expert_elements["prefetch"] * element_bytes,
            "reduce_grad": slots * expert_elements["reduce_grad"] * 4}


# -- timing across thread-ranks -----------------------------------------------------------------------------

def stamps(world: ThreadsWorld, op: Callable[[], object], warmup: int,
           iters: int) -> list[tuple[Stamp, Stamp]]:
    """Run the collective `op` on this rank `warmup + iters` times, each after a barrier (every rank idle);
    `(start, end)` of the timed runs. The end of a CUDA run is when this rank's stream finishes it."""
    runs = []
    for i in range(warmup + iters):
        world.barrier()
        start = stamp(world.device)
        op()
        end = stamp(world.device)
        if i >= warmup:
            runs.append((start, end))
    world.barrier()
    return runs


def collective_seconds(stamps_ri: Sequence[Sequence[tuple[Stamp, Stamp]]]) -> float:
    """Median over runs of (last rank's end - first rank's start), from every rank's `stamps`."""
    runs = []
    for run_r in zip(*stamps_ri, strict=True):
        runs.append(max(seconds_between(start, end) for start, _ in run_r for _, end in run_r))
    return statistics.median(runs)


# -- the phases ---------------------------------------------------------------------------------------------

def comm_step(world: ThreadsWorld, buffer: Buffer, hidden_sh: torch.Tensor, route_weights_sk: torch.Tensor,
              topk_sk: torch.Tensor, args: argparse.Namespace) -> tuple[MoonEPCommPlan, dict[str, list]]:
    """One rank, one skew: the plan of a forward dispatch, and the stamps of plan, dispatch_fwd, dispatch
    (with that plan) and combine (of the dispatched rows)."""
    S, K, E = topk_sk.shape[0], topk_sk.shape[1], buffer.E
    tokens_per_expert = torch.zeros(E, dtype=torch.int64, device=world.device).scatter_add_(
        0, topk_sk.reshape(-1), torch.ones(S * K, dtype=torch.int64, device=world.device))
    x_nvsh, _, _, plan = buffer.dispatch(hidden_sh, route_weights_sk, topk_sk, tokens_per_expert)
    ops = {"plan": lambda: plan_routes(world.all_gather(tokens_per_expert), topk_sk, rank=world.rank,
                                       num_slots=buffer.B, token_padding=buffer.token_padding,
                                       rows_per_rank=buffer.NvS),
           "dispatch_fwd": lambda: buffer.dispatch(hidden_sh, route_weights_sk, topk_sk, tokens_per_expert),
           "dispatch": lambda: buffer.dispatch(hidden_sh, route_weights_sk, None, None, plan=plan),
           "combine": lambda: buffer.combine(plan, x_nvsh)}
    return plan, {name: stamps(world, op, args.warmup, args.iters) for name, op in ops.items()}


def comm_phase(world: ThreadsWorld, args: argparse.Namespace,
               routes_s: Sequence[torch.Tensor]) -> tuple[Buffer, list[tuple[MoonEPCommPlan, dict]]]:
    """One rank: a bf16 Buffer and random tokens, then `comm_step` on this rank's share of each skew's
    `[R*S, K]` routes."""
    S = args.tokens
    buffer = Buffer(S, args.hidden, args.top_k, args.experts, args.ranks, token_padding=args.token_padding,
                    world=world, validate=False)
    gen = torch.Generator(world.device).manual_seed(args.seed + world.rank)
    hidden_sh = torch.randn(S, args.hidden, generator=gen, device=world.device).to(torch.bfloat16)
    route_weights_sk = torch.rand(S, args.top_k, generator=gen, device=world.device)
    return buffer, [comm_step(world, buffer, hidden_sh, route_weights_sk,
                              topk_tk[world.rank * S:(world.rank + 1) * S], args) for topk_tk in routes_s]


def weight_phase(world: ThreadsWorld, buffer: Buffer, plans_s: Sequence[MoonEPCommPlan],
                 projections: Sequence[str], gradients: bool, args: argparse.Namespace) -> list[list]:
    """One rank: home rows and slots of `projections` (bf16 weights, or fp32 gradients), then per skew the
    stamps of `prefetch_weight` (or `reduce_grad`); the memory is released before returning."""
    dtype = torch.float32 if gradients else torch.bfloat16
    kind = "grads" if gradients else "weights"
    rows, keys = {}, []
    for name in projections:
        shape = PROJECTIONS[name](args.hidden, args.ffn)
        parts = []
        for part, count in (("home", buffer.epn), ("slots", buffer.B)):
            keys.append(f"bench.comm/{kind}/{name}/{part}")
            zeros = torch.zeros(count, *shape, dtype=dtype, device=world.device)
            parts.append(world.symmetric(keys[-1], zeros))
        rows[name] = ExpertRows(*parts)
    op = buffer.reduce_grad if gradients else buffer.prefetch_weight
    timings = [stamps(world, lambda plan=plan: op(plan, rows.get("gate_up"), None, rows.get("down")),
                      args.warmup, args.iters) for plan in plans_s]
    for key in keys:
        world.release(key)
    return timings


def fitting_projections(args: argparse.Namespace, num_slots: int, element_bytes: int) -> tuple[str, ...]:
    """The largest of `FITS` whose home rows and slots on all ranks, plus the threads world's transient
    copies (about three `[max(B, R)]` row blocks per rank), fit in `MEMORY_MARGIN` of the free memory."""
    if args.projections:
        return tuple(args.projections)
    if args.device != "cuda":
        return FITS[0]
    free, _ = torch.cuda.mem_get_info()
    epn, R = args.experts // args.ranks, args.ranks
    for projections in FITS:
        elements_p = [math.prod(PROJECTIONS[p](args.hidden, args.ffn)) for p in projections]
        need = (R * (epn + num_slots) * sum(elements_p) + 3 * R * max(num_slots, R) * max(elements_p)) \
            * element_bytes
        if need <= MEMORY_MARGIN * free:
            return projections
    raise RuntimeError(f"not even one projection's experts fit in {free / 2**30:.1f} GiB free")


def padded_offsets(load_g: torch.Tensor, token_padding: int) -> torch.Tensor:
    """`[G]` routes per group -> `[G]` int32 end offsets of segments padded to `token_padding`."""
    return torch.cumsum((load_g + token_padding - 1) // token_padding * token_padding, 0).to(torch.int32)


def hottest_offsets(plans_r: Sequence[MoonEPCommPlan], token_padding: int) -> dict[str, torch.Tensor]:
    """The compute-group end offsets of the rank with the most padded rows, for MoonEP (`[epn + B]`, home
    experts then slots, from its plan) and for plain EP (`[epn]`, every route on its home rank)."""
    first = plans_r[0]
    epn = first.E // first.R
    moonep = [compute_offsets(p.cu_seqlens, p.rank, epn, p.E) for p in plans_r]
    load_re = first.expert_load.long().view(first.R, epn)
    plain = [padded_offsets(load_e, token_padding) for load_e in load_re]
    return {"moonep": max(moonep, key=lambda o: int(o[-1])), "plain_ep": max(plain, key=lambda o: int(o[-1]))}


def expert_seconds(args: argparse.Namespace, offsets: Sequence[torch.Tensor]) -> list[float]:
    """Forward gate_up and down grouped GEMMs over each `[G]` offsets (G = epn + B or epn groups), on one
    set of random bf16 activations sized for the largest, and one set of weights per G (whole tensors:
    torch's CPU grouped GEMM runs 10x slower on a slice of a larger weight tensor)."""
    device, H, F = torch.device(args.device), args.hidden, args.ffn
    gemm = select_grouped_gemm(args.grouped_gemm, device, torch.bfloat16, k=math.gcd(H, F),
                               token_padding=args.token_padding)
    gen = torch.Generator(device).manual_seed(args.seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    rows = max(int(o[-1]) for o in offsets)
    x_mh, h_mf = randn(rows, H), randn(rows, F)
    weights = {groups: (randn(groups, 2 * F, H, scale=H**-0.5), randn(groups, H, F, scale=F**-0.5))
               for groups in sorted({len(o) for o in offsets})}
    measure = timed if device.type == "cuda" else wall_time
    seconds = []
    for offs_g in offsets:
        offs_g = offs_g.to(device)
        gate_up_gfh, down_ghf = weights[len(offs_g)]

        def experts(offs_g=offs_g, gate_up_gfh=gate_up_gfh, down_ghf=down_ghf):
            gemm.fwd(x_mh, (gate_up_gfh,), offs_g)
            gemm.fwd(h_mf, (down_ghf,), offs_g)

        seconds.append(measure(experts, 2, 5))
    return seconds


# -- the suite ----------------------------------------------------------------------------------------------

def free_cache(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_suite(args: argparse.Namespace) -> tuple[dict, dict, list[dict]]:
    """`(limits, setup, rows)`: one row per skew (module docstring)."""
    device = torch.device(args.device)
    limits = measure_limits() if device.type == "cuda" else {}
    free_cache(args.device)
    R, S, E, K = args.ranks, args.tokens, args.experts, args.top_k
    routes = skewed_routes(args.maxvio, R * S, E, K, args.seed, device)
    group = ThreadGroup(R, device)
    phase = run_ranks(lambda world: comm_phase(world, args, [topk for _, topk in routes]), R, group=group)
    buffers = [buffer for buffer, _ in phase]
    plans_rs = [[plan for plan, _ in results] for _, results in phase]
    num_slots = buffers[0].B
    free_cache(args.device)
    projections = {}
    weight_stamps = {}
    for op, gradients in (("prefetch", False), ("reduce_grad", True)):
        projections[op] = fitting_projections(args, num_slots, 4 if gradients else 2)
        weight_stamps[op] = run_ranks(lambda world, g=gradients, p=projections[op]: weight_phase(
            world, buffers[world.rank], plans_rs[world.rank], p, g, args), R, group=group)
        free_cache(args.device)
    offsets_s = [hottest_offsets([plans_r[s] for plans_r in plans_rs], args.token_padding)
                 for s in range(len(routes))]
    expert_s = expert_seconds(args, [o[kind] for o in offsets_s for kind in ("moonep", "plain_ep")])
    copy_rate = limits.get("copy_bytes_per_s")
    rows = []
    for s, ((sigma, topk_tk), target) in enumerate(zip(routes, args.maxvio, strict=True)):
        plans_r = [plans_r[s] for plans_r in plans_rs]
        plan = plans_r[0]
        bytes_by_op = op_bytes(plans_r, args.hidden, {op: sum(
            math.prod(PROJECTIONS[p](args.hidden, args.ffn)) for p in projected)
            for op, projected in projections.items()})
        seconds_by_op = {name: collective_seconds([results[s][1][name] for _, results in phase])
                         for name in OPS[:4]}
        seconds_by_op |= {op: collective_seconds([stamps_rs[s] for stamps_rs in weight_stamps[op]])
                          for op in ("prefetch", "reduce_grad")}
        ops = {}
        for name in OPS:
            seconds, moved = seconds_by_op[name], bytes_by_op[name]
            ops[name] = {"s": seconds, "bytes": moved, "gbps": moved / seconds / 1e9,
                         "pct_copy": 100 * moved / seconds / (copy_rate / 2) if copy_rate else None}
        rank_load, home_load = plan.rank_load.double(), plan.home_load.double()
        rows.append({
            "target_maxvio": target, "maxvio": expert_skew(topk_tk, E),
            "routing": "round-robin" if sigma is None else "lognormal", "sigma": sigma,
            "slots_used": int(plan.slots_used.sum()),
            "moonep": {"rank_load_max_over_mean": float(rank_load.max() / rank_load.mean()),
                       "hottest_rank_rows": int(offsets_s[s]["moonep"][-1]), "expert_s": expert_s[2 * s]},
            "plain_ep": {"rank_load_max_over_mean": float(home_load.max() / home_load.mean()),
                         "hottest_rank_rows": int(offsets_s[s]["plain_ep"][-1]),
                         "expert_s": expert_s[2 * s + 1]},
            "ops": ops})
    for buffer in buffers:
        buffer.destroy()
    setup = dict(R=R, S=S, H=args.hidden, ffn=args.ffn, K=K, E=E, B=num_slots, tp=args.token_padding,
                 NvS=buffers[0].NvS, world="threads (R thread-ranks on one device)",
                 grouped_gemm=args.grouped_gemm, warmup=args.warmup, iters=args.iters,
                 projections={op: list(p) for op, p in projections.items()},
                 memory_note="prefetch and reduce_grad run in turn, each with its own home rows and slots of "
                             "the listed projections (the most that fit the free memory); bytes count only "
                             "those projections")
    return limits, setup, rows


def print_table(setup: dict, rows: list[dict]) -> None:
    print(f"R={setup['R']} S={setup['S']} H={setup['H']} H'={setup['ffn']} K={setup['K']} E={setup['E']} "
          f"B={setup['B']} tp={setup['tp']}; prefetch {'+'.join(setup['projections']['prefetch'])}, "
          f"reduce_grad {'+'.join(setup['projections']['reduce_grad'])}")
    for row in rows:
        sigma = "round-robin" if row["sigma"] is None else f"sigma {row['sigma']:.4g}"
        moonep, plain = row["moonep"], row["plain_ep"]
        print(f"\nmaxvio {row['target_maxvio']:g} (got {row['maxvio']:.4f}, {sigma}, "
              f"{row['slots_used']} slots used)")
        print(f"  {'op':<13}{'ms':>10}{'MB':>12}{'GB/s':>10}{'% copy':>9}")
        for name, op in row["ops"].items():
            pct = "" if op["pct_copy"] is None else f"{op['pct_copy']:.1f}"
            print(f"  {name:<13}{op['s'] * 1e3:10.3f}{op['bytes'] / 1e6:12.2f}{op['gbps']:10.2f}{pct:>9}")
        for label, side in (("MoonEP", moonep), ("plain EP", plain)):
            print(f"  {label:<9} routes/rank max/mean {side['rank_load_max_over_mean']:.3f}, hottest rank "
                  f"{side['hottest_rank_rows']} rows: experts {side['expert_s'] * 1e3:.3f} ms")
        print(f"  hottest-rank expert time, plain EP / MoonEP: {plain['expert_s'] / moonep['expert_s']:.2f}x")


def plot(setup: dict, rows: list[dict], path: Path) -> None:
    """Left: MoonEP's operation times; right: the hottest rank's expert time, MoonEP vs plain EP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    labels = [f"{row['target_maxvio']:g}" for row in rows]
    fig, (ops_ax, experts_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in OPS:
        ops_ax.plot(x, [row["ops"][name]["s"] * 1e3 for row in rows], marker="o", label=name)
    ops_ax.set_yscale("log")
    ops_ax.set_title("MoonEP operations (all ranks, one device)")
    for label, key in (("plain EP", "plain_ep"), ("MoonEP", "moonep")):
        experts_ax.plot(x, [row[key]["expert_s"] * 1e3 for row in rows], marker="o", label=label)
    experts_ax.plot(x, [(row["moonep"]["expert_s"] + row["ops"]["prefetch"]["s"]) * 1e3 for row in rows],
                    marker="o", linestyle="--", label="MoonEP + prefetch")
    experts_ax.set_title("hottest rank: forward expert GEMMs")
    for ax in (ops_ax, experts_ax):
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("maxvio (max expert load / mean - 1)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"R={setup['R']} S={setup['S']} H={setup['H']} K={setup['K']} E={setup['E']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # R thread-ranks already fill the cores; nested OpenMP teams only spin
    limits, setup, rows = run_suite(args)
    print_table(setup, rows)
    path = write_record("comm", limits, rows, args.out, ran_on=args.device)
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "setup": setup}, indent=1))
    plot(setup, rows, path.with_suffix(".png"))
    print(path, path.with_suffix(".png"))
    return path


if __name__ == "__main__":
    main()
