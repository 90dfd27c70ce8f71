"""Swap the MoE modules of a torchtitan model for `MoonEPMoELayer`.

Shapes use the suffix letters of DESIGN.md, "Notation"; torchtitan's tensors keep torchtitan's names and
capital suffixes (`w1_EFD`: E experts, F their FFN width, D the model dimension, our H; `x_BLD`: batch,
sequence, D).

`swap_moe_modules(model, max_tokens_per_rank, world)` replaces every `torchtitan.models.common.moe.MoE` of
a built torchtitan model (DeepSeek-V3, Qwen3, ... from its config registry; on a device or on meta) in place
with a `MoonEPTitanMoE`: a torchtitan `Module` around one `MoonEPMoELayer`, configured from the replaced
module (dims, experts, top-k, score function, `route_norm`, `route_scale`, node-limited groups, shared
experts, expert bias), that keeps `MoE`'s contract:

1. `forward(x_BLD [B, L, D]) -> [B, L, D]`, with `B * L <= max_tokens_per_rank` on every rank. At EP = R
   every rank holds a full copy of the non-expert model, runs its own tokens and swaps its own copy on its
   own world, every rank in the same order.
2. Checkpoints in torchtitan's names and layouts, through state-dict hooks as torchtitan's own
   `FusedQKVLinear` does: `router.gate.weight [E, D]`, `routed_experts.inner_experts.w1_EFD` and `w3_EFD`
   `[E, F, D]`, `w2_EDF [E, D, F]`, `shared_experts.w1 / w2 / w3 (/ gate).weight`, `expert_bias_E [E]`; so
   torchtitan's checkpointer (`ModelWrapper`: `state_dict()`, `load_state_dict(strict=False)`) and its HF
   state-dict adapters read and write the swapped model. At EP > 1 the expert tensors hold this rank's
   home experts `[epn, ...]`: plain tensors on a threads or collective world, DTensors on a DeviceMesh's
   world (placements `[Replicate(), Shard(0)]` over its ("dp", "ep") dimensions), so DCP sees whole
   `[E, ...]` tensors. Loading takes whole `[E, ...]` tensors (any torchtitan checkpoint) or this rank's
   `[epn, ...]`.
3. Aux-loss-free balancing as torchtitan does it: `load_balance_coeff`, `expert_bias_E` (the router's
   selection bias) and `tokens_per_expert_E`, which torchtitan's optimizer pre-hook
   (`register_moe_load_balancing_hook`, its models' `post_optimizer_build_fn`) reads and updates exactly as
   for its own `MoE`. `tokens_per_expert_E` counts the routes of the whole EP group (the GLOBAL loads the
   planner gathers, the same on every rank of the group) in every training forward, an activation
   checkpointing recompute included, as torchtitan's `MoE` counts (its hook halves the counts under full
   AC). The hook sums the counts over its "loss" mesh: where that mesh also spans an EP group's ranks,
   every count is multiplied by the same factor, which leaves `sign(mean - count)`, so the update, as it is.
4. Initialisation the torchtitan way: built on meta, `to_empty()` then the model's `init_weights()` (or
   this module's `reset_parameters()`) draws every tensor with the replaced module's own initialisers
   (`param_init`): each expert (as `[1, F, D]`) from torch's generator seeded by the layer's init seed and
   its global id, every other tensor by the seed and its name: the same model at every EP size, and
   replicated tensors identical on every rank.

Data parallelism: `moonep_moe.parallel.data_parallel(model, mesh, "fsdp", blocks=...)` (FSDP2's
`fully_shard` with the home experts left out) with the layers on `mesh`'s "ep" dimension, not torchtitan's
`parallelize_fn`, whose FSDP would shard the home experts. So torchtitan's `Trainer` does not run a swapped
model as it is: a loop of torchtitan's components does (docs/torchtitan.md, `bench/torchtitan_train.py`).

Refused with a one-line ValueError naming the argument: a model already parallelized by torchtitan;
`expert_parallel_degree` or `tensor_parallel_degree` > 1 in `parallelize`; torchtitan's FSDP application
(`apply_fsdp_to_decoder`, which reads `routed_experts`); `num_expert_groups` with softmax scores (torchtitan
scores a group by its top-2 sum, MoonEP's softmax router by its max) or without `num_limited_groups`;
`_debug_force_load_balance`; a router gate or shared expert with a bias; experts other than
`GroupedExperts` (a low-precision converter's); a `moe_comm_backend` other than "standard"; an
`aux_loss_coeff` override.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
from torchtitan.protocols.module import Module

# The public API (`moonep_moe`, `moonep_moe.parallel`) and two internal names, `recomputing` and
# `derived_seed`: re-point those here when their modules move.
from moonep_moe.config import MoEConfig, dtype_name
from moonep_moe.layers.moe import MoonEPMoELayer, recomputing
from moonep_moe.parallel import ep_world
from moonep_moe.transport.world import EPWorld
from moonep_moe.weights.experts import derived_seed

__all__ = ["MoonEPTitanMoE", "swap_moe_modules", "titan_grads"]

EXPERTS = "routed_experts.inner_experts"
"""Where torchtitan's `MoE` keeps its `GroupedExperts`."""
EXPERT_PLACEMENTS = (Replicate(), Shard(0))
"""The expert tensors' placements over a ("dp", "ep") mesh: replicated over "dp", split over "ep"."""
LINEAR_DEFAULT_INIT = partial(nn.init.kaiming_uniform_, a=math.sqrt(5))
"""nn.Linear's own weight init: what torchtitan's `Linear` runs without a `param_init`."""


