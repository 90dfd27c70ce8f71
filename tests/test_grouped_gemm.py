"""Every grouped-GEMM backend against a float64 dense per-group matmul; the selection rules; measured
selection ("auto") with an injected timer and its cache, in process and on file."""

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from moonep_moe.gemm import autotune
from moonep_moe.gemm.autotune import (
    ChoiceCache,
    MeasuredGroupedGemm,
    choice_context,
    measure_grouped_gemm,
    rows_bucket,
)
from moonep_moe.gemm.base import GemmProblem, SlotsReady
from moonep_moe.gemm.reference import ReferenceGroupedGemm
from moonep_moe.gemm.registry import select_grouped_gemm
from moonep_moe.gemm.torch_native import TorchGroupedGemm
from moonep_moe.gemm.triton import TritonGroupedGemm
from moonep_moe.transport.threads import run_ranks
from moonep_moe.transport.world import RankFailedError

CPU = torch.device("cpu")
# Segment sizes: empty groups (first, middle, last), a 1-row group and large ones; 7 unused tail rows.
SIZES_G = [0, 1, 37, 0, 120, 1, 64, 0]
TAIL = 7
M, N, K = sum(SIZES_G) + TAIL, 32, 16
HOME = 5  # groups [0, HOME) are "home experts", the rest "prefetch slots"

CASES = [
    (ReferenceGroupedGemm(), torch.float64),
    (ReferenceGroupedGemm(), torch.float32),
    (ReferenceGroupedGemm(), torch.bfloat16),
    (TorchGroupedGemm(), torch.float32),
    (TorchGroupedGemm(), torch.bfloat16),
    (TorchGroupedGemm(), torch.float16),
    # wgrad in Triton's interpreter on CPU tensors
    pytest.param(TritonGroupedGemm(), torch.bfloat16, marks=pytest.mark.interpreter),
    pytest.param(TritonGroupedGemm(), torch.float16, marks=pytest.mark.interpreter),
]
IDS = [f"{gemm.name}-{dtype}" for gemm, dtype in (getattr(case, "values", case) for case in CASES)]
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    # fp32 sums of up to 120 products of N(0, 1) values, twice when accumulating: a typical rounding error
    # is sqrt(n) * 2^-24 * sum|ab| ~ 5e-5 (the worst case n * 2^-24 * sum|ab| ~ 5e-4); 1e-5 failed on one
    # input draw
    torch.float32: dict(rtol=1e-5, atol=2e-4),
    torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
    torch.float16: dict(rtol=2e-3, atol=5e-3),
}


def offsets_g() -> torch.Tensor:
    return torch.tensor(SIZES_G, dtype=torch.int32).cumsum(0).int()


