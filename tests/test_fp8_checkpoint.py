"""DeepSeek-V3-format FP8 expert checkpoints loaded into the layer (`load_state_dict`) and swapped from a
transformers model whose MoE blocks carry FP8 experts.

The format: each expert projection's `weight` is e4m3 and its `weight_scale_inv` fp32 holds one scale per
128x128 block, tail blocks included; the value meant is `weight.float() * weight_scale_inv` per block, in
fp32. transformers' fused experts (`experts.gate_up_proj` + `experts.gate_up_proj_scale_inv`) stack gate's
and up's scales the way they stack the weights, so with F % 128 != 0 the fused scales have
`2 * ceil(F/128)` rows, not `ceil(2F/128)`. H = 160 and F = 192 below give every projection a tail block in
both dimensions and make the two readings of the fused scales differ (4 rows against 3).

The expected values are computed here block by block (`blockwise_product`), not by the package.
"""

from __future__ import annotations

import math

import pytest
import torch

from moonep_moe.comm.world import run_ranks
from moonep_moe.config import MoEConfig
from moonep_moe.layers.fp8 import E4M3_MAX, FP8_DTYPE, quantise_blocks
from moonep_moe.layers.moe import MoonEPMoELayer

E, H, F, K = 4, 160, 192, 2
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
PROJECTIONS = {"gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}


def layer_config(R: int, dtype: str) -> MoEConfig:
    return MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, ep_size=R,
                     max_tokens_per_rank=8, token_padding=4, dtype=dtype, router={"dtype": "float32"},
                     grouped_gemm="reference")


