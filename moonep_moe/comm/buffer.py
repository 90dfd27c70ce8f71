"""`Buffer`: the comm core of one MoE layer shape (MoonEP's public API and semantics, reference in torch).

Notation and suffixes: DESIGN.md, "Notation". One step of a layer on every rank:

1. `dispatch(hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert)`: gathers the `[R, E]`
   histogram, plans (identically on every rank), writes each token row once per destination rank straight
   into its expert-grouped row there, sends a weight for every route, fills padding rows with zeros and
   copies primary rows into their same-rank duplicates (local expansion).
   -> `hidden_nvsh [NvS, H]`, `route_weights_nvs [NvS]`, `cu_seqlens [E+B]`, `plan`. FP8 rows move with
   their 1x128 scales (`scales=`): one packed byte row each in the rows' memory (`fp8.wire`), through
   the same exchange; `hidden_nvsh` is then the pair (e4m3 rows, scales).
2. `prefetch_weight(plan, gate, up, down)`: copies every replicated expert into this rank's slots (FP8
   weights with their block scales: `scales=`).
3. The caller runs the experts over the `cu_seqlens` segments.
4. `combine(plan, y_nvsh)`: pre-reduces duplicate rows into their primary in fp32, then sums every token's
   K rows in fp32 in k order -> `out_sh [S, H]`.

Backward reuses the forward plan: `dispatch(grad_out_sh, plan=plan)` brings the gradient to the rows,
`combine(plan, grad_x_nvsh, grad_route_weights_nvs)` returns the input and route-weight gradients, and
`reduce_grad(plan, ...)` adds every replica's gradient into its home expert's gradient and clears the slots.

Memory: the Buffer owns three symmetric tensors (peers write and read them): the rows `[NvS, H]`, their
route weights `[NvS]` and the duplicate pairs `[R*S*K, 2]` (a received duplicate route's row and its primary
row, at the slot of the route that sent it); and one local `[NvS]` int32 scratch, zero between operations,
the row kernels' marks while they build the dup tables (not counted in `nbytes`, which is the symmetric
memory).

Work per step (DESIGN.md's notation; s = this call's tokens, n = s*K routes, N = S*K the capacity's; the
`comm.kernels.rows` path, which serving runs): the histogram, the all-gather (none with one rank) and the plan
O(n + R*E); the row exchanges O(n*H) (each token row read once, written once per destination rank, K rows
read back); the dup tables O(R*N + rows the plan fills) (one program: the duplicate pairs, then the filled
rows in order; the reference sorts the pairs) plus zeroing the plan's int32 dup tables (16 bytes per row of
NvS, inside the planner's launch); padding rows and duplicate rows
O(rows the plan fills); combine's copy of a `hidden_nvsh` that is not the Buffer's own view, and
`dispatch(zero_copy=False)`'s copy of the rows (a `[NvS, H]` tensor the caller owns, its rows past
`cu_seqlens[-1]` unspecified), O(rows the plan fills). The torch reference (`ReferenceExchange`) copies,
pads, expands and pre-reduces over all NvS rows (fixed-shape torch, no host read).

The Buffer keeps the API, the checks, the plans, the streams and the memory's lifetime; how rows cross ranks
is its exchange (`comm.exchange`), chosen once at construction (`kernels`): the torch reference over the
world's `scatter_rows` / `gather_rows` (every EP world) or the Triton row kernels (where every peer's
memory is mapped), equal bit for bit. Both read the indices the Buffer builds (the plan, the dup tables,
the replica tables).

`async_finish=True` queues an operation on this rank's comm stream (priority `comm_stream_priority`), after
the caller's current stream's work; without it an operation runs on the current stream. The results are
MoonEP's: `dispatch` returns four items, and a fifth, its `CommEvent` (`comm.event`), with `async_finish`;
`combine` always ends with its event (None without `async_finish`); `prefetch_weight` and `reduce_grad`
return their event (None without `async_finish`). `reduce_grad(..., behind=True)` leaves the operation
running behind its caller with no event to wait for: every later operation of a Buffer on the world, and
`wait_behind()`, order their stream behind it.

No host reads: every index the operations build has a shape fixed by the config (N routes, NvS rows, R*B
slots); entries that are not needed are marked, never masked out (rank -1 in the exchanges, a zero
contribution or a self-copy locally), so nothing waits on the host and a step can be captured in a CUDA
graph. The one host read left is the expert-id check of `dispatch`, behind `validate` (below).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from moonep_moe.base.sizes import TOKEN_PADDING, check_layout, default_slots, rows_capacity
from moonep_moe.comm.checks import _tensors, check_tensor
from moonep_moe.comm.event import CommEvent
from moonep_moe.comm.exchange import KernelExchange, RowExchange, RowMemory, select_exchange
from moonep_moe.comm.replicas import ExpertTransfers
from moonep_moe.fp8.format import FP8_DTYPE
from moonep_moe.fp8.wire import pack_rows, packed_width, scale_columns, unpack_rows
from moonep_moe.plan.planner import expert_histogram, plan_one_rank, plan_routes
from moonep_moe.plan.policies import NO_REPLICATION
from moonep_moe.plan.types import MoonEPCommPlan
from moonep_moe.transport.registry import world_of_process_group
from moonep_moe.transport.world import EPWorld

_buffer_ids = itertools.count()

BUFFER_NAMES = dict(E="E={}", R="num_ep_ranks={}", K="K={}", B="B={}")
"""How `Buffer` calls E, R, K and B (its arguments) in `check_layout`'s errors."""

