"""The elementwise middle of the expert block: SwiGLU times the per-row route weight, and its backward.

Shapes use the suffix letters of DESIGN.md, "Notation": a row is a dispatched row (``nv``), ``ab_nv2f`` the
fused gate+up projection output, columns ``[0, F)`` = a (gate), ``[F, 2F)`` = b (up). Both functions are
pure, compute in fp32 (float64 for float64 input) and cast back to the input dtypes. On CUDA (with Triton)
they run as one fused kernel each (`moonep_moe.layers.kernels.swiglu`), elsewhere as the torch reference
below; rows at and past `num_rows` (an int32 device scalar such as `cu_seqlens[-1]`) are then left
unspecified.

With FP8 GEMMs after them (`swiglu_weighted_fp8`, `swiglu_weighted_backward_fp8`) they also hand the next
GEMM its rows cast to e4m3 per 1x128 tile (`moonep_moe.gemm.fp8`'s format and DeepGEMM's scale layout, the
bytes `fp8.cast.cast_rows` makes of their bf16 output), so that GEMM reads no bf16 rows to cast them: on
CUDA the casts run inside the fused kernels (forward writes no bf16 ``hw`` at all).

Forward:  ``hw = silu(a) * b * w[:, None]``.
Backward, with ``u`` the gradient w.r.t. ``hw`` (``u = dy @ Wd``) and ``dh = u * w[:, None]``:
``grad_w = rowsum(u * silu(a) * b)``, ``da = dh * b * silu'(a)``, ``db = dh * silu(a)``,
``silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from moonep_moe.base.triton import triton_available
from moonep_moe.fp8.format import TILE, quantise_rows, to_deep_gemm_row_scales

__all__ = ["fp8_tiles_reason", "swiglu_backward_rows", "swiglu_weighted", "swiglu_weighted_backward",
           "swiglu_weighted_backward_fp8", "swiglu_weighted_fp8"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _use_triton(tensor: Tensor) -> bool:
    """The one place that picks the fused kernels: CUDA tensors of 16 or 32 bits with Triton installed (the
    kernels compute in fp32; float64 stays on the torch path)."""
    return tensor.is_cuda and tensor.dtype != torch.float64 and triton_available()


def swiglu_weighted(ab_nv2f: Tensor, route_weights_nvs: Tensor, num_rows: Tensor | None = None) -> Tensor:
    """``hw_nvf = silu(a) * b * w[:, None]``.

    Args:
        ab_nv2f: [NvS, 2F] gate and up projections, any floating dtype.
        route_weights_nvs: [NvS] route weight per row (fp32 usually; padding rows carry 0).

    Returns:
        hw_nvf: [NvS, F] in ``ab_nv2f.dtype``.
    """
    if _use_triton(ab_nv2f):
        from moonep_moe.layers.kernels.swiglu import swiglu_weighted_triton

        return swiglu_weighted_triton(ab_nv2f, route_weights_nvs, num_rows)
    compute = _compute_dtype(ab_nv2f.dtype)
    a_nvf, b_nvf = ab_nv2f.to(compute).chunk(2, dim=-1)
    w_nv1 = route_weights_nvs.to(compute)[:, None]
    return (F.silu(a_nvf) * b_nvf * w_nv1).to(ab_nv2f.dtype)


def swiglu_weighted_backward(u_nvf: Tensor, ab_nv2f: Tensor, route_weights_nvs: Tensor,
                             num_rows: Tensor | None = None, over_ab: bool = False
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``swiglu_weighted`` given ``u_nvf``, the gradient w.r.t. its output ``hw_nvf``.

    Args:
        u_nvf: [NvS, F] gradient w.r.t. ``hw_nvf``.
        ab_nv2f: [NvS, 2F] the forward input.
        route_weights_nvs: [NvS] the forward route weights.
        over_ab: write ``dab`` over ``ab_nv2f`` (returned as ``dab_nv2f``) instead of into a new tensor, for a
            caller that never reads ``ab`` again: one ``[NvS, 2F]`` tensor less while both would be alive.
            Each element of ``dab`` depends on ``ab``'s elements of its own row and column pair only, which
            the fused kernel reads before it writes them.

    Returns:
        dab_nv2f: [NvS, 2F] in ``ab_nv2f.dtype`` (``ab_nv2f`` itself with ``over_ab``).
        grad_route_weights_nvs: [NvS] in ``route_weights_nvs.dtype``, reduced in fp32 (or float64).
        hw_nvf: [NvS, F] the forward output, recomputed in the same pass (the down projection's wgrad needs
            it).
    """
    if _use_triton(ab_nv2f):
        from moonep_moe.layers.kernels.swiglu import swiglu_weighted_backward_triton

        return swiglu_weighted_backward_triton(u_nvf, ab_nv2f, route_weights_nvs, num_rows, over_ab)
    compute = _compute_dtype(ab_nv2f.dtype)
    a_nvf, b_nvf = ab_nv2f.to(compute).chunk(2, dim=-1)
    u_nvf = u_nvf.to(compute)
    sig_nvf = torch.sigmoid(a_nvf)
    silu_nvf = a_nvf * sig_nvf
    grad_route_weights_nvs = (u_nvf * silu_nvf * b_nvf).sum(-1)
    dh_nvf = u_nvf * route_weights_nvs.to(compute)[:, None]
    da_nvf = dh_nvf * b_nvf * sig_nvf * (1 + a_nvf * (1 - sig_nvf))
    dab_nv2f = torch.cat([da_nvf, dh_nvf * silu_nvf], dim=-1)
    hw_nvf = silu_nvf * b_nvf * route_weights_nvs.to(compute)[:, None]
    if over_ab:
        dab_nv2f = ab_nv2f.copy_(dab_nv2f)
    return (dab_nv2f.to(ab_nv2f.dtype), grad_route_weights_nvs.to(route_weights_nvs.dtype),
            hw_nvf.to(ab_nv2f.dtype))


