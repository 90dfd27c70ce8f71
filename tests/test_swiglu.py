"""The fused SwiGLU-times-route-weight forward and backward against torch autograd in float64."""

import pytest
import torch
import torch.nn.functional as F

from moonep_moe.layers.swiglu import swiglu_weighted, swiglu_weighted_backward

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
