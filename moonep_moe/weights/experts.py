"""`HomeExperts`: the routed experts a rank owns (its parameters), their gradients and checkpoint names.

Shapes use the suffix letters of DESIGN.md, "Notation". Layout (nn.Linear style, `[experts, out, in]`):
`gate_up [epn, 2F, H]` (rows [0, F) gate, [F, 2F) up, so both projections run as one GEMM) and
`down [epn, H, F]`. Only the home experts are stored: never a replicated copy of all E. Both parameters are
registered with the EP world so peers can read them (prefetch); `bind(world)` does it, and again whenever the
parameters move (a one-rank layer's `.to()`, `to_empty()`): on the meta device nothing is registered or
allocated. On CUDA, where `transport.arena` can, the home experts are mapped right before the shared slot
pool, so the grouped GEMMs read home experts and slots as one tensor without copying them. The home experts'
gradients are made fresh every step by the weight-gradient GEMMs (`new_grads` wraps them), or are each
parameter's persistent fp32 `main_grad` (`MoEConfig.expert_grad_dtype="main_grad"`). Peers pull the replicas'
gradients from where the GEMMs write them: over the replicas' own slot weights in the parameters' dtype
(`"param"`: `grads_in_slots`, no pool of their own), else into the shared fp32 slot-gradient pools.

Initialisation (`reset_parameters`) draws each expert from a generator seeded with the layer's seed and
the expert's GLOBAL id (`seeded_uniform_`), so the initial model is the same at every EP size.

Checkpoints hold one entry per expert under its global id, whatever the EP size:
`{e}.gate_proj.weight [F, H]`, `{e}.up_proj.weight [F, H]`, `{e}.down_proj.weight [H, F]`. Loading also
accepts Mixtral's per-expert `w1` / `w3` / `w2` names and the fused layouts `gate_up_proj [E, 2F, H]` +
`down_proj [E, H, F]` (transformers v5) and `w13 [E, 2F, H]` + `w2 [E, H, F]` (vLLM). A rank takes its home
experts from whatever the dict holds, so a checkpoint saved at one EP size loads at any other once its
per-rank dicts are merged (`{**rank0, **rank1, ...}`).

FP8 checkpoints load too: DeepSeek-V3's released per-expert e4m3 `{e}.down_proj.weight` with fp32
`{e}.down_proj.weight_scale_inv` (one scale per 128x128 block), and transformers' fused FP8 experts
`gate_up_proj` + `gate_up_proj_scale_inv` (gate's and up's scales stacked) and `down_proj` +
`down_proj_scale_inv`: each weight times its block scales in fp32, as the format defines it, rounded to the
parameters' dtype (`fp8.checkpoint.copy_checkpoint_weight_`, chunk by chunk: no fp32 copy of a whole
expert). `state_dict()` holds the parameters, never FP8.

FP8 experts with no master (`expert_weights="fp8"`, inference): `gate_up` and `down` are then e4m3 buffers
(not parameters: nothing to train) beside fp32 block scales `gate_up_scale_inv [epn, 2F/128, ceil(H/128)]`
and `down_scale_inv [epn, ceil(H/128), ceil(F/128)]` (F a multiple of 128, so gate's and up's blocks are the
fused matrix's); slots are e4m3 with a scale pool (`slot_scale_pool`), prefetched with their scales
(`scales`), and the grouped GEMMs take them as `Fp8Weights` (`compute_weights`). Checkpoints in either FP8
layout load as stored, bytes and scales unchanged; unquantised ones are quantised on load
(`quantise_blocks`). `state_dict()` is DeepSeek-V3's per-expert format: `{e}.gate_proj.weight` e4m3 +
`{e}.gate_proj.weight_scale_inv`, ... (views of the buffers), which any layer loads, at any EP size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn

from moonep_moe.fp8.checkpoint import SCALE_SUFFIX, checkpoint_scales, copy_checkpoint_weight_
from moonep_moe.fp8.format import BLOCK, FP8_DTYPE, block_scales_shape, quantise_blocks
from moonep_moe.transport.world import EPWorld, SymmetricTensor
from moonep_moe.weights.pool import ExpertRows, allocate_home, slot_grad_pool, slot_pool, slot_scale_pool
from moonep_moe.weights.quantised import Fp8Weights

PER_EXPERT_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
FUSED_NAMES = (("gate_up_proj", "down_proj"), ("w13", "w2"))


def derived_seed(seed: int, key: str) -> int:
    """A 63-bit seed of its own for `key` (e.g. `"expert7.down"`) under the layer seed `seed`."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def seeded_uniform_(weight: torch.Tensor, seed: int, key: str) -> None:
    """nn.Linear's default init in place: uniform in +-1/sqrt(fan_in), fan_in = `weight.shape[-1]`, drawn
    from a generator of the weight's device seeded with `derived_seed(seed, key)`: the same values for the
    same (seed, key, shape, dtype, device type), whatever was drawn before (on other ranks, other layers)."""
    if weight.device.type == "meta":
        return  # nothing to initialise (as torch's own init on meta tensors)
    generator = torch.Generator(weight.device).manual_seed(derived_seed(seed, key))
    bound = weight.shape[-1] ** -0.5
    weight.uniform_(-bound, bound, generator=generator)


