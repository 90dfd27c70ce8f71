"""TopKRouter against direct hand computations; group-limited routing as a property test; the router GEMM on
bf16 tensor cores (SplitLinear) against float64 within fp32 bounds."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_moe.config import RouterConfig
from moonep_moe.layers.router import SplitLinear, TopKRouter, split_bf16

T, E, K = 11, 8, 3


def identity_router(num_experts: int = E, top_k: int = K, **fields) -> TopKRouter:
    """A float64 router with W = I, so ``logits == hidden`` and the test picks the logits directly."""
    router = TopKRouter(RouterConfig(dtype="float64", **fields), num_experts, num_experts, top_k)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts, dtype=torch.float64))
    return router


def hand_route(logits_te: torch.Tensor, score_function: str, renormalize: bool, scale: float, top_k: int):
    """Experts and route weights for ungrouped, unbiased routing, written out directly."""
    if score_function == "softmax":
        scores_te = logits_te.exp() / logits_te.exp().sum(-1, keepdim=True)
    else:
        scores_te = 1 / (1 + (-logits_te).exp())
    experts_tk = scores_te.argsort(dim=-1, descending=True)[:, :top_k]
    gates_tk = scores_te.gather(-1, experts_tk)
    if renormalize:
        gates_tk = gates_tk / (gates_tk.sum(-1, keepdim=True) + (1e-20 if score_function == "sigmoid" else 0))
    return experts_tk, gates_tk * scale


@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_matches_hand_computation(score_function, renormalize, scale):
    router = identity_router(
        score_function=score_function, renormalize=renormalize, routed_scaling_factor=scale
    )
    logits_te = torch.randn(T, E, dtype=torch.float64)
    out = router(logits_te)
    experts_tk, gates_tk = hand_route(logits_te, score_function, renormalize, scale, K)
    assert out.topk_experts_tk.dtype == torch.int32 and out.route_weights_tk.dtype == torch.float64
    torch.testing.assert_close(out.logits_te, logits_te)
    torch.testing.assert_close(out.topk_experts_tk, experts_tk.int())
    torch.testing.assert_close(out.route_weights_tk, gates_tk, rtol=1e-12, atol=1e-12)
    if renormalize:
        torch.testing.assert_close(out.route_weights_tk.sum(-1), torch.full((T,), scale, dtype=torch.float64))
    assert out.aux_loss is None


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_renormalize_min_divides_by_the_sum_clamped_there(score_function):
    """`renormalize_min` m divides by max(sum, m) (ERNIE-4.5's `moe_norm_min`; 0 is MiniMax-M2's plain sum):
    with m between the tokens' smallest and largest top-k sums, some tokens are renormalised and the others
    divided by m, both as written out by hand."""
    logits_te = torch.randn(T, E, dtype=torch.float64) * 3
    experts_tk, gates_tk = hand_route(logits_te, score_function, False, 1.0, K)
    sums_t = gates_tk.sum(-1)
    for m in (0.0, float(sums_t.median())):
        out = identity_router(score_function=score_function, renormalize=True, renormalize_min=m)(logits_te)
        torch.testing.assert_close(out.topk_experts_tk, experts_tk.int())
        want_tk = gates_tk / sums_t.clamp(min=m)[:, None]
        torch.testing.assert_close(out.route_weights_tk, want_tk, rtol=1e-12, atol=0)
    assert (sums_t < m).any() and (sums_t > m).any(), "the clamp must bind for some tokens and not others"


def test_renormalize_min_needs_renormalize():
    with pytest.raises(ValueError, match="renormalize_min"):
        RouterConfig(renormalize=False, renormalize_min=0.0)
    with pytest.raises(ValueError, match="renormalize_min"):
        RouterConfig(renormalize_min=-1.0)


def test_histogram_counts_this_calls_routes():
    out = identity_router()(torch.randn(T, E, dtype=torch.float64))
    expected_e = torch.bincount(out.topk_experts_tk.flatten().long(), minlength=E)
    assert out.tokens_per_expert_e.dtype == torch.int32
    assert out.tokens_per_expert_e.tolist() == expected_e.tolist()
    assert int(out.tokens_per_expert_e.sum()) == T * K


@given(
    seed=st.integers(0, 2**31 - 1),
    n_group=st.sampled_from([2, 4]),
    experts_per_group=st.integers(1, 4),
    topk_group_frac=st.floats(0, 1),
    top_k_frac=st.floats(0, 1),
    score_function=st.sampled_from(["softmax", "sigmoid"]),
    biased=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_group_limited_never_picks_masked_groups(
    seed, n_group, experts_per_group, topk_group_frac, top_k_frac, score_function, biased
):
    gen = torch.Generator().manual_seed(seed)
    num_experts = n_group * experts_per_group
    topk_group = 1 + round(topk_group_frac * (n_group - 1))
    top_k = 1 + round(top_k_frac * (topk_group * experts_per_group - 1))
    router = identity_router(
        num_experts,
        top_k,
        score_function=score_function,
        n_group=n_group,
        topk_group=topk_group,
        expert_bias=biased,
    )
    if biased:
        router.expert_bias.copy_(torch.randn(num_experts, generator=gen))
    logits_te = torch.randn(T, num_experts, dtype=torch.float64, generator=gen)
    out = router(logits_te)

    scores_te = logits_te.softmax(-1) if score_function == "softmax" else logits_te.sigmoid()
    biased_tgx = (scores_te + (router.expert_bias if biased else 0)).view(T, n_group, experts_per_group)
    if score_function == "sigmoid":
        group_tg = biased_tgx.sort(-1, descending=True).values[..., :2].sum(-1)
    else:
        group_tg = biased_tgx.max(-1).values
    cutoff_t1 = group_tg.sort(-1, descending=True).values[:, topk_group - 1 : topk_group]
    picked_groups_tk = out.topk_experts_tk.long() // experts_per_group
    assert (group_tg.gather(-1, picked_groups_tk) >= cutoff_t1).all(), "picked an expert of a masked group"
    for row in out.topk_experts_tk.tolist():
        assert len(set(row)) == top_k
        assert len({e // experts_per_group for e in row}) <= topk_group


def test_bias_changes_selection_not_gates():
    logits_te = torch.randn(T, E, dtype=torch.float64)
    plain = identity_router(score_function="sigmoid", renormalize=False)
    biased = identity_router(score_function="sigmoid", renormalize=False, expert_bias=True)
    biased.expert_bias[E - 1] = 10.0  # far above any sigmoid gap: every token must pick expert E-1
    out = biased(logits_te)
    assert (out.topk_experts_tk[:, 0] == E - 1).all()
    assert not torch.equal(out.topk_experts_tk, plain(logits_te).topk_experts_tk)
    unbiased_gates_tk = logits_te.sigmoid().gather(-1, out.topk_experts_tk.long())
    torch.testing.assert_close(out.route_weights_tk, unbiased_gates_tk)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_softmax_renormalised_gates_of_underflowed_scores_are_zero_not_nan(dtype):
    """With the expert bias choosing experts whose softmax scores underflowed to 0 (logits far below the
    token's best), renormalising divides 0 by 0: those tokens get route weights 0; the others keep the plain
    sum's bits."""
    router = TopKRouter(RouterConfig(dtype=dtype, score_function="softmax", renormalize=True,
                                     expert_bias=True), E, E, 2)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        router.expert_bias[E - 2:] = 10.0  # every token picks the last two experts
    logits_te = torch.zeros(2, E, dtype=router.weight.dtype)
    logits_te[0, 0] = 2000.0  # token 0: expert 0 takes all the softmax mass, the picked two underflow
    out = router(logits_te)
    assert torch.equal(out.route_weights_tk[0], torch.zeros(2, dtype=router.weight.dtype))
    assert torch.equal(out.route_weights_tk[1], torch.full((2,), 0.5, dtype=router.weight.dtype))


def test_aux_loss_hand_example():
    # Two tokens, both pick expert 0 (K=1): f = [1, 0]; P = mean([.75, .25], [.6, .4]) = [.675, .325].
    router = identity_router(2, 1, aux_loss_coeff=0.01)
    logits_te = torch.tensor([[math.log(3.0), 0.0], [math.log(1.5), 0.0]], dtype=torch.float64)
    out = router(logits_te)
    assert out.topk_experts_tk.flatten().tolist() == [0, 0]
    torch.testing.assert_close(out.aux_loss, torch.tensor(0.01 * 2 * 0.675, dtype=torch.float64))


def test_sigmoid_aux_loss_uses_normalised_scores():
    router = identity_router(aux_loss_coeff=0.1, score_function="sigmoid")
    logits_te = torch.randn(T, E, dtype=torch.float64)
    out = router(logits_te)
    probs_te = logits_te.sigmoid() / logits_te.sigmoid().sum(-1, keepdim=True)
    f_e = out.tokens_per_expert_e.double() / (T * K)
    torch.testing.assert_close(out.aux_loss, 0.1 * E * (f_e * probs_te.mean(0)).sum())


def test_gradient_reaches_weight_through_route_weights_and_aux_loss():
    router = TopKRouter(RouterConfig(dtype="float64", aux_loss_coeff=0.01), 16, E, K)
    hidden_th = torch.randn(T, 16, dtype=torch.float64)
    upstream_tk = torch.randn(T, K, dtype=torch.float64)
    out = router(hidden_th)
    (out.route_weights_tk * upstream_tk).sum().backward()

    weight_eh = router.weight.detach().clone().requires_grad_()
    gates_tk = (hidden_th @ weight_eh.T).softmax(-1).gather(-1, out.topk_experts_tk.long())
    ((gates_tk / gates_tk.sum(-1, keepdim=True)) * upstream_tk).sum().backward()
    torch.testing.assert_close(router.weight.grad, weight_eh.grad)

    router.weight.grad = None
    router(hidden_th).aux_loss.backward()
    assert router.weight.grad.abs().sum() > 0


def test_update_expert_bias_moves_toward_underloaded():
    router = identity_router(expert_bias=True, expert_bias_update_rate=0.1)
    router.update_expert_bias(torch.tensor([10, 0, 5, 5, 2, 8, 6, 4]))  # mean 5
    expected_e = 0.1 * torch.tensor([-1.0, 1, 0, 0, 1, -1, -1, 1])
    torch.testing.assert_close(router.expert_bias, expected_e)
    assert router.expert_bias.dtype == torch.float32


def test_update_expert_bias_needs_bias():
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        identity_router().update_expert_bias(torch.ones(E))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_router_dtype(dtype):
    router = TopKRouter(RouterConfig(dtype=dtype), 16, E, K)
    out = router(torch.randn(T, 16))
    assert router.weight.dtype == out.route_weights_tk.dtype == out.logits_te.dtype == getattr(torch, dtype)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="n_group"):
        TopKRouter(RouterConfig(n_group=3, topk_group=1), 16, E, K)
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(RouterConfig(n_group=4, topk_group=1), 16, E, K)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_token_mask_routes_real_tokens_as_if_alone(score_function):
    """Masked (padding) tokens get expert -1 and weight 0 on every route; the real tokens' routes, the
    histogram, the aux loss and the router gradient are those of the batch without the padding."""
    router = identity_router(score_function=score_function, aux_loss_coeff=0.1)
    gen = torch.Generator().manual_seed(7)
    logits_te = torch.randn(T, E, dtype=torch.float64, generator=gen)
    mask_t = torch.rand(T, generator=gen) < 0.6
    mask_t[:2] = torch.tensor([True, False])
    upstream_tk = torch.randn(T, K, dtype=torch.float64, generator=gen)

    def route(hidden_th, upstream_tk, token_mask_t=None):
        router.weight.grad = None
        out = router(hidden_th, token_mask_t)
        ((out.route_weights_tk * upstream_tk).sum() + out.aux_loss).backward()
        return out, router.weight.grad.clone()

    masked, masked_grad = route(logits_te, upstream_tk, mask_t)
    alone, alone_grad = route(logits_te[mask_t], upstream_tk[mask_t])
    assert (masked.topk_experts_tk[~mask_t] == -1).all(), "masked tokens must get no route (-1)"
    assert (masked.route_weights_tk[~mask_t] == 0).all(), "masked tokens must get route weight 0"
    assert torch.equal(masked.topk_experts_tk[mask_t], alone.topk_experts_tk)
    assert torch.equal(masked.route_weights_tk[mask_t], alone.route_weights_tk)
    assert torch.equal(masked.tokens_per_expert_e, alone.tokens_per_expert_e)
    torch.testing.assert_close(masked.aux_loss, alone.aux_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(masked_grad, alone_grad, rtol=1e-12, atol=1e-15)


# -- the router's GEMMs on bf16 tensor cores (SplitLinear) ---------------------------------------------------

def wide_fp32(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 values over a wide range of exponents and both signs, some zeros."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-60, 60, shape, generator=gen).float())
    values = torch.randn(shape, generator=gen) * scale
    return torch.where(torch.rand(shape, generator=gen) < 0.05, 0.0, values)


@pytest.mark.parametrize("seed", range(3))
def test_three_bf16_terms_sum_to_the_fp32_value_exactly_and_two_within_2_pow_minus_16(seed):
    t = wide_fp32((64, 96), seed)
    terms = split_bf16(t, 3)
    assert terms.dtype == torch.bfloat16 and terms.shape == (3, 64, 96)
    assert torch.equal(terms.double().sum(0), t.double())  # each partial sum exact in float64
    two = split_bf16(t, 2).double().sum(0)
    assert ((two - t.double()).abs() <= t.double().abs() * 2**-16).all()
    assert not torch.equal(two, t.double())  # two terms are not exact: the bound above is the one that holds


def split_linear_inputs(seed: int, T: int = 48, H: int = 160, E: int = 24, device: str = "cpu"):
    """bf16 hidden states `[T, H]`, an fp32 router weight `[E, H]` and an fp32 logits gradient `[T, E]`."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16).to(device)
    w = (torch.randn(E, H, generator=gen) * H**-0.5).to(device)
    return x, w, (torch.randn(T, E, generator=gen) / T).to(device)


def split_linear_case(seed: int, T: int = 48, H: int = 160, E: int = 24, device: str = "cpu"):
    """SplitLinear's logits and both gradients, each with float64's, sum |a||b| and the products summed."""
    x, w, grad = split_linear_inputs(seed, T, H, E, device)
    x, w = x.requires_grad_(), w.requires_grad_()
    logits = SplitLinear.apply(x, w)
    logits.backward(grad)
    xd, wd, gd = x.detach().double(), w.detach().double(), grad.double()
    return {"logits": (logits, xd @ wd.t(), xd.abs() @ wd.abs().t(), H),
            "grad_weight": (w.grad, gd.t() @ xd, gd.abs().t() @ xd.abs(), T),
            "grad_input": (x.grad, gd @ wd, gd.abs() @ wd.abs(), 3 * E)}


@pytest.mark.parametrize("seed", range(4))
def test_split_linear_has_fp32_accuracy_with_the_input_gradient_rounded_once_to_bf16(seed):
    """The logits and the weight gradient (fp32): every bf16 product exact, so only fp32 summation error,
    at most about (K + 2) * 2**-24 of sum |a||b| over the K summed products (the classic bound of an fp32
    dot product, plus the three terms' sum). The input gradient (bf16): the left-out terms
    g1 w3 + g2 w2 + g3 w1 (|g2|, |w2| <= 2**-8 of g, w; |g3|, |w3| <= 2**-16) about 3 * 2**-16 of
    sum |g||w|, then one bf16 rounding (2**-8 of the value); the bound takes twice that."""
    case = split_linear_case(seed)
    for name in ("logits", "grad_weight"):
        value, ref, scale, k = case[name]
        assert value.dtype == torch.float32, name
        assert ((value.double() - ref).abs() <= (k + 2) * 2**-24 * scale).all(), name
    value, ref, scale, _ = case["grad_input"]
    assert value.dtype == torch.bfloat16
    assert ((value.double() - ref).abs() <= 2**-8 * ref.abs() + 2**-13 * scale).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_split_linear_takes_no_tokens(device):
    """A rank with no tokens this step: empty logits, a zero weight gradient, an empty input gradient."""
    x = torch.zeros(0, 16, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.randn(4, 16, device=device, requires_grad=True)
    logits = SplitLinear.apply(x, w)
    logits.sum().backward()
    assert logits.shape == (0, 4) and logits.dtype == torch.float32
    assert torch.equal(w.grad, torch.zeros_like(w)) and x.grad.shape == (0, 16)


def test_the_fp32_bound_fails_for_a_single_bf16_term():
    """The bound above can fail: the same logits from the bf16 rounding of the weight alone miss it."""
    x, w, _ = split_linear_inputs(0)
    _, ref, scale, k = split_linear_case(0)["logits"]
    one_term = x.float() @ w.to(torch.bfloat16).float().t()
    assert not ((one_term.double() - ref).abs() <= (k + 2) * 2**-24 * scale).all()


@pytest.mark.gpu
@pytest.mark.parametrize("bf16x3", [True, False])
def test_a_cuda_router_over_bf16_states_uses_the_split_gemm_unless_configured_off(bf16x3):
    """On CUDA with bf16 hidden states and an fp32 router: SplitLinear (tensor cores) by default, plain fp32
    GEMMs with `bf16x3=False`; either way the logits within (H + 2) * 2**-22 of sum |x||w| of float64 (the
    tensor cores' fp32 accumulation is coarser than round-to-nearest: 2**-22 per addition, not 2**-24)."""
    H, E = 1024, 64
    router = TopKRouter(RouterConfig(score_function="sigmoid", bf16x3=bf16x3), H, E, 4).cuda()
    hidden = torch.randn(256, H, device="cuda").to(torch.bfloat16).requires_grad_()
    out = router(hidden)
    assert (type(out.logits_te.grad_fn).__name__ == "SplitLinearBackward") == bf16x3
    xd, wd = hidden.detach().double(), router.weight.detach().double()
    bound = (H + 2) * 2**-22 * (xd.abs() @ wd.abs().t())
    assert ((out.logits_te.double() - xd @ wd.t()).abs() <= bound).all()
    out.route_weights_tk.float().sum().backward()
    assert router.weight.grad is not None and hidden.grad is not None and hidden.grad.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(2))
def test_split_linear_on_cuda_tensor_cores_within_their_accumulation_bound(seed):
    """SplitLinear on the GPU (torch.mm with fp32 output): the CPU test's bounds with the tensor cores'
    2**-22 per addition in place of 2**-24."""
    case = split_linear_case(seed, T=512, H=1024, E=64, device="cuda")
    for name in ("logits", "grad_weight"):
        value, ref, scale, k = case[name]
        assert ((value.double() - ref).abs() <= (k + 2) * 2**-22 * scale).all(), name
    value, ref, scale, k = case["grad_input"]
    assert ((value.double() - ref).abs() <= 2**-8 * ref.abs() + (2**-13 + k * 2**-22) * scale).all()
