"""`MoonEPMoELayer`: the MoE block of a transformer with MoonEP's exactly balanced expert parallelism.

Shapes use the suffix letters of DESIGN.md, "Notation": the caller's `T` tokens (`t`) are, inside the layer,
this rank's tokens of the step (`s`, at most S).

forward(hidden [T, H] or [batch, seq, H]):
1. router -> `topk_experts_tk`, `route_weights_tk` (ordinary autograd; its gradient arrives through the
   route weights), the local histogram and the optional aux loss;
2. `MoonEPExperts` (one autograd Function): dispatch, prefetch, grouped-GEMM SwiGLU experts, combine;
3. shared experts (dense SwiGLU, optionally gated) added to the routed output. On CUDA they run on a side
   stream while step 2 runs (`overlapped_step`, `MoEConfig.overlap_shared_experts`), in backward too.

Per-step balance statistics stay on the device (`balance_stats()` returns tensors; reading them is the only
host sync, and it is the caller's choice).

Activation checkpointing (`torch.utils.checkpoint` around a block holding the layer): the recompute in
backward routes and plans again, identically on every rank (the plan is a pure function of the gathered
histogram), while the Function's backward takes the first forward's plan (a backward `dispatch(plan=...)`
may take an earlier plan of the Buffer); gradients equal the uncheckpointed run's. The recompute leaves
`expert_load` and the recorded router logits alone (`recomputing`), so they count each forward once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import math
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.pool import layer_buffer, release_layer_buffer
from moonep_moe.config import MoEConfig
from moonep_moe.gemm.base import GemmProblem, GroupedGemm
from moonep_moe.gemm.fp8 import Fp8GroupedGemm
from moonep_moe.gemm.registry import fp8_grouped_gemm, fp8_weights_gemm, select_grouped_gemm
from moonep_moe.layers.function import ExpertsState, MoonEPExperts
from moonep_moe.layers.router import RouterOutput, TopKRouter
from moonep_moe.transport.registry import WORLDS, world_of_group
from moonep_moe.transport.threads import single_world
from moonep_moe.transport.world import EPWorld
from moonep_moe.weights.experts import HomeExperts, seeded_uniform_, zero_main_grad_


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


@functools.cache
def one_rank_world(device: torch.device) -> EPWorld:
    """This process's one-rank world on `device`, which every layer built there without a world shares (and
    with it the layers' Buffer, `MoEConfig.share_buffer`)."""
    return single_world(device)


def default_world(config: MoEConfig, device: torch.device | None = None) -> EPWorld:
    """The world a layer built without one uses: `world="threads"` -> the one-rank world on `device`
    (`one_rank_world`; default: torch's default device; only with ep_size == 1); `"collective"` -> the
    initialised default process group's `CollectiveWorld`; `"symmetric"` -> its `SymmetricWorld` (one GPU per
    rank, `cuda:LOCAL_RANK`)."""
    if WORLDS[config.world].of_group is not None:
        return world_of_group(config.world)
    if config.ep_size != 1:
        raise ValueError(f"ep_size={config.ep_size} needs a world with {config.ep_size} ranks "
                         "(e.g. moonep_moe.run_ranks, or world='symmetric' / 'collective' under "
                         "torchrun)")
    return one_rank_world(_indexed(torch.device(torch.get_default_device() if device is None else device)))


def _indexed(device: torch.device) -> torch.device:
    """`cuda` -> `cuda:<current device>` (tensors and worlds report their index); other devices as given."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def place_layer(config: MoEConfig, world: EPWorld | None, device: torch.device | str | None
                ) -> tuple[EPWorld, torch.device]:
    """A new layer's world and the device its parameters start on (`MoonEPMoELayer`'s `world`, `device`):
    device None -> `meta` under `torch.device("meta")` / `set_default_device("meta")`, else the world's
    device (the default world's: torch's default device for `world="threads"`). A device other than the
    world's or `meta` raises."""
    if device is None and torch.get_default_device().type == "meta":
        device = "meta"
    device = None if device is None else _indexed(torch.device(device))
    world = default_world(config, device) if world is None else world
    device = world.device if device is None else device
    if device.type != "meta" and device != world.device:
        raise ValueError(f"device={device} differs from the EP world's device {world.device} (rank "
                         f"{world.rank}): a layer lives on its world's device, or on meta until to_empty()")
    return world, device