def swiglu_weighted_fp8(ab_nv2f: Tensor, route_weights_nvs: Tensor,
                        num_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``hw_nvf`` (`swiglu_weighted`) as the FP8 rows a GEMM multiplies: ``(q [NvS, F] e4m3, scales [NvS,
    F/128] fp32)``, one power-of-two scale per row per 128 columns of hw in ``ab_nv2f``'s dtype, the scales
    MN-major with a row stride of `fp8.format.tma_aligned_rows` (DeepGEMM's sm90 layout). F must be a
    multiple of 128 (`fp8_tiles_reason`; ValueError)."""
    _check_fp8_tiles(ab_nv2f)
    if _use_triton(ab_nv2f):
        from moonep_moe.layers.kernels.swiglu import swiglu_weighted_fp8_triton

        return swiglu_weighted_fp8_triton(ab_nv2f, route_weights_nvs, num_rows)
    return _fp8_rows(swiglu_weighted(ab_nv2f, route_weights_nvs))


def swiglu_weighted_backward_fp8(u_nvf: Tensor, ab_nv2f: Tensor, route_weights_nvs: Tensor,
                                 num_rows: Tensor | None = None, over_ab: bool = False
                                 ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor]]:
    """`swiglu_weighted_backward`'s ``(dab_nv2f, grad_route_weights_nvs, hw_nvf)`` and ``dab`` as the FP8 rows
    a GEMM multiplies, ``(q [NvS, 2F] e4m3, scales [NvS, 2F/128])`` (as `swiglu_weighted_fp8`): on CUDA in
    the same pass, without reading dab back. F must be a multiple of 128 (ValueError)."""
    _check_fp8_tiles(ab_nv2f)
    if _use_triton(ab_nv2f):
        from moonep_moe.layers.kernels.swiglu import swiglu_weighted_backward_triton

        return swiglu_weighted_backward_triton(u_nvf, ab_nv2f, route_weights_nvs, num_rows, over_ab,
                                               fp8_dab=True)
    dab_nv2f, grad_route_weights_nvs, hw_nvf = swiglu_weighted_backward(u_nvf, ab_nv2f, route_weights_nvs,
                                                                        over_ab=over_ab)
    return dab_nv2f, grad_route_weights_nvs, hw_nvf, _fp8_rows(dab_nv2f)


def swiglu_backward_rows(u_nvf: Tensor, ab_nv2f: Tensor, route_weights_nvs: Tensor, num_rows: Tensor | None,
                         over_ab: bool, fp8_rows: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | tuple]:
    """`swiglu_weighted_backward`'s ``(dab, grad_route_weights, hw)`` and the rows gate_up's dgrad
    multiplies: dab itself, or with ``fp8_rows`` dab as FP8 rows (`swiglu_weighted_backward_fp8`)."""
    if fp8_rows:
        return swiglu_weighted_backward_fp8(u_nvf, ab_nv2f, route_weights_nvs, num_rows, over_ab)
    dab_nv2f, grad_route_weights_nvs, hw_nvf = swiglu_weighted_backward(u_nvf, ab_nv2f, route_weights_nvs,
                                                                        num_rows, over_ab)
    return dab_nv2f, grad_route_weights_nvs, hw_nvf, dab_nv2f


def fp8_tiles_reason(ffn: int) -> str | None:
    """Why SwiGLU cannot write its rows as FP8 for F = ``ffn``, or None: every 1x128 tile must lie in one of
    a and b (gate_up's dgrad reads dab's 2F columns in tiles)."""
    return None if ffn % TILE == 0 else f"F={ffn} is not a multiple of {TILE}"


def _check_fp8_tiles(ab_nv2f: Tensor) -> None:
    reason = fp8_tiles_reason(ab_nv2f.shape[1] // 2)
    if reason:
        raise ValueError(f"SwiGLU cannot write FP8 rows: {reason}")


def _fp8_rows(x_mk: Tensor) -> tuple[Tensor, Tensor]:
    """The torch path's FP8 rows: the reference cast (`fp8.format.quantise_rows`, the Triton casts' bytes),
    its scales in DeepGEMM's layout."""
    q_mk, scales_mk = quantise_rows(x_mk)
    return q_mk, to_deep_gemm_row_scales(scales_mk)
