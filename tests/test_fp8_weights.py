"""FP8 experts with no bf16 master (`MoEConfig.expert_weights="fp8"`, inference).

The contract: a layer whose home experts are e4m3 bytes + fp32 128x128 block scales holds exactly the bytes
of the FP8 checkpoint it loaded (DeepSeek-V3's per-expert format or transformers' fused one, any EP size),
keeps no expert tensor in any other dtype, prefetches FP8 slots with their scales, and computes what a bf16
master layer computes from the dequantised checkpoint.

On the CPU (`grouped_gemm="reference"`, `ReferenceFp8Gemm`) that last part is exact: with the power-of-two
scales of `quantise_blocks`, every dequantised weight `q * 2^j` (3 mantissa bits, exponent well inside
bf16's) is a bf16 value, so the bf16 masters hold the same numbers the FP8 path dequantises in fp32; both
layers then run the same per-segment fp32 GEMMs on the same bf16 activations, so outputs are equal bit for
bit, on uniform and skewed routing, at every EP size (a slot holding another expert's bytes, or an expert's
bytes with another block's scale, changes them). On the GPU (DeepGEMM) the activations are also rounded to
e4m3 per 1x128 tile; that test derives its bound below.

H = 160 gives every projection a tail block (128 + 32 columns or rows); F = 256 (two blocks) keeps gate's
and up's blocks apart in the fused `[2F, H]` matrix, which `expert_weights="fp8"` requires (F % 128 == 0).
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_checkpoint import BATCH, HF_TOL, SEQ, VOCAB, deepseek_quantise, quantised_deepseek_v3, rel_err

from moonep_moe.config import MoEConfig
from moonep_moe.fp8.format import FP8_DTYPE, dequantise_rows, quantise_blocks, quantise_rows
from moonep_moe.gemm.registry import fp8_unsupported_reason
from moonep_moe.integrations.hf import MoonEPBlock, hf_state_dict, swap_moe_blocks
from moonep_moe.layers import moe
from moonep_moe.layers.function import MoonEPExperts
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks

E, H, F, K, S = 4, 160, 256, 2, 8
PROJECTIONS = {"gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
QUANTISERS = {"pow2": lambda w: tuple(t[0] for t in quantise_blocks(w[None])), "amax/448": deepseek_quantise}


def config(R: int, **changes) -> MoEConfig:
    fields = dict(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, ep_size=R, max_tokens_per_rank=S,
                  dtype="bfloat16", router={"dtype": "float32"}, grouped_gemm="reference",
                  expert_weights="fp8")
    return MoEConfig(**{**fields, **changes})


def checkpoint(quantiser: str = "pow2", seed: int = 0) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's per-expert FP8 layout, built here: `experts.{e}.{proj}.weight` e4m3 +
    `.weight_scale_inv` fp32, from weights spread over 8 binades (block scales differ block to block), and a
    router that sends every (positive) token to experts 0 and 1 (skewed: rank 0's experts are replicated
    into the other ranks' slots)."""
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen) * 0.01
    router[:2] += 0.05
    out = {"router.weight": router}
    for e in range(E):
        for proj, shape in PROJECTIONS.items():
            binades = torch.randint(-4, 4, shape, generator=gen)
            w = torch.randn(shape, generator=gen) * 0.05 * torch.exp2(binades)
            out[f"experts.{e}.{proj}.weight"], out[f"experts.{e}.{proj}.weight_scale_inv"] = \
                QUANTISERS[quantiser](w)
    return out


