"""Activation checkpointing around MoonEP blocks: peak memory and time of forward + backward with and
without `torch.utils.checkpoint` (non-reentrant), same weights, same tokens, same run.

    python -m bench.checkpointing                       # qwen3-moe-30b-a3b layers at EP=1: 4 blocks, T=8192
    python -m bench.checkpointing --config deepseek-v3 --layers 2 --tokens 4096
    python -m bench.checkpointing --device cpu --config tiny-cpu --tokens 256   # a smoke run, no memory

One rank on one GPU (the threads world cannot run several ranks' backward on one device). A block is
`h + moe(norm(h))` (a LayerNorm, the MoonEP layer with the config's settings); `--layers` blocks are stacked
and the loss is `sum(out * g)` for a fixed random `g`. Checkpointed, every block keeps only its input for
backward and recomputes its forward there (routing, plan, dispatch, experts, combine). Reported per mode:
fwd+bwd seconds (median of CUDA-event timings), the memory held for backward at the end of forward and the
peak memory during the step, both above the memory held before it (parameters; gradients are dropped between
steps; the peak comes late in backward, where the gradients of every block exist), and the largest
difference of any gradient from the plain run's (0 where the backend is deterministic).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.common import timed, write_record
from moonep_moe.config import load_config
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world


class Block(nn.Module):
    """`h + moe(norm(h))`."""

    def __init__(self, cfg, world):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size, dtype=cfg.torch_dtype, device=world.device)
        self.moe = MoonEPMoELayer(cfg, world)

    def forward(self, h_th: torch.Tensor) -> torch.Tensor:
        return h_th + self.moe(self.norm(h_th))


def forward(blocks: nn.ModuleList, x_th: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    h_th = x_th
    for block in blocks:
        h_th = checkpoint(block, h_th, use_reentrant=False) if checkpointed else block(h_th)
    return h_th


def step(blocks: nn.ModuleList, x_th: torch.Tensor, g_th: torch.Tensor, checkpointed: bool) -> None:
    """One forward + backward; leaves the gradients on the parameters."""
    forward(blocks, x_th, checkpointed).backward(g_th)


def grads(blocks: nn.ModuleList) -> list[torch.Tensor]:
    return [p.grad.clone() for p in blocks.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-moe-30b-a3b", help="packaged layer config or YAML path")
    parser.add_argument("--layers", type=int, default=4, help="blocks stacked")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (max_tokens_per_rank)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="folder for the JSON record (default bench/results)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = load_config(args.config, ep_size=1, max_tokens_per_rank=args.tokens)
    torch.manual_seed(0)
    world = single_world(device)
    blocks = nn.ModuleList(Block(cfg, world) for _ in range(args.layers))
    x_th = torch.randn(args.tokens, cfg.hidden_size, device=device, dtype=cfg.torch_dtype, requires_grad=True)
    g_th = torch.randn_like(x_th)
    rows, reference = [], None
    for checkpointed in (False, True):
        blocks.zero_grad(set_to_none=True)
        step(blocks, x_th, g_th, checkpointed)  # warm-up (kernel compilation, GEMM choice) and the gradients
        got = grads(blocks)
        reference = reference or got
        max_diff = max(float((a.float() - b.float()).abs().max())
                       for a, b in zip(got, reference, strict=True))
        row = {"mode": "checkpoint" if checkpointed else "plain", "max_grad_diff_vs_plain": max_diff}
        if cuda:
            blocks.zero_grad(set_to_none=True)
            x_th.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out_th = forward(blocks, x_th, checkpointed)
            torch.cuda.synchronize()
            # what backward needs, held from the end of forward: the memory checkpointing trades for time
            row["saved_for_backward_gib"] = (torch.cuda.memory_allocated() - before) / 2**30
            out_th.backward(g_th)
            del out_th
            torch.cuda.synchronize()
            row["peak_above_params_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30

            def run(checkpointed=checkpointed):
                blocks.zero_grad(set_to_none=True)
                x_th.grad = None
                step(blocks, x_th, g_th, checkpointed)

            row["seconds"] = timed(run, warmup=1, repeat=5)
        rows.append(row)
        print(row)
    if cuda:
        plain, ckpt = rows
        print(f"{args.config}, {args.layers} blocks, T={args.tokens}: held for backward after forward "
              f"{plain['saved_for_backward_gib']:.2f} GiB plain, {ckpt['saved_for_backward_gib']:.2f} GiB "
              f"checkpointed; peak above the parameters {plain['peak_above_params_gib']:.2f} GiB plain, "
              f"{ckpt['peak_above_params_gib']:.2f} GiB checkpointed; "
              f"time x{ckpt['seconds'] / plain['seconds']:.2f}")
        setup = {"config": args.config, "layers": args.layers, "tokens": args.tokens}
        print("results:", write_record("checkpointing", {}, rows, Path(args.out) if args.out else None,
                                       ran_on=args.device, setup=setup))


if __name__ == "__main__":
    main()
