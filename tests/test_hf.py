"""Swapped Hugging Face models against the originals: logits, loss (with the router aux loss where the model
adds it) and every gradient, in float32 and bfloat16, at EP=1 and at EP=4 on the threads world.

At EP=4 every rank holds a full copy of the non-expert model and runs its own batch: each rank's logits,
loss and non-expert gradients must match the original model on that batch, and the expert gradients
(merged over the ranks' home experts) the original's summed over the four batches.
Tiny random models (2 layers, H=32, E=8, K=2), built locally: nothing is downloaded.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moonep_moe.integrations.hf import (  # noqa: E402
    EXPERT_KEYS,
    MoonEPBlock,
    hf_state_dict,
    merge_expert_shards,
    swap_moe_blocks,
)
from moonep_moe.transport.threads import run_ranks  # noqa: E402

VOCAB, BATCH, SEQ = 64, 2, 12
TOKENS = BATCH * SEQ
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=True)
DEEPSEEK_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
DEEPSEEK_V3_MOE = dict(moe_intermediate_size=16, intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
                       n_group=4, topk_group=2, routed_scaling_factor=2.5)
DSA_HEADS = dict(num_key_value_heads=4)  # DeepSeek sparse attention: as many key/value heads as query heads
DSA_INDEXER = dict(index_head_dim=8, index_n_heads=2, index_topk=16)  # index_topk >= SEQ: every key kept
NO_SPECIAL_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # defaults outside VOCAB


def qwen3_next(**fields) -> torch.nn.Module:
    """Qwen3-Next with full attention in every layer. Its linear-attention layers' `dt_bias` gradient sums
    terms that nearly cancel: at these sizes its own fp32 rounding reaches 3e-4 of its largest value (against
    float64), too ill-conditioned for a 1e-5 parity bound. The MoE block does not depend on the attention."""
    config = COMMON | fields
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **config, moe_intermediate_size=16, intermediate_size=48, shared_expert_intermediate_size=24,
        num_experts=8, norm_topk_prob=True, head_dim=8,
        layer_types=["full_attention"] * config["num_hidden_layers"]))


def qwen3_vl_moe(**fields) -> torch.nn.Module:
    """Qwen3-VL-MoE on text-only batches (a one-block vision tower, which gets no gradient)."""
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], mrope_interleaved=True)
    text = dict(**(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, num_experts=8,
                head_dim=8, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                  deepstack_visual_indexes=[])
    return transformers.Qwen3VLMoeForConditionalGeneration(
        transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision))


def glm4v_moe(**fields) -> torch.nn.Module:
    """GLM-4.5V on text-only batches (a one-block vision tower, which gets no gradient)."""
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], partial_rotary_factor=1.0)
    text = dict(**(COMMON | fields), **DEEPSEEK_V3_MOE, first_k_dense_replace=0, head_dim=8,
                rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    return transformers.Glm4vMoeForConditionalGeneration(
        transformers.Glm4vMoeConfig(text_config=text, vision_config=vision))


def qwen3_omni_moe(**fields) -> torch.nn.Module:
    """Qwen3-Omni-MoE's thinker on text-only batches (one-layer vision and audio towers, which get no
    gradient)."""
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], mrope_interleaved=True)
    text = dict(**(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, num_experts=8,
                head_dim=8, norm_topk_prob=True, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                  deepstack_visual_indexes=[])
    audio = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, d_model=16,
                 output_dim=32, downsample_hidden_size=8)
    return transformers.Qwen3OmniMoeThinkerForConditionalGeneration(transformers.Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio))


def qwen3_5_moe(**fields) -> torch.nn.Module:
    """Qwen3.5-MoE's text model with full attention in every layer (as `qwen3_next`)."""
    config = COMMON | fields
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
        **config, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8, head_dim=8,
        layer_types=["full_attention"] * config["num_hidden_layers"]))


def qwen4_exp(**fields) -> torch.nn.Module:
    """Qwen4-Exp's text model with indexed attention in every layer, its indexer's budget (16 keys, 4 blocks
    of 4) covering all of SEQ, so every key is kept."""
    config = COMMON | fields
    indexer = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16,
                   indexer_compress_ratio=4)
    return transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(
        **config, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8, head_dim=8,
        norm_topk_prob=True, layer_types=["indexed_attention"] * config["num_hidden_layers"], **indexer))


def all_sparse(fields) -> list[str]:
    """`mlp_layer_types` with an MoE block in every layer."""
    return ["sparse"] * (COMMON | fields)["num_hidden_layers"]


