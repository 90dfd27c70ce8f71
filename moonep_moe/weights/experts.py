"""`HomeExperts`: the routed experts a rank owns (its parameters), their gradients and checkpoint names.

Shapes use the suffix letters of DESIGN.md, "Notation". Layout (nn.Linear style, `[experts, out, in]`):
`gate_up [epn, 2F, H]` (rows [0, F) gate, [F, 2F) up, so both projections run as one GEMM) and
`down [epn, H, F]`. Only the home experts are stored: never a replicated copy of all E. Both parameters are
registered with the EP world so peers can read them (prefetch); `bind(world)` does it, and again whenever the
parameters move (a one-rank layer's `.to()`, `to_empty()`): on the meta device nothing is registered or
allocated. On CUDA, where `weights.arena` can, the home experts are mapped right before the shared slot pool,
so the grouped GEMMs read home experts and slots as one tensor without copying them. The home experts'
gradients are made fresh every step by the weight-gradient GEMMs (`new_grads` wraps them), or are each
parameter's persistent fp32 `main_grad` (`MoEConfig.expert_grad_dtype="main_grad"`); the replicas' accumulate
in the shared fp32 slot-gradient pools, which peers pull.

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
parameters' dtype (`weights.quantised.checkpoint_weight`). `state_dict()` holds the parameters, never FP8.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from moonep_moe.comm.world import EPWorld, SymmetricTensor
from moonep_moe.weights.pool import ExpertRows, allocate_home, slot_grad_pool, slot_pool
from moonep_moe.weights.quantised import FP8_DTYPE, SCALE_SUFFIX, checkpoint_scales, checkpoint_weight

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

    The parameters start on meta, unallocated: the owner calls `bind(world)` once they are to live on a real
    device, then `reset_parameters()` (or loads a checkpoint).
    """

    def __init__(self, world: EPWorld, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 num_slots: int, dtype: torch.dtype, name: str, seed: int):
        super().__init__()
        self.world, self.num_experts, self.num_slots = world, num_experts, num_slots
        self.name, self.seed = name, seed
        self.epn = num_experts // world.size
        self.first_expert = world.rank * self.epn
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        h, f, epn = hidden_size, ffn_hidden_size, self.epn
        self.gate_up = nn.Parameter(torch.empty(epn, 2 * f, h, dtype=dtype, device="meta"))
        self.down = nn.Parameter(torch.empty(epn, h, f, dtype=dtype, device="meta"))
        self.rows: tuple[ExpertRows, ExpertRows] | None = None
        """`(gate_up, down)` rows as registered with the world; None while unbound (e.g. on meta)."""
        self.slot_grads: tuple[SymmetricTensor, SymmetricTensor] | None = None

    def bind(self, world: EPWorld) -> None:
        """Move the home experts into memory of `world.device` that peers can read (the arena where it
        applies), keeping their values unless they are on meta, and register them, the slot pools and the
        slot-gradient pools with `world`. Releases an earlier binding first. Collective."""
        self.release()
        self.world = world
        f, h = self.ffn_hidden_size, self.hidden_size
        computes = []
        for name, row_shape in (("gate_up", (2 * f, h)), ("down", (h, f))):
            param = getattr(self, name)
            home, compute = allocate_home(world, self.epn, row_shape, param.dtype, self.num_slots)
            if param.device.type == "meta":  # nothing to keep, and `.data` cannot leave meta
                setattr(self, name, nn.Parameter(home, requires_grad=param.requires_grad))
            else:
                home.copy_(param.detach())
                param.data = home
            computes.append(compute)
        dtype, b = self.gate_up.dtype, self.num_slots
        self.rows = (
            ExpertRows(world.symmetric(f"{self.name}/gate_up", self.gate_up),
                       slot_pool(world, (b, 2 * f, h), dtype), computes[0]),
            ExpertRows(world.symmetric(f"{self.name}/down", self.down),
                       slot_pool(world, (b, h, f), dtype), computes[1]),
        )
        self.slot_grads = (slot_grad_pool(world, (b, 2 * f, h), dtype),
                           slot_grad_pool(world, (b, h, f), dtype))

    def release(self) -> None:
        """Forget this layer's registrations with its world (the shared pools stay); idempotent."""
        if self.rows is not None:
            for rows in self.rows:
                self.world.release(rows.home.key)
        self.rows = self.slot_grads = None

    def new_grads(self, home: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[ExpertRows, ExpertRows]:
        """This step's gradients of `(gate_up, down)` for `Buffer.reduce_grad`: home gradients `[epn, 2F, H]`
        and `[epn, H, F]` beside the shared fp32 slot gradient pools. The home gradients are local to this
        rank (peers only pull slot gradients).

        `home` ("param" mode): the fresh home gradients the weight-gradient GEMMs made in the parameters'
        dtype, kept as they are, so autograd keeps them as `.grad` without a copy and nothing of the size
        of the parameters stays allocated between steps. None ("main_grad" mode): each parameter's
        persistent `main_grad` (`persistent_main_grad`), which the weight-gradient GEMMs add into."""
        world = self.world
        weights = (self.gate_up, self.down)
        grads = []
        for i, (kind, weight, slots) in enumerate(zip(("gate_up", "down"), weights, self.slot_grads,
                                                      strict=True)):
            grad = persistent_main_grad(weight, f"experts.{kind}", world.rank) if home is None else home[i]
            peers = tuple(grad if r == world.rank else None for r in range(world.size))
            grads.append(ExpertRows(SymmetricTensor(f"{self.name}/{kind}_grad", world.rank, peers), slots))
        return grads[0], grads[1]

    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert (uniform in +-1/sqrt(fan_in)), each expert from its own
        generator seeded by (`seed`, global expert id): the same experts at every EP size. Not collective."""
        for i, expert in enumerate(self.home_experts):
            seeded_uniform_(self.gate_up[i], self.seed, f"expert{expert}.gate_up")
            seeded_uniform_(self.down[i], self.seed, f"expert{expert}.down")

    @property
    def home_experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.epn)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        f = self.ffn_hidden_size
        for i, expert in enumerate(self.home_experts):
            for name, value in (("gate_proj", self.gate_up[i, :f]), ("up_proj", self.gate_up[i, f:]),
                                ("down_proj", self.down[i])):
                destination[f"{prefix}{expert}.{name}.weight"] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        ours = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix)}
        fused = next((pair for pair in FUSED_NAMES if all(n in ours for n in pair)), None)
        for key in ours.values():
            weight_key = key.removesuffix(SCALE_SUFFIX)
            if weight_key != key and weight_key not in state_dict:
                error_msgs.append(f"{key}: block scales without their weight {weight_key}")
        with torch.no_grad():
            if fused is not None:
                self._load_fused(state_dict, [ours[n] for n in fused], error_msgs)
            else:
                self._load_per_expert(state_dict, prefix, ours, missing_keys, error_msgs)
        if strict and fused is None:
            known = {f"{e}.{n}.weight{suffix}" for e in range(self.num_experts)
                     for names in PER_EXPERT_NAMES.values() for n in names for suffix in ("", SCALE_SUFFIX)}
            unexpected_keys.extend(k for name, k in ours.items() if name not in known)

    def _load_fused(self, state_dict, keys: list[str], error_msgs: list[str]) -> None:
        """Home experts from fused `gate_up [E, 2F, H]` and `down [E, H, F]` under `keys` (unquantised ones
        also stored transposed, `[E, H, 2F]` and `[E, F, H]`); FP8 ones dequantised expert by expert with
        their scales (`checkpoint_weight`; gate's and up's stacked). Nothing is copied after an error."""
        f, h, e = self.ffn_hidden_size, self.hidden_size, self.num_experts
        sources = []
        for key, param, expected, parts in ((keys[0], self.gate_up, (e, 2 * f, h), 2),
                                            (keys[1], self.down, (e, h, f), 1)):
            shape = tuple(state_dict[key].shape)
            transposed = state_dict[key].dtype != FP8_DTYPE and expected[1] != expected[2] and \
                shape == (e, expected[2], expected[1])
            if shape != expected and not transposed:
                error_msgs.append(f"{key}: expected {list(expected)}, got {list(shape)}")
                return
            try:
                checkpoint_scales(state_dict, key, parts)
            except ValueError as error:
                error_msgs.append(str(error))
                return
            sources.append((key, param, parts, transposed))
        for key, param, parts, transposed in sources:
            for i, expert in enumerate(self.home_experts):
                value = checkpoint_weight(state_dict, key, parts, expert)
                param[i].copy_(value.T if transposed else value)

    def _load_per_expert(self, state_dict, prefix: str, ours: dict[str, str], missing_keys: list[str],
                         error_msgs: list[str]) -> None:
        """Home experts from per-expert `{e}.{gate_proj|w1, up_proj|w3, down_proj|w2}.weight` entries (FP8
        ones dequantised with their `weight_scale_inv`)."""
        f = self.ffn_hidden_size
        for i, expert in enumerate(self.home_experts):
            targets = {"gate": self.gate_up[i, :f], "up": self.gate_up[i, f:], "down": self.down[i]}
            for part, names in PER_EXPERT_NAMES.items():
                candidates = [f"{expert}.{n}.weight" for n in names]
                key = next((ours[c] for c in candidates if c in ours), None)
                if key is None:
                    missing_keys.append(f"{prefix}{candidates[0]}")
                    continue
                try:
                    value = checkpoint_weight(state_dict, key)
                except ValueError as error:
                    error_msgs.append(str(error))
                    continue
                if value.shape != targets[part].shape:
                    error_msgs.append(f"{key}: expected {list(targets[part].shape)}, got {list(value.shape)}")
                    continue
                targets[part].copy_(value)


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
