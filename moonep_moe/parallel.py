"""Expert parallelism beside data parallelism: one `DeviceMesh` `("dp", "ep")` places both.

Legend: W ranks in the mesh, `dp x ep`; rank (d, r) has global mesh rank `d * ep + r`, so each EP group is a
block of consecutive ranks (one NVLink domain on a GPU node). The EP group of rank (d, r) is row d of the
mesh (the "ep" dimension); the ranks holding the same home experts are column r (the "dp" dimension).

Which group reduces which gradient. Each rank's loss is the mean over its own tokens and the global loss is
the mean of the W ranks' losses (what DDP and FSDP2 assume):

- router, shared experts, everything outside the routed experts: replicated on all W ranks; reduced over all
  W ranks ("dp" x "ep", by DDP or FSDP2), scaled by 1/W (their average);
- home experts (`experts.gate_up`, `experts.down`; their `main_grad` in that mode): rank (d, r) holds experts
  `[r*epn, (r+1)*epn)`, the same for every d; summed over "dp" only (`reduce_expert_grads`), scaled by 1/W;
- replica (slot) gradients: process-global pools, added into their home experts over "ep" inside the
  layer's backward (`reduce_grad`); never parameters, so neither DDP nor FSDP2 sees them.

Why 1/W for the home experts: after the layer's backward a home expert's gradient already sums the
contributions of every token of its EP group's `ep` ranks (their tokens came to it), so the sum over "dp"
holds the gradient of the sum of all W ranks' losses, and 1/W makes it the gradient of their mean. The
field's recurring bugs are the neighbours of this rule: reducing over "ep" (adds different experts), or over
all W ranks (adds different experts too), or averaging over "dp" only (W/dp = ep times too large).

Use (every rank, under torchrun; `tests/test_parallel.py` runs it with gloo on the CPU):
1. `mesh = moe_mesh(dp, ep, "cpu")` (or a 2-D slice named "dp", "ep" of your own mesh);
2. `world = ep_world(mesh)`: the "ep" dimension's EP world; build every `MoonEPMoELayer(config, world)`;
3. `model = data_parallel(model, mesh, "ddp")` (or `"fsdp"`): replicas made identical, the non-expert
   parameters under DDP / FSDP2 over all W ranks, the home experts left out of both;
4. per step: forward + backward of every micro-batch (DDP: `model.no_sync()` for all but the last; FSDP2:
   `model.set_requires_gradient_sync(False)`), then `reduce_expert_grads(model, mesh)`, then the optimizer
   (`main_grad` mode: `p.grad = p.main_grad.to(p.dtype)` for the home experts first), and with an
   aux-loss-free expert bias, `update_expert_bias(model, mesh)`. To clip gradients, call
   `clip_grad_norm_(model, max_norm, mesh)` after `reduce_expert_grads`, not torch's (which would take each
   rank's norm over its own home experts only).

FSDP2 shards only the non-expert parameters: the home experts are registered with the EP world (peers read
them to prefetch replicas), so they stay whole on every rank; they are already split `ep` ways.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.registry import world_of_group
from moonep_moe.transport.world import EPWorld

__all__ = ["clip_grad_norm_", "data_parallel", "ep_world", "expert_parameters", "moe_layers", "moe_mesh",
           "reduce_expert_grads", "update_expert_bias"]

DP, EP = "dp", "ep"
"""The mesh dimensions' names."""


def moe_mesh(dp: int, ep: int, device_type: str = "cpu") -> DeviceMesh:
    """The `(dp, ep)` mesh over the default process group's `dp * ep` ranks, dimensions named "dp", "ep"
    (EP groups are blocks of consecutive ranks). Collective.

    A "cuda" mesh sets each rank's device to `cuda:LOCAL_RANK` (DeviceMesh does), so where a host runs more
    ranks than it has GPUs (ranks sharing a GPU, over gloo: the tests, and `train --dp` on one GPU) the mesh
    is built as a "cpu" one: its process groups are the default backend's either way, and the EP world takes
    its device from its own argument (`ep_world(..., device=)`)."""
    if device_type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
        device_type = "cpu"
    return init_device_mesh(device_type, (dp, ep), mesh_dim_names=(DP, EP))


