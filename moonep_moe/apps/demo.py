"""`moonep-moe demo`: per-rank load with MoonEP replicas vs plain expert parallelism, across routing skew.

For each target skew (`maxvio = max_e T_e / mean_e T_e - 1` over the group's experts):
1. skew the router the way MoonEP's benchmark does: expert logits offset by `sigma * z_e` (z ~ N(0, 1),
   i.e. lognormal expert popularity), with sigma found by bisection to hit the target;
2. run one forward + backward of `MoonEPMoELayer` on R thread-ranks, or one rank per process under
   torchrun (weights loaded from one full checkpoint, every rank taking its home experts);
3. check every rank's output, input gradient and router gradient, and every expert's weight gradient,
   against the dense single-device reference in float64;
4. record each rank's routes with replicas (the plan) and under plain EP (its home experts' routes).

It prints a table and writes a PNG of per-rank load against skew.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from moonep_moe.config import MoEConfig
from moonep_moe.layers.dense import dense_step
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.layers.router import TopKRouter
from moonep_moe.transport.threads import run_ranks
from moonep_moe.transport.world import EPWorld

SKEW_TARGETS = (0.0, 1.0, 5.0, 20.0)
TOLERANCE = 1e-4
"""Largest error (relative to the reference's largest magnitude) accepted against float64."""


@dataclass
class Model:
    """One full (un-sharded) MoE layer and one step's data for every rank."""

    router_weight_eh: torch.Tensor
    gate_up_e2fh: torch.Tensor
    down_ehf: torch.Tensor
    hidden: list[torch.Tensor]
    grad_out: list[torch.Tensor]

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A checkpoint in the fused layout (`gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`)."""
        return {"router.weight": self.router_weight_eh.to(dtype),
                "experts.gate_up_proj": self.gate_up_e2fh.to(dtype),
                "experts.down_proj": self.down_ehf.to(dtype)}


@dataclass
class SkewResult:
    target: float
    maxvio: float
    moonep_load_r: list[int]
    ep_load_r: list[int]
    slots_used_r: list[int]
    max_error: float


def make_model(cfg: MoEConfig, sigma: float, seed: int) -> Model:
    """Float64 weights and tokens; expert e's logits are offset by about `3 * sigma * z_e` for every token
    (each token carries a shared direction u, and the router's row e leans along u by `sigma * z_e`)."""
    gen = torch.Generator().manual_seed(seed)
    H, F, E = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    u_h = randn(H)
    u_h /= u_h.norm()
    z_e = randn(E)
    base_eh = randn(E, H) / math.sqrt(H)
    base_eh -= (base_eh @ u_h)[:, None] * u_h  # orthogonal to u and of equal norms: no skew at sigma = 0
    base_eh /= base_eh.norm(dim=1, keepdim=True)
    router_eh = base_eh + sigma * z_e[:, None] * u_h
    tokens = cfg.max_tokens_per_rank
    hidden = [randn(tokens, H) + 3 * u_h for _ in range(cfg.ep_size)]
    return Model(router_eh, randn(E, 2 * F, H) / math.sqrt(H), randn(E, H, F) / math.sqrt(F), hidden,
                 [randn(tokens, H) for _ in range(cfg.ep_size)])


def measure_maxvio(cfg: MoEConfig, model: Model) -> float:
    router = TopKRouter(cfg.router.model_copy(update={"dtype": "float64"}), cfg.hidden_size,
                        cfg.num_experts, cfg.top_k)
    with torch.no_grad():
        router.weight.copy_(model.router_weight_eh)
        counts_e = sum(router(x).tokens_per_expert_e for x in model.hidden).double()
    return float(counts_e.max() / counts_e.mean() - 1)


def find_sigma(cfg: MoEConfig, target: float, seed: int, steps: int = 30) -> float:
    """Log-scale bisection of sigma so that the routing's maxvio reaches `target` (0 -> no skew)."""
    if target <= 0:
        return 0.0
    low, high = 1e-3, 1e3
    for _ in range(steps):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if measure_maxvio(cfg, make_model(cfg, mid, seed)) < target else (low, mid)
    return high


def run_layer(cfg: MoEConfig, model: Model, world: EPWorld | None = None) -> list[dict[str, torch.Tensor]]:
    """One forward + backward of the layer on `cfg.ep_size` thread-ranks (results in rank order), or, given
    a process world (one process per rank), on this rank only (a one-element list). Results on the CPU."""
    dtype = cfg.torch_dtype
    state = model.state_dict(dtype)

    def rank_fn(world):
        layer = MoonEPMoELayer(cfg, world)
        layer.load_state_dict(state)
        x = model.hidden[world.rank].to(world.device, dtype).requires_grad_()
        out = layer(x)
        out.backward(model.grad_out[world.rank].to(world.device, dtype))
        stats = layer.balance_stats()
        layer.destroy()
        result = dict(out=out.detach(), grad_x=x.grad, grad_router=layer.router.weight.grad,
                      grad_gate_up=layer.experts.gate_up.grad, grad_down=layer.experts.down.grad,
                      rank_load=stats["rank_load"], ep_rank_load=stats["ep_rank_load"],
                      slots_used=stats["slots_used"])
        return {k: v.cpu() for k, v in result.items()}

    return [rank_fn(world)] if world is not None else run_ranks(rank_fn, cfg.ep_size)


def max_error(cfg: MoEConfig, model: Model, got: list[dict[str, torch.Tensor]],
              ranks: list[int] | None = None) -> float:
    """Largest relative error of any output or gradient of `ranks` (default: all, `got` in rank order)
    against the float64 dense reference; expert gradients relative to the whole group's.

    The reference routes with the layer's router dtype, so both pick the same experts (a float64 router
    could break near-ties the other way), and computes everything else in float64."""
    ref_cfg = cfg.model_copy(update={"dtype": "float64"})
    want = [dense_step(ref_cfg, {"weight": model.router_weight_eh}, model.gate_up_e2fh, model.down_ehf, x, g)
            for x, g in zip(model.hidden, model.grad_out, strict=True)]
    full = {name: sum(w[name] for w in want) for name in ("grad_gate_up", "grad_down")}
    epn = cfg.experts_per_rank
    triples = []
    for g, rank in zip(got, range(len(got)) if ranks is None else ranks, strict=True):
        triples += [(g[name], want[rank][name], want[rank][name])
                    for name in ("out", "grad_x", "grad_router")]
        triples += [(g[name], full[name][rank * epn:(rank + 1) * epn], full[name]) for name in full]
    return max(float((a.double() - b).abs().max() / scale.abs().max().clamp(min=1e-30))
               for a, b, scale in triples)


def run_demo(cfg: MoEConfig, seed: int = 0, targets: tuple[float, ...] = SKEW_TARGETS,
             world: EPWorld | None = None) -> list[SkewResult]:
    """The sweep on thread-ranks, or given a process world, this process's rank of it (every rank gets
    the same results: loads come from the global plan, the error is the group's maximum)."""
    results = []
    quiet = world is not None and world.rank > 0
    # The bar goes to stderr, only where that is a terminal (None: tqdm asks), and is cleared when the sweep
    # ends (or fails), so that the table printed next on stdout reads intact where both share a terminal.
    bar = tqdm(targets, desc="skew levels", unit="level", disable=True if quiet else None, file=sys.stderr,
               leave=False)
    with bar:
        for target in bar:
            model = make_model(cfg, find_sigma(cfg, target, seed), seed)
            got = run_layer(cfg, model, world)
            error = max_error(cfg, model, got, None if world is None else [world.rank])
            if world is not None:
                error = float(world.all_gather(torch.tensor(error, device=world.device)).max())
            results.append(SkewResult(target, measure_maxvio(cfg, model), got[0]["rank_load"].tolist(),
                                      got[0]["ep_rank_load"].tolist(), got[0]["slots_used"].tolist(), error))
    return results


def format_table(cfg: MoEConfig, results: list[SkewResult]) -> str:
    def ratio(load: list[int]) -> str:
        return f"{max(load) / max(sum(load) / len(load), 1e-9):8.2f}"

    def cells(values: list[int], width: int) -> str:
        return "".join(f"{v:>{width}}" for v in values)

    loads = 5 * cfg.ep_size
    header = (f"{'target maxvio (got)':>19} | {'routes/rank MoonEP':>{loads}} max/mean | "
              f"{'routes/rank plain EP':>{loads}} max/mean | {'slots':>{3 * cfg.ep_size}} | vs float64")
    lines = [header, "-" * len(header)]
    for r in results:
        check = "ok" if r.max_error < TOLERANCE else "FAIL"
        lines.append(f"{r.target:>11g} ({r.maxvio:5.2f}) | {cells(r.moonep_load_r, 5)} "
                     f"{ratio(r.moonep_load_r)} | {cells(r.ep_load_r, 5)} {ratio(r.ep_load_r)} | "
                     f"{cells(r.slots_used_r, 3)} | {check} {r.max_error:.0e}")
    return "\n".join(lines)


def plot(cfg: MoEConfig, results: list[SkewResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skews = [r.maxvio for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.get_cmap("tab10")
    for rank in range(cfg.ep_size):
        ax.plot(skews, [r.ep_load_r[rank] for r in results], "--o", color=colors(rank), alpha=0.6,
                label=f"rank {rank}, plain EP")
        ax.plot(skews, [r.moonep_load_r[rank] for r in results], "-s", color=colors(rank),
                label=f"rank {rank}, MoonEP")
    ax.set_xlabel("routing skew: maxvio = max / mean expert load - 1")
    ax.set_ylabel("routes computed per rank")
    ax.set_title(f"{cfg.ep_size} EP ranks, E={cfg.num_experts}, K={cfg.top_k}, "
                 f"S={cfg.max_tokens_per_rank}, B={cfg.prefetch_slots}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
