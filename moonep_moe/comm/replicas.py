"""The Buffer's weight half: `prefetch_weight` copies replicated experts into this rank's slots, `reduce_grad`
adds every replica's gradient into its home expert's and clears the slots. Notation: DESIGN.md."""

from __future__ import annotations

from typing import Any

import torch

from moonep_moe.comm.checks import check_tensor, row_fingerprints
from moonep_moe.comm.event import CommEvent
from moonep_moe.comm.exchange import write_used_slots
from moonep_moe.fp8.format import FP8_DTYPE, as_bytes, block_scales_shape
from moonep_moe.plan.types import MoonEPCommPlan
from moonep_moe.transport.world import SymmetricTensor
from moonep_moe.weights.pool import ExpertRows
from moonep_moe.weights.quantised import rows_as_bytes


class ExpertTransfers:
    """`prefetch_weight` and `reduce_grad` of `Buffer` (its base class), with their argument checks. Uses the
    Buffer's world, layout (E, B, epn), exchange, launch and plan checks."""

    @torch.no_grad()
    def prefetch_weight(self, plan: MoonEPCommPlan, full_gate_weight, full_up_weight, full_down_weight,
                        scales=None, async_finish: bool = False, wait_for_readers: bool = True
                        ) -> CommEvent | None:
        """Copy each replicated expert's weights into this rank's slots: slot j gets `experts_to_copy[r, j]`.

        Each projection is either the replicated form `[E+B, N, K]` (every expert present on every rank, as
        vLLM's integration passes it: rows E+j are the slots) or an `ExpertRows` (home experts read from
        their rank + this rank's slot pool). A projection given as None is skipped (a fused gate_up passed
        as the gate). Only the used slots are written: a slot marked -1 keeps what it holds (zeros, or an
        expert an earlier plan put there), never read, as its segment is empty; so a prefetch moves the bytes
        of the replicas the plan makes, not of every slot. Collective: every rank calls it with the same
        forms.

        FP8 weights (`float8_e4m3fn`, one fp32 scale per 128x128 block: `fp8.format`) move with their
        scales: `scales` is then `(gate_scales, up_scales, down_scales)`, one per weight in that weight's
        form: an `ExpertRows` of home `[epn, ceil(N/128), ceil(K/128)]` and slot `[B, ...]` fp32 scales, or
        the replicated `[E+B, ceil(N/128), ceil(K/128)]`; None for a weight that is None or not FP8. Each
        slot gets its expert's e4m3 bytes and scales unchanged (half the bytes of bf16, plus 4 per block),
        so it equals quantising the moved bf16 expert. `scales` None: no weight may be FP8.

        The replicated form is read locally, so its rows of other ranks' experts must be those experts'
        real weights: with `validate` every copied expert is compared with its home rank's rows (exact
        fingerprints, one all-gather, one host read) and a mismatch raises before any slot is written. A
        weight that holds only this rank's home experts must be passed as `ExpertRows`.

        Peers read this rank's home experts (`ExpertRows`) while they prefetch. By default the call returns
        when every rank is done reading (a closing barrier), so the caller may write its home experts right
        after. `wait_for_readers=False` leaves that barrier out, so a rank whose experts are replicated
        elsewhere goes on while its peers read them (its link's time to serve the replicas hides under what
        it computes next): the caller must then make another collective call of this Buffer (dispatch,
        prefetch, combine, reduce_grad: each opens with a barrier every rank reaches only after its own
        reads) before it writes its home experts. The layer's step does: combine follows every prefetch.

        Returns the event: a `CommEvent` with `async_finish`, else None.
        """
        self._check_alive()
        self._check_plan(plan)
        rank = self.world.rank
        named = self._prefetched(((full_gate_weight, "full_gate_weight"), (full_up_weight, "full_up_weight"),
                                  (full_down_weight, "full_down_weight")), scales)
        projections = [w for w, _ in named]
        validate = self._validating()

        def op():
            expert_b = plan.experts_to_copy[rank]
            for weight, name in named:  # the replicated form is local: every expert is on every rank
                if not isinstance(weight, ExpertRows):
                    weight = as_bytes(weight)
                    copies = weight.index_select(0, expert_b.long().clamp(min=0))
                    if validate:
                        self._check_replicated(weight, name, copies, expert_b)
                    write_used_slots(weight[self.E:], copies, expert_b)
            expert_rows = [rows_as_bytes(w) for w in projections if isinstance(w, ExpertRows)]
            if expert_rows:
                self._exchange.copy_experts(expert_rows, expert_b, wait_for_readers)

        return self._launch(async_finish, op, (plan, *projections))[1]

    def _prefetched(self, weights: tuple[tuple[Any, str], ...], scales) -> list[tuple[Any, str]]:
        """`[(tensor, name)]` that `prefetch_weight` copies: the given weights (`(weight or None, name)` of
        gate, up, down), each FP8 one followed by its scales (named `scales[i]`), all checked."""
        rank = self.world.rank
        if scales is None:
            scales = (None,) * len(weights)
        elif not isinstance(scales, tuple | list) or len(scales) != len(weights):
            raise ValueError(f"rank {rank}: scales must be None or a tuple (gate_scales, up_scales, "
                             f"down_scales), got {scales!r:.80}")
        named = []
        for i, ((weight, name), scale) in enumerate(zip(weights, scales, strict=True)):
            if weight is None:
                if scale is not None:
                    raise ValueError(f"rank {rank}: scales[{i}] is given but {name} is None")
                continue
            if isinstance(weight, ExpertRows):
                self._check_rows(weight, name)
            else:
                self._check_full(weight, name)
            named.append((weight, name))
            dtype = (weight.home.local if isinstance(weight, ExpertRows) else weight).dtype
            if (dtype == FP8_DTYPE) != (scale is not None):
                raise ValueError(f"rank {rank}: {name} is {dtype}: " + (
                    f"FP8 weights move with their 128x128 block scales, pass them as scales[{i}]"
                    if scale is None else f"scales[{i}] is only for FP8 ({FP8_DTYPE}) weights, pass None"))
            if scale is not None:
                self._check_scales(scale, weight, f"scales[{i}]", name)
                named.append((scale, f"scales[{i}]"))
        return named

    def _check_scales(self, scales, weight, name: str, weight_name: str) -> None:
        """`scales` in `weight`'s form, fp32, contiguous, one per 128x128 block of each of its experts."""
        rank = self.world.rank
        if isinstance(weight, ExpertRows) != isinstance(scales, ExpertRows):
            raise ValueError(f"rank {rank}: {name} must be in {weight_name}'s form "
                             f"({type(weight).__name__}), got {type(scales).__name__}")
        if isinstance(weight, ExpertRows):
            pairs = ((weight.home.local, scales.home.local, f"{name} home"),
                     (weight.slots.local, scales.slots.local, f"{name} slots"))
        else:
            pairs = ((weight, scales, name),)
        for w, s, label in pairs:
            check_tensor(s, label, block_scales_shape(w.shape), torch.float32, self.world.device, rank)
            if not s.is_contiguous():
                raise ValueError(f"rank {rank}: {label} must be contiguous")

    def _check_replicated(self, weight: torch.Tensor, name: str, copies_b: torch.Tensor,
                          expert_b: torch.Tensor) -> None:
        """Collective: raise unless every used slot's copy `copies_b [B, N, K]` (rows of `weight [E+B, N, K]`
        for the experts `expert_b [B]`, -1 unused) equals that expert's rows on its home rank."""
        rank, epn = self.world.rank, self.epn
        home_rx2 = self.world.all_gather(row_fingerprints(weight[rank * epn:(rank + 1) * epn]))
        expected_b2 = home_rx2.view(self.E, 2).index_select(0, expert_b.long().clamp(min=0))
        wrong_b = (expert_b >= 0) & (row_fingerprints(copies_b) != expected_b2).any(1)
        if bool(wrong_b.any()):  # the host read of `validate`
            expert = int(expert_b[wrong_b][0])
            raise ValueError(
                f"rank {rank}: {name}[{expert}] differs from expert {expert}'s weights on its home rank "
                f"{expert // epn}: the replicated [E+B, N, K] form must hold every expert's real weights on "
                "every rank; pass a weight that holds only the home experts as ExpertRows")

    def _check_full(self, tensor: torch.Tensor, name: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tensor.shape[0] != self.E + self.B:
            shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"rank {self.world.rank}: {name} must be [E+B={self.E + self.B}, N, K] or "
                             f"ExpertRows, got {shape}")

    def _check_rows(self, rows: ExpertRows, name: str,
                    slots_dtypes: tuple[torch.dtype, ...] | None = None) -> None:
        """Home `[epn, *row]` and slots `[B, *row]` on this device, contiguous (the row kernels address them
        as flat rows); the slots in the home dtype, or in one of `slots_dtypes`."""
        home, slots = rows.home.local, rows.slots.local
        row = tuple(home.shape[1:])
        for tensor, part, count, dtypes in ((home, "home", self.epn, (home.dtype,)),
                                            (slots, "slots", self.B, slots_dtypes or (home.dtype,))):
            check_tensor(tensor, f"{name} {part}", (count, *row), dtypes, self.world.device, self.world.rank)
            if not tensor.is_contiguous():
                raise ValueError(f"rank {self.world.rank}: {name} {part} must be contiguous")

    @torch.no_grad()
    def reduce_grad(self, plan: MoonEPCommPlan, full_gate_grad, full_up_grad, full_down_grad,
                    gate_reduce_buffer: SymmetricTensor | None = None,
                    up_reduce_buffer: SymmetricTensor | None = None,
                    down_reduce_buffer: SymmetricTensor | None = None,
                    async_finish: bool = False, *, behind: bool = False) -> CommEvent | None:
        """Add every replica's gradient into its home expert's gradient, then clear the slots.

        Each projection's gradient is either an `ExpertRows` (home gradients + the symmetric slot
        gradients, fp32 or in the home gradients' dtype: each replica is rounded to the home dtype, and their
        sum with the home gradient is made in fp32 and rounded once) or the replicated form `[E+B, N, K]`
        fp32 with the slot gradients in rows E.., in which case its `*_reduce_buffer` (a symmetric
        `[B, N, K]` fp32 tensor) stages them for the peers. None skips a projection. Collective: every rank
        must call it with the same projections. Replicas are added in (slot, rank) order, the same order on
        both implementations: deterministic.

        `behind=True` leaves it running behind the caller (on the comm stream, as `async_finish`): the
        next operation of any Buffer on this world, and `wait_behind()`, order their stream behind it, so
        the caller may compute on (the layers before this one in a backward pass) while it runs. The
        gradients are not held: keep them, and read them only after `wait_behind()`. Returns None then.

        Returns the event: a `CommEvent` with `async_finish`, else None.
        """
        self._check_alive()
        self._check_plan(plan)
        given = []
        for grad, staging, name in ((full_gate_grad, gate_reduce_buffer, "gate"),
                                    (full_up_grad, up_reduce_buffer, "up"),
                                    (full_down_grad, down_reduce_buffer, "down")):
            if grad is None:
                continue
            if isinstance(grad, ExpertRows):
                self._check_rows(grad, f"full_{name}_grad",
                                 (grad.home.local.dtype, torch.float32, torch.float64))
            else:
                self._check_full(grad, f"full_{name}_grad")
                if not isinstance(staging, SymmetricTensor):
                    raise ValueError(f"rank {self.world.rank}: full_{name}_grad in the [E+B, ...] form needs "
                                     f"{name}_reduce_buffer as this rank's [B, N, K] SymmetricTensor "
                                     "(world.symmetric(key, tensor): the world reaches the peers' buffers), "
                                     "not MoonEP's [R, B, N, K] view of every rank's; got "
                                     f"{_described(staging)}")
                check_tensor(staging.local, f"{name}_reduce_buffer", tuple(grad[self.E:].shape),
                       (grad.dtype, torch.float32, torch.float64), self.world.device, self.world.rank)
                if not grad.is_contiguous():
                    raise ValueError(f"rank {self.world.rank}: full_{name}_grad must be contiguous")
            given.append((grad, staging))

        def op():
            rank = self.world.rank
            projections = []  # (home gradients [epn, ...], symmetric slot gradients, replicated slot rows)
            for grad, staging in given:
                if isinstance(grad, ExpertRows):
                    projections.append((grad.home.local, grad.slots, None))
                else:
                    staging.local.copy_(grad[self.E:])
                    projections.append((grad[rank * self.epn:(rank + 1) * self.epn], staging, grad[self.E:]))
            mine_rb, home_rb = self._replica_tables(plan)
            self._exchange.add_replicas([(home, slots) for home, slots, _ in projections], mine_rb, home_rb)
            experts_b = plan.experts_to_copy[rank]
            for _, slots, replicated in projections:  # both forms were checked contiguous above
                self._exchange.clear_slots(slots.local, experts_b)
                if replicated is not None:
                    self._exchange.clear_slots(replicated, experts_b)

        if behind:  # the slot gradients (pools, or the staging) are held; the gradients the caller keeps
            self._run_behind(op, (plan, *(staging if staging is not None else grad.slots
                                          for grad, staging in given)))
            return None
        return self._launch(async_finish, op, (plan, *given))[1]

    def _replica_tables(self, plan: MoonEPCommPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """`[R, B]` (slot j of rank d holds one of this rank's home experts, which one: index in [0, epn))."""
        table_rb = plan.experts_to_copy.long()
        mine_rb = (table_rb >= 0) & (table_rb // self.epn == self.world.rank)
        return mine_rb, table_rb.clamp(min=0) % self.epn


def _described(value: Any) -> str:
    """How an error names a given argument: a tensor by its shape, anything else by its type."""
    return f"a tensor {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
