"""The baseline of `bench.ep_group`: one rank of a torch-native plain-EP layer (`NativePlainEPRank`),
bench.layer's `torch._grouped_mm` experts on the rows an all-to-all brings it (a row per route, no
deduplication), eager or under `torch.compile`, each all-to-all stood in for by copies of its bytes on the
rank's stream."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from bench.common import stamp
from bench.native_layer import native_grouped_swiglu
from bench.rank_replay import GroupStep
from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import SharedExperts


def native_ep_experts(x_nh: torch.Tensor, expert_n: torch.Tensor, weight_n: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The expert side of one rank of torch-native plain EP: `[n, H]` rows it received (in arrival order),
    their local experts `[n]` and route weights `[n]` -> `[n, H]`: sorted by expert, bench.native_layer's
    `native_grouped_swiglu`, back to arrival order. A function of its weights (`gate_up [epn, 2H', H]`,
    `down [epn, H, H']`), so one compilation serves every group."""
    order_n = torch.argsort(expert_n, stable=True)
    offs_e = torch.cumsum(torch.bincount(expert_n, minlength=gate_up.shape[0]), 0).to(torch.int32)
    y_nh = native_grouped_swiglu(x_nh[order_n], weight_n[order_n], offs_e, gate_up, down)
    return torch.zeros_like(y_nh).index_copy(0, order_n, y_nh)


@functools.cache
def compiled_native_ep_experts() -> Callable[..., torch.Tensor]:
    """`native_ep_experts` under `torch.compile` (default mode, dynamic shapes: the rows a rank receives and
    its experts change with the skew and the group), made once per process."""
    return torch.compile(native_ep_experts, dynamic=True)


class NativeEPExperts(nn.Module):
    """One rank's home experts of torch-native plain EP (parameters) and the function that runs them on the
    rows it received (`run`: `native_ep_experts`, or its compiled form)."""

    def __init__(self, experts: int, hidden: int, ffn: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        kwargs = dict(dtype=dtype, device=device)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * ffn, hidden, **kwargs) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, ffn, **kwargs) / ffn**0.5)
        self.run: Callable[..., torch.Tensor] = native_ep_experts

    def forward(self, x_nh: torch.Tensor, expert_n: torch.Tensor, weight_n: torch.Tensor) -> torch.Tensor:
        return self.run(x_nh, expert_n, weight_n, self.gate_up, self.down)


