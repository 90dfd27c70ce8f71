"""The reference grouped GEMM: one plain matmul per segment in the operands' dtype, on any device. The
correctness oracle of every backend (it reads the segment ends on the host: never in a timed step)."""

from collections.abc import Sequence

import torch
from torch import Tensor

from moonep_moe.gemm.base import (
    OPS,
    SlotsReady,
    _check_groups,
    _store,
    _wgrad_parts,
    host_segments,
    into,
    wait_for,
)


def _segment_matmul(a: Tensor, weights: Sequence[Tensor], offs_g: Tensor, transpose_w: bool,
                    out: Tensor | None = None) -> Tensor:
    """``a[start:end] @ w[g]^T`` (``transpose_w``) or ``a[start:end] @ w[g]`` per group, in fp32 or wider,
    into ``out`` where it fits (`into`; its rows past the last segment left as they are), else into a new
    tensor whose rows past the last segment are zero."""
    _check_groups(weights, offs_g, "weights")
    compute = torch.promote_types(a.dtype, torch.float32)
    ws = [w.T if transpose_w else w for part in weights for w in part.unbind(0)]
    given = into(out, a.shape[0], ws[0].shape[1], a.dtype, a.device)
    out = given if given is out else given.zero_()
    for (start, end), w in zip(host_segments(offs_g), ws, strict=True):
        out[start:end] = (a[start:end].to(compute) @ w.to(compute)).to(a.dtype)
    return out


class ReferenceGroupedGemm:
    """A plain loop over groups: any device, any floating dtype (float64 included).

    Computes in ``torch.promote_types(dtype, float32)`` and casts results to the input dtype; output rows
    past the last segment are zero (left as they were in a given ``out``). It reads ``offs_g`` on the host:
    on a GPU this is a device-to-host sync, so use it for tests and as the oracle, not in a step that must
    stay sync-free.
    """

    name = "reference"
    ops = OPS
    joined_weights = True

    def fwd(self, x: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
            slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        wait_for(slots_ready)
        return _segment_matmul(x, weights, offs_g, transpose_w=True, out=out)

    def dgrad(self, dy: Tensor, weights: Sequence[Tensor], offs_g: Tensor,
              slots_ready: SlotsReady | None = None, out: Tensor | None = None) -> Tensor:
        wait_for(slots_ready)
        return _segment_matmul(dy, weights, offs_g, transpose_w=False, out=out)

    def wgrad(self, dy: Tensor, x: Tensor, offs_g: Tensor, out: Sequence[Tensor | None],
              accumulate: bool = True) -> list[Tensor]:
        parts = _wgrad_parts(dy, x, offs_g, out, accumulate)
        compute = torch.promote_types(x.dtype, torch.float32)
        group_outs = [group_out for part in parts for group_out in part.unbind(0)]
        for (start, end), group_out in zip(host_segments(offs_g), group_outs, strict=True):
            _store(group_out, dy[start:end].to(compute).T @ x[start:end].to(compute), accumulate)
        return parts
