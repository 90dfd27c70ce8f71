"""The weights, inputs and step of every layer bench.layer measures, ours and torch-native: the same
weights (`layer_weights`; ours takes them with `with_layer_weights`), the same tokens and output gradient
(`step_inputs`), and one optimizer step's work (`step`: `optimizer_stepped`, fresh gradients, then each
micro-batch's forward and backward), its forward halves (`forwards`), a forward on frozen weights
(`inference`) and the GPU kernels of one step (`step_kernels`). Apart from the command, so that the
benchmarks built on its layers (bench.memory, bench.step_bytes, bench.grouped_mm_calls,
bench.wgrad_hygiene) run exactly what it runs."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.graph import increment_version

from bench.common import cuda_kernels
from bench.ep_rank import RankPlan, as_ep_rank
from moonep_moe.layers.moe import MoonEPMoELayer


def layer_weights(hidden: int, ffn: int, experts: int, seed: int = 0,
                  device: torch.device | str = "cuda") -> dict[str, torch.Tensor]:
    """Both layers' weights under our checkpoint names, drawn on `device` (the GPU; "cpu" for smoke runs and
    tests) from `seed` (the same every call): `router.weight` fp32 `[E, H]`, `experts.gate_up_proj` bf16
    `[E, 2H', H]`, `experts.down_proj` bf16 `[E, H, H']`, each normal with variance 1 / fan-in."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).div_(math.sqrt(shape[-1]))

    return {"router.weight": draw(experts, hidden, dtype=torch.float32),
            "experts.gate_up_proj": draw(experts, 2 * ffn, hidden, dtype=torch.bfloat16),
            "experts.down_proj": draw(experts, hidden, ffn, dtype=torch.bfloat16)}


def with_layer_weights(layer: MoonEPMoELayer, ep_rank: RankPlan | None = None) -> MoonEPMoELayer:
    """`layer` holding `layer_weights` of its config's shapes and, with `ep_rank`, made that EP rank's
    (`as_ep_rank`): what every table measures of ours."""
    cfg = layer.config
    layer.load_state_dict(layer_weights(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts,
                                        device=layer.world.device))
    return layer if ep_rank is None else as_ep_rank(layer, ep_rank.epn, ep_rank)


def step_inputs(tokens: int, hidden: int,
                device: torch.device | str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """`(x_th, grad_th)`: the tokens `[tokens, hidden]` (requiring their gradient) and the output gradient
    every layer of a table is measured with, bf16 on `device` (the GPU; "cpu" for smoke runs), drawn from
    seed 1 (the same every call)."""
    gen = torch.Generator(device=device).manual_seed(1)
    x_th = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    return x_th, torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)


def optimizer_stepped(layer: nn.Module) -> None:
    """What an optimizer step does to the layer as far as its caches can tell: every parameter's version
    moves (no kernel runs), so an fp8 layer casts its weights again on the next call."""
    for param in layer.parameters():
        increment_version(param)


def step(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor, micro_batches: int = 1) -> None:
    """One optimizer step's work of the layer: its weights just updated (`optimizer_stepped`), fresh
    gradients, then `micro_batches` forwards and backwards (gradient accumulation)."""
    optimizer_stepped(layer)
    layer.zero_grad(set_to_none=True)
    for _ in range(micro_batches):
        x_th.grad = None
        layer(x_th).backward(grad_th)


def forwards(layer: nn.Module, x_th: torch.Tensor, micro_batches: int = 1) -> None:
    """The forward halves of `step`: its weights just updated, then `micro_batches` forwards."""
    optimizer_stepped(layer)
    for _ in range(micro_batches):
        layer(x_th)


@torch.no_grad()
def inference(layer: nn.Module, x_th: torch.Tensor) -> None:
    """One forward without autograd, the weights left as they are (frozen, as in serving): an fp8 layer
    reuses the FP8 copies it kept of them."""
    layer(x_th)


def step_kernels(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor,
                 micro_batches: int = 1) -> list[tuple[str, float]]:
    """`[(name, ms)]`: every GPU kernel, copy and fill of one `step`, one entry per launch."""
    return cuda_kernels(lambda: step(layer, x_th, grad_th, micro_batches))