class NativePlainEPRank:
    """One rank of a torch-native plain-EP layer in the group `step` (its `off` plan: every route on its
    expert's home rank), one training step at a time (`step()`). Owns its staged rows and buffers.

    Its tokens' rows permuted into all-to-all order (by destination rank), the all-to-all (a row per route),
    the experts on the rows it received (`experts`, eager or compiled), the all-to-all back and each token's
    K rows summed (`index_add`); the backward the same way round (autograd through the experts). Each
    all-to-all is stood in for by copies of its bytes on the rank's own stream (it blocks: the next op needs
    it): the rows arriving (staged: the senders' real rows) copied in, the rows leaving read into scratch,
    and recorded as a window for the link model. `shared`: shared experts (the layer's `SharedExperts`) run
    on the rank's tokens after the routed experts, forward and backward, as a plain torch MoE runs them."""

    def __init__(self, step: GroupStep, rank: int, experts: nn.Module, shared: nn.Module | None = None):
        cfg = step.cfg
        self.experts, self.rank, self.top_k, self.shared = experts, rank, cfg.top_k, shared
        epn = cfg.experts_per_rank
        device = step.hidden[rank].device
        self.device = device
        expert_n = step.topk[rank].reshape(-1).long()
        dest_n = torch.where(expert_n >= 0, expert_n // epn, step.num_ranks)
        order_n = torch.argsort(dest_n, stable=True)[:int((expert_n >= 0).sum())]
        self.send_token_n = order_n // cfg.top_k
        self.remote_send_m = (dest_n[order_n] != rank).nonzero().flatten()
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in ("x", "e", "w", "g", "remote")}
        for r in range(step.num_ranks):
            routes_n = step.topk[r].reshape(-1).long()
            mine_n = (routes_n >= 0) & (routes_n // epn == rank)
            token_n = mine_n.nonzero().flatten() // cfg.top_k
            parts["x"].append(step.hidden[r].index_select(0, token_n))
            parts["g"].append(step.grad_out[r].index_select(0, token_n))
            parts["e"].append(routes_n[mine_n] - rank * epn)
            parts["w"].append(step.weights[r].reshape(-1)[mine_n])
            parts["remote"].append(torch.full_like(token_n, r != rank, dtype=torch.bool))
        staged = {name: torch.cat(tensors) for name, tensors in parts.items()}
        self.recv_e = staged["e"]
        self.remote_recv_m = staged["remote"].nonzero().flatten()
        self.staged_x, self.staged_w, self.staged_g = staged["x"], staged["w"], staged["g"]
        self.staged_back = step.hidden[rank].index_select(0, self.send_token_n)
        self.recv_x, self.recv_w = torch.empty_like(self.staged_x), torch.empty_like(self.staged_w)
        self.recv_g, self.back = torch.empty_like(self.staged_g), torch.empty_like(self.staged_back)
        self.leaf_x = self.recv_x.detach().requires_grad_()
        self.leaf_w = self.recv_w.detach().requires_grad_()
        hidden = self.staged_x.shape[1]
        self.scratch_send = self.staged_x.new_empty((len(self.remote_send_m), hidden))
        self.scratch_recv = self.staged_x.new_empty((len(self.remote_recv_m), hidden))
        self.hidden_sh, self.grad_sh = step.hidden[rank], step.grad_out[rank]
        self.leaf_sh = self.hidden_sh.detach().requires_grad_()

    @property
    def routes(self) -> int:
        return len(self.recv_e)

    def step(self) -> list[tuple]:
        """One training step (queued on the device); returns its four all-to-all windows as (start, end)
        stamps (`window_seconds` reads them once the step has completed)."""
        marks: list = []

        def all_to_all(arrive: torch.Tensor, staged: torch.Tensor, leave: torch.Tensor, index_m: torch.Tensor,
                       scratch: torch.Tensor) -> None:
            marks.append(stamp(self.device))
            with torch.no_grad():
                arrive.copy_(staged)
                torch.index_select(leave, 0, index_m, out=scratch)
            marks.append(stamp(self.device))

        self.experts.zero_grad(set_to_none=True)
        self.leaf_x.grad = self.leaf_w.grad = self.leaf_sh.grad = None
        send_nh = self.hidden_sh.index_select(0, self.send_token_n)
        all_to_all(self.recv_x, self.staged_x, send_nh, self.remote_send_m, self.scratch_send)
        with torch.no_grad():
            self.recv_w.copy_(self.staged_w)
        y_nh = self.experts(self.leaf_x, self.recv_e, self.leaf_w)
        all_to_all(self.back, self.staged_back, y_nh.detach(), self.remote_recv_m, self.scratch_recv)
        out_sh = torch.zeros_like(self.hidden_sh).index_add_(0, self.send_token_n, self.back)
        shared_sh = None
        if self.shared is not None:
            self.shared.zero_grad(set_to_none=True)
            shared_sh = self.shared(self.leaf_sh)
            out_sh = out_sh + shared_sh.detach()
        grad_back = self.grad_sh.index_select(0, self.send_token_n)
        all_to_all(self.recv_g, self.staged_g, grad_back, self.remote_send_m, self.scratch_send)
        y_nh.backward(self.recv_g)
        all_to_all(self.back, self.staged_back, self.leaf_x.grad, self.remote_recv_m, self.scratch_recv)
        torch.zeros_like(out_sh).index_add_(0, self.send_token_n, self.back)
        if shared_sh is not None:
            shared_sh.backward(self.grad_sh)
        return list(zip(marks[::2], marks[1::2], strict=True))


def native_shared_experts(cfg: MoEConfig, device: torch.device) -> nn.Module | None:
    """The shared experts of `cfg` as the layer builds them (`SharedExperts`, nn.Linear's init), for the
    torch-native rank to run after its routed experts; None where `cfg` has none."""
    if not cfg.shared_width:
        return None
    return SharedExperts(cfg.hidden_size, cfg.shared_width, cfg.shared_experts.gate, cfg.torch_dtype, device)


def hottest_rank(step: GroupStep) -> int:
    """The rank with the most routes under the step's plan (ties: the lowest)."""
    load_r = step.plans[0].rank_load.long().cpu()
    return int(torch.argmax(load_r * step.num_ranks - torch.arange(step.num_ranks)))