def agree_on_init_seed(world: EPWorld, config: MoEConfig) -> int:
    """Collective, at construction: the layer's init seed, rank 0's draw from torch's CPU generator (so
    `torch.manual_seed` before construction makes the layer reproducible), and a check that every rank holds
    the same config (a 63-bit hash of `config.model_dump_json()`): one all-gather of two int64, read on the
    host. Raises on every rank, naming the ranks, when the configs differ.

    Every rank draws once, so the ranks' generators stay in step. Thread-ranks share one generator: rank 0
    draws before the gather, the others after it, and a barrier keeps the next layer's draw after theirs, so
    rank 0 gets the draw a one-rank run would (for the first layer after `torch.manual_seed`).
    """

    def draw() -> int:
        return int(torch.randint(0, 2**62, (), device="cpu"))

    if world.size == 1:
        return draw()
    digest = hashlib.sha256(config.model_dump_json().encode()).digest()
    mine = [int.from_bytes(digest[:8], "little") >> 1, draw() if world.rank == 0 else 0]
    gathered_r2 = world.all_gather(torch.tensor(mine, dtype=torch.int64, device=world.device)).tolist()
    if world.rank != 0:
        draw()
    world.barrier()
    hash_r = [h for h, _ in gathered_r2]
    if len(set(hash_r)) > 1:
        differ = [r for r, h in enumerate(hash_r) if h != hash_r[0]]
        raise ValueError(f"MoEConfig differs across the EP ranks: rank(s) {differ} disagree with rank 0 "
                         f"(seen on rank {world.rank}); every rank must build the layer from the same config")
    return gathered_r2[0][1]


def recomputing() -> bool:
    """True while autograd runs a backward pass on this thread: a forward that runs then is activation
    checkpointing's recompute (`torch.utils.checkpoint`, reentrant or not), whose side effects (expert loads,
    recorded router logits) the first forward already had. `torch.utils.checkpoint` asks the same
    (private) `torch._C._current_graph_task_id`."""
    return torch._C._current_graph_task_id() != -1


def routed_step(layer: MoonEPMoELayer, hidden_sh: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
    """The routed half of `MoonEPMoELayer.forward`: `[s, H]` tokens through `MoonEPExperts` as the router
    chose, then the forward's bookkeeping (the plan's loads into `expert_load`; the router logits kept with
    `record_router_logits`), which a recompute under activation checkpointing skips (`recomputing`)."""
    state = layer._state
    route_weights_sk = routing.route_weights_tk.to(state.buffer.weight_dtype)
    experts = layer.experts
    experts.follow_storage_swaps()  # before any peer reads them (prefetch) or a GEMM does
    records = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_sh, route_weights_sk, experts.gate_up, experts.down))
    out_sh = MoonEPExperts.apply(hidden_sh.contiguous(), route_weights_sk, routing.topk_experts_tk,
                                 routing.tokens_per_expert_e, experts.gate_up, experts.down, state, records)
    if not recomputing():
        with torch.no_grad():
            layer.expert_load += state.last_plan.expert_load
        if layer.record_router_logits:
            layer.last_router_logits_te = routing.logits_te
    return out_sh


