"""Activation checkpointing (`torch.utils.checkpoint`) around blocks holding MoonEP layers, on thread-ranks.

The recompute in backward routes, plans and dispatches again, identically on every rank (the plan is a pure
function of the gathered histogram), and the layer's backward takes the forward's plan (the Buffer's latest
dispatch rule lets a backward `dispatch(plan=...)` take an earlier plan). Gradients must equal the
uncheckpointed run's bit for bit (reference GEMMs, torch reference comm path on the CPU), and the forward's
side effects must count once: the expert loads (`expert_load`, which the expert bias update reads), the
balance statistics and the recorded router logits (the forward's, not the recompute's). The shared experts
run after the routed ones, so that a non-reentrant recompute does not stop early (torch stops it once the
last saved tensor is back) before the layer's bookkeeping.
"""

from __future__ import annotations

import pytest
import torch
from test_layer import make_config
from torch import nn
from torch.utils.checkpoint import checkpoint

from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks

R, LAYERS = 2, 2


class Block(nn.Module):
    """`h + moe(norm(h))`: a transformer block's MoE half (the norm replicated)."""

    def __init__(self, cfg, world):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size, dtype=cfg.torch_dtype)
        self.moe = MoonEPMoELayer(cfg, world)

    def forward(self, h_th: torch.Tensor) -> torch.Tensor:
        return h_th + self.moe(self.norm(h_th))


def run(checkpointed: str | None, grad_mode: str = "param",
        share_buffer: bool = True) -> list[dict[str, torch.Tensor]]:
    """Two steps of `LAYERS` blocks on R thread-ranks, each block under `checkpoint` (`checkpointed`:
    "non-reentrant", "reentrant", or None: plain); every rank's output, input and parameter gradients,
    expert loads, last balance statistics, and how many Buffers the blocks' layers hold."""
    cfg = make_config(R, expert_grad_dtype=grad_mode, shared_experts={"num_shared_experts": 1},
                      share_buffer=share_buffer)
    gen = torch.Generator().manual_seed(7)
    steps = [(torch.randn(R, cfg.max_tokens_per_rank, cfg.hidden_size, generator=gen, dtype=torch.float64),
              torch.randn(R, cfg.max_tokens_per_rank, cfg.hidden_size, generator=gen, dtype=torch.float64))
             for _ in range(2)]

    def rank_fn(world):
        torch.manual_seed(0) if world.rank == 0 else None
        blocks = nn.ModuleList(Block(cfg, world) for _ in range(LAYERS))
        with torch.no_grad():
            for block in blocks:
                block.moe.router.expert_bias[:2] = 0.1  # skewed: replicas carry gradients
                block.moe.record_router_logits = True
        result = {}
        for x_rsh, grad_rsh in steps:
            x = x_rsh[world.rank].clone().requires_grad_()
            h = x
            for block in blocks:
                if checkpointed is None:
                    h = block(h)
                else:
                    h = checkpoint(block, h, use_reentrant=checkpointed == "reentrant")
            recorded = [block.moe.last_router_logits_te for block in blocks]
            h.backward(grad_rsh[world.rank])
            result["out"], result["grad_x"] = h.detach(), x.grad
            kept = all(b.moe.last_router_logits_te is t for b, t in zip(blocks, recorded, strict=True))
            result["forward's router logits kept"] = torch.tensor(kept)
        result["buffers"] = torch.tensor(len({id(block.moe.buffer) for block in blocks}))
        for name, p in blocks.named_parameters():
            result[name] = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        for i, block in enumerate(blocks):
            result[f"{i}.expert_load"] = block.moe.expert_load.clone()
            for key, value in block.moe.balance_stats().items():
                result[f"{i}.{key}"] = value
        return result

    return run_ranks(rank_fn, R)


@pytest.mark.parametrize("grad_mode", ["param", "main_grad"])
@pytest.mark.parametrize("checkpointed", ["non-reentrant", "reentrant"])
def test_checkpointed_blocks_give_the_plain_gradients_bit_for_bit_and_count_loads_once(checkpointed,
                                                                                        grad_mode):
    plain, got = run(None, grad_mode), run(checkpointed, grad_mode)
    assert int(plain[0]["0.slots_used"].sum()) > 0, "no replicas: the skew is too weak"
    for rank, (g, want) in enumerate(zip(got, plain, strict=True)):
        assert g.keys() == want.keys()
        for key in want:
            assert torch.equal(g[key], want[key]), f"rank {rank}: {key} differs under {checkpointed}"


@pytest.mark.parametrize("checkpointed", [None, "non-reentrant"])
def test_blocks_sharing_one_buffer_train_like_blocks_with_a_buffer_each(checkpointed):
    """`MoEConfig.share_buffer` (the default): the blocks' layers hold one Buffer between them, and two steps
    give bit for bit what layers with a Buffer each give: plain, and with the recompute dispatching again
    between the later block's backward and the earlier block's."""
    own, shared = run(checkpointed, share_buffer=False), run(checkpointed)
    assert int(own[0]["0.slots_used"].sum()) > 0, "no replicas: the skew is too weak"
    for rank, (g, want) in enumerate(zip(shared, own, strict=True)):
        assert (int(g.pop("buffers")), int(want.pop("buffers"))) == (1, LAYERS), f"rank {rank}"
        assert g.keys() == want.keys()
        for key in want:
            assert torch.equal(g[key], want[key]), f"rank {rank}: {key} differs with a shared Buffer"
