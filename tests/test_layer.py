"""MoonEPMoELayer against the dense single-device float64 reference, on R thread-ranks.

Every rank's output, input gradient and router gradient, and every expert's weight gradient (summed over
all ranks' tokens) must match `dense_moe` run on the same router and the full set of E experts.
All random inputs are drawn on the main thread: torch's default generator is shared by the rank threads.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_moe.config import MoEConfig
from moonep_moe.layers.dense import dense_step
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks, single_world

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


def make_config(R: int, **overrides) -> MoEConfig:
    fields = dict(hidden_size=16, ffn_hidden_size=8, num_experts=32, top_k=2, ep_size=R,
                  max_tokens_per_rank=48, token_padding=8, dtype="float64",
                  router={"dtype": "float64", "expert_bias": True}, grouped_gemm="reference")
    return MoEConfig(**{**fields, **overrides})


@dataclass
class Problem:
    """One step's inputs for every rank, and the full model's weights."""

    cfg: MoEConfig
    hidden: list[torch.Tensor]          # per rank [T, H]
    grad_out: list[torch.Tensor]        # per rank [T, H]
    masks: list[torch.Tensor | None]    # per rank [T] bool
    router_weight_eh: torch.Tensor
    expert_bias_e: torch.Tensor
    gate_up_e2fh: torch.Tensor
    down_ehf: torch.Tensor


def make_problem(cfg: MoEConfig, seed: int, skew: float = 0.0, tokens: int | None = None,
                 padding: int = 0) -> Problem:
    """`skew` > 0 biases selection toward experts 0 and 1 (maxvio up to E/K - 1); `padding` masks the
    last tokens of every rank out of routing."""
    gen = torch.Generator().manual_seed(seed)
    R, T = cfg.ep_size, tokens or cfg.max_tokens_per_rank
    H, F, E = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    bias_e = torch.zeros(E, dtype=F64)
    bias_e[:2] = skew
    masks = [None] * R
    if padding:
        masks = [torch.arange(T) < T - padding for _ in range(R)]
    return Problem(cfg, [randn(T, H) for _ in range(R)], [randn(T, H) for _ in range(R)], masks,
                   randn(E, H) / H**0.5, bias_e.float(), randn(E, 2 * F, H) / H**0.5, randn(E, H, F) / F**0.5)


def build_layer(p: Problem, world) -> MoonEPMoELayer:
    """This rank's layer holding the problem's router and its home experts."""
    epn = p.cfg.num_experts // p.cfg.ep_size
    home = slice(world.rank * epn, (world.rank + 1) * epn)
    layer = MoonEPMoELayer(p.cfg, world)
    with torch.no_grad():
        layer.router.weight.copy_(p.router_weight_eh)
        layer.router.expert_bias.copy_(p.expert_bias_e)
        layer.experts.gate_up.copy_(p.gate_up_e2fh[home])
        layer.experts.down.copy_(p.down_ehf[home])
    return layer


def rank_step(p: Problem, world, device: str = "cpu", backward: bool = True) -> dict[str, torch.Tensor]:
    """One forward (+ backward) of this rank's layer in any EP world: outputs, gradients, balance stats and
    the plan's `dst`, `experts_to_copy`, `cu_seqlens`, on the CPU (floating point ones in float64)."""
    dtype = p.cfg.torch_dtype
    layer = build_layer(p, world)
    x = p.hidden[world.rank].to(device, dtype).requires_grad_()
    mask = p.masks[world.rank]
    out = layer(x, None if mask is None else mask.to(device))
    if backward:
        out.backward(p.grad_out[world.rank].to(device, dtype))
    stats = {k: v.clone() for k, v in layer.balance_stats().items()}
    plan = layer._state.last_plan
    layer.destroy()
    result = dict(out=out.detach(), grad_x=x.grad, grad_router=layer.router.weight.grad,
                  grad_gate_up=layer.experts.gate_up.grad, grad_down=layer.experts.down.grad, **stats,
                  dst=plan.dst, experts_to_copy=plan.experts_to_copy, cu_seqlens=plan.cu_seqlens,
                  arena=torch.tensor(all(rows.compute is not None for rows in layer.experts.rows)))
    return {k: v.cpu().double() if v.is_floating_point() else v.cpu()
            for k, v in result.items() if v is not None}


