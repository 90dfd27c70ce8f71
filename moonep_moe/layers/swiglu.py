"""The elementwise middle of the expert block: SwiGLU times the per-row route weight, and its backward.

Shapes use the suffix letters of DESIGN.md, "Notation": a row is a dispatched row (``nv``), ``ab_nv2f`` the
fused gate+up projection output, columns ``[0, F)`` = a (gate), ``[F, 2F)`` = b (up). Both functions are
pure, compute in fp32 (float64 for float64 input) and cast back to the input dtypes. On CUDA (with Triton)
they run as one fused kernel each (`moonep_moe.layers.kernels.swiglu`), elsewhere as the torch reference
below; rows at and past `num_rows` (an int32 device scalar such as `cu_seqlens[-1]`) are then left
unspecified.

Forward:  ``hw = silu(a) * b * w[:, None]``.
Backward, with ``u`` the gradient w.r.t. ``hw`` (``u = dy @ Wd``) and ``dh = u * w[:, None]``:
``grad_w = rowsum(u * silu(a) * b)``, ``da = dh * b * silu'(a)``, ``db = dh * silu(a)``,
``silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from moonep_moe.base.triton import triton_available

__all__ = ["swiglu_weighted", "swiglu_weighted_backward"]


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
