"""`MoonEPExperts`: dispatch -> prefetch -> grouped-GEMM experts -> combine as one autograd Function.

Shapes use the suffix letters of DESIGN.md, "Notation" (`g`: this rank's `epn + B` compute groups, home
experts then slots).

Forward, on every rank:
1. `Buffer.dispatch`: plan from the gathered histogram, rows and route weights to their expert-grouped rows
   (as FP8 rows with their scales under `fp8_dispatch`, and where an FP8 layer's backward does not read
   them: `dispatches_fp8`).
2. `Buffer.prefetch_weight`: replicated experts' weights into this rank's slots (with
   `MoEConfig.overlap_prefetch` on the comm stream). It does not wait for the peers reading this rank's
   experts (`wait_for_readers=False`): combine's barriers order those reads.
3. `ab = x @ gate_up^T` (one grouped GEMM for gate and up; with `overlap_prefetch` the home experts' groups
   first, then a device-side wait for the prefetch, then the slots' groups: `SlotsReady`, so the replicas'
   link time hides under the home experts' GEMM where the backend can split it), `hw = silu(a) * b * w`
   (the route weight applied per row), `y = hw @ down^T` (grouped GEMM). Before FP8 GEMMs SwiGLU writes hw
   as the e4m3 rows down multiplies (`hands_fp8_rows`), and in backward dab also as gate_up's dgrad takes it.
4. `Buffer.combine`: each token's K rows summed in fp32.

Backward reuses the forward plan (never plans again):
1. `dispatch(grad_out, plan=plan, zero_copy=True)` brings the gradient to the rows (used in place, no
   copy); `prefetch_weight` again (later layers overwrote the shared slot pool).
2. down: `u = dy @ down` (dgrad; with `overlap_prefetch` split as forward's first GEMM); the
   fused SwiGLU backward gives `dab`, the route-weight gradient per row and, recomputed in the same pass,
   `hw`; `dW_down = dy^T hw` (wgrad into this step's home grads and the slot grads), dy's last reader;
   then `dx = dab @ gate_up` (dgrad) into the Buffer's rows, which dy no longer needs.
3. `combine(plan, dx, grad_w)` on the comm stream (input and route-weight gradients back to the tokens)
   beside `dW_gate_up = dab^T x` (wgrad) on the caller's: its link time can hide under the GEMM (on the
   H200 its kernels find no free SM while torch's grouped GEMM runs, so they mostly follow it). One rank
   without slots (EP=1) saves no copy of x in forward: its backward combines first, then gathers x again
   into the Buffer's rows (a local copy, the bytes the saved copy cost) for that wgrad.
The GEMM before each combine (forward's down, backward's gate_up dgrad) writes its rows into the Buffer's
rows where its backend can (`GroupedGemm.fwd`'s `out`: DeepGEMM, FP8, the reference), so combine reads them
there instead of copying `[NvS, H]` in.
Unless the graph is kept (`retain_graph`), each saved activation is freed after its last reader, and the
SwiGLU backward writes dab over ab, as a compiled graph's backward frees its saved tensors.
4. `reduce_grad`: every replica's fp32 gradient added into its home expert's, slots cleared. With
   `MoEConfig.overlap_reduce_grad` it runs on the comm stream behind the rest of the backward pass (the
   layers before this one) where autograd reads the gradients only after the pass
   (`grads_read_after_backward`): the next routed operation on the EP group, and the end of the pass
   (an autograd callback), wait for it on the device (`Buffer.wait_behind`).
A frozen projection (`requires_grad=False` on `experts.gate_up` or `experts.down`) gets no weight gradient:
no wgrad GEMM, nothing in `reduce_grad`, no `main_grad` allocated; its weights still carry the input's and
the route weights' gradients (dgrad). `reduce_grad` is collective, so freeze the same projections on every
rank of the EP group (replicas of a rank's experts train on its peers).

Home gradients (`MoEConfig.expert_grad_dtype`): "param" has the wgrad GEMM make them in the parameters' dtype
(fp32 accumulation inside the GEMM; with `torch._grouped_mm` its own output, no copy) and hands them to
autograd as `.grad`, or, where `.grad` already holds earlier micro-batches' gradients, add into it and hand
it back (`accumulating_grads`: no second gradient-sized tensor, no separate add pass); "main_grad" adds wgrad
straight into each parameter's persistent fp32 `main_grad` (the slot gradients are zero between steps, so
adding into them is exact too) and hands autograd None (a placeholder for a parameter under Megatron-Core's
grad-buffer protocol: `weights.experts.main_grad_added`).

Under `torch.compile` the whole Function runs eagerly between compiled graphs (`compile_break.run_eagerly`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonep_moe.base.triton import triton_missing_reason
from moonep_moe.comm.buffer import Buffer
from moonep_moe.gemm.base import Fp8RowsGemm, GroupedGemm, SlotsReady, casts_rows
from moonep_moe.layers.swiglu import (
    fp8_tiles_reason,
    swiglu_backward_rows,
    swiglu_weighted,
    swiglu_weighted_fp8,
)
from moonep_moe.plan.types import MoonEPCommPlan
from moonep_moe.weights.experts import HomeExperts, main_grad_added


@dataclass
class ExpertsState:
    """What the Function needs besides tensors: the comm core, the experts and the GEMM backend. Holds the
    plan of the last forward (telemetry reads it; backward keeps its own reference)."""

    buffer: Buffer
    experts: HomeExperts
    gemm: GroupedGemm
    main_grad: bool = False
    """`MoEConfig.expert_grad_dtype == "main_grad"`: wgrad adds into the parameters' `main_grad`."""
    fp8_dispatch: bool = False
    """`MoEConfig.fp8_dispatch`: the tokens are quantised by the GEMM backend, an `Fp8RowsGemm`, and
    dispatched as FP8."""
    last_plan: MoonEPCommPlan | None = None
    overlap_prefetch: bool = False
    """`MoEConfig.overlap_prefetch`: prefetch on the comm stream beside the home experts' groups of the first
    GEMM, which then waits and computes the slot groups (`SlotsReady`); else prefetch on the caller's stream,
    then one GEMM over every group."""
    overlap_reduce_grad: bool = False
    """`MoEConfig.overlap_reduce_grad`: reduce_grad runs behind the rest of the backward pass where autograd
    reads the gradients only after it (`grads_read_after_backward`)."""

    @property
    def one_rank(self) -> bool:
        """One rank without slots (EP=1): nothing crosses a link and no replica's gradient overwrites its
        slot weights, so backward may order its GEMMs for memory alone."""
        return self.buffer.world.size == 1 and self.experts.num_slots == 0

    @property
    def fp8_rows(self) -> bool:
        """Whether SwiGLU hands the GEMMs after it their rows already FP8 (`hands_fp8_rows`)."""
        return hands_fp8_rows(self.gemm, self.experts.ffn_hidden_size)

    @property
    def regathers_rows(self) -> bool:
        """Whether backward gathers the dispatched rows x again from the tokens (a local copy on one rank,
        the bytes forward's saved copy would have cost) instead of forward saving a `[NvS, H]` copy: one
        rank in bf16 (FP8 rows, `fp8_dispatch`, are saved as dispatched)."""
        return self.one_rank and not self.fp8_dispatch

    def dispatches_fp8(self, records: bool) -> bool:
        """Whether a forward dispatches its tokens as FP8 rows with their scales (`Buffer.dispatch`'s
        `scales`): with `fp8_dispatch`; and where no backward reads the dispatched rows (inference, `records`
        false, or one rank whose backward gathers the bf16 rows again, `regathers_rows`) wherever the GEMM
        casts the rows it multiplies (`Fp8RowsGemm.casts_rows`) and the Buffer's rows hold them. There it is
        the same bits: the dispatched rows are copies of the tokens, cast to the same bytes before dispatch
        as after it, so the GEMM reads them in place (the `[S, H]` tokens cast instead of the `[NvS, H]`
        rows) and the exchange moves about half of bf16's bytes."""
        if self.fp8_dispatch:
            return True
        return (not records or self.regathers_rows) and casts_rows(self.gemm) and self.buffer.takes_fp8_rows

    def prefetch(self, plan: MoonEPCommPlan, *scales) -> SlotsReady | None:
        """This step's prefetch of the replicas' weights (FP8 `scales` with them, forward), and the first
        GEMM's `SlotsReady` (None without overlap)."""
        gate_up_rows, down_rows = self.experts.rows
        event = self.buffer.prefetch_weight(plan, gate_up_rows, None, down_rows, *scales,
                                            async_finish=self.overlap_prefetch, wait_for_readers=False)
        return self.slots_ready(event)

    def slots_ready(self, event: object | None = None) -> SlotsReady | None:
        """The first GEMM's `SlotsReady` for the slots' weights arriving with `event` (None: they are
        there), or None without `overlap_prefetch` (the GEMM runs whole)."""
        if not self.overlap_prefetch:
            return None
        return SlotsReady(self.buffer.epn, event, row_alignment=self.buffer.token_padding)

    def __post_init__(self) -> None:
        if self.fp8_dispatch and not isinstance(self.gemm, Fp8RowsGemm):
            raise TypeError(f"fp8_dispatch needs a GEMM backend that takes FP8 rows (Fp8RowsGemm), got "
                            f"{type(self.gemm).__name__}")