class HomeExperts(nn.Module):
    """This rank's `epn` routed experts of one MoE layer.

    Args:
        world: the EP world (rank r owns experts [r*epn, (r+1)*epn)).
        num_experts: E. hidden_size: H. ffn_hidden_size: F. num_slots: B prefetch slots per rank.
        dtype: parameter dtype. name: a key unique to this layer on every rank (the same on all ranks).
        seed: the layer's init seed (the same on every rank; see `reset_parameters`).
        fp8: keep the experts FP8 with no master (`MoEConfig.expert_weights="fp8"`): e4m3 buffers and their
            block scales instead of `dtype` parameters (see the module docstring).
        allow_non_finite: load checkpoint weights that hold NaN or Inf as stored
            (`MoEConfig.allow_non_finite_weights`); by default they are a load error.
        grads_in_slots: the replicas' weight gradients overwrite their own slot weights, in the parameters'
            dtype (`MoEConfig.expert_grad_dtype="param"`): backward's last read of a slot's weights (dgrad)
            comes before its weight gradient is written, and the next write into the pool (a prefetch)
            after `Buffer.reduce_grad` has read it, so no slot-gradient pool is allocated. False: a shared
            fp32 slot-gradient pool (`"main_grad"`, whose GEMMs add into it).

    The weights start on meta, unallocated: the owner calls `bind(world)` once they are to live on a real
    device, then `reset_parameters()` (or loads a checkpoint).
    """

    def __init__(self, world: EPWorld, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 num_slots: int, dtype: torch.dtype, name: str, seed: int, fp8: bool = False,
                 allow_non_finite: bool = False, grads_in_slots: bool = False):
        super().__init__()
        self.world, self.num_experts, self.num_slots = world, num_experts, num_slots
        self.name, self.seed, self.fp8, self.allow_non_finite = name, seed, fp8, allow_non_finite
        self.grads_in_slots = grads_in_slots
        self.epn = num_experts // world.size
        self.first_expert = world.rank * self.epn
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        for kind, shape in self._shapes():
            if fp8:
                self.register_buffer(kind, torch.empty(shape, dtype=FP8_DTYPE, device="meta"))
                self.register_buffer(kind + SCALE_SUFFIX, torch.empty(block_scales_shape(shape),
                                                                      dtype=torch.float32, device="meta"))
            else:
                setattr(self, kind, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")))
        self.rows: tuple[ExpertRows, ExpertRows] | None = None
        """`(gate_up, down)` rows as registered with the world; None while unbound (e.g. on meta)."""
        self.scale_rows: tuple[ExpertRows, ExpertRows] | None = None
        """FP8 experts: their block scales' rows `(gate_up, down)`, registered like `rows`; else None."""
        self.slot_grads: tuple[SymmetricTensor, SymmetricTensor] | None = None
        """`(gate_up, down)` replica gradients `[B, out, in]`: the slot pools themselves (`grads_in_slots`) or
        the shared fp32 slot-gradient pools; None while unbound and for FP8 experts."""
        self._registered: dict[str, torch.Tensor] = {}
        """Name -> the memory `bind` registered for that parameter or buffer (an alias of it): what peers read
        and the arena's `compute` view joins (`follow_storage_swaps`)."""

    def _shapes(self) -> tuple[tuple[str, tuple[int, int, int]], ...]:
        """`(name, [epn, out, in])` of the two stored projections."""
        h, f, epn = self.hidden_size, self.ffn_hidden_size, self.epn
        return ("gate_up", (epn, 2 * f, h)), ("down", (epn, h, f))

    def bind(self, world: EPWorld) -> None:
        """Move the home experts into memory of `world.device` that peers can read (the arena where it
        applies), keeping their values unless they are on meta, and register them, the slot pools and the
        slot-gradient pools with `world`. Releases an earlier binding first. Collective."""
        self.release()
        self.world = world
        b, rows, scale_rows = self.num_slots, [], []
        for kind, shape in self._shapes():
            dtype = getattr(self, kind).dtype
            home, compute = allocate_home(world, self.epn, shape[1:], dtype, b)
            rows.append(self._register(kind, home, slot_pool(world, (b, *shape[1:]), dtype), compute))
            if self.fp8:
                scales = getattr(self, kind + SCALE_SUFFIX)
                home = torch.empty(scales.shape, dtype=scales.dtype, device=world.device)
                slots = slot_scale_pool(world, (b, *scales.shape[1:]))
                scale_rows.append(self._register(kind + SCALE_SUFFIX, home, slots))
        self.rows = (rows[0], rows[1])
        if self.fp8:
            self.scale_rows = (scale_rows[0], scale_rows[1])
        elif self.grads_in_slots:
            self.slot_grads = (rows[0].slots, rows[1].slots)
        else:
            self.slot_grads = (slot_grad_pool(world, rows[0].slots.local.shape, dtype),
                               slot_grad_pool(world, rows[1].slots.local.shape, dtype))

    def _register(self, name: str, home: torch.Tensor, slots: SymmetricTensor,
                  compute: torch.Tensor | None = None) -> ExpertRows:
        """Make `home` the storage of the parameter or buffer `name` (keeping its values unless they are on
        meta) and register it with the world, beside its `slots` (and the arena's `compute` view)."""
        current = getattr(self, name)
        if current.device.type == "meta":  # nothing to keep, and `.data` cannot leave meta
            value = nn.Parameter(home, current.requires_grad) if isinstance(current, nn.Parameter) else home
            setattr(self, name, value)
        else:
            home.copy_(current.detach())
            current.data = home
        rows = ExpertRows(self.world.symmetric(f"{self.name}/{name}", getattr(self, name)), slots, compute)
        self._registered[name] = getattr(self, name).detach()  # after `symmetric`, which may move it
        return rows

    def release(self) -> None:
        """Forget this layer's registrations with its world (the shared pools stay); idempotent."""
        for rows in (self.rows or ()) + (self.scale_rows or ()):
            self.world.release(rows.home.key)
        self.rows = self.scale_rows = self.slot_grads = None
        self._registered = {}

    @torch.no_grad()
    def follow_storage_swaps(self) -> None:
        """Put back into its registered memory any home-expert weight whose storage was swapped on its device
        since `bind` (`param.data = t`, a new Parameter or buffer set in its place): its values are copied
        there and it is re-pointed at it (it no longer aliases `t`). That memory is what peers read (the
        threads world holds the registered tensor, the symmetric world maps it) and what the arena's
        `compute` view joins with the slots, so a swap left in place would run the experts' old values on
        this rank's GEMMs or its peers' replicas. A move to another device goes through the layer's `.to()`
        (which binds again). Not collective; a pointer compare per weight, a copy only after a swap.

        Raises:
            ValueError naming the weight and the rank where it now has another device, shape or dtype.
        """
        for name, memory in self._registered.items():
            current = getattr(self, name)
            if current.data_ptr() == memory.data_ptr() and current.stride() == memory.stride():
                continue
            if (current.device, current.shape, current.dtype) != (memory.device, memory.shape, memory.dtype):
                raise ValueError(
                    f"experts.{name} on rank {self.world.rank} was replaced by a {current.dtype} "
                    f"{list(current.shape)} tensor on {current.device}; it must stay {memory.dtype} "
                    f"{list(memory.shape)} on {memory.device} (move the layer with .to(), which binds it "
                    "again)")
            memory.copy_(current)
            current.data = memory

    @property
    def scales(self) -> tuple[ExpertRows, None, ExpertRows] | None:
        """`Buffer.prefetch_weight`'s `scales` for `(gate_up, None, down)`; None for unquantised experts."""
        return None if self.scale_rows is None else (self.scale_rows[0], None, self.scale_rows[1])

    def compute_weights(self, joined: bool) -> tuple[tuple[torch.Tensor, ...] | Fp8Weights, ...]:
        """`(gate_up, down)` weights of this rank's compute groups (home experts, then slots) for a grouped
        GEMM: `ExpertRows.compute_weights(joined)` of each, or for FP8 experts `Fp8Weights` of the e4m3 rows
        (joined where the arena joins them: the backend takes them as they are) and of their scales."""
        if self.scale_rows is None:
            return tuple(rows.compute_weights(joined) for rows in self.rows)
        return tuple(Fp8Weights(rows.compute_weights(), scales.compute_weights())
                     for rows, scales in zip(self.rows, self.scale_rows, strict=True))

    def main_grads(self, trains: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """"main_grad" mode: the persistent `main_grad` of `gate_up` and `down` (`persistent_main_grad`),
        which the weight-gradient GEMMs add into; None for a projection that `trains` says is frozen (none
        is allocated for it)."""
        return tuple(persistent_main_grad(weight, f"experts.{kind}", self.world.rank) if train else None
                     for kind, weight, train in zip(("gate_up", "down"), (self.gate_up, self.down), trains,
                                                    strict=True))

    def new_grads(self, home: tuple[torch.Tensor | None, torch.Tensor | None]
                  ) -> tuple[ExpertRows | None, ExpertRows | None]:
        """This step's gradients of `(gate_up, down)` for `Buffer.reduce_grad`: each home gradient
        (`[epn, 2F, H]`, `[epn, H, F]`) beside its replicas' (`slot_grads`); None where `home` is None
        (a frozen projection). The home gradients are local to this rank (peers only pull slot gradients):
        in "param" mode the fresh ones the weight-gradient GEMMs made in the parameters' dtype, kept as they
        are, so autograd keeps them as `.grad` without a copy and nothing of the size of the parameters stays
        allocated between steps; in "main_grad" mode the persistent `main_grads`."""
        world = self.world
        grads = []
        for kind, grad, slots in zip(("gate_up", "down"), home, self.slot_grads, strict=True):
            peers = tuple(grad if r == world.rank else None for r in range(world.size))
            grads.append(None if grad is None else
                         ExpertRows(SymmetricTensor(f"{self.name}/{kind}_grad", world.rank, peers), slots))
        return grads[0], grads[1]

    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert (uniform in +-1/sqrt(fan_in)), each expert from its own
        generator seeded by (`seed`, global expert id): the same experts at every EP size. FP8 experts draw
        in fp32 and are quantised (`quantise_blocks`). Not collective; nothing to do on meta."""
        if self.gate_up.device.type == "meta":
            return
        for i, expert in enumerate(self.home_experts):
            for kind, shape in self._shapes():
                key = f"expert{expert}.{kind}"
                if not self.fp8:
                    seeded_uniform_(getattr(self, kind)[i], self.seed, key)
                    continue
                drawn = torch.empty(shape[1:], dtype=torch.float32, device=self.gate_up.device)
                seeded_uniform_(drawn, self.seed, key)
                self._store(kind, i, 0, shape[1], {key: drawn}, key)

    @property
    def home_experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.epn)

    def _regions(self) -> dict[str, tuple[str, int, int]]:
        """Where one expert's projections are stored: `{part: (gate_up | down, first row, end row)}`."""
        f, h = self.ffn_hidden_size, self.hidden_size
        return {"gate": ("gate_up", 0, f), "up": ("gate_up", f, 2 * f), "down": ("down", 0, h)}

    def _views(self, kind: str, i: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert i's rows [start, stop) of `kind` and, for FP8 experts, the rows of their block scales."""
        weight = getattr(self, kind)[i, start:stop]
        if not self.fp8:
            return weight, None
        return weight, getattr(self, kind + SCALE_SUFFIX)[i, start // BLOCK:-(-stop // BLOCK)]

    def _store(self, kind: str, i: int, start: int, stop: int, state_dict, key: str, parts: int = 1,
               index=..., transposed: bool = False) -> None:
        """Expert i's rows [start, stop) of `kind` from `state_dict[key][index]` (transposed if so stored):
        masters take the checkpoint's values (FP8 ones dequantised in bounded chunks,
        `copy_checkpoint_weight_`); FP8 experts take an FP8 weight's bytes and scales as stored, and quantise
        any other (`quantise_blocks`). Raises as `checkpoint_scales`."""
        weight, scales = self._views(kind, i, start, stop)
        if scales is None:
            copy_checkpoint_weight_(weight.T if transposed else weight, state_dict, key, parts, index)
            return
        stored_scales = checkpoint_scales(state_dict, key, parts)
        value = state_dict[key][index].to(weight.device)
        if stored_scales is None:
            q, stored = quantise_blocks((value.T if transposed else value)[None])
            value, stored_scales, index = q[0], stored[0], ...
        weight.copy_(value)
        scales.copy_(stored_scales[index])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for expert_i, expert in enumerate(self.home_experts):
            for part, (kind, start, stop) in self._regions().items():
                key = f"{prefix}{expert}.{PER_EXPERT_NAMES[part][0]}.weight"
                for suffix, value in zip(("", SCALE_SUFFIX), self._views(kind, expert_i, start, stop),
                                         strict=True):
                    if value is not None:
                        destination[key + suffix] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        ours = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix)}
        fused = next((pair for pair in FUSED_NAMES if all(n in ours for n in pair)), None)
        for key in ours.values():
            weight_key = key.removesuffix(SCALE_SUFFIX)
            if weight_key != key and weight_key not in state_dict:
                error_msgs.append(self._on_rank(f"{key}: block scales without their weight {weight_key}"))
        with torch.no_grad():
            if fused is not None:
                self.load_fused(state_dict, [ours[n] for n in fused], error_msgs)
            else:
                self._load_per_expert(state_dict, prefix, ours, missing_keys, error_msgs)
        if strict and fused is None:
            known = {f"{e}.{n}.weight{suffix}" for e in range(self.num_experts)
                     for names in PER_EXPERT_NAMES.values() for n in names for suffix in ("", SCALE_SUFFIX)}
            unexpected_keys.extend(k for name, k in ours.items() if name not in known)

    @torch.no_grad()
    def load_fused(self, state_dict, keys: Sequence[str], error_msgs: list[str]) -> None:
        """Home experts from fused `gate_up [E, 2F, H]` and `down [E, H, F]` under `keys` (unquantised ones
        also stored transposed, `[E, H, 2F]` and `[E, F, H]`), expert by expert (`_store`; FP8 ones with
        gate's and up's scales stacked under `key + SCALE_SUFFIX`). Errors are appended to `error_msgs`,
        naming the key; nothing is copied after one."""
        f, h, e = self.ffn_hidden_size, self.hidden_size, self.num_experts
        sources = []
        for key, kind, expected, parts in ((keys[0], "gate_up", (e, 2 * f, h), 2),
                                           (keys[1], "down", (e, h, f), 1)):
            shape = tuple(state_dict[key].shape)
            transposed = state_dict[key].dtype != FP8_DTYPE and expected[1] != expected[2] and \
                shape == (e, expected[2], expected[1])
            if shape != expected and not transposed:
                error_msgs.append(self._on_rank(f"{key}: expected {list(expected)}, got {list(shape)}"))
                return
            try:
                checkpoint_scales(state_dict, key, parts)
            except ValueError as error:
                error_msgs.append(self._on_rank(str(error)))
                return
            for expert in self.home_experts:
                if (error := self._non_finite(state_dict[key][expert], key, expert)) is not None:
                    error_msgs.append(error)
                    return
            sources.append((key, kind, expected[1], parts, transposed))
        for key, kind, rows, parts, transposed in sources:
            for i, expert in enumerate(self.home_experts):
                self._store(kind, i, 0, rows, state_dict, key, parts, expert, transposed)

    def _load_per_expert(self, state_dict, prefix: str, ours: dict[str, str], missing_keys: list[str],
                         error_msgs: list[str]) -> None:
        """Home experts from per-expert `{e}.{gate_proj|w1, up_proj|w3, down_proj|w2}.weight` entries (FP8
        ones with their `weight_scale_inv`), each stored by `_store`."""
        for i, expert in enumerate(self.home_experts):
            for part, names in PER_EXPERT_NAMES.items():
                kind, start, stop = self._regions()[part]
                candidates = [f"{expert}.{n}.weight" for n in names]
                key = next((ours[c] for c in candidates if c in ours), None)
                if key is None:
                    missing_keys.append(f"{prefix}{candidates[0]}")
                    continue
                try:
                    checkpoint_scales(state_dict, key)
                except ValueError as error:
                    error_msgs.append(self._on_rank(str(error)))
                    continue
                expected = self._views(kind, i, start, stop)[0].shape
                if state_dict[key].shape != expected:
                    error_msgs.append(self._on_rank(f"{key}: expected {list(expected)}, got "
                                                    f"{list(state_dict[key].shape)}"))
                    continue
                if (error := self._non_finite(state_dict[key], key, expert)) is not None:
                    error_msgs.append(error)
                    continue
                self._store(kind, i, start, stop, state_dict, key)

    def _on_rank(self, message: str) -> str:
        """A load error as reported: `message` and this rank (each rank loads its own home experts, so the
        rank that found the error names it)."""
        return f"{message} (rank {self.world.rank})"

    def _non_finite(self, value: torch.Tensor, key: str, expert: int) -> str | None:
        """The load error for expert `expert`'s weights `value` (the checkpoint's `key`, as stored) when they
        hold NaN or Inf and `allow_non_finite` is off, else None. One host read: at load only."""
        if self.allow_non_finite or bool(torch.isfinite(value.float() if value.dtype == FP8_DTYPE
                                                        else value).all()):
            return None
        return (f"{key}: expert {expert}'s weights hold NaN or Inf (rank {self.world.rank}); "
                "MoEConfig.allow_non_finite_weights=True loads them as stored")


def persistent_main_grad(weight: nn.Parameter, name: str, rank: int) -> torch.Tensor:
    """`weight.main_grad`: fp32 (float64 for float64 weights), `weight`'s shape and device, contiguous;
    allocated zero on first use, or the one already attached (e.g. a view of a contiguous grad buffer).

    Raises:
        ValueError naming `name` and `rank` when an attached `main_grad` has another dtype, shape or device.
    """
    dtype = torch.promote_types(weight.dtype, torch.float32)
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        grad = weight.main_grad = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
    elif (grad.dtype, grad.shape, grad.device) != (dtype, weight.shape, weight.device) or \
            not grad.is_contiguous():
        raise ValueError(f"{name}.main_grad on rank {rank} must be a contiguous {dtype} tensor of shape "
                         f"{list(weight.shape)} on {weight.device}, got {grad.dtype} {list(grad.shape)} on "
                         f"{grad.device}")
    return grad


def main_grad_added(weight: nn.Parameter) -> torch.Tensor | None:
    """What autograd receives for `weight` ("main_grad" mode) once its gradient was added into `main_grad`:
    None, or for a parameter that carries `grad_added_to_main_grad` (Megatron-Core's grad-buffer protocol:
    its DDP puts the flag on every parameter whose `main_grad` is a view of its grad buffer) the flag set
    True and a placeholder gradient of `weight`'s shape and dtype. The placeholder makes autograd run the
    parameter's gradient accumulation, so the DDP's hook there fires (it marks the buffer's bucket ready)
    and, seeing the flag, leaves `main_grad` alone and drops `.grad`. As in Megatron-Core the placeholder is
    uninitialised unless `weight.zero_out_wgrad` asks for zeros: the gradient is `main_grad`, never `.grad`.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    fill = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return fill(weight.shape, dtype=weight.dtype, device=weight.device)


@torch.no_grad()
def zero_main_grad_(weight: nn.Parameter) -> None:
    """Zero `weight.main_grad` in place where it is allocated (a grad buffer holding it as a view sees the
    zeros; a new tensor would leave the buffer holding the old sums), and clear `grad_added_to_main_grad`
    where the parameter carries it, as Megatron-Core's DDP does when it zeroes its grad buffers."""
    if getattr(weight, "main_grad", None) is not None:
        weight.main_grad.zero_()
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = False