def segments() -> list[tuple[int, int]]:
    ends = offsets_g().tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def random_inputs(dtype: torch.dtype, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Fresh random tensors; rows past the last segment are NaN, which no valid output row may see."""
    tensors = [torch.randn(shape, dtype=torch.float64).to(dtype) for shape in shapes]
    for t in tensors:
        if t.shape[0] == M:
            t[M - TAIL :] = float("nan")
    return tensors


def weight_parts(w_gnk: torch.Tensor, split: bool) -> list[torch.Tensor]:
    """The weights as one tensor, or as separate (home, slots) tensors."""
    return [w_gnk[:HOME].clone(), w_gnk[HOME:].clone()] if split else [w_gnk]


@pytest.mark.parametrize("split", [False, True], ids=["one", "home+slots"])
@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_fwd_and_dgrad_match_dense(gemm, dtype, split):
    x_mk, dy_mn, w_gnk = random_inputs(dtype, (M, K), (M, N), (len(SIZES_G), N, K))
    y_mn = gemm.fwd(x_mk, weight_parts(w_gnk, split), offsets_g())
    dx_mk = gemm.dgrad(dy_mn, weight_parts(w_gnk, split), offsets_g())
    assert y_mn.shape == (M, N) and y_mn.dtype == dtype
    assert dx_mk.shape == (M, K) and dx_mk.dtype == dtype
    for g, (start, end) in enumerate(segments()):
        x, dy, w = x_mk[start:end].double(), dy_mn[start:end].double(), w_gnk[g].double()
        torch.testing.assert_close(y_mn[start:end].double(), x @ w.T, **TOL[dtype])
        torch.testing.assert_close(dx_mk[start:end].double(), dy @ w, **TOL[dtype])


@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_fwd_and_dgrad_write_into_a_given_out(gemm, dtype):
    """`out` (the layer passes the Buffer's rows): the reference writes its segments into it and returns it,
    the rows past the last segment left as they were; torch's kernel makes its own output, which it returns
    instead. Either way the segments are right; an `out` of the wrong shape or dtype is never written."""
    x_mk, dy_mn, w_gnk = random_inputs(dtype, (M, K), (M, N), (len(SIZES_G), N, K))
    for op, a_mk, cols, transpose in (("fwd", x_mk, N, True), ("dgrad", dy_mn, K, False)):
        out = torch.full((M, cols), 7.0, dtype=dtype)
        got = getattr(gemm, op)(a_mk, [w_gnk], offsets_g(), out=out)
        assert (got is out) == (gemm.name == "reference"), (gemm.name, op)
        if got is out:
            assert torch.equal(out[M - TAIL:], torch.full((TAIL, cols), 7.0, dtype=dtype))
        else:
            assert torch.equal(out, torch.full((M, cols), 7.0, dtype=dtype))
        for g, (start, end) in enumerate(segments()):
            w = w_gnk[g].double().T if transpose else w_gnk[g].double()
            torch.testing.assert_close(got[start:end].double(), a_mk[start:end].double() @ w, **TOL[dtype])
        other = torch.float32 if dtype == torch.float64 else torch.float64
        for wrong in (torch.zeros(M + 1, cols, dtype=dtype), torch.zeros(M, cols, dtype=other)):
            assert getattr(gemm, op)(a_mk, [w_gnk], offsets_g(), out=wrong) is not wrong
            assert not wrong.any()


class Arrival:
    """A prefetch's event stand-in: the slots hold NaN until `wait()`, which copies their weights in (the
    replicas arriving) and counts the waits."""

    def __init__(self, slots: torch.Tensor, weights: torch.Tensor):
        self.slots, self.weights, self.waits = slots, weights, 0

    def wait(self) -> None:
        self.slots.copy_(self.weights)
        self.waits += 1


@pytest.mark.parametrize("split", [False, True], ids=["one", "home+slots"])
@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_fwd_and_dgrad_read_the_slots_only_after_they_arrive(gemm, dtype, split):
    """`slots_ready`: the slot groups' weights are NaN until the wait; every backend waits before it reads
    a slot (the torch one after the home groups), so the results equal the dense matmuls."""
    x_mk, dy_mn, w_gnk = random_inputs(dtype, (M, K), (M, N), (len(SIZES_G), N, K))
    for op, a_mk, transpose in (("fwd", x_mk, True), ("dgrad", dy_mn, False)):
        parts = weight_parts(w_gnk, split) if split else [w_gnk.clone()]
        slots = parts[1] if split else parts[0][HOME:]
        slots.fill_(float("nan"))
        arrival = Arrival(slots, w_gnk[HOME:])
        out = getattr(gemm, op)(a_mk, parts, offsets_g(), SlotsReady(HOME, arrival))
        assert arrival.waits == 1
        for g, (start, end) in enumerate(segments()):
            w = w_gnk[g].double().T if transpose else w_gnk[g].double()
            torch.testing.assert_close(out[start:end].double(), a_mk[start:end].double() @ w, **TOL[dtype])


def test_torch_fwd_computes_the_home_groups_before_the_wait(monkeypatch):
    """The torch backend splits: one `torch._grouped_mm` over the home groups is queued before the wait, the
    slot groups after it (so the home experts' GEMM runs while the replicas arrive)."""
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(("gemm", k["offs"].numel()))
                        or grouped_mm(*a, **k))
    x_mk, w_gnk = random_inputs(torch.float32, (M, K), (len(SIZES_G), N, K))

    class Marking:
        def wait(self):
            calls.append(("wait", None))

    TorchGroupedGemm().fwd(x_mk, [w_gnk], offsets_g(), SlotsReady(HOME, Marking()))
    assert calls == [("gemm", HOME), ("wait", None)]


@pytest.mark.parametrize("split", [False, True], ids=["one", "home+slots"])
@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_wgrad_accumulates(gemm, dtype, split):
    x_mk, dy_mn = random_inputs(dtype, (M, K), (M, N))
    grad_dtype = torch.promote_types(dtype, torch.float32)
    out_gnk = torch.zeros(len(SIZES_G), N, K, dtype=grad_dtype)
    parts = weight_parts(out_gnk, split)
    gemm.wgrad(dy_mn, x_mk, offsets_g(), parts)
    gemm.wgrad(dy_mn, x_mk, offsets_g(), parts)
    got_gnk = torch.cat(parts)
    for g, (start, end) in enumerate(segments()):
        expected_nk = 2 * dy_mn[start:end].double().T @ x_mk[start:end].double()
        torch.testing.assert_close(got_gnk[g].double(), expected_nk, **TOL[dtype])
        if start == end:
            assert not got_gnk[g].any(), "an empty group must get a zero gradient"


@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_wgrad_overwrite_replaces_whatever_was_there(gemm, dtype):
    x_mk, dy_mn = random_inputs(dtype, (M, K), (M, N))
    grad_dtype = torch.promote_types(dtype, torch.float32)
    parts = weight_parts(torch.full((len(SIZES_G), N, K), float("nan"), dtype=grad_dtype), split=True)
    gemm.wgrad(dy_mn, x_mk, offsets_g(), parts, accumulate=False)
    got_gnk = torch.cat(parts)
    for g, (start, end) in enumerate(segments()):
        if start == end and g >= HOME:
            continue  # an unused slot: may be left as it was (NaN), nothing reads it
        expected_nk = dy_mn[start:end].double().T @ x_mk[start:end].double()
        torch.testing.assert_close(got_gnk[g].double(), expected_nk, **TOL[dtype])


@pytest.mark.parametrize("later", [True, False], ids=["home+slots", "home-only"])
@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_wgrad_makes_a_none_first_part(gemm, dtype, later):
    """"param" mode: the home groups' gradients (out[0] None) come back fresh in the inputs' dtype, the
    slot groups are overwritten in their fp32 (or wider) part; both equal the float64 products."""
    x_mk, dy_mn = random_inputs(dtype, (M, K), (M, N))
    grad_dtype = torch.promote_types(dtype, torch.float32)
    slots = torch.full((len(SIZES_G) - HOME, N, K), float("nan"), dtype=grad_dtype)
    offs_g = offsets_g() if later else offsets_g()[:HOME]
    home, *rest = gemm.wgrad(dy_mn, x_mk, offs_g, (None, slots) if later else (None,), accumulate=False)
    assert home.shape == (HOME, N, K) and home.dtype == dtype and home.is_contiguous()
    assert rest == ([slots] if later else [])
    got_gnk = torch.cat([home.to(grad_dtype), slots]) if later else home
    for g, (start, end) in enumerate(segments()[:len(got_gnk)]):
        if start == end and g >= HOME:
            continue  # an unused slot: may be left as it was (NaN), nothing reads it
        expected_nk = dy_mn[start:end].double().T @ x_mk[start:end].double()
        torch.testing.assert_close(got_gnk[g].double(), expected_nk, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_wgrad_home_part_is_the_grouped_mm_output_and_ignores_later_rows(monkeypatch, dtype):
    """`torch._grouped_mm(dy^T, x, offs=offs_g[:HOME])` computes exactly the home groups whatever the rows
    after them hold (garbage here), and its output IS the returned home gradient (no copy)."""
    x_mk, dy_mn = random_inputs(dtype, (M, K), (M, N))
    home_end = int(offsets_g()[HOME - 1])
    x_mk[home_end:], dy_mn[home_end:] = float("nan"), float("inf")
    made = []

    def spy(*args, **kwargs):
        made.append(grouped_mm(*args, **kwargs))
        return made[-1]

    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", spy)
    home, = TorchGroupedGemm().wgrad(dy_mn, x_mk, offsets_g()[:HOME], (None,), accumulate=False)
    assert len(made) == 1 and home is made[0]
    assert torch.isfinite(home).all()
    for g, (start, end) in enumerate(segments()[:HOME]):
        expected_nk = dy_mn[start:end].double().T @ x_mk[start:end].double()
        torch.testing.assert_close(home[g].double(), expected_nk, **TOL[dtype])


@pytest.mark.parametrize("gemm", [ReferenceGroupedGemm(), TorchGroupedGemm()], ids=lambda g: g.name)
def test_wgrad_none_part_only_first_and_only_overwriting(gemm):
    x_mk, dy_mn = torch.randn(M, K), torch.randn(M, N)
    slots = torch.zeros(len(SIZES_G) - HOME, N, K)
    with pytest.raises(ValueError, match="out: only its first part may be None.*accumulate=False"):
        gemm.wgrad(dy_mn, x_mk, offsets_g(), (None, slots), accumulate=True)
    with pytest.raises(ValueError, match="out: only its first part may be None"):
        gemm.wgrad(dy_mn, x_mk, offsets_g(), (slots, None), accumulate=False)
    with pytest.raises(ValueError, match="offs_g must be int32 \\[G\\] with G >= the groups"):
        gemm.wgrad(dy_mn, x_mk, offsets_g()[:2], (None, slots), accumulate=False)


@pytest.mark.parametrize("gemm", [ReferenceGroupedGemm(), TorchGroupedGemm()], ids=lambda g: g.name)
def test_group_count_mismatch_is_rejected(gemm):
    x_mk, w_gnk = torch.randn(M, K), torch.randn(len(SIZES_G) - 1, N, K)
    with pytest.raises(ValueError, match="offs_g"):
        gemm.fwd(x_mk, [w_gnk], offsets_g())


def test_select_reference_runs_anything():
    assert select_grouped_gemm("reference", CPU, torch.float64).name == "reference"
    assert select_grouped_gemm("reference", CPU, torch.bfloat16, k=3).name == "reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_select_torch_where_supported(dtype):
    assert select_grouped_gemm("torch", CPU, dtype, k=64).name == "torch"
    assert select_grouped_gemm("auto", CPU, dtype, k=64).name == "torch"


@pytest.mark.parametrize(
    ("dtype", "k", "reason"),
    [(torch.float64, 64, "supports"), (torch.bfloat16, 4, "16 bytes"), (torch.float32, 6, "16 bytes")],
)
def test_select_torch_unsupported(dtype, k, reason):
    with pytest.raises(ValueError, match=f"grouped_gemm='torch'.*{reason}"):
        select_grouped_gemm("torch", CPU, dtype, k=k)
    assert select_grouped_gemm("auto", CPU, dtype, k=k).name == "reference"


def test_select_triton_needs_cuda():
    with pytest.raises(ValueError, match="grouped_gemm='triton' cannot run here: the Triton wgrad runs on"):
        select_grouped_gemm("triton", CPU, torch.bfloat16, k=64)


def test_auto_on_cpu_does_not_measure():
    problem = GemmProblem(((N, K),), rows_per_group=64)
    assert select_grouped_gemm("auto", CPU, torch.bfloat16, k=16, problem=problem).name == "torch"


def test_select_bad_names():
    with pytest.raises(ValueError, match="grouped_gemm='deep_gemm' cannot run here: DeepGEMM runs bf16"):
        select_grouped_gemm("deep_gemm", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="grouped_gemm must be one of"):
        select_grouped_gemm("cublas", CPU, torch.bfloat16)


def _deep_gemm_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        select_grouped_gemm("deep_gemm", torch.device("cuda"), torch.bfloat16, token_padding=128)
    except ValueError:
        return False
    return True


@pytest.mark.skipif(not _deep_gemm_available(), reason="needs DeepGEMM on a Hopper GPU (run on the H200)")
@pytest.mark.parametrize("sizes_g", [[0, 128, 0, 384, 128, 0], [0] * 4 + [1024] + [0] * 3, [128] * 6])
def test_deep_gemm_matches_reference_on_128_aligned_segments(sizes_g):
    """fwd and dgrad on DeepGEMM (psum layout: the padded ends straight from the device), into their own
    output and into a given one, with empty, tiny and huge segments and (home, slots) weight pairs, against
    the reference on fresh data."""
    cuda = torch.device("cuda")
    deep = select_grouped_gemm("deep_gemm", cuda, torch.bfloat16, token_padding=128)
    ref = ReferenceGroupedGemm()
    offs_g = torch.tensor(sizes_g, dtype=torch.int32, device=cuda).cumsum(0).int()
    rows, n, k, home = int(offs_g[-1]) + 64, 256, 384, 2
    x_mk = torch.randn(rows, k, device=cuda, dtype=torch.bfloat16)
    dy_mn = torch.randn(rows, n, device=cuda, dtype=torch.bfloat16)
    w_gnk = torch.randn(len(sizes_g), n, k, device=cuda, dtype=torch.bfloat16) / k**0.5
    weights = (w_gnk[:home], w_gnk[home:])
    used = int(offs_g[-1])
    for op, a_mk, cols in (("fwd", x_mk, n), ("dgrad", dy_mn, k)):
        want = getattr(ref, op)(a_mk, weights, offs_g)
        out = torch.full((rows, cols), float("nan"), device=cuda, dtype=torch.bfloat16)
        for given in (None, out):  # into a given tensor (the layer's Buffer rows) as into its own
            got = getattr(deep, op)(a_mk, weights, offs_g, out=given)
            assert given is None or got is given
            error = float((got[:used].float() - want[:used].float()).norm() / want[:used].float().norm())
            assert error < 1e-2, (op, given is None, error)


DEEP_WGRAD_SIZES = [  # 128-aligned segments: skewed, empty home and slot groups, one huge
    [0, 384, 128, 0, 1280, 0, 128, 0],
    [2048, 0, 0, 128, 0, 0, 0, 3072],
    [128] * 8,
]


@pytest.mark.skipif(not _deep_gemm_available(), reason="needs DeepGEMM on a Hopper GPU (run on the H200)")
@pytest.mark.parametrize("sizes_g", DEEP_WGRAD_SIZES)
@pytest.mark.parametrize("mode", ["fresh", "overwrite", "add_bf16", "add_fp32"])
def test_deep_gemm_wgrad_matches_reference_home_on_deep_gemm_slots_on_triton(sizes_g, mode):
    """wgrad's home part on DeepGEMM's k-grouped kernel (a stand-in host list), its slots on Triton: every
    home group and every filled slot against a float64 reference on fresh data, with NaN rows past the last
    segment and a row count that is not a multiple of 128; the home part bit for bit what the kernel gives
    with the true host list. Tolerances: one rounding of the fp32 sum into the output (bf16: 2^-8 relative
    per element), fp32 sums of up to 3072 products (about sqrt(3072) * 2^-24 relative)."""
    cuda = torch.device("cuda")
    deep = select_grouped_gemm("deep_gemm", cuda, torch.bfloat16, token_padding=128)
    home_groups, cols, inner = 4, 256, 384
    offs_g = torch.tensor(sizes_g, dtype=torch.int32, device=cuda).cumsum(0).int()
    used = int(offs_g[-1])
    dy_mn = torch.randn(used + 64, cols, device=cuda, dtype=torch.bfloat16)
    x_mk = torch.randn(used + 64, inner, device=cuda, dtype=torch.bfloat16)
    dy_mn[used:], x_mk[used:] = float("nan"), float("nan")
    ends = offs_g.tolist()
    want = torch.stack([dy_mn[start:end].double().T @ x_mk[start:end].double()
                        for start, end in zip([0, *ends[:-1]], ends, strict=True)])
    grad_dtype = torch.float32 if mode == "add_fp32" else torch.bfloat16
    before = torch.randn(len(sizes_g), cols, inner, device=cuda).to(grad_dtype)
    out = before.clone()
    home, slots = out[:home_groups], out[home_groups:]
    adds = mode.startswith("add")
    got_home, got_slots = deep.wgrad(dy_mn, x_mk, offs_g, (None if mode == "fresh" else home, slots), adds)
    if adds:
        want += before.double()
    filled = [home_groups + g for g, size in enumerate(sizes_g[home_groups:]) if size]
    got = torch.cat([got_home, got_slots])[list(range(home_groups)) + filled].double()
    want = want[list(range(home_groups)) + filled]
    bound = 2**-8 if grad_dtype == torch.bfloat16 else 1e-5
    assert float((got - want).norm() / want.norm()) < bound
    assert got_home.dtype == grad_dtype and (mode == "fresh" or got_home.data_ptr() == home.data_ptr())
    rows = (used + 64) // 128 * 128
    true_d = (torch.zeros_like(got_home) if mode == "fresh" else before[:home_groups].clone())
    if mode == "overwrite":
        true_d.zero_()
    true_sizes = list(sizes_g[:home_groups])
    true_sizes[-1] += rows - sum(true_sizes)  # a true list: the device's sizes, the last covering the rest
    deep._deep_gemm.k_grouped_bf16_gemm_tn_contiguous(dy_mn[:rows], x_mk[:rows], true_d, true_sizes,
                                                      offs_g.diff(prepend=offs_g.new_zeros(1))[:home_groups],
                                                      true_d)
    assert torch.equal(got_home, true_d)


@pytest.mark.parametrize("arg", ["dy", "x", "out[0]"])
def test_deep_gemm_wgrad_refuses_operands_its_kernel_cannot_lay_out(arg):
    """A non-contiguous operand is refused by name before any kernel (checked on the CPU: the class is made
    without importing DeepGEMM, which the check does not reach)."""
    from moonep_moe.gemm.deep_gemm import DeepGemmGroupedGemm

    deep = object.__new__(DeepGemmGroupedGemm)
    dy_mn, x_mk = torch.randn(M, N, dtype=torch.bfloat16), torch.randn(M, K, dtype=torch.bfloat16)
    home = torch.zeros(HOME, N, K, dtype=torch.bfloat16)
    slots = torch.zeros(len(SIZES_G) - HOME, N, K, dtype=torch.bfloat16)
    if arg == "dy":
        dy_mn = torch.randn(M, 2 * N, dtype=torch.bfloat16)[:, :N]
    elif arg == "x":
        x_mk = torch.randn(M, 2 * K, dtype=torch.bfloat16)[:, ::2]
    else:
        home = torch.zeros(HOME, K, N, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match=rf"deep_gemm wgrad needs {re.escape(arg)} contiguous"):
        deep.wgrad(dy_mn, x_mk, offsets_g(), (home, slots), accumulate=True)


class FakeTimer:
    """Injected timer: the backend named ``winners[op]`` takes 1 s, every other 2 s (``WGRAD_ADD`` as
    "wgrad" unless named); records each call."""

    def __init__(self, winners: dict[str, str]):
        self.winners, self.calls = winners, []

    def __call__(self, op, n, k, rows, groups, backends):
        self.calls.append((op, n, k, rows, groups, tuple(gemm.name for gemm in backends)))
        winner = self.winners.get(op) or self.winners[op.split()[0]]
        return [1.0 if gemm.name == winner else 2.0 for gemm in backends]


class WgradOnly(ReferenceGroupedGemm):
    """A backend that computes only wgrad itself (like the Triton one)."""

    name = "wgrad_only"
    ops = ("wgrad",)


SHAPES = GemmProblem(((N, K), (K, N)), rows_per_group=100)
CONTEXT = "test-device|bf16"
OPS_NAMES = ("fwd", "dgrad", "wgrad")


def test_measured_choice_per_op_and_dispatch():
    timer = FakeTimer({"fwd": "reference", "dgrad": "torch", "wgrad": "reference"})
    gemm = measure_grouped_gemm([TorchGroupedGemm(), ReferenceGroupedGemm()], SHAPES, CONTEXT, timer,
                                ChoiceCache(None))
    assert isinstance(gemm, MeasuredGroupedGemm)
    assert {key: g.name for key, g in gemm.chosen.items()} == {
        ("fwd", N, K): "reference", ("fwd", K, N): "reference", ("dgrad", N, K): "torch",
        ("dgrad", K, N): "torch", ("wgrad", N, K): "reference", ("wgrad", K, N): "reference"}
    assert [call[:5] for call in timer.calls] == [(op, n, k, 128, (8, 0)) for op in ("fwd", "dgrad", "wgrad")
                                                  for n, k in ((N, K), (K, N))]
    # dispatch: the chosen backends compute the right thing
    x_mk, dy_mn, w_gnk = random_inputs(torch.float32, (M, K), (M, N), (len(SIZES_G), N, K))
    ref = ReferenceGroupedGemm()
    torch.testing.assert_close(gemm.fwd(x_mk, [w_gnk], offsets_g()), ref.fwd(x_mk, [w_gnk], offsets_g()),
                               equal_nan=True)
    got, want = torch.zeros(len(SIZES_G), N, K), torch.zeros(len(SIZES_G), N, K)
    gemm.wgrad(dy_mn, x_mk, offsets_g(), [got], accumulate=False)
    ref.wgrad(dy_mn, x_mk, offsets_g(), [want], accumulate=False)
    torch.testing.assert_close(got, want)
    home, _ = gemm.wgrad(dy_mn, x_mk, offsets_g(), (None, got[HOME:]), accumulate=False)  # "param" mode
    torch.testing.assert_close(home, want[:HOME])


def test_ranks_whose_timings_disagree_run_rank_0s_choices():
    """Timing noise can make ranks measure different winners; ranks that ran different backends would
    compute the same experts differently. Every rank runs rank 0's choice of every primitive and shape;
    each keeps its own measurement in its cache (a record of what it timed)."""
    winners = [{"fwd": "torch", "dgrad": "reference", "wgrad": "reference"},
               {"fwd": "reference", "dgrad": "torch", "wgrad": "torch"}]

    def rank(world):
        cache = ChoiceCache(None)
        gemm = measure_grouped_gemm([TorchGroupedGemm(), ReferenceGroupedGemm()], SHAPES, CONTEXT,
                                    FakeTimer(winners[world.rank]), cache, world=world)
        return {key: g.name for key, g in gemm.chosen.items()}, sorted(cache._choices.values())

    (chosen_0, cached_0), (chosen_1, cached_1) = run_ranks(rank, 2)
    shapes = ((N, K), (K, N))
    assert chosen_0 == chosen_1 == {(op, n, k): winners[0][op] for op in winners[0] for n, k in shapes}
    assert [cached_0, cached_1] == [sorted(w[op] for op in w for _ in shapes) for w in winners]


def test_a_rank_that_cannot_run_rank_0s_choice_raises_naming_it():
    def rank(world):
        backends = [TorchGroupedGemm(), ReferenceGroupedGemm()][:2 - world.rank]
        measure_grouped_gemm(backends, SHAPES, CONTEXT, FakeTimer(dict.fromkeys(OPS_NAMES, "reference")),
                             ChoiceCache(None), world=world)

    message = (r"rank 1 failed: ValueError: rank 1: grouped_gemm='auto': rank 0 runs reference for fwd "
               r"\d+x\d+, which this rank cannot run \(its candidates: torch\)")
    with pytest.raises(RankFailedError, match=message):
        run_ranks(rank, 2)


def test_only_backends_computing_an_op_themselves_are_timed():
    timer = FakeTimer({"wgrad": "wgrad_only"})
    gemm = measure_grouped_gemm([TorchGroupedGemm(), WgradOnly()], SHAPES, CONTEXT, timer, ChoiceCache(None))
    assert {call[0] for call in timer.calls} == {"wgrad"}
    assert all(call[5] == ("torch", "wgrad_only") for call in timer.calls)
    assert gemm.chosen[("fwd", N, K)].name == "torch" and gemm.chosen[("wgrad", K, N)].name == "wgrad_only"


def test_cache_in_process_then_on_file(tmp_path):
    path = tmp_path / "sub" / "gemm.json"
    backends = [TorchGroupedGemm(), ReferenceGroupedGemm()]
    winners = {"fwd": "torch", "dgrad": "reference", "wgrad": "reference"}
    timer, cache = FakeTimer(winners), ChoiceCache(path)
    first = measure_grouped_gemm(backends, SHAPES, CONTEXT, timer, cache)
    assert len(timer.calls) == 6
    again = measure_grouped_gemm(backends, SHAPES, CONTEXT, timer, cache)
    assert len(timer.calls) == 6, "the in-process cache must skip the timing"
    saved = json.loads(path.read_text())
    assert len(saved) == 6 and all(key.startswith(CONTEXT) for key in saved)
    # a later process: a fresh cache on the same file, and a timer that would pick differently
    other = FakeTimer({op: "torch" for op in winners})
    later = measure_grouped_gemm(backends, SHAPES, CONTEXT, other, ChoiceCache(path))
    assert other.calls == []
    for gemm in (again, later):
        assert {k: g.name for k, g in gemm.chosen.items()} == {k: g.name for k, g in first.chosen.items()}
    # another rows bucket, context or candidate set is another key: timed, and added to the same file
    measure_grouped_gemm(backends, GemmProblem(SHAPES.shapes_nk, 1000), CONTEXT, other, ChoiceCache(path))
    measure_grouped_gemm(backends, SHAPES, "other-device|bf16", other, ChoiceCache(path))
    measure_grouped_gemm(backends[:1] + [WgradOnly()], SHAPES, CONTEXT, other, ChoiceCache(path))
    assert len(other.calls) == 6 + 6 + 2
    assert len(json.loads(path.read_text())) == 6 + 6 + 6 + 2


def test_wgrad_choice_is_kept_per_gradient_dtype(tmp_path):
    """The gradients' dtype changes what wgrad writes, so its choice is kept per dtype; fwd and dgrad
    keep theirs."""
    backends, path = [TorchGroupedGemm(), ReferenceGroupedGemm()], tmp_path / "gemm.json"
    timer = FakeTimer({"fwd": "torch", "dgrad": "torch", "wgrad": "reference"})
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float32):
        problem = GemmProblem(SHAPES.shapes_nk, SHAPES.rows_per_group, grad_dtype=grad_dtype)
        measure_grouped_gemm(backends, problem, CONTEXT, timer, ChoiceCache(path))
    assert [call[0] for call in timer.calls] == ["fwd"] * 2 + ["dgrad"] * 2 + ["wgrad"] * 4
    wgrad_keys = sorted(key.split("|")[-2] for key in json.loads(path.read_text()) if "|wgrad|" in key)
    assert wgrad_keys == ["grad=bfloat16"] * 2 + ["grad=float32"] * 2


@pytest.mark.parametrize(("groups", "shape", "rows", "timed"), [
    ((256, 0), (4096, 7168), 256, (32, 0)),      # DeepSeek-V3 at EP = 1: 32 of 256 groups
    ((32, 32), (4096, 7168), 2048, (27, 1)),     # one EP = 8 rank: its home groups and the slot a plan fills
    ((32, 32), (28672, 4096), 2048, (6, 1)),     # large experts: the memory cap leaves 7 groups
    ((1, 1), (28672, 4096), 16384, (1, 1)),      # Mixtral at EP = 8
    ((1, 1), (28672, 4096), 65536, (1, 0)),      # room for one group: the home one
    ((3, 0), (32, 16), 128, (3, 0)), ((0, 4), (32, 16), 128, (0, 4)), ((1, 63), (32, 16), 8, (1, 1)),
])
def test_timed_groups_are_the_home_ones_and_a_filled_slot_up_to_a_count_and_a_memory_cap(groups, shape, rows,
                                                                                           timed):
    problem = GemmProblem((shape,), rows, groups=groups)
    assert autotune.timed_groups(problem, *shape, rows) == timed
    assert 2 * rows * sum(shape) + 6 * shape[0] * shape[1] <= autotune.TIMING_BYTES // sum(timed)


def test_wgrad_is_timed_in_the_layers_mode_and_kept_per_mode(tmp_path):
    """The layer's problem (groups, "param" or "main_grad" mode) reaches the timer and the cache key: the
    two modes are timed and kept apart, and keys of the format before it (8 groups, overwrite) are not
    reused."""
    path = tmp_path / "gemm.json"
    backends = [TorchGroupedGemm(), ReferenceGroupedGemm()]
    old_key = f"{CONTEXT}|wgrad|n={N}|k={K}|rows=128|torch/reference|grad=bfloat16"
    path.write_text(json.dumps({old_key: "reference"}))
    timer = FakeTimer({"fwd": "torch", "dgrad": "torch", "wgrad": "torch"})
    for fresh in (True, False, True):
        problem = GemmProblem(((N, K),), 100, torch.bfloat16, groups=(48, 16), fresh_home_grads=fresh)
        gemm = measure_grouped_gemm(backends, problem, CONTEXT, timer, ChoiceCache(path))
        assert gemm.chosen[("wgrad", N, K)].name == "torch"
    # the "param" problem times its adding form too, under the key the "main_grad" one then reads
    assert [call[:5] for call in timer.calls if call[0].startswith("wgrad")] == [
        ("wgrad", N, K, 128, (31, 1)), (autotune.WGRAD_ADD, N, K, 128, (31, 1))]
    keys = [key for key in json.loads(path.read_text()) if key != old_key and "|wgrad|" in key]
    assert sorted(key.removeprefix(f"{CONTEXT}|wgrad|") for key in keys) == [
        f"n={N}|k={K}|rows=128|groups=31+1|torch/reference|grad=bfloat16|{mode}" for mode in ("add", "fresh")]


def test_param_mode_chooses_apart_the_wgrad_that_makes_home_gradients_and_the_one_adding_into_them():
    """A "param" problem (the home gradients made by the backend) also times wgrad adding into given home
    gradients (`WGRAD_ADD`, a later micro-batch's calls): each call goes to its own form's winner, both
    computing the reference's gradients; a "main_grad" problem has no second form."""
    timer = FakeTimer({"fwd": "torch", "dgrad": "torch", "wgrad": "torch", autotune.WGRAD_ADD: "recording"})
    recording = Recording()
    problem = GemmProblem(((N, K),), 100, torch.float32, groups=(HOME, len(SIZES_G) - HOME),
                          fresh_home_grads=True)
    gemm = measure_grouped_gemm([TorchGroupedGemm(), recording], problem, CONTEXT, timer, ChoiceCache(None))
    assert gemm.chosen[("wgrad", N, K)].name == "torch"
    assert gemm.chosen[(autotune.WGRAD_ADD, N, K)].name == "recording"
    x_mk, dy_mn = random_inputs(torch.float32, (M, K), (M, N))
    want = torch.zeros(len(SIZES_G), N, K)
    ReferenceGroupedGemm().wgrad(dy_mn, x_mk, offsets_g(), [want], accumulate=False)
    slots = torch.zeros(len(SIZES_G) - HOME, N, K)
    home, _ = gemm.wgrad(dy_mn, x_mk, offsets_g(), (None, slots), accumulate=False)
    assert recording.wgrad_calls == []
    gemm.wgrad(dy_mn, x_mk, offsets_g(), (home, slots.zero_()), accumulate=True)
    assert [accumulate for _, accumulate, _ in recording.wgrad_calls] == [True]
    torch.testing.assert_close(home, 2 * want[:HOME])
    torch.testing.assert_close(slots, want[HOME:])
    main_grad = dataclasses.replace(problem, fresh_home_grads=False)
    assert (autotune.WGRAD_ADD, N, K) not in measure_grouped_gemm(
        [TorchGroupedGemm(), Recording()], main_grad, CONTEXT, timer, ChoiceCache(None)).chosen


class Recording(ReferenceGroupedGemm):
    """Records how wgrad is called."""

    name = "recording"

    def __init__(self):
        self.wgrad_calls = []

    def wgrad(self, dy, x, offs_g, out, accumulate=True):
        self.wgrad_calls.append(([None if part is None else (part.dtype, part.shape[0]) for part in out],
                                 accumulate, offs_g.tolist()))
        return super().wgrad(dy, x, offs_g, out, accumulate)


@pytest.mark.parametrize("fresh", [True, False], ids=["param", "main_grad"])
def test_timed_wgrad_calls_are_the_layers(fresh):
    """"param": the home part made by the backend, fp32 slots overwritten; "main_grad": added into home
    gradients of the gradient dtype and fp32 slots; on (home + slot) groups of the timed rows."""
    gemm = Recording()
    calls = autotune.timed_calls("wgrad", N, K, 8, (3, 2), [gemm], CPU, torch.bfloat16, torch.float32,
                                     fresh)
    calls[0]()
    home = None if fresh else (torch.float32, 3)
    assert gemm.wgrad_calls == [([home, (torch.float32, 2)], not fresh, [8, 16, 24, 32, 40])]


class StepClock:
    """A clock whose marks are the positions in a log of calls; each call's time is set by its name."""

    def __init__(self, log: list[str], seconds: dict[str, list[float]]):
        self.log, self.per_call = log, {name: iter(times) for name, times in seconds.items()}

    def mark(self) -> int:
        return len(self.log)

    def seconds(self, start: int, end: int) -> float:
        (name,) = self.log[start:end]  # exactly the one timed call between the marks
        return next(self.per_call[name])


def test_candidates_are_timed_in_turns_after_every_warmup_medians_and_failures():
    """auto's timer: every candidate warms up, then each round runs every candidate once (none timed on a
    GPU warmer than another's); each gets the median of its rounds; one that raises counts as inf."""
    log: list[str] = []

    def call(name: str, fails_at: int | None = None):
        def run():
            log.append(name)
            if fails_at is not None and log.count(name) == fails_at:
                raise RuntimeError("no kernel for this shape")
        return run

    clock = StepClock(log, {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 9.0]})
    with pytest.warns(UserWarning, match="candidate c failed while timed"):
        seconds = autotune.seconds_in_turns([call("a"), call("b"), call("c", fails_at=3)], ["a", "b", "c"],
                                            warmup=2, repeat=3, clock=clock)
    assert seconds == [2.0, 5.0, float("inf")]
    assert log == ["a", "a", "b", "b", "c", "c", "a", "b", "c", "a", "b", "a", "b"]


