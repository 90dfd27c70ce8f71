"""Swap the MoE blocks of a Hugging Face transformers model for `MoonEPMoELayer`.

Shapes use the suffix letters of DESIGN.md, "Notation" (``t``: the tokens the model passes to a block).

`swap_moe_blocks(model, max_tokens_per_rank, world)` replaces every supported MoE block in place with a
`MoonEPBlock`: a thin module around one `MoonEPMoELayer` that keeps the block's call signature
(`forward(hidden_states [batch, seq, H]) -> [batch, seq, H]`) and copies its weights (router, this rank's
home experts, shared experts and their gate, a router's selection bias (`e_score_correction_bias`, AFMoE's
`expert_bias`)). The
rest of the model is untouched: at EP = R, every rank holds a full copy of the non-expert model, runs its own
batch and swaps its own copy with its own world (every rank in the same order). A multimodal model's blocks
read its text config (`get_text_config()`).

Router logits: transformers (the pinned v5) does not return them from the block; the model records them with
a forward hook on the router class when asked (`output_router_logits=True`, which also adds the aux loss).
`MoonEPBlock` passes the layer's own logits (`MoonEPMoELayer.last_router_logits_te`, the router runs once)
through `router_logits`, an identity module carrying the same recording hook, so `outputs.router_logits` and
the aux loss stay as the original model computes them.

Supported blocks (transformers 5.x, fused experts `gate_up_proj [E, 2F, H]` (gate rows first) and
`down_proj [E, H, F]`, SiLU):

- `MixtralSparseMoeBlock`, `MiniMaxSparseMoeBlock` (MiniMax-Text-01, the same code): softmax over E, top-k,
  renormalise;
- `OlmoeSparseMoeBlock` (OLMoE), `FlexOlmoSparseMoeBlock` (FlexOlmo, the same code): softmax, top-k,
  `norm_topk_prob`;
- `Qwen2MoeSparseMoeBlock`: softmax, top-k, `norm_topk_prob`; a shared expert with a sigmoid gate;
- `Qwen3MoeSparseMoeBlock`, `MellumSparseMoeBlock` (Mellum), `Qwen3OmniMoeThinkerTextSparseMoeBlock`
  (Qwen3-Omni-MoE's thinker text model), the same code: softmax, top-k, `norm_topk_prob`;
- `Qwen3NextSparseMoeBlock`, `Qwen4ExpTextSparseMoeBlock` (Qwen4-Exp's text model): Qwen2-MoE's code
  (softmax, top-k, `norm_topk_prob`; a sigmoid-gated shared expert);
- `Qwen3_5MoeSparseMoeBlock` (Qwen3.5-MoE): Qwen2-MoE's, always renormalising (softmax, top-k, renormalise;
  a sigmoid-gated shared expert);
- `Qwen3VLMoeTextSparseMoeBlock` (Qwen3-VL-MoE's text model): softmax, top-k, renormalise;
- `HunYuanMoEV1Moe` (Hunyuan-A13B): softmax (fp32 scores of the `gate.wg` logits), top-k, renormalise; an
  ungated shared MLP (`shared_mlp`); one expert count and top-k for every layer;
- `DeepseekV2Moe`: fp32 softmax, top-k (`topk_method="greedy"` only), no renormalisation,
  `routed_scaling_factor`; shared experts;
- `DeepseekV3MoE`: fp32 sigmoid scores + `e_score_correction_bias` (selection only; frozen, as in
  transformers), group-limited top-k (`n_group`, `topk_group`), `norm_topk_prob`, `routed_scaling_factor`;
  shared experts;
- `Glm4MoeMoE` (GLM-4.5/4.6), `Dots1MoE` (dots.llm1), `DeepseekV32MoE` (DeepSeek-V3.2), `Glm4MoeLiteMoE`
  (GLM-4-MoE-Lite), `GlmMoeDsaMoE` (GLM-5), `Glm4vMoeTextMoE` (GLM-4.5V's text model), `SolarOpenMoE` (Solar
  Open), `KimiLinearMoE` (Kimi-Linear; its config names the routed experts `num_experts`): DeepSeek-V3's
  code, routing and shared experts;
- `MiMoV2FlashMoE` (MiMo-V2-Flash): DeepSeek-V3's router and routed experts, no shared experts;
- `AfmoeSparseMoeBlock` (AFMoE): fp32 sigmoid scores of the model-dtype `router.gate` logits + the block's
  `expert_bias` (selection only), top-k, divided by `sum + 1e-20`, times `route_scale`; shared experts;
- `MiniMaxM2SparseMoeBlock` (MiniMax-M2): fp32 sigmoid scores + the block's `e_score_correction_bias`
  (selection only), top-k, divided by the plain sum (`router.renormalize_min=0`);
- `Ernie4_5_MoeSparseMoeBlock` (ERNIE-4.5): fp32 softmax + `moe_statics.e_score_correction_bias` (selection
  only), top-k, divided by the sum clamped to `moe_norm_min` (`router.renormalize_min`); shared experts.

FP8 blocks (transformers' finegrained-FP8 integration, e.g. DeepSeek-V3's released checkpoint loaded
as it is): `FP8Experts` (e4m3 `gate_up_proj` / `down_proj` with fp32 `gate_up_proj_scale_inv` (gate's and
up's scales stacked) / `down_proj_scale_inv`, one scale per 128x128 block) and `FP8Linear` shared experts
(`weight` + `weight_scale_inv`) are swapped in dequantised (each weight times its block scales in fp32, then
rounded), into bfloat16 masters unless the overrides say `dtype=`. With `expert_weights="fp8"` (inference)
the routed experts stay FP8 instead: this rank's e4m3 bytes and scales are copied as they are into the
layer's FP8 experts (`MoEConfig.expert_weights`; an unquantised block's experts are quantised), and
`hf_tensors` gives them back with their scales under the same names; shared experts are still dequantised.

Anything else that looks like an MoE block, expert or shared-expert bias terms, transposed or interleaved
expert layouts, activations other than SiLU, FP8 blocks other than 128x128, Mixtral's and MiniMax's router
jitter, DeepSeek-V2's `group_limited_greedy`, HunYuan-MoE's per-layer expert counts and AFMoE without shared
experts fail in `swap_moe_blocks` with a message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moonep_moe.config import MoEConfig, dtype_name
from moonep_moe.fp8.checkpoint import SCALE_SUFFIX, check_finite_scales, copy_checkpoint_weight_
from moonep_moe.fp8.format import BLOCK, FP8_DTYPE
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world
from moonep_moe.transport.world import EPWorld

__all__ = ["EXPERT_KEYS", "MoonEPBlock", "hf_state_dict", "merge_expert_shards", "swap_moe_blocks"]

EXPERT_KEYS = ("experts.gate_up_proj", "experts.down_proj")
"""HF-local names of the fused expert tensors; in `hf_state_dict` they hold a rank's home experts only."""
BIAS_KEY = "gate.e_score_correction_bias"


