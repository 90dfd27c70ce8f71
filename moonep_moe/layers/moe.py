"""`MoonEPMoELayer`: the MoE block of a transformer with MoonEP's exactly balanced expert parallelism.

Legend: t tokens of this rank (T <= S), h hidden, e experts, k top-k.

forward(hidden [T, H] or [B, L, H]):
1. router -> `topk_experts_tk`, `route_weights_tk` (ordinary autograd; its gradient arrives through the
   route weights), the local histogram and the optional aux loss;
2. `MoonEPExperts` (one autograd Function): dispatch, prefetch, grouped-GEMM SwiGLU experts, combine;
3. shared experts (dense SwiGLU, optionally gated) added to the routed output.

Per-step balance statistics stay on the device (`balance_stats()` returns tensors; reading them is the only
host sync, and it is the caller's choice).
"""

from __future__ import annotations

import hashlib
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.world import EPWorld, single_world
from moonep_moe.config import MoEConfig
from moonep_moe.layers.function import ExpertsState, routed_experts
from moonep_moe.layers.grouped_gemm import GemmProblem, select_grouped_gemm
from moonep_moe.layers.router import TopKRouter
from moonep_moe.weights.experts import HomeExperts


class SharedExperts(nn.Module):
    """Dense SwiGLU MLP applied to every token: `down(silu(gate(x)) * up(x))`, width
    `num_shared_experts * ffn_hidden_size`, optionally scaled by `sigmoid(gate_proj(x))` (Qwen2-MoE)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, gated: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        kwargs = dict(bias=False, dtype=dtype, device=device)
        self.gate_up = nn.Linear(hidden_size, 2 * ffn_hidden_size, **kwargs)
        self.down = nn.Linear(ffn_hidden_size, hidden_size, **kwargs)
        self.gate = nn.Linear(hidden_size, 1, **kwargs) if gated else None

    def forward(self, hidden_th: torch.Tensor) -> torch.Tensor:
        gate_tf, up_tf = self.gate_up(hidden_th).chunk(2, dim=-1)
        out_th = self.down(F.silu(gate_tf) * up_tf)
        return out_th * torch.sigmoid(self.gate(hidden_th)) if self.gate is not None else out_th


def default_world(config: MoEConfig) -> EPWorld:
    """The world a layer built without one uses: `world="threads"` -> a one-rank world on the CPU (only with
    ep_size == 1); `"collective"` -> the initialised default process group's `CollectiveWorld`;
    `"symmetric"` -> its `SymmetricWorld` (one GPU per rank, `cuda:LOCAL_RANK`)."""
    if config.world == "collective":
        from moonep_moe.comm.collective import collective_world

        return collective_world()
    if config.world == "symmetric":
        from moonep_moe.comm.symmetric import symmetric_world

        return symmetric_world()
    if config.ep_size != 1:
        raise ValueError(f"ep_size={config.ep_size} needs a world with {config.ep_size} ranks "
                         "(e.g. moonep_moe.comm.world.run_ranks, or world='symmetric' / 'collective' under "
                         "torchrun)")
    return single_world()


def check_same_config(world: EPWorld, config: MoEConfig) -> None:
    """Collective: raise on every rank, naming the ranks, unless all ranks hold the same config (one
    all-gather of a 63-bit hash of `config.model_dump_json()`, read on the host at construction)."""
    digest = hashlib.sha256(config.model_dump_json().encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:8], "little") >> 1], dtype=torch.int64, device=world.device)
    hash_r = world.all_gather(mine).view(-1).tolist()
    if len(set(hash_r)) > 1:
        differ = [r for r, h in enumerate(hash_r) if h != hash_r[0]]
        raise ValueError(f"MoEConfig differs across the EP ranks: rank(s) {differ} disagree with rank 0 "
                         f"(seen on rank {world.rank}); every rank must build the layer from the same config")


class MoonEPMoELayer(nn.Module):
    """Drop-in MoE block. Parameters: `router.weight [E, H]`, `experts.gate_up [epn, 2H', H]`,
    `experts.down [epn, H, H']` (this rank's home experts only) and the shared experts.

    Args:
        config: the layer's `MoEConfig` (validated).
        world: the EP world (any `EPWorld`), whose size must be `config.ep_size`; default from
            `config.world` (`default_world`). Every rank must construct its layers in the same order, from
            the same config (checked: ranks that disagree raise, named).

    `forward` returns a tensor of the input's shape, or `(output, aux_loss)` when
    `config.router.aux_loss_coeff > 0`.
    """

    _serial = itertools.count()

    def __init__(self, config: MoEConfig, world: EPWorld | None = None):
        super().__init__()
        world = default_world(config) if world is None else world
        if world.size != config.ep_size:
            raise ValueError(f"ep_size={config.ep_size} does not match the world's size {world.size}")
        check_same_config(world, config)
        self.config, self.world = config, world
        dtype, device = config.torch_dtype, world.device
        h, f, e, k = config.hidden_size, config.ffn_hidden_size, config.num_experts, config.top_k
        serial = world.globals.setdefault("layer_serial", itertools.count())
        self.router = TopKRouter(config.router, h, e, k).to(device)
        self.experts = HomeExperts(world, e, h, f, config.prefetch_slots, dtype, name=f"moe{next(serial)}")
        shared = config.shared_experts
        self.shared_experts = None
        if shared.num_shared_experts:
            width = shared.num_shared_experts * (shared.ffn_hidden_size or f)
            self.shared_experts = SharedExperts(h, width, shared.gate, dtype, device)
        # validate=False: the router's expert ids are in [-1, E) by construction, and the check is a host read
        self.buffer = Buffer(config.max_tokens_per_rank, h, k, e, config.ep_size, config.prefetch_slots,
                             token_padding=config.token_padding, world=world, dtype=dtype, validate=False)
        main_grad = config.expert_grad_dtype == "main_grad"
        grad_dtype = torch.promote_types(dtype, torch.float32) if main_grad else dtype
        groups = config.experts_per_rank + config.prefetch_slots  # this rank's compute groups
        problem = GemmProblem(((2 * f, h), (h, f)), rows_per_group=config.max_tokens_per_rank * k // groups,
                              grad_dtype=grad_dtype)
        gemm = select_grouped_gemm(config.grouped_gemm, device, dtype, k=math.gcd(h, f),
                                   token_padding=config.token_padding, problem=problem)
        self._state = ExpertsState(self.buffer, self.experts, gemm, grad_dtype, main_grad)
        expert_load_e = torch.zeros(e, dtype=torch.int64, device=device)
        self.register_buffer("expert_load", expert_load_e, persistent=False)
        self.record_router_logits = False
        """When True, `forward` keeps the router's logits `[T, E]` (with their autograd graph) in
        `last_router_logits_te` until the next call, so a wrapper can return them without routing twice."""
        self.last_router_logits_te: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None):
        """`[T, H]` or `[B, L, H]` with `B*L <= max_tokens_per_rank` -> the same shape (and the aux loss).

        `token_mask` (`[T]` or `[B, L]` bool, True = real token) keeps padding tokens out of routing: their
        routes are -1 (not counted, not sent, zero routed output), so padding never changes the plan of the
        real tokens.
        """
        cfg = self.config
        if hidden_states.dim() not in (2, 3) or hidden_states.shape[-1] != cfg.hidden_size:
            raise ValueError(f"hidden_states must be [T, {cfg.hidden_size}] or [B, L, {cfg.hidden_size}], "
                             f"got {list(hidden_states.shape)}")
        if hidden_states.dtype != cfg.torch_dtype:
            raise ValueError(f"hidden_states must have dtype {cfg.torch_dtype} (config.dtype), "
                             f"got {hidden_states.dtype}")
        hidden_th = hidden_states.reshape(-1, cfg.hidden_size)
        if hidden_th.shape[0] > cfg.max_tokens_per_rank:
            raise ValueError(f"{hidden_th.shape[0]} tokens exceed "
                             f"max_tokens_per_rank={cfg.max_tokens_per_rank}")
        if token_mask is not None and (token_mask.shape != hidden_states.shape[:-1]
                                       or token_mask.dtype != torch.bool):
            raise ValueError(f"token_mask must be a bool tensor of shape {list(hidden_states.shape[:-1])}, "
                             f"got {token_mask.dtype} {list(token_mask.shape)}")
        routing = self.router(hidden_th, None if token_mask is None else token_mask.reshape(-1))
        if self.record_router_logits:
            self.last_router_logits_te = routing.logits_te
        route_weights_tk = routing.route_weights_tk.to(self.buffer.weight_dtype)
        out_th = routed_experts(hidden_th.contiguous(), route_weights_tk,
                                routing.topk_experts_tk, routing.tokens_per_expert_e,
                                self.experts.gate_up, self.experts.down, self._state)
        with torch.no_grad():
            self.expert_load += self._state.last_plan.expert_load
        if self.shared_experts is not None:
            out_th = out_th + self.shared_experts(hidden_th)
        out = out_th.view(hidden_states.shape)
        return (out, routing.aux_loss) if routing.aux_loss is not None else out

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing: move the router's expert bias using the group-wide expert loads counted
        since the last call (identical on every rank, so the bias stays replicated), then reset them."""
        self.router.update_expert_bias(self.expert_load)
        self.expert_load.zero_()

    @torch.no_grad()
    def zero_main_grad(self) -> None:
        """`expert_grad_dtype="main_grad"`: zero the home experts' persistent `main_grad` (where allocated),
        e.g. after each optimizer step; the layer never zeroes it itself."""
        for weight in (self.experts.gate_up, self.experts.down):
            if getattr(weight, "main_grad", None) is not None:
                weight.main_grad.zero_()

    def balance_stats(self) -> dict[str, torch.Tensor]:
        """The last step's balance, as device tensors (no host sync until you read them).

        `rank_load [R]` routes computed per rank; `max_load`, `mean_load`, `maxvio = max / mean - 1`;
        the same for plain expert parallelism (`ep_rank_load`, `ep_maxvio`: every route on its home rank);
        `slots_used [R]`.
        """
        plan = self._state.last_plan
        if plan is None:
            raise RuntimeError("balance_stats() needs a forward pass first")
        stats = {"rank_load": plan.rank_load, "ep_rank_load": plan.home_load, "slots_used": plan.slots_used}
        for prefix, load in (("", plan.rank_load), ("ep_", plan.home_load)):
            load = load.double()
            stats[f"{prefix}max_load"] = load.max()
            stats[f"{prefix}mean_load"] = load.mean()
            stats[f"{prefix}maxvio"] = load.max() / load.mean().clamp(min=1e-9) - 1
        return stats

    def destroy(self) -> None:
        """Release the layer's comm memory (its Buffer). The layer cannot run afterwards."""
        self.buffer.destroy()