def run_moonep(p: Problem, device: str = "cpu", backward: bool = True) -> list[dict[str, torch.Tensor]]:
    """`rank_step` on `cfg.ep_size` thread-ranks on `device`."""
    return run_ranks(lambda world: rank_step(p, world, device, backward), p.cfg.ep_size, device=device)


def run_dense(p: Problem) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor, torch.Tensor, float]:
    """The oracle: each rank's tokens through the full model on one device, expert gradients summed over
    ranks. Also returns the group's expert-level maxvio (max_e T_e / mean - 1)."""
    router_state = {"weight": p.router_weight_eh, "expert_bias": p.expert_bias_e}
    results = [dense_step(p.cfg, router_state, p.gate_up_e2fh, p.down_ehf, x, g, mask)
               for x, g, mask in zip(p.hidden, p.grad_out, p.masks, strict=True)]
    counts_e = sum(r["tokens_per_expert"] for r in results).double()
    maxvio = float(counts_e.max() / counts_e.mean() - 1)
    return (results, sum(r["grad_gate_up"] for r in results), sum(r["grad_down"] for r in results), maxvio)


def assert_matches_dense(p: Problem, device: str = "cpu") -> tuple[list[dict[str, torch.Tensor]], float]:
    got = run_moonep(p, device)
    want, grad_gate_up, grad_down, maxvio = run_dense(p)
    tol = TOL
    epn = p.cfg.num_experts // p.cfg.ep_size
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in ("out", "grad_x", "grad_router"):
            torch.testing.assert_close(g[name], w[name], **tol,
                                       msg=lambda m, n=name, r=rank: f"{n} on rank {r}: {m}")
        home = slice(rank * epn, (rank + 1) * epn)
        torch.testing.assert_close(g["grad_gate_up"], grad_gate_up[home], **tol)
        torch.testing.assert_close(g["grad_down"], grad_down[home], **tol)
    return got, maxvio


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_uniform_routing_matches_dense(R):
    got, _ = assert_matches_dense(make_problem(make_config(R), seed=R))
    loads = got[0]["rank_load"]
    assert int(loads.max() - loads.min()) <= 1


@pytest.mark.parametrize("R", [2, 4, 8])
def test_skewed_routing_matches_dense_and_stays_balanced(R):
    p = make_problem(make_config(R), seed=10 + R, skew=100.0)
    got, maxvio = assert_matches_dense(p)
    assert maxvio >= 10, maxvio
    loads, ep_loads = got[0]["rank_load"], got[0]["ep_rank_load"]
    assert int(loads.max() - loads.min()) <= 1
    assert float(got[0]["ep_maxvio"]) > 0.5  # plain EP would have been badly imbalanced
    assert int(got[0]["slots_used"].max()) > 0
    assert int(ep_loads.sum()) == int(loads.sum())


@pytest.mark.parametrize("R", [2, 4])
def test_invalid_routes_and_fewer_tokens_than_capacity(R):
    cfg = make_config(R)
    p = make_problem(cfg, seed=20 + R, skew=3.0, tokens=cfg.max_tokens_per_rank - 13, padding=7)
    got, _ = assert_matches_dense(p)
    for g, mask in zip(got, p.masks, strict=True):
        assert torch.all(g["out"][~mask] == 0)
    assert int(got[0]["rank_load"].sum()) == R * (cfg.max_tokens_per_rank - 13 - 7) * cfg.top_k


