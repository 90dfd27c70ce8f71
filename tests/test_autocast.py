"""`torch.autocast` around an fp32 model holding bf16 MoonEP layers (CPU autocast: bf16).

What is cast where: the model's own ops as autocast decides (a Linear in bf16, a LayerNorm in fp32); the
layer casts its input to its `config.dtype` and runs with autocast off, exactly as without autocast: the
router in `router.dtype` (fp32, not autocast's bf16), experts and shared experts in bf16; its output is bf16
(the residual add promotes to fp32). Gradients come in the parameters' dtypes: fp32 for the model's own
parameters and the router, bf16 for the shared experts and the routed experts (`param` mode; their fp32
`main_grad` in that mode); the input's gradient comes back in fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks

H = 32


def make_config(R: int, grad_mode: str = "param") -> MoEConfig:
    return MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=8, top_k=2, ep_size=R,
                     max_tokens_per_rank=24, token_padding=8, dtype="bfloat16", expert_grad_dtype=grad_mode,
                     router={"dtype": "float32", "expert_bias": True},
                     shared_experts={"num_shared_experts": 1})


class Net(nn.Module):
    """An fp32 model: `head(h + moe(norm(h)))`, `h = inp(x)`, the MoE layer bf16."""

    def __init__(self, cfg: MoEConfig, world):
        super().__init__()
        self.inp, self.norm = nn.Linear(H, H), nn.LayerNorm(H)
        self.moe = MoonEPMoELayer(cfg, world)
        self.head = nn.Linear(H, 1)
        with torch.no_grad():
            self.moe.router.expert_bias[:2] = 0.1  # replicas

    def forward(self, x_th: torch.Tensor) -> torch.Tensor:
        h_th = self.inp(x_th)
        return self.head(h_th + self.moe(self.norm(h_th)))


def inputs(R: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(24, H, generator=gen) for _ in range(R)]


@pytest.mark.parametrize("R", [1, 2])
def test_the_layer_under_autocast_equals_the_layer_given_its_dtype(R):
    """`layer(x_fp32)` under autocast == `layer(x_fp32.to(bf16))` without: output, every gradient, bit for
    bit (so the router ran in fp32, not in autocast's bf16)."""
    xs = inputs(R)

    def rank_fn(world):
        torch.manual_seed(0) if world.rank == 0 else None
        layer = MoonEPMoELayer(make_config(R), world)
        with torch.no_grad():
            layer.router.expert_bias[:2] = 0.1
        results = []
        for autocast in (True, False):
            x = xs[world.rank].clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = layer(x if autocast else x.to(torch.bfloat16))
            out.float().square().sum().backward()
            results.append({"out": out.detach(), "grad_x": x.grad, **{
                n: p.grad.clone() for n, p in layer.named_parameters()}})
            layer.zero_grad(set_to_none=True)
        return results

    for got, want in run_ranks(rank_fn, R):
        assert got["out"].dtype == torch.bfloat16 and got["grad_x"].dtype == torch.float32
        assert got["router.weight"].dtype == torch.float32 and got["experts.gate_up"].dtype == torch.bfloat16
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("grad_mode", ["param", "main_grad"])
def test_an_fp32_model_with_bf16_experts_trains_under_autocast(grad_mode):
    """Two micro-batches under autocast on 2 thread-ranks: every gradient finite, in the documented dtype,
    and the sum of the micro-batches' (the LayerNorm hands the layer fp32, which it casts)."""
    xs = inputs(2)

    def rank_fn(world):
        torch.manual_seed(0) if world.rank == 0 else None
        net = Net(make_config(2, grad_mode), world)
        grads = []
        for x_th in xs[world.rank].chunk(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(x_th).float().square().mean() / 2
            loss.backward()
            grads.append({n: (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None
                              else p.grad).clone() for n, p in net.named_parameters()})
        return grads, {n: p.dtype for n, p in net.named_parameters()}

    for (first, both), dtypes in run_ranks(rank_fn, 2):
        assert dtypes["moe.shared_experts.down.weight"] == torch.bfloat16 == dtypes["moe.experts.down"]
        for name, grad in both.items():
            main_grad = name.startswith("moe.experts.") and grad_mode == "main_grad"
            assert grad.dtype == (torch.float32 if main_grad else dtypes[name]), name
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
            assert not torch.equal(grad, first[name]), f"{name}: the second micro-batch added nothing"
