"""A step's comm cost follows its tokens, not the Buffer's capacity.

A Buffer's rows `[NvS, H]` are sized for its capacity S and its padded segments: `NvS = align_up(S*K +
(tp-1)*(epn+B), tp)`, so with tp = 128 and many experts a decode step of one token owns tens of thousands of
rows. A step of s tokens must touch only what s tokens fill (its routes' rows, their padding, their
duplicates), plus what scales with E, B or the capacity's S*K routes, never a pass over all NvS rows:

- `test_no_torch_op_spans_the_rows`: every torch op a serving step (dispatch with the views, combine of a
  separate expert output: the communicator's pattern) runs on the kernel path, recorded with a
  `TorchDispatchMode` while the row kernels run unrecorded, touches fewer than NvS elements, except the
  plan's allocation and the zeroing of its int32 dup tables (DESIGN.md's `[NvS, 3]` / `[NvS]` fields, whose
  unused entries are zero: 16 bytes per row, done inside the planner's launch on a GPU);
- `test_combine_leaves_rows_past_the_plan`: combine of an expert output that is not the Buffer's own view
  copies only the rows the plan fills (up to `cu_seqlens[-1]`, read on the device); a sentinel in the
  Buffer's rows past them survives, on the kernels (Triton's interpreter on the CPU) and the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_comm_kernels import KERNEL_DEVICE
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from moonep_moe.comm.buffer import Buffer
from moonep_moe.plan.planner import expert_histogram
from moonep_moe.transport.threads import run_ranks

# R=2, capacity S=4, K=4, E=16 (epn=8, B=8), tp=16: NvS = align_up(16 + 15*16, 16) = 256 rows, while the
# capacity's routes are R*S*K = 32 and a one-token step fills at most K segments.
SHAPE = dict(S=4, H=32, K=4, E=16, num_ep_ranks=2, token_padding=16)
SENTINEL = 7.0


def make_buffer(world, kernels: bool) -> Buffer:
    return Buffer(**SHAPE, world=world, dtype=torch.float32, kernels=kernels, validate=False)


def routing(rank: int, num_tokens: int, device) -> tuple[torch.Tensor, ...]:
    """`[s, H]` rows, `[s, K]` weights and K distinct experts per token (routes of a token that meet on one
    rank are duplicates)."""
    gen = torch.Generator().manual_seed(11 + rank)
    K, E = SHAPE["K"], SHAPE["E"]
    topk_sk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(num_tokens)]).int()
    return (torch.randn(num_tokens, SHAPE["H"], generator=gen).to(device),
            torch.rand(num_tokens, K, generator=gen).to(device), topk_sk.to(device))


class _Unrecorded:
    """The row-kernel module with every call run outside the recording mode (on a GPU the kernels are
    opaque launches; in Triton's interpreter they would show up as whole-tensor host copies)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        function = getattr(self._module, name)

        def call(*args, **kwargs):
            with _disable_current_modes():
                return function(*args, **kwargs)

        return call


class _Sizes(TorchDispatchMode):
    """Records `(op, largest tensor it reads or writes, in elements)` of every non-view op."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.ops.append((str(func.overloadpacket), max((t.numel() for t in tensors), default=0)))
        return out


@pytest.mark.interpreter
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_no_torch_op_spans_the_rows(num_tokens):
    def fn(world):
        buf = make_buffer(world, kernels=True)
        buf._exchange = dataclasses.replace(buf._exchange, rows=_Unrecorded(buf._exchange.rows))
        hidden_sh, weights_sk, topk_sk = routing(world.rank, num_tokens, world.device)
        expert_out_nvsh = torch.randn(buf.NvS, buf.H)  # the experts' own output tensor, not the view
        sizes = _Sizes()
        with torch.no_grad(), sizes:
            rows_nvsh, _, _, plan = buf.dispatch(hidden_sh, weights_sk, topk_sk,
                                                 expert_histogram(topk_sk, buf.E), zero_copy=True,
                                                 router_weights_zero_copy=True)
            out_sh, _, _ = buf.combine(plan, expert_out_nvsh)
        dup_tables = plan.dup_groups.numel() + plan.dup_loffs.numel() + plan.dup_counts.numel()
        return dict(ops=sizes.ops, NvS=buf.NvS, dup_tables=dup_tables, duplicates=int(plan.dup_counts[1]))

    results = run_ranks(fn, SHAPE["num_ep_ranks"])
    assert sum(result["duplicates"] for result in results) > 0, "the step records duplicates"
    for result in results:
        nvs = result["NvS"]
        assert nvs == 256
        # allocations touch nothing; the one wide op allowed is the planner's zeroing of the dup tables
        planner = ("aten.zero_", result["dup_tables"])
        wide = [(op, n) for op, n in result["ops"] if n >= nvs and not op.startswith("aten.empty")]
        unexpected = [entry for entry in wide if entry != planner]
        assert not unexpected, f"ops over >= NvS={nvs} elements with {num_tokens} token(s): {unexpected}"
        assert planner in wide  # the recording sees the planner's ops


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.interpreter)],
                         ids=["reference", "kernels"])
def test_combine_leaves_rows_past_the_plan(kernels):
    def fn(world):
        buf = make_buffer(world, kernels)
        hidden_sh, weights_sk, topk_sk = routing(world.rank, 1, world.device)
        _, _, cu_seqlens, plan = buf.dispatch(hidden_sh, weights_sk, topk_sk, zero_copy=True,
                                              router_weights_zero_copy=True)
        end = int(cu_seqlens[-1])
        view_nvsh = buf.hidden_nvsh_buffer_view
        view_nvsh[end:] = SENTINEL
        expert_out_nvsh = torch.randn(buf.NvS, buf.H, generator=torch.Generator().manual_seed(3))
        out_sh, _, _ = buf.combine(plan, expert_out_nvsh)
        return dict(end=end, NvS=buf.NvS, past=view_nvsh[end:].clone(), out=out_sh)

    results = run_ranks(fn, SHAPE["num_ep_ranks"])
    for result in results:
        assert 0 < result["end"] < result["NvS"] // 2
        assert bool((result["past"] == SENTINEL).all()), "combine wrote rows past the plan's end"


@pytest.mark.gpu
def test_cuda_combine_leaves_rows_past_the_plan_and_equals_the_full_copy():
    """On the H200: a one-rank combine reads the expert outputs where they are, leaves the Buffer's rows past
    the plan's end untouched, and its result equals the reference's run on the CPU from the same inputs (the
    CUDA reference's `index_add_` adds in no fixed order, so it is not bit-reproducible: see
    tests/test_comm_kernels.py)."""
    from moonep_moe.transport.threads import single_world

    results = []
    for kernels, device in ((True, torch.device(KERNEL_DEVICE)), (False, torch.device("cpu"))):
        world = single_world(device)
        buf = Buffer(**{**SHAPE, "num_ep_ranks": 1}, world=world, dtype=torch.float32, kernels=kernels,
                     validate=False)
        hidden_sh, weights_sk, topk_sk = routing(0, 3, world.device)
        _, _, cu_seqlens, plan = buf.dispatch(hidden_sh, weights_sk, topk_sk, zero_copy=True,
                                              router_weights_zero_copy=True)
        end = int(cu_seqlens[-1])
        buf.hidden_nvsh_buffer_view[end:] = SENTINEL
        expert_out_nvsh = torch.randn(buf.NvS, buf.H, generator=torch.Generator().manual_seed(3)).to(device)
        out_sh, _, _ = buf.combine(plan, expert_out_nvsh)
        assert bool((buf.hidden_nvsh_buffer_view[end:] == SENTINEL).all())
        results.append(out_sh.cpu())
        buf.destroy()
    assert torch.equal(*results)
