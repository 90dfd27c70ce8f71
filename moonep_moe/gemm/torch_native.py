"""The torch grouped GEMM: `torch._grouped_mm` (CUTLASS on CUDA) for fwd, dgrad and wgrad."""

from collections.abc import Sequence

import torch
from torch import Tensor

from moonep_moe.base.triton import triton_missing_reason
from moonep_moe.gemm.base import (
    OPS,
    SlotsReady,
    _cat_groups,
    _check_groups,
    _fresh_groups,
    _store_groups,
    groups_before_wait,
    host_segments,
)


class TorchGroupedGemm:
    """``torch._grouped_mm``: no host sync, reads ``offs_g`` on the device.

    fwd and dgrad are 2D x 3D calls with ``offs``; wgrad is a 2D x 2D call giving ``[G, cols, inner]``, which
    is added into the fp32 gradients. ``torch._grouped_mm`` insists that its output dtype equals its input
    dtype, so for bf16 each wgrad product is rounded to bf16 before that fp32 add.

    A wgrad whose first part is to be made (None: the home experts' gradients, "param" mode) gets
    ``torch._grouped_mm(dy^T, x, offs=offs_g[:n])`` itself: rows past the n-th group's end are ignored, so
    that call computes exactly the first n groups, and its output is the gradient (no copy). The later
    groups (prefetch slots, B > 0) start at a row known only on the device, which ``torch._grouped_mm``
    cannot skip to: on CUDA they go to the Triton wgrad (`moonep_moe.gemm.kernels.wgrad`, which starts at
    any group, written straight into the slot gradients); elsewhere a call over all G groups gives
    them, which computes the first n groups a second time and holds a ``[G, cols, inner]`` temporary.

    With ``slots_ready`` (the slots' weights still arriving) fwd and dgrad compute the home groups first,
    ``torch._grouped_mm`` over ``offs_g[:home_groups]``, then wait, then the slot groups into the same output
    (`groups_from`: on CUDA the Triton kernel `moonep_moe.gemm.kernels.groups_from`, which starts at a row
    known only on the device; elsewhere a loop over the slot groups, reading their ends on the host).

    fwd and dgrad return ``torch._grouped_mm``'s own output (it takes no ``out``), never a given ``out``.

    A weights sequence of more than one tensor (home experts and slots apart: the arena cannot join them,
    `moonep_moe.transport.arena`) is joined with ``torch.cat`` on every call, a copy of the weights.

    Limits (torch 2.13, found by experiment; ``select_grouped_gemm`` checks them): float32, bfloat16 and
    float16 on CPU, bfloat16 on CUDA; every operand's row stride (inner and cols) must be a multiple of 16
    bytes.
    """

    name = "torch"
    ops = OPS
    joined_weights = True

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
            slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        return _home_then_slots(x, weights, offs_g, slots_ready, transposed=True)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
              slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        return _home_then_slots(dy, weights, offs_g, slots_ready, transposed=False)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        fresh = _fresh_groups(out, offs_g, accumulate)
        if out[0] is not None:
            _store_groups(torch._grouped_mm(dy.T, x, offs=offs_g), out, accumulate)
            return list(out)
        made = torch._grouped_mm(dy.T, x, offs=offs_g[:fresh])  # [fresh, cols, inner], the rest ignored
        later = out[1:]
        if any(part.shape[0] for part in later):
            if dy.is_cuda:
                from moonep_moe.gemm.kernels.wgrad import grouped_wgrad_triton

                grouped_wgrad_triton(dy, x, offs_g, later, accumulate=False, first_group=fresh,
                                     slot_groups_from=fresh)
            else:
                _store_groups(torch._grouped_mm(dy.T, x, offs=offs_g)[fresh:], later, accumulate=False)
        return [made, *later]


def _home_then_slots(a: Tensor, weights: Sequence[Tensor], offs_g: Tensor, slots_ready: SlotsReady | None,
                     transposed: bool) -> Tensor:
    """``a[start:end] @ w[g]^T`` (``transposed``, fwd) or ``@ w[g]`` (dgrad) per group; with ``slots_ready``
    the home groups before the wait and the slot groups after it."""
    _check_groups(weights, offs_g, "weights")
    home = groups_before_wait(slots_ready, offs_g.numel(),
                              can_split=not (a.is_cuda and triton_missing_reason() is not None))
    if not home:
        joined = _cat_groups(weights)
        return torch._grouped_mm(a, joined.transpose(-2, -1) if transposed else joined, offs=offs_g)
    if len(weights) == 2 and weights[0].shape[0] == home:
        home_w, slots_w = weights
    else:  # one joined tensor (the arena's), or parts split elsewhere
        joined = _cat_groups(weights)
        home_w, slots_w = joined[:home], joined[home:]
    if transposed:
        home_w, slots_w = home_w.transpose(-2, -1), slots_w.transpose(-2, -1)
    out = torch._grouped_mm(a, home_w, offs=offs_g[:home])  # rows past the home groups' end are not written
    slots_ready.wait()
    groups_from(a, slots_w, offs_g, home, out, slots_ready.row_alignment)
    return out


def groups_from(a_mk: Tensor, b_gkn: Tensor, offs_g: Tensor, first: int, out_mn: Tensor,
                row_alignment: int = 1) -> None:
    """``out[start:end] = a[start:end] @ b[g - first]`` for the groups ``g >= first`` (`kernels.groups_from`'s
    contract): the Triton kernel on CUDA (its aligned one where every group end is a multiple of 128:
    ``row_alignment``), a loop over the groups elsewhere (host reads of their ends)."""
    if a_mk.is_cuda:
        from moonep_moe.gemm.kernels.groups_from import groups_from_gemm

        groups_from_gemm(a_mk, b_gkn, offs_g, first, out_mn, row_alignment=row_alignment)
        return
    for (start, end), b_kn in zip(host_segments(offs_g)[first:], b_gkn, strict=True):
        out_mn[start:end] = (a_mk[start:end] @ b_kn).to(out_mn.dtype)


_TORCH_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}


def unsupported_reason(device: torch.device, dtype: torch.dtype, k: int | None = None,
                       token_padding: int | None = None) -> str | None:
    """Why ``torch._grouped_mm`` cannot run this case, or None when it can."""
    dtypes = _TORCH_DTYPES.get(device.type, ())
    if dtype not in dtypes:
        return f"torch._grouped_mm on {device.type} supports {[str(d) for d in dtypes]}, got {dtype}"
    if k is not None and k * dtype.itemsize % 16:
        return f"row strides must be multiples of 16 bytes; k={k} of {dtype} is {k * dtype.itemsize} bytes"
    return None