def hands_fp8_rows(gemm: GroupedGemm, ffn: int) -> bool:
    """Whether SwiGLU gives the GEMM after it (forward's down, backward's gate_up dgrad) its rows as FP8, cast
    in SwiGLU's own pass (`swiglu_weighted_fp8`, `swiglu_weighted_backward_fp8`) instead of by the GEMM from
    bf16 rows: the same bytes, one pass over the rows less. Where the backend casts the rows it multiplies
    (`Fp8RowsGemm.casts_rows`) and F is whole 1x128 tiles (`fp8_tiles_reason`)."""
    return casts_rows(gemm) and fp8_tiles_reason(ffn) is None


def compute_offsets(cu_seqlens_g: torch.Tensor, rank: int, epn: int, num_experts: int) -> torch.Tensor:
    """`[E+B]` padded ends of the physical groups -> `[epn+B]` ends of this rank's compute groups (home
    experts, then slots).

    Exact without a host read: the groups before and after the home range are empty on this rank.
    """
    return torch.cat([cu_seqlens_g[rank * epn:(rank + 1) * epn], cu_seqlens_g[num_experts:]])


class MoonEPExperts(torch.autograd.Function):
    """`(hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert, gate_up, down, state, records) ->
    out_sh`.

    Args (forward):
        hidden_sh: `[s, H]` tokens of this rank in the Buffer's dtype.
        route_weights_sk: `[s, K]` route weights in the Buffer's weight dtype (differentiable).
        topk_experts_sk: `[s, K]` int experts, -1 = no route. tokens_per_expert: `[E]` int histogram.
        gate_up, down: the home expert parameters (`state.experts`), passed so autograd gives them grads.
        state: `ExpertsState`.
        records: whether autograd records this forward for a backward (grad mode on, and the tokens, the
            route weights or an expert weight requiring grad). Without it (inference) the expert GEMMs read
            the dispatched rows in place: no `[NvS, H]` copy is made for a backward that will not run.

    With `MoEConfig.fp8_dispatch` the tokens are quantised before dispatch (`gemm.quantise_rows`) and travel
    as FP8 rows with their scales; the forward GEMM takes them as they arrive, backward keeps them (not a bf16
    copy) and dequantises them for gate_up's weight gradient. An FP8 layer dispatches FP8 rows, read in place,
    wherever no backward reads them (inference, one rank: `ExpertsState.dispatches_fp8`, the same bits).

    FP8 experts with no master (`MoEConfig.expert_weights="fp8"`) run forward only: their scales are
    prefetched with them and the GEMMs take `Fp8Weights`; the layer refuses, before routing, a forward whose
    output would need a gradient (`MoonEPMoELayer.forward`), so this backward never meets them.
    """

    @staticmethod
    def forward(ctx, hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert, gate_up, down,
                state: ExpertsState, records: bool):
        buffer, experts, gemm = state.buffer, state.experts, state.gemm
        regather, fp8_rows_in = state.regathers_rows, state.dispatches_fp8(records)
        in_place = regather or not records  # the Buffer's own rows where backward gathers them again or none
        # runs, else a copy it saves
        # fp8_rows_in: the tokens as e4m3 rows with their 1x128 scales, so x_nvsh is that pair, as the fwd
        # GEMM takes it
        rows_sh, scales_sh = gemm.quantise_rows(hidden_sh) if fp8_rows_in else (hidden_sh, None)
        x_nvsh, w_nvs, cu_seqlens, plan = buffer.dispatch(rows_sh, route_weights_sk, topk_experts_sk,
                                                          tokens_per_expert, zero_copy=in_place,
                                                          scales=scales_sh)
        # no closing barrier: this rank goes on while its peers read its replicated experts; combine's
        # barriers order those reads before anything writes the home experts (the optimizer, after the step)
        slots_ready = state.prefetch(plan, experts.scales)
        offs_g = compute_offsets(cu_seqlens, buffer.world.rank, buffer.epn, buffer.E)
        gate_up_w, down_w = experts.compute_weights(gemm.joined_weights)
        ab_nv2f = gemm.fwd(x_nvsh, gate_up_w, offs_g, slots_ready)
        # hw (fp8_rows: as the FP8 rows the down GEMM multiplies, no bf16 hw written)
        hw_nvf = (swiglu_weighted_fp8 if state.fp8_rows else swiglu_weighted)(ab_nv2f, w_nvs, offs_g[-1:])
        # gate_up has read the rows (x is a copy of them, or gathered again in backward), so down may write
        # y into them, where combine reads it without copying it in (a backend that cannot returns its own)
        rows_nvsh = buffer.hidden_nvsh_buffer_view
        y_nvsh = gemm.fwd(hw_nvf, down_w, offs_g, out=rows_nvsh)
        out_sh, _, _ = buffer.combine(plan, y_nvsh, zero_copy=y_nvsh is rows_nvsh)
        x_saved = (hidden_sh,) if regather else x_nvsh if fp8_rows_in else (x_nvsh,)
        ctx.save_for_backward(*x_saved, ab_nv2f, w_nvs, offs_g)
        ctx.plan, ctx.state = plan, state
        state.last_plan = plan
        return out_sh

    @staticmethod
    def backward(ctx, grad_out_sh):
        *x_parts, ab_nv2f, w_nvs, offs_g = ctx.saved_tensors
        # Unless the graph is kept for another backward (`retain_graph`), autograd's saved copies are dropped
        # now, as a compiled graph's backward does: each activation is freed after its last reader below, not
        # when backward returns, and SwiGLU's backward writes dab over ab (ab's only reader)
        once = not graph_kept()
        if once:
            ctx.maybe_clear_saved_tensors()
        plan, state = ctx.plan, ctx.state
        buffer, experts, gemm = state.buffer, state.experts, state.gemm
        # zero_copy: dy is the Buffer's own rows, not a [NvS, H] copy of them. They stay dy until gate_up's
        # dgrad, queued after dy's last reader (the down wgrad), writes dx over them (or, where its backend
        # makes its own dx, this backward's combine copies dx in): only that GEMM, dispatch and combine of
        # this Buffer write its rows (prefetch and reduce_grad touch the slot pools), and peers
        # write them only inside a dispatch (`scatter_rows` / `KernelExchange.send_routes` start with every
        # rank's barrier, which this rank reaches only in its next dispatch; the collective world writes them
        # on this rank's stream). The model's layers of this shape may share the Buffer
        # (`MoEConfig.share_buffer`): no other layer's routed step runs between this dispatch and this
        # combine. The forward's x_nvsh is a copy, saved for backward (y and the other layers' steps
        # overwrite the rows), except on one rank, where this backward gathers it again (`regathers_rows`).
        dy_nvsh, *_ = buffer.dispatch(grad_out_sh.to(buffer.dtype).contiguous(), None, None, None, plan=plan,
                                      zero_copy=True)
        slots_ready = state.prefetch(plan)  # as forward
        gate_up_w, down_w = experts.compute_weights(gemm.joined_weights)
        u_nvf = gemm.dgrad(dy_nvsh, down_w, offs_g, slots_ready)
        # dab_rows: dab as gate_up's dgrad multiplies it (fp8_rows: FP8, cast in the same pass)
        dab_nv2f, grad_w_nvs, hw_nvf, dab_rows = swiglu_backward_rows(u_nvf, ab_nv2f, w_nvs, offs_g[-1:],
                                                                      over_ab=once, fp8_rows=state.fp8_rows)
        del u_nvf, ab_nv2f  # each activation freed after its last reader, not when backward returns: the
        # memory goes to the gradients made later in this backward (the step's peak is at gate_up's wgrad)
        # down's weight gradient first, dy's last reader: the rows are then free, and gate_up's dgrad writes
        # dx into them, where combine reads it without copying it in (a backend that cannot write there
        # returns its own dx, which combine copies). With peers, combine runs on the comm stream beside
        # gate_up's weight gradient, so its link time can hide under that GEMM. One rank without slots
        # (`ExpertsState.one_rank`) has no link time to hide: combine, then gate_up's weight gradient, its x
        # gathered again into the Buffer's rows (`regathers_rows`: dead once combine has read dx) or
        # dequantised from the saved FP8 rows.
        # The trainable projections only. "param": the GEMMs make this step's home gradients (None parts)
        # and overwrite the slot gradients (no zeroing pass, no copy), or, where autograd would add this
        # step's gradient into a `.grad` (a later micro-batch), add into that `.grad` (`accumulating_grads`);
        # "main_grad": they add into the persistent main_grad. Added into, the slot gradients are exact too
        # (the fp32 pool is zero between steps: reduce_grad clears it; slot gradients written over the slot
        # weights, `grads_in_slots`, are cleared first, each projection's after its dgrad, the last reader of
        # its slot weights)
        # the projections whose gradient this backward wants: trainable, and not left out of a
        # `backward(inputs=...)` (the input-gradient half of a split backward runs no weight-gradient GEMM)
        main_grad = state.main_grad
        trains = tuple(needed and engine_runs(node) is not False for needed, (node, _)
                       in zip(ctx.needs_input_grad[4:6], ctx.next_functions[-2:], strict=True))
        if main_grad:
            home = experts.main_grads(trains)
        else:
            home = accumulating_grads(ctx.next_functions[-2:], trains)  # gate_up's and down's edges: the
            # last tensor arguments (an argument that is not a tensor, e.g. a None histogram, has no edge)
        adds = tuple(main_grad or grad is not None for grad in home)
        clears = tuple(experts.grads_in_slots and add and train
                       for add, train in zip(adds, trains, strict=True))
        gate_up_slots, down_slots = (pool.local for pool in experts.slot_grads)
        if trains[1]:
            if clears[1]:
                zero_filled_slots(down_slots, offs_g, buffer.epn)
            down_home, _ = gemm.wgrad(dy_nvsh, hw_nvf, offs_g, (home[1], down_slots), adds[1])
            home = (home[0], down_home)
        del hw_nvf
        rows_nvsh = buffer.hidden_nvsh_buffer_view
        dx_nvsh = gemm.dgrad(dab_rows, gate_up_w, offs_g, out=rows_nvsh)
        del dab_rows
        if clears[0]:
            zero_filled_slots(gate_up_slots, offs_g, buffer.epn)

        def gate_up_wgrad(home):
            if not trains[0]:
                return home
            if state.regathers_rows:  # forward's dispatch again, of the saved tokens: the same rows
                x_nvsh, *_ = buffer.dispatch(x_parts[0], None, None, None, plan=plan, zero_copy=True)
            elif state.fp8_dispatch:  # FP8 rows dequantised exactly: the values the forward multiplied
                x_nvsh = gemm.dequantise_rows(*x_parts, offs_g, buffer.dtype)
            else:
                x_nvsh = x_parts[0]
            gate_up_home, _ = gemm.wgrad(dab_nv2f, x_nvsh, offs_g, (home[0], gate_up_slots), adds[0])
            return gate_up_home, home[1]

        zero_copy = dx_nvsh is rows_nvsh
        if state.one_rank:
            grad_hidden_sh, grad_route_weights_sk, _ = buffer.combine(plan, dx_nvsh, grad_w_nvs,
                                                                      zero_copy=zero_copy)
            del dx_nvsh
            home = gate_up_wgrad(home)
        else:  # gate_up's weight gradient reads dab and x, not the rows; the results are the same bits
            # either way (the same kernels on the same inputs)
            grad_hidden_sh, grad_route_weights_sk, combined = buffer.combine(plan, dx_nvsh, grad_w_nvs,
                                                                             async_finish=True,
                                                                             zero_copy=zero_copy)
            del dx_nvsh
            home = gate_up_wgrad(home)
            combined.wait()
        grads = experts.new_grads(home)
        if any(trains):
            behind = state.overlap_reduce_grad and grads_read_after_backward(ctx.next_functions[-2:], trains,
                                                                             adds)
            buffer.reduce_grad(plan, grads[0], None, grads[1], behind=behind)
            if behind:  # the caller's stream waits for it once the backward pass is done, before anything
                # reads the gradients (autograd runs the callback before backward() or grad() returns)
                torch.autograd.Variable._execution_engine.queue_callback(buffer.wait_behind)
        if main_grad:
            weight_grads = [main_grad_added(w) if train else None
                            for w, train in zip((experts.gate_up, experts.down), trains, strict=True)]
        else:  # in the parameters' dtype, held by no parameter: autograd keeps them as .grad without a copy
            for (node, _), add in zip(ctx.next_functions[-2:], adds, strict=True):
                if add:  # the accumulated .grad, handed back
                    node.variable.grad = None
            weight_grads = [None if grad is None else grad.home.local for grad in grads]
        return grad_hidden_sh, grad_route_weights_sk, None, None, *weight_grads, None, None