def fused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same experts in transformers' fused FP8 layout (gate's rows then up's, scales stacked alike)."""
    def stacked(projs: tuple[str, ...], suffix: str) -> torch.Tensor:
        return torch.stack([torch.cat([state[f"experts.{e}.{p}.weight{suffix}"] for p in projs])
                            for e in range(E)])

    out = {"router.weight": state["router.weight"]}
    for key, projs in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        out[f"experts.{key}"] = stacked(projs, "")
        out[f"experts.{key}_scale_inv"] = stacked(projs, "_scale_inv")
    return out


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of an FP8 tensor (torch has no CPU `equal` for float8), any other tensor as it is."""
    return tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor


def inputs(rank: int, big: bool = False) -> torch.Tensor:
    """`[S, H]` bf16 tokens of `rank`, positive (so the checkpoint's router prefers expert 0); `big`: values
    up to 2^12 (the FP8 path must not saturate: only the weights are FP8)."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(S, H, generator=gen)
    return (x * 2.0**12 if big else x).bfloat16()


def run(R: int, state: dict[str, torch.Tensor], big: bool = False, **changes) -> list[dict]:
    """An R-rank group of layers loading `state` strictly, each rank's output on its tokens (no grad), its
    state_dict, the slots its plan used and its experts' tensors."""

    def rank_fn(world):
        layer = MoonEPMoELayer(config(R, **changes), world)
        layer.load_state_dict(state)
        with torch.no_grad():
            out = layer(inputs(world.rank, big))
        return {"out": out, "state": layer.state_dict(), "slots_used": layer.balance_stats()["slots_used"],
                "parameters": dict(layer.experts.named_parameters()),
                "buffers": dict(layer.experts.named_buffers())}

    return run_ranks(rank_fn, R)


def merged_state(results: list[dict]) -> dict[str, torch.Tensor]:
    return {k: v for res in results for k, v in res["state"].items()}


# -- loading: bytes as stored, nothing wider ---------------------------------------------------------------


@pytest.mark.parametrize("quantiser", list(QUANTISERS))
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("R", [1, 2])
def test_fp8_checkpoint_loads_as_its_bytes_with_no_wider_expert_tensor(R, layout, quantiser):
    """Loaded strictly at EP=R from either layout, the merged `state_dict()` is the per-expert checkpoint,
    e4m3 bytes and fp32 scales identical (any scales: amax/448 ones are not powers of two); the experts have
    no parameters and their buffers are only e4m3 values and fp32 scales."""
    per_expert = checkpoint(quantiser, seed=1)
    results = run(R, per_expert if layout == "per_expert" else fused(per_expert))
    got = merged_state(results)
    assert got.keys() == per_expert.keys()
    for key, want in per_expert.items():
        assert got[key].dtype == want.dtype and torch.equal(raw(got[key]), raw(want)), key
    for res in results:
        assert res["parameters"] == {}
        assert {name: t.dtype for name, t in res["buffers"].items()} == {
            "gate_up": FP8_DTYPE, "gate_up_scale_inv": torch.float32, "down": FP8_DTYPE,
            "down_scale_inv": torch.float32}
        assert tuple(res["buffers"]["gate_up_scale_inv"].shape) == (E // R, 2 * F // 128, 2)


def test_unquantised_checkpoint_is_quantised_on_load_and_init_is_the_same_at_every_ep_size():
    """A bf16 checkpoint loads as `quantise_blocks` of each expert (per projection and fused alike); an FP8
    layer's own init (fp32 draws quantised) gives the same experts at EP=1 and EP=2."""
    state = checkpoint(seed=2)
    bf16 = {k: v for k, v in state.items() if not k.endswith("_scale_inv")}
    for k in bf16:
        if k.startswith("experts."):
            bf16[k] = (state[k].float() * state[k + "_scale_inv"].repeat_interleave(128, 0)
                       .repeat_interleave(128, 1)[:state[k].shape[0], :state[k].shape[1]]).bfloat16()
    got = merged_state(run(2, bf16))
    for key, weight in bf16.items():
        if key.startswith("experts."):
            q, scales = quantise_blocks(weight[None])
            assert torch.equal(raw(got[key]), raw(q[0])) and torch.equal(got[key + "_scale_inv"], scales[0])
            # pow2 scales: requantising the dequantised values gives the same numbers back
            assert torch.equal(got[key].float() * scales[0].repeat_interleave(128, 0).repeat_interleave(
                128, 1)[:q.shape[1], :q.shape[2]], weight.float())

    def init_state(R: int) -> dict[str, torch.Tensor]:
        def rank_fn(world):
            torch.manual_seed(5)
            return MoonEPMoELayer(config(R), world).state_dict()

        return {k: v for shard in run_ranks(rank_fn, R) for k, v in shard.items() if k.startswith("experts.")}

    one, two = init_state(1), init_state(2)
    assert one.keys() == two.keys() and all(torch.equal(raw(one[k]), raw(two[k])) for k in one)


# -- forward: the dequantised checkpoint's own values -------------------------------------------------------


@pytest.mark.parametrize("big", [False, True], ids=["unit", "huge"])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_fp8_layer_equals_the_bf16_master_layer_on_the_dequantised_checkpoint(R, big):
    """Bit for bit (see the module docstring), with expert 0 hot so the other ranks prefetch its FP8 bytes
    and scales into their slots (checked: slots are used at R > 1)."""
    state = checkpoint(seed=3)
    fp8 = run(R, state, big)
    masters = run(R, state, big, expert_weights="bf16", precision="bf16", token_padding=128)
    for rank, (got, want) in enumerate(zip(fp8, masters, strict=True)):
        assert got["out"].dtype == want["out"].dtype == torch.bfloat16
        assert got["out"].abs().max() > 0
        assert torch.equal(got["out"], want["out"]), f"rank {rank}"
    if R > 1:
        assert int(sum(res["slots_used"] for res in fp8).sum()) > 0, "skewed routing must use FP8 slots"


class RoundedExperts:
    """Stands in for `MoonEPExperts` in `moonep_moe.layers.moe`: the routed experts get the tokens rounded to
    their FP8 values (1x128 tiles, dequantised exactly into bf16); the router still sees them as given."""

    @staticmethod
    def apply(hidden_sh, *args):
        return MoonEPExperts.apply(dequantise_rows(*quantise_rows(hidden_sh), torch.bfloat16), *args)


@pytest.mark.parametrize("R", [1, 2])
def test_fp8_dispatch_multiplies_the_tokens_fp8_values(R, monkeypatch):
    """`fp8_dispatch` on the reference path: the tokens are quantised before dispatch and arrive as e4m3
    rows with their scales, so the layer computes, bit for bit, what the same layer without it computes when
    its routed experts get the tokens rounded to those values; slots in use at R=2."""
    state = checkpoint(seed=5)
    with_dispatch = run(R, state, fp8_dispatch=True)
    monkeypatch.setattr(moe, "MoonEPExperts", RoundedExperts)
    plain = run(R, state)
    for rank, (got, want) in enumerate(zip(with_dispatch, plain, strict=True)):
        assert got["out"].abs().max() > 0
        assert torch.equal(got["out"], want["out"]), f"rank {rank}"
    if R > 1:
        assert int(sum(res["slots_used"] for res in with_dispatch).sum()) > 0


def test_fp8_layer_with_padding_tokens_and_an_empty_step():
    """Masked tokens route nowhere (zero output rows); a step of zero tokens gives `[0, H]`."""
    layer = MoonEPMoELayer(config(1))
    layer.load_state_dict(checkpoint(seed=4))
    x = inputs(0)
    mask = torch.arange(S) % 2 == 0
    with torch.no_grad():
        out = layer(x, mask)
        assert not out[~mask].any() and out[mask].abs().amax(1).gt(0).all()
        assert layer(x[:0]).shape == (0, H)


# -- refusals, before any kernel ----------------------------------------------------------------------------


def test_forward_that_would_need_a_gradient_is_refused():
    layer = MoonEPMoELayer(config(1))
    message = r"expert_weights='fp8' runs forward only \(rank 0\): the FP8 experts have no master weights"
    with pytest.raises(ValueError, match=message):
        layer(inputs(0))  # grad enabled, the router requires grad
    layer.router.requires_grad_(False)
    with pytest.raises(ValueError, match=message):
        layer(inputs(0).requires_grad_())
    assert layer(inputs(0)).grad_fn is None  # frozen router and input: allowed
    with torch.inference_mode():
        layer.router.requires_grad_(True)
        layer(inputs(0))


@pytest.mark.parametrize(("changes", "message"), [
    (dict(precision="bf16"), r"expert_weights='fp8' needs precision='fp8' \(its default\), got "
                             r"precision='bf16'"),
    (dict(ffn_hidden_size=192), r"expert_weights='fp8' needs ffn_hidden_size a multiple of 128 .* got 192"),
    (dict(grouped_gemm="torch"), r"expert_weights='fp8' runs on grouped_gemm 'auto' or 'deep_gemm' .* "
                                 r"got 'torch'"),
    (dict(dtype="float32"), r"precision='fp8' needs dtype='bfloat16'"),
])
def test_config_refusals(changes, message):
    with pytest.raises(ValueError, match=message):
        config(1, **changes)


def test_defaults_precision_and_padding_follow_expert_weights():
    cfg = config(1)
    assert (cfg.precision, cfg.token_padding) == ("fp8", 128)
    assert MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K,
                     max_tokens_per_rank=S).expert_weights == "bf16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_fp8_gemm_path_refused_at_construction_without_cuda():
    with pytest.raises(ValueError, match=r"expert_weights='fp8' with grouped_gemm='auto' cannot run here "
                                         r"\(rank 0\): FP8 experts run bf16 .* on CUDA, .*use grouped_gemm="
                                         r"'reference'"):
        MoonEPMoELayer(config(1, grouped_gemm="auto"))


def test_dtype_conversion_of_fp8_experts_is_refused():
    """`.to(bfloat16)` leaves a bf16 layer's parameters as they are but would cast the e4m3 buffers and their
    fp32 scales (whichever the check meets first is named)."""
    layer = MoonEPMoELayer(config(1, router={"dtype": "bfloat16"}))
    with pytest.raises(ValueError, match=r"cannot convert MoonEPMoELayer's torch.(float8_e4m3fn|float32) "
                                         r"parameters to torch.bfloat16"):
        layer.to(torch.bfloat16)
    assert layer.experts.gate_up.dtype == FP8_DTYPE and layer.experts.down_scale_inv.dtype == torch.float32


def test_fp8_weight_without_its_scales_is_an_error_naming_the_key():
    state = checkpoint(seed=6)
    del state["experts.3.down_proj.weight_scale_inv"]
    layer = MoonEPMoELayer(config(1))
    with pytest.raises(RuntimeError, match=r"experts.3.down_proj.weight: a float8_e4m3fn weight needs its "
                                           r"block scales experts.3.down_proj.weight_scale_inv"):
        layer.load_state_dict(state)


# -- the transformers swap (skipped without transformers) ---------------------------------------------------


def test_swap_keeps_transformers_fp8_experts_fp8():
    """`expert_weights="fp8"`: the swapped blocks hold the FP8 experts' bytes and scales as transformers
    stored them (`hf_tensors` under the same names), no bf16 expert tensor, and give the logits of the swap
    into bf16 masters bit for bit (same reasoning as the layer test; both on the reference GEMM), and the
    original model's on its dequantised weights within the bf16 tolerance of tests/test_hf.py."""
    reference, fp8 = quantised_deepseek_v3(torch.bfloat16, ffn=128)
    _, masters = quantised_deepseek_v3(torch.bfloat16, ffn=128)
    originals = {k: v.clone() for k, v in fp8.state_dict().items() if ".mlp.experts." in k}
    swap_moe_blocks(fp8, BATCH * SEQ, grouped_gemm="reference", expert_weights="fp8")
    swap_moe_blocks(masters, BATCH * SEQ, grouped_gemm="reference", token_padding=128)
    blocks = [m for m in fp8.modules() if isinstance(m, MoonEPBlock)]
    assert len(blocks) == 2 and all(list(b.moe.experts.parameters()) == [] for b in blocks)
    swapped = {k: v for k, v in hf_state_dict(fp8).items() if ".mlp.experts." in k}
    assert swapped.keys() == originals.keys() and len(swapped) == 8
    for key, want in originals.items():
        assert swapped[key].dtype == want.dtype and torch.equal(raw(swapped[key]), raw(want)), key
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, exact, want = (m(input_ids=ids, labels=ids) for m in (fp8, masters, reference))
    assert torch.equal(got.logits, exact.logits)
    assert rel_err(got.logits, want.logits) <= HF_TOL[torch.bfloat16]


def test_swap_refuses_fp8_experts_whose_ffn_size_is_not_a_multiple_of_128():
    _, fp8 = quantised_deepseek_v3(torch.bfloat16)  # F = 16
    with pytest.raises(ValueError, match=r"expert_weights='fp8' needs ffn_hidden_size a multiple of 128"):
        swap_moe_blocks(fp8, BATCH * SEQ, grouped_gemm="reference", expert_weights="fp8")


# -- on the H200: DeepGEMM's FP8 GEMMs on the stored weights ----------------------------------------------


def _fp8_available() -> bool:
    return torch.cuda.is_available() and \
        fp8_unsupported_reason(torch.device("cuda"), torch.bfloat16, 128) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_available(), reason="needs DeepGEMM on a Hopper GPU (run on the H200)")
