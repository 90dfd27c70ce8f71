"""The whole layer on one GPU: no host sync, one CUDA graph, peak memory independent of the routing skew
(DESIGN.md, "Static shapes, no host sync"). A one-rank world (its barrier is a no-op) with bf16 experts."""

from __future__ import annotations

import gc

import pytest
import torch

from moonep_moe.config import MoEConfig
from moonep_moe.gemm import deep_gemm
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world

pytestmark = pytest.mark.gpu

T, H, F, E, K = 256, 256, 128, 16, 4


def layer_and_inputs(grad_dtype: str = "param", grouped_gemm: str = "auto",
                     overlap_reduce_grad: bool = False):
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, max_tokens_per_rank=T,
                    dtype="bfloat16", expert_grad_dtype=grad_dtype, grouped_gemm=grouped_gemm,
                    router={"expert_bias": True}, overlap_reduce_grad=overlap_reduce_grad)
    torch.manual_seed(0)
    layer = MoonEPMoELayer(cfg, single_world("cuda"))
    return layer, torch.randn(T, H, device="cuda", dtype=torch.bfloat16)


def skew(layer: MoonEPMoELayer, strength: float) -> None:
    """Bias the router toward experts 0..K-1 (strength 0: the router's own choice)."""
    with torch.no_grad():
        layer.router.expert_bias.zero_()
        layer.router.expert_bias[:K] = strength


def step(layer: MoonEPMoELayer, x_th: torch.Tensor, grad_th: torch.Tensor) -> torch.Tensor:
    out_th = layer(x_th)
    out_th.backward(grad_th)
    return out_th


@pytest.mark.parametrize(("grad_dtype", "grouped_gemm", "overlap_reduce_grad"), [
    ("param", "auto", False), ("main_grad", "auto", False), ("param", "deep_gemm", False),
    ("main_grad", "deep_gemm", False), ("param", "auto", True)])
def test_forward_and_backward_make_no_host_sync(grad_dtype, grouped_gemm, overlap_reduce_grad):
    if grouped_gemm == "deep_gemm" and (reason := deep_gemm.unsupported_reason(torch.device("cuda"),
                                                                              torch.bfloat16, None, 128)):
        pytest.skip(reason)
    layer, x_th = layer_and_inputs(grad_dtype, grouped_gemm, overlap_reduce_grad)
    x_th.requires_grad_()
    skew(layer, 10.0)
    step(layer, x_th, torch.ones_like(x_th))  # first use: kernels built, pools allocated
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(layer, x_th, torch.ones_like(x_th))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x_th.grad).all()


@pytest.mark.parametrize("overlap_reduce_grad", [False, True])
def test_one_cuda_graph_replays_new_routing_exactly(overlap_reduce_grad):
    """Capture forward + backward once; replay with new tokens and a new router bias (new routing, new
    plan): output, input gradient and every weight gradient equal an eager step's. With
    `overlap_reduce_grad` the graph holds reduce_grad's branch on the comm stream, joined at the end of the
    backward pass."""
    layer, x_th = layer_and_inputs(overlap_reduce_grad=overlap_reduce_grad)
    static_x = x_th.clone().requires_grad_()
    static_grad = torch.randn_like(x_th)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer.zero_grad(set_to_none=True)
            static_x.grad = None
            step(layer, static_x, static_grad)
    torch.cuda.current_stream().wait_stream(stream)
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(layer, static_x, static_grad)

    for seed, strength in ((1, 0.0), (2, 20.0), (3, 3.0)):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        new_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        new_grad = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        skew(layer, strength)
        with torch.no_grad():
            static_x.copy_(new_x)
            static_grad.copy_(new_grad)
        graph.replay()
        replayed = [t.clone() for t in (static_out, static_x.grad, layer.experts.gate_up.grad,
                                        layer.experts.down.grad, layer.router.weight.grad)]
        eager_x = new_x.clone().requires_grad_()
        saved_grads = [p.grad for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        eager = [step(layer, eager_x, new_grad).detach(), eager_x.grad, layer.experts.gate_up.grad,
                 layer.experts.down.grad, layer.router.weight.grad]
        for p, g in zip(layer.parameters(), saved_grads, strict=True):
            p.grad = g  # the graph keeps writing its own gradient tensors
        for name, got, want in zip(("out", "grad_x", "grad_gate_up", "grad_down", "grad_router"), replayed,
                                   eager, strict=True):
            # bf16 tolerance: fp32 atomics (index_add_) may order additions differently between runs
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_peak_memory_does_not_depend_on_routing_skew():
    """A step's peak above what was allocated before it. Earlier tests' garbage is collected first and the
    collector is off while measuring: a collection between two steps would lower the second's baseline."""
    layer, x_th = layer_and_inputs()
    x_th.requires_grad_()
    grad_th = torch.ones_like(x_th)
    peaks = {}
    gc.collect()
    gc.disable()
    try:
        for strength in (0.0, 100.0, 0.0, 100.0):  # warm the allocator and pools on both before measuring
            skew(layer, strength)
            layer.zero_grad(set_to_none=True)
            x_th.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step(layer, x_th, grad_th)
            torch.cuda.synchronize()
            peaks[strength] = torch.cuda.max_memory_allocated() - before
    finally:
        gc.enable()
    load_e = layer._state.last_plan.expert_load.double()
    assert float(load_e.max() / load_e.mean()) > 2.0, "the skewed step was not skewed"
    assert peaks[0.0] == peaks[100.0], peaks
