"""The whole MoonEPMoELayer forward + backward against a torch-native MoE layer, same shapes, same run.

    python -m bench.layer                   # DeepSeek-V3 layer at EP=1: T=8192, H=7168, H'=2048, E=256, K=8
    python -m bench.layer --tokens 4096 --experts 64
    python -m bench.layer --backends --token-paddings   # the torch-native baseline and the DEFAULT row only

The baseline is what users run today, written here in the torchtitan style: a softmax top-k router, a
sort-based permute, `torch._grouped_mm` experts with autograd, an `index_add` unpermute. Both layers get the
same weights and tokens. Ours runs first as the DEFAULT row: `MoEConfig` with only the shapes given and every
other setting at its default (what a user gets; `"config": "default"` in the JSON), then with each
grouped-GEMM backend, each `expert_grad_dtype` (`param`: gradients in the parameters' bf16 like the
baseline; `main_grad`: a persistent fp32 `main_grad` that wgrad adds into, never zeroed here, as across
micro-batches) and each token padding (the segment alignment: 128 for DeepGEMM; at EP=1 with E=256 it adds
~25% rows, 16 adds ~3%). Reported: fwd+bwd time (median of CUDA-event timings), its ratio to the baseline,
and each one's peak memory during a step (parameters and gradients, `main_grad` included).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import measure_limits, timed, write_record
from moonep_moe.comm.world import single_world
from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer


class TorchNativeMoE(nn.Module):
    """A plain EP=1 MoE block: router -> sort by expert -> grouped GEMMs -> index_add back."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        kwargs = dict(device="cuda", dtype=torch.bfloat16)
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False, device="cuda", dtype=torch.float32)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * ffn, hidden, **kwargs))
        self.down = nn.Parameter(torch.empty(experts, hidden, ffn, **kwargs))

    def forward(self, x_th: torch.Tensor) -> torch.Tensor:
        scores_te = self.router(x_th.float()).softmax(-1)
        weights_tk, experts_tk = scores_te.topk(self.top_k, dim=-1)
        weights_tk = weights_tk / weights_tk.sum(-1, keepdim=True)
        order_n = experts_tk.flatten().argsort(stable=True)
        token_n = order_n // self.top_k
        counts_e = torch.bincount(experts_tk.flatten(), minlength=self.gate_up.shape[0])
        offs_e = torch.cumsum(counts_e, 0).to(torch.int32)
        x_nh = x_th[token_n]
        gate_nf, up_nf = torch._grouped_mm(x_nh, self.gate_up.transpose(-2, -1), offs=offs_e).chunk(2, -1)
        h_nf = F.silu(gate_nf) * up_nf * weights_tk.flatten()[order_n, None].to(x_th.dtype)
        y_nh = torch._grouped_mm(h_nf, self.down.transpose(-2, -1), offs=offs_e)
        return torch.zeros_like(x_th).index_add(0, token_n, y_nh)


def step(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    x_th.grad = None
    layer(x_th).backward(grad_th)


def print_profile(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor) -> None:
    """The GPU kernels of one step, by total time (where the time goes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(layer, x_th, grad_th)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def measure(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor) -> tuple[float, float]:
    """(median fwd+bwd seconds, peak GiB of one step)."""
    seconds = timed(lambda: step(layer, x_th, grad_th), warmup=2, repeat=7)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(layer, x_th, grad_th)
    torch.cuda.synchronize()
    return seconds, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--backends", nargs="*", default=["torch", "deep_gemm", "triton", "auto"])
    parser.add_argument("--grad-dtypes", nargs="*", default=["param", "main_grad"],
                        help="MoEConfig.expert_grad_dtype values to run (default both)")
    parser.add_argument("--token-paddings", nargs="*", type=int, default=[128, 16],
                        help="MoEConfig.token_padding values: 128 (DeepGEMM's M-block) pads each of the E "
                             "segments by 64 rows on average; 16 wastes less where the backend allows it")
    parser.add_argument("--profile", action="store_true", help="also print each layer's kernels of one step")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    limits = measure_limits()
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, f, e = args.hidden, args.ffn, args.experts
    x_th = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad_th = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    weights = {"router": torch.randn(e, h, device="cuda", generator=gen) / math.sqrt(h),
               "gate_up": torch.randn(e, 2 * f, h, device="cuda", generator=gen).bfloat16() / math.sqrt(h),
               "down": torch.randn(e, h, f, device="cuda", generator=gen).bfloat16() / math.sqrt(f)}
    flops = 3 * 2 * args.tokens * args.top_k * 3 * f * h  # fwd + 2x bwd of the three projections

    baseline = TorchNativeMoE(h, f, e, args.top_k)
    with torch.no_grad():
        baseline.router.weight.copy_(weights["router"])
        baseline.gate_up.copy_(weights["gate_up"])
        baseline.down.copy_(weights["down"])
    base_s, base_gib = measure(baseline, x_th, grad_th)
    if args.profile:
        print_profile(baseline, x_th, grad_th)
    del baseline
    rows = [{"layer": "torch-native", "ms": base_s * 1e3, "vs_baseline": 1.0, "peak_gib": base_gib,
             "tflops": flops / base_s / 1e12}]
    print(f"{'torch-native':44} {base_s * 1e3:8.2f} ms  peak {base_gib:6.1f} GiB", flush=True)
    shapes = dict(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=args.top_k,
                  max_tokens_per_rank=args.tokens)
    runs = [("DEFAULT config", {})]
    variants = itertools.product(args.token_paddings, args.backends, args.grad_dtypes)
    for padding, backend, grad_dtype in variants:
        runs.append((f"{backend}, {grad_dtype} grads, tp {padding}",
                     dict(grouped_gemm=backend, expert_grad_dtype=grad_dtype, token_padding=padding)))
    for label, settings in runs:
        gc.collect()
        torch.cuda.empty_cache()
        cfg = MoEConfig(**shapes, **settings)
        try:
            layer = MoonEPMoELayer(cfg, single_world("cuda"))
        except ValueError as error:
            print(f"skipping {label}: {error}")
            continue
        layer.load_state_dict({"router.weight": weights["router"], "experts.gate_up_proj": weights["gate_up"],
                               "experts.down_proj": weights["down"]})
        seconds, gib = measure(layer, x_th, grad_th)
        if args.profile:
            print_profile(layer, x_th, grad_th)
        name = f"moonep ({label})"
        rows.append({"layer": name, "config": "default" if not settings else "variant",
                     "backend": cfg.grouped_gemm, "expert_grad_dtype": cfg.expert_grad_dtype,
                     "token_padding": cfg.token_padding, "dtype": cfg.dtype, "ms": seconds * 1e3,
                     "vs_baseline": seconds / base_s, "peak_gib": gib, "tflops": flops / seconds / 1e12})
        print(f"{name:44} {seconds * 1e3:8.2f} ms  peak {gib:6.1f} GiB  "
              f"{seconds / base_s:.2f}x torch-native", flush=True)
        layer.destroy()
        del layer
    print("results:", write_record("layer", limits, rows, Path(args.out) if args.out else None))


if __name__ == "__main__":
    main()