@dataclass(frozen=True)
class BlockSpec:
    """How one transformers MoE block class maps onto a `MoEConfig` and onto HF parameter names.

    `fields(hf_config)` returns the `MoEConfig` fields read from the model config (shapes, router, shared
    experts); `router` is the HF name of the module holding the router's `weight [E, H]` (`gate` but for
    HunYuan-MoE's `gate.wg` and AFMoE's `router.gate`); `shared` is the HF name of the shared-expert MLP
    (None: none) and `shared_gate` the name of its sigmoid gate (None: ungated); `router_fp32` routes in
    float32 whatever the model dtype (DeepSeek-V2 and V3, GLM-4.5, dots.llm1, ERNIE-4.5); `bias` is the HF
    name of the selection bias where the router has one (`router.expert_bias`), `bias_lead` the leading
    dimensions of its `[..., E]` shape (ERNIE-4.5's is `[1, E]`).
    """

    fields: Callable[[Any], dict[str, Any]]
    router: str = "gate"
    shared: str | None = None
    shared_gate: str | None = None
    router_fp32: bool = False
    bias: str = BIAS_KEY
    bias_lead: tuple[int, ...] = ()


def _softmax_top_k(ffn_hidden_size: int, num_experts: int, renormalize: bool) -> dict[str, Any]:
    """Routed experts behind a softmax over E and top-k, the chosen scores renormalised when `renormalize`."""
    return dict(ffn_hidden_size=ffn_hidden_size, num_experts=num_experts,
                router=dict(score_function="softmax", renormalize=renormalize))


