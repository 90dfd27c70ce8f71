"""`Buffer`: the comm core of one MoE layer shape (MoonEP's public API and semantics, reference in torch).

Shapes: S tokens of capacity, H hidden, K top-k, E experts, R ranks, `epn = E / R`, B slots, NvS rows.
One step of a layer on every rank:

1. `dispatch(hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert)`: gathers the `[R, E]`
   histogram, plans (identically on every rank), writes each token row once per destination rank straight
   into its expert-grouped row there, sends a weight for every route, fills padding rows with zeros and
   copies primary rows into their same-rank duplicates (local expansion).
   -> `hidden_nvsh [NvS, H]`, `route_weights_nvs [NvS]`, `cu_seqlens [E+B]`, `plan`.
2. `prefetch_weight(plan, gate, up, down)`: copies every replicated expert into this rank's slots.
3. The caller runs the experts over the `cu_seqlens` segments.
4. `combine(plan, y_nvsh)`: pre-reduces duplicate rows into their primary in fp32, then sums every token's
   K rows in fp32 in k order -> `out_sh [S, H]`.

Backward reuses the forward plan: `dispatch(grad_out_sh, plan=plan)` brings the gradient to the rows,
`combine(plan, grad_x_nvsh, grad_route_weights_nvs)` returns the input and route-weight gradients, and
`reduce_grad(plan, ...)` adds every replica's gradient into its home expert's gradient and clears the slots.

Memory: the Buffer owns three symmetric tensors (peers write and read them): the rows `[NvS, H]`, their
route weights `[NvS]` and the duplicate sources `[NvS]`. Everything that crosses ranks goes through the
world's two collective row exchanges, `scatter_rows` (dispatch) and `gather_rows` (combine, prefetch,
reduce_grad), so every EP world (threads, symmetric memory, torch.distributed collectives) runs this same
reference; local work (padding zero-fill, duplicate expansion and pre-reduction) happens between them.

No host reads: every index the operations build has a shape fixed by the config (N routes, NvS rows, R*B
slots); entries that are not needed are marked, never masked out (rank -1 in the exchanges, a zero
contribution or a self-copy locally), so nothing waits on the host and a step can be captured in a CUDA
graph. The one host read left is the expert-id check of `dispatch`, behind `validate` (below).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from moonep_moe.comm.plan import MoonEPCommPlan, decode_dst, default_slots, plan_routes, rows_capacity
from moonep_moe.comm.world import EPWorld, SymmetricTensor
from moonep_moe.weights.pool import ExpertRows

_buffer_ids = itertools.count()


@dataclass(frozen=True)
class CommEvent:
    """Marks the end of an operation queued with `async_finish=True`; `wait()` makes the current stream
    wait for it. The reference implementation finishes before returning, so on the CPU it is complete."""

    event: torch.cuda.Event | None

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def _event(device: torch.device) -> CommEvent:
    if device.type != "cuda":
        return CommEvent(None)
    event = torch.cuda.Event()
    event.record()
    return CommEvent(event)


def _check(tensor: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype | tuple,
           device: torch.device) -> None:
    """Raise a ValueError naming `name` unless `tensor` has this shape (None = any size), dtype and device."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {tensor.dtype}")
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape,
                                                                                  strict=True)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {expected}, got {list(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device}, got {tensor.device}")


def _padding_mask(zero_fill_g2: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`[G, 2]` (first padding row, padding rows) of groups in row order -> `[num_rows]` bool, True on
    padding rows. Each row finds its group by its end offset (searchsorted), so the shape is fixed."""
    first_g = zero_fill_g2[:, 0].long()
    end_g = first_g + zero_fill_g2[:, 1].long()
    row_v = torch.arange(num_rows, device=zero_fill_g2.device)
    group_v = torch.searchsorted(end_g, row_v, right=True)
    inside_v = group_v < len(end_g)
    return inside_v & (row_v >= first_g[group_v.clamp(max=len(end_g) - 1)])


def _index_add_blocked_(target: torch.Tensor, index_c: torch.Tensor, values_c: torch.Tensor,
                        max_elements: int = 2**31 - 1) -> None:
    """`target[index_c[i]] += values_c[i]` for all i (`[C]` indices, `[C, *row]` values), in blocks of
    target rows each spanning at most `max_elements` (< 2^31) elements. CUDA's `index_add_` failed on the
    H200 for a DeepSeek-V3 layer's fp32 home gradients (3.8e9 elements); a block that small takes the 32-bit
    indexing path that every smaller call takes. Entries outside a block add a zero row there (a `where`,
    not a product, so an inf gradient stays where it belongs). One block, the usual case, is one call."""
    rows_per_block = max(1, max_elements // max(1, target[0].numel()))
    if target.shape[0] <= rows_per_block:
        target.index_add_(0, index_c, values_c)
        return
    expand = (-1,) + (1,) * (values_c.dim() - 1)
    for first in range(0, target.shape[0], rows_per_block):
        block = target[first:first + rows_per_block]
        local_c = index_c - first
        inside_c = (local_c >= 0) & (local_c < block.shape[0])
        block.index_add_(0, local_c.clamp(0, block.shape[0] - 1),
                         torch.where(inside_c.view(expand), values_c, 0))


class Buffer:
    """The comm core of one EP group for one layer shape: plan, dispatch, combine, prefetch, reduce_grad.

    Args:
        S: token capacity per rank (max_tokens_per_rank). A call may carry fewer tokens.
        H: hidden size. K: routed experts per token. E: experts in the group.
        num_ep_ranks: R, must equal `world.size`; E % R == 0.
        B: prefetch slots per rank, default `E / R` (training needs it; 0 when R == 1); B <= E - E / R.
        num_sms, comm_stream_priority, enable_pdl: launch hints of the GPU kernels; the reference
            implementation ignores them.
        token_padding: every non-empty segment is padded to a multiple of it (128: Hopper's M-block).
        explicitly_destroy: when True the caller must call `destroy()`; otherwise the memory is released
            when the Buffer is garbage-collected.
        world: the EP world (`moonep_moe.comm.world`).
        dtype: dtype of the dispatched rows (bf16 in production; float64 for exact tests). Route weights
            are fp32 (float64 for float64 rows).
        validate: check in `dispatch` that every expert id is in [-1, E) and raise a ValueError naming the
            bad id. It reads the ids on the host: on a GPU that is a sync, so it is skipped while a CUDA
            graph is being captured, and production turns it off (`validate=False`, or set
            `buffer.validate = False`) to run a step under `torch.cuda.set_sync_debug_mode("error")`.
            Everything else the Buffer does on the device reads nothing on the host.
    """

    def __init__(self, S: int, H: int, K: int, E: int, num_ep_ranks: int, B: int | None = None,
                 num_sms: int | None = None, token_padding: int = 128, comm_stream_priority: int = 0,
                 enable_pdl: bool = False, explicitly_destroy: bool = False, *, world: EPWorld,
                 dtype: torch.dtype = torch.bfloat16, validate: bool = True):
        for name, value in dict(S=S, H=H, K=K, E=E, num_ep_ranks=num_ep_ranks,
                                token_padding=token_padding).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if E % num_ep_ranks:
            raise ValueError(f"E={E} must be divisible by num_ep_ranks={num_ep_ranks}")
        if world.size != num_ep_ranks:
            raise ValueError(f"num_ep_ranks={num_ep_ranks} must equal the world's size {world.size}")
        if K > E:
            raise ValueError(f"K={K} must be <= E={E}")
        epn = E // num_ep_ranks
        B = default_slots(E, num_ep_ranks) if B is None else B
        if not 0 <= B <= E - epn:
            raise ValueError(f"B={B} must be in [0, E - E/R = {E - epn}]")
        self.S, self.H, self.K, self.E, self.R, self.B = S, H, K, E, num_ep_ranks, B
        self.epn, self.token_padding, self.world, self.dtype = epn, token_padding, world, dtype
        self.validate = validate
        self.num_sms, self.comm_stream_priority, self.enable_pdl = num_sms, comm_stream_priority, enable_pdl
        self.NvS = rows_capacity(S, K, num_ep_ranks, E, B, token_padding)
        self.weight_dtype = torch.promote_types(dtype, torch.float32)
        self.id = next(_buffer_ids)
        serial = world.globals.setdefault("buffer_serial", itertools.count())
        prefix = f"buffer{next(serial)}"
        device = world.device
        self._rows = world.symmetric(f"{prefix}/rows", torch.zeros(self.NvS, H, dtype=dtype, device=device))
        self._weights = world.symmetric(f"{prefix}/weights",
                                        torch.zeros(self.NvS, dtype=self.weight_dtype, device=device))
        self._dup_source = world.symmetric(f"{prefix}/dup_source",
                                           torch.full((self.NvS,), -1, dtype=torch.int32, device=device))
        keys = [t.key for t in (self._rows, self._weights, self._dup_source)]
        self._finalizer = None if explicitly_destroy else weakref.finalize(self, _release, world, keys)
        self._keys = keys
        self._destroyed = False
        self._pending_views: MoonEPCommPlan | None = None
        """The plan of a step whose zero-copy dispatch views have not been combined yet (see `dispatch`)."""

    # -- lifetime -------------------------------------------------------------------------------------------

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def destroy(self) -> None:
        """Release the symmetric memory. Idempotent; any later call raises."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        _release(self.world, self._keys)

    @property
    def nbytes(self) -> int:
        """Bytes of symmetric memory this Buffer holds per rank (rows, route weights, duplicate sources)."""
        return sum(t.local.nbytes for t in (self._rows, self._weights, self._dup_source))

    def end_step(self) -> None:
        """Forget a step whose zero-copy dispatch was never combined (it failed in between), so that the
        next step may dispatch. Its views are then overwritten by that dispatch."""
        self._pending_views = None

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed; create a new one")

    def _check_plan(self, plan: MoonEPCommPlan) -> None:
        if not isinstance(plan, MoonEPCommPlan):
            raise TypeError(f"plan must be a MoonEPCommPlan, got {type(plan).__name__}")
        if plan.owner != self.id or plan.rank != self.world.rank:
            raise ValueError(f"plan was made by Buffer {plan.owner} on rank {plan.rank}, "
                             f"not by this Buffer ({self.id}) on rank {self.world.rank}")

    # -- views ----------------------------------------------------------------------------------------------

    def hidden_nvsh_buffer_view(self) -> torch.Tensor:
        """`[NvS, H]` the persistent rows: write expert outputs here and `combine(..., zero_copy=True)`.
        Overwritten by the next dispatch or combine: never save it for backward."""
        self._check_alive()
        return self._rows.local

    def router_weight_buffer_view(self) -> torch.Tensor:
        """`[NvS]` the persistent route weights (fp32), same lifetime rules as the rows."""
        self._check_alive()
        return self._weights.local

    # -- dispatch -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def dispatch(self, hidden_sh: torch.Tensor, route_weights_sk: torch.Tensor | None,
                 topk_experts_sk: torch.Tensor | None, tokens_per_expert: torch.Tensor | None,
                 plan: MoonEPCommPlan | None = None, async_finish: bool = False, zero_copy: bool = False,
                 router_weights_zero_copy: bool = False):
        """Send every route's row and weight to the rank and row where it is computed.

        Args:
            hidden_sh: `[s, H]` rows in the Buffer's dtype, s <= S.
            route_weights_sk: `[s, K]` fp32 (float64 for float64 rows) route weights; may be None with a plan.
            topk_experts_sk: `[s, K]` int32/int64 experts in [-1, E), -1 = no route. Ignored with a plan.
            tokens_per_expert: `[E]` int histogram of this rank's valid routes (`bincount` of the non-negative
                entries of `topk_experts_sk`). Ignored with a plan.
            plan: a plan from an earlier dispatch of this Buffer (the combine-backward path): no planning,
                the returned `cu_seqlens` is None.
            zero_copy / router_weights_zero_copy: return the Buffer's persistent views instead of copies.
                Until this step's `combine`, a dispatch of a new step (without a plan) raises: it would
                overwrite the views (two in-flight steps cannot share one Buffer; give each its own).
                Dispatches with a plan (backward) stay legal: forward dispatch -> combine -> backward
                dispatch(plan) -> combine. Copy-mode steps own their rows and are not tracked.

        Returns:
            `(hidden_nvsh [NvS, H], route_weights_nvs [NvS] or None, cu_seqlens [E+B] int32 or None, plan)`,
            plus a `CommEvent` when `async_finish`. Rows of padding are zero; rows past `cu_seqlens[-1]` are
            unspecified. Raises before any exchange if an argument is malformed.
        """
        self._check_alive()
        device = self.world.device
        if hidden_sh.dim() != 2 or hidden_sh.shape[0] > self.S:
            raise ValueError(f"hidden_sh must have shape [s <= S={self.S}, H={self.H}], got "
                             f"{list(hidden_sh.shape)}")
        num_tokens = hidden_sh.shape[0]
        _check(hidden_sh, "hidden_sh", (num_tokens, self.H), self.dtype, device)
        if route_weights_sk is not None:
            _check(route_weights_sk, "route_weights_sk", (num_tokens, self.K), self.weight_dtype, device)
        if plan is None:
            if self._pending_views is not None:
                raise RuntimeError(
                    f"Buffer {self.id}: a new step was dispatched while the previous step's zero-copy views "
                    "have not been combined: two in-flight steps cannot share one Buffer. Combine the "
                    "previous step first, give each in-flight step its own Buffer, or call end_step() if "
                    "the previous step failed")
            ints = (torch.int32, torch.int64)
            _check(topk_experts_sk, "topk_experts_sk", (num_tokens, self.K), ints, device)
            _check(tokens_per_expert, "tokens_per_expert", (self.E,), ints, device)
            if route_weights_sk is None:
                raise ValueError("route_weights_sk is required when no plan is given")
            if self.validate and (device.type != "cuda" or not torch.cuda.is_current_stream_capturing()):
                self._check_expert_ids(topk_experts_sk)
            counts_re = self.world.all_gather(tokens_per_expert.to(torch.int64))
            plan = plan_routes(counts_re, topk_experts_sk, rank=self.world.rank, num_slots=self.B,
                               token_padding=self.token_padding, rows_per_rank=self.NvS, owner=self.id)
            cu_seqlens = plan.cu_seqlens
        else:
            self._check_plan(plan)
            if plan.num_routes != num_tokens * self.K:
                raise ValueError(f"hidden_sh has {num_tokens} tokens, the plan was made for "
                                 f"{plan.num_routes // self.K}")
            cu_seqlens = None
        self._send_rows(plan, hidden_sh, route_weights_sk, record_duplicates=cu_seqlens is not None)
        if cu_seqlens is not None and (zero_copy or router_weights_zero_copy):
            self._pending_views = plan
        rows_nvsh = self._rows.local if zero_copy else self._rows.local.clone()
        weights_nvs = None
        if route_weights_sk is not None:
            weights_nvs = self._weights.local if router_weights_zero_copy else self._weights.local.clone()
        result = (rows_nvsh, weights_nvs, cu_seqlens, plan)
        return (*result, _event(device)) if async_finish else result

    def _check_expert_ids(self, topk_experts_sk: torch.Tensor) -> None:
        """Expert ids in [-1, E). Reads the tensor on the host: on a GPU this syncs (see `validate`)."""
        bad = (topk_experts_sk < -1) | (topk_experts_sk >= self.E)
        if bool(bad.any()):
            value = int(topk_experts_sk[bad][0])
            raise ValueError(f"topk_experts_sk holds expert id {value}: ids must be in [-1, E={self.E})")

    def _send_rows(self, plan: MoonEPCommPlan, hidden_sh: torch.Tensor, route_weights_sk: torch.Tensor | None,
                   record_duplicates: bool) -> None:
        """Every route's payload row (primaries only) and weight to its destination row; the duplicate
        sources too when `record_duplicates` (the forward dispatch, which fills the plan's dup tables).
        Then zero the padding rows and copy each primary row into its duplicates (all NvS rows)."""
        dest_n, row_n, primary_n, valid_n = decode_dst(plan.dst, self.NvS)
        token_n = torch.arange(plan.dst.numel(), device=plan.dst.device) // self.K
        world = self.world
        # capacities: a token sends one payload row per destination rank (<= S), a weight per route (<= S*K)
        world.scatter_rows(self._rows, torch.where(valid_n & primary_n, dest_n, -1), row_n,
                           hidden_sh.index_select(0, token_n), capacity=self.S)
        if route_weights_sk is not None:
            world.scatter_rows(self._weights, torch.where(valid_n, dest_n, -1), row_n,
                               route_weights_sk.reshape(-1), capacity=self.S * self.K)
        if record_duplicates:
            world.scatter_rows(self._dup_source, torch.where(valid_n & ~primary_n, dest_n, -1), row_n,
                               self._primary_rows(dest_n, row_n, valid_n), capacity=self.S * self.K)
            self._record_duplicates(plan)
        padding_nvs = _padding_mask(plan.zero_fill_ranges, self.NvS)
        self._rows.local.masked_fill_(padding_nvs[:, None], 0)
        self._weights.local.masked_fill_(padding_nvs, 0)
        rows_nvsh = self._rows.local
        rows_nvsh.copy_(rows_nvsh.index_select(0, self._source_rows(plan)))

    def _primary_rows(self, dest_n: torch.Tensor, row_n: torch.Tensor, valid_n: torch.Tensor) -> torch.Tensor:
        """`[N]` for each route the row of its token's primary route on the same rank (itself if primary)."""
        dest_sk = torch.where(valid_n, dest_n, -1).view(-1, self.K)
        # the primary is the first k of the token with the same destination
        same_skk = dest_sk[:, :, None] == dest_sk[:, None, :]
        first_sk = same_skk.int().argmax(-1)
        return torch.gather(row_n.view(-1, self.K), 1, first_sk).reshape(-1)

    def _record_duplicates(self, plan: MoonEPCommPlan) -> None:
        """Turn the received `[NvS]` duplicate sources (-1: not a duplicate) into the plan's dup tables and
        clear them. Fixed shapes: the rows sorted by (primary, row) with non-duplicates pushed to the end
        by a sentinel key; group starts where the primary changes; unused table entries are zero."""
        nvs = self.NvS
        source_nvs = self._dup_source.local
        index_v = torch.arange(nvs, device=source_nvs.device)  # rows, then positions in the sorted order
        key_v = torch.where(source_nvs >= 0, source_nvs.long() * nvs + index_v, nvs * nvs)
        order_v = torch.argsort(key_v, stable=True)
        dup_v = (source_nvs >= 0)[order_v]  # position i of the sorted order holds a duplicate
        primary_v = source_nvs[order_v].long()
        starts_v = dup_v & ((index_v == 0) | (primary_v != torch.roll(primary_v, 1)))
        group_v = torch.cumsum(starts_v, 0) - 1
        dump_v = torch.full_like(index_v, nvs)  # fixed-shape scatters send unused entries to a dump row
        groups_v3 = torch.zeros(nvs + 1, 3, dtype=torch.int64, device=index_v.device)
        groups_v3.index_copy_(0, torch.where(starts_v, group_v, dump_v),
                              torch.stack([primary_v, index_v, torch.zeros_like(index_v)], 1))
        groups_v3[:, 2].index_add_(0, torch.where(dup_v, group_v, dump_v), torch.ones_like(index_v))
        plan.dup_groups.copy_(groups_v3[:nvs])
        plan.dup_loffs.copy_(torch.where(dup_v, order_v, 0))
        plan.dup_counts.copy_(torch.stack([starts_v.sum(), dup_v.sum()]))
        source_nvs.fill_(-1)

    def _source_rows(self, plan: MoonEPCommPlan) -> torch.Tensor:
        """`[NvS]` int64 from the plan's dup tables: each row's primary row if it is a duplicate, else the
        row itself (so `rows[source]` expands duplicates, and an `index_add_` over it pre-reduces them)."""
        nvs = self.NvS
        groups_v3 = plan.dup_groups.long()
        num_groups, num_dups = plan.dup_counts.long().unbind()
        index_v = torch.arange(nvs, device=groups_v3.device)
        dump_v = torch.full_like(index_v, nvs)
        # the group of each dup_loffs entry: count the group starts at or before it
        starts_v = torch.zeros(nvs + 1, dtype=torch.int64, device=index_v.device)
        starts_v.index_add_(0, torch.where(index_v < num_groups, groups_v3[:, 1], dump_v),
                            torch.ones_like(index_v))
        group_v = (torch.cumsum(starts_v[:nvs], 0) - 1).clamp(min=0)
        source_v = torch.arange(nvs + 1, device=index_v.device)
        source_v.index_copy_(0, torch.where(index_v < num_dups, plan.dup_loffs.long(), dump_v),
                             groups_v3[:, 0].index_select(0, group_v))
        return source_v[:nvs]

    # -- combine --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def combine(self, plan: MoonEPCommPlan, hidden_nvsh: torch.Tensor,
                route_weights_nvs: torch.Tensor | None = None, zero_copy: bool = False,
                async_finish: bool = False):
        """Bring every route's row home and sum each token's K rows in fp32, in k order.

        Args:
            plan: the plan of this step's dispatch.
            hidden_nvsh: `[NvS, H]` expert outputs in the Buffer's dtype, unweighted sums: the experts apply
                the route weights. With `zero_copy` it must be `hidden_nvsh_buffer_view()` itself.
            route_weights_nvs: optional `[NvS]` fp32 per-row values gathered back per route (backward: the
                route-weight gradients); with `zero_copy` it must be `router_weight_buffer_view()`.

        Returns:
            `(hidden_sh [s, H] in the Buffer's dtype, route_weights_sk [s, K] or None, event or None)`;
            invalid routes contribute zero.
        """
        self._check_alive()
        self._check_plan(plan)
        device = self.world.device
        _check(hidden_nvsh, "hidden_nvsh", (self.NvS, self.H), self.dtype, device)
        if plan is self._pending_views:
            self._pending_views = None
        if route_weights_nvs is not None:
            _check(route_weights_nvs, "route_weights_nvs", (self.NvS,), self.weight_dtype, device)
        if zero_copy:
            for given, own, name in ((hidden_nvsh, self._rows.local, "hidden_nvsh"),
                                     (route_weights_nvs, self._weights.local, "route_weights_nvs")):
                if given is not None and given.data_ptr() != own.data_ptr():
                    raise ValueError(f"zero_copy=True needs {name} to be this Buffer's own view "
                                     f"({name.split('_')[0]}_*_buffer_view()), got another tensor")
        if route_weights_nvs is not None and not zero_copy:
            self._weights.local.copy_(route_weights_nvs)
        accumulate = torch.promote_types(self.dtype, torch.float32)
        # pre-reduce: every row adds into its source row (duplicates into their primary, the rest into
        # themselves), in fp32; only primary rows are read below
        sums_nvsh = torch.zeros(self.NvS, self.H, dtype=accumulate, device=device)
        sums_nvsh.index_add_(0, self._source_rows(plan), hidden_nvsh.to(accumulate))
        self._rows.local.copy_(sums_nvsh)
        del sums_nvsh
        dest_n, row_n, primary_n, valid_n = decode_dst(plan.dst, self.NvS)
        num_tokens = plan.dst.numel() // self.K
        gathered_nh = self.world.gather_rows(self._rows, torch.where(valid_n & primary_n, dest_n, -1), row_n,
                                             capacity=self.S).to(accumulate)
        out_sh = torch.zeros(num_tokens, self.H, dtype=accumulate, device=device)
        for k in range(self.K):  # fp32 sum in k order
            out_sh += gathered_nh.view(num_tokens, self.K, self.H)[:, k]
        weights_sk = None
        if route_weights_nvs is not None:
            weights_n = self.world.gather_rows(self._weights, torch.where(valid_n, dest_n, -1), row_n,
                                               capacity=self.S * self.K)
            weights_sk = weights_n.view(num_tokens, self.K)
        return out_sh.to(self.dtype), weights_sk, (_event(device) if async_finish else None)

    # -- weights --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefetch_weight(self, plan: MoonEPCommPlan, full_gate_weight, full_up_weight, full_down_weight,
                        scales=None, async_finish: bool = False) -> CommEvent | None:
        """Copy each replicated expert's weights into this rank's slots: slot j gets `experts_to_copy[r, j]`.

        Each projection is either the replicated form `[E+B, N, K]` (every expert present on every rank, as
        vLLM's integration passes it: rows E+j are the slots) or an `ExpertRows` (home experts read from
        their rank + this rank's slot pool). A projection given as None is skipped (a fused gate_up passed
        as the gate). Every slot is written (fixed shapes): slots marked -1 are zeroed, their segments are
        empty. `scales` (quantised weights) is not supported yet and must be None.
        """
        self._check_alive()
        self._check_plan(plan)
        if scales is not None:
            raise NotImplementedError("prefetch_weight(scales=...): quantised experts are not supported yet")
        expert_b = plan.experts_to_copy[self.world.rank].long()
        used_b = expert_b >= 0
        for weight in (full_gate_weight, full_up_weight, full_down_weight):
            if weight is None:
                continue
            if isinstance(weight, ExpertRows):
                copies = self.world.gather_rows(weight.home, torch.where(used_b, expert_b // self.epn, -1),
                                                expert_b.clamp(min=0) % self.epn, capacity=self.B)
                weight.slots.local.copy_(copies)
            else:
                self._check_full(weight, "full weight")
                copies = weight.index_select(0, expert_b.clamp(min=0))
                weight[self.E:].copy_(copies.masked_fill_(~used_b.view(-1, *[1] * (copies.dim() - 1)), 0))
        return _event(self.world.device) if async_finish else None

    def _check_full(self, tensor: torch.Tensor, name: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tensor.shape[0] != self.E + self.B:
            shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be [E+B={self.E + self.B}, N, K] or ExpertRows, got {shape}")

    @torch.no_grad()
    def reduce_grad(self, plan: MoonEPCommPlan, full_gate_grad, full_up_grad, full_down_grad,
                    gate_reduce_buffer: SymmetricTensor | None = None,
                    up_reduce_buffer: SymmetricTensor | None = None,
                    down_reduce_buffer: SymmetricTensor | None = None,
                    async_finish: bool = False) -> CommEvent | None:
        """Add every replica's gradient into its home expert's gradient (fp32), then clear the slots.

        Each projection's gradient is either an `ExpertRows` (home fp32 gradients + the symmetric slot-grad
        pool) or the replicated form `[E+B, N, K]` fp32 with the slot gradients in rows E.., in which case
        its `*_reduce_buffer` (a symmetric `[B, N, K]` fp32 tensor) stages them for the peers. None skips a
        projection. Collective: every rank must call it with the same projections.
        """
        self._check_alive()
        self._check_plan(plan)
        projections = []
        for grad, staging, name in ((full_gate_grad, gate_reduce_buffer, "gate"),
                                    (full_up_grad, up_reduce_buffer, "up"),
                                    (full_down_grad, down_reduce_buffer, "down")):
            if grad is None:
                continue
            if isinstance(grad, ExpertRows):
                projections.append((grad.home.local, grad.slots, None))
                continue
            self._check_full(grad, f"full_{name}_grad")
            if not isinstance(staging, SymmetricTensor):
                raise ValueError(f"full_{name}_grad in the [E+B, ...] form needs {name}_reduce_buffer, "
                                 "a SymmetricTensor [B, N, K]")
            staging.local.copy_(grad[self.E:])
            rank = self.world.rank
            projections.append((grad[rank * self.epn:(rank + 1) * self.epn], staging, grad[self.E:]))
        # which slot of which rank holds which of this rank's home experts ([R, B], fixed shape)
        table_rb = plan.experts_to_copy.long()
        mine_rb = (table_rb >= 0) & (table_rb // self.epn == self.world.rank)
        home_rb = table_rb.clamp(min=0) % self.epn
        rank_r = torch.arange(self.R, device=table_rb.device)
        used_b = table_rb[self.world.rank] >= 0
        for home, slots, replicated in projections:
            # one slot index per exchange: R rows in flight (the peak memory), R * B rows in all; rows of
            # other ranks' experts come back zero and add nothing
            for slot in range(self.B):
                pulled_r = self.world.gather_rows(slots, torch.where(mine_rb[:, slot], rank_r, -1),
                                                  torch.full_like(rank_r, slot), capacity=1)
                _index_add_blocked_(home, home_rb[:, slot], pulled_r.to(home.dtype))
            expand = (-1,) + (1,) * (slots.local.dim() - 1)
            slots.local.masked_fill_(used_b.view(expand), 0)
            if replicated is not None:
                replicated.masked_fill_(used_b.view(expand), 0)
        return _event(self.world.device) if async_finish else None


def _release(world: EPWorld, keys: list[str]) -> None:
    for key in keys:
        world.release(key)
