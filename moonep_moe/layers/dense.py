"""The dense single-device MoE: the oracle the whole layer is tested against.

Shapes use the suffix letters of DESIGN.md, "Notation" (``t``: the caller's tokens).
Plain torch autograd ops, a loop over experts, no tricks: keep it obviously correct.
"""

from collections.abc import Mapping

import torch.nn.functional as F
from torch import Tensor

from moonep_moe.config import MoEConfig
from moonep_moe.layers.router import TopKRouter

__all__ = ["dense_moe", "dense_step"]


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
        # m: this expert's routes, as (token, k) index lists
        token_m, k_m = (topk_experts_tk == expert).nonzero(as_tuple=True)
        gate_mf, up_mf = (hidden_th[token_m] @ gate_up_e2fh[expert].T).chunk(2, dim=-1)
        weight_m1 = route_weights_tk[token_m, k_m].to(hidden_th.dtype)[:, None]
        y_mh = (F.silu(gate_mf) * up_mf * weight_m1) @ down_ehf[expert].T
        out_th = out_th.index_add(0, token_m, y_mh)
    return out_th


def dense_step(config: MoEConfig, router_state: Mapping[str, Tensor], gate_up_e2fh: Tensor,
               down_ehf: Tensor, hidden_th: Tensor, grad_out_th: Tensor,
               token_mask_t: Tensor | None = None) -> dict[str, Tensor]:
    """One forward + backward of the whole routed MoE on one device: the reference for one rank's tokens.

    Args:
        config: the layer config (router settings, sizes).
        router_state: the router's `state_dict()` (`weight [E, H]`, `expert_bias [E]` when enabled).
        gate_up_e2fh, down_ehf: all E experts. hidden_th, grad_out_th: `[T, H]`. token_mask_t: `[T]` bool.

    Returns:
        `out [T, H]`, `grad_x [T, H]`, `grad_router [E, H]`, `grad_gate_up [E, 2F, H]`, `grad_down [E, H, F]`
        (the expert gradients of these tokens only), in the dtype of `hidden_th`.
    """
    router = TopKRouter(config.router, config.hidden_size, config.num_experts, config.top_k)
    router.to(hidden_th.device).load_state_dict(router_state)
    gate_up = gate_up_e2fh.detach().clone().requires_grad_()
    down = down_ehf.detach().clone().requires_grad_()
    x_th = hidden_th.detach().clone().requires_grad_()
    routing = router(x_th, token_mask_t)
    out_th = dense_moe(x_th, routing.topk_experts_tk, routing.route_weights_tk, gate_up, down)
    out_th.backward(grad_out_th)
    return dict(out=out_th.detach(), grad_x=x_th.grad, grad_router=router.weight.grad.to(hidden_th.dtype),
                grad_gate_up=gate_up.grad, grad_down=down.grad,
                tokens_per_expert=routing.tokens_per_expert_e)
