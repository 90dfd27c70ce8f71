"""The torch-native MoE layer, bench.layer's baseline: `TorchNativeMoE`, what users run today in the
torchtitan style (an fp32 softmax top-k router, a sort-based permute, `torch._grouped_mm` experts with
autograd, an `index_add` unpermute), built with bench.layer's weights (`native_layer`) and compiled as a
careful user runs it (`compile_native`). Its experts on rows grouped by expert (`native_grouped_swiglu`)
are also bench.native_ep's, the torch-native plain-EP baseline of bench.ep_group."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from bench.layer_step import layer_weights, step


class TorchNativeMoE(nn.Module):
    """A plain EP=1 MoE block: router -> sort by expert -> grouped GEMMs -> index_add back. On CUDA for the
    benchmarks; `device="cpu"` for tests (`torch._grouped_mm` runs bf16 there too). Weights uninitialised."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, device: torch.device | str = "cuda"):
        super().__init__()
        kwargs = dict(device=device, dtype=torch.bfloat16)
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False, device=device, dtype=torch.float32)
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
        y_nh = native_grouped_swiglu(x_th[token_n], weights_tk.flatten()[order_n], offs_e, self.gate_up,
                                     self.down)
        return torch.zeros_like(x_th).index_add(0, token_n, y_nh)


def native_grouped_swiglu(x_nh: torch.Tensor, weight_n: torch.Tensor, offs_e: torch.Tensor,
                          gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The torch-native layer's experts on rows grouped by expert: `torch._grouped_mm` gate and up, SwiGLU
    times the route weight, `torch._grouped_mm` down (autograd through all of it).

    Args:
        x_nh: `[n, H]` rows, expert by expert. weight_n: `[n]` their route weights. offs_e: `[E]` int32 end
            offsets of the experts' rows. gate_up: `[E, 2H', H]`. down: `[E, H, H']`.
    Returns `[n, H]` in the rows' dtype."""
    gate_nf, up_nf = torch._grouped_mm(x_nh, gate_up.transpose(-2, -1), offs=offs_e).chunk(2, -1)
    h_nf = F.silu(gate_nf) * up_nf * weight_n[:, None].to(x_nh.dtype)
    return torch._grouped_mm(h_nf, down.transpose(-2, -1), offs=offs_e)


def native_layer(hidden: int, ffn: int, experts: int, top_k: int,
                 device: torch.device | str = "cuda") -> TorchNativeMoE:
    """The torch-native layer on `device` with `layer_weights`."""
    layer = TorchNativeMoE(hidden, ffn, experts, top_k, device)
    weights = layer_weights(hidden, ffn, experts, device=device)
    with torch.no_grad():
        layer.router.weight.copy_(weights["router.weight"])
        layer.gate_up.copy_(weights["experts.gate_up_proj"])
        layer.down.copy_(weights["experts.down_proj"])
    return layer


def compile_native(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor) -> tuple[nn.Module, float]:
    """`torch.compile(layer)` (default mode, static shapes) and the seconds of its first step (compiling
    forward and backward); later steps run the compiled graphs."""
    compiled = torch.compile(layer, dynamic=False)
    start = time.perf_counter()
    step(compiled, x_th, grad_th)
    torch.cuda.synchronize()
    return compiled, time.perf_counter() - start
