"""The fused SwiGLU-times-route-weight forward and backward against torch autograd in float64."""

import pytest
import torch
import torch.nn.functional as F

from moonep_moe.fp8.format import FP8_DTYPE, quantise_rows
from moonep_moe.layers.swiglu import (
    swiglu_weighted,
    swiglu_weighted_backward,
    swiglu_weighted_backward_fp8,
    swiglu_weighted_fp8,
)

M, FFN = 37, 24


def autograd_swiglu(ab_m2f: torch.Tensor, route_weights_m: torch.Tensor) -> torch.Tensor:
    a_mf, b_mf = ab_m2f.chunk(2, dim=-1)
    return F.silu(a_mf) * b_mf * route_weights_m[:, None]


def random_case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ab_m2f = (3 * torch.randn(M, 2 * FFN, dtype=torch.float64)).to(dtype)
    route_weights_m = torch.rand(M, dtype=torch.float64)
    route_weights_m[::5] = 0.0  # padding rows carry a zero weight
    u_mf = torch.randn(M, FFN, dtype=torch.float64).to(dtype)
    return ab_m2f, route_weights_m, u_mf


def test_forward_matches_autograd_float64():
    ab_m2f, route_weights_m, _ = random_case(torch.float64)
    hw_mf = swiglu_weighted(ab_m2f, route_weights_m)
    assert hw_mf.shape == (M, FFN) and hw_mf.dtype == torch.float64
    torch.testing.assert_close(hw_mf, autograd_swiglu(ab_m2f, route_weights_m), rtol=1e-14, atol=1e-14)