@dataclass(frozen=True)
class Part:
    """One tensor of torchtitan's `MoE` and where the swapped layer keeps it.

    Attributes:
        titan: its key under the `MoE` module (`routed_experts.inner_experts.w1_EFD`).
        ours: the layer's tensor holding it (`experts.gate_up`, relative to the layer).
        half: None for the whole of `ours`, else 0 or 1: the first or second half of `ours` along its
            second-to-last dimension (gate rows, then up rows).
        expert_name: for expert tensors (dimension 0: E experts in torchtitan, this rank's epn in `ours`),
            `HomeExperts`' per-expert checkpoint name (`gate_proj`, `up_proj`, `down_proj`); else None.
    """

    titan: str
    ours: str
    half: int | None = None
    expert_name: str | None = None


def module_parts(block: MoE) -> tuple[Part, ...]:
    """The tensors of `block`, in its `state_dict()` order: its own buffer, then routed experts, router
    gate and shared experts."""
    parts = [Part("expert_bias_E", "router.expert_bias")] if block.expert_bias_E is not None else []
    parts += [Part(f"{EXPERTS}.w1_EFD", "experts.gate_up", 0, "gate_proj"),
              Part(f"{EXPERTS}.w2_EDF", "experts.down", None, "down_proj"),
              Part(f"{EXPERTS}.w3_EFD", "experts.gate_up", 1, "up_proj"),
              Part("router.gate.weight", "router.weight")]
    if block.shared_experts is not None:
        parts += [Part("shared_experts.w1.weight", "shared_experts.gate_up.weight", 0),
                  Part("shared_experts.w2.weight", "shared_experts.down.weight"),
                  Part("shared_experts.w3.weight", "shared_experts.gate_up.weight", 1)]
        if isinstance(block.shared_experts, SigmoidGatedFeedForward):
            parts.append(Part("shared_experts.gate.weight", "shared_experts.gate.weight"))
    return tuple(parts)


def initialiser(block: MoE, key: str) -> Callable[[torch.Tensor], Any] | None:
    """The initialiser torchtitan's `init_states` would run on `block`'s parameter `key`: its module's
    `param_init` entry, nn.Linear's own for a `Linear` without one, None where torchtitan would raise."""
    owner_name, _, name = key.rpartition(".")
    owner = block.get_submodule(owner_name)
    if owner._param_init is not None:
        return owner._param_init.get(name)
    return LINEAR_DEFAULT_INIT if isinstance(owner, nn.Linear) else None


