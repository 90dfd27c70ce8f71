"""The dense oracle against a per-token, per-route loop in float64."""

import torch
import torch.nn.functional as F

from moonep_moe.layers.dense import dense_moe

T, H, FFN, E, K = 13, 8, 6, 5, 3


def per_route_loop(hidden_th, topk_experts_tk, route_weights_tk, gate_up_e2fh, down_ehf):
    out_th = torch.zeros_like(hidden_th)
    for t in range(T):
        for k in range(K):
            e = int(topk_experts_tk[t, k])
            if e < 0:
                continue
            gate_f = gate_up_e2fh[e, :FFN] @ hidden_th[t]
            up_f = gate_up_e2fh[e, FFN:] @ hidden_th[t]
            out_th[t] += route_weights_tk[t, k] * (down_ehf[e] @ (F.silu(gate_f) * up_f))
    return out_th


def test_matches_per_route_loop_with_dropped_routes():
    hidden_th = torch.randn(T, H, dtype=torch.float64)
    topk_experts_tk = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    topk_experts_tk[2] = -1  # a padding token
    topk_experts_tk[5, 1] = -1  # a single dropped route
    route_weights_tk = torch.rand(T, K, dtype=torch.float64)
    gate_up_e2fh = torch.randn(E, 2 * FFN, H, dtype=torch.float64)
    down_ehf = torch.randn(E, H, FFN, dtype=torch.float64)
    args = (hidden_th, topk_experts_tk, route_weights_tk, gate_up_e2fh, down_ehf)

    out_th = dense_moe(*args)
    assert out_th.shape == (T, H) and out_th.dtype == torch.float64
    torch.testing.assert_close(out_th, per_route_loop(*args), rtol=1e-12, atol=1e-12)
    assert not out_th[2].any()


def test_gradients_flow_to_every_input():
    hidden_th = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    topk_experts_tk = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    route_weights_tk = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    gate_up_e2fh = torch.randn(E, 2 * FFN, H, dtype=torch.float64, requires_grad=True)
    down_ehf = torch.randn(E, H, FFN, dtype=torch.float64, requires_grad=True)
    inputs = (hidden_th, route_weights_tk, gate_up_e2fh, down_ehf)
    assert torch.autograd.gradcheck(
        lambda x, w, gu, d: dense_moe(x, topk_experts_tk, w, gu, d), inputs, eps=1e-6, atol=1e-6
    )