def test_cache_file_unreadable_or_stale_is_timed_again(tmp_path):
    path = tmp_path / "gemm.json"
    path.write_text("{not json")
    backends = [TorchGroupedGemm(), ReferenceGroupedGemm()]
    timer = FakeTimer({"fwd": "torch", "dgrad": "torch", "wgrad": "reference"})
    measure_grouped_gemm(backends, SHAPES, CONTEXT, timer, ChoiceCache(path))
    assert len(timer.calls) == 6 and len(json.loads(path.read_text())) == 6
    # a file naming a backend that is not a candidate now: timed again, not trusted
    path.write_text(json.dumps({key: "cublas" for key in json.loads(path.read_text())}))
    measure_grouped_gemm(backends, SHAPES, CONTEXT, timer, ChoiceCache(path))
    assert len(timer.calls) == 12


def test_default_cache_location(monkeypatch, tmp_path):
    monkeypatch.setattr(autotune, "_DEFAULT_CACHE", None)
    monkeypatch.setenv("MOONEP_MOE_CACHE", str(tmp_path))
    assert autotune.default_choice_cache().path == tmp_path / "gemm.json"
    monkeypatch.setattr(autotune, "_DEFAULT_CACHE", None)
    monkeypatch.setenv("MOONEP_MOE_CACHE", "off")
    assert autotune.default_choice_cache().path is None
    monkeypatch.setattr(autotune, "_DEFAULT_CACHE", None)
    monkeypatch.delenv("MOONEP_MOE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert autotune.default_choice_cache().path == tmp_path / "moonep-moe" / "gemm.json"


def test_measured_selection_logs_what_it_times_what_it_chose_and_the_cache(caplog, tmp_path):
    """INFO on the "moonep_moe" logger: each timing (candidates, primitive, shape, where the winner is
    kept), each winner, and a summary; a later process that reads every choice from the file says so."""
    caplog.set_level(logging.INFO, logger="moonep_moe")
    path = tmp_path / "gemm.json"
    backends = [TorchGroupedGemm(), ReferenceGroupedGemm()]
    timer = FakeTimer({"fwd": "torch", "dgrad": "reference", "wgrad": "reference"})
    measure_grouped_gemm(backends, SHAPES, CONTEXT, timer, ChoiceCache(path))
    lines = [record.getMessage() for record in caplog.records if record.name.startswith("moonep_moe")]
    assert f"grouped_gemm=auto: timing torch/reference fwd on [{N}, {K}] weights, 8 + 0 groups of 128 rows " \
           f"({CONTEXT}), once: the winner is kept in {path}" in lines
    assert any(line.startswith(f"grouped_gemm=auto: dgrad {N}x{K} -> reference (torch 2000.000 ms, "
                               "reference 1000.000 ms") for line in lines)
    assert sum("timing" in line for line in lines) == 6
    assert f"fwd {N}x{K}: torch" in lines[-1] and "6 timed" in lines[-1] and str(path) in lines[-1]
    caplog.clear()
    measure_grouped_gemm(backends, SHAPES, CONTEXT, timer, ChoiceCache(path))  # as a later process would
    lines = [record.getMessage() for record in caplog.records if record.name.startswith("moonep_moe")]
    assert len(lines) == 1 and "0 timed, the rest from the cache" in lines[0] and str(path) in lines[0]


SECOND_PROCESS = """
from moonep_moe.gemm.autotune import default_choice_cache, measure_grouped_gemm
from moonep_moe.gemm.base import GemmProblem, SlotsReady
from moonep_moe.gemm.reference import ReferenceGroupedGemm
from moonep_moe.gemm.torch_native import TorchGroupedGemm
calls = []
def timer(op, n, k, rows, groups, backends):
    calls.append(op)
    return [float(i) for i, _ in enumerate(backends)]
problem = GemmProblem(((32, 16), (16, 32)), rows_per_group=100)
gemm = measure_grouped_gemm([TorchGroupedGemm(), ReferenceGroupedGemm()], problem, "ctx", timer,
                            default_choice_cache())
print(len(calls), gemm.describe())
"""


def test_a_second_process_reads_the_default_cache_file_instead_of_timing(tmp_path):
    """Two processes with the same `MOONEP_MOE_CACHE`: the first times every primitive and shape, the second
    none, and both choose the same."""
    env = {**os.environ, "MOONEP_MOE_CACHE": str(tmp_path)}
    root = Path(__file__).resolve().parents[1]
    outputs = [subprocess.run([sys.executable, "-c", SECOND_PROCESS], env=env, cwd=root, capture_output=True,
                              text=True, check=True, timeout=120).stdout.strip() for _ in range(2)]
    (first_timed, first_choice), (second_timed, second_choice) = (out.split(" ", 1) for out in outputs)
    assert (first_timed, second_timed) == ("6", "0") and first_choice == second_choice
    assert len(json.loads((tmp_path / "gemm.json").read_text())) == 6


def test_choice_context_names_the_device_the_versions_and_the_dtype():
    import triton

    context = choice_context("NVIDIA H200", torch.bfloat16)
    assert context == f"NVIDIA H200|torch {torch.__version__}|triton {triton.__version__}|bfloat16"


@pytest.mark.parametrize(("rows", "align", "bucket"), [(0, 1, 1), (1, 1, 1), (100, 1, 128), (128, 1, 128),
                                                        (129, 8, 256), (20, 128, 128), (300, 128, 512)])
def test_rows_bucket(rows, align, bucket):
    assert rows_bucket(rows, align) == bucket


@pytest.mark.gpu
def test_gpu_auto_measures_once_and_matches_reference(monkeypatch, tmp_path):
    """On CUDA, "auto" times torch, triton (and DeepGEMM where installed) and the result is right."""
    monkeypatch.setattr(autotune, "_DEFAULT_CACHE", None)
    monkeypatch.setenv("MOONEP_MOE_CACHE", str(tmp_path))
    cuda = torch.device("cuda")
    n, k, sizes_g = 512, 256, [0, 128, 256, 0, 384, 128]
    problem = GemmProblem(((n, k), (k, n)), rows_per_group=128)
    gemm = select_grouped_gemm("auto", cuda, torch.bfloat16, k=k, token_padding=128, problem=problem)
    assert isinstance(gemm, MeasuredGroupedGemm) and len(gemm.chosen) == 6
    assert len(json.loads((tmp_path / "gemm.json").read_text())) == 6
    offs_g = torch.tensor(sizes_g, dtype=torch.int32, device=cuda).cumsum(0).int()
    x_mk = torch.randn(int(offs_g[-1]), k, device=cuda, dtype=torch.bfloat16)
    dy_mn = torch.randn(int(offs_g[-1]), n, device=cuda, dtype=torch.bfloat16)
    w_gnk = torch.randn(len(sizes_g), n, k, device=cuda, dtype=torch.bfloat16) / k**0.5
    ref = ReferenceGroupedGemm()
    for got, want in ((gemm.fwd(x_mk, [w_gnk], offs_g), ref.fwd(x_mk, [w_gnk], offs_g)),
                      (gemm.dgrad(dy_mn, [w_gnk[:2], w_gnk[2:]], offs_g), ref.dgrad(dy_mn, [w_gnk], offs_g))):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    got, want = torch.zeros(len(sizes_g), n, k, device=cuda), torch.zeros(len(sizes_g), n, k, device=cuda)
    gemm.wgrad(dy_mn, x_mk, offs_g, [got[:2], got[2:]], accumulate=False)
    ref.wgrad(dy_mn, x_mk, offs_g, [want], accumulate=False)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-1)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes_g", [[256] * 6, [0, 1, 2048, 0, 129, 7], [384, 0, 0, 0, 0, 0]],
                         ids=["uniform", "skewed", "home-only-rows"])