def graph_kept() -> bool:
    """Whether the running backward keeps the graph for another one (`retain_graph=True`, or
    `create_graph`), so saved activations must stay intact; True where this torch cannot say."""
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if kept is None else kept()


def zero_filled_slots(slots_bmn: torch.Tensor, offs_g: torch.Tensor, epn: int) -> None:
    """Zero the slots of `slots [B, out, in]` (contiguous) whose group in `offs_g` (`[epn + B]` ends of the
    compute groups) has rows, without a host read; the unused ones keep what they hold. So a weight-gradient
    GEMM that adds can write the gradients of slots that held weights (`HomeExperts.grads_in_slots`)."""
    if slots_bmn.is_cuda and triton_missing_reason() is None:
        from moonep_moe.gemm.kernels.wgrad import zero_filled_groups

        zero_filled_groups(slots_bmn, offs_g, epn)
        return
    sizes_g = torch.diff(offs_g, prepend=offs_g.new_zeros(1))
    slots_bmn.masked_fill_((sizes_g[epn:] > 0).view(-1, 1, 1), 0)


def engine_runs(node) -> bool | None:
    """Whether the running backward executes `node` (an input's gradient edge; None: no edge, so False):
    False where a `backward(inputs=...)` leaves that input out; None where autograd cannot say (a leaf's
    gradient accumulator under `torch.autograd.grad`, which returns the gradient instead of accumulating it:
    the gradient is wanted, `.grad` is not added into)."""
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None