def _refuse_jitter(c, family: str) -> None:
    """The router's multiplicative input noise in training (`router_jitter_noise`) is not reproduced."""
    if getattr(c, "router_jitter_noise", 0.0):
        raise ValueError(f"{family} router_jitter_noise={c.router_jitter_noise} is not supported; expected 0")


def _mixtral(c) -> dict[str, Any]:
    _refuse_jitter(c, "Mixtral/MiniMax")
    return _softmax_top_k(c.intermediate_size, c.num_local_experts, True)


def _olmoe(c) -> dict[str, Any]:
    return _softmax_top_k(c.intermediate_size, c.num_experts, bool(c.norm_topk_prob))


def _qwen3(c) -> dict[str, Any]:
    return _softmax_top_k(c.moe_intermediate_size, c.num_experts, bool(c.norm_topk_prob))


def _qwen3_vl(c) -> dict[str, Any]:
    """Qwen3-VL-MoE's text blocks always renormalise the top-k scores (no `norm_topk_prob` in its config)."""
    return _softmax_top_k(c.moe_intermediate_size, c.num_experts, True)


def _qwen2_shared(c) -> dict[str, Any]:
    """Qwen2-MoE's one shared expert, `shared_expert_intermediate_size` wide, behind a sigmoid gate."""
    return dict(num_shared_experts=1, ffn_hidden_size=c.shared_expert_intermediate_size, gate=True)


def _qwen2(c) -> dict[str, Any]:
    return {**_qwen3(c), "shared_experts": _qwen2_shared(c)}


def _qwen3_5(c) -> dict[str, Any]:
    """Qwen3.5-MoE: Qwen2-MoE's block, its router always renormalising (no `norm_topk_prob` in its config)."""
    return {**_qwen3_vl(c), "shared_experts": _qwen2_shared(c)}


def _ungated_shared(width: int, num_experts: int, router: dict[str, Any], num_shared: int) -> dict[str, Any]:
    """DeepSeek's layout: `num_experts` routed experts behind `router` and `num_shared` ungated shared
    experts (fused into one MLP; none where it is 0), all `width` wide."""
    shared = dict(num_shared_experts=num_shared, ffn_hidden_size=width, gate=False)
    return dict(ffn_hidden_size=width, num_experts=num_experts, router=router, shared_experts=shared)


