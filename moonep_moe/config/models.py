"""Typed configuration of one MoonEP MoE layer: pydantic models, validated once at construction.

The tree is ``MoEConfig`` -> ``RouterConfig`` (``router``) and ``SharedExpertConfig`` (``shared_experts``).
Every model forbids unknown keys and is frozen: a config that validated stays valid. To change a field, build
a new one (``load_config(name, field=value)`` or ``MoEConfig(**{**cfg.model_dump(), "field": value})``).

Notation (DESIGN.md): S = ``max_tokens_per_rank``, H = ``hidden_size``, H' = ``ffn_hidden_size``,
K = ``top_k``, E = ``num_experts``, R = ``ep_size``, epn = E // R, B = prefetch slots per rank,
tp = ``token_padding``, NvS = dispatched-row capacity per rank (``MoEConfig.rows_per_rank``).

Every error names the field and the expected value. Errors come out as ``pydantic.ValidationError``, a
``ValueError`` subclass. Values that YAML or Python would pass on silently are refused too: a bool for an
int (``ep_size: true`` is not 1) and a non-finite float (``aux_loss_coeff: .inf``), in every model
(`config.rules.CONFIG_RULES`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, StrictInt, field_validator, model_validator

from moonep_moe.base.sizes import BLOCK_TOKEN_PADDING, TOKEN_PADDING
from moonep_moe.config.comm import CommConfig
from moonep_moe.config.rules import CONFIG_RULES
from moonep_moe.fp8.format import WEIGHT_BYTES as FP8_WEIGHT_BYTES
from moonep_moe.gemm.registry import BACKENDS, GROUPED_GEMM_NAMES
from moonep_moe.transport.registry import WORLD_NAMES

__all__ = [
    "MoEConfig",
    "RouterConfig",
    "SharedExpertConfig",
]


class RouterConfig(BaseModel):
    """How tokens pick their K experts: scores, top-k selection, load-balancing terms."""

    model_config = CONFIG_RULES

    score_function: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description=(
            "Maps router logits to scores. Default 'softmax' (Mixtral, Qwen-MoE); 'sigmoid' for DeepSeek-V3 "
            "and Kimi-K2 (HF `scoring_func`). With 'sigmoid' keep `renormalize=True`, since sigmoid scores "
            "of the K chosen experts do not sum to 1."
        ),
    )
    renormalize: bool = Field(
        True,
        description=(
            "Divide the K selected scores by their sum, so each token's route weights sum to 1 before "
            "`routed_scaling_factor` (HF `norm_topk_prob`). Default True; recommended for every packaged "
            "model."
        ),
    )
    renormalize_min: float | None = Field(
        None,
        ge=0.0,
        description=(
            "The renormalisation's denominator. Default None: `sum + 1e-20` for sigmoid scores "
            "(DeepSeek-V3's), and for softmax the plain sum where it is a normal float (else the scores stay "
            "unnormalised, about 0, rather than 0 / 0). A number m: `max(sum, m)` for either score function "
            "(ERNIE-4.5's `moe_norm_min`; 0.0 is the plain sum, MiniMax-M2's, NaN where every chosen score "
            "is 0). Only with `renormalize` True."
        ),
    )
    n_group: StrictInt = Field(
        1,
        ge=1,
        description=(
            "Group-limited routing (DeepSeek-V3): the E experts form `n_group` equal groups, a token first "
            "keeps its best `topk_group` groups, then picks top-k inside them. Default 1 disables it. Must "
            "divide num_experts; DeepSeek-V3 uses 8 (one group per node)."
        ),
    )
    topk_group: StrictInt = Field(
        1,
        ge=1,
        description=(
            "Groups kept per token when n_group > 1 (DeepSeek-V3: 4). Must satisfy "
            "1 <= topk_group <= n_group, and top_k <= topk_group * (num_experts // n_group). Ignored when "
            "n_group == 1."
        ),
    )
    routed_scaling_factor: float = Field(
        1.0,
        ge=0.0,
        description=(
            "Multiplies every route weight after (optional) renormalisation. Default 1.0; DeepSeek-V3 2.5, "
            "Kimi-K2 2.827 (HF `routed_scaling_factor`)."
        ),
    )
    expert_bias: bool = Field(
        False,
        description=(
            "Aux-loss-free load balancing (DeepSeek-V3 `e_score_correction_bias`): a per-expert bias added "
            "to the scores for *selection only*; route weights use the unbiased scores. The bias is a "
            "buffer, updated outside the gradient by `expert_bias_update_rate`. Default False."
        ),
    )
    expert_bias_update_rate: float = Field(
        1e-3,
        ge=0.0,
        description=(
            "Step size of the expert-bias update (raise the bias of under-loaded experts, lower it for "
            "over-loaded ones). Default 1e-3 (DeepSeek-V3's gamma). Only used when `expert_bias` is True; 0 "
            "freezes the bias (inference, or a loaded checkpoint's bias)."
        ),
    )
    aux_loss_coeff: float = Field(
        0.0,
        ge=0.0,
        description=(
            "Weight of the switch-style load-balancing aux loss (E * sum_e f_e * P_e). Default 0.0 disables "
            "it. Typical values 1e-3 to 1e-2; with `expert_bias` True a small value (or 0) is usual. "
            "Balance across ranks does not need it: the planner already balances them exactly."
        ),
    )
    dtype: Literal["float32", "float64", "bfloat16"] = Field(
        "float32",
        description=(
            "Compute dtype of the router GEMM and scores. Default 'float32' (recommended: top-k ties and "
            "small score gaps are sensitive to bf16 rounding); 'float64' for reference tests."
        ),
    )

    bf16x3: bool = Field(
        True,
        description=(
            "On CUDA, run a float32 router over bfloat16 hidden states on bf16 tensor cores with fp32 "
            "accumulation: the fp32 weight and gradients split exactly into three bf16 terms each (a bf16 "
            "product is exact in fp32). Default True: 1.3-1.9x faster than fp32 GEMMs on an H200, to fp32 "
            "accuracy up to the tensor cores' accumulation (bench.router records both against a float64 "
            "product). "
            "False: plain fp32 GEMMs (cuBLAS; TF32 if the user enabled it). Ignored on CPU and for other "
            "dtypes."
        ),
    )

    @model_validator(mode="after")
    def _check_groups(self) -> RouterConfig:
        if self.topk_group > self.n_group:
            raise ValueError(
                f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group}); expected "
                f"1 <= topk_group <= n_group"
            )
        if self.renormalize_min is not None and not self.renormalize:
            raise ValueError(
                f"renormalize_min ({self.renormalize_min}) is set but renormalize is False; expected "
                "renormalize_min None, or renormalize True"
            )
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        """The router compute dtype as a ``torch.dtype``."""
        return getattr(torch, self.dtype)


class SharedExpertConfig(BaseModel):
    """Always-on experts that every token passes through, beside the K routed ones (not dispatched)."""

    model_config = CONFIG_RULES

    num_shared_experts: StrictInt = Field(
        0,
        ge=0,
        description=(
            "Number of shared experts. Default 0 (none: Mixtral, Qwen3-MoE); DeepSeek-V3 and Kimi-K2 use 1 "
            "(HF `n_shared_experts`). They are fused into one dense SwiGLU MLP of width "
            "num_shared_experts * ffn_hidden_size, computed locally on every rank."
        ),
    )
    ffn_hidden_size: StrictInt | None = Field(
        None,
        ge=1,
        description=(
            "Intermediate size of ONE shared expert. Default None means the routed experts' "
            "`ffn_hidden_size` (DeepSeek-V3, Kimi-K2: 2048). The shared MLP width is "
            "num_shared_experts * ffn_hidden_size."
        ),
    )
    gate: bool = Field(
        False,
        description=(
            "Qwen2-MoE style gate: multiply the shared output by sigmoid(Linear(H, 1)(x)). Default False "
            "(DeepSeek-V3 and Kimi-K2 have no shared gate)."
        ),
    )




class MoEConfig(CommConfig):
    """One MoE layer and its expert-parallel group: the comm fields (`CommConfig`, flat in YAML), the expert
    FFN size, router, shared experts, gradient mode and backends."""

    ffn_hidden_size: StrictInt = Field(
        ...,
        ge=1,
        description=(
            "H': intermediate size of one routed expert (HF `moe_intermediate_size`, Mixtral "
            "`intermediate_size`). Required. A multiple of 128 keeps grouped GEMMs on their fast path."
        ),
    )
    ep_size: StrictInt = Field(
        1,
        ge=1,
        description=(
            "R: ranks in the EP group. Default 1 (no expert parallelism). Each rank owns "
            "epn = num_experts // ep_size home experts."
        ),
    )
    token_padding: StrictInt = Field(
        None,
        ge=1,
        validate_default=False,
        description=(
            "tp: every non-empty expert segment is padded with zero rows to a multiple of this. Default: 128 "
            "with grouped_gemm='deep_gemm' or precision='fp8' (their M-block; they need a multiple of 128), "
            "and with 'auto' where a home expert expects at least 256 rows (max_tokens_per_rank * top_k / "
            "home experts: padding then adds at most ~25%), so DeepGEMM's bf16 GEMMs can run (on the H200 "
            "one EP=8 rank of DeepSeek-V3 and Kimi-K2, ~2048 and ~1365 rows an expert, steps 2-5% faster "
            "than 'auto' at 16: bench/results/layer-*-ep8-rank-*-5c27820.json; DeepSeek-V3 and Qwen3-MoE "
            "at EP=1, 256 and 512 rows, 3-4% faster: bench/results/layer-*-tp128-*-3ae8da3.json); else 16, "
            "the alignment torch._grouped_mm and the Triton wgrad take (Kimi-K2 at EP=1, ~171 rows an "
            "expert: 128 made the step 8% slower). Serving that decodes a few tokens a step at a large "
            "max_tokens_per_rank sets 16: each filled group is padded to tp rows. Smaller values (e.g. 8) "
            "waste less memory in CPU tests and demos."
        ),
    )
    expert_grad_dtype: Literal["param", "main_grad"] = Field(
        "param",
        description=(
            "How the routed experts' weight gradients are kept. Default 'param' (recommended, the fast one): "
            "the weight-gradient GEMMs accumulate in fp32 and write each home expert's gradient in the "
            "parameters' dtype (bf16 grads for bf16 weights), as plain PyTorch does; replicas' gradients are "
            "added in fp32 and rounded; autograd receives them as `.grad` (later micro-batches' GEMMs add "
            "into the existing `.grad`). 'main_grad' (Megatron style, for fp32 accumulation across "
            "micro-batches): each home-expert parameter (`experts.gate_up`, "
            "`experts.down`) carries a persistent `main_grad` in fp32 (float64 for float64 weights), "
            "allocated zero on first use on the parameter's device (or one you attach beforehand, e.g. a "
            "view of a contiguous grad buffer); the weight-gradient GEMMs add straight into it and the "
            "replicas' gradients are reduced into it (no zeroing pass, no cast), and `param.grad` stays None "
            "(so hooks on those parameters' grads do not fire). Zero it yourself between optimizer steps: "
            "`layer.zero_main_grad()` (or `p.main_grad.zero_()`). An optimizer must read `main_grad`, as "
            "Megatron's do (they step fp32 main params from it); with a plain torch optimizer set "
            "`p.grad = p.main_grad.to(p.dtype)` before `step()`. Router and shared experts keep ordinary "
            "`.grad` in both modes. The former 'float32' (fp32 copy of the home gradients, then a cast: "
            "1.37x the time and +40 GiB on the DeepSeek-V3 layer) was removed: use 'param' or 'main_grad'."
        ),
    )
    router: RouterConfig = Field(
        default_factory=RouterConfig,
        description="Router options (scores, renormalisation, group-limited routing, balancing terms).",
    )
    shared_experts: SharedExpertConfig = Field(
        default_factory=SharedExpertConfig,
        description="Shared (always-on) experts. Default: none.",
    )
    overlap_shared_experts: bool = Field(
        True,
        description=(
            "Run the shared experts on a side CUDA stream while the routed experts (planning, dispatch, "
            "prefetch, grouped GEMMs, combine) run on the current one, joined before the sum; autograd runs "
            "their backward on the same streams, so backward overlaps too. Default True (recommended). "
            "Outputs and gradients are bit-identical either way. No effect without shared experts or off "
            "CUDA (one stream). Under torch.compile the overlapped shared experts run eagerly with the "
            "routed experts (one graph break, as without overlap); set False to keep them in the compiled "
            "graph, after the routed experts."
        ),
    )
    overlap_prefetch: bool = Field(
        False,
        description=(
            "Prefetch the replicas' weights on the comm stream while the home experts' groups of the first "
            "GEMM (gate_up forward, down's dgrad in backward) run, then wait on the device and compute the "
            "slot groups (a Triton GEMM that starts at a row known only on the device; the torch and "
            "deep_gemm backends). Takes the replicas' link time off the step where the home GEMM outlasts "
            "it. Default False: whether it pays depends on the slot groups' Triton GEMM against the "
            "backend's; it made the step faster or left it within its spread on H100s and is not yet "
            "measured on the H200 with the aligned slot kernel (docs/gpu.md). Bit-identical to prefetching "
            "on the caller's stream before the same split GEMM."
        ),
    )
    overlap_reduce_grad: bool = Field(
        False,
        description=(
            "Run reduce_grad (each replica's weight gradient added into its home expert's) on the comm "
            "stream behind the rest of the backward pass (the layers before this one) instead of before "
            "this layer's backward returns: the next routed operation on the EP group, and the end of the "
            "backward pass, wait for it on the device. Gradients bit-identical either way. Where autograd "
            "would read the gradients during the backward pass (a hook on the expert weights, a .grad it "
            "adds into, create_graph) the layer reduces before returning, as without it; hooks on the "
            "weights' gradient accumulators cannot be seen, so leave it off where one reads the expert "
            "gradients during backward (e.g. Megatron-Core's overlapped gradient reduce on them); that is "
            "why it is off by default. No effect off CUDA or without trainable expert weights."
        ),
    )
    share_buffer: bool = Field(
        True,
        description=(
            "Layers of the same shape on one world share one Buffer (dispatched rows, route weights, "
            "duplicate pairs), as they share the prefetch-slot pools: a model pays its `[NvS, H]` rows once, "
            "not per layer (0.89 GiB per DeepSeek-V3 layer at S=8192, EP=8). Correct for any schedule that "
            "runs one layer's MoE step at a time (each forward and each backward of the routed experts "
            "starts with its own dispatch; activation recomputation and pipeline schedules included). "
            "Default True. False gives the layer a Buffer of its own: for schedules that run two layers' "
            "routed steps at once, e.g. on two streams."
        ),
    )
    grouped_gemm: Literal[GROUPED_GEMM_NAMES] = Field(
        "auto",
        description=(
            "Grouped-GEMM backend. Default 'auto': on CUDA every backend that can run is timed once per "
            "primitive and shape (cached in process and in ~/.cache/moonep-moe/gemm.json, $MOONEP_MOE_CACHE) "
            "and the fastest runs; elsewhere torch where it supports the dtype, else the reference. "
            "'torch' = torch._grouped_mm, 'reference' = a plain loop over segments (any device and dtype), "
            "'deep_gemm' = DeepGEMM fwd/dgrad on sm90 (needs the [gpu] extra and dtype 'bfloat16'), "
            "'triton' = the package's Triton weight-gradient kernel (fp32 accumulation straight into the "
            "gradients) with torch fwd/dgrad."
        ),
    )
    precision: Literal["bf16", "fp8"] = Field(
        "bf16",
        description=(
            "Routed experts' GEMM precision. Default 'bf16'. 'fp8' (DeepSeek-V3 recipe, training): bf16 "
            "master weights and gradients as with 'bf16'; fwd and dgrad run on FP8 grouped GEMMs (DeepGEMM's "
            "on sm90 where it is installed, else the package's Triton kernel, half DeepGEMM's speed) with "
            "e4m3 activations (1x128 tiles) and weights (128x128 blocks), cast by fused kernels (the home "
            "weights once per version, so once per optimizer step under gradient accumulation); wgrad "
            "stays bf16 on the `grouped_gemm` backend unless `fp8_wgrad`. Needs "
            "dtype='bfloat16', token_padding a multiple of 128 (the default with 'fp8') and a CUDA GPU with "
            "FP8 tensor cores (sm89 or newer; tested on sm90) (`moonep_moe.gemm.fp8`)."
        ),
    )
    fp8_dispatch: bool = Field(
        False,
        description=(
            "With precision='fp8': quantise each token once, before dispatch (e4m3 with 1x128 fp32 scales, "
            "the [S, H] tokens instead of the [NvS, H] rows), and dispatch the FP8 rows with their scales "
            "(about half of bf16's bytes on the wire), which the forward GEMM takes as they arrive: "
            "DeepSeek-V3's recipe. The output and every gradient but gate_up's weight gradient are the same "
            "bits as without it (the same rows, quantised the same way); backward keeps the FP8 rows instead "
            "of a bf16 copy (half that activation memory) and gate_up's wgrad multiplies them dequantised, "
            "exactly the values the forward multiplied, where it multiplies the bf16 rows without it. "
            "Default False: on one H200 at EP=1 it ran 0.98x plain fp8's step time, and its wire saving "
            "across GPUs is not yet measured. Where no backward reads the dispatched rows (inference; one "
            "rank without slots, which gathers the bf16 rows again) an fp8 layer dispatches FP8 rows "
            "whatever this says: the same bits, read in place. Needs precision='fp8'."
        ),
    )
    fp8_wgrad: bool = Field(
        False,
        description=(
            "With precision='fp8': the experts' weight gradients as FP8 GEMMs too (DeepGEMM's sm90 k-grouped "
            "FP8 kernel, fp32 accumulation promoted every 128 rows): dy and x are cast per column per 128 "
            "rows of their segment (e4m3, power-of-two fp32 scales), added into the fp32 gradients "
            "(`main_grad`, the slot gradients). Each operand's e4m3 rounding (2^-4 of a value) enters the "
            "gradient, as in DeepSeek-V3's FP8 training. It pays where each expert has many rows: on one "
            "H200, at one DeepSeek-V3 EP=8 rank (about 2048 rows an expert) it was the fastest FP8 step, "
            "at EP=1 (256 rows an expert, where the fp32 gradient traffic outweighs the GEMM) slower than "
            "bf16 wgrad. Default False (bf16 wgrad). Needs precision='fp8', expert_grad_dtype='main_grad' "
            "(into bf16 `param` gradients the kernel's fp32 sums need a temporary each way, which made the "
            "step slower than bf16 wgrad) and DeepGEMM on an sm90 GPU."
        ),
    )
    expert_weights: Literal["bf16", "fp8"] = Field(
        "bf16",
        description=(
            "How the routed experts' weights are stored. Default 'bf16': masters in `dtype` (parameters, "
            "trainable). 'fp8' (inference with FP8 checkpoints): no master at all; each home expert is "
            "e4m3 values with fp32 128x128 block scales (buffers `experts.gate_up` / "
            "`experts.gate_up_scale_inv`, `experts.down` / `experts.down_scale_inv`; `state_dict()` in "
            "DeepSeek-V3's per-expert format), loaded from DeepSeek-V3's per-expert or transformers' fused "
            "FP8 checkpoints as stored (unquantised ones are quantised on load); prefetch moves e4m3 bytes "
            "and scales; the GEMMs take them as they are: the FP8 grouped GEMMs ('auto' / 'deep_gemm': "
            "DeepGEMM's on sm90 where installed, else the Triton kernel; CUDA sm89 or newer) or, with "
            "grouped_gemm='reference', the weights dequantised exactly and multiplied in fp32 on any device. "
            "Needs precision='fp8' (the default with 'fp8'), dtype='bfloat16' and "
            "ffn_hidden_size a multiple of 128 (gate and up are one [2F, H] FP8 matrix whose blocks must not "
            "straddle them). Not trainable: a forward with grad enabled whose input or router requires "
            "grad raises; run under torch.no_grad() or torch.inference_mode()."
        ),
    )
    allow_non_finite_weights: bool = Field(
        False,
        description=(
            "Whether loading a checkpoint (`load_state_dict`, the transformers swap, the torchtitan adapter) "
            "accepts routed-expert weights that hold NaN or Inf. Default False (recommended): such a weight "
            "is a load error naming the key, the expert and the rank (one NaN expert makes every token "
            "routed to it NaN, and its replicas carry the NaN to other ranks). True loads them as stored, "
            "e.g. to inspect a diverged run. The check reads each loaded home-expert projection once (one "
            "host sync each, at load only); the router and shared experts are loaded as torch loads them."
        ),
    )
    world: Literal[WORLD_NAMES] = Field(
        WORLD_NAMES[0],
        description=(
            "EP transport (`transport.registry.WORLDS`). Default 'threads' (R ranks as threads in one "
            "process: tests, one-device simulation). 'symmetric' = torch symmetric memory inside one NVLink "
            "domain (production); 'collective' = torch.distributed all-to-all over NCCL or gloo (multi-node, "
            "CPU)."
        ),
    )

    @field_validator("expert_grad_dtype", mode="before")
    @classmethod
    def _removed_grad_mode(cls, value: Any) -> Any:
        if value == "float32":
            raise ValueError("expert_grad_dtype='float32' was removed: use 'param' (the default: gradients "
                             "in the parameters' dtype, fp32 accumulation inside the GEMM) or 'main_grad' "
                             "(fp32 `main_grad` accumulated across micro-batches)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_token_padding(cls, data: Any) -> Any:
        return with_derived_defaults(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check_routing_and_backend(self) -> MoEConfig:
        e, k = self.num_experts, self.top_k
        n_group, topk_group = self.router.n_group, self.router.topk_group
        if e % n_group != 0:
            raise ValueError(f"router.n_group ({n_group}) must divide num_experts (E={e})")
        if n_group > 1 and k > topk_group * (e // n_group):
            raise ValueError(
                f"top_k (K={k}) must be <= router.topk_group * (num_experts // router.n_group) "
                f"= {topk_group} * {e // n_group} = {topk_group * (e // n_group)}"
            )
        if self.grouped_gemm == "deep_gemm" and self.dtype != "bfloat16":
            raise ValueError(f"grouped_gemm='deep_gemm' needs dtype='bfloat16', got dtype={self.dtype!r}")
        if self.precision == "fp8" and (self.dtype != "bfloat16" or self.token_padding % BLOCK_TOKEN_PADDING):
            raise ValueError(f"precision='fp8' needs dtype='bfloat16' and token_padding a multiple of 128, "
                             f"got dtype={self.dtype!r}, token_padding={self.token_padding}")
        if self.fp8_dispatch and self.precision != "fp8":
            raise ValueError(f"fp8_dispatch=True needs precision='fp8', got precision={self.precision!r}")
        if self.fp8_wgrad and (self.precision != "fp8" or self.expert_weights == "fp8"
                               or self.expert_grad_dtype != "main_grad"):
            raise ValueError(f"fp8_wgrad=True needs precision='fp8', trainable experts "
                             f"(expert_weights='bf16') and expert_grad_dtype='main_grad' (fp32 gradients it "
                             f"adds into), got "
                             f"precision={self.precision!r}, expert_weights={self.expert_weights!r}, "
                             f"expert_grad_dtype={self.expert_grad_dtype!r}")
        if self.expert_weights == "fp8":
            self._check_fp8_weights()
        return self

    def _check_fp8_weights(self) -> None:
        """`expert_weights='fp8'`: FP8 GEMMs, on a backend that takes FP8 weights, over whole 128-row blocks
        of gate and of up."""
        if self.precision != "fp8":
            raise ValueError(f"expert_weights='fp8' needs precision='fp8' (its default), got "
                             f"precision={self.precision!r}")
        if self.ffn_hidden_size % 128:
            raise ValueError(f"expert_weights='fp8' needs ffn_hidden_size a multiple of 128 (gate's and up's "
                             f"128x128 blocks of one [2F, H] matrix), got {self.ffn_hidden_size}")
        if self.grouped_gemm not in ("auto", "deep_gemm", "reference"):
            raise ValueError(f"expert_weights='fp8' runs on grouped_gemm 'auto' or 'deep_gemm' (the FP8 "
                             f"GEMMs) or 'reference' (any device), got {self.grouped_gemm!r}")

    @property
    def expert_weight_bytes(self) -> float:
        """Bytes an element of an expert's weights takes when prefetch moves it: ``dtype``'s itemsize, or
        with ``expert_weights='fp8'`` one e4m3 byte plus its share of its block's fp32 scale."""
        return FP8_WEIGHT_BYTES if self.expert_weights == "fp8" else super().expert_weight_bytes

    @property
    def shared_width(self) -> int:
        """The shared MLP's width: ``num_shared_experts`` times their ``ffn_hidden_size`` (the routed
        experts' where unset); 0 without shared experts."""
        shared = self.shared_experts
        return shared.num_shared_experts * (shared.ffn_hidden_size or self.ffn_hidden_size)

    @property
    def replica_grad_dtype(self) -> torch.dtype:
        """The dtype of the replicas' weight gradients, as backward keeps them and `reduce_grad` moves them:
        the parameters' with ``expert_grad_dtype='param'`` (written over their slot weights), at least fp32
        with 'main_grad' (a pool of their own, which the GEMMs add into)."""
        if self.expert_grad_dtype == "param":
            return self.torch_dtype
        return torch.promote_types(self.torch_dtype, torch.float32)

    @property
    def comm(self) -> CommConfig:
        """The comm part of this layer's config (E, K, R, B, S, H, tp, dtype), for the Buffer and
        `MoECommunicator`."""
        return CommConfig(**self.model_dump(include=set(CommConfig.model_fields)))