@pytest.mark.parametrize("R", [1, 2])
def test_deep_gemm_fp8_layer_tracks_the_reference_fp8_layer(R):
    """The same checkpoint on DeepGEMM (`grouped_gemm="auto"`) and on `ReferenceFp8Gemm`, R thread-ranks on
    one GPU (R = 2: FP8 slots prefetched by the compiled copy kernel). The weights are the same numbers on
    both paths; DeepGEMM also rounds each activation to e4m3 (at most 2^-4 relative, or 2^-10 of its tile's
    scale) and accumulates in its own order. One operand rounded bounds each product term's error by 2^-4
    relative; errors of random signs add in norm far below that, so 2^-4 norm-wise relative error per
    output is a ceiling for the two-GEMM chain (expected: about 2^-7)."""
    state = checkpoint(seed=7)

    def rank_fn(world):
        outs = {}
        for gemm in ("auto", "reference"):
            layer = MoonEPMoELayer(config(R, grouped_gemm=gemm), world)
            layer.load_state_dict(state)
            with torch.no_grad():
                outs[gemm] = layer(inputs(world.rank).to(world.device)).double()
            layer.destroy()
        return outs

    for rank, outs in enumerate(run_ranks(rank_fn, R, device="cuda")):
        error = float((outs["auto"] - outs["reference"]).norm() / outs["reference"].norm())
        assert error < 2.0**-4, f"rank {rank}: relative error {error:.3g}"
