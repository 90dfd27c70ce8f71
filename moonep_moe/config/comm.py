"""`CommConfig`: the comm core's fields of one layer shape (what the planner, the `Buffer` and
`MoECommunicator` need), the base of `MoEConfig`. Notation: DESIGN.md, and `config.models`' docstring."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, Field, StrictInt, model_validator

from moonep_moe.base.sizes import TOKEN_PADDING, check_layout, default_slots, rows_capacity
from moonep_moe.config.rules import CONFIG_RULES
from moonep_moe.plan.policies import BALANCE_NAMES, BALANCE_POLICIES


class CommConfig(BaseModel):
    """The comm core's fields of one layer shape: what the planner, the `Buffer` and `MoECommunicator` need.

    Defined once: `MoEConfig` extends it (its YAML keys are these fields, flat) and `MoEConfig.comm` is its
    comm part; `moonep_moe.engine.communicator.CommunicatorConfig` extends it with the facade's options. The
    layout checks (E % R, K <= E, B in [0, E - E/R]) are `base.sizes.check_layout`, the one check every
    caller runs.
    """

    model_config = CONFIG_RULES

    hidden_size: StrictInt = Field(
        ...,
        ge=1,
        description="H: model hidden size (HF `hidden_size`). Required.",
    )
    num_experts: StrictInt = Field(
        ...,
        ge=1,
        description=(
            "E: routed experts in the EP group (HF `n_routed_experts` / `num_experts` / "
            "`num_local_experts`). Required; must be divisible by ep_size."
        ),
    )
    top_k: StrictInt = Field(
        ...,
        ge=1,
        description=(
            "K: routed experts per token (HF `num_experts_per_tok`). Required; 1 <= top_k <= num_experts."
        ),
    )
    ep_size: StrictInt | None = Field(
        None,
        ge=1,
        description=(
            "R: ranks in the EP group; each rank owns epn = num_experts // ep_size home experts. None: the "
            "world's size, where a world is given (`MoECommunicator`); `MoEConfig` defaults it to 1."
        ),
    )
    num_prefetch_slots: StrictInt | None = Field(
        None,
        ge=0,
        description=(
            "B: expert slots per rank that receive prefetched replicas of hot remote experts. Default None "
            "resolves to epn (= num_experts // ep_size) when ep_size > 1, else 0. Training needs B >= epn "
            "for exact balance (a rank hosts replicas from at most one remote home group); B < epn "
            "(inference, to save memory) gives best-effort balance and a larger `rows_per_rank`. "
            "Must be in [0, num_experts - epn]."
        ),
    )
    token_padding: StrictInt = Field(
        TOKEN_PADDING,
        ge=1,
        description=(
            "tp: every non-empty expert segment is padded with zero rows to a multiple of this. Default 16, "
            "the layer's (`MoEConfig` picks 16, or 128 with DeepGEMM): the alignment torch._grouped_mm and "
            "the Triton kernels take. Engines whose grouped GEMM needs Hopper's 128-row M-block "
            "(DeepGEMM's contiguous layout) pass 128; a GEMM that masks partial blocks can take 1. Serving "
            "pays for it per step: a decode step of s tokens fills up to s*K groups, each padded to tp rows "
            "that are zeroed and run through the GEMMs (with E=256, K=8 and tp=128 a 128-token step carries "
            "~250 groups of 128 rows, mostly padding)."
        ),
    )
    max_tokens_per_rank: StrictInt = Field(
        ...,
        ge=1,
        description=(
            "S: token capacity per rank per step; a step may carry fewer valid tokens. Required. Fixes every "
            "buffer shape (static shapes, no host sync), so peak memory grows with it."
        ),
    )
    dtype: Literal["bfloat16", "float16", "float32", "float64"] = Field(
        "bfloat16",
        description=(
            "Dtype of activations and expert weights. Default 'bfloat16' (production; required by DeepGEMM). "
            "'float32' for the CPU demo, 'float64' for reference tests."
        ),
    )
    balance: Literal[BALANCE_NAMES] = Field(
        BALANCE_NAMES[0],
        description=(
            "Replication policy of the planner (`plan.policies`). Default 'exact' (training): with B >= epn "
            "every rank computes T // R or T // R + 1 routes for any routing, replicating hot experts "
            "however few routes they take. 'cost_aware' (serving): an expert is replicated only where it "
            "takes more routes off its donor than the GEMM time of one weight transfer is worth "
            "(`replica_cost`, from `link_bandwidth_gbs` and `gemm_tflops`), and the plan falls back to "
            "plain EP unless the modelled hottest rank gets faster; decode-sized steps then move no "
            "weights. 'off': plain EP, no replica (every route on its home rank). 'cost_aware' and 'off' "
            "are best effort, so `rows_per_rank` covers the B < epn worst case (R*S*K routes)."
        ),
    )
    link_bandwidth_gbs: float = Field(
        450.0,
        gt=0,
        description=(
            "Cost model of balance='cost_aware': GB/s one rank's link moves in one direction (a replica's "
            "weights in, or a donor's replicas out). Default 450: H200 NVLink's 900 GB/s bidirectional spec "
            "(a spec number, not measured here). Unused by 'exact' and 'off'."
        ),
    )
    gemm_tflops: float = Field(
        775.8,
        gt=0,
        description=(
            "Cost model of balance='cost_aware': the expert GEMMs' rate in TFLOP/s. Default 775.8: the dense "
            "bf16 GEMM rate measured on the H200 (bench/results/gemm-NVIDIA_H200-20261129.json, `limits`); "
            "the grouped GEMMs reached 537 there. A higher rate makes routes cheaper, so fewer replicas pay. "
            "Unused by 'exact' and 'off'."
        ),
    )

    @model_validator(mode="after")
    def _check_comm_layout(self) -> CommConfig:
        # without an EP size (the world's, known later) only K <= E can be checked here
        if self.ep_size is None:
            check_layout(self.num_experts, 1, self.top_k, None)
        else:
            check_layout(self.num_experts, self.ep_size, self.top_k, self.num_prefetch_slots)
        return self

    def _ranks(self) -> int:
        if self.ep_size is None:
            raise ValueError("ep_size is None (the world's size): set it to derive per-rank sizes")
        return self.ep_size

    @property
    def experts_per_rank(self) -> int:
        """epn = E // R: home experts stored on each rank."""
        return self.num_experts // self._ranks()

    @property
    def prefetch_slots(self) -> int:
        """B, resolved: ``num_prefetch_slots``, or when None, epn if ``ep_size`` > 1 else 0."""
        if self.num_prefetch_slots is not None:
            return self.num_prefetch_slots
        return default_slots(self.num_experts, self._ranks())

    @property
    def expert_weight_bytes(self) -> float:
        """Bytes an element of an expert's weights takes when prefetch moves it: ``dtype``'s itemsize."""
        return self.torch_dtype.itemsize

    @property
    def replica_cost(self) -> int:
        """The planner's `replica_cost` for ``balance`` (`plan.policies`): 0 for 'exact', `NO_REPLICATION`
        for 'off', and for 'cost_aware' the GEMM routes whose (forward) time equals one expert's weight
        transfer of `expert_weight_bytes` per element, `replica_cost_routes` (1724 for bf16 at the
        defaults, 863 for FP8 experts)."""
        policy = BALANCE_POLICIES[self.balance]
        return policy.replica_cost(self.expert_weight_bytes, self.link_bandwidth_gbs * 1e9,
                                   self.gemm_tflops * 1e12)

    @property
    def routes_per_rank(self) -> int:
        """N = S * K: routes that leave one rank per step (at most; invalid routes are not sent)."""
        return self.max_tokens_per_rank * self.top_k

    @property
    def rows_per_rank(self) -> int:
        """NvS: dispatched-row capacity per rank, the first dimension of ``hidden_nvsh``.

        A rank has at most epn + B non-empty segments (its home experts and its slots), each padded by
        fewer than tp rows, so the capacity is ``align_up(routes + (tp - 1) * (epn + B), tp)``, where
        ``routes`` is the most routes the planner can put on one rank:

        - B >= epn and ``balance='exact'``: the balance invariant holds for any routing, so a rank computes
          at most S*K routes.
        - B < epn, or another ``balance``: balance is best effort. In the worst case every rank sends all
          its S*K routes to this rank's home experts and no replica absorbs them, so the bound is R*S*K.
          Static shapes must cover that worst case, because sizing for the typical case would make a
          skewed step overflow.
          (With R = 1, B = 0 < epn and the bound is S*K, as expected.)
        """
        return rows_capacity(self.max_tokens_per_rank, self.top_k, self._ranks(), self.num_experts,
                             self.prefetch_slots, self.token_padding, self.replica_cost)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype`` (activations and expert weights)."""
        return getattr(torch, self.dtype)