def blockwise_product(q_nk: torch.Tensor, scales_nk: torch.Tensor) -> torch.Tensor:
    """`q.float() * scale` for every 128x128 block (tail blocks included), block by block, in fp32."""
    out = torch.empty(q_nk.shape, dtype=torch.float32)
    for i in range(scales_nk.shape[0]):
        for j in range(scales_nk.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = q_nk[rows, cols].float() * scales_nk[i, j]
    return out


def deepseek_quantise(w_nk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's own weight cast, by hand: per 128x128 block `scale = amax / 448` (not a power of two,
    so the fp32 product rounds), `q = e4m3(w / scale)`. Returns `(q [N, K] e4m3, scales fp32)`."""
    n, k = w_nk.shape
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    scales = torch.empty(math.ceil(n / 128), math.ceil(k / 128), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w_nk[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float()
            scales[i, j] = block.abs().amax() / E4M3_MAX
            q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = (block / scales[i, j]).to(FP8_DTYPE)
    return q, scales


QUANTISERS = {"pow2": lambda w: tuple(t[0] for t in quantise_blocks(w[None])),  # the project's reference
              "amax/448": deepseek_quantise}


def fp8_experts(seed: int, quantiser: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random experts quantised blockwise, per projection: `{"{e}.{proj}": (q e4m3, scales fp32)}`."""
    gen = torch.Generator().manual_seed(seed)
    return {f"{e}.{proj}": QUANTISERS[quantiser](torch.randn(shape, generator=gen) * 0.05)
            for e in range(E) for proj, shape in PROJECTIONS.items()}


def router_weight() -> torch.Tensor:
    return torch.randn(E, H, generator=torch.Generator().manual_seed(99))


def per_expert_checkpoint(experts) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's released layout: `experts.{e}.{proj}.weight` e4m3 + `.weight_scale_inv` fp32."""
    out = {"router.weight": router_weight()}
    for name, (q, scales) in experts.items():
        out[f"experts.{name}.weight"], out[f"experts.{name}.weight_scale_inv"] = q, scales
    return out


def fused_checkpoint(experts) -> dict[str, torch.Tensor]:
    """transformers' FP8 experts: `gate_up_proj [E, 2F, H]` e4m3 (gate rows first) with gate's and up's
    scales stacked the same way `[E, 2 * ceil(F/128), ceil(H/128)]`; `down_proj` with its own."""
    def stacked(projs, i):
        return torch.stack([torch.cat([experts[f"{e}.{p}"][i] for p in projs]) for e in range(E)])

    return {"router.weight": router_weight(),
            "experts.gate_up_proj": stacked(("gate_proj", "up_proj"), 0),
            "experts.gate_up_proj_scale_inv": stacked(("gate_proj", "up_proj"), 1),
            "experts.down_proj": stacked(("down_proj",), 0),
            "experts.down_proj_scale_inv": stacked(("down_proj",), 1)}


def dequantised_checkpoint(experts, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same experts as a plain checkpoint in `dtype`: each block's fp32 product, rounded to `dtype`."""
    out = {"router.weight": router_weight()}
    for name, (q, scales) in experts.items():
        out[f"experts.{name}.weight"] = blockwise_product(q, scales).to(dtype)
    return out


def loaded(R: int, dtype: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` loaded strictly into an R-rank group of `dtype` layers; every rank's `state_dict()` merged."""

    def rank_fn(world):
        layer = MoonEPMoELayer(layer_config(R, dtype), world)
        layer.load_state_dict(state)
        return layer.state_dict()

    return {k: v for shard in run_ranks(rank_fn, R) for k, v in shard.items()}


@pytest.mark.parametrize("quantiser", list(QUANTISERS))
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fp8_checkpoint_loads_as_its_dequantised_values(dtype, R, layout, quantiser):
    """Loaded strictly at EP=R, an FP8 checkpoint gives the same model as its dequantised fp32 checkpoint
    (for power-of-two scales that is also the dequantised bf16 checkpoint: every product is exact);
    `state_dict()` stays the layer's per-expert masters in the layer's dtype, with no scales."""
    experts = fp8_experts(seed=1, quantiser=quantiser)
    fp8 = (per_expert_checkpoint if layout == "per_expert" else fused_checkpoint)(experts)
    got = loaded(R, dtype, fp8)
    want = loaded(R, dtype, dequantised_checkpoint(experts, torch.float32))
    assert got.keys() == want.keys() and not any("scale" in k for k in got)
    for key, value in want.items():
        assert key.startswith("router.") or value.dtype == got[key].dtype == DTYPES[dtype]
        assert torch.equal(got[key], value), f"{key} differs from its dequantised value"
    if quantiser == "pow2":
        exact = loaded(R, dtype, dequantised_checkpoint(experts, torch.bfloat16))
        assert all(torch.equal(got[k], v) for k, v in exact.items())


def test_fp8_checkpoint_loads_in_strict_mode_with_no_unexpected_or_missing_keys():
    layer = MoonEPMoELayer(layer_config(1, "bfloat16"))
    result = layer.load_state_dict(per_expert_checkpoint(fp8_experts(seed=2, quantiser="pow2")), strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == []


def load_errors(state: dict[str, torch.Tensor]) -> str:
    """The message `load_state_dict(state, strict=False)` raises (bad values are errors even then)."""
    layer = MoonEPMoELayer(layer_config(1, "float32"))
    with pytest.raises(RuntimeError) as error:
        layer.load_state_dict(state, strict=False)
    return str(error.value)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_fp8_weight_without_its_scales_is_an_error_naming_the_key(layout):
    experts = fp8_experts(seed=3, quantiser="pow2")
    if layout == "per_expert":
        state, weight = per_expert_checkpoint(experts), "experts.2.up_proj.weight"
    else:
        state, weight = fused_checkpoint(experts), "experts.down_proj"
    del state[f"{weight}_scale_inv"]
    message = load_errors(state)
    assert f"{weight}: a float8_e4m3fn weight needs its block scales {weight}_scale_inv" in message


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_fp8_scales_of_the_wrong_shape_or_dtype_are_an_error_naming_the_key(layout):
    experts = fp8_experts(seed=4, quantiser="pow2")
    if layout == "per_expert":
        state, expected = per_expert_checkpoint(experts), [2, 2]
        scales = "experts.1.down_proj.weight_scale_inv"
    else:  # gate's and up's scales stacked: 2 * ceil(192/128) rows, not ceil(384/128)
        state, scales, expected = fused_checkpoint(experts), "experts.gate_up_proj_scale_inv", [4, 4, 2]
    state[scales] = state[scales][..., :1, :]
    message = load_errors(state)
    assert f"{scales}: expected float32 {expected}" in message
    state[scales] = torch.ones(expected, dtype=torch.bfloat16)
    assert f"{scales}: expected float32 {expected}" in load_errors(state)


def test_fp8_scales_without_their_fp8_weight_are_an_error_naming_the_key():
    experts = fp8_experts(seed=5, quantiser="pow2")
    orphan = {**per_expert_checkpoint(experts), "experts.gate_up_proj_scale_inv": torch.ones(E, 4, 2)}
    assert "experts.gate_up_proj_scale_inv: block scales without their weight experts.gate_up_proj" in \
        load_errors(orphan)
    state = per_expert_checkpoint(experts)
    state["experts.0.gate_proj.weight"] = state["experts.0.gate_proj.weight"].float()
    assert ("experts.0.gate_proj.weight_scale_inv: block scales beside a float32 weight; scales belong to "
            "float8_e4m3fn weights") in load_errors(state)