MODELS = {  # each takes further config fields (ones it does not set)
    "mixtral": lambda **fields: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **(COMMON | fields), intermediate_size=16, num_local_experts=8)),
    "qwen2_moe": lambda **fields: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48,
        shared_expert_intermediate_size=24, num_experts=8, norm_topk_prob=False)),
    "qwen3_moe": lambda **fields: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, num_experts=8,
        norm_topk_prob=True, head_dim=8)),
    "deepseek_v3": lambda **fields: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=0,
        **DEEPSEEK_MLA)),
    "olmoe": lambda **fields: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **(COMMON | fields), intermediate_size=16, num_experts=8, norm_topk_prob=False)),
    "qwen3_next": qwen3_next,
    "qwen3_vl_moe": qwen3_vl_moe,
    "deepseek_v2": lambda **fields: transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, n_routed_experts=8,
        n_shared_experts=2, routed_scaling_factor=2.5, first_k_dense_replace=0, **DEEPSEEK_MLA)),
    "glm4_moe": lambda **fields: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=0,
        head_dim=8)),
    "dots1": lambda **fields: transformers.Dots1ForCausalLM(transformers.Dots1Config(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, n_routed_experts=8,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0,
        head_dim=8)),
    "minimax_m2": lambda **fields: transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(
        **(COMMON | fields), intermediate_size=16, num_local_experts=8, head_dim=8, bos_token_id=None,
        eos_token_id=None)),
    "ernie4_5_moe": lambda **fields: transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, moe_num_experts=8,
        moe_num_shared_experts=2, moe_layer_start_index=0, head_dim=8)),
    "minimax": lambda **fields: transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        **(COMMON | fields), intermediate_size=16, num_local_experts=8, head_dim=8,
        layer_types=["full_attention"] * (COMMON | fields)["num_hidden_layers"])),
    "flex_olmo": lambda **fields: transformers.FlexOlmoForCausalLM(transformers.FlexOlmoConfig(
        **(COMMON | fields), intermediate_size=16, num_experts=8, norm_topk_prob=False, **NO_SPECIAL_TOKENS)),
    "mellum": lambda **fields: transformers.MellumForCausalLM(transformers.MellumConfig(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, num_local_experts=8,
        norm_topk_prob=True, head_dim=8)),
    "qwen3_5_moe": qwen3_5_moe,
    "qwen4_exp": qwen4_exp,
    "deepseek_v32": lambda **fields: transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(
        **(COMMON | DSA_HEADS | fields), **DEEPSEEK_V3_MOE, first_k_dense_replace=0, **DSA_INDEXER,
        **DEEPSEEK_MLA)),
    "glm_moe_dsa": lambda **fields: transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(
        **(COMMON | DSA_HEADS | fields), **DEEPSEEK_V3_MOE, first_k_dense_replace=0, **DSA_INDEXER,
        **DEEPSEEK_MLA)),
    "glm4_moe_lite": lambda **fields: transformers.Glm4MoeLiteForCausalLM(transformers.Glm4MoeLiteConfig(
        **(COMMON | fields), **DEEPSEEK_V3_MOE, mlp_layer_types=all_sparse(fields), **DEEPSEEK_MLA)),
    "solar_open": lambda **fields: transformers.SolarOpenForCausalLM(transformers.SolarOpenConfig(
        **(COMMON | fields), **DEEPSEEK_V3_MOE, head_dim=8)),
    "kimi_linear": lambda **fields: transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, num_experts=8,
        num_shared_experts=1, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5,
        mlp_layer_types=all_sparse(fields), layer_types=["full_attention"] * len(all_sparse(fields)),
        **NO_SPECIAL_TOKENS, **DEEPSEEK_MLA)),
    "hunyuan_v1_moe": lambda **fields: transformers.HunYuanMoEV1ForCausalLM(transformers.HunYuanMoEV1Config(
        **(COMMON | fields), intermediate_size=16, num_experts=8, moe_topk=2, head_dim=8)),
    "afmoe": lambda **fields: transformers.AfmoeForCausalLM(transformers.AfmoeConfig(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, num_experts=8,
        num_shared_experts=1, route_scale=2.5, num_dense_layers=0, head_dim=8)),
    "glm4v_moe": glm4v_moe,
    "qwen3_omni_moe": qwen3_omni_moe,
    "mimo_v2_flash": lambda **fields: transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(
        **(COMMON | fields), moe_intermediate_size=16, intermediate_size=48, n_routed_experts=8, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, mlp_layer_types=all_sparse(fields), head_dim=8)),
}
# Worst |got - want| over max |want|, per tensor. bf16 runs both models in bf16: the two only differ in
# summation order and where route weights are rounded, so the bound is a few bf16 ulps of the largest value.
# That rounding can flip a top-k near-tie (two scores within a bf16 ulp) in a layer whose input it changed,
# after which a token's gradient lands on another expert: a legitimate bf16 outcome, not a parity error. The
# first MoE layer's router reads inputs both models compute alike, so bf16 checks at EP=4 run one layer; a
# new seed that fails in bf16 only should be checked for a flipped route first.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_model(name: str, dtype: torch.dtype, seed: int, **fields) -> torch.nn.Module:
    """A tiny random model (with further config `fields`); a selection bias (`e_score_correction_bias`:
    DeepSeek-V3 and the families sharing its block, MiniMax-M2, ERNIE-4.5; AFMoE's `expert_bias`) gets random
    values so it shifts selection."""
    torch.manual_seed(seed)
    model = MODELS[name](**fields)
    with torch.no_grad():
        for module in model.modules():
            for attr in ("e_score_correction_bias", "expert_bias"):
                bias = getattr(module, attr, None)
                if isinstance(bias, torch.Tensor):
                    bias.normal_(0, 0.05)
    return model.to(dtype)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30))


