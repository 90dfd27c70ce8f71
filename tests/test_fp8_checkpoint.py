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

import copy
import math

import pytest
import torch

from moonep_moe.config import MoEConfig
from moonep_moe.fp8.format import E4M3_MAX, FP8_DTYPE, quantise_blocks
from moonep_moe.integrations.hf import MoonEPBlock, hf_state_dict, swap_moe_blocks
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks

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


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_non_finite_fp8_scales_are_an_error_naming_the_key(layout, value):
    """A NaN or infinite block scale would load as NaN or infinite weights (and NaN outputs): a load error,
    as misshapen scales are."""
    experts = fp8_experts(seed=6, quantiser="pow2")
    if layout == "per_expert":
        state, scales = per_expert_checkpoint(experts), "experts.3.gate_proj.weight_scale_inv"
    else:
        state, scales = fused_checkpoint(experts), "experts.down_proj_scale_inv"
    state[scales] = state[scales].clone()
    state[scales].view(-1)[-1] = value
    message = load_errors(state)
    assert f"{scales}: 1 of {state[scales].numel()} block scales are NaN or infinite" in message


def test_fp8_scales_without_their_fp8_weight_are_an_error_naming_the_key():
    experts = fp8_experts(seed=5, quantiser="pow2")
    orphan = {**per_expert_checkpoint(experts), "experts.gate_up_proj_scale_inv": torch.ones(E, 4, 2)}
    assert "experts.gate_up_proj_scale_inv: block scales without their weight experts.gate_up_proj" in \
        load_errors(orphan)
    state = per_expert_checkpoint(experts)
    state["experts.0.gate_proj.weight"] = state["experts.0.gate_proj.weight"].float()
    assert ("experts.0.gate_proj.weight_scale_inv: block scales beside a float32 weight; scales belong to "
            "float8_e4m3fn weights") in load_errors(state)


# -- the transformers swap (skipped without transformers) -------------------------------------------------

VOCAB, BATCH, SEQ = 64, 2, 12
HF_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # as tests/test_hf.py: a few ulps of the largest value


def deepseek_v3(dtype: torch.dtype, ffn: int = 16) -> torch.nn.Module:
    """A tiny random DeepSeek-V3 (2 MoE layers, H=32, E=8, K=2, F=`ffn`) with a random expert bias."""
    transformers = pytest.importorskip("transformers")
    with torch.random.fork_rng():  # seeded here, and later tests draw what they drew without this one
        torch.manual_seed(0)
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2, moe_intermediate_size=ffn, intermediate_size=48,
            n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8))
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.normal_(0, 0.05)
    return model.to(dtype)


