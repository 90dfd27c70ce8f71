"""How many device ops one serving step launches: a pinned upper bound.

A decode step moves a few KiB, so on the H200 its cost is the number of kernels it launches (2-3 us each,
even replayed in a CUDA graph), not their bytes. This test lists, on the CPU, every device op one R = 1
`MoECommunicator.dispatch` + `combine(..., out=)` runs on the kernel path (the path a GPU takes: the Triton
planner and row kernels, run here in Triton's interpreter) and fails if the count passes
`MAX_DEVICE_OPS`: a test that fails when someone adds launches back.

What counts as one device op (`DeviceOps`):
- each Triton kernel launch;
- each torch op that runs a kernel on a GPU, recorded with a `TorchDispatchMode` while the Triton kernels
  run unrecorded: every op but views, allocations (`empty*`, no kernel) and `scalar_tensor` (a Python
  number wrapped on the CPU by `torch.where(mask, tensor, number)`, no device kernel);
- each `pointer_table` call counts R fills: while a CUDA graph is captured every call fills a fresh table
  (`comm.kernels.common.pointer_table`), so a replayed step runs them.

Run with `-s` to print the listing (`python -m pytest tests/test_launch_count.py -s`).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import moonep_moe.comm.buffer as buffer_module
import moonep_moe.plan.planner as plan_module
from moonep_moe.comm.exchange import select_exchange
from moonep_moe.engine.communicator import MoECommunicator
from moonep_moe.transport.threads import single_world

MAX_DEVICE_OPS = 3
"""Device ops of one R = 1 decode-sized dispatch + combine on the kernel path (its routes fit one planner
token block): the planner's one launch (it counts the routes, plans and finds every route's row in one
program; a larger step takes a second launch for the rows), send_routes, which also zeroes the padding rows
(dispatch); gather_routes into `out` (combine). One rank's plans hold no duplicate routes, so
record_duplicates, expand_duplicates, copy_rows and pre_reduce do not run (10 before that, 6 before the
padding moved into send_routes, 5 before the planner counted the routes, 4 before one block's plan became
one program); before the fusion (a8777f7) it was 80: 10 Triton launches, 5 pointer-table fills, 65 torch
ops."""
S, H, K, E, TP = 8, 32, 4, 16, 16


class DeviceOps(TorchDispatchMode):
    """Appends to `ops` the name of every torch op that launches a device kernel (module docstring)."""

    def __init__(self, ops: list[str]):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not (func.is_view or name.startswith("aten.empty") or name == "aten.scalar_tensor"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def record_launches(ops: list[str], monkeypatch) -> None:
    """From now on every Triton launch appends `triton.<kernel>` to `ops` (and runs outside the recording
    mode), and every `pointer_table` call one `pointer_table fill` per rank."""
    from triton.runtime.interpreter import InterpretedFunction

    from moonep_moe.comm.kernels import common

    run, table = InterpretedFunction.run, common.pointer_table

    def recorded_run(self, *args, **kwargs):
        ops.append(f"triton.{self.fn.__name__}")
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    def recorded_table(tensor):
        ops.extend(["pointer_table fill"] * len(tensor.peers))
        with _disable_current_modes():
            return table(tensor)

    monkeypatch.setattr(InterpretedFunction, "run", recorded_run)
    monkeypatch.setattr(common, "pointer_table", recorded_table)


def step_ops(num_tokens: int, monkeypatch) -> list[str]:
    """The device ops, in order, of one R = 1 step of `num_tokens` tokens on the kernel path, after an
    unrecorded step of the same bucket (which creates the Buffer)."""
    monkeypatch.setattr(plan_module, "_use_triton", lambda topk: True)  # the planner kernels, as on a GPU
    monkeypatch.setattr(buffer_module, "select_exchange", lambda memory, _: select_exchange(memory, True))
    comm = MoECommunicator(world=single_world("cpu"), hidden_size=H, num_experts=E, top_k=K,
                           max_tokens_per_rank=S, token_padding=TP, dtype="float32", check_expert_ids=False)
    gen = torch.Generator().manual_seed(num_tokens)
    hidden_th = torch.randn(num_tokens, H, generator=gen)
    topk_tk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(num_tokens)]).int()
    weights_tk = torch.rand(num_tokens, K, generator=gen)
    out_th = torch.empty(num_tokens, H)
    bucket = comm.capacity_for(num_tokens)
    with torch.no_grad():
        out, handle = comm.dispatch(hidden_th, topk_tk, weights_tk, capacity=bucket)
        expert_out_nvsh = out.tokens_nvsh.clone()  # the engine's own output (bench.serving's comm graph)
        comm.combine(expert_out_nvsh, handle, out=out_th)
        ops: list[str] = []
        record_launches(ops, monkeypatch)
        with DeviceOps(ops):
            _, handle = comm.dispatch(hidden_th, topk_tk, weights_tk, capacity=bucket)
            comm.combine(expert_out_nvsh, handle, out=out_th)
    comm.destroy()
    return ops


@pytest.mark.interpreter
@pytest.mark.oldest_triton
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_one_rank_step_launches_at_most_the_bound(num_tokens, monkeypatch):
    ops = step_ops(num_tokens, monkeypatch)
    counts = collections.Counter(ops)
    listing = "\n".join(f"{count:4d} {name}" for name, count in counts.most_common())
    print(f"\none R=1 dispatch + combine(out=) of {num_tokens} token(s): {len(ops)} device ops\n{listing}")
    assert any(name.startswith("triton.") for name in ops), "the recording sees the kernels"
    assert len(ops) <= MAX_DEVICE_OPS, f"{len(ops)} device ops > {MAX_DEVICE_OPS}:\n{listing}"