def step(model: torch.nn.Module, ids: torch.Tensor, grads_of=None) -> dict[str, torch.Tensor]:
    """Forward + backward on `ids [B, L]` (labels = ids): logits, loss and the gradients by name
    (`grads_of(model)`, default the model's own parameters), but for parameters the loss does not reach (a
    vision tower on a text-only batch), which have none in either model."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = grads_of(model) if grads_of else {n: p.grad for n, p in model.named_parameters()}
    result = {f"grad:{n}": g.detach().clone() for n, g in grads.items() if g is not None}
    return {**result, "logits": out.logits.detach(), "loss": out.loss.detach()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float, what: str) -> float:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    worst = 0.0
    for name, w in want.items():
        err = rel_err(got[name], w)
        assert err <= tol, f"{what}: {name} differs, relative error {err:.2e} > {tol:.0e}"
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_swapped_model_matches_original_ep1(name, dtype):
    original = make_model(name, dtype, seed=0)
    swapped = swap_moe_blocks(copy.deepcopy(original), TOKENS, token_padding=8)
    blocks = [m for m in swapped.modules() if isinstance(m, MoonEPBlock)]
    assert len(blocks) == 2
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    want = step(original, ids)
    got = step(swapped, ids, lambda m: hf_state_dict(m, grads=True))
    assert_close(got, want, TOL[dtype], f"{name} {dtype} EP=1")
    # router logits where the model returns them (transformers versions differ per model)
    expected = getattr(original(input_ids=ids, output_router_logits=True), "router_logits", None)
    routed = getattr(swapped(input_ids=ids, output_router_logits=True), "router_logits", None)
    assert (routed is None) == (expected is None)
    if expected is not None:
        assert len(routed) == 2 and routed[0].shape == (TOKENS, 8)
        torch.testing.assert_close(routed[0].float(), expected[0].float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_state_dict_gives_back_the_original_tensors(name):
    """`hf_state_dict` of a freshly swapped model (EP=1) holds the original's parameters and its selection
    bias (`e_score_correction_bias`, wherever the family keeps it and whatever its shape), under the original
    names, equal bit for bit, so `load_state_dict` of the original takes it."""
    original = make_model(name, torch.float32, seed=0)
    swapped = swap_moe_blocks(copy.deepcopy(original), TOKENS, token_padding=8)
    got = hf_state_dict(swapped)
    want = {**dict(original.named_parameters()),
            **{n: b for n, b in original.named_buffers() if n.endswith("e_score_correction_bias")}}
    assert set(got) == set(want), f"names differ: {sorted(set(got) ^ set(want))}"
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), f"{key} differs"
    original.load_state_dict({k: v.detach().clone() for k, v in got.items()}, strict=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_swapped_model_matches_original_ep4(name, dtype):
    """bf16 runs one layer: a second MoE layer's router reads the first layer's output, whose rounding
    legitimately differs (the swap sums each token's routes in fp32, the original in bf16), and bf16 router
    scores of 8 experts tie often at these sizes (on the CI machine, 14 of seeds 0-19 give Qwen3's second
    layer an exact tie at the top-k boundary, seed 6 included), so a flipped route would fail a parity check
    for no parity error. One layer's router reads the same attention output in both models; fp32 runs both
    layers."""
    R = 4
    original = make_model(name, dtype, seed=6, num_hidden_layers=1 if dtype == torch.bfloat16 else 2)
    gen = torch.Generator().manual_seed(106)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(R)]
    want = [step(original, ids) for ids in batches]
    copies = [copy.deepcopy(original) for _ in range(R)]

    def rank_fn(world):
        model = swap_moe_blocks(copies[world.rank], TOKENS, world, token_padding=8)
        return step(model, batches[world.rank], lambda m: hf_state_dict(m, grads=True))

    got = run_ranks(rank_fn, R)
    expert_want = {k: sum(w[k] for w in want) for k in want[0] if k.endswith(EXPERT_KEYS)}
    expert_got = merge_expert_shards(got)
    assert_close(expert_got, expert_want, TOL[dtype], f"{name} {dtype} EP=4 experts")
    for rank in range(R):
        rest = {k: v for k, v in got[rank].items() if k not in expert_got}
        rest_want = {k: v for k, v in want[rank].items() if k not in expert_want}
        assert_close(rest, rest_want, TOL[dtype], f"{name} {dtype} EP=4 rank {rank}")


def test_deepseek_v3_without_top_k_renormalisation():
    """`norm_topk_prob: false` (route weights are the raw sigmoid scores times `routed_scaling_factor`; the
    tests above build the default, true): the swapped model must match the original, gradients included."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    original = make_model("deepseek_v3", torch.float32, seed=3, norm_topk_prob=False)
    want = step(original, ids)
    normalised = make_model("deepseek_v3", torch.float32, seed=3, norm_topk_prob=True)
    assert rel_err(step(normalised, ids)["logits"], want["logits"]) > 1e-3, "the flag must change the model"
    swapped = swap_moe_blocks(copy.deepcopy(original), TOKENS, token_padding=8)
    got = step(swapped, ids, lambda m: hf_state_dict(m, grads=True))
    assert_close(got, want, TOL[torch.float32], "deepseek_v3 norm_topk_prob=False EP=1")


def test_ernie_moe_norm_min_where_it_binds():
    """ERNIE-4.5 divides the chosen scores by their sum clamped to `moe_norm_min` (default 1e-12, which
    never binds on these models): at 0.4, above some tokens' top-2 softmax sums and below others', the swapped
    model must still match the original, gradients included."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    original = make_model("ernie4_5_moe", torch.float32, seed=3, moe_norm_min=0.4)
    want = step(original, ids)
    default = make_model("ernie4_5_moe", torch.float32, seed=3)
    assert rel_err(step(default, ids)["logits"], want["logits"]) > 1e-3, "the clamp must change the model"
    swapped = swap_moe_blocks(copy.deepcopy(original), TOKENS, token_padding=8)
    blocks = [m for m in swapped.modules() if isinstance(m, MoonEPBlock)]
    assert [block.moe.router.config.renormalize_min for block in blocks] == [0.4, 0.4]
    got = step(swapped, ids, lambda m: hf_state_dict(m, grads=True))
    assert_close(got, want, TOL[torch.float32], "ernie4_5_moe moe_norm_min=0.4 EP=1")


def test_unsupported_blocks_fail_with_a_message():
    model = make_model("qwen3_moe", torch.float32, seed=0)
    bias = torch.nn.Parameter(torch.zeros(8, 32))
    model.model.layers[0].mlp.experts.register_parameter("down_proj_bias", bias)
    with pytest.raises(ValueError, match="expert bias"):
        swap_moe_blocks(model, TOKENS)
    with pytest.raises(ValueError, match="no supported MoE block"):
        swap_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)), TOKENS)
    with pytest.raises(ValueError, match="aux_loss_coeff"):
        swap_moe_blocks(make_model("mixtral", torch.float32, seed=0), TOKENS, router={"aux_loss_coeff": 0.01})
    with pytest.raises(ValueError, match="shared-expert bias"):
        swap_moe_blocks(make_model("deepseek_v2", torch.float32, seed=0, mlp_bias=True), TOKENS)
    grouped = make_model("deepseek_v2", torch.float32, seed=0, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2)
    with pytest.raises(ValueError, match="group_limited_greedy"):
        swap_moe_blocks(grouped, TOKENS)
