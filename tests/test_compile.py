"""`torch.compile` of a whole MoonEPMoELayer: compiled outputs and gradients equal eager ones.

The routed experts (comm core and grouped GEMMs) run eagerly between the compiled graphs
(`moonep_moe.layers.compile_break.run_eagerly`); the router compiles, and so do the shared experts where they
do not overlap the routed experts (CPU, or `overlap_shared_experts=False`; on CUDA they run eagerly beside
them by default). `fullgraph=True` cannot trace the experts and fails with one error that says why.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world

T, H, F, E, K = 64, 32, 16, 8, 2


def make_layer(dtype: str, device: str, **overrides) -> MoonEPMoELayer:
    router = {"dtype": "float64" if dtype == "float64" else "float32"}
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, max_tokens_per_rank=T,
                    token_padding=8, dtype=dtype, router=router, shared_experts={"num_shared_experts": 1},
                    **overrides)
    torch.manual_seed(0)
    return MoonEPMoELayer(cfg, single_world(device))


def step(layer, module, x_th: torch.Tensor, grad_th: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward + backward through `module` (the layer or its compiled form): output, input gradient and
    every parameter's gradient (`main_grad` for the experts in that mode), then cleared."""
    x_th = x_th.clone().requires_grad_()
    out_th = module(x_th)
    out_th.backward(grad_th)
    return taken_grads(layer, out_th, x_th)


def taken_grads(layer, out_th: torch.Tensor, x_th: torch.Tensor) -> dict[str, torch.Tensor]:
    """After a backward: the output, the input gradient and every parameter's gradient (`main_grad` for the
    experts in that mode), copied; the layer's gradients then cleared."""
    result = {"out": out_th.detach(), "grad_x": x_th.grad}
    for name, param in layer.named_parameters():
        result[name] = getattr(param, "main_grad", param.grad).clone()
    layer.zero_grad(set_to_none=True)
    layer.zero_main_grad()
    return result


def assert_compiled_matches_eager(dtype: str, device: str, tol: dict, **overrides) -> None:
    """Three steps with different tokens (new routing, new plans): compiled equals eager, and the compiled
    layer is not recompiled."""
    torch._dynamo.reset()
    layer = make_layer(dtype, device, **overrides)
    compiled = torch.compile(layer)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x_th, grad_th = (torch.randn(T, H, generator=gen, device=device).to(layer.config.torch_dtype)
                             for _ in range(2))
            want, got = step(layer, layer, x_th, grad_th), step(layer, compiled, x_th, grad_th)
            for name, value in want.items():
                if "norm" in tol:  # low precision: elementwise bounds fail where sums cancel
                    error = (got[name].double() - value.double()).norm() / value.double().norm()
                    assert error <= tol["norm"], f"{name}: relative error {error:.2e} > {tol['norm']:.2e}"
                else:
                    torch.testing.assert_close(got[name], value, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["param", "main_grad"])
def test_compiled_float32_layer_matches_eager_on_cpu(mode):
    """fp32 on the CPU runs torch._grouped_mm, whose fake-tensor kernel accepts only bf16: tracing the
    experts failed before they were kept out of the graph."""
    assert_compiled_matches_eager("float32", "cpu", dict(rtol=1e-5, atol=1e-5), expert_grad_dtype=mode)


def test_compiled_float64_layer_matches_eager_on_cpu():
    """float64 runs the reference grouped GEMM, which reads the segment sizes on the host."""
    assert_compiled_matches_eager("float64", "cpu", dict(rtol=1e-12, atol=1e-12), grouped_gemm="reference")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fullgraph_fails_saying_why(device):
    torch._dynamo.reset()
    layer = make_layer("float32" if device == "cpu" else "bfloat16", device)
    x_th = torch.randn(T, H, device=device).to(layer.config.torch_dtype)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="routed experts .* run eagerly between compiled "
                                                              "graphs"):
        torch.compile(layer, fullgraph=True)(x_th)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiled_layer_matches_eager_on_cuda(dtype):
    """bf16: inductor fuses the router and shared experts' elementwise work in fp32 where eager rounds each op
    to bf16, so each tensor may differ by a few roundings of bf16's unit roundoff 2^-8 (in norm: single
    elements of a gradient that sums many products may cancel to nothing and differ by more)."""
    tol = dict(norm=4 * 2**-8) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-4)
    assert_compiled_matches_eager(dtype, "cuda", tol)