def ep_world(mesh: DeviceMesh, kind: Literal["collective", "symmetric"] = "collective", *,
             exact_size: bool = False, device: torch.device | None = None) -> EPWorld:
    """The EP world of this rank's "ep" dimension of `mesh`: `collective_world` of its process group (NCCL
    or gloo; `exact_size` as there), or `symmetric_world` (one NVLink domain) on `device` (default
    `cuda:LOCAL_RANK`). One per process and group, so every layer built on it shares its slot pools. From a
    bare process group, call `collective_world(group)` / `symmetric_world(group)` directly."""
    return world_of_group(kind, mesh_dims(mesh)[EP].get_group(), device, exact_size=exact_size)


def mesh_dims(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    """`{"dp": ..., "ep": ..., "all": ...}`: the two 1-D meshes of this rank and the flattened mesh of all
    W ranks. Raises unless `mesh` is 2-D with dimensions named "dp" and "ep"."""
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != (DP, EP):
        raise ValueError(f"mesh must be 2-D with dimensions named ({DP!r}, {EP!r}) (moe_mesh), got "
                         f"{mesh.ndim}-D with names {mesh.mesh_dim_names} (rank {dist.get_rank()})")
    return {DP: mesh[DP], EP: mesh[EP], "all": mesh._flatten(f"{DP}_{EP}")}


def moe_layers(model: nn.Module) -> list[MoonEPMoELayer]:
    """Every `MoonEPMoELayer` in `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, MoonEPMoELayer)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The home-expert parameters of every MoonEP layer of `model` (`gate_up`, `down` per layer): the
    parameters reduced over "dp" only. Everything else in `model` is replicated on every rank."""
    return [p for layer in moe_layers(model) for p in (layer.experts.gate_up, layer.experts.down)]


def world_ranks(world: EPWorld) -> list[int] | None:
    """The global ranks of `world`, in EP-rank order: its process group's; this process alone for a one-rank
    world without a process group (a threads world); None for thread-ranks of several (no mesh dimension)."""
    group = getattr(world, "group", None)
    if isinstance(group, dist.ProcessGroup):
        return dist.get_process_group_ranks(group)
    return [dist.get_rank()] if world.size == 1 else None


def check_layers(model: nn.Module, mesh: DeviceMesh) -> list[MoonEPMoELayer]:
    """`model`'s MoonEP layers; raises (naming the rank) when one was built on another EP group than the
    mesh's "ep" dimension, or when there is none. The groups are compared by their members in rank order,
    not by size (a group of the right size over other ranks, e.g. a "dp" column, would add different
    experts' gradients together) nor by object (torch 2.11 builds the mesh's groups anew, and a distinct
    group object over the same ranks in the same order is the same EP group)."""
    layers, ep, rank = moe_layers(model), mesh_dims(mesh)[EP], dist.get_rank()
    if not layers:
        raise ValueError(f"model holds no MoonEPMoELayer (rank {rank})")
    ranks = dist.get_process_group_ranks(ep.get_group())
    for layer in layers:
        members = world_ranks(layer.world)
        if members != ranks:
            built = f"{layer.world.size} thread-ranks" if members is None else f"ranks {members}"
            raise ValueError(f"a MoonEPMoELayer of model was built on an EP world of {built}, not the mesh's "
                             f"'ep' dimension (ranks {ranks}), on rank {rank}: build every layer with "
                             "MoonEPMoELayer(config, ep_world(mesh))")
    return layers


@torch.no_grad()
def sync_replicas(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make the replicas identical: home experts broadcast over "dp" from d = 0, every other parameter and
    buffer over all W ranks from mesh rank 0 (the layers' `expert_load` counts stay each EP group's own).
    Collective."""
    dims = mesh_dims(mesh)
    experts = set(expert_parameters(model))
    loads = {id(layer.expert_load) for layer in moe_layers(model)}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in loads:
            continue
        dim = dims[DP] if tensor in experts else dims["all"]
        if dim.size() > 1:
            dist.broadcast(tensor.data, group=dim.get_group(), group_src=0)


def data_parallel(model: nn.Module, mesh: DeviceMesh, strategy: Literal["ddp", "fsdp"] = "ddp", *,
                  blocks: Iterable[nn.Module] = (), **kwargs) -> nn.Module:
    """Wrap `model` (holding MoonEP layers built on `ep_world(mesh)`) for data parallelism over `mesh`.

    1. `sync_replicas`: the replicas start identical (home experts over "dp", the rest over all ranks).
    2. `"ddp"`: `DistributedDataParallel` over all W ranks, told to ignore the home experts and the layers'
       `expert_load` counts, beside whatever `model._ddp_params_and_buffers_to_ignore` already names
       (returns the DDP module). The counts are each EP group's own: DDP would otherwise broadcast rank 0's
       at construction and, with its buffer sync on (`forward_sync_buffers` / `broadcast_buffers`, the
       default), before every forward, micro-batches included. `"fsdp"`: `fully_shard` over all W ranks (the
       flattened mesh) of each of `blocks` (e.g. the transformer blocks), then of `model`, with the home
       experts as `ignored_params` (returns `model`, now an FSDP module).
    `kwargs` go to DDP / `fully_shard`. The home experts are reduced by `reduce_expert_grads` (the module
    docstring's table), which the caller runs after the last micro-batch's backward.
    """
    layers = check_layers(model, mesh)
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r} (rank {dist.get_rank()})")
    sync_replicas(model, mesh)
    everyone = mesh_dims(mesh)["all"]
    experts = set(expert_parameters(model))
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block, mesh=everyone, ignored_params=experts, **kwargs)
        fully_shard(model, mesh=everyone, ignored_params=experts, **kwargs)
        return model
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    ignored = [*getattr(model, "_ddp_params_and_buffers_to_ignore", ())]
    ignored += [names[id(t)] for t in [*experts, *(layer.expert_load for layer in layers)]]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    device = layers[0].world.device
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                               process_group=everyone.get_group(), **kwargs)


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, mesh: DeviceMesh) -> None:
    """After the backward of the step's last micro-batch, before `optimizer.step()`: every home expert's
    gradient summed over "dp" and scaled by 1/W (the module docstring says why). Collective over "dp"; works
    on the wrapped or unwrapped model. Which gradient is the layer's mode's, whatever else the parameter
    holds: `.grad` ("param"), or `main_grad` ("main_grad"), where a `.grad` may remain (a loop that sets it
    from `main_grad` for a torch optimizer and zeroes with `zero_grad(set_to_none=False)`), stale and left
    alone. Frozen home experts (`requires_grad=False`) are skipped.

    Raises:
        ValueError naming the parameter and rank when a trainable home expert has no gradient (call it
        after backward, once per step).
    """
    dims = mesh_dims(mesh)
    dp, scale = dims[DP], 1.0 / mesh.size()
    for index, layer in enumerate(check_layers(model, mesh)):
        main_grad = layer.config.expert_grad_dtype == "main_grad"
        for name in ("gate_up", "down"):
            weight = getattr(layer.experts, name)
            if not weight.requires_grad:
                continue
            grad = home_grad(layer, weight)
            if grad is None:
                raise ValueError(f"MoonEP layer {index} experts.{name} has no "
                                 f"{'main_grad' if main_grad else 'grad'} on rank {dist.get_rank()}: call "
                                 "reduce_expert_grads after backward")
            if dp.size() > 1:
                dist.all_reduce(grad, group=dp.get_group())
            grad.mul_(scale)


@torch.no_grad()
def update_expert_bias(model: nn.Module, mesh: DeviceMesh) -> None:
    """Aux-loss-free balancing over the whole mesh: each layer's `expert_load` (its EP group's counts since
    the last update, identical on the group's ranks) summed over "dp", then `layer.update_expert_bias()`, so
    the bias moves by the global loads and stays identical on all W ranks. Layers without a bias are
    skipped. Collective over "dp"."""
    dp = mesh_dims(mesh)[DP]
    for layer in check_layers(model, mesh):
        if layer.router.expert_bias is None:
            continue
        if dp.size() > 1:
            dist.all_reduce(layer.expert_load, group=dp.get_group())
        layer.update_expert_bias()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, mesh: DeviceMesh | None = None, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of the whole distributed model by their global norm, as
    `torch.nn.utils.clip_grad_norm_` does on one process holding every parameter: after the gradients are
    reduced (`reduce_expert_grads` on a mesh), before the optimizer. Returns the total norm, a 0-dim tensor
    equal on every rank.

    Every gradient counts once: the non-expert ones as their data-parallel wrapper leaves them (DDP, or
    any reduction that leaves them the same on every rank; FSDP2: DTensor shards, whose norm is reduced over
    their mesh), the home experts' (`.grad`, or `main_grad` in that mode) summed over each layer's EP world
    (each EP rank holds other experts; the ranks of a "dp" column hold the same ones, already reduced). Then
    every gradient, home experts' included, is multiplied by `max_norm / (norm + 1e-6)` where that is below
    1. `mesh`: the `(dp, ep)` mesh, whose "ep" group every layer's world must be (checked); None on thread
    ranks or one process. No host read unless `error_if_nonfinite`. Collective over the EP worlds (and the
    DTensors' mesh).

    Raises:
        ValueError naming the argument and rank for a `max_norm` or `norm_type` that is not a positive
        number, or a model without MoonEP layers; RuntimeError naming the rank with `error_if_nonfinite` when
        the norm is NaN or infinite.
    """
    from torch.distributed.tensor import DTensor

    layers = moe_layers(model) if mesh is None else check_layers(model, mesh)
    rank = dist.get_rank() if mesh is not None else layers[0].world.rank if layers else 0
    if not layers:
        raise ValueError(f"model holds no MoonEPMoELayer (rank {rank})")
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r} (rank {rank})")
    p = float(norm_type)
    homes = expert_parameters(model)
    dense = [w.grad for w in model.parameters() if w.grad is not None and not any(w is h for h in homes)]
    worlds: dict[int, tuple[EPWorld, list[torch.Tensor]]] = {}
    for layer in layers:
        grads = worlds.setdefault(id(layer.world), (layer.world, []))[1]
        grads += [g for w in (layer.experts.gate_up, layer.experts.down)
                  if (g := home_grad(layer, w)) is not None]
    expert_grads = [g for _, grads in worlds.values() for g in grads]
    device = layers[0].world.device
    sharded = [g for g in dense if isinstance(g, DTensor)]
    norms = [_total_norm([g for g in dense if not isinstance(g, DTensor)], p, device)]
    if sharded:
        norms.append(_total_norm(sharded, p, device))
    for world, grads in worlds.values():  # this rank's home experts; the world's other ranks hold the rest
        norm = _total_norm(grads, p, device)
        if world.size > 1:
            norm = torch.linalg.vector_norm(world.all_gather(norm.reshape(1)), p)
        norms.append(norm)
    total = _total_norm(norms, p, device)  # the norm of the groups' norms
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {float(total)}, so they "
                           f"cannot be clipped (rank {rank}); error_if_nonfinite=False clips them anyway")
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in dense + expert_grads:  # a DTensor's shard: every rank scales its own by the same factor
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(scale.to(local.device))
    return total


def home_grad(layer: MoonEPMoELayer, weight: nn.Parameter) -> torch.Tensor | None:
    """The gradient of `weight`, one of `layer`'s home-expert weights, in the layer's gradient mode:
    `main_grad` ("main_grad") or `.grad` ("param"); None where there is none yet."""
    main_grad = layer.config.expert_grad_dtype == "main_grad"
    return getattr(weight, "main_grad", None) if main_grad else weight.grad


def _total_norm(tensors: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """The `p`-norm of `tensors` taken as one vector (`torch.nn.utils.get_total_norm`: a norm per tensor,
    in its dtype, as torch's clipping takes them; DTensor shards' norm reduced over their mesh), in fp32 or
    wider, on `device` (0 for none)."""
    from torch.distributed.tensor import DTensor

    if not tensors:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.get_total_norm(tensors, p)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return norm.to(device, torch.promote_types(norm.dtype, torch.float32))

