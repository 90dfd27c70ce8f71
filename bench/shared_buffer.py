"""The comm memory of a stack of MoE layers with one shared Buffer (`MoEConfig.share_buffer`, the default)
against a Buffer per layer (the baseline, `share_buffer=False`), measured in the same run.

    python -m bench.shared_buffer                 # 4 DeepSeek-V3-shaped layers at EP=1 on the GPU (seconds)
    python -m bench.shared_buffer --device cpu    # tiny shapes: the Buffers counted, nothing timed

The layers have DeepSeek-V3's H, E, K and S (`moonep_moe/configs/deepseek-v3.yaml`, ep_size 1, so no slots)
with the experts shrunk to H' = `--ffn` (128), so that `--layers` of them fit beside each other: the Buffer's
`[NvS, H]` rows do not depend on H'. Per mode, one row: `buffers` (distinct Buffers the layers hold),
`buffer_gib` (one Buffer's bytes, `Buffer.nbytes`), `comm_gib` (the distinct Buffers' bytes together), and on
the GPU `built_gib` (memory allocated by building the stack) and `step_peak_gib` (the most allocated during
one fwd+bwd step of `h = h + layer(h)` through the stack after a warm-up step, from before the stack was
built). Each mode is measured twice, shared first and last, so a drift of the allocator shows. The record
goes to `bench/results/shared-buffer-<device>-...json`.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import model_shape, write_record
from moonep_moe import MoEConfig, MoonEPMoELayer
from moonep_moe.transport.threads import single_world

CPU_SMOKE = {"hidden_size": 64, "num_experts": 16, "top_k": 4, "max_tokens_per_rank": 32}


def stack_step(stack: list[MoonEPMoELayer], x_th: torch.Tensor) -> None:
    """One fwd+bwd step of `h = h + layer(h)` through `stack`, gradients fresh."""
    x_th.grad = None
    for layer in stack:
        layer.zero_grad(set_to_none=True)
    h_th = x_th
    for layer in stack:
        h_th = h_th + layer(h_th)
    h_th.float().sum().backward()


def measure(shapes: dict, share: bool, layers: int, device: str) -> dict:
    """One row: a stack of `layers` layers of `shapes` on one world with `share_buffer=share`."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if cuda else 0
    world = single_world(device)
    config = MoEConfig(**shapes, share_buffer=share)
    stack = [MoonEPMoELayer(config, world) for _ in range(layers)]
    buffers = {id(layer.buffer): layer.buffer for layer in stack}
    row = {"share_buffer": share, "layers": layers, "buffers": len(buffers),
           "buffer_gib": stack[0].buffer.nbytes / 2**30,
           "comm_gib": sum(buffer.nbytes for buffer in buffers.values()) / 2**30}
    x_th = torch.randn(config.max_tokens_per_rank, config.hidden_size, device=device,
                       dtype=config.torch_dtype, requires_grad=True)
    if cuda:
        torch.cuda.synchronize()
        row["built_gib"] = (torch.cuda.memory_allocated() - base) / 2**30
    stack_step(stack, x_th)  # warm-up: kernels built, workspaces allocated
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        stack_step(stack, x_th)
        torch.cuda.synchronize()
        row["step_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    for layer in stack:
        layer.destroy()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=128, help="H' of the shrunk experts")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    model = model_shape("deepseek-v3")
    shapes = dict(CPU_SMOKE) if args.device == "cpu" else {
        "hidden_size": model["hidden"], "num_experts": model["experts"], "top_k": model["top_k"],
        "max_tokens_per_rank": model["tokens"]}
    shapes.update(ffn_hidden_size=args.ffn, dtype="bfloat16" if args.device == "cuda" else "float32")
    rows = [measure(shapes, share, args.layers, args.device) for share in (True, False, True)]
    for row in rows:
        print(", ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                        for key, value in row.items()))
    path = write_record("shared-buffer", {}, rows, ran_on=args.device, setup={**shapes, **vars(args)},
                        baseline="share_buffer=False")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