def test_backward_matches_autograd_float64():
    ab_m2f, route_weights_m, u_mf = random_case(torch.float64)
    ab_m2f.requires_grad_()
    route_weights_m.requires_grad_()
    expected_dab, expected_dw = torch.autograd.grad(
        autograd_swiglu(ab_m2f, route_weights_m), (ab_m2f, route_weights_m), u_mf
    )
    dab_m2f, grad_route_weights_m, hw_mf = swiglu_weighted_backward(u_mf, ab_m2f.detach(),
                                                                     route_weights_m.detach())
    assert dab_m2f.dtype == torch.float64 and grad_route_weights_m.dtype == torch.float64
    expected_hw = autograd_swiglu(ab_m2f, route_weights_m).detach()
    torch.testing.assert_close(hw_mf, expected_hw, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(dab_m2f, expected_dab, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_route_weights_m, expected_dw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_input_keeps_dtypes(dtype):
    ab_m2f, route_weights_m, u_mf = random_case(dtype)
    route_weights_m = route_weights_m.float()
    hw_mf = swiglu_weighted(ab_m2f, route_weights_m)
    dab_m2f, grad_route_weights_m, _ = swiglu_weighted_backward(u_mf, ab_m2f, route_weights_m)
    assert (hw_mf.dtype, dab_m2f.dtype, grad_route_weights_m.dtype) == (dtype, dtype, torch.float32)
    expected = autograd_swiglu(ab_m2f.double(), route_weights_m.double())
    torch.testing.assert_close(hw_mf.double(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.interpreter
@pytest.mark.oldest_triton
@pytest.mark.parametrize("programs", [7, 2**16])
def test_fused_kernels_on_the_cpu_with_fewer_programs_than_rows(monkeypatch, programs):
    """Triton's interpreter: with 7 programs each takes every 7th row below num_rows (the grid's cap, which
    keeps a Buffer sized for R*S*K rows from launching a program per capacity row); the torch path's
    values."""
    from moonep_moe.layers.kernels import swiglu as kernels

    monkeypatch.setattr(kernels, "ROW_PROGRAMS", programs)
    ab_m2f, route_weights_m, u_mf = (t.float() for t in random_case(torch.float64))
    num_rows = torch.tensor([29], dtype=torch.int32)
    got_hw = kernels.swiglu_weighted_triton(ab_m2f, route_weights_m, num_rows)
    got = kernels.swiglu_weighted_backward_triton(u_mf, ab_m2f, route_weights_m, num_rows)
    want_hw = swiglu_weighted(ab_m2f, route_weights_m)
    want = swiglu_weighted_backward(u_mf, ab_m2f, route_weights_m)
    for g, w in zip((got_hw, *got), (want_hw, *want), strict=True):
        torch.testing.assert_close(g[:29], w[:29], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [7, 2**16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ffn", [24, 2048, 1000])
def test_fused_kernels_match_the_reference_and_skip_rows_past_num_rows(monkeypatch, dtype, ffn, programs):
    """The CUDA path (Triton) against the torch path on the same inputs; rows >= num_rows untouched; with 7
    programs each takes every 7th row."""
    from moonep_moe.layers.kernels import swiglu as kernels

    monkeypatch.setattr(kernels, "ROW_PROGRAMS", programs)
    ab_m2f = (3 * torch.randn(300, 2 * ffn, dtype=torch.float64)).to(dtype)
    route_weights_m = torch.rand(300, dtype=torch.float32)
    u_mf = torch.randn(300, ffn, dtype=torch.float64).to(dtype)
    num_rows = torch.tensor([257], dtype=torch.int32, device="cuda")
    cuda = [t.cuda() for t in (ab_m2f, route_weights_m, u_mf)]
    want_hw = swiglu_weighted(ab_m2f, route_weights_m)
    want = swiglu_weighted_backward(u_mf, ab_m2f, route_weights_m)
    got_hw = swiglu_weighted(cuda[0], cuda[1], num_rows)
    got = swiglu_weighted_backward(cuda[2], cuda[0], cuda[1], num_rows)
    # fp32: the route-weight gradient sums F products in another order than the reference
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for g, w in zip((got_hw, *got), (want_hw, *want), strict=True):
        torch.testing.assert_close(g[:257].cpu(), w[:257], **tol)


def over_ab_case(backward, u_mf, ab_m2f, route_weights_m, num_rows=None):
    """`backward` with `over_ab` on a copy of `ab`, against it without: the same three results, dab in the
    copy's own memory."""
    want = backward(u_mf, ab_m2f, route_weights_m, num_rows)
    ab_copy = ab_m2f.clone()
    got = backward(u_mf, ab_copy, route_weights_m, num_rows, over_ab=True)
    assert got[0].data_ptr() == ab_copy.data_ptr()
    return got, want


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_backward_over_ab_gives_the_same_results_in_ab(dtype):
    ab_m2f, route_weights_m, u_mf = random_case(dtype)
    got, want = over_ab_case(swiglu_weighted_backward, u_mf, ab_m2f, route_weights_m.to(
        torch.float64 if dtype == torch.float64 else torch.float32))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.interpreter
def test_fused_backward_over_ab_on_the_cpu(monkeypatch):
    """Triton's interpreter, several column blocks a row (BLOCK_F 8 < F): each block's a and b are read before
    dab is stored over them, so the results equal those written into a new tensor, bit for bit."""
    from moonep_moe.layers.kernels import swiglu as kernels

    monkeypatch.setattr(kernels, "BLOCK_F", 8)
    ab_m2f, route_weights_m, u_mf = (t.float() for t in random_case(torch.float64))
    num_rows = torch.tensor([29], dtype=torch.int32)
    got, want = over_ab_case(kernels.swiglu_weighted_backward_triton, u_mf, ab_m2f, route_weights_m,
                             num_rows)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g[:29], w[:29], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("ffn", [24, 2048, 1000])
def test_fused_backward_over_ab_matches_a_new_tensor(ffn):
    ab_m2f = (3 * torch.randn(300, 2 * ffn, device="cuda")).bfloat16()
    route_weights_m = torch.rand(300, device="cuda")
    u_mf = torch.randn(300, ffn, device="cuda").bfloat16()
    num_rows = torch.tensor([257], dtype=torch.int32, device="cuda")
    got, want = over_ab_case(swiglu_weighted_backward, u_mf, ab_m2f, route_weights_m, num_rows)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g[:257], w[:257], rtol=0, atol=0)


# -- FP8 rows for the GEMMs after SwiGLU, cast in its own pass ----------------------------------------------


def fp8_case(ffn: int, rows: int, num_rows: int, device: str):
    """bf16 ``ab``, ``u`` and fp32 route weights (every 5th row a padding row of weight 0), and ``num_rows``
    (an int32 device scalar: rows past it unwritten)."""
    gen = torch.Generator().manual_seed(ffn)
    ab_m2f = (3 * torch.randn(rows, 2 * ffn, generator=gen)).bfloat16()
    route_weights_m = torch.rand(rows, generator=gen)
    route_weights_m[::5] = 0.0
    u_mf = torch.randn(rows, ffn, generator=gen).bfloat16()
    num_rows = torch.tensor([num_rows], dtype=torch.int32)
    return [t.to(device) for t in (ab_m2f, route_weights_m, u_mf, num_rows)]


def assert_cast_of(got: tuple[torch.Tensor, torch.Tensor], x_mk: torch.Tensor, rows: int) -> None:
    """``got`` = ``(q, scales)`` is the reference cast of ``x``'s first ``rows`` rows, bit for bit, the
    scales MN-major with a row stride of 4-row multiples (DeepGEMM's layout)."""
    q_mk, scales_mk = got
    want_q, want_scales = quantise_rows(x_mk[:rows].cpu())
    assert q_mk.dtype == FP8_DTYPE and scales_mk.stride() == (1, -(-q_mk.shape[0] // 4) * 4)
    assert torch.equal(q_mk[:rows].cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales_mk[:rows].cpu(), want_scales)


def check_fp8_rows(forward, backward, forward_fp8, backward_fp8, device: str, ffn: int, rows: int = 300,
                   num_rows: int = 257) -> None:
    """The FP8 forms against the plain ones (``forward``, ``backward``, the same path) on the same inputs:
    hw's and dab's reference casts, bit for bit, and the backward's other results the same bits, with and
    without ``over_ab``."""
    ab_m2f, route_weights_m, u_mf, ends = fp8_case(ffn, rows, num_rows, device)
    hw_mf = forward(ab_m2f, route_weights_m, ends)
    assert_cast_of(forward_fp8(ab_m2f, route_weights_m, ends), hw_mf, num_rows)
    want = backward(u_mf, ab_m2f, route_weights_m, ends)
    for over_ab in (False, True):
        *got, dab_rows = backward_fp8(u_mf, ab_m2f.clone(), route_weights_m, ends, over_ab=over_ab)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g[:num_rows], w[:num_rows])
        assert_cast_of(dab_rows, want[0], num_rows)


PATHS = (swiglu_weighted, swiglu_weighted_backward, swiglu_weighted_fp8, swiglu_weighted_backward_fp8)
"""The functions `check_fp8_rows` takes: plain and FP8, forward and backward."""


@pytest.mark.parametrize("ffn", [128, 384])
def test_fp8_rows_are_the_reference_cast_of_the_bf16_rows(ffn):
    """The torch path (CPU tensors), F = 1 and 3 tiles."""
    check_fp8_rows(*PATHS, "cpu", ffn)


@pytest.mark.interpreter
@pytest.mark.oldest_triton
@pytest.mark.parametrize("block_f,programs", [(512, 2**16), (128, 7)])
def test_fused_fp8_kernels_on_the_cpu_cast_in_the_same_pass(monkeypatch, block_f, programs):
    """Triton's interpreter: the fused kernels' FP8 outputs are the reference casts of the rows they would
    write in bf16, bit for bit; F = 384 is one block of four tiles (the last masked) at 512 columns a
    block, and three blocks at 128; with 7 programs each takes every 7th row below num_rows."""
    from moonep_moe.layers.kernels import swiglu as kernels

    monkeypatch.setattr(kernels, "BLOCK_F", block_f)
    monkeypatch.setattr(kernels, "ROW_PROGRAMS", programs)
    check_fp8_rows(kernels.swiglu_weighted_triton, kernels.swiglu_weighted_backward_triton,
                   kernels.swiglu_weighted_fp8_triton,
                   lambda *args, **kw: kernels.swiglu_weighted_backward_triton(*args, **kw, fp8_dab=True),
                   "cpu", 384, rows=24, num_rows=19)


@pytest.mark.gpu
@pytest.mark.parametrize("ffn", [128, 384, 2048])
def test_fused_fp8_kernels_cast_in_the_same_pass(ffn):
    """On CUDA (compiled, rounding with the hardware conversion): as on the CPU."""
    check_fp8_rows(*PATHS, "cuda", ffn)


def test_fp8_rows_need_whole_tiles_of_f():
    ab_m2f, route_weights_m, u_mf = (t.bfloat16() for t in random_case(torch.float64))
    with pytest.raises(ValueError, match="F=24 is not a multiple of 128"):
        swiglu_weighted_fp8(ab_m2f, route_weights_m.float())
    with pytest.raises(ValueError, match="F=24 is not a multiple of 128"):
        swiglu_weighted_backward_fp8(u_mf, ab_m2f, route_weights_m.float())
