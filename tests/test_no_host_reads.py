"""The Buffer's device path reads no device value on the host (DESIGN.md, "Static shapes, no host sync").

`no_host_reads()` is a dispatch-level guard for the current thread: every op whose result needs a tensor's
value on the host (`item`/`int`/`bool`, `tolist`, `numpy`) or whose output shape depends on values
(`nonzero`, boolean-mask indexing, `unique*`, `masked_select`, `bincount`, `repeat_interleave` without
`output_size`) raises `HostReadError`. On a GPU each of them is a device-to-host sync, and none of them can
be captured in a CUDA graph. Each Buffer operation then runs under the guard on every rank of a 2-rank
threads world (skewed routing, so replicas exist: prefetch_weight and reduce_grad move real slots).

On the CPU each operation is guarded alone and its results are checked exactly; the planner runs outside the
guard there (its row-capacity check reads on the host on the CPU only, on purpose). On the `meta` device,
the path a GPU takes, the whole step runs under the guard, planner included.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from test_buffer import DOWN_NK, GATE_NK, Case, full_weights
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import moonep_moe.comm.buffer as buffer_module
import moonep_moe.comm.exchange as exchange_module
from moonep_moe.transport.threads import run_ranks, single_world
from moonep_moe.weights.pool import ExpertRows, slot_grad_pool, slot_pool

F64 = torch.float64
aten = torch.ops.aten


class HostReadError(RuntimeError):
    """A data-dependent host read (or a data-dependent output shape) under `no_host_reads()`."""


_DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                   aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default,
                   aten.bincount.default}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
              aten._index_put_impl_.default}


class _Guard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT:
            raise HostReadError(f"{func} reads device values on the host")
        if func in _INDEX_OPS and any(t is not None and t.dtype == torch.bool for t in args[1]):
            raise HostReadError(f"{func} with a boolean mask (nonzero: a host read)")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostReadError(f"{func} without output_size has a data-dependent shape")
        return func(*args, **kwargs)


_guarded = threading.local()


def _refuse(name: str):
    original = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        if getattr(_guarded, "on", False):
            raise HostReadError(f"Tensor.{name}() reads device values on the host")
        return original(self, *args, **kwargs)

    return method


@contextlib.contextmanager
def no_host_reads():
    """Raise `HostReadError` on any data-dependent host read of the current thread."""
    _guarded.on = True
    try:
        with _Guard():
            yield
    finally:
        _guarded.on = False


@contextlib.contextmanager
def host_reads_allowed():
    """Suspend `no_host_reads()` (the planner, until it is sync-free)."""
    on, _guarded.on = getattr(_guarded, "on", False), False
    try:
        with _disable_current_modes():
            yield
    finally:
        _guarded.on = on


@pytest.fixture(autouse=True)
def refuse_tensor_reads(monkeypatch):
    """`tolist` and `numpy` read memory directly (no dispatcher op): refuse them under the guard."""
    for name in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _refuse(name))


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: int(t[0]), lambda t: bool(t.any()), lambda t: t.tolist(),
    lambda t: t[t > 0], lambda t: t.nonzero(), lambda t: torch.unique_consecutive(t),
    lambda t: torch.repeat_interleave(t.abs()), lambda t: t.numpy(),
    lambda t: t.clone().__setitem__(t > 0, 0),
], ids=["item", "int", "bool", "tolist", "mask-index", "nonzero", "unique_consecutive",
        "repeat_interleave", "numpy", "mask-assign"])
def test_guard_catches_host_reads(read):
    t = torch.arange(-3, 5)
    read(t)  # fine outside the guard
    with no_host_reads(), pytest.raises(HostReadError):
        read(t)


OPS = ["dispatch", "combine", "dispatch-backward", "prefetch_weight", "reduce_grad"]


def buffer_step(world, case: Case, guarded_op: str | None) -> dict:
    """dispatch -> combine (rows and route weights) -> dispatch(plan) -> prefetch_weight (both weight forms)
    -> reduce_grad (both gradient forms), with `guarded_op` (None: every op) under `no_host_reads()`; every
    slot gradient is ones. On the CPU the results are checked exactly."""
    device = world.device
    buf = case.buffer(world, validate=False)
    x = {k: v.to(device) for k, v in case.inputs(world.rank).items()}
    r, B, epn = world.rank, buf.B, case.epn
    weights = [full_weights(case, GATE_NK, 1).to(device), full_weights(case, DOWN_NK, 2).to(device)]
    rows = [ExpertRows(world.symmetric(f"test/home/{i}", w[r * epn:(r + 1) * epn].clone()),
                       slot_pool(world, (B, *w.shape[1:]), F64)) for i, w in enumerate(weights)]
    replicated = [torch.cat([w, torch.zeros(B, *w.shape[1:], dtype=F64, device=device)]) for w in weights]
    grads = [ExpertRows(world.symmetric(f"test/grad/{i}", torch.ones(epn, *w.shape[1:], dtype=F64,
                                                                     device=device)),
                        slot_grad_pool(world, (B, *w.shape[1:]), F64)) for i, w in enumerate(weights)]
    staging = world.symmetric("test/stage", torch.zeros(B, *GATE_NK, dtype=F64, device=device))
    grad_full = torch.ones(case.E + B, *GATE_NK, dtype=F64, device=device)

    def guard(op):
        return no_host_reads() if guarded_op in (op, None) else contextlib.nullcontext()

    with guard("dispatch"):
        rows_nvsh, weights_nvs, _, plan = buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"])
    with guard("combine"):
        out_sh, _, _ = buf.combine(plan, rows_nvsh * weights_nvs[:, None])
        _, weights_sk, _ = buf.combine(plan, rows_nvsh, weights_nvs)
    with guard("dispatch-backward"):
        grad_nvsh, _, _, _ = buf.dispatch(x["hidden"], None, None, None, plan=plan)
    with guard("prefetch_weight"):
        buf.prefetch_weight(plan, rows[0], None, rows[1])
        buf.prefetch_weight(plan, replicated[0], None, replicated[1])
    for grad in grads:
        grad.slots.local.fill_(1)
    with guard("reduce_grad"):
        buf.reduce_grad(plan, grads[0], None, grads[1])
        buf.reduce_grad(plan, grad_full, None, None, gate_reduce_buffer=staging)
    if device.type != "cpu":
        return {}
    valid_sk = (x["topk"] >= 0).to(F64)
    assert torch.equal(out_sh, (x["weights"] * valid_sk).sum(1, keepdim=True) * x["hidden"])
    assert torch.equal(weights_sk, x["weights"] * valid_sk)
    assert not grads[0].slots.local[plan.experts_to_copy[r] >= 0].any(), "used slots are cleared"
    return dict(table=plan.experts_to_copy, home_grad=grads[0].home.local.clone())


CASE = Case(R=2, S=16, H=8, K=3, E=8, tp=4, kind="skewed", invalid=0.2)


@pytest.mark.parametrize("op", OPS)
def test_buffer_operation_makes_no_host_read(op, monkeypatch):
    """One operation under the guard on the CPU, with exact results; the planner runs outside the guard
    (on the CPU it checks the row capacity on the host, on purpose)."""
    plan_routes = buffer_module.plan_routes

    def unguarded_planner(*args, **kwargs):
        with host_reads_allowed():
            return plan_routes(*args, **kwargs)

    monkeypatch.setattr(buffer_module, "plan_routes", unguarded_planner)
    results = run_ranks(lambda world: buffer_step(world, CASE, op), CASE.R)
    table = results[0]["table"]
    assert bool((table >= 0).any()), "skewed routing must use slots"
    for rank, res in enumerate(results):  # 1 + every replica's gradient (ones) arrived at its home expert
        replicas_e = torch.zeros(CASE.epn, dtype=F64)
        mine = table[(table >= 0) & (table // CASE.epn == rank)] % CASE.epn
        replicas_e.index_add_(0, mine, torch.ones(len(mine), dtype=F64))
        assert torch.equal(res["home_grad"][:, 0, 0], 1 + replicas_e)


def test_whole_step_with_planner_makes_no_host_read_off_the_cpu():
    """The whole step, planner included, under the guard on the `meta` device: the path a GPU takes (the
    planner's CPU-only capacity check is skipped), and meta tensors hold no values, so any read would fail
    even without the guard. Two thread-ranks, so every exchange crosses ranks."""
    run_ranks(lambda world: buffer_step(world, CASE, None), CASE.R, device="meta")


def test_index_add_in_blocks_equals_index_add():
    """`_index_add_blocked_` (reduce_grad's add, split so no kernel sees 2^31 elements) with tiny blocks."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(-9, 10, (7, 3, 2), generator=gen).to(F64)
    index_c = torch.tensor([6, 0, 3, 3, 5, 0, 2, 6])
    values_c = torch.randint(-9, 10, (8, 3, 2), generator=gen).to(F64)
    values_c[1, 0, 0] = float("inf")
    want = target.clone().index_add_(0, index_c, values_c)
    for max_elements in (6, 13, 18, 10**9):
        got = target.clone()
        exchange_module._index_add_blocked_(got, index_c, values_c, max_elements=max_elements)
        assert torch.equal(got, want), max_elements


@pytest.mark.gpu
def test_cuda_one_rank_step_runs_under_sync_debug_error():
    """A one-rank step on the GPU (dispatch with planning, combine, backward dispatch, combine with route
    weights) under `torch.cuda.set_sync_debug_mode("error")`: any synchronising call raises."""
    case = Case(R=1, S=16, H=8, K=3, E=8, tp=4, kind="skewed")
    buf = case.buffer(single_world("cuda"), validate=False)
    x = {k: v.cuda() for k, v in case.inputs(0).items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows_nvsh, weights_nvs, _, plan = buf.dispatch(x["hidden"], x["weights"], x["topk"], x["tpe"])
        out_sh, _, _ = buf.combine(plan, rows_nvsh * weights_nvs[:, None])
        grad_nvsh, _, _, _ = buf.dispatch(x["hidden"], None, None, None, plan=plan)
        _, weights_sk, _ = buf.combine(plan, grad_nvsh, weights_nvs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    valid_sk = (x["topk"] >= 0).to(F64)
    assert torch.equal(out_sh, (x["weights"] * valid_sk).sum(1, keepdim=True) * x["hidden"])
    assert torch.equal(weights_sk, x["weights"] * valid_sk)