@settings(max_examples=16, deadline=None)
@given(st.data())
def test_any_valid_config_matches_dense(data):
    """Drawn configs (R ranks of 1-5 experts each, K, capacity, padding, every balance policy, both score
    functions, group-limited routing, the slots, the routed scale) and inputs (fewer tokens than capacity,
    masked tokens, expert-bias skew): every rank's output, input and router gradients and every expert's
    weight gradient equal the dense float64 reference's."""
    R = data.draw(st.sampled_from([1, 2, 3, 4, 6]), "R")
    E = R * data.draw(st.integers(1, 5), "epn")
    K = data.draw(st.integers(1, min(E, 6)), "K")
    groups = [g for g in range(1, E + 1) if E % g == 0]
    n_group = data.draw(st.sampled_from(groups), "n_group")
    topk_group = data.draw(st.integers(1, n_group), "topk_group")
    if topk_group * (E // n_group) < K:
        n_group = topk_group = 1
    S = data.draw(st.integers(1, 40), "S")
    router = dict(dtype="float64", expert_bias=True, n_group=n_group, topk_group=topk_group,
                  score_function=data.draw(st.sampled_from(["softmax", "sigmoid"]), "score"),
                  renormalize=data.draw(st.booleans(), "renormalize"),
                  routed_scaling_factor=data.draw(st.sampled_from([1.0, 2.5]), "scale"))
    fields = dict(num_experts=E, top_k=K, max_tokens_per_rank=S, router=router,
                  token_padding=data.draw(st.sampled_from([1, 4, 8, 16]), "tp"),
                  balance=data.draw(st.sampled_from(["exact", "cost_aware", "off"]), "balance"))
    if R > 1:
        fields["num_prefetch_slots"] = data.draw(st.sampled_from([0, 1, E // R]), "B")
    tokens = data.draw(st.integers(1, S), "tokens")
    padding = data.draw(st.integers(0, tokens), "padding")
    problem = make_problem(make_config(R, **fields), seed=data.draw(st.integers(0, 2**16), "seed"),
                           skew=data.draw(st.sampled_from([0.0, 3.0, 100.0]), "skew"), tokens=tokens,
                           padding=padding)
    assert_matches_dense(problem)


@pytest.mark.gpu
def test_cuda_one_rank_matches_dense_in_float64():
    """The unchanged layer on one GPU, forward and backward, exact in float64."""
    assert_matches_dense(make_problem(make_config(1), seed=31, skew=100.0), device="cuda")


@pytest.mark.gpu
def test_cuda_thread_ranks_forward_matches_dense_in_float64():
    """Four thread-ranks on their own streams of one GPU, skewed routing, exact in float64. (Backward with
    several thread-ranks cannot run on one GPU: see the next test.)"""
    p = make_problem(make_config(4), seed=34, skew=100.0)
    for got, want in zip(run_moonep(p, "cuda", backward=False), run_dense(p)[0], strict=True):
        torch.testing.assert_close(got["out"], want["out"], **TOL)
        assert int(got["rank_load"].max() - got["rank_load"].min()) <= 1


@pytest.mark.gpu
def test_cuda_thread_ranks_backward_raises_instead_of_hanging():
    p = make_problem(make_config(2), seed=35)
    with pytest.raises(RuntimeError, match="device thread"):
        run_moonep(p, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 4])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_cuda_bf16_matches_dense_within_bf16_tolerance(R, backend):
    """bf16 activations and experts (torch._grouped_mm's sm90 path), float32 router, skewed routing:
    within bf16 tolerance of the float64 reference (forward and backward with one rank, forward with 4)."""
    cfg = make_config(R, hidden_size=64, ffn_hidden_size=32, dtype="bfloat16", grouped_gemm=backend,
                      router={"dtype": "float32", "expert_bias": True})
    p = make_problem(cfg, seed=40, skew=100.0)
    bf16 = [t.bfloat16().double() for t in p.hidden + [p.gate_up_e2fh, p.down_ehf]]  # what the layer sees
    p.hidden, p.gate_up_e2fh, p.down_ehf = bf16[:-2], bf16[-2], bf16[-1]
    got, want = run_moonep(p, "cuda", backward=R == 1), run_dense(p)[0]
    for g, w in zip(got, want, strict=True):
        for name in ("out", "grad_x") if R == 1 else ("out",):
            error = float((g[name] - w[name]).norm() / w[name].norm())
            assert error < 2e-2, f"{name}: relative error {error:.1e}"


def test_batched_input_shape_and_shared_experts():
    cfg = make_config(2, shared_experts={"num_shared_experts": 1, "gate": True})

    def rank_fn(world):
        layer = MoonEPMoELayer(cfg, world)
        x = torch.ones(3, 16, 16, dtype=F64)
        out = layer(x)
        return out.shape, layer.shared_experts is not None

    for shape, has_shared in run_ranks(rank_fn, 2):
        assert shape == (3, 16, 16) and has_shared


def test_same_gradients_at_ep_r_and_ep_1():
    """The same model and tokens at EP=4 and EP=1 (one rank holding all tokens) learn the same."""
    cfg4 = make_config(4, max_tokens_per_rank=24)
    p4 = make_problem(cfg4, seed=5, skew=50.0)
    cfg1 = make_config(1, max_tokens_per_rank=96)
    p1 = Problem(cfg1, [torch.cat(p4.hidden)], [torch.cat(p4.grad_out)], [None], p4.router_weight_eh,
                 p4.expert_bias_e, p4.gate_up_e2fh, p4.down_ehf)
    got4, got1 = run_moonep(p4), run_moonep(p1)[0]
    torch.testing.assert_close(torch.cat([g["grad_gate_up"] for g in got4]), got1["grad_gate_up"], **TOL)
    torch.testing.assert_close(torch.cat([g["grad_down"] for g in got4]), got1["grad_down"], **TOL)
    torch.testing.assert_close(torch.cat([g["out"] for g in got4]), got1["out"], **TOL)
    torch.testing.assert_close(sum(g["grad_router"] for g in got4), got1["grad_router"], **TOL)


def test_aux_loss_is_returned_and_differentiable():
    cfg = make_config(1, router={"dtype": "float64", "aux_loss_coeff": 0.01})
    layer = MoonEPMoELayer(cfg)
    out, aux = layer(torch.randn(8, 16, dtype=F64))
    assert aux.dim() == 0 and aux > 0
    (out.sum() + aux).backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_expert_bias_update_uses_group_load():
    cfg = make_config(2)
    p = make_problem(cfg, seed=3, skew=100.0)

    def rank_fn(world):
        layer = MoonEPMoELayer(cfg, world)
        with torch.no_grad():
            layer.router.weight.copy_(p.router_weight_eh)
            layer.router.expert_bias.copy_(p.expert_bias_e)
        layer(p.hidden[world.rank])
        load = layer.expert_load.clone()
        layer.update_expert_bias()
        return load, layer.router.expert_bias.clone(), layer.expert_load.clone()

    (load0, bias0, after0), (load1, bias1, _) = run_ranks(rank_fn, 2)
    assert torch.equal(load0, load1) and torch.equal(bias0, bias1)  # the group's load, on every rank
    assert int(load0.sum()) == 2 * cfg.max_tokens_per_rank * cfg.top_k
    assert bool((bias0[:2] < p.expert_bias_e[:2]).all()) and int(after0.sum()) == 0


# -- bad input --------------------------------------------------------------------------------------------


def one_rank_layer(**overrides) -> MoonEPMoELayer:
    return MoonEPMoELayer(make_config(1, **overrides))


def test_wrong_dtype_raises():
    with pytest.raises(ValueError, match="dtype"):
        one_rank_layer()(torch.randn(4, 16, dtype=torch.float32))


def test_wrong_hidden_size_raises():
    with pytest.raises(ValueError, match="hidden_states"):
        one_rank_layer()(torch.randn(4, 15, dtype=F64))


def test_too_many_tokens_raises():
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        one_rank_layer()(torch.randn(49, 16, dtype=F64))


def test_bad_token_mask_raises():
    with pytest.raises(ValueError, match="token_mask"):
        one_rank_layer()(torch.randn(4, 16, dtype=F64), torch.ones(5, dtype=torch.bool))


def test_world_size_mismatch_raises():
    with pytest.raises(ValueError, match="ep_size"):
        MoonEPMoELayer(make_config(2))


def test_symmetric_world_without_its_setup_raises_at_construction():
    """No GPU: a ValueError saying so; a GPU but no process group: a RuntimeError naming init_symmetric."""
    with pytest.raises((ValueError, RuntimeError), match="CUDA|init_symmetric"):
        one_rank_layer(world="symmetric")


def test_destroy_twice_then_use_raises():
    layer = one_rank_layer()
    layer.destroy()
    layer.destroy()
    assert layer.buffer.destroyed
    with pytest.raises(RuntimeError, match="destroyed"):
        layer(torch.randn(4, 16, dtype=F64))


def test_layers_of_one_shape_on_one_world_share_one_buffer():
    """`MoEConfig.share_buffer`: one Buffer per shape and world, kept while a layer uses it. `destroy()` gives
    one layer's share back (that layer cannot run any more; the others can), the last user destroys it, and
    a layer garbage-collected gives its share back too. Layers built without a world share this process's
    one-rank world of their device."""
    world, x = single_world(), torch.randn(4, 16, dtype=F64)
    a, b = MoonEPMoELayer(make_config(1), world), MoonEPMoELayer(make_config(1), world)
    other_shape = MoonEPMoELayer(make_config(1, max_tokens_per_rank=24), world)
    own = MoonEPMoELayer(make_config(1, share_buffer=False), world)
    assert a.buffer is b.buffer and other_shape.buffer is not a.buffer and own.buffer is not a.buffer
    first, second = one_rank_layer(), one_rank_layer()
    assert first.world is second.world and first.buffer is second.buffer and first.buffer is not a.buffer
    a.destroy()
    a.destroy()
    assert not b.buffer.destroyed
    with pytest.raises(RuntimeError, match="was destroyed"):
        a(x)
    assert b(x).shape == x.shape
    b.destroy()
    assert b.buffer.destroyed and not own.buffer.destroyed
    c = MoonEPMoELayer(make_config(1), world)
    buffer = c.buffer
    assert buffer is not b.buffer and not buffer.destroyed
    del c
    gc.collect()
    assert buffer.destroyed


def test_a_buffer_destroyed_directly_is_never_handed_to_a_new_layer():
    """`layer.buffer.destroy()` by hand (not `layer.destroy()`, which gives the share back): a layer built
    afterwards gets a new Buffer, not the destroyed one, and runs; the first layer can still give its share
    back, which touches neither Buffer."""
    world, x = single_world(), torch.randn(4, 16, dtype=F64)
    first = MoonEPMoELayer(make_config(1), world)
    destroyed = first.buffer
    destroyed.destroy()
    second = MoonEPMoELayer(make_config(1), world)
    assert second.buffer is not destroyed and not second.buffer.destroyed
    assert second(x).shape == x.shape
    first.destroy()
    assert not second.buffer.destroyed
    second.destroy()
    assert second.buffer.destroyed


def test_failed_step_leaves_layer_usable():
    """A rejected step changes nothing: the next step gives exactly the dense reference's answer."""
    cfg = make_config(2)
    p = make_problem(cfg, seed=7, skew=20.0)
    want, _, _, _ = run_dense(p)

    def rank_fn(world):
        layer = build_layer(p, world)
        before = [t.clone() for t in (layer.experts.gate_up, layer.experts.down)]
        with pytest.raises(ValueError):
            layer(torch.randn(cfg.max_tokens_per_rank + 1, 16, dtype=F64))
        layer.buffer.validate = True  # the layer's own steps skip the id check: its router makes the ids
        with pytest.raises(ValueError):
            layer.buffer.dispatch(p.hidden[world.rank], torch.ones(48, 2, dtype=F64),
                                  torch.full((48, 2), 99, dtype=torch.int32),
                                  torch.zeros(cfg.num_experts, dtype=torch.int32))
        assert all(torch.equal(a, b) for a, b in zip(before, (layer.experts.gate_up, layer.experts.down),
                                                     strict=True))
        return layer(p.hidden[world.rank]).detach()

    for got, w in zip(run_ranks(rank_fn, 2), want, strict=True):
        torch.testing.assert_close(got, w["out"], **TOL)