def dtype_name(dtype: torch.dtype) -> str:
    """The name a config's `dtype` fields take for `dtype` (`torch.bfloat16` -> "bfloat16"): the inverse of
    their `torch_dtype`."""
    return str(dtype).removeprefix("torch.")


def with_derived_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """`MoEConfig` fields (a partial set, as a YAML `moe:` section gives them) with the defaults that depend
    on other fields filled in: `precision` left out is 'fp8' with `expert_weights='fp8'`; `token_padding`
    left out is `default_token_padding`'s. Pure functions of the config, so every rank resolves the same;
    what `MoEConfig` applies before validating."""
    if fields.get("expert_weights") == "fp8" and fields.get("precision") is None:
        fields = {**fields, "precision": "fp8"}
    if fields.get("token_padding") is None:
        fields = {**fields, "token_padding": default_token_padding(fields)}
    return fields


BLOCK_PADDING_ROWS = 256
"""Rows a home expert expects (``max_tokens_per_rank * top_k / epn``) from which ``grouped_gemm='auto'`` pads
segments to whole 128-row blocks: the padding then adds about a quarter of the rows or less (half a block per
segment on average), and DeepGEMM's bf16 GEMMs, which need the blocks, become candidates (measured faster on
the H200 from 256 rows an expert, slower at 171)."""


def default_token_padding(fields: dict[str, Any]) -> int:
    """tp for `MoEConfig` fields that leave it out: `BLOCK_TOKEN_PADDING` where the backend or FP8 needs whole
    128-row blocks, or with 'auto' where a home expert expects `BLOCK_PADDING_ROWS` rows or more; else
    `TOKEN_PADDING`. Fields not (yet) valid count as their defaults or as few rows; validation reports
    them."""
    name = fields.get("grouped_gemm", "auto")
    backend = BACKENDS.get(name) if isinstance(name, str) else None
    if fields.get("precision") == "fp8" or (backend is not None and backend.token_padding > TOKEN_PADDING):
        return BLOCK_TOKEN_PADDING
    sizes = [fields.get(field, default) for field, default in
             (("max_tokens_per_rank", 0), ("top_k", 0), ("num_experts", 0), ("ep_size", 1))]
    if name != "auto" or not all(type(size) is int and size > 0 for size in sizes):
        return TOKEN_PADDING
    tokens, k, experts, ranks = sizes
    epn = max(experts // ranks, 1)
    return BLOCK_TOKEN_PADDING if tokens * k // epn >= BLOCK_PADDING_ROWS else TOKEN_PADDING
