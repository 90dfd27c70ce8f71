"""Top-k router: logits, scores, (group-limited) expert selection, route weights, load-balancing terms.

Shapes use the suffix letters of DESIGN.md, "Notation" (``t``: the caller's tokens). The expert groups of
group-limited routing (``n_group`` blocks of ``E / n_group`` consecutive experts) are spelled out, not given a
letter.

The router is ordinary autograd: it receives its gradient through ``route_weights_tk`` (and the aux loss).
Selection (which experts) is not differentiable; the optional expert bias (DeepSeek-V3's
``e_score_correction_bias``) shifts selection only, never the route weights.

On CUDA an fp32 router over bf16 hidden states runs its three GEMMs on bf16 tensor cores with fp32 output
(`SplitLinear`) instead of fp32 SIMT GEMMs (1.3-1.9x faster on the H200, `bench.router`), to fp32 accuracy up
to the tensor cores' accumulation: the fp32 operands are split exactly into three bf16 terms, and a product of
two bf16 numbers is exact in fp32.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from moonep_moe.config import RouterConfig

__all__ = ["RouterOutput", "SplitLinear", "TopKRouter", "split_bf16"]


def split_bf16(t: Tensor, terms: int) -> Tensor:
    """``[terms, *t.shape]`` bf16 terms of fp32 ``t``, each the bf16 rounding of what the earlier ones leave.

    Each remainder is exact in fp32 and each term takes the next 8 significant bits, so three terms sum to
    ``t`` exactly (bf16 has fp32's exponent range; values within 2**-16 of fp32's smallest normal lose their
    last bits) and two to within ``2**-16`` of ``|t|``.
    """
    parts = [t.to(torch.bfloat16)]
    rest = t
    for _ in range(terms - 1):
        rest = rest - parts[-1]  # in fp32 (type promotion), the bf16 term widened exactly: one kernel
        parts.append(rest.to(torch.bfloat16))
    return torch.stack(parts)


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of bf16 operands with fp32 accumulation and output: tensor cores on CUDA; elsewhere the
    same arithmetic (exact products, fp32 sums) in fp32, as ``torch.mm(out_dtype=)`` is CUDA-only."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class SplitLinear(torch.autograd.Function):
    """``F.linear(x.float(), w)`` for bf16 ``x_th [T, H]`` and fp32 ``w_eh [E, H]`` (fp32 logits ``[T, E]``),
    with every GEMM on bf16 operands and fp32 accumulation:

    - forward: ``x @ [w1; w2; w3]^T`` (one GEMM of ``N = 3E``; ``w = w1 + w2 + w3`` exactly, `split_bf16`),
      the three ``[T, E]`` column blocks summed;
    - weight gradient (fp32): ``[g1; g2; g3] @ x`` (``M = 3E``, ``g`` split in three likewise), summed;
    - input gradient (returned in bf16, ``x``'s dtype): ``[g1, g1, g2] @ [w1; w2; w1]`` (one GEMM of
      ``K = 3E``): the terms below ``2**-16`` of the product left out, far under bf16's rounding.

    Every product of two bf16 numbers is exact in fp32, so the logits and the weight gradient carry only fp32
    summation error, as an fp32 GEMM's do (in another order); the input gradient rounds to bf16 once.
    """

    @staticmethod
    def forward(ctx, x_th: Tensor, w_eh: Tensor) -> Tensor:
        w_seh = split_bf16(w_eh, 3)
        ctx.save_for_backward(x_th, w_seh)
        y_ts = _mm_f32(x_th, w_seh.flatten(0, 1).t()).view(x_th.shape[0], 3, w_eh.shape[0])
        return y_ts[:, 0] + (y_ts[:, 1] + y_ts[:, 2])

    @staticmethod
    def backward(ctx, grad_te: Tensor):
        x_th, w_seh = ctx.saved_tensors
        grad_x = grad_w = None
        g_ste = split_bf16(grad_te.float(), 3)
        if ctx.needs_input_grad[0]:
            g_tke = torch.stack((g_ste[0], g_ste[0], g_ste[1]), dim=1)  # [T, 3, E]
            w_keh = torch.stack((w_seh[0], w_seh[1], w_seh[0]))  # [3, E, H]
            grad_x = _mm_f32(g_tke.flatten(1), w_keh.flatten(0, 1)).to(x_th.dtype)
        if ctx.needs_input_grad[1]:
            gw_seh = _mm_f32(g_ste.transpose(1, 2).flatten(0, 1), x_th).view(w_seh.shape)
            grad_w = gw_seh[0] + (gw_seh[1] + gw_seh[2])
        return grad_x, grad_w


class RouterOutput(NamedTuple):
    """What one router call returns.

    Attributes:
        topk_experts_tk: int32 [T, K] chosen expert ids, best first.
        route_weights_tk: [T, K] in the router dtype, differentiable w.r.t. the router weight.
        logits_te: [T, E] in the router dtype.
        aux_loss: scalar tensor (already times ``aux_loss_coeff``), or None when the coefficient is 0.
        tokens_per_expert_e: int32 [E] histogram of this call's T*K routes.
    """

    topk_experts_tk: Tensor
    route_weights_tk: Tensor
    logits_te: Tensor
    aux_loss: Tensor | None
    tokens_per_expert_e: Tensor


class TopKRouter(nn.Module):
    """Owns the router weight ``[E, H]`` (nn.Linear(H, E, bias=False) layout) and the optional expert bias.

    Steps of ``forward``:
    1. ``logits = hidden @ W^T`` in the router dtype (`SplitLinear` for bf16 hidden states and an fp32
       router on CUDA, unless ``RouterConfig.bf16x3`` is False).
    2. scores = softmax or sigmoid of the logits, in fp32 (float64 for a float64 router).
    3. Selection scores = scores + expert bias (when enabled). With ``n_group > 1`` each group is scored
       (sigmoid: sum of its top-2, DeepSeek-V3; softmax: its max, DeepSeek-V2), the ``topk_group`` best groups
       are kept and the others masked out.
    4. Top-k over the selection scores; the route weights are the unbiased scores of the chosen experts,
       renormalised when set (by ``max(sum, renormalize_min)``, or by default for sigmoid ``sum + 1e-20``),
       times ``routed_scaling_factor``.
    5. The histogram of the routes and, when ``aux_loss_coeff > 0``, the switch-style aux loss
       ``coeff * E * sum_e f_e * P_e``.
    """

    expert_bias: Tensor | None

    def __init__(self, config: RouterConfig, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if num_experts % config.n_group:
            raise ValueError(f"n_group ({config.n_group}) must divide num_experts ({num_experts})")
        groups_kept = config.topk_group if config.n_group > 1 else 1
        max_top_k = groups_kept * (num_experts // config.n_group)
        if not 1 <= top_k <= max_top_k:
            raise ValueError(f"top_k ({top_k}) must be in [1, {max_top_k}] (experts in the kept groups)")
        self.config = config
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=config.torch_dtype))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        bias_e = torch.zeros(num_experts, dtype=torch.float32) if config.expert_bias else None
        self.register_buffer("expert_bias", bias_e)

    def forward(self, hidden_th: Tensor, token_mask_t: Tensor | None = None) -> RouterOutput:
        """Route ``hidden_th`` [T, H] (any floating dtype; cast to the router dtype).

        ``token_mask_t`` (bool [T], True = real token): masked tokens get expert -1 and weight 0 on every
        route and are left out of the histogram and the aux loss.
        """
        cfg = self.config
        if (cfg.bf16x3 and hidden_th.is_cuda and hidden_th.dtype == torch.bfloat16
                and self.weight.dtype == torch.float32):
            logits_te = SplitLinear.apply(hidden_th, self.weight)
        else:
            logits_te = F.linear(hidden_th.to(self.weight.dtype), self.weight)
        logits_te_c = logits_te.to(torch.promote_types(logits_te.dtype, torch.float32))
        sigmoid = cfg.score_function == "sigmoid"
        scores_te = logits_te_c.sigmoid() if sigmoid else logits_te_c.softmax(dim=-1)

        select_te = scores_te.detach()
        if self.expert_bias is not None:
            select_te = select_te + self.expert_bias
        if cfg.n_group > 1:
            select_te = self._mask_groups(select_te)
        topk_experts_tk = select_te.topk(self.top_k, dim=-1).indices

        gates_tk = scores_te.gather(-1, topk_experts_tk)
        if cfg.renormalize:
            # `renormalize_min` m: max(sum, m), as the model computes it. Else sigmoid: DeepSeek-V3's
            # `sum + 1e-20`; softmax: the plain sum where it is a normal number; a token whose selected scores
            # (nearly) all underflowed (the expert bias can select experts far below its best one) keeps them
            # unnormalised, about 0, instead of 0 / 0 = NaN forward or an infinite 1 / sum in backward
            total_tk = gates_tk.sum(-1, keepdim=True)
            if cfg.renormalize_min is not None:
                total_tk = total_tk.clamp(min=cfg.renormalize_min)
            elif sigmoid:
                total_tk = total_tk + 1e-20
            else:
                total_tk = torch.where(total_tk >= torch.finfo(total_tk.dtype).tiny, total_tk, 1.0)
            gates_tk = gates_tk / total_tk
        gates_tk = gates_tk * cfg.routed_scaling_factor

        real_tk = torch.ones_like(topk_experts_tk, dtype=torch.bool)
        if token_mask_t is not None:
            real_tk = token_mask_t[:, None].expand_as(topk_experts_tk)
            topk_experts_tk = torch.where(real_tk, topk_experts_tk, -1)
            gates_tk = gates_tk * real_tk
        tokens_per_expert_e = torch.zeros(self.num_experts, dtype=torch.int32, device=hidden_th.device)
        tokens_per_expert_e.index_add_(0, topk_experts_tk.clamp(min=0).flatten(), real_tk.flatten().int())
        aux_loss = None
        if cfg.aux_loss_coeff > 0:
            aux_loss = self._aux_loss(scores_te, real_tk[:, 0], tokens_per_expert_e)
        return RouterOutput(
            topk_experts_tk.int(), gates_tk.to(logits_te.dtype), logits_te, aux_loss, tokens_per_expert_e
        )

    def _mask_groups(self, select_te: Tensor) -> Tensor:
        """Set the selection scores of every expert outside the token's ``topk_group`` best groups to -inf.

        Works on ``by_group [T, n_group, E / n_group]`` (the scores of each group's experts) and
        ``group_score``, ``keep`` ``[T, n_group]``.
        """
        cfg = self.config
        by_group = rearrange(select_te, "t (group member) -> t group member", group=cfg.n_group)
        if cfg.score_function == "sigmoid":
            group_score = by_group.topk(min(2, by_group.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_score = by_group.amax(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        masked = by_group.masked_fill(~keep[..., None], float("-inf"))
        return rearrange(masked, "t group member -> t (group member)")

    def _aux_loss(self, scores_te: Tensor, real_t: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        """``coeff * E * sum_e f_e * P_e`` over the real tokens; f_e = share of their routes (no grad),
        P_e = their mean score (sigmoid scores normalised per token)."""
        probs_te = scores_te
        if self.config.score_function == "sigmoid":
            probs_te = scores_te / scores_te.sum(-1, keepdim=True)
        num_real = real_t.sum().clamp(min=1).to(scores_te.dtype)
        f_e = tokens_per_expert_e.to(scores_te.dtype) / (num_real * self.top_k)
        p_e = (probs_te * real_t[:, None]).sum(0) / num_real
        return self.config.aux_loss_coeff * self.num_experts * (f_e * p_e).sum()

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_e: Tensor) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean(count) - count)``.

        Args:
            tokens_per_expert_e: [E] route counts (any numeric dtype), usually summed over steps and ranks.
        """
        if self.expert_bias is None:
            raise RuntimeError(
                "update_expert_bias needs RouterConfig.expert_bias=True; this router has no bias"
            )
        counts_e = tokens_per_expert_e.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(self.config.expert_bias_update_rate * torch.sign(counts_e.mean() - counts_e))
