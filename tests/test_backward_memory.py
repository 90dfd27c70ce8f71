"""Backward frees each saved activation after its last reader, unless the graph is kept; one rank saves no
copy of the dispatched rows.

Without `retain_graph`, the experts' backward drops autograd's saved copies at its start and writes
SwiGLU's gradient over the saved gate/up projections. With `retain_graph` every saved tensor stays intact:
a second backward over the same graph gives the same gradients. On one rank without slots, forward saves
the tokens instead of the dispatched rows, and backward gathers the rows again for gate_up's weight
gradient."""

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


GPU_T, GPU_H, GPU_F = 4096, 1024, 512


def gpu_layer(grad_dtype: str = "param") -> tuple[MoonEPMoELayer, torch.Tensor, torch.Tensor]:
    """One rank (EP=1, no slots), bf16 on the GPU, and a step's tokens and output gradient."""
    cfg = MoEConfig(hidden_size=GPU_H, ffn_hidden_size=GPU_F, num_experts=16, top_k=4,
                    max_tokens_per_rank=GPU_T, dtype="bfloat16", expert_grad_dtype=grad_dtype)
    torch.manual_seed(0)
    layer = MoonEPMoELayer(cfg, single_world("cuda"))
    x_th = torch.randn(GPU_T, GPU_H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return layer, x_th, torch.randn_like(x_th)


@pytest.mark.gpu
def test_one_rank_forward_saves_no_copy_of_the_dispatched_rows():
    """What forward leaves allocated for backward: the gate/up projections [NvS, 2F], the output [T, H] and
    small tensors, under half the dispatched rows' [NvS, H] more (a saved copy of them would be all of it)."""
    layer, x_th, grad_th = gpu_layer()
    layer(x_th).backward(grad_th)  # first use: kernels built, pools allocated
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out_th = layer(x_th)
    held = torch.cuda.memory_allocated() - before
    rows = layer._state.buffer.NvS
    assert held < rows * 2 * GPU_F * 2 + out_th.nbytes + rows * GPU_H * 2 // 2, held


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", ["param", "main_grad"])
def test_a_freed_graph_peaks_lower_by_the_gate_up_projections(grad_dtype):
    """A freed graph never peaks higher than a kept one (`retain_graph=True`: every saved tensor kept to the
    end). In the default "param" mode the step peaks while the weight gradients are made, and there the
    kept graph's peak minus the freed one's is at least the gate/up projections' size ([NvS, 2F] in bf16,
    0.95 of it for the allocator's rounding), which the freed graph's SwiGLU backward writes dab over.
    ("main_grad" allocates no gradient in backward: its peak comes earlier.)"""
    layer, x_th, grad_th = gpu_layer(grad_dtype)
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
    assert peaks[False] <= peaks[True], peaks
    if grad_dtype == "param":
        released = layer._state.buffer.NvS * 2 * GPU_F * 2
        assert peaks[True] - peaks[False] >= 0.95 * released, (peaks, released)
