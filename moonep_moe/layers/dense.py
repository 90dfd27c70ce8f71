"""The dense single-device MoE: the oracle the whole layer is tested against.

Legend: t tokens, h hidden size, f expert FFN size, e experts, k routes per token, r routes of one expert.
Plain torch autograd ops, a loop over experts, no tricks: keep it obviously correct.
"""

import torch.nn.functional as F
from torch import Tensor

__all__ = ["dense_moe"]


def dense_moe(
    hidden_th: Tensor,
    topk_experts_tk: Tensor,
    route_weights_tk: Tensor,
    gate_up_e2fh: Tensor,
    down_ehf: Tensor,
) -> Tensor:
    """``out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_experts[t,k]``.

    Args:
        hidden_th: [T, H] tokens; sets the compute dtype.
        topk_experts_tk: [T, K] integer expert ids in [-1, E); -1 means no route and is ignored.
        route_weights_tk: [T, K] route weights (cast to the hidden dtype).
        gate_up_e2fh: [E, 2F, H] fused gate (rows [0, F)) and up (rows [F, 2F)) projections.
        down_ehf: [E, H, F] down projections.

    Returns:
        out_th: [T, H] in ``hidden_th.dtype``, differentiable w.r.t. every tensor input but the ids.
    """
    out_th = hidden_th.new_zeros(hidden_th.shape)
    for expert in range(gate_up_e2fh.shape[0]):
        token_r, slot_r = (topk_experts_tk == expert).nonzero(as_tuple=True)
        gate_rf, up_rf = (hidden_th[token_r] @ gate_up_e2fh[expert].T).chunk(2, dim=-1)
        weight_r1 = route_weights_tk[token_r, slot_r].to(hidden_th.dtype)[:, None]
        y_rh = (F.silu(gate_rf) * up_rf * weight_r1) @ down_ehf[expert].T
        out_th = out_th.index_add(0, token_r, y_rh)
    return out_th
