"""The elementwise middle of the expert block: SwiGLU times the per-row route weight, and its backward.

Legend: m rows (dispatched routes), f expert FFN size; ``ab_m2f`` is the fused gate+up projection output,
columns ``[0, f)`` = a (gate), ``[f, 2f)`` = b (up). Both functions are pure, compute in fp32 (float64 for
float64 input) and cast back to the input dtypes. On CUDA (with Triton) they run as one fused kernel each
(`moonep_moe.layers.kernels.swiglu`), elsewhere as the torch reference below; rows at and past `num_rows`
(an int32 device scalar such as `cu_seqlens[-1]`) are then left unspecified.

Forward:  ``hw = silu(a) * b * w[:, None]``.
Backward, with ``u`` the gradient w.r.t. ``hw`` (``u = dy @ Wd``) and ``dh = u * w[:, None]``:
``grad_w = rowsum(u * silu(a) * b)``, ``da = dh * b * silu'(a)``, ``db = dh * silu(a)``,
``silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["swiglu_weighted", "swiglu_weighted_backward"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _use_triton(tensor: Tensor) -> bool:
    """The one place that picks the fused kernels: CUDA tensors of 16 or 32 bits with Triton installed (the
    kernels compute in fp32; float64 stays on the torch path)."""
    if not tensor.is_cuda or tensor.dtype == torch.float64:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def swiglu_weighted(ab_m2f: Tensor, route_weights_m: Tensor, num_rows: Tensor | None = None) -> Tensor:
    """``hw_mf = silu(a) * b * w[:, None]``.

    Args:
        ab_m2f: [M, 2F] gate and up projections, any floating dtype.
        route_weights_m: [M] route weight per row (fp32 usually; padding rows carry 0).

    Returns:
        hw_mf: [M, F] in ``ab_m2f.dtype``.
    """
    if _use_triton(ab_m2f):
        from moonep_moe.layers.kernels.swiglu import swiglu_weighted_triton

        return swiglu_weighted_triton(ab_m2f, route_weights_m, num_rows)
    compute = _compute_dtype(ab_m2f.dtype)
    a_mf, b_mf = ab_m2f.to(compute).chunk(2, dim=-1)
    w_m1 = route_weights_m.to(compute)[:, None]
    return (F.silu(a_mf) * b_mf * w_m1).to(ab_m2f.dtype)


def swiglu_weighted_backward(u_mf: Tensor, ab_m2f: Tensor, route_weights_m: Tensor,
                             num_rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``swiglu_weighted`` given ``u_mf``, the gradient w.r.t. its output ``hw_mf``.

    Args:
        u_mf: [M, F] gradient w.r.t. ``hw_mf``.
        ab_m2f: [M, 2F] the forward input.
        route_weights_m: [M] the forward route weights.

    Returns:
        dab_m2f: [M, 2F] in ``ab_m2f.dtype``.
        grad_route_weights_m: [M] in ``route_weights_m.dtype``, reduced in fp32 (or float64).
        hw_mf: [M, F] the forward output, recomputed in the same pass (the down projection's wgrad needs it).
    """
    if _use_triton(ab_m2f):
        from moonep_moe.layers.kernels.swiglu import swiglu_weighted_backward_triton

        return swiglu_weighted_backward_triton(u_mf, ab_m2f, route_weights_m, num_rows)
    compute = _compute_dtype(ab_m2f.dtype)
    a_mf, b_mf = ab_m2f.to(compute).chunk(2, dim=-1)
    u_mf = u_mf.to(compute)
    sig_mf = torch.sigmoid(a_mf)
    silu_mf = a_mf * sig_mf
    grad_route_weights_m = (u_mf * silu_mf * b_mf).sum(-1)
    dh_mf = u_mf * route_weights_m.to(compute)[:, None]
    da_mf = dh_mf * b_mf * sig_mf * (1 + a_mf * (1 - sig_mf))
    dab_m2f = torch.cat([da_mf, dh_mf * silu_mf], dim=-1)
    hw_mf = silu_mf * b_mf * route_weights_m.to(compute)[:, None]
    return dab_m2f.to(ab_m2f.dtype), grad_route_weights_m.to(route_weights_m.dtype), hw_mf.to(ab_m2f.dtype)