def quantise_stacked(w: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q, scales, dequantised)` of `w [..., N, K]` as transformers stores it: each of its `parts` stacked
    projections of N/parts rows (gate's and up's in a fused gate_up) quantised with the project's reference
    cast, their scales stacked the same way; `dequantised` the blockwise fp32 products, in `w`'s shape."""
    w_gnk = w.reshape(-1, *w.shape[-2:])
    qs, scales, products = [], [], []
    for part_gnk in w_gnk.chunk(parts, 1):
        q_gnk, scales_gnk = quantise_blocks(part_gnk)
        qs.append(q_gnk)
        scales.append(scales_gnk)
        pairs = zip(q_gnk, scales_gnk, strict=True)
        products.append(torch.stack([blockwise_product(q, s) for q, s in pairs]))
    scales_gnk = torch.cat(scales, 1)
    return (torch.cat(qs, 1).reshape(w.shape), scales_gnk.reshape(*w.shape[:-2], *scales_gnk.shape[1:]),
            torch.cat(products, 1).reshape(w.shape))


def quantised_deepseek_v3(dtype: torch.dtype, block_size=(128, 128), ffn: int = 16
                          ) -> tuple[torch.nn.Module, ...]:
    """`(reference, fp8)`: `fp8` is the tiny model with its MoE blocks' experts and shared experts turned
    into transformers' own FP8 modules (`replace_with_fp8_linear`: `FP8Experts` with `gate_up_proj_scale_inv
    [E, 2, 1]` (gate's and up's stacked) and `down_proj_scale_inv`, `FP8Linear`s with `weight_scale_inv`),
    holding the reference's weights quantised; `reference` holds their dequantised values (exact in `dtype`:
    power-of-two scales)."""
    reference = deepseek_v3(dtype, ffn)
    transformers = pytest.importorskip("transformers")
    fp8_integration = pytest.importorskip("transformers.integrations.finegrained_fp8")
    fp8 = copy.deepcopy(reference)
    config = transformers.FineGrainedFP8Config(weight_block_size=block_size,
                                               modules_to_not_convert=[r".*self_attn", "lm_head"])
    fp8_integration.replace_with_fp8_linear(fp8, config.modules_to_not_convert, config)
    converted = [n for n, m in fp8.named_modules() if type(m).__name__.startswith("FP8")]
    assert len(converted) == 8 and all(".mlp." in n for n in converted)  # the MoE blocks only
    for ref_layer, layer in zip(reference.model.layers, fp8.model.layers, strict=True):
        ref_mlp, mlp = ref_layer.mlp, layer.mlp
        pairs = [(ref_mlp.experts, mlp.experts, "gate_up_proj", 2),
                 (ref_mlp.experts, mlp.experts, "down_proj", 1)]
        pairs += [(getattr(ref_mlp.shared_experts, n), getattr(mlp.shared_experts, n), "weight", 1)
                  for n in ("gate_proj", "up_proj", "down_proj")]
        for ref_module, module, name, parts in pairs:
            q, scales, dequantised = quantise_stacked(getattr(ref_module, name).detach(), parts)
            assert scales.shape == getattr(module, f"{name}_scale_inv").shape  # transformers' own layout
            setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, f"{name}_scale_inv", torch.nn.Parameter(scales, requires_grad=False))
            with torch.no_grad():
                getattr(ref_module, name).copy_(dequantised)
            assert torch.equal(getattr(ref_module, name).float(), dequantised)
    return reference, fp8


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swapped_fp8_deepseek_v3_matches_the_original_on_its_dequantised_weights(dtype):
    """FP8 experts and shared experts swap in as dequantised masters (bf16 by default; `dtype=` overrides):
    every tensor equals the dequantised original's, and logits and loss match the original computed from
    the dequantised weights."""
    reference, fp8 = quantised_deepseek_v3(dtype)
    overrides = {} if dtype == torch.bfloat16 else {"dtype": "float32"}
    swapped = swap_moe_blocks(fp8, BATCH * SEQ, token_padding=8, **overrides)
    blocks = [m for m in swapped.modules() if isinstance(m, MoonEPBlock)]
    assert len(blocks) == 2 and all(b.moe.experts.gate_up.dtype == dtype for b in blocks)
    for ref_layer, block in zip(reference.model.layers, blocks, strict=True):
        want = ref_layer.mlp.state_dict()
        for name, value in block.hf_tensors().items():
            assert torch.equal(value, want[name].to(value.dtype)), name
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = reference(input_ids=ids, labels=ids), swapped(input_ids=ids, labels=ids)
    assert rel_err(got.logits, want.logits) <= HF_TOL[dtype]
    assert rel_err(got.loss, want.loss) <= HF_TOL[dtype]


@pytest.mark.parametrize("name", ["experts.gate_up_proj_scale_inv",
                                  "shared_experts.up_proj.weight_scale_inv"])
def test_non_finite_fp8_scales_fail_at_the_swap_naming_the_key(name):
    """Refused before any block is swapped: the first layer's block, which is fine, stays as it was."""
    _, fp8 = quantised_deepseek_v3(torch.bfloat16)
    with torch.no_grad():
        fp8.model.layers[1].mlp.get_parameter(name).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=rf"^model\.layers\.1\.mlp\.{name}: 1 of \d+ block scales are NaN "
                                         "or infinite"):
        swap_moe_blocks(fp8, BATCH * SEQ, token_padding=8)
    assert not any(isinstance(m, MoonEPBlock) for m in fp8.modules())


def test_swap_dequantises_fp8_weights_in_bounded_chunks(monkeypatch):
    """The swap never widens a whole FP8 weight to fp32 at once (DeepSeek-V3: one layer's experts, or even
    one expert's gate_up, 117 MB in fp32): every dequantisation it asks for is at most
    `DEQUANTISE_CHUNK_BYTES` of fp32 values (here 32 KiB: gate_up's parts [512, 32] go in row bands, down
    [32, 512] in column bands), and the masters are the same bits as dequantising each whole tensor."""
    import moonep_moe.fp8.checkpoint as checkpoint
    from moonep_moe.fp8.format import dequantise_blocks

    _, fp8 = quantised_deepseek_v3(torch.bfloat16, ffn=512)
    whole = {}  # the whole-tensor dequantisation of every FP8 tensor, rounded to the bf16 masters
    for name, module in fp8.named_modules():
        for weight_name, weight in module.named_parameters(recurse=False):
            if weight.dtype == FP8_DTYPE:
                parts = 2 if weight_name == "gate_up_proj" else 1
                scales = getattr(module, f"{weight_name}_scale_inv")
                whole[f"{name}.{weight_name}"] = dequantise_blocks(weight, scales, torch.float32,
                                                                   parts).bfloat16()
    sizes = []

    def recording(q, scales, dtype=torch.float64, parts=1):
        sizes.append(q.numel() * dtype.itemsize)  # the bytes of the fp32 tensor it is asked to make
        return dequantise_blocks(q, scales, dtype, parts)

    monkeypatch.setattr(checkpoint, "DEQUANTISE_CHUNK_BYTES", 32 * 1024)
    monkeypatch.setattr(checkpoint, "dequantise_blocks", recording)
    swapped = swap_moe_blocks(fp8, BATCH * SEQ, token_padding=8)
    assert sizes and max(sizes) <= 32 * 1024, f"largest fp32 temporary: {max(sizes)} bytes"
    state = hf_state_dict(swapped)  # under the original names; at EP=1 every routed expert is home
    assert len(whole) == 10 and all(torch.equal(state[name], value) for name, value in whole.items())


def test_fp8_experts_of_another_block_size_fail_at_the_swap():
    """64x128 blocks: at these shapes the scales have the 128x128 shapes too, so only the block size tells."""
    _, fp8 = quantised_deepseek_v3(torch.bfloat16, block_size=(64, 128))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: FP8 block_size=\(64, 128\) is not "
                                         r"supported; expected \(128, 128\)"):
        swap_moe_blocks(fp8, BATCH * SEQ, token_padding=8)