def _deepseek(c, router: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's config names: `n_routed_experts` and `n_shared_experts`, `moe_intermediate_size` wide."""
    return _ungated_shared(c.moe_intermediate_size, c.n_routed_experts, router, c.n_shared_experts)


def _deepseek_v2(c) -> dict[str, Any]:
    """DeepSeek-V2's `greedy` routing: fp32 softmax, top-k, never renormalised (transformers' block ignores
    `norm_topk_prob`), times `routed_scaling_factor`. Its `group_limited_greedy` sets the dropped groups'
    scores to 0 before the top-k, where the router uses -inf, so it is refused rather than approximated."""
    if c.topk_method != "greedy":
        raise ValueError(f"DeepSeek-V2 topk_method={c.topk_method!r} is not supported; expected 'greedy' "
                         "('group_limited_greedy' masks the dropped groups' scores to 0, the router to -inf)")
    return _deepseek(c, dict(score_function="softmax", renormalize=False,
                             routed_scaling_factor=float(c.routed_scaling_factor)))


def _deepseek_v3_router(c) -> dict[str, Any]:
    """DeepSeek-V3's router: sigmoid, a frozen selection bias, group-limited top-k, `norm_topk_prob`,
    `routed_scaling_factor`."""
    return dict(score_function="sigmoid", renormalize=bool(c.norm_topk_prob), n_group=c.n_group,
                topk_group=c.topk_group, routed_scaling_factor=float(c.routed_scaling_factor),
                expert_bias=True, expert_bias_update_rate=0.0)


def _deepseek_v3(c) -> dict[str, Any]:
    return _deepseek(c, _deepseek_v3_router(c))


def _kimi_linear(c) -> dict[str, Any]:
    """Kimi-Linear: DeepSeek-V3's block; its config counts the routed experts in `num_experts`."""
    return _ungated_shared(c.moe_intermediate_size, c.num_experts, _deepseek_v3_router(c),
                           c.n_shared_experts)


def _mimo_v2_flash(c) -> dict[str, Any]:
    """MiMo-V2-Flash: DeepSeek-V3's router and routed experts, no shared experts."""
    return dict(ffn_hidden_size=c.moe_intermediate_size, num_experts=c.n_routed_experts,
                router=_deepseek_v3_router(c))


def _minimax_m2(c) -> dict[str, Any]:
    """MiniMax-M2: fp32 sigmoid scores of the model-dtype logits, the block's `e_score_correction_bias` for
    selection only, top-k, the chosen scores divided by their plain sum; no shared expert."""
    _refuse_jitter(c, "MiniMax-M2")
    router = dict(score_function="sigmoid", renormalize=True, renormalize_min=0.0, expert_bias=True,
                  expert_bias_update_rate=0.0)
    return dict(ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts, router=router)


def _hunyuan_v1_moe(c) -> dict[str, Any]:
    """HunYuan-MoE: softmax (fp32 scores of the router's logits), top-k, always renormalised; one ungated
    shared MLP as wide as the experts (`intermediate_size`). Per-layer expert counts or top-k (lists) are
    refused: every block is configured from the one model config."""
    for key in ("num_experts", "moe_topk"):
        value = getattr(c, key)
        if not isinstance(value, int):
            raise ValueError(f"HunYuan-MoE per-layer {key}={value} is not supported; expected one int")
    router = dict(score_function="softmax", renormalize=True)
    return _ungated_shared(c.intermediate_size, c.num_experts, router, 1)


def _afmoe(c) -> dict[str, Any]:
    """AFMoE: fp32 sigmoid scores of the model-dtype logits, the block's `expert_bias` for selection only,
    top-k, divided by `sum + 1e-20`, times `route_scale`; `num_shared_experts` ungated shared experts fused
    into one MLP."""
    if not c.num_shared_experts:
        raise ValueError("AFMoE num_shared_experts=0 is not supported (its block keeps an empty shared MLP)")
    router = dict(score_function="sigmoid", renormalize=True, routed_scaling_factor=float(c.route_scale),
                  expert_bias=True, expert_bias_update_rate=0.0)
    return _ungated_shared(c.moe_intermediate_size, c.num_experts, router, c.num_shared_experts)


def _ernie4_5(c) -> dict[str, Any]:
    """ERNIE-4.5: fp32 softmax, `moe_statics.e_score_correction_bias` for selection only, top-k, the chosen
    scores divided by their sum clamped to `moe_norm_min`; `moe_num_shared_experts` ungated shared experts
    fused into one MLP (none where it is 0)."""
    router = dict(score_function="softmax", renormalize=True, renormalize_min=float(c.moe_norm_min),
                  expert_bias=True, expert_bias_update_rate=0.0)
    return _ungated_shared(c.moe_intermediate_size, c.num_experts, router, c.moe_num_shared_experts)


MIXTRAL = BlockSpec(_mixtral)
"""Mixtral's block; MiniMax's (`MiniMaxSparseMoeBlock`) is the same code."""
OLMOE = BlockSpec(_olmoe)
"""OLMoE's block; FlexOlmo's is the same code."""
QWEN2_MOE = BlockSpec(_qwen2, shared="shared_expert", shared_gate="shared_expert_gate")
"""Qwen2-MoE's block; Qwen3-Next's and Qwen4-Exp's text blocks are the same code."""
QWEN3_MOE = BlockSpec(_qwen3)
"""Qwen3-MoE's block; Qwen3-Omni-MoE's thinker text blocks and Mellum's are the same code."""
DEEPSEEK_V3 = BlockSpec(_deepseek_v3, shared="shared_experts", router_fp32=True)
"""DeepSeek-V3's block; GLM-4.5's (`Glm4MoeMoE`), dots.llm1's (`Dots1MoE`), DeepSeek-V3.2's, GLM-4-MoE-Lite's,
GLM-5's (`GlmMoeDsaMoE`), GLM-4.5V's text blocks and Solar Open's are the same code (Kimi-Linear's too, with
its own field names: `_kimi_linear`)."""

SPECS: dict[str, BlockSpec] = {
    "MixtralSparseMoeBlock": MIXTRAL,
    "MiniMaxSparseMoeBlock": MIXTRAL,
    "OlmoeSparseMoeBlock": OLMOE,
    "FlexOlmoSparseMoeBlock": OLMOE,
    "Qwen2MoeSparseMoeBlock": QWEN2_MOE,
    "Qwen3MoeSparseMoeBlock": QWEN3_MOE,
    "MellumSparseMoeBlock": QWEN3_MOE,
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": QWEN3_MOE,
    "Qwen3NextSparseMoeBlock": QWEN2_MOE,
    "Qwen4ExpTextSparseMoeBlock": QWEN2_MOE,
    "Qwen3_5MoeSparseMoeBlock": BlockSpec(_qwen3_5, shared="shared_expert", shared_gate="shared_expert_gate"),
    "Qwen3VLMoeTextSparseMoeBlock": BlockSpec(_qwen3_vl),
    "DeepseekV2Moe": BlockSpec(_deepseek_v2, shared="shared_experts", router_fp32=True),
    "DeepseekV3MoE": DEEPSEEK_V3,
    "Glm4MoeMoE": DEEPSEEK_V3,
    "Dots1MoE": DEEPSEEK_V3,
    "DeepseekV32MoE": DEEPSEEK_V3,
    "Glm4MoeLiteMoE": DEEPSEEK_V3,
    "GlmMoeDsaMoE": DEEPSEEK_V3,
    "SolarOpenMoE": DEEPSEEK_V3,
    "Glm4vMoeTextMoE": DEEPSEEK_V3,
    "KimiLinearMoE": BlockSpec(_kimi_linear, shared="shared_experts", router_fp32=True),
    "MiMoV2FlashMoE": BlockSpec(_mimo_v2_flash, router_fp32=True),
    "HunYuanMoEV1Moe": BlockSpec(_hunyuan_v1_moe, router="gate.wg", shared="shared_mlp"),
    "AfmoeSparseMoeBlock": BlockSpec(_afmoe, router="router.gate", shared="shared_experts",
                                     bias="expert_bias"),
    "MiniMaxM2SparseMoeBlock": BlockSpec(_minimax_m2, bias="e_score_correction_bias"),
    "Ernie4_5_MoeSparseMoeBlock": BlockSpec(_ernie4_5, shared="shared_experts", router_fp32=True,
                                            bias="gate.moe_statics.e_score_correction_bias", bias_lead=(1,)),
}
"""Supported block classes, by class name (the transformers classes are not imported here)."""


class RouterLogits(nn.Module):
    """Identity on the router logits `[T, E]`: the module `outputs.router_logits` is recorded from."""

    def forward(self, logits_te: torch.Tensor) -> torch.Tensor:
        return logits_te


class MoonEPBlock(nn.Module):
    """A transformers MoE block backed by `MoonEPMoELayer`: `forward(hidden_states [batch, seq, H])` ->
    `[batch, seq, H]`.

    Attributes:
        moe: the layer (`moe.router`, `moe.experts` (home experts), `moe.shared_experts`).
        router_logits: identity module fed the layer's logits every call (hooked for recording).
        spec: the block's `BlockSpec`; `hf_class`: the replaced class's name.
    """

    def __init__(self, layer: MoonEPMoELayer, spec: BlockSpec, hf_class: str):
        super().__init__()
        self.moe, self.spec, self.hf_class = layer, spec, hf_class
        self.router_logits = RouterLogits()
        layer.record_router_logits = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.moe(hidden_states)
        logits_te, self.moe.last_router_logits_te = self.moe.last_router_logits_te, None
        self.router_logits(logits_te)
        return out

    def hf_tensors(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """This block's tensors (or their `.grad`) under the replaced block's HF-local names, as views.

        `experts.gate_up_proj [epn, 2F, H]` and `experts.down_proj [epn, H, F]` are this rank's home experts
        (global ids `moe.experts.home_experts`), FP8 ones with their block scales (`..._scale_inv`);
        shared-expert `gate_proj`/`up_proj` are the two halves of the fused `gate_up [2 * width, H]` (width:
        the shared experts' FFN width). Buffers (`gate.e_score_correction_bias`) only when `grads` is False.
        """
        def get(p: torch.Tensor) -> torch.Tensor | None:
            return p.grad if grads else p

        moe = self.moe
        out = {f"{self.spec.router}.weight": get(moe.router.weight), EXPERT_KEYS[0]: get(moe.experts.gate_up),
               EXPERT_KEYS[1]: get(moe.experts.down)}
        if moe.experts.fp8:  # no gradients (forward only)
            out.update({key + SCALE_SUFFIX: get(getattr(moe.experts, kind + SCALE_SUFFIX))
                         for key, kind in zip(EXPERT_KEYS, ("gate_up", "down"), strict=True)})
        if not grads and moe.router.expert_bias is not None:
            out[self.spec.bias] = moe.router.expert_bias.view(*self.spec.bias_lead, -1)
        shared = moe.shared_experts
        if shared is not None:
            gate_up, width = get(shared.gate_up.weight), shared.down.weight.shape[1]
            out[f"{self.spec.shared}.gate_proj.weight"] = None if gate_up is None else gate_up[:width]
            out[f"{self.spec.shared}.up_proj.weight"] = None if gate_up is None else gate_up[width:]
            out[f"{self.spec.shared}.down_proj.weight"] = get(shared.down.weight)
            if shared.gate is not None:
                out[f"{self.spec.shared_gate}.weight"] = get(shared.gate.weight)
        return out


def _check_block(name: str, block: nn.Module, spec: BlockSpec) -> None:
    """Raise on what `MoonEPMoELayer` cannot reproduce exactly."""
    experts = block.experts
    layout = dict(has_bias=False, has_gate=True, is_transposed=False, is_concatenated=True,
                  has_post_expert_norm=False)
    for attr, expected in layout.items():
        if getattr(experts, attr, expected) != expected:
            raise ValueError(f"{name}.experts: {attr}={getattr(experts, attr)} is not supported; "
                             f"expected {expected}")
    params = {n for n, _ in experts.named_parameters()}
    expected = {"gate_up_proj", "down_proj"}
    if experts.gate_up_proj.dtype == FP8_DTYPE:
        expected |= {n + SCALE_SUFFIX for n in expected}
    if params != expected:
        raise ValueError(f"{name}.experts: parameters {sorted(params)} are not supported (expert bias "
                         f"terms?); expected exactly {sorted(expected)} (gate_up_proj [E, 2F, H], down_proj "
                         "[E, H, F])")
    for sub_name, sub in block.named_modules(prefix=name):
        scales = {n: p for n, p in sub.named_parameters(recurse=False) if n.endswith(SCALE_SUFFIX)}
        block_size = getattr(sub, "block_size", None)
        if scales and (block_size is None or tuple(block_size) != (BLOCK, BLOCK)):
            raise ValueError(f"{sub_name}: FP8 block_size={block_size} is not supported; expected "
                             f"({BLOCK}, {BLOCK}) (DeepSeek-V3's 128x128 blocks)")
        for scale_name, value in scales.items():
            check_finite_scales(value, f"{sub_name}.{scale_name}")
    act = getattr(experts.config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{name}: hidden_act={act!r} is not supported; expected 'silu' (SwiGLU experts)")
    router = block.get_submodule(spec.router)
    router_params = {n for n, _ in router.named_parameters()} - {spec.bias.removeprefix(f"{spec.router}.")}
    if router_params != {"weight"}:
        raise ValueError(f"{name}.{spec.router}: parameters {sorted(router_params)} are not supported; "
                         "expected only weight")
    for sub in (sub for sub in (spec.shared, spec.shared_gate) if sub and getattr(block, sub) is not None):
        # only weights are copied: refuse a bias
        extra = sorted(n for n, _ in block.get_submodule(sub).named_parameters()
                       if not n.endswith(("weight", "weight" + SCALE_SUFFIX)))
        if extra:
            raise ValueError(f"{name}.{sub}: parameters {extra} are not supported (shared-expert bias "
                             "terms?); expected weights only")


def _looks_like_moe(module: nn.Module) -> bool:
    return hasattr(module, "experts") and (hasattr(module, "gate") or hasattr(module, "router"))


def block_config(block: nn.Module, spec: BlockSpec, hf_config: Any, max_tokens_per_rank: int, ep_size: int,
                 overrides: dict[str, Any]) -> MoEConfig:
    """The `MoEConfig` of one block: HF config fields, the experts' dtype, then `overrides` (nested dicts
    merged into `router` / `shared_experts`)."""
    dtype = block.experts.gate_up_proj.dtype
    if dtype == FP8_DTYPE:  # masters of the dequantised weights, as DeepSeek-V3 computes them
        dtype = torch.bfloat16
    router_dtype = dtype_name(block.get_submodule(spec.router).weight.dtype)
    if spec.router_fp32 or dtype == torch.float16:  # no fp16 router: route in fp32 (HF routes in fp16)
        router_dtype = "float32"
    fields = dict(hidden_size=hf_config.hidden_size, top_k=hf_config.num_experts_per_tok, ep_size=ep_size,
                  max_tokens_per_rank=max_tokens_per_rank, dtype=dtype_name(dtype), grouped_gemm="auto",
                  **spec.fields(hf_config))
    fields["router"] = {**fields["router"], "dtype": router_dtype}
    for key, value in overrides.items():
        fields[key] = {**fields.get(key, {}), **value} if isinstance(value, dict) else value
    if fields["router"].get("aux_loss_coeff", 0.0):
        raise ValueError("router.aux_loss_coeff must stay 0 in a swapped block: the HF model computes its "
                         "own aux loss from the recorded router logits (output_router_logits=True)")
    return MoEConfig.model_validate(fields)


def _install_logits_hook(block: MoonEPBlock) -> None:
    """Record `block.router_logits`'s output as the model's `router_logits`, the way transformers records
    its router classes (the hook is inert unless the model was asked for router logits)."""
    from transformers.utils.output_capturing import install_output_capuring_hook

    install_output_capuring_hook(block.router_logits, "router_logits", 0)


@torch.no_grad()
def _copy_weights(block: nn.Module, target: MoonEPBlock) -> None:
    """Copy the HF block's tensors into `target`: its home experts (`HomeExperts.load_fused`: into masters,
    FP8 ones dequantised, or kept FP8 with `expert_weights="fp8"`), then the rest (FP8 ones dequantised). FP8
    weights are dequantised expert by expert, in bounded chunks (`copy_checkpoint_weight_`), never as one
    fp32 copy of a whole block's experts."""
    source = dict(block.state_dict())
    errors: list[str] = []
    target.moe.experts.load_fused(source, EXPERT_KEYS, errors)
    if errors:
        raise ValueError(f"{target.hf_class}.{errors[0]}")
    for name, view in target.hf_tensors().items():
        if name.startswith(EXPERT_KEYS):
            continue  # loaded above, scales too
        if name == target.spec.bias and name not in source:
            continue  # an expert bias the overrides added (router.expert_bias) starts at zero
        if name not in source:
            raise ValueError(f"{target.hf_class}: expected a tensor named {name!r}, found {sorted(source)}")
        if source[name].shape != view.shape:
            raise ValueError(f"{target.hf_class}.{name}: expected shape {list(view.shape)}, "
                             f"got {list(source[name].shape)}")
        try:
            copy_checkpoint_weight_(view, source, name)
        except ValueError as error:
            raise ValueError(f"{target.hf_class}.{error}") from None


def swap_moe_blocks(model: nn.Module, max_tokens_per_rank: int, world: EPWorld | None = None,
                    **config_overrides: Any) -> nn.Module:
    """Replace every MoE block of a transformers `model` in place with a `MoonEPBlock`; returns `model`.

    Args:
        model: a transformers model (any head) of a supported family (see the module docstring).
        max_tokens_per_rank: S, the most tokens (batch * sequence) one forward of a block carries on a rank.
        world: the EP world (its size is the EP size); default: a one-rank world on the model's device. With
            R ranks, call this on every rank, on that rank's own copy of the model.
        **config_overrides: `MoEConfig` fields applied after the ones read from the model, e.g.
            `token_padding=8`, `num_prefetch_slots=0`, `grouped_gemm="reference"`,
            `router={"expert_bias_update_rate": 1e-3}`; `expert_weights="fp8"` keeps FP8 experts FP8 (no
            bf16 master; inference only; the model's expert FFN size must be a multiple of 128).

    Raises (every block is checked before any is swapped, so `model` is left as it was):
        ValueError: no supported block found, an MoE-like block of an unsupported class, an unsupported
            feature (expert or shared-expert bias terms, non-SiLU experts, FP8 blocks other than 128x128,
            router jitter, DeepSeek-V2's group-limited greedy routing, an aux-loss override), an invalid
            config, or NaN or infinite FP8 block scales (naming the key).
    """
    device = next(model.parameters()).device
    world = world if world is not None else single_world(device)
    found = []
    for name, module in list(model.named_modules()):
        cls = type(module).__name__
        if cls in SPECS:
            found.append((name, module, SPECS[cls]))
        elif _looks_like_moe(module) and not isinstance(module, (MoonEPBlock, MoonEPMoELayer)):
            raise ValueError(f"{name}: MoE block class {cls} is not supported; supported: {', '.join(SPECS)}")
    if not found:
        raise ValueError(f"no supported MoE block in {type(model).__name__}; supported: {', '.join(SPECS)}")
    hf_config = model.config.get_text_config()  # a multimodal model's blocks read its text config
    configs = []
    for name, block, spec in found:  # every block checked before any is swapped
        _check_block(name, block, spec)
        configs.append(block_config(block, spec, hf_config, max_tokens_per_rank, world.size,
                                    config_overrides))
    for (name, block, spec), cfg in zip(found, configs, strict=True):
        swapped = MoonEPBlock(MoonEPMoELayer(cfg, world), spec, type(block).__name__)
        _copy_weights(block, swapped)
        _install_logits_hook(swapped)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, swapped)
    return model


def hf_state_dict(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor | None]:
    """A swapped model's tensors (or `.grad`s) under the original model's names.

    Everything outside the swapped blocks keeps its name; each `MoonEPBlock` contributes `hf_tensors`. The
    `EXPERT_KEYS` entries hold this rank's home experts `[epn, ...]`: `merge_expert_shards` joins the ranks'.
    """
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, MoonEPBlock)}
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        if not any(name.startswith(f"{b}.") for b in blocks):
            out[name] = p.grad if grads else p
    for prefix, block in blocks.items():
        out.update({f"{prefix}.{k}": v for k, v in block.hf_tensors(grads).items()})
    return out


def merge_expert_shards(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' `hf_state_dict`s (in rank order) -> their expert entries (FP8 ones' scales too)
    concatenated to `[E, ...]`."""
    keys = EXPERT_KEYS + tuple(key + SCALE_SUFFIX for key in EXPERT_KEYS)
    return {k: torch.cat([s[k] for s in states]) for k in states[0] if k.endswith(keys)}