def test_gpu_torch_wgrad_fresh_home_and_triton_slots(sizes_g):
    """On CUDA the home groups come from `torch._grouped_mm(offs=offs_g[:home])` and the slot groups from
    the Triton wgrad (`first_group`), written into fp32 slot gradients; both against the reference. An
    empty slot group (an unused slot) is not written: it keeps its NaN."""
    cuda, home_groups, n, k = torch.device("cuda"), 2, 512, 256
    offs_g = torch.tensor(sizes_g, dtype=torch.int32, device=cuda).cumsum(0).int()
    rows = int(offs_g[-1]) + 64
    x_mk = torch.randn(rows, k, device=cuda, dtype=torch.bfloat16)
    dy_mn = torch.randn(rows, n, device=cuda, dtype=torch.bfloat16)
    x_mk[rows - 64:], dy_mn[rows - 64:] = float("nan"), float("nan")
    slots = torch.full((len(sizes_g) - home_groups, n, k), float("nan"), device=cuda)
    home, _ = TorchGroupedGemm().wgrad(dy_mn, x_mk, offs_g, (None, slots), accumulate=False)
    want = torch.zeros(len(sizes_g), n, k, device=cuda)
    ReferenceGroupedGemm().wgrad(dy_mn, x_mk, offs_g, [want], accumulate=False)
    assert home.dtype == torch.bfloat16 and home.shape == (home_groups, n, k)
    torch.testing.assert_close(home.float(), want[:home_groups], rtol=2e-2, atol=1e-1)
    unused = torch.tensor(sizes_g[home_groups:], device=cuda) == 0
    assert slots[unused].isnan().all()
    torch.testing.assert_close(slots[~unused], want[home_groups:][~unused], rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
def test_gpu_layer_ranks_agree_on_auto_when_their_timings_differ(monkeypatch):
    """Two thread-ranks build a `grouped_gemm="auto"` layer, each timing for itself (no shared cache) with a
    timer under which rank r finds backend r fastest: both run rank 0's choices."""
    from test_layer import make_config

    from moonep_moe.gemm import registry
    from moonep_moe.layers.moe import MoonEPMoELayer

    monkeypatch.setattr(registry, "default_choice_cache", lambda: ChoiceCache(None))

    def rank_timer(device, dtype, grad_dtype, fresh_home_grads):
        def timer(op, n, k, rows, groups, backends):
            favourite = int(threading.current_thread().name.removeprefix("ep-rank-")) % len(backends)
            return [1.0 if i == favourite else 2.0 for i in range(len(backends))]
        return timer

    monkeypatch.setattr(registry, "cuda_timer", rank_timer)
    cfg = make_config(2, hidden_size=256, ffn_hidden_size=128, num_experts=8, max_tokens_per_rank=64,
                      token_padding=16, dtype="bfloat16", grouped_gemm="auto", router={"dtype": "float32"})

    def rank(world):
        layer = MoonEPMoELayer(cfg, world)
        return layer._state.gemm.describe()

    described = run_ranks(rank, 2, device="cuda")
    assert described[0] == described[1], described