def experts_step(layer: MoonEPMoELayer, hidden_sh: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
    """What `MoonEPMoELayer.forward` runs after the router: `[s, H]` tokens -> the routed experts' output as
    `routing` chose plus the shared experts' (where the layer has them), the shared experts on a side stream
    beside the routed step where `MoEConfig.overlap_shared_experts` applies (`overlapped_step`), else after
    it. Under `torch.compile` the step runs eagerly between the compiled graphs."""
    overlap = (layer.shared_experts is not None and layer.config.overlap_shared_experts
               and hidden_sh.is_cuda)
    step = overlapped_step if overlap else routed_step
    if torch.compiler.is_compiling():  # traced: the step runs eagerly between the compiled graphs
        from moonep_moe.layers.compile_break import run_eagerly
        out_sh = run_eagerly(step, layer, hidden_sh, routing)
    else:
        out_sh = step(layer, hidden_sh, routing)
    if not overlap and layer.shared_experts is not None:
        out_sh = out_sh + layer.shared_experts(hidden_sh)
    return out_sh


def shared_experts_stream(world: EPWorld) -> torch.cuda.Stream:
    """This rank's side stream for the shared experts (`overlapped_step`), shared by its layers and made on
    first use (kept in `world.globals`, as the Buffer keeps its comm stream)."""
    key = ("shared_experts_stream", world.device)
    if key not in world.globals:
        world.globals[key] = torch.cuda.Stream(world.device)
    return world.globals[key]


def overlapped_step(layer: MoonEPMoELayer, hidden_sh: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
    """`routed_step` plus the shared experts, which run on a side stream meanwhile (CUDA only): `[s, H]`
    tokens -> `[s, H]` routed + shared output, bit-identical to the serial path's.

    1. The side stream (`shared_experts_stream`) waits for the current stream's queued work: the input's
       producer and the router.
    2. The shared experts are queued on the side stream, so they compute while the current stream plans,
       dispatches and prefetches.
    3. `routed_step` (planning, dispatch, prefetch, grouped GEMMs, combine) is queued on the current stream.
    4. The current stream waits for the side stream and adds `routed + shared`, the serial path's sum.

    Backward overlaps the same way: autograd runs each op's backward on the stream its forward ran on, and
    synchronises (and records on the consumer's stream) every gradient that crosses streams: the output
    gradient going to the side stream, the shared experts' input gradient added into `hidden_sh`'s.
    The shared experts read `hidden_sh` through a view of their own, so their input-gradient terms (two
    with a gate) are summed there first and reach `hidden_sh`'s gradient as one term, beside the routed
    experts' and the router's: autograd adds those in the serial path's order up to the swap of two terms,
    which float addition does not notice (queued after the shared experts, the routed experts' backward now
    runs before theirs).
    Memory used across streams is recorded there, so the caching allocator does not hand it out early:
    `hidden_sh` (the current stream's) on the side stream, which reads it in forward and again in the shared
    experts' backward (a saved input); the shared output (the side stream's) on the current stream.
    In a CUDA graph the side stream forks from the capturing stream (1) and joins it (4; in backward,
    autograd joins its streams into the caller's). Under `torch.compile` this whole step runs eagerly
    (`compile_break.run_eagerly`): the shared experts are not compiled then.
    """
    current = torch.cuda.current_stream(hidden_sh.device)
    side = shared_experts_stream(layer.world)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        shared_sh = layer.shared_experts(hidden_sh.view_as(hidden_sh))
    hidden_sh.record_stream(side)
    out_sh = routed_step(layer, hidden_sh, routing)
    current.wait_stream(side)
    shared_sh.record_stream(current)
    return out_sh + shared_sh


def experts_gemm(config: MoEConfig, world: EPWorld) -> GroupedGemm:
    """The routed experts' grouped GEMM for ``config`` on ``world``'s device (collective where "auto" measures
    on several ranks): experts kept FP8 multiply as stored (`fp8_weights_gemm`); else the backend
    `select_grouped_gemm` picks for this rank's problem (``epn`` home groups of ``S * K / epn`` rows, where a
    balanced plan leaves nearly every row, and ``B`` slots; wgrad as the gradient mode runs it), wrapped in
    FP8 fwd and dgrad with ``precision='fp8'``."""
    h, f, k = config.hidden_size, config.ffn_hidden_size, config.top_k
    dtype, device = config.torch_dtype, world.device
    if config.expert_weights == "fp8":
        return fp8_weights_gemm(config.grouped_gemm, device, dtype, config.token_padding, world.rank)
    main_grad = config.expert_grad_dtype == "main_grad"
    epn, slots = config.experts_per_rank, config.prefetch_slots
    problem = GemmProblem(((2 * f, h), (h, f)), rows_per_group=config.max_tokens_per_rank * k // epn,
                          grad_dtype=torch.promote_types(dtype, torch.float32) if main_grad else dtype,
                          groups=(epn, slots), fresh_home_grads=not main_grad)
    gemm = select_grouped_gemm(config.grouped_gemm, device, dtype, k=math.gcd(h, f),
                               token_padding=config.token_padding, problem=problem, world=world)
    if config.precision == "fp8":  # fwd and dgrad in FP8; the backend selected above keeps wgrad
        gemm = fp8_grouped_gemm(gemm, device, dtype, config.token_padding, world.rank, config.fp8_wgrad)
    return gemm


def world_on(world: EPWorld, device: torch.device) -> EPWorld:
    """A one-rank world's counterpart on `device`: `world` itself on its own device, else a one-rank threads
    world, one per device and shared by every layer that shared `world` (kept in `world.globals`)."""
    siblings = world.globals.setdefault("worlds_by_device", {world.device: world})
    if device not in siblings:
        moved = single_world(device)
        moved.globals["worlds_by_device"] = siblings
        siblings[device] = moved
    return siblings[device]


class MoonEPMoELayer(nn.Module):
    """Drop-in MoE block. Parameters: `router.weight [E, H]`, `experts.gate_up [epn, 2H', H]`,
    `experts.down [epn, H, H']` (this rank's home experts only) and the shared experts. With
    `config.expert_weights="fp8"` the home experts are no parameters but e4m3 buffers with their block
    scales (`HomeExperts`), and the layer runs forward only (a forward that would need a gradient raises).

    Args:
        config: the layer's `MoEConfig` (validated).
        world: the EP world (any `EPWorld`), whose size must be `config.ep_size`; default from
            `config.world` (`default_world`: for `"threads"`, a one-rank world on `device`). Every rank must
            construct its layers in the same order, from the same config (checked: ranks that disagree
            raise, named).
        device: where the layer is built. Default: the world's device when a world is given (or
            `config.world` names a process world), else torch's default device (`torch.set_default_device`);
            `meta` whenever torch's default device is meta. A given world and a device other than its own
            or `meta` raise.

    Device semantics (nn.Module conventions):
    - On `meta` nothing is allocated: no comm memory (Buffer, symmetric registrations, slot pools) and no
      parameter memory. `to_empty(device=...)` then `reset_parameters()` gives a working layer equal to
      one built directly after the same `torch.manual_seed` (the torchtitan / FSDP2 pattern); the comm
      memory is allocated when the layer first reaches a real device (collective on a multi-rank world).
    - A one-rank layer moves with `.to()` / `.cuda()` / `.cpu()`, its comm memory too (its world becomes
      a one-rank world on the new device, `world_on`). A multi-rank layer is bound to its world's device:
      moving it elsewhere raises (its comm memory is registered with its peers there).
    - Dtypes are the config's (`dtype`, `router.dtype`, FP8 experts' e4m3 and fp32 scales): `.to(dtype)`,
      `.half()`, ... that would change one raise; build the layer from a config with the dtype you want.
    - Replicated parameters (router, shared experts) start identical on every rank, and home experts are
      drawn per global expert id, so the initial model is the same at every EP size (`reset_parameters`).
    - `copy.deepcopy`, `pickle` and `torch.save(layer)` raise (the comm memory belongs to the world): save
      `layer.state_dict()`, rebuild with `MoonEPMoELayer(config, world)` and `load_state_dict`.

    `forward` returns a tensor of the input's shape, or `(output, aux_loss)` when
    `config.router.aux_loss_coeff > 0`.
    """

    _serial = itertools.count()

    def __init__(self, config: MoEConfig, world: EPWorld | None = None, *,
                 device: torch.device | str | None = None):
        super().__init__()
        world, device = place_layer(config, world, device)
        if world.size != config.ep_size:
            raise ValueError(f"ep_size={config.ep_size} does not match the world's size {world.size}")
        self.init_seed = agree_on_init_seed(world, config)
        """The seed every parameter is drawn from (`reset_parameters`): rank 0's draw, on every rank."""
        self.config, self.world = config, world
        dtype = config.torch_dtype
        h, f, e, k = config.hidden_size, config.ffn_hidden_size, config.num_experts, config.top_k
        serial = world.globals.setdefault("layer_serial", itertools.count())
        shared = config.shared_experts
        with torch.device("meta"):  # unallocated, and nothing drawn from torch's generator (see below)
            self.router = TopKRouter(config.router, h, e, k)
            self.shared_experts = None
            if config.shared_width:
                self.shared_experts = SharedExperts(h, config.shared_width, shared.gate, dtype,
                                                    torch.device("meta"))
        self.experts = HomeExperts(world, e, h, f, config.prefetch_slots, dtype, name=f"moe{next(serial)}",
                                   seed=self.init_seed, fp8=config.expert_weights == "fp8",
                                   allow_non_finite=config.allow_non_finite_weights,
                                   grads_in_slots=config.expert_grad_dtype == "param")
        expert_load_e = torch.zeros(e, dtype=torch.int64, device=device)
        self.register_buffer("expert_load", expert_load_e, persistent=False)
        self.record_router_logits = False
        """When True, `forward` keeps the router's logits `[T, E]` (with their autograd graph) in
        `last_router_logits_te` until the next call, so a wrapper can return them without routing twice."""
        self.last_router_logits_te: torch.Tensor | None = None
        self.buffer: Buffer | None = None
        self._buffer_given_back = False
        self._state: ExpertsState | None = None
        if device.type != "meta":
            for module in (self.router, self.shared_experts):
                if module is not None:
                    module.to_empty(device=device)
            self._bind_comm()
        # from `init_seed` alone: built here, it equals a layer built on meta + to_empty + reset_parameters
        self.reset_parameters()

    # -- device, comm memory and init ---------------------------------------------------------------------

    def _bind_comm(self) -> None:
        """Allocate this rank's comm memory on `self.world` (collective): the home experts' registration
        (`HomeExperts.bind`), the Buffer, and the grouped GEMM chosen for the device."""
        config, world = self.config, self.world
        h, k, e, dtype = config.hidden_size, config.top_k, config.num_experts, config.torch_dtype
        self.experts.bind(world)
        # validate=False: the router's expert ids are in [-1, E) by construction, and the check is a host read
        shape = dict(token_padding=config.token_padding, dtype=dtype, replica_cost=config.replica_cost)
        if config.share_buffer:  # given back by destroy(), a move, or when the layer is garbage-collected
            self.buffer = layer_buffer(world, config.max_tokens_per_rank, h, k, e, config.prefetch_slots,
                                       **shape)
            self._buffer_share = weakref.finalize(self, release_layer_buffer, world, self.buffer)
            self._buffer_share.atexit = False  # no collective destroy while the interpreter exits
        else:
            self.buffer = Buffer(config.max_tokens_per_rank, h, k, e, config.ep_size, B=config.prefetch_slots,
                                 world=world, validate=False, **shape)
        self._buffer_given_back = False
        # experts kept FP8 have no weight gradients, so no main_grad either
        main_grad = config.expert_weights != "fp8" and config.expert_grad_dtype == "main_grad"
        self._state = ExpertsState(self.buffer, self.experts, experts_gemm(config, world), main_grad,
                                   config.fp8_dispatch, overlap_prefetch=config.overlap_prefetch,
                                   overlap_reduce_grad=config.overlap_reduce_grad)

    def _release_comm(self) -> None:
        """Give the comm memory back to the world (the Buffer's and the home experts' registrations)."""
        self._give_back_buffer()
        self.experts.release()
        self.buffer = self._state = None

    def _give_back_buffer(self) -> None:
        """Destroy the layer's own Buffer, or give its share of a shared one back (once)."""
        if self.buffer is None or self._buffer_given_back:
            return
        if self.config.share_buffer:
            self._buffer_share()
        else:
            self.buffer.destroy()
        self._buffer_given_back = True

    def _placement(self) -> tuple:
        """Where the home experts are: device and storage (a move or `to_empty` changes it)."""
        gate_up, down = self.experts.gate_up, self.experts.down
        return gate_up.device, gate_up.data_ptr(), down.data_ptr()

    def _world_after(self, fn) -> EPWorld:
        """The world this layer would have after `_apply(fn)`, found on empty probes of its dtypes before
        anything moves: raises where `fn` changes a dtype (they are the config's) or moves a multi-rank
        layer off its world's device (its comm memory is registered with its peers there)."""
        world, device = self.world, self.experts.gate_up.device
        for dtype in {t.dtype for t in itertools.chain(self.parameters(), self.experts.buffers())}:
            probe = fn(torch.empty(0, dtype=dtype, device=device))
            if probe.dtype != dtype:
                cfg = self.config
                raise ValueError(f"cannot convert MoonEPMoELayer's {dtype} parameters to {probe.dtype} "
                                 f"(rank {world.rank}): its dtypes are the config's (dtype={cfg.dtype}, "
                                 f"router.dtype={cfg.router.dtype}); build it from a config with the dtype "
                                 "you want")
        target = probe.device
        if target == world.device:
            return world
        if world.size > 1:
            raise ValueError(f"cannot move a {world.size}-rank MoonEPMoELayer to {target} (rank "
                             f"{world.rank}): it is bound to its EP world's device {world.device}, where its "
                             "comm memory is registered with its peers; build it on the device of a world "
                             "there instead")
        return world_on(world, target)

    def _apply(self, fn, recurse=True):
        """nn.Module's `.to()` / `.cuda()` / `.cpu()` / `to_empty()` / `.half()` ...: checks first where `fn`
        sends the layer (`_world_after`), then moves the parameters and, where the home experts moved (new
        device or new storage), the comm memory: released, then allocated again unless on meta."""
        world = self._world_after(fn)
        before = self._placement()
        super()._apply(fn, recurse)
        if self._placement() != before:
            self._release_comm()
            self.world = world
            if self.experts.gate_up.device.type != "meta":
                self._bind_comm()
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)initialise every parameter and buffer as at construction, from `init_seed`: the router and the
        shared experts as nn.Linear does (uniform in +-1/sqrt(fan_in)), identical on every rank; the home
        experts per global expert id (`HomeExperts.reset_parameters`); the expert bias and the expert loads
        zero. Not collective; nothing to do on meta. After `to_empty()` it gives the layer built directly."""
        seed = self.init_seed
        seeded_uniform_(self.router.weight, seed, "router.weight")
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()
        if self.shared_experts is not None:
            for name, weight in self.shared_experts.named_parameters():
                seeded_uniform_(weight, seed, f"shared_experts.{name}")
        self.experts.reset_parameters()
        self.expert_load.zero_()

    def __reduce_ex__(self, protocol):
        raise TypeError("MoonEPMoELayer cannot be pickled, deep-copied or saved whole (torch.save(layer)): "
                        "its comm memory is registered with its EP world. Save layer.state_dict() instead "
                        "and rebuild with MoonEPMoELayer(config, world) + load_state_dict()")

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None):
        """`[T, H]` or `[batch, seq, H]` with `T = batch * seq <= max_tokens_per_rank` -> the same shape (and
        the aux loss).

        `token_mask` (`[T]` or `[batch, seq]` bool, True = real token) keeps padding tokens out of routing:
        their routes are -1 (not counted, not sent, zero routed output), so padding never changes the plan of
        the real tokens.

        Under `torch.autocast` (enabled for the input's device type) the input is cast to the layer's dtype
        (`config.dtype`, whatever autocast's own dtype) and the layer runs with autocast off, as it would
        without: the router in `router.dtype`, experts and shared experts in `config.dtype`; the output is in
        `config.dtype`, the input's gradient in the input's dtype. Without autocast a dtype other than
        `config.dtype` raises.
        """
        device_type = hidden_states.device.type
        # not torch.amp.is_autocast_available: torch 2.11's dynamo cannot trace it (a graph break, and
        # fullgraph=True failed on it); meta is the one device type without autocast
        if device_type != "meta" and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return self.forward(hidden_states.to(self.config.torch_dtype), token_mask)
        cfg = self.config
        if hidden_states.dim() not in (2, 3) or hidden_states.shape[-1] != cfg.hidden_size:
            raise ValueError(f"hidden_states must be [T, {cfg.hidden_size}] or "
                             f"[batch, seq, {cfg.hidden_size}], got {list(hidden_states.shape)}")
        if hidden_states.dtype != cfg.torch_dtype:
            raise ValueError(f"hidden_states must have dtype {cfg.torch_dtype} (config.dtype), "
                             f"got {hidden_states.dtype} (under torch.autocast the layer casts it)")
        if self.buffer is None:
            raise RuntimeError(f"MoonEPMoELayer is on the meta device (rank {self.world.rank}): call "
                               "to_empty(device=...) and reset_parameters() (or load_state_dict) first")
        if self._buffer_given_back:
            raise RuntimeError(f"rank {self.world.rank}: this MoonEPMoELayer was destroyed (destroy() gave "
                               "its comm memory back); build a new one")
        if hidden_states.device != self.world.device:
            raise ValueError(f"hidden_states must be on {self.world.device} (the layer's device), "
                             f"got {hidden_states.device}")
        if cfg.expert_weights == "fp8" and torch.is_grad_enabled() and (
                hidden_states.requires_grad or any(p.requires_grad for p in self.router.parameters())):
            raise ValueError(f"expert_weights='fp8' runs forward only (rank {self.world.rank}): the FP8 "
                             "experts have no master weights to train; run under torch.no_grad() or "
                             "torch.inference_mode() (or freeze the router and the input)")
        hidden_sh = hidden_states.reshape(-1, cfg.hidden_size)
        if hidden_sh.shape[0] > cfg.max_tokens_per_rank:
            raise ValueError(f"{hidden_sh.shape[0]} tokens exceed "
                             f"max_tokens_per_rank={cfg.max_tokens_per_rank}")
        if token_mask is not None and (token_mask.shape != hidden_states.shape[:-1]
                                       or token_mask.dtype != torch.bool):
            raise ValueError(f"token_mask must be a bool tensor of shape {list(hidden_states.shape[:-1])}, "
                             f"got {token_mask.dtype} {list(token_mask.shape)}")
        routing = self.router(hidden_sh, None if token_mask is None else token_mask.reshape(-1))
        out = experts_step(self, hidden_sh, routing).view(hidden_states.shape)
        return (out, routing.aux_loss) if routing.aux_loss is not None else out

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing: move the router's expert bias using the group-wide expert loads counted
        since the last call (identical on every rank, so the bias stays replicated), then reset them."""
        self.router.update_expert_bias(self.expert_load)
        self.expert_load.zero_()

    def zero_main_grad(self) -> None:
        """`expert_grad_dtype="main_grad"`: zero the home experts' persistent `main_grad` in place (where
        allocated; a grad buffer that holds it as a view sees the zeros) and clear Megatron's
        `grad_added_to_main_grad` flag where set (`zero_main_grad_`), e.g. after each optimizer step; the
        layer never zeroes it itself."""
        for weight in (self.experts.gate_up, self.experts.down):
            zero_main_grad_(weight)

    @property
    def last_expert_load(self) -> torch.Tensor | None:
        """`[E]` int32: the routes the last forward sent to each expert, in the whole EP group (the gathered
        histogram's sum), identical on every rank; None before the first forward. Unlike `expert_load`, an
        activation-checkpointing recompute counts again: it is the last forward's plan, whichever it was.
        The plan's own device tensor: no host sync, and a later forward makes a new plan."""
        plan = None if self._state is None else self._state.last_plan
        return None if plan is None else plan.expert_load

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
        """Release the layer's comm memory: its own Buffer, or its share of the Buffer its shape shares
        (`MoEConfig.share_buffer`; the last layer to give it back destroys it). The layer cannot run
        afterwards."""
        self._give_back_buffer()


@contextlib.contextmanager
def fixed_expert_weights(model: nn.Module) -> Iterator[None]:
    """The FP8 weight copies of `model`'s `precision="fp8"` MoonEP layers (the model itself may be one) held
    for the block only: freed when it ends. Run a step's micro-batches inside and `optimizer.step()` after it,
    so the optimizer runs without them::

        with fixed_expert_weights(model):
            for micro_batch in micro_batches:
                loss_fn(model(micro_batch)).backward()
        optimizer.step()

    Inside and outside a block, an fp8 layer casts its home experts' weights once per version, in each
    orientation (`Fp8WeightCache`: again after an in-place change or any optimizer step), so gradient
    accumulation needs no block to cast once per optimizer step; the copies, as many bytes as the bf16
    home weights per layer (the slots' in one scratch where the arena maps it, else with each layer's),
    otherwise stay between steps. `bf16` layers are unaffected.
    Blocks nest; the outermost one frees the copies.
    """
    caches = [layer._state.gemm.weights for layer in model.modules()
              if isinstance(layer, MoonEPMoELayer) and layer._state is not None
              and isinstance(layer._state.gemm, Fp8GroupedGemm)]
    for cache in caches:
        cache.fixed += 1
    try:
        yield
    finally:
        for cache in caches:
            cache.fixed -= 1
            if not cache.fixed:
                cache.release()