def accumulating_grads(edges: tuple, trains: tuple[bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """"param" mode: for each weight the Function takes (`edges`: its input edges, `ctx.next_functions`),
    the `.grad` that this backward's gradient would be added into, for the weight-gradient GEMMs to add
    into themselves; None where the GEMMs make a fresh gradient (the first micro-batch, a frozen weight).

    Autograd adds a gradient into an existing `.grad` as a pass of its own (`grad += fresh`) after the GEMM
    made `fresh`, a second tensor of the weights' size: with gradient accumulation, a read and a write of
    every gradient more and their size in memory again. The GEMMs add into `.grad` instead (the Triton
    wgrad in fp32, rounding once); the Function then clears `.grad` and hands autograd that same tensor,
    which autograd keeps as `.grad` (no copy where nothing else holds it), running the weight's
    post-accumulate hooks as usual. Only where the result is what autograd's own accumulation gives: the
    weight is a leaf given as itself (the edge is its gradient accumulator), this backward runs that
    accumulator (not `torch.autograd.grad`, for which `_will_engine_execute_node` raises on a leaf, nor a
    `backward(inputs=)` without the weight), no graph of the gradients is built (`create_graph`), `.grad` is
    dense with the weight's dtype, device and strides and is not part of a graph, and no hook on the weight
    wants this micro-batch's gradient alone (`register_hook`)."""
    if torch.is_grad_enabled():
        return (None,) * len(trains)
    return tuple(_accumulating_grad(node) if train else None for (node, _), train in zip(edges, trains,
                                                                                           strict=True))


def grads_read_after_backward(edges: tuple, trains: tuple[bool, bool], adds: tuple[bool, bool]) -> bool:
    """Whether nothing reads this backward's expert gradients before the backward pass ends, so reduce_grad
    may still be adding the replicas' into them meanwhile (`MoEConfig.overlap_reduce_grad`): no graph of
    the gradients is built (`create_graph`), and each trained weight (`edges`: the Function's input edges of
    gate_up and down) is a leaf given as itself with no hook on it (`register_hook`,
    `register_post_accumulate_grad_hook`), whose gradient autograd keeps as handed over: its `.grad` is None,
    or is the one this backward added into (`adds`) and hands back, or autograd returns the gradient
    (`torch.autograd.grad`) instead of adding it into `.grad`. Elsewhere autograd would read it at once (an
    add into `.grad`, a copy, a hook, the next node's backward). Hooks on a weight's gradient accumulator
    node cannot be seen from here (see the config's description)."""
    if torch.is_grad_enabled():
        return False
    for (node, _), train, add in zip(edges, trains, adds, strict=True):
        if not train:
            continue
        weight = _hookless_leaf(node)
        if weight is None or weight._post_accumulate_grad_hooks:
            return False
        if not (add or weight.grad is None or engine_runs(node) is None):
            return False
    return True


def _hookless_leaf(node) -> torch.Tensor | None:
    """The leaf an input edge's gradient accumulator (`AccumulateGrad`) adds into, where no hook wants its
    gradient first (`register_hook`); None for any other edge."""
    weight = getattr(node, "variable", None)
    if type(node).__name__ != "AccumulateGrad" or weight is None or weight._backward_hooks:
        return None
    return weight


def _accumulating_grad(node) -> torch.Tensor | None:
    weight = _hookless_leaf(node)
    grad = None if weight is None else weight.grad
    if (grad is None or grad.layout != torch.strided or grad.requires_grad or grad.dtype != weight.dtype
            or grad.device != weight.device or grad.stride() != weight.stride()):
        return None
    return grad if engine_runs(node) else None  # None under torch.autograd.grad: .grad is left alone


COMPILE_BREAK_REASON = (
    "MoonEP's routed experts (planner, dispatch, prefetch, grouped GEMMs, combine, reduce_grad) run eagerly "
    "between compiled graphs: they launch their own kernels on peer and process-global memory that the "
    "compiled graph cannot see, and their reference paths read segment sizes on the host. "
    "torch.compile(fullgraph=True) cannot trace them: compile the layer without fullgraph (one graph break "
    "around the experts) or capture forward + backward in a CUDA graph"
)
