"""`ExpertLayout`: a model's routed-expert weights laid out for one EP rank of an inference engine.

Shapes use the suffix letters of DESIGN.md, "Notation" (``x``: this rank's home experts where E-sized
tensors appear too); I is the expert FFN size H' (``f``), as inference engines name it.

Engines load expert weights as `w13 [E, 2I, H]` (gate rows [0, I), up rows [I, 2I)) and `w2 [E, H, I]` (vLLM,
SGLang; transformers v5 calls them `gate_up_proj` / `down_proj`), or one `gate/up/down` triple per expert.
`ExpertLayout.from_fused` / `ExpertLayout.from_experts` turn either into this rank's `ExpertRows` (the form
`Buffer.prefetch_weight` takes):

- home experts `[epn, 2I, H]` and `[epn, H, I]`: a copy of this rank's slice only, registered with the EP
  world (symmetric memory where the world has it) so peers can prefetch from it;
- slots `[B, 2I, H]` and `[B, H, I]`: the process-global `slot_pool`, shared by every layer of that shape.

FP8 experts (DeepSeek-V3's checkpoint format: e4m3 `weight` + fp32 `weight_scale_inv`, one per 128x128
block, `fp8.format`) stay FP8: `from_fused(..., scales=(w13_scales, w2_scales))` registers the scales
beside the weights (home scales symmetric, slot scales from `slot_scale_pool`), and prefetch moves both.

So a rank holds at most `epn + B` experts per projection, never all E (unlike a replicated layout). Nothing
here allocates gradients: a layout is for inference. Training uses `HomeExperts` (same home/slot layout,
plus fp32 gradients and per-expert checkpoint names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moonep_moe.fp8.format import FP8_DTYPE, block_scales_shape
from moonep_moe.transport.world import EPWorld
from moonep_moe.weights.pool import ExpertRows, slot_pool, slot_scale_pool

ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""`expert -> (gate [I, H], up [I, H], down [H, I])` for a global expert id (called for home experts only)."""


