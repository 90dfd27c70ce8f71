"""`MoECommunicator`: a framework-neutral facade over the comm core for inference engines.

Notation and suffixes: DESIGN.md, "Notation" (`t`: the engine's tokens of this rank in a step, t <= S; `nv`:
rows of the Buffer serving the step; `g`: this rank's compute groups, `epn` home experts then B slots).

It follows the shape of the MSCCL++ expert-parallel API draft: one object per layer shape, `dispatch` returns
the tokens in an expert-major layout plus an opaque handle, the engine runs its own expert GEMMs on that
layout, `combine` brings the results home. One step, on every rank of the EP group:

1. `out, handle = comm.dispatch(hidden_th, topk_ids_tk, weights_tk)`: plan (identically on every rank) and
   move each route's row to the rank and row where it is computed. `out.tokens_nvsh` is grouped by
   compute group: group g covers rows `[offsets_g[g-1], offsets_g[g])` and holds `expert_ids_g[g]`.
   With `quantization='fp8_e4m3'` the engine quantises first and passes e4m3 rows with `scales=`; they
   arrive as `out.tokens_nvsh` and `out.scales_nvsh`, half the bytes of bf16 on the wire.
2. `comm.prefetch_weights(handle, layout)`: copy the replicated experts into this rank's slots (the engine's
   `ExpertLayout`), so slot groups can be computed with slot weights.
3. The engine runs the experts per group and multiplies each row by `out.weights_nvs` (padding rows are
   zero, so it may compute whole padded groups).
4. `hidden_th = comm.combine(expert_output_nvsh, handle)`: each token's K rows summed in fp32 (or
   `comm.combine(expert_output_nvsh, handle, out=output_th)`: written into the caller's tensor).

Steps with fewer tokens than S are served by a `BufferPool` (the smallest power-of-two capacity that fits
the group's largest step), so a decode step never pays for S. Invalid routes (expert -1) are padding: not
counted, not sent, zero in combine; pad with -1, never with expert 0.

Streams. `dispatch` / `combine` / `prefetch_weights` run on the caller's current stream. `dispatch_async` /
`combine_async` queue the step on the Buffer's comm stream after the caller's queued work and return a
`CommRequest` at once: `is_completed()` is False until the device has finished it, `wait()` orders the
caller's stream after it (an event; the host does not block) and returns the result.

CUDA graphs (engines capture one graph per batch-size bucket). A step reads nothing on the host when (a) the
bucket is named: `dispatch(..., capacity=bucket)`, one of `comm.capacities`, the same on every rank, (b)
`check_expert_ids=False` (or while capturing, where the expert-id checks are skipped) and (c) the world's
barriers are device-side (one rank, or the symmetric-memory world; the threads world's barriers with R > 1
block the host). Capture dispatch -> experts -> combine with static `[bucket, H]` / `[bucket, K]` inputs,
then replay with new routing and any t <= bucket real tokens, the rest padded with expert -1 (their outputs
are zero).

Two steps in flight (two-batch overlap): with `max_inflight_steps=2` each dispatched, not yet combined step
of one capacity gets its own Buffer, so `dispatch(A); dispatch(B); ...; combine(A); combine(B)` equals
running A and B one by one. The layout's slots hold one step's replicas: prefetch and run a step's experts
before the next step's `prefetch_weights`.

What is supported is stated by the `supports_*` properties; every unsupported option raises at construction
or at the first call with a message naming what is supported.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import torch
from pydantic import Field, StrictInt

from moonep_moe.base.sizes import LAYOUT_NAMES, check_layout, default_slots
from moonep_moe.comm.buffer import Buffer
from moonep_moe.comm.event import CommEvent
from moonep_moe.comm.pool import BufferPool
from moonep_moe.config import CommConfig, MoEConfig
from moonep_moe.engine.layout import ExpertLayout
from moonep_moe.fp8.format import FP8_DTYPE
from moonep_moe.fp8.wire import packed_width
from moonep_moe.plan.types import MoonEPCommPlan
from moonep_moe.transport.world import EPWorld

T = TypeVar("T")
_communicator_ids = itertools.count()

FACADE_DISPATCH_NAMES = ("input_th", "weights_tk", "topk_ids_tk")
"""How `MoECommunicator.dispatch` calls the rows, route weights and expert ids (in its errors)."""


class CommunicatorConfig(CommConfig):
    """What the communicator needs of a layer: the comm fields (`CommConfig`: H, E, K, S, R, B, tp, dtype;
    `ep_size` None takes the world's size, if given it must equal it) and the facade's own options."""

    num_local_experts: StrictInt | None = Field(None, ge=1, description=(
        "Explicit expert placement: home experts per rank. Default None = E / R, the only placement "
        "supported (contiguous blocks); another value raises."))
    local_expert_start: StrictInt | None = Field(None, ge=0, description=(
        "Explicit expert placement: this rank's first home expert. Default None = rank * E / R, the only "
        "placement supported; another value raises."))
    variable_tokens: bool = Field(True, description=(
        "Serve each step from a pool of power-of-two capacities (one extra all-gather of one int per "
        "step, read on the host). False: one Buffer of capacity S for every step, no token counts "
        "gathered (and `min_capacity` unused)."))
    min_capacity: StrictInt = Field(1, ge=1, description=(
        "Smallest pooled capacity (bounds how many Buffers the pool creates). Default 1."))
    max_inflight_steps: StrictInt = Field(1, ge=1, description=(
        "Steps of one capacity that may be dispatched and not yet combined at once; each gets its own Buffer "
        "(memory: that many Buffers per capacity used). Default 1; 2 for two-batch overlap."))
    check_expert_ids: bool = Field(True, description=(
        "Check in dispatch that every expert id is in [-1, E), naming the bad id. A host read: on a GPU it "
        "synchronises the caller's stream (skipped while a CUDA graph is captured). Engines that overlap "
        "steps or need a sync-free dispatch set False."))
    expert_bias: bool = Field(False, description=(
        "Bias terms in the expert projections (e.g. GPT-OSS). Not supported: True raises at construction."))
    quantization: Literal["none", "fp8_e4m3", "mxfp8"] = Field("none", description=(
        "Quantised dispatch of activations. 'none' (default): rows in the config's dtype. 'fp8_e4m3': the "
        "engine quantises, then dispatches (as vLLM does): `dispatch` takes e4m3 rows with their 1x128 fp32 "
        "scales (`scales=`) and returns both, about half the bytes of bf16 on the wire; combine stays in the "
        "config's dtype. Needs H >= 16 in bf16 (the packed rows live in the rows' memory). 'mxfp8' is not "
        "supported and raises at construction."))

    @classmethod
    def from_moe_config(cls, config: MoEConfig, **overrides: Any) -> CommunicatorConfig:
        """The comm fields of a layer's `MoEConfig` (`MoEConfig.comm`), with `overrides` applied."""
        return cls(**{**config.comm.model_dump(), **overrides})


@dataclass(frozen=True)
class DispatchOutput:
    """What the expert runner consumes (all on the world's device).

    Attributes:
        tokens_nvsh: `[NvS, H]` rows grouped by compute group; padding rows zero. A view of the Buffer's
            persistent rows: valid until this step's combine (the next dispatch overwrites it). With
            `quantization='fp8_e4m3'` e4m3 rows (row stride `fp8.wire.packed_width(H)` bytes), exactly
            the bytes each token's sender passed.
        weights_nvs: `[NvS]` fp32 route weight of each row (zero on padding), or None when dispatch got no
            weights (the rows are then summed unweighted).
        num_tokens_per_expert_g: `[epn+B]` int32 valid rows of each compute group (padding excluded).
        offsets_g: `[epn+B]` int32 padded end row of each compute group (the `cu_seqlens` of this rank's
            home experts, then its slots); group g starts at `offsets_g[g-1]` (0 for g = 0).
        expert_ids_g: `[epn+B]` int32 global expert of each group: the home experts in order, then the
            expert held by each slot, -1 for an unused slot (its group is empty).
        scales_nvsh: with `quantization='fp8_e4m3'`, `[NvS, ceil(H/128)]` fp32 the 1x128 scales of
            `tokens_nvsh`'s rows (the sender's, exactly; zero on padding), a view like `tokens_nvsh` (row
            stride `packed_width(H) / 4`; DeepGEMM's sm90 GEMM wants them MN-major: copy them with
            `gemm.fp8.to_deep_gemm_row_scales`); None otherwise.
    """

    tokens_nvsh: torch.Tensor
    weights_nvs: torch.Tensor | None
    num_tokens_per_expert_g: torch.Tensor
    offsets_g: torch.Tensor
    expert_ids_g: torch.Tensor
    scales_nvsh: torch.Tensor | None = None


@dataclass(eq=False)
class DispatchHandle:
    """Opaque state of one dispatched step, consumed by `combine` and `prefetch_weights` of the communicator
    that made it. Holds the Buffer serving the step, its plan and the token count; engines must not read
    or change it. One combine per handle."""

    _owner: int
    _buffer: Buffer
    _plan: MoonEPCommPlan
    _num_tokens: int
    _combined: bool = field(default=False)


class CommRequest(Generic[T]):
    """An operation started by `dispatch_async` / `combine_async`, queued on the Buffer's comm stream (on
    CUDA) behind an event. Nothing of the step may be used before `wait()`.

    Off CUDA (CPU worlds) the operation has completed before the call returns: `is_completed()` is True at
    once and `wait()` only builds the result.
    """

    def __init__(self, finish: Callable[[], T], event: CommEvent):
        self._finish, self._event = finish, event
        self._result: tuple[T] | None = None

    def is_completed(self) -> bool:
        """Whether the queued operation has finished on the device (True off CUDA). Does not block."""
        return self._event.query()

    def wait(self) -> T:
        """Make the caller's current stream wait for the operation (the host does not block) and return its
        result, built on that stream after the wait. Later calls return the same result."""
        if self._result is None:
            self._event.wait()
            self._result = (self._finish(),)
        return self._result[0]


class MoECommunicator:
    """Dispatch / combine for one layer shape on one rank of an EP group, for engines that run their own
    experts. Owns its Buffers (created lazily, released by `destroy()`); holds no weights.

    Args:
        config: a `CommunicatorConfig`, a `CommConfig` or a `MoEConfig` (its comm fields are used), or None.
        world: the EP world of this rank (`moonep_moe.transport.world`).
        **kwargs: `CommunicatorConfig` fields, overriding the config's (or the whole config when it is None).

    Raises:
        NotImplementedError: an unsupported option (expert bias, mxfp8 dispatch), naming what is supported.
        ValueError: an invalid shape or placement (E not divisible by R, placement other than contiguous
            blocks, B out of range).
    """

    supports_variable_tokens = True
    """Steps may carry any t <= S tokens; padding routes (-1) are neither counted nor sent."""
    supports_async = True
    """`dispatch_async` / `combine_async` return a `CommRequest` at once; the step runs on the comm stream and
    `is_completed()` is False until the device has finished it. The host does not block when `capacity=` is
    given, `check_expert_ids=False` and the world's barriers are device-side (one rank, symmetric memory);
    the threads world with R > 1 synchronises at its barriers. Implemented, not yet run on a GPU
    (`test_async_request_returns_before_the_device_is_done`); off CUDA a request completes before
    returning."""
    supports_cuda_graph = True
    """dispatch -> experts -> combine captured in a CUDA graph per capacity bucket (`capacity=`), replayed
    with new routing and any t <= bucket real tokens (padding: expert -1), under the conditions of the module
    docstring. Implemented, not yet run on a GPU (`test_cuda_graph_per_bucket_replays_new_routing` and
    `tests/test_engine_contract.py`)."""
    supports_quantized_dispatch = True
    """With `quantization='fp8_e4m3'`, `dispatch(q_th, ..., scales=scales_th)` moves e4m3 rows with their
    1x128 fp32 scales (one packed byte row each, `fp8.wire`: about half of bf16's bytes) and returns
    both (`DispatchOutput.tokens_nvsh`, `.scales_nvsh`), exactly the sender's bytes; combine stays in the
    config's dtype. mxfp8 is refused at construction."""
    supports_expert_bias = False
    """Expert projections without bias terms only; `prefetch_weights` copies weights, never biases."""
    supports_multiple_inflight_steps = True
    """With `max_inflight_steps=n`, up to n steps of one capacity in flight at once (dispatched, not
    combined), each on its own Buffer (two-batch overlap: n = 2); one step per Buffer."""
    supports_backward = False
    """Forward (serving) only; training uses `MoonEPMoELayer`, whose backward reuses the forward plan."""

    def __init__(self, config: CommConfig | None = None, *, world: EPWorld,
                 **kwargs: Any):
        if isinstance(config, MoEConfig):
            config = CommunicatorConfig.from_moe_config(config, **kwargs)
        elif config is None:
            config = CommunicatorConfig(**kwargs)
        elif kwargs or not isinstance(config, CommunicatorConfig):  # a CommConfig, or overrides
            config = CommunicatorConfig(**{**config.model_dump(), **kwargs})
        _check_supported(config, world)
        self.config, self.world = config, world
        E, R = config.num_experts, world.size
        self.num_local_experts = E // R
        """epn: home experts on this rank."""
        self.local_expert_start = world.rank * self.num_local_experts
        """This rank's first home expert; it owns `[local_expert_start, local_expert_start + epn)`."""
        slots = config.num_prefetch_slots
        self.num_slots = default_slots(E, R) if slots is None else slots
        self.dtype = getattr(torch, config.dtype)
        self.id = next(_communicator_ids)
        capacity = config.max_tokens_per_rank
        smallest = config.min_capacity if config.variable_tokens else capacity
        self._pool = BufferPool(capacity, config.hidden_size, config.top_k, E, world=world,
                                num_slots=self.num_slots, token_padding=config.token_padding,
                                dtype=self.dtype, min_capacity=smallest,
                                max_inflight_steps=config.max_inflight_steps,
                                validate=config.check_expert_ids, replica_cost=config.replica_cost)

    @classmethod
    def capabilities(cls) -> dict[str, bool]:
        """Every `supports_*` property by name."""
        return {name: getattr(cls, name) for name in dir(cls) if name.startswith("supports_")}

    def capacity_for(self, num_tokens: int) -> int:
        """Collective: the token capacity of the Buffer that serves a step with `num_tokens` tokens here."""
        return self._pool.capacity_for(num_tokens)

    @property
    def capacities(self) -> list[int]:
        """The capacity buckets a step may name (`dispatch(..., capacity=)`), ascending; the largest is S."""
        return self._pool.capacities

    # -- dispatch -------------------------------------------------------------------------------------------

    def dispatch(self, input_th: torch.Tensor, topk_ids_tk: torch.Tensor,
                 weights_tk: torch.Tensor | None = None, *, capacity: int | None = None,
                 scales: torch.Tensor | None = None) -> tuple[DispatchOutput, DispatchHandle]:
        """Collective: send every route's row (and weight) to the rank and row where it is computed, on the
        caller's current stream.

        Args:
            input_th: `[t, H]` rows in the config's dtype, t <= S (t may differ per rank); with
                `quantization='fp8_e4m3'` e4m3 rows (`float8_e4m3fn`).
            topk_ids_tk: `[t, K]` int32/int64 experts in [-1, E); -1 = no route (padding).
            weights_tk: `[t, K]` fp32 (float64 for float64 rows) route weights, or None (unweighted sum).
            capacity: the capacity bucket serving the step, one of `capacities`, >= t and the same on every
                rank; None = the smallest that fits the group's largest t (one all-gather read on the host
                when R > 1). Required while a CUDA graph is captured.
            scales: with `quantization='fp8_e4m3'`, `[t, ceil(H/128)]` fp32 the 1x128 scales of `input_th`
                (any strides, e.g. MN-major); None otherwise.

        Returns:
            `(DispatchOutput, DispatchHandle)`. Raises before any exchange on malformed input.
        """
        return self._dispatch(input_th, topk_ids_tk, weights_tk, capacity, scales, async_finish=False)

    def dispatch_async(self, input_th: torch.Tensor, topk_ids_tk: torch.Tensor,
                       weights_tk: torch.Tensor | None = None, *, capacity: int | None = None,
                       scales: torch.Tensor | None = None
                       ) -> CommRequest[tuple[DispatchOutput, DispatchHandle]]:
        """`dispatch` queued on the comm stream; `wait()` returns `(DispatchOutput, DispatchHandle)` (see
        `supports_async`)."""
        return self._dispatch(input_th, topk_ids_tk, weights_tk, capacity, scales, async_finish=True)

    def _dispatch(self, input_th, topk_ids_tk, weights_tk, capacity: int | None, scales,
                  async_finish: bool):
        """Check the arguments under their names here, then run the step on the serving Buffer: on the
        caller's stream (`dispatch`), or queued on its comm stream behind a request (`dispatch_async`)."""
        self._check_alive()
        rank, max_tokens = self.world.rank, self.config.max_tokens_per_rank
        if not isinstance(input_th, torch.Tensor) or input_th.dim() != 2 or input_th.shape[0] > max_tokens:
            raise ValueError(f"rank {rank}: input_th must be a [t <= max_tokens_per_rank={max_tokens}, "
                             f"H={self.config.hidden_size}] tensor, got "
                             f"{list(getattr(input_th, 'shape', [])) or type(input_th).__name__}")
        fp8 = self.config.quantization == "fp8_e4m3"
        if not fp8 and (input_th.dtype == FP8_DTYPE or scales is not None):
            given = f"{input_th.dtype}{'' if scales is None else ' with scales'}"
            raise ValueError(f"rank {rank}: quantised dispatch ({given}) needs quantization='fp8_e4m3', this "
                             f"communicator's is {self.config.quantization!r}: pass the activations in "
                             f"{self.dtype}, or build it with quantization='fp8_e4m3'")
        if fp8 and input_th.dtype != FP8_DTYPE:
            raise ValueError(f"rank {rank}: quantization='fp8_e4m3': input_th must be {FP8_DTYPE} rows with "
                             f"their scales=, got {input_th.dtype}")
        num_tokens = input_th.shape[0]
        buffer = self._pool.get(num_tokens, capacity)
        weighted = weights_tk is not None
        if not weighted and isinstance(topk_ids_tk, torch.Tensor):
            weights_tk = torch.ones(topk_ids_tk.shape, dtype=buffer.weight_dtype, device=input_th.device)
        # `event`: [] on the caller's stream, [its CommEvent] with async_finish (the Buffer appends it)
        rows_nvsh, weights_nvs, _, plan, *event = buffer.dispatch(
            input_th, weights_tk, topk_ids_tk, async_finish=async_finish, zero_copy=True,
            router_weights_zero_copy=weighted, scales=scales, arg_names=FACADE_DISPATCH_NAMES)
        tokens_nvsh, scales_nvsh = rows_nvsh if fp8 else (rows_nvsh, None)
        handle = DispatchHandle(self.id, buffer, plan, num_tokens)

        def finish() -> tuple[DispatchOutput, DispatchHandle]:
            output = self._layout(tokens_nvsh, weights_nvs if weighted else None, plan, scales_nvsh)
            return output, handle

        return CommRequest(finish, *event) if async_finish else finish()

    @staticmethod
    def _layout(tokens_nvsh, weights_nvs, plan: MoonEPCommPlan, scales_nvsh=None) -> DispatchOutput:
        """The step's `DispatchOutput`: the rows (and FP8 scales) and views of the planner's
        `compute_groups` (no op)."""
        offsets_g, routes_g, expert_ids_g = plan.compute_groups.unbind()
        return DispatchOutput(tokens_nvsh, weights_nvs, routes_g, offsets_g, expert_ids_g, scales_nvsh)

    # -- weights --------------------------------------------------------------------------------------------

    def prefetch_weights(self, handle: DispatchHandle, layout: ExpertLayout) -> None:
        """Collective: copy the experts this step replicates into this rank's slots of `layout`, so the
        runner can compute the slot groups (`expert_ids_g[epn:]`) with `layout.*.slots`; FP8 experts with
        their block scales (`layout.*_scales.slots`), half the bytes of bf16."""
        self._check_handle(handle)
        if not isinstance(layout, ExpertLayout):
            raise TypeError(f"rank {self.world.rank}: layout must be an ExpertLayout, got "
                            f"{type(layout).__name__}")
        expected = (self.config.num_experts, self.local_expert_start, self.num_local_experts, self.num_slots)
        given = (layout.num_experts, layout.local_expert_start, layout.num_local_experts, layout.num_slots)
        if given != expected:
            raise ValueError(f"rank {self.world.rank}: layout has (E, local_expert_start, num_local_experts, "
                             f"B) = {given}, this communicator {expected}")
        handle._buffer.prefetch_weight(handle._plan, layout.gate_up, None, layout.down, layout.scales)

    # -- combine --------------------------------------------------------------------------------------------

    def combine(self, expert_output_nvsh: torch.Tensor, handle: DispatchHandle, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Collective: sum every token's K expert rows in fp32 (in k order) -> `[t, H]` in the config's dtype,
        on the caller's current stream.

        Args:
            expert_output_nvsh: `[NvS, H]` the runner's output per dispatched row, already multiplied by
                `weights_nvs`; may be `tokens_nvsh` itself, written in place. Rows past the groups are
                ignored. With `quantization='fp8_e4m3'` it is in the config's dtype, and the FP8 tokens
                share the memory of the Buffer's rows: write it there only once they are consumed.
            handle: this step's handle (one combine per handle).
            out: optional `[t, H]` tensor in the config's dtype on the world's device (a modular kernel's
                `output`): the result is written into it (one `[t, H]` copy) and it is returned.
        """
        return self._combine(expert_output_nvsh, handle, out, async_finish=False)

    def combine_async(self, expert_output_nvsh: torch.Tensor, handle: DispatchHandle, *,
                      out: torch.Tensor | None = None) -> CommRequest[torch.Tensor]:
        """`combine` queued on the comm stream; `wait()` returns `[t, H]` (`out` when given, written on the
        caller's stream after the wait; see `supports_async`)."""
        return self._combine(expert_output_nvsh, handle, out, async_finish=True)

    def _combine(self, expert_output_nvsh, handle: DispatchHandle, out: torch.Tensor | None,
                 async_finish: bool):
        """Check the arguments under their names here, then combine on the caller's stream (`combine`) or
        queued on the comm stream behind a request (`combine_async`)."""
        self._check_handle(handle)
        if handle._combined:
            raise RuntimeError(f"rank {self.world.rank}: this DispatchHandle was already combined: one "
                               "combine per dispatch")
        buffer = handle._buffer
        if out is not None:
            expected = (handle._num_tokens, self.config.hidden_size)
            if (not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != self.dtype
                    or out.device != self.world.device):
                got = (f"{list(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
                       else type(out).__name__)
                raise ValueError(f"rank {self.world.rank}: out must be a {list(expected)} {self.dtype} "
                                 f"tensor on {self.world.device}, got {got}")
        in_place = (isinstance(expert_output_nvsh, torch.Tensor)
                    and expert_output_nvsh.data_ptr() == buffer.hidden_nvsh_buffer_view.data_ptr())
        # eagerly the sums go straight into `out` (no [t, H] copy); a request writes it after its wait
        into = out if out is not None and out.is_contiguous() and not async_finish else None
        out_th, _, event = buffer.combine(handle._plan, expert_output_nvsh, None, async_finish,
                                          zero_copy=in_place, out_sh=into, arg_name="expert_output_nvsh")
        handle._combined = True

        def finish() -> torch.Tensor:
            return out_th if out is None or into is not None else out.copy_(out_th)

        return CommRequest(finish, event) if async_finish else finish()

    def discard(self, handle: DispatchHandle) -> None:
        """Give up a step that failed between dispatch and combine, so that the next dispatch may run.
        Collective when the failure happened on every rank; the handle cannot be combined afterwards."""
        self._check_handle(handle)
        handle._combined = True
        handle._buffer.end_step()

    # -- lifetime -------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """The Buffer pool's capacities and bytes on this rank (`BufferPool.stats`)."""
        return self._pool.stats()

    def destroy(self) -> None:
        """Release every Buffer. Idempotent; later calls raise."""
        self._pool.destroy()

    def _check_alive(self) -> None:
        if self._pool.destroyed:
            raise RuntimeError(f"rank {self.world.rank}: this MoECommunicator was destroyed; create a new "
                               "one")

    def _check_handle(self, handle: DispatchHandle) -> None:
        self._check_alive()
        if not isinstance(handle, DispatchHandle) or handle._owner != self.id:
            raise ValueError(f"rank {self.world.rank}: handle must be a DispatchHandle returned by this "
                             "communicator's dispatch")


def _check_supported(config: CommunicatorConfig, world: EPWorld) -> None:
    """Raise before anything is allocated if the config asks for what this implementation cannot do."""
    where = f"rank {world.rank}"
    if config.expert_bias:
        raise NotImplementedError(f"{where}: expert_bias=True: expert projections with bias terms are not "
                                  "supported (prefetch copies weights only); supported: expert_bias=False")
    if config.quantization == "mxfp8":
        raise NotImplementedError(f"{where}: quantization='mxfp8' is not supported; supported: 'none' (rows "
                                  "in the config's dtype) and 'fp8_e4m3' (e4m3 rows with 1x128 fp32 scales)")
    H, row_bytes = config.hidden_size, config.hidden_size * getattr(torch, config.dtype).itemsize
    if config.quantization == "fp8_e4m3" and packed_width(H) > row_bytes:
        raise ValueError(f"{where}: quantization='fp8_e4m3' with hidden_size={H}: e4m3 rows with their "
                         f"scales take {packed_width(H)} bytes, more than a {config.dtype} row's {row_bytes}")
    E, R = config.num_experts, world.size
    if config.ep_size is not None and config.ep_size != R:
        raise ValueError(f"{where}: ep_size={config.ep_size} does not match the world's size {R}")
    names = {**LAYOUT_NAMES, "R": "ep_size (R={})" if config.ep_size is not None else "the EP size (R={})"}
    check_layout(E, R, config.top_k, config.num_prefetch_slots, names, where)
    epn = E // R
    placement = (config.num_local_experts, config.local_expert_start)
    if placement[0] not in (None, epn) or placement[1] not in (None, world.rank * epn):
        raise ValueError(f"{where}: expert placement (num_local_experts, local_expert_start) = {placement} "
                         f"is not supported: only contiguous blocks, (E/R, rank*E/R) = "
                         f"({epn}, {world.rank * epn})")
    if config.min_capacity > config.max_tokens_per_rank:
        raise ValueError(f"{where}: min_capacity ({config.min_capacity}) must be <= max_tokens_per_rank "
                         f"({config.max_tokens_per_rank})")