@contextlib.contextmanager
def forked_generator(device: torch.device) -> Iterator[torch.Generator]:
    """torch's default generator of `device`, for the block only: its state is restored after it."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        yield torch.cuda.default_generators[device.index] if cuda else torch.default_generator


class MoonEPTitanMoE(Module):
    """torchtitan's `MoE` backed by `MoonEPMoELayer`: `forward(x_BLD [B, L, D]) -> [B, L, D]`.

    Attributes:
        layer: the `MoonEPMoELayer` (router, this rank's home experts, shared experts).
        load_balance_coeff: the replaced module's (None: no expert bias).
        tokens_per_expert_E: float32 `[E]` buffer (not saved), the EP group's routes per expert counted by
            every training forward since torchtitan's balancing hook last zeroed it.
        parts: the replaced module's tensors (`Part`); `titan_shapes`, `titan_dtypes`: their shapes (whole:
            `[E, ...]` for experts) and dtypes there; `inits`: their initialisers (`initialiser`); `mesh`: the
            ("dp", "ep") mesh of a DeviceMesh world, else None.
    """

    def __init__(self, layer: MoonEPMoELayer, block: MoE, mesh: DeviceMesh | None):
        super().__init__()
        self.layer, self.mesh = layer, mesh
        self.load_balance_coeff = block.load_balance_coeff
        self.parts = module_parts(block)
        state = block.state_dict(keep_vars=True)
        self.titan_shapes = {part.titan: state[part.titan].shape for part in self.parts}
        self.titan_dtypes = {part.titan: state[part.titan].dtype for part in self.parts}
        self.inits = {part.titan: initialiser(block, part.titan) for part in self.parts
                      if part.titan != "expert_bias_E"}
        device = layer.experts.gate_up.device
        counts_E = torch.zeros(layer.config.num_experts, dtype=torch.float32, device=device)
        self.register_buffer("tokens_per_expert_E", counts_E, persistent=False)
        self._recomputed = False
        self.register_state_dict_post_hook(MoonEPTitanMoE._save_titan)
        self.register_load_state_dict_pre_hook(MoonEPTitanMoE._load_titan)
        self.register_load_state_dict_post_hook(MoonEPTitanMoE._name_missing)

    @property
    def expert_bias_E(self) -> torch.Tensor | None:
        """float32 `[E]` selection bias (the router's `expert_bias`), moved by torchtitan's balancing hook."""
        return self.layer.router.expert_bias

    @property
    def routed_experts(self) -> nn.Module:
        raise ValueError("torchtitan's FSDP or expert-parallel application (apply_fsdp_to_decoder, via "
                         "parallelize_fn) would shard MoonEP's home experts: wrap the swapped model with "
                         "moonep_moe.parallel.data_parallel(model, mesh, 'fsdp', blocks=...) instead")

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        """`[B, L, D] -> [B, L, D]`, in training counting the EP group's routes into `tokens_per_expert_E`
        (`_count_recompute` counts an activation-checkpointing recompute)."""
        recompute = self.training and recomputing()
        self._recomputed = recompute
        out_BLD = self.layer(x_BLD.to(self.layer.config.torch_dtype))
        if self.training and not recompute:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(self.layer.last_expert_load)
            if x_BLD.requires_grad:
                x_BLD.register_hook(self._count_recompute)
        return out_BLD.to(x_BLD.dtype)

    def _count_recompute(self, grad_BLD: torch.Tensor) -> None:
        """Gradient hook on a training forward's input, so it runs when this module's backward is done: if
        activation checkpointing recomputed the forward in that backward, count the recompute's routes (its
        plan is the layer's last), as torchtitan's `MoE` counts its recompute. Counting after the recompute's
        layer call instead would be lost: torch's recompute stops once the last saved tensor is rebuilt."""
        if self._recomputed:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(self.layer.last_expert_load)
            self._recomputed = False

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's `Module.parallelize`, refusing what would shard this module: its experts are already
        spread over its EP world."""
        for name, degree in (("expert_parallel_degree", parallel_dims.ep),
                             ("tensor_parallel_degree", parallel_dims.tp)):
            if degree > 1:
                raise ValueError(f"{name}={degree} is not supported on a MoonEP MoE module: its experts are "
                                 f"already spread over its EP world (EP size {self.layer.world.size}); set "
                                 "it to 1")
        super().parallelize(parallel_dims)

    # -- torchtitan's tensors ------------------------------------------------------------------------------

    def _ours(self, part: Part) -> torch.Tensor:
        return attrgetter(part.ours)(self.layer)

    def titan_tensor(self, part: Part, grads: bool = False) -> torch.Tensor | None:
        """`part` (or its `.grad`, None where there is none) in torchtitan's layout and dtype, detached (a
        copy where `part` is half of a tensor); an expert tensor on a DeviceMesh world as a DTensor of the
        whole `[E, ...]`."""
        tensor = self._ours(part)
        tensor = tensor.grad if grads else tensor.detach()
        if tensor is None:
            return None
        if part.half is not None:
            if isinstance(tensor, DTensor):  # an FSDP shard: split the whole tensor, as torchtitan does
                tensor = tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
            tensor = tensor.chunk(2, dim=-2)[part.half].contiguous()
        tensor = tensor.to(self.titan_dtypes[part.titan])
        if part.expert_name is not None and self.mesh is not None:
            tensor = DTensor.from_local(tensor, self.mesh, EXPERT_PLACEMENTS, run_check=False)
        return tensor

    @staticmethod
    def _save_titan(module: MoonEPTitanMoE, state_dict, prefix: str, local_metadata) -> None:
        """`state_dict()` post-hook: the layer's entries become torchtitan's."""
        for key in [k for k in state_dict if k.startswith(f"{prefix}layer.")]:
            del state_dict[key]
        for part in module.parts:
            state_dict[prefix + part.titan] = module.titan_tensor(part)

    @staticmethod
    def _load_titan(module: MoonEPTitanMoE, state_dict, prefix: str, local_metadata, strict, missing_keys,
                    unexpected_keys, error_msgs) -> None:
        """`load_state_dict()` pre-hook: torchtitan's entries become the layer's (experts as `HomeExperts`'
        per-expert entries, halves joined). An entry whose partner half is absent stays, unexpected."""
        module._loading_prefix = prefix
        halves: dict[str, list[torch.Tensor | None]] = {}
        for part in module.parts:
            key = prefix + part.titan
            if key not in state_dict:
                continue
            if part.expert_name is not None:
                module._load_experts(state_dict, key, f"{prefix}layer.experts", part.expert_name, error_msgs)
            elif part.half is None:
                state_dict[f"{prefix}layer.{part.ours}"] = state_dict.pop(key)
            else:
                halves.setdefault(part.ours, [None, None])[part.half] = key
        for ours, keys in halves.items():
            if None in keys:
                continue
            values = [state_dict.pop(key) for key in keys]
            if isinstance(values[0], DTensor):  # join whole tensors, as torchtitan's fused QKV does
                values = [v.redistribute(v.device_mesh, [Replicate()] * v.device_mesh.ndim) for v in values]
            state_dict[f"{prefix}layer.{ours}"] = torch.cat(values, dim=-2)

    def _load_experts(self, state_dict, key: str, experts_prefix: str, name: str, error_msgs) -> None:
        """torchtitan's `[E, ...]` (or this rank's `[epn, ...]`) expert tensor under `key` -> one entry per
        expert, `{experts_prefix}.{e}.{name}.weight` (views), for `HomeExperts` to take its own."""
        value = state_dict.pop(key)
        experts = self.layer.experts
        if isinstance(value, DTensor):
            mine = value.device_mesh == self.mesh and tuple(value.placements) == EXPERT_PLACEMENTS
            value = value.to_local() if mine else value.full_tensor()
        if value.shape[0] not in (experts.num_experts, experts.epn):
            error_msgs.append(f"{key}: expected {experts.num_experts} experts (the whole layer) or this "
                              f"rank's {experts.epn}, got {value.shape[0]} (rank {experts.world.rank})")
            return
        first = 0 if value.shape[0] == experts.num_experts else experts.first_expert
        for i in range(value.shape[0]):
            state_dict[f"{experts_prefix}.{first + i}.{name}.weight"] = value[i]

    @staticmethod
    def _name_missing(module: MoonEPTitanMoE, incompatible_keys) -> None:
        """`load_state_dict()` post-hook: missing layer entries reported under torchtitan's names."""
        prefix = getattr(module, "_loading_prefix", None)
        if prefix is None:
            return
        named: list[str] = []
        for key in incompatible_keys.missing_keys:
            named += [name for name in module.titan_names(prefix, key) if name not in named]
        incompatible_keys.missing_keys[:] = named

    def titan_names(self, prefix: str, key: str) -> list[str]:
        """torchtitan's names of the layer's entry `key` (under this module's `prefix`); `[key]` for any
        other key."""
        local = key.removeprefix(f"{prefix}layer.")

        def holds(part: Part) -> bool:
            if part.expert_name is None:
                return local == part.ours
            return re.fullmatch(rf"experts\.\d+\.{part.expert_name}\.weight", local) is not None

        return [prefix + part.titan for part in self.parts if holds(part)] or [key]

    # -- initialisation ------------------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every parameter with the replaced module's initialisers (`inits`), from torch's generator
        seeded by the layer's `init_seed` and the tensor (each expert separately, by its global id), then zero
        the expert bias and the counts. Not collective; nothing to do on meta.

        Raises:
            ValueError: a tensor torchtitan has no initialiser for (no `param_init` entry).
        """
        layer = self.layer
        device = layer.experts.gate_up.device
        if device.type == "meta":
            return
        joined: dict[str, list[torch.Tensor]] = {}
        with forked_generator(device) as generator:
            for part in self.parts:
                if part.titan == "expert_bias_E":
                    continue
                if self.inits[part.titan] is None:
                    raise ValueError(f"no initialiser for {part.titan} (the replaced module's param_init)")
                if part.expert_name is not None:
                    self._draw_experts(part, generator)
                else:
                    drawn = self._drawn(part, self.titan_shapes[part.titan], generator, part.titan)
                    joined.setdefault(part.ours, []).append(drawn)
        for ours, values in joined.items():
            target = attrgetter(ours)(layer)
            value = torch.cat(values, dim=-2) if len(values) > 1 else values[0]
            if isinstance(target, DTensor):  # every rank drew the same whole tensor: take its own shard
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
            target.copy_(value)
        self._init_self_buffers()

    def _drawn(self, part: Part, shape, generator: torch.Generator, key: str) -> torch.Tensor:
        """A new tensor of `shape` in `part`'s torchtitan dtype, drawn by its initialiser from `generator`
        seeded by (the layer's init seed, `key`)."""
        generator.manual_seed(derived_seed(self.layer.init_seed, key))
        device = self.layer.experts.gate_up.device
        drawn = torch.empty(shape, dtype=self.titan_dtypes[part.titan], device=device)
        self.inits[part.titan](drawn)
        return drawn

    def _draw_experts(self, part: Part, generator: torch.Generator) -> None:
        """This rank's experts of `part`, each drawn as `[1, F, D]` (seeded by its global id), into its
        rows."""
        target = self._ours(part)
        if part.half is not None:
            target = target.chunk(2, dim=-2)[part.half]
        shape = (1, *self.titan_shapes[part.titan][1:])
        for i, expert in enumerate(self.layer.experts.home_experts):
            target[i].copy_(self._drawn(part, shape, generator, f"expert{expert}.{part.titan}")[0])

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        """Zero the expert bias and the counts (torchtitan's `MoE` does the same); they stay on the layer's
        device."""
        if self.layer.experts.gate_up.device.type == "meta":
            return
        with torch.no_grad():
            self.tokens_per_expert_E.zero_()
            self.layer.expert_load.zero_()
            if self.expert_bias_E is not None:
                self.expert_bias_E.zero_()


# -- the swap -----------------------------------------------------------------------------------------------


def check_module(name: str, block: MoE) -> None:
    """Raise on what `MoonEPMoELayer` cannot reproduce exactly, naming the argument."""
    router, routed = block.router, block.routed_experts
    experts, dispatcher = routed.inner_experts, routed.token_dispatcher
    if type(experts) is not GroupedExperts:
        raise ValueError(f"{name}.{EXPERTS}: {type(experts).__name__} is not supported; expected "
                         "GroupedExperts (a model built without a grouped-experts converter)")
    if type(dispatcher) not in (LocalTokenDispatcher, AllToAllTokenDispatcher):
        raise ValueError(f"{name}: moe_comm_backend with {type(dispatcher).__name__} is not supported; "
                         "expected 'standard' (MoonEP does the dispatch)")
    if getattr(dispatcher, "ep_mesh", None) is not None or block._parallelized or \
            any(isinstance(p, DTensor) for p in block.parameters()):
        raise ValueError(f"{name} is already parallelized by torchtitan: swap the MoE modules first, then "
                         "parallelize with moonep_moe.parallel.data_parallel")
    if router.gate.bias is not None:
        raise ValueError(f"{name}.router.gate: bias=True is not supported; expected bias=False")
    if router._debug_force_load_balance:
        raise ValueError(f"{name}.router: _debug_force_load_balance=True is not supported; expected False")
    groups = router.num_expert_groups
    if groups is not None and router.score_func != "sigmoid":
        raise ValueError(f"{name}.router: num_expert_groups={groups} with score_func={router.score_func!r} "
                         "is not supported (torchtitan scores a group by its top-2 sum, MoonEP's softmax "
                         "router by its max); expected score_func='sigmoid' or num_expert_groups=None")
    if groups is not None and router.num_limited_groups is None:
        raise ValueError(f"{name}.router: num_expert_groups={groups} needs num_limited_groups; got None")
    shared = block.shared_experts
    if shared is not None and type(shared) not in (FeedForward, SigmoidGatedFeedForward):
        raise ValueError(f"{name}.shared_experts: {type(shared).__name__} is not supported; expected "
                         "FeedForward or SigmoidGatedFeedForward")
    for sub_name, sub in ([] if shared is None else shared.named_children()):
        if getattr(sub, "bias", None) is not None:
            raise ValueError(f"{name}.shared_experts.{sub_name}: bias=True is not supported; expected "
                             "bias=False")


def module_config(block: MoE, max_tokens_per_rank: int, ep_size: int, overrides: dict[str, Any]) -> MoEConfig:
    """The `MoEConfig` of one torchtitan `MoE`: its shapes and router, its experts' dtype (the router in
    float32, as torchtitan computes the gate, float64 in a float64 model), then `overrides` (nested dicts
    merged into `router` / `shared_experts`).

    The layer's own bias update (`expert_bias_update_rate`) stays 0: torchtitan's hook moves the bias."""
    router, w1_EFD = block.router, block.routed_experts.inner_experts.w1_EFD
    num_experts, ffn, dim = w1_EFD.shape
    router_fields = dict(score_function=router.score_func, renormalize=bool(router.route_norm),
                         routed_scaling_factor=float(router.route_scale),
                         dtype="float64" if w1_EFD.dtype == torch.float64 else "float32",
                         expert_bias=block.load_balance_coeff is not None, expert_bias_update_rate=0.0)
    if router.num_expert_groups is not None:
        router_fields.update(n_group=router.num_expert_groups, topk_group=router.num_limited_groups)
    fields: dict[str, Any] = dict(hidden_size=dim, ffn_hidden_size=ffn, num_experts=num_experts,
                                  top_k=router.top_k, ep_size=ep_size, dtype=dtype_name(w1_EFD.dtype),
                                  max_tokens_per_rank=max_tokens_per_rank, router=router_fields)
    shared = block.shared_experts
    if shared is not None:
        fields["shared_experts"] = dict(num_shared_experts=1, ffn_hidden_size=shared.w1.out_features,
                                        gate=isinstance(shared, SigmoidGatedFeedForward))
    for key, value in overrides.items():
        fields[key] = {**fields.get(key, {}), **value} if isinstance(value, dict) else value
    if fields["router"].get("aux_loss_coeff", 0.0):
        raise ValueError("router.aux_loss_coeff must stay 0 in a swapped torchtitan module: torchtitan's MoE "
                         "returns no aux loss (it balances with expert_bias_E)")
    return MoEConfig.model_validate(fields)


def swap_moe_modules(model: nn.Module, max_tokens_per_rank: int, world: EPWorld | DeviceMesh | None = None,
                     **config_overrides: Any) -> nn.Module:
    """Replace every torchtitan `MoE` of `model` in place with a `MoonEPTitanMoE` (weights copied, unless on
    meta); returns `model`.

    Args:
        model: a built torchtitan model (e.g. `model_registry("debugmodel").model.build()`), on a device or
            on meta (then `to_empty()` and `init_weights()` after swapping, as torchtitan's trainer does).
        max_tokens_per_rank: S, the most tokens (B * L) one forward of a module carries on a rank.
        world: the EP world (its size is the EP size): None (a one-rank world on the model's device), any
            `EPWorld` (e.g. `run_ranks` thread ranks), or a ("dp", "ep") DeviceMesh (`moonep_moe.parallel.
            moe_mesh`), whose "ep" dimension's collective world is used. At EP > 1 call this on every rank,
            each on its own copy of the model, every rank with the same arguments.
        **config_overrides: `MoEConfig` fields applied after the ones read from the modules, e.g.
            `token_padding=8`, `grouped_gemm="reference"`, `dtype="bfloat16"` (the module then casts its input
            and output).

    Raises:
        ValueError: no torchtitan `MoE` in `model`, a module on another device than the world's, or what the
            module docstring lists as refused.
    """
    mesh = world if isinstance(world, DeviceMesh) else None
    if mesh is not None:
        world = ep_world(mesh)
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]
    if not found:
        raise ValueError(f"no torchtitan MoE module in {type(model).__name__}")
    for name, block in found:
        check_module(name, block)
        device = block.routed_experts.inner_experts.w1_EFD.device
        on_meta = device.type == "meta"
        if world is not None and not on_meta and device != world.device:
            raise ValueError(f"{name} is on {device}, the EP world's device is {world.device} (rank "
                             f"{world.rank}); build the model there, or on meta")
        cfg = module_config(block, max_tokens_per_rank, 1 if world is None else world.size, config_overrides)
        layer = MoonEPMoELayer(cfg, world, device=device if world is None or on_meta else None)
        swapped = MoonEPTitanMoE(layer, block, mesh)
        swapped.train(block.training)
        if not on_meta:
            swapped.load_state_dict(block.state_dict())
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, swapped)
    return model


def titan_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's `.grad` of a swapped model under the original model's names: the swapped modules'
    in torchtitan's layout (`MoonEPTitanMoE.titan_tensor`), at EP > 1 their experts' this rank's home
    experts (DTensors of the whole `[E, ...]` on a DeviceMesh world)."""
    swapped = {name: m for name, m in model.named_modules() if isinstance(m, MoonEPTitanMoE)}
    grads = {name: p.grad for name, p in model.named_parameters()
             if not any(name.startswith(f"{prefix}.") for prefix in swapped)}
    for prefix, module in swapped.items():
        grads.update({f"{prefix}.{part.titan}": module.titan_tensor(part, grads=True) for part in module.parts
                      if part.titan != "expert_bias_E"})
    return grads