BEHIND = "comm_behind"
"""The world's `globals` key of the `CommEvent`s of operations left running behind their callers."""

DISPATCH_NAMES = ("hidden_sh", "route_weights_sk", "topk_experts_sk")
"""How `Buffer.dispatch` calls its rows, route weights and expert ids (in its errors)."""


class Buffer(ExpertTransfers):
    """The comm core of one EP group for one layer shape: plan, dispatch, combine, prefetch, reduce_grad.

    Args (after `num_ep_ranks` keyword-only: MoonEP's positional order there is not this one's, so a
    positional call raises instead of meaning something else):
        S: token capacity per rank (max_tokens_per_rank). A call may carry fewer tokens.
        H: hidden size. K: routed experts per token. E: experts in the group.
        num_ep_ranks: R, must equal the world's size; E % R == 0.
        B: prefetch slots per rank, default `E / R` (training needs it; 0 when R == 1); B <= E - E / R.
        num_sms: SMs the row kernels' grid-stride loops size their grids for (default: the device's).
        comm_stream_priority: priority of the comm stream that `async_finish=True` operations run on
            (torch's convention: lower is higher priority; e.g. -1).
        token_padding: every non-empty segment is padded to a multiple of it (default `TOKEN_PADDING`, 16;
            128 for grouped GEMMs that need Hopper's M-block).
        explicitly_destroy: when True the caller must call `destroy()`: a Buffer garbage-collected without
            it warns (ResourceWarning, naming the Buffer and rank) and then releases its memory; when False
            the memory is released silently when the Buffer is garbage-collected.
        world: the EP world (`moonep_moe.transport.world`), or None to derive it from `group`.
        group: MoonEP's way to name the ranks, used where `world` is None: a process group (None: the
            initialised default group), whose world `transport.registry.world_of_process_group` gives
            (symmetric memory for NCCL, the collective world for gloo).
        dtype: dtype of the dispatched rows (bf16 in production; float64 for exact tests). Route weights
            are fp32 (float64 for float64 rows).
        validate: check in `dispatch` that every expert id is in [-1, E) (a ValueError naming the bad id)
            and that a given `tokens_per_expert` counts them, and in `prefetch_weight` that the slots'
            experts copied from a replicated `[E+B, ...]` weight equal their home rank's rows. These read
            device values on the host: on a GPU that is a sync, so they are skipped while a CUDA graph is
            being captured, and production turns them off (`validate=False`, or set
            `buffer.validate = False`) to run a step under `torch.cuda.set_sync_debug_mode("error")`.
            Everything else the Buffer does on the device reads nothing on the host.
        kernels: run the Triton row kernels (`comm.kernels.rows`) instead of the torch reference. None
            (default) = where they apply: a CUDA world whose symmetric tensors map every peer (threads world
            on one GPU, symmetric-memory world), rows in bf16/fp16/fp32/fp64. True forces them (a ValueError
            where they cannot run; on CPU tensors they need Triton's interpreter, `TRITON_INTERPRET=1`, which
            is how the tests check them against the reference); False forces the reference.
        replica_cost: the planner's replication policy (`plan.policies`, `CommConfig.replica_cost`): 0
            (default) exact balance, c > 0 cost-aware (a replica must take more than c routes off its donor),
            `NO_REPLICATION` plain EP. Anything but 0 sizes the rows for best-effort balance
            (`rows_capacity`).
    """

    def __init__(self, S: int, H: int, K: int, E: int, num_ep_ranks: int, *, B: int | None = None,
                 num_sms: int | None = None, token_padding: int = TOKEN_PADDING,
                 group: dist.ProcessGroup | None = None, comm_stream_priority: int = 0,
                 explicitly_destroy: bool = False, world: EPWorld | None = None,
                 dtype: torch.dtype = torch.bfloat16, validate: bool = True, kernels: bool | None = None,
                 replica_cost: int = 0):
        if world is None:
            world = world_of_process_group(group)
        elif group is not None:
            raise ValueError(f"rank {world.rank}: pass the EP world or the process group (group=, whose "
                             "world is derived from it), not both")
        where = f"rank {world.rank}"
        if not isinstance(replica_cost, int) or not 0 <= replica_cost <= NO_REPLICATION:
            raise ValueError(f"{where}: replica_cost must be an int in [0, {NO_REPLICATION}], got "
                             f"{replica_cost!r}")
        for name, value in dict(S=S, H=H, K=K, E=E, num_ep_ranks=num_ep_ranks,
                                token_padding=token_padding).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
        check_layout(E, num_ep_ranks, K, B, BUFFER_NAMES, where)
        if world.size != num_ep_ranks:
            raise ValueError(f"{where}: num_ep_ranks={num_ep_ranks} must equal the world's size {world.size}")
        epn = E // num_ep_ranks
        B = default_slots(E, num_ep_ranks) if B is None else B
        self.S, self.H, self.K, self.E, self.R, self.B = S, H, K, E, num_ep_ranks, B
        self.epn, self.token_padding, self.world, self.dtype = epn, token_padding, world, dtype
        self.validate = validate
        self.num_sms, self.comm_stream_priority = num_sms, comm_stream_priority
        self.replica_cost = replica_cost
        self.NvS = rows_capacity(S, K, num_ep_ranks, E, B, token_padding, replica_cost)
        self.weight_dtype = torch.promote_types(dtype, torch.float32)
        self.id = next(_buffer_ids)
        serial = world.globals.setdefault("buffer_serial", itertools.count())
        prefix = f"buffer{next(serial)}"
        device = world.device
        self._rows = world.symmetric(f"{prefix}/rows", torch.zeros(self.NvS, H, dtype=dtype, device=device))
        self._weights = world.symmetric(f"{prefix}/weights",
                                        torch.zeros(self.NvS, dtype=self.weight_dtype, device=device))
        self._dup_pairs = world.symmetric(f"{prefix}/dup_pairs", torch.full(
            (num_ep_ranks * S * K, 2), -1, dtype=torch.int32, device=device))
        dup_marks = torch.zeros(self.NvS, dtype=torch.int32, device=device)
        memory = RowMemory(world, self._rows, self._weights, self._dup_pairs, dup_marks, S, K, epn, B,
                           token_padding, num_sms)
        self._exchange = select_exchange(memory, kernels)
        """How rows cross ranks: the Triton row kernels or the torch reference (`comm.exchange`)."""
        self._fp8_exchange: RowExchange | None = None
        """The same exchange over the rows' memory seen as packed FP8 rows (`fp8.wire`), where they fit
        in the rows' bytes: what `dispatch(..., scales=)` moves."""
        if packed_width(H) <= self._rows.local[0].nbytes:
            packed = replace(memory, rows=self._rows.as_rows(packed_width(H), torch.uint8))
            self._fp8_exchange = replace(self._exchange, memory=packed)
        keys = [t.key for t in (self._rows, self._weights, self._dup_pairs)]
        unreleased = f"Buffer {self.id} on rank {world.rank}" if explicitly_destroy else None
        self._finalizer = weakref.finalize(self, _release, world, keys, unreleased)
        self._keys = keys
        self._destroyed = False
        self._pending_views: MoonEPCommPlan | None = None
        """The plan of a step whose zero-copy dispatch views have not been combined yet (see `dispatch`)."""
        self._steps = 0
        """Forward dispatches so far: the step number of the latest plan made (`MoonEPCommPlan.step`)."""
        self._current_step: int | None = None
        """The step of the latest dispatch (forward, or backward with `plan=`): the plan operations take."""

    @property
    def uses_kernels(self) -> bool:
        """True where the operations run the Triton row kernels, False where the torch reference runs."""
        return isinstance(self._exchange, KernelExchange)

    def _comm_stream(self) -> torch.cuda.Stream:
        """This rank's comm stream of that priority, shared by its Buffers (created on first use)."""
        key = ("comm_stream", self.world.device, self.comm_stream_priority)
        if key not in self.world.globals:
            self.world.globals[key] = torch.cuda.Stream(self.world.device, priority=self.comm_stream_priority)
        return self.world.globals[key]

    def _launch(self, async_finish: bool, op: Callable[[], Any], inputs: tuple
                ) -> tuple[Any, CommEvent | None]:
        """`op()` on the current stream (event None), or with `async_finish` on the comm stream after the
        current stream's queued work, returning its `CommEvent`. The event holds `inputs` until it is waited
        for (their memory is not reused before the comm stream is done with them). The results are
        allocated on the comm stream, which only this method queues work on, each time after the caller's
        queued work: once the caller frees a result, no later comm operation reuses its memory before the
        caller's reads of it. Every operation starts behind the ones running behind their callers
        (`wait_behind`)."""
        self.wait_behind()
        if not async_finish:
            return op(), None
        if self.world.device.type != "cuda":
            return op(), CommEvent(None)
        caller = torch.cuda.current_stream(self.world.device)
        stream = self._comm_stream()
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            result = op()
            event = torch.cuda.Event()
            event.record(stream)
        return result, CommEvent(event, tuple(t for t in _tensors(inputs) if t.device.type == "cuda"))

    def _run_behind(self, op: Callable[[], None], held: tuple) -> None:
        """`op()` on the comm stream after the current stream's queued work, left running behind the
        caller: the next operation of any Buffer on this world, and `wait_behind`, wait for it. The event
        holds `held` (what the caller may free before then), nothing else."""
        _, event = self._launch(True, op, held)
        self.world.globals.setdefault(BEHIND, []).append(event)

    def wait_behind(self) -> None:
        """Order the current stream behind every operation left running behind its caller on this rank's
        world (`reduce_grad(..., behind=True)`, of any of its Buffers): what the caller queues next on it
        (a read of the gradients they write, any comm operation) runs after them. Every operation calls it
        first; `MoonEPExperts` calls it at the end of the backward pass. Returns at once on the host."""
        for event in self.world.globals.pop(BEHIND, ()):
            event.wait()

    # -- lifetime -------------------------------------------------------------------------------------------

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def destroy(self) -> None:
        """Release the symmetric memory. Idempotent; any later call raises."""
        if self._destroyed:
            return
        self.wait_behind()
        self._destroyed = True
        self._finalizer.detach()
        _release(self.world, self._keys)

    @property
    def nbytes(self) -> int:
        """Bytes of symmetric memory this Buffer holds per rank (rows, route weights, duplicate pairs)."""
        return sum(t.local.nbytes for t in (self._rows, self._weights, self._dup_pairs))

    def end_step(self) -> None:
        """Forget a step whose zero-copy dispatch was never combined (it failed in between), so that the
        next step may dispatch. Its views are then overwritten by that dispatch."""
        self._pending_views = None

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"rank {self.world.rank}: this Buffer ({self.id}) was destroyed; "
                               "create a new one")

    def _check_plan(self, plan: MoonEPCommPlan, backward_dispatch: bool = False) -> None:
        """`plan` must come from this Buffer on this rank and be the plan of its latest dispatch (a backward
        `dispatch(plan=...)` may take any earlier plan of this Buffer and makes it the latest). Host ints
        only: no device read."""
        rank = self.world.rank
        if not isinstance(plan, MoonEPCommPlan):
            raise TypeError(f"rank {rank}: plan must be a MoonEPCommPlan, got {type(plan).__name__}")
        if plan.owner != self.id or plan.rank != rank:
            raise ValueError(f"rank {rank}: plan was made by Buffer {plan.owner} on rank {plan.rank}, "
                             f"not by this Buffer ({self.id}) on rank {rank}")
        if not backward_dispatch and plan.step != self._current_step:
            raise ValueError(
                f"rank {rank}: plan is the plan of step {plan.step} of Buffer {self.id}, whose latest "
                f"dispatch was step {self._current_step}: every operation takes the plan of the latest "
                "dispatch (a backward dispatch(..., plan=plan) makes an earlier plan the latest again); two "
                "steps in flight at once need two Buffers")

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether `dispatch` takes FP8 rows with their scales (`scales=`): their packed rows (`fp8.wire`)
        fit in the bytes of this Buffer's rows (any H >= 16 in bf16)."""
        return self._fp8_exchange is not None

    # -- views ----------------------------------------------------------------------------------------------

    @property
    def hidden_nvsh_buffer_view(self) -> torch.Tensor:
        """`[NvS, H]` the persistent rows: write expert outputs here and `combine(..., zero_copy=True)`.
        Overwritten by the next dispatch or combine: never save it for backward."""
        self._check_alive()
        return self._rows.local

    @property
    def router_weight_buffer_view(self) -> torch.Tensor:
        """`[NvS]` the persistent route weights (fp32), same lifetime rules as the rows."""
        self._check_alive()
        return self._weights.local

    # -- dispatch -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def dispatch(self, hidden_sh: torch.Tensor, route_weights_sk: torch.Tensor | None = None,
                 topk_experts_sk: torch.Tensor | None = None, tokens_per_expert: torch.Tensor | None = None,
                 plan: MoonEPCommPlan | None = None, async_finish: bool = False, zero_copy: bool = False,
                 router_weights_zero_copy: bool = False, scales: torch.Tensor | None = None, *,
                 arg_names: tuple[str, str, str] = DISPATCH_NAMES):
        """Send every route's row and weight to the rank and row where it is computed.

        Args:
            hidden_sh: `[s, H]` rows in the Buffer's dtype, s <= S; or FP8 rows (`float8_e4m3fn`) with
                their `scales`.
            route_weights_sk: `[s, K]` fp32 (float64 for float64 rows) route weights; may be None with a plan.
            topk_experts_sk: `[s, K]` int32/int64 experts in [-1, E), -1 = no route. Ignored with a plan.
            tokens_per_expert: optional `[E]` int histogram of this rank's valid routes (MoonEP's signature).
                The Buffer counts `topk_experts_sk` itself on the device (`expert_histogram`), so the plan
                never depends on it; with `validate` a histogram that disagrees with the ids raises.
                Ignored with a plan.
            plan: the plan of an earlier forward dispatch of this Buffer (the combine-backward path, e.g.
                `dispatch(grad_sh, plan=plan, async_finish=True)`): no planning, the returned `cu_seqlens`
                is None, and `plan` becomes the plan the next operations take.
            zero_copy / router_weights_zero_copy: return the Buffer's persistent views instead of copies
                (the row kernels copy the rows the plan fills, the torch reference all NvS: serving takes the
                views).
                Until this step's `combine`, a dispatch of a new step (without a plan) raises: it would
                overwrite the views (two in-flight steps cannot share one Buffer; give each its own).
                Dispatches with a plan (backward) stay legal: forward dispatch -> combine -> backward
                dispatch(plan) -> combine.
            scales: the fp32 scales `[s, ceil(H/128)]` (any strides) of FP8 `hidden_sh`, one per row per 128
                columns (a tail tile has its own; `gemm.fp8.quantise_rows`, `cast_rows`), None otherwise:
                quantise, then dispatch (as vLLM does). Each row travels with its scales as one packed byte
                row (`fp8.wire`: H + 4*ceil(H/128) bytes, rounded up to 16; about half of bf16's) in
                the memory of the Buffer's rows, so it needs `packed_width(H) <= H * itemsize` (any H >= 16
                in bf16). Every destination row gets exactly the sender's bytes and scales, duplicates
                included; padding rows get zero values and zero scales. Combine stays in the Buffer's dtype.
            arg_names: how errors call the rows, route weights and expert ids (a facade over the Buffer
                passes its own arguments' names).

        A plan is valid for the operations after its dispatch (prefetch_weight, combine, reduce_grad) until
        the next dispatch of this Buffer; a backward `dispatch(plan=...)` makes an earlier plan of this
        Buffer valid again (activation recomputation, pipeline schedules). Other plans raise.

        Returns:
            `(hidden_nvsh [NvS, H], route_weights_nvs [NvS] or None, cu_seqlens [E+B] int32 or None, plan)`,
            and with `async_finish` a fifth item, the operation's `CommEvent` (MoonEP's convention: the
            event is appended only to an asynchronous dispatch). Rows of padding are zero; rows
            past `cu_seqlens[-1]` are unspecified. Raises before any exchange if an argument is malformed.
            With `scales`, `hidden_nvsh` is the pair `(rows [NvS, H] e4m3, scales [NvS, ceil(H/128)] fp32)`
            (DeepEP's convention): with `zero_copy`, views of the packed rows (row strides
            `packed_width(H)` and `packed_width(H) / 4` elements; they alias `hidden_nvsh_buffer_view`,
            so expert outputs written there overwrite them); else contiguous copies (of the rows up to
            `cu_seqlens[-1]`, as the bf16 rows).
        """
        self._check_dispatch(hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert, plan,
                             arg_names, scales)
        return self._dispatch(hidden_sh, route_weights_sk, topk_experts_sk, plan, async_finish, zero_copy,
                              router_weights_zero_copy, scales)

    def _check_dispatch(self, hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert,
                        plan: MoonEPCommPlan | None, names: tuple[str, str, str], scales=None) -> None:
        """`dispatch`'s argument checks; every error names the rank and the argument as `names` (hidden,
        route weights, expert ids) calls it, and `scales` as `scales`: the communicator checks its own
        arguments through this."""
        self._check_alive()
        device, rank = self.world.device, self.world.rank
        hidden_name, weights_name, topk_name = names
        if isinstance(hidden_sh, torch.Tensor) and (hidden_sh.dim() != 2 or hidden_sh.shape[0] > self.S):
            raise ValueError(f"rank {rank}: {hidden_name} must have shape [s <= S={self.S}, H={self.H}], got "
                             f"{list(hidden_sh.shape)}")
        num_tokens = hidden_sh.shape[0] if isinstance(hidden_sh, torch.Tensor) else 0
        fp8 = isinstance(hidden_sh, torch.Tensor) and hidden_sh.dtype == FP8_DTYPE
        if fp8 and scales is None:
            raise ValueError(f"rank {rank}: {hidden_name} is {FP8_DTYPE}: FP8 rows travel with their 1x128 "
                             f"scales, pass them as scales (float32 [s, {scale_columns(self.H)}])")
        if scales is not None:
            if isinstance(hidden_sh, torch.Tensor) and not fp8:
                raise ValueError(f"rank {rank}: scales is only for FP8 ({FP8_DTYPE}) {hidden_name}, got "
                                 f"{hidden_name} in {hidden_sh.dtype}")
            check_tensor(scales, "scales", (num_tokens, scale_columns(self.H)), torch.float32, device, rank)
            if not self.takes_fp8_rows:
                raise ValueError(f"rank {rank}: scales: FP8 rows of H={self.H} with their scales take "
                                 f"{packed_width(self.H)} bytes, more than this Buffer's {self.dtype} rows "
                                 f"({self._rows.local[0].nbytes} bytes) hold")
        check_tensor(hidden_sh, hidden_name, (num_tokens, self.H), FP8_DTYPE if fp8 else self.dtype, device,
                     rank)
        if route_weights_sk is not None:
            check_tensor(route_weights_sk, weights_name, (num_tokens, self.K), self.weight_dtype, device,
                         rank)
        if plan is not None:
            self._check_plan(plan, backward_dispatch=True)
            if plan.num_routes != num_tokens * self.K:
                raise ValueError(f"rank {rank}: {hidden_name} has {num_tokens} tokens, the plan was made for "
                                 f"{plan.num_routes // self.K}")
            return
        if self._pending_views is not None:
            raise RuntimeError(
                f"rank {rank}: Buffer {self.id}: a new step was dispatched while the previous step's "
                "zero-copy views have not been combined: two in-flight steps cannot share one Buffer. "
                "Combine the previous step first, give each in-flight step its own Buffer, or call "
                "end_step() if the previous step failed")
        ints = (torch.int32, torch.int64)
        check_tensor(topk_experts_sk, topk_name, (num_tokens, self.K), ints, device, rank)
        if tokens_per_expert is not None:
            check_tensor(tokens_per_expert, "tokens_per_expert", (self.E,), ints, device, rank)
        if route_weights_sk is None:
            raise ValueError(f"rank {rank}: {weights_name} is required when no plan is given")
        if self._validating():
            self._check_routing(topk_experts_sk, tokens_per_expert, topk_name)

    def _validating(self) -> bool:
        """`validate`, except while a CUDA graph is being captured (its host reads would break capture)."""
        cuda = self.world.device.type == "cuda"
        return self.validate and not (cuda and torch.cuda.is_current_stream_capturing())

    def _check_routing(self, topk_experts_sk: torch.Tensor, tokens_per_expert: torch.Tensor | None,
                       topk_name: str) -> None:
        """Expert ids in [-1, E), and `tokens_per_expert` (if given) their histogram. One host read of two
        flags: on a GPU this syncs (see `validate`)."""
        rank = self.world.rank
        bad_sk = (topk_experts_sk < -1) | (topk_experts_sk >= self.E)
        flags = [bad_sk.any()]
        if tokens_per_expert is not None:
            flags.append((expert_histogram(topk_experts_sk, self.E) != tokens_per_expert).any())
        bad_ids, *bad_counts = torch.stack(flags).tolist()
        if bad_ids:
            value = int(topk_experts_sk[bad_sk][0])
            raise ValueError(f"rank {rank}: {topk_name} holds expert id {value}: ids must be in "
                             f"[-1, E={self.E})")
        if any(bad_counts):
            counts_e = expert_histogram(topk_experts_sk, self.E)
            expert = int(torch.nonzero(counts_e != tokens_per_expert)[0])
            raise ValueError(f"rank {rank}: tokens_per_expert[{expert}] = {int(tokens_per_expert[expert])}, "
                             f"but {topk_name} routes {int(counts_e[expert])} tokens to expert {expert}: "
                             "tokens_per_expert must count the valid ids (or be None: the Buffer counts "
                             "them)")

    def _dispatch(self, hidden_sh, route_weights_sk, topk_experts_sk, plan: MoonEPCommPlan | None,
                  async_finish: bool, zero_copy: bool, router_weights_zero_copy: bool, scales=None):
        """`dispatch` after its checks."""
        step = self._steps + 1 if plan is None else plan.step
        exchange = self._exchange if scales is None else self._fp8_exchange

        def op():
            step_plan, cu_seqlens = plan, None
            if step_plan is None:
                kwargs = dict(num_slots=self.B, token_padding=self.token_padding, rows_per_rank=self.NvS,
                              owner=self.id, replica_cost=self.replica_cost)
                if self.R == 1:  # no peers to gather from: the planner counts the routes itself
                    step_plan = plan_one_rank(topk_experts_sk, self.E, **kwargs)
                else:
                    counts_re = self.world.all_gather(expert_histogram(topk_experts_sk, self.E))
                    step_plan = plan_routes(counts_re, topk_experts_sk, rank=self.world.rank, **kwargs)
                step_plan = replace(step_plan, step=step)
                cu_seqlens = step_plan.cu_seqlens
            rows_sh = hidden_sh if scales is None else pack_rows(hidden_sh, scales)
            self._send_rows(exchange, step_plan, rows_sh, route_weights_sk, record_duplicates=plan is None)
            rows_nvsh = self._received_rows(exchange, step_plan, zero_copy)
            weights_nvs = None
            if route_weights_sk is not None:
                weights_nvs = self._weights.local if router_weights_zero_copy else self._weights.local.clone()
            return rows_nvsh, weights_nvs, cu_seqlens, step_plan

        result, event = self._launch(async_finish, op, (hidden_sh, route_weights_sk, topk_experts_sk, plan,
                                                        scales))
        self._steps, self._current_step = max(self._steps, step), step
        if plan is None and (zero_copy or router_weights_zero_copy):
            self._pending_views = result[3]
        return (*result, event) if async_finish else result

    @staticmethod
    def _send_rows(exchange: RowExchange, plan: MoonEPCommPlan, rows_sh: torch.Tensor,
                   route_weights_sk: torch.Tensor | None, record_duplicates: bool) -> None:
        """Through `exchange` (the Buffer's, or its packed FP8 one with packed `rows_sh`): every route's
        payload row (primaries only) and weight to its destination row; the duplicate pairs too when
        `record_duplicates` (the forward dispatch, which fills the plan's dup tables). Then zero the padding
        rows and copy each primary row into its duplicates (the rows the plan fills)."""
        exchange.send_routes(plan, rows_sh, route_weights_sk, record_duplicates)
        if record_duplicates:
            exchange.record_duplicates(plan)
        exchange.fill_rows(plan)

    def _received_rows(self, exchange: RowExchange, plan: MoonEPCommPlan, zero_copy: bool):
        """The rows a dispatch through `exchange` left: the Buffer's `[NvS, H]` rows, or with the packed FP8
        exchange the pair (e4m3 rows, scales) unpacked from them; views with `zero_copy`, else copies (of
        the rows the plan fills, where the exchange can bound the copy: the rest is unspecified)."""
        if exchange is self._exchange:
            return self._rows.local if zero_copy else exchange.filled_copy(self._rows.local, plan)
        views = unpack_rows(exchange.memory.rows.local, self.H)
        return views if zero_copy else tuple(exchange.filled_copy(view, plan) for view in views)

    # -- combine --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def combine(self, plan: MoonEPCommPlan, hidden_nvsh: torch.Tensor,
                route_weights_nvs: torch.Tensor | None = None, async_finish: bool = False, *,
                zero_copy: bool = False, out_sh: torch.Tensor | None = None, arg_name: str = "hidden_nvsh"):
        """Bring every route's row home and sum each token's K rows in fp32, in k order.

        Args:
            plan: the plan of this Buffer's latest dispatch.
            hidden_nvsh: `[NvS, H]` expert outputs in the Buffer's dtype, unweighted sums: the experts apply
                the route weights. With `zero_copy` it must be `hidden_nvsh_buffer_view` itself.
            route_weights_nvs: optional `[NvS]` fp32 per-row values gathered back per route (backward: the
                route-weight gradients): copied into the Buffer unless it is `router_weight_buffer_view`
                (`zero_copy` or not).
            out_sh: where to write the sums: a contiguous `[s, H]` tensor in the Buffer's dtype on its device
                (returned as `hidden_sh`); None: a new tensor.
            arg_name: how errors call `hidden_nvsh` (a facade over the Buffer passes its own name).

        Returns:
            `(hidden_sh [s, H] in the Buffer's dtype, route_weights_sk [s, K] or None, event)`, the event a
            `CommEvent` with `async_finish`, else None; invalid routes contribute zero.
        """
        self._check_combine(plan, hidden_nvsh, route_weights_nvs, zero_copy, arg_name)
        if out_sh is not None:
            check_tensor(out_sh, "out_sh", (plan.num_routes // self.K, self.H), self.dtype, self.world.device,
                         self.world.rank)
            if not out_sh.is_contiguous():
                raise ValueError(f"rank {self.world.rank}: out_sh must be contiguous")
        return self._combine(plan, hidden_nvsh, route_weights_nvs, zero_copy, async_finish, out_sh)

    def _check_combine(self, plan: MoonEPCommPlan, hidden_nvsh, route_weights_nvs, zero_copy: bool,
                       hidden_name: str) -> None:
        """`combine`'s argument checks; errors name the rank and the rows as `hidden_name` calls them."""
        self._check_alive()
        self._check_plan(plan)
        device, rank = self.world.device, self.world.rank
        check_tensor(hidden_nvsh, hidden_name, (self.NvS, self.H), self.dtype, device, rank)
        if route_weights_nvs is not None:
            check_tensor(route_weights_nvs, "route_weights_nvs", (self.NvS,), self.weight_dtype, device, rank)
        if zero_copy and hidden_nvsh.data_ptr() != self._rows.local.data_ptr():
            raise ValueError(f"rank {rank}: zero_copy=True needs {hidden_name} to be this Buffer's own view "
                             "(hidden_nvsh_buffer_view), got another tensor")

    def _combine(self, plan: MoonEPCommPlan, hidden_nvsh, route_weights_nvs, zero_copy: bool,
                 async_finish: bool, out_sh: torch.Tensor | None = None):
        """`combine` after its checks; the tokens' sums are written into `out_sh` when given (a contiguous
        `[s, H]` tensor in the Buffer's dtype on its device, checked by the caller) and returned."""
        if plan is self._pending_views:
            self._pending_views = None

        def op():
            own_nvs = self._weights.local
            if route_weights_nvs is not None and route_weights_nvs.data_ptr() != own_nvs.data_ptr():
                own_nvs.copy_(route_weights_nvs)
            return self._exchange.combine(plan, hidden_nvsh, zero_copy, route_weights_nvs is not None, out_sh)

        (out_sh, weights_sk), event = self._launch(async_finish, op, (plan, hidden_nvsh, route_weights_nvs))
        return out_sh, weights_sk, event

def _release(world: EPWorld, keys: list[str], unreleased: str | None = None) -> None:
    """Forget this rank's registrations of `keys`; `unreleased` names a Buffer created with
    `explicitly_destroy=True` that is being garbage-collected without `destroy()` (warned about)."""
    if unreleased is not None:
        warnings.warn(f"{unreleased} was created with explicitly_destroy=True and garbage-collected without "
                      "destroy(): releasing its symmetric memory now; call destroy() (collectively, on every "
                      "rank) when done with it", ResourceWarning, stacklevel=2)
    for key in keys:
        world.release(key)
