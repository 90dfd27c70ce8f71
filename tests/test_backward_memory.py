"""Backward frees each saved activation after its last reader, unless the graph is kept.

Without `retain_graph`, the experts' backward drops autograd's saved copies at its start, writes SwiGLU's
gradient over the saved gate/up projections and, on one rank, frees the dispatched rows after gate_up's
weight gradient, before the input gradient is made. With `retain_graph` every saved tensor stays intact:
a second backward over the same graph gives the same gradients."""

from __future__ import annotations

import pytest
import torch
from test_layer import build_layer, make_config, make_problem, run_dense

from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks, single_world


def gradients(layer: MoonEPMoELayer, x_th: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"grad_x": x_th.grad.clone(), "grad_router": layer.router.weight.grad.clone(),
            "grad_gate_up": layer.experts.gate_up.grad.clone(), "grad_down": layer.experts.down.grad.clone()}


def kept_then_freed(p, world) -> tuple[dict, dict]:
    """One forward, backward with `retain_graph=True`, then backward again over the same graph (which frees
    it): each backward's gradients, alone."""
    layer = build_layer(p, world)
    x_th = p.hidden[world.rank].clone().requires_grad_()
    out_th = layer(x_th)
    runs = []
    for retain in (True, False):
        layer.zero_grad(set_to_none=True)
        x_th.grad = None
        out_th.backward(p.grad_out[world.rank], retain_graph=retain)
        runs.append(gradients(layer, x_th))
    return runs[0], runs[1]


@pytest.mark.parametrize("R", [1, 2])
def test_a_kept_graph_gives_the_same_gradients_in_its_second_backward(R):
    """Skewed routing, replicas filled where R > 1. Against the float64 oracle, and the second backward
    (which may write over the saved tensors) equal to the first bit for bit."""
    p = make_problem(make_config(R), seed=11, skew=3.0)
    _, grad_gate_up, grad_down, _ = run_dense(p)
    results = run_ranks(lambda world: kept_then_freed(p, world), R)
    epn = p.cfg.num_experts // R
    for rank, (kept, freed) in enumerate(results):
        for name in kept:
            torch.testing.assert_close(freed[name], kept[name], rtol=0, atol=0,
                                       msg=lambda m, n=name, r=rank: f"{n} on rank {r}: {m}")
        home = slice(rank * epn, (rank + 1) * epn)
        torch.testing.assert_close(kept["grad_gate_up"], grad_gate_up[home], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(kept["grad_down"], grad_down[home], rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", ["param", "main_grad"])
def test_a_freed_graph_peaks_lower_by_the_saved_rows_and_projections(grad_dtype):
    """One rank, bf16 on the GPU: a freed graph never peaks higher than a kept one (`retain_graph=True`:
    every saved tensor kept to the end). In the default "param" mode the step peaks while the weight
    gradients are made, and there the kept graph's peak minus the freed one's is at least the dispatched
    rows' and the gate/up projections' size ([NvS, H] + [NvS, 2F] in bf16, 0.95 of it for the allocator's
    rounding), what the freed graph has released by the time the input gradient is made. ("main_grad"
    allocates no gradient in backward: its peak comes earlier, at SwiGLU's backward.)"""
    T, H, F, E, K = 4096, 1024, 512, 16, 4
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, max_tokens_per_rank=T,
                    dtype="bfloat16", expert_grad_dtype=grad_dtype)
    torch.manual_seed(0)
    layer = MoonEPMoELayer(cfg, single_world("cuda"))
    x_th = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_th = torch.randn_like(x_th)
    peaks = {}
    for retain in (False, True, False, True):  # the first two warm the allocator and the pools
        layer.zero_grad(set_to_none=True)
        x_th.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        layer(x_th).backward(grad_th, retain_graph=retain)
        torch.cuda.synchronize()
        peaks[retain] = torch.cuda.max_memory_allocated() - before
    rows = layer._state.buffer.NvS
    released = rows * (H + 2 * F) * 2
    assert peaks[False] <= peaks[True], peaks
    if grad_dtype == "param":
        assert peaks[True] - peaks[False] >= 0.95 * released, (peaks, released)