@dataclass(frozen=True)
class ExpertLayout:
    """This rank's routed experts of one layer: `gate_up` and `down` as `ExpertRows` (home + slots).

    Attributes:
        gate_up: home `[epn, 2I, H]` (symmetric), slots `[B, 2I, H]` (process-global pool).
        down: home `[epn, H, I]` (symmetric), slots `[B, H, I]` (process-global pool).
        local_expert_start: the first home expert (`rank * epn`); num_experts: E.
        gate_up_scales, down_scales: FP8 experts' fp32 block scales, home `[epn, ceil(2I/128), ceil(H/128)]`
            and `[epn, ceil(H/128), ceil(I/128)]` (symmetric), slots `[B, ...]`; None for unquantised ones.
    """

    gate_up: ExpertRows
    down: ExpertRows
    local_expert_start: int
    num_experts: int
    gate_up_scales: ExpertRows | None = None
    down_scales: ExpertRows | None = None

    @property
    def scales(self) -> tuple[ExpertRows, None, ExpertRows] | None:
        """`Buffer.prefetch_weight`'s `scales` for (gate_up, None, down): None for unquantised experts."""
        return None if self.gate_up_scales is None else (self.gate_up_scales, None, self.down_scales)

    @property
    def num_local_experts(self) -> int:
        """epn: home experts on this rank."""
        return self.gate_up.home.local.shape[0]

    @property
    def num_slots(self) -> int:
        """B: prefetch slots on this rank."""
        return self.gate_up.slots.local.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of expert weights on this rank: home experts plus the (shared) slot pool, and scales."""
        parts = (self.gate_up, self.down, self.gate_up_scales, self.down_scales)
        return sum(rows.home.local.nbytes + rows.slots.local.nbytes for rows in parts if rows is not None)

    @classmethod
    def from_fused(cls, world: EPWorld, w13_e2fh: torch.Tensor, w2_ehf: torch.Tensor, *, num_slots: int,
                   name: str, dtype: torch.dtype | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> ExpertLayout:
        """Collective. From the whole group's `w13 [E, 2I, H]` and `w2 [E, H, I]` (on any device, e.g. a CPU
        or memory-mapped checkpoint): copies only this rank's `epn` experts to `world.device`.

        Args:
            num_slots: B prefetch slots per rank. name: a key unique to this layer, the same on every rank.
            dtype: the experts' dtype on the device (default: the given tensors'); FP8 experts stay FP8.
            scales: for FP8 (`float8_e4m3fn`) experts, their fp32 block scales `(w13_scales [E, ceil(2I/128),
                ceil(H/128)], w2_scales [E, ceil(H/128), ceil(I/128)])` (a checkpoint's `weight_scale_inv`,
                gate's and up's joined like the weights); None for unquantised experts.
        """
        if w13_e2fh.dim() != 3 or w2_ehf.dim() != 3 or w13_e2fh.shape[0] != w2_ehf.shape[0]:
            raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I] with the same E, got "
                             f"{list(w13_e2fh.shape)} and {list(w2_ehf.shape)}")
        num_experts, two_f, h = w13_e2fh.shape
        if two_f % 2 or tuple(w2_ehf.shape[1:]) != (h, two_f // 2):
            raise ValueError(f"w2 must be [E, H={h}, I={two_f // 2}] for w13 {list(w13_e2fh.shape)}, got "
                             f"{list(w2_ehf.shape)}")
        start, epn = _home_range(world, num_experts)
        layout = cls._register(world, w13_e2fh[start:start + epn], w2_ehf[start:start + epn], start,
                               num_experts, num_slots, name, dtype or w13_e2fh.dtype)
        if scales is None:
            return layout
        _check_scales(w13_e2fh, w2_ehf, scales, dtype)
        rows = [ExpertRows(world.symmetric(f"{name}/{part}_scales",
                                           s[start:start + epn].to(world.device, torch.float32, copy=True)
                                           .contiguous()),
                           slot_scale_pool(world, (num_slots, *s.shape[1:])))
                for part, s in (("w13", scales[0]), ("w2", scales[1]))]
        return replace(layout, gate_up_scales=rows[0], down_scales=rows[1])

    @classmethod
    def from_experts(cls, world: EPWorld, expert_weights: ExpertWeights, num_experts: int, *, num_slots: int,
                     name: str, dtype: torch.dtype) -> ExpertLayout:
        """Collective. From per-expert weights: `expert_weights(e)` gives `(gate [I, H], up [I, H],
        down [H, I])` and is called for this rank's home experts only (so a lazy loader reads its slice)."""
        start, epn = _home_range(world, num_experts)
        triples = [expert_weights(e) for e in range(start, start + epn)]
        w13_x2fh = torch.stack([torch.cat([gate, up]) for gate, up, _ in triples])
        w2_xhf = torch.stack([down for _, _, down in triples])
        return cls._register(world, w13_x2fh, w2_xhf, start, num_experts, num_slots, name, dtype)

    @classmethod
    def _register(cls, world: EPWorld, home_w13_x2fh: torch.Tensor, home_w2_xhf: torch.Tensor, start: int,
                  num_experts: int, num_slots: int, name: str, dtype: torch.dtype) -> ExpertLayout:
        if not isinstance(num_slots, int) or not 0 <= num_slots <= num_experts - home_w13_x2fh.shape[0]:
            raise ValueError(f"num_slots must be an int in [0, E - E/R = "
                             f"{num_experts - home_w13_x2fh.shape[0]}], got {num_slots!r}")
        rows = []
        for part, home in (("w13", home_w13_x2fh), ("w2", home_w2_xhf)):
            # an owned copy on the device: the full checkpoint tensor can be freed
            local = home.to(device=world.device, dtype=dtype, copy=True).contiguous()
            rows.append(ExpertRows(world.symmetric(f"{name}/{part}", local),
                                   slot_pool(world, (num_slots, *local.shape[1:]), dtype)))
        return cls(rows[0], rows[1], start, num_experts)


def _check_scales(w13_e2fh: torch.Tensor, w2_ehf: torch.Tensor, scales, dtype: torch.dtype | None) -> None:
    """`scales` are two fp32 tensors, one scale per 128x128 block of FP8 `w13` and `w2` kept FP8."""
    if not isinstance(scales, tuple | list) or len(scales) != 2:
        raise ValueError(f"scales must be (w13_scales, w2_scales), got {scales!r:.80}")
    if w13_e2fh.dtype != FP8_DTYPE or w2_ehf.dtype != FP8_DTYPE or dtype not in (None, FP8_DTYPE):
        raise ValueError(f"scales are for FP8 ({FP8_DTYPE}) experts kept FP8, got w13 {w13_e2fh.dtype}, w2 "
                         f"{w2_ehf.dtype}, dtype={dtype}")
    for name, weight, s in (("w13_scales", w13_e2fh, scales[0]), ("w2_scales", w2_ehf, scales[1])):
        expected = block_scales_shape(weight.shape)
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != expected:
            got = f"{s.dtype} {list(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"scales: {name} must be float32 {list(expected)} (one per 128x128 block), "
                             f"got {got}")


def _home_range(world: EPWorld, num_experts: int) -> tuple[int, int]:
    """`(first home expert, epn)` of this rank; E must be divisible by R."""
    if num_experts % world.size:
        raise ValueError(f"E={num_experts} experts must be divisible by the EP size R={world.size}")
    epn = num_experts // world.size
    return world.rank * epn, epn
