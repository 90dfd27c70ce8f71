"""`MoonEPCommPlan`, one rank's plan of one step, and the `dst` encoding every part of the comm core reads.

A leaf module (it imports only torch): the torch planners (`plan.reference`, `plan.device`), the Triton
planner (`plan.triton`), the Buffer and the tests all depend on it, and it on none of them. The planners build
their plan with the one constructor, `MoonEPCommPlan.empty`, and write its fields in place.

Notation and suffixes: DESIGN.md, "Notation".
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

NO_ROUTE = -(2**31)
"""`dst` of an invalid route (expert -1): not sent, contributes zero."""


def _field_shapes(N: int, R: int, E: int, B: int, NvS: int) -> dict[str, tuple[int, ...]]:
    """Every tensor field of a plan and its shape, in allocation order (the dup tables last and adjacent;
    empty with one rank, whose plans hold no duplicates)."""
    dups = NvS if R > 1 else 0
    return dict(dst=(N,), experts_to_copy=(R, B), cu_seqlens=(E + B,), zero_fill_ranges=(E + B, 2),
                remote_stats=(2,), rank_load=(R,), home_load=(R,), expert_load=(E,), slots_used=(R,),
                compute_groups=(3, E // R + B), dup_groups=(dups, 3), dup_loffs=(dups,), dup_counts=(2,))


@dataclass(frozen=True)
class MoonEPCommPlan:
    """Everything a step needs to move rows; identical on every rank except the rank-local fields.

    All tensors are int32, contiguous, on the rank's device. The dup tables describe this rank's *received*
    rows and are filled by `Buffer.dispatch` (the planners leave them zero).

    Attributes:
        dst: `[S*K]` per local route: `d * NvS + row`, `-(d * NvS + row) - 1` for a later route of the same
            token to the same rank d, `NO_ROUTE` for an invalid route.
        experts_to_copy: `[R, B]` global expert held by each rank's slot, -1 for an unused slot.
        cu_seqlens: `[E+B]` this rank's padded group end offsets (groups: E experts, then B slots).
        zero_fill_ranges: `[E+B, 2]` this rank's (first padding row, padding rows) per group.
        remote_stats: `[2]` this rank's (valid routes computed on other ranks, payload rows sent to other
            ranks after deduplication).
        rank_load: `[R]` routes computed by each rank (telemetry; equal up to one when balanced).
        home_load: `[R]` routes to each rank's home experts: the load of plain expert parallelism.
        expert_load: `[E]` valid routes to each expert in the whole group (the gathered histogram's sum).
        slots_used: `[R]` slots holding a replica on each rank.
        compute_groups: `[3, epn+B]` this rank's compute groups (its epn home experts, then its B slots):
            row 0 each group's padded end row (`cu_seqlens` of those groups), row 1 its routes (padding
            excluded), row 2 its global expert (-1 for an unused slot). What an engine's expert runner
            reads (`MoECommunicator`'s `DispatchOutput`), written by the planner.
        dup_groups: `[NvS, 3]` rows `(primary row, first index into dup_loffs, duplicates)`; the first
            `dup_counts[0]` are used, sorted by primary row. `[0, 3]` with one rank (R = 1: every route is
            primary, so no table is zeroed or read per step).
        dup_loffs: `[NvS]` duplicate rows; the first `dup_counts[1]` are used (`[0]` with one rank).
        dup_counts: `[2]` (duplicate groups, duplicate rows) received by this rank.
        num_routes, num_ranks, num_experts, num_slots, rows_per_rank, top_k: the scalars N, R, E, B, NvS, K.
        rank: the rank this plan belongs to; owner: id of the Buffer that made it (None: a bare plan).
        step: which forward dispatch of that Buffer made it (1, 2, ...; None: a bare plan). Host int: the
            Buffer checks with it, without a device read, that an operation gets the plan of its latest
            dispatch.
    """

    dst: torch.Tensor
    experts_to_copy: torch.Tensor
    cu_seqlens: torch.Tensor
    zero_fill_ranges: torch.Tensor
    remote_stats: torch.Tensor
    rank_load: torch.Tensor
    home_load: torch.Tensor
    expert_load: torch.Tensor
    slots_used: torch.Tensor
    compute_groups: torch.Tensor
    dup_groups: torch.Tensor
    dup_loffs: torch.Tensor
    dup_counts: torch.Tensor
    num_routes: int
    num_ranks: int
    num_experts: int
    num_slots: int
    rows_per_rank: int
    top_k: int
    rank: int
    owner: int | None = None
    step: int | None = None

    N = property(lambda self: self.num_routes)
    R = property(lambda self: self.num_ranks)
    E = property(lambda self: self.num_experts)
    B = property(lambda self: self.num_slots)
    NvS = property(lambda self: self.rows_per_rank)
    K = property(lambda self: self.top_k)

    @classmethod
    def empty(cls, *, num_tokens: int, top_k: int, num_ranks: int, num_experts: int, num_slots: int,
              rows_per_rank: int, rank: int, device: torch.device | str,
              owner: int | None = None) -> MoonEPCommPlan:
        """The one constructor: a plan whose tensor fields are uninitialised int32 views of one allocation
        (no kernel runs), for a planner to write in place. The dup tables are adjacent, last: `dup_tables`
        is their one flat view, which a planner zeroes."""
        shapes = _field_shapes(num_tokens * top_k, num_ranks, num_experts, num_slots, rows_per_rank)
        sizes = [torch.Size(shape).numel() for shape in shapes.values()]
        flat = torch.empty(sum(sizes), dtype=torch.int32, device=device)
        views = {name: part.view(shape) for (name, shape), part in zip(shapes.items(), flat.split(sizes),
                                                                      strict=True)}
        return cls(**views, num_routes=num_tokens * top_k, num_ranks=num_ranks, num_experts=num_experts,
                   num_slots=num_slots, rows_per_rank=rows_per_rank, top_k=top_k, rank=rank, owner=owner)

    @property
    def dup_tables(self) -> torch.Tensor:
        """`[NvS*3 + NvS + 2]` the dup tables (`dup_groups`, `dup_loffs`, `dup_counts`) as one flat view; only
        for a plan from `empty` (a clone's tables are separate tensors)."""
        numel = self.dup_groups.numel() + self.dup_loffs.numel() + self.dup_counts.numel()
        if self.dup_counts.storage_offset() != self.dup_groups.storage_offset() + numel - 2:
            raise ValueError("dup_tables: this plan's dup tables are not adjacent (not made by empty())")
        return self.dup_groups.as_strided((numel,), (1,))

    def clone(self) -> MoonEPCommPlan:
        """A deep copy: every tensor cloned (a later dispatch into the same Buffer cannot change it)."""
        return replace(self, **{f.name: getattr(self, f.name).clone() for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def decode_dst(dst_n: torch.Tensor, rows_per_rank: int) -> tuple[torch.Tensor, ...]:
    """`dst [N]` -> (destination rank, row, is primary, is valid), each `[N]`; rank and row are 0 where
    the route is invalid."""
    valid_n = dst_n != NO_ROUTE
    primary_n = dst_n >= 0
    raw_n = torch.where(primary_n, dst_n, -dst_n.long() - 1)
    raw_n = torch.where(valid_n, raw_n, 0).long()
    return raw_n // rows_per_rank, raw_n % rows_per_rank, primary_n, valid_n
