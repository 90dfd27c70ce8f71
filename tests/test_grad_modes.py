"""The routed experts' gradient modes (`MoEConfig.expert_grad_dtype`) against the dense float64 reference.

"param" (the default): `.grad` in the parameters' dtype, fresh every step. "main_grad": a persistent fp32
(float64 for float64 weights) `main_grad` per home-expert parameter that wgrad and the replicas' reduction
add into across micro-batches, `.grad` left None. Skewed routing makes replicas, so the replicas' reduction
into the home gradients is checked too (R > 1).
"""

from __future__ import annotations

import dataclasses

import pydantic
import pytest
import torch
from test_layer import TOL, build_layer, make_config, make_problem, run_dense

from moonep_moe.comm.buffer import Buffer
from moonep_moe.config import MoEConfig
from moonep_moe.gemm import autotune
from moonep_moe.layers import moe
from moonep_moe.layers.function import MoonEPExperts
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks, single_world


def expert_grads(layer: MoonEPMoELayer) -> dict[str, torch.Tensor | None]:
    """What each mode leaves on the home experts, on the CPU in float64 (None where absent)."""
    grads = {}
    for name in ("gate_up", "down"):
        weight = getattr(layer.experts, name)
        for kind, value in (("grad", weight.grad), ("main_grad", getattr(weight, "main_grad", None))):
            grads[f"{name}.{kind}"] = None if value is None else value.detach().cpu().double()
    return grads


def micro_batches(p, steps: int) -> list:
    """`steps` problems with the weights of `p` and new tokens and output gradients (drawn on this thread)."""
    gen = torch.Generator().manual_seed(123)
    shape = p.hidden[0].shape

    def draw():
        return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in p.hidden]

    return [p] + [dataclasses.replace(p, hidden=draw(), grad_out=draw()) for _ in range(steps - 1)]


def run_steps(problems: list, zero_after: int | None = None) -> list[dict]:
    """One layer per rank, one forward + backward per problem without zeroing anything (but
    `zero_main_grad()` after step `zero_after`); each rank's expert gradients and router gradient at the end,
    and how many slots its last step used."""
    p0 = problems[0]

    def rank_fn(world):
        layer = build_layer(p0, world)
        for step, p in enumerate(problems):
            x = p.hidden[world.rank].to(p.cfg.torch_dtype).requires_grad_()
            layer(x).backward(p.grad_out[world.rank].to(p.cfg.torch_dtype))
            if step == zero_after:
                layer.zero_main_grad()
        result = dict(expert_grads(layer), router=layer.router.weight.grad.double(),
                      slots_used=layer.balance_stats()["slots_used"].clone())
        layer.destroy()
        return result

    return run_ranks(rank_fn, p0.cfg.ep_size)


def summed_dense_grads(problems: list) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Every expert's gradient summed over the problems (and ranks), and the largest expert maxvio."""
    dense = [run_dense(p) for p in problems]
    return (sum(d[1] for d in dense), sum(d[2] for d in dense), max(d[3] for d in dense))


def assert_home_grads(got: list[dict], kind: str, grad_gate_up, grad_down, epn: int) -> None:
    for rank, g in enumerate(got):
        home = slice(rank * epn, (rank + 1) * epn)
        torch.testing.assert_close(g[f"gate_up.{kind}"], grad_gate_up[home], **TOL)
        torch.testing.assert_close(g[f"down.{kind}"], grad_down[home], **TOL)


def test_default_mode_is_param_with_grads_in_the_parameters_dtype():
    """The fast mode is the default: a bf16 layer built with every setting at its default gives its experts
    bf16 `.grad` and allocates no `main_grad` (an fp32 default cost 1.37x the step and +40 GiB)."""
    cfg = MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, max_tokens_per_rank=16)
    assert cfg.expert_grad_dtype == "param"
    layer = MoonEPMoELayer(cfg)
    layer(torch.randn(16, 64, dtype=torch.bfloat16)).sum().backward()
    grads = expert_grads(layer)
    assert layer.experts.gate_up.grad.dtype == layer.experts.down.grad.dtype == torch.bfloat16
    assert grads["gate_up.main_grad"] is None and grads["down.main_grad"] is None
    assert not layer._state.main_grad


def test_removed_float32_mode_names_the_replacements():
    with pytest.raises(pydantic.ValidationError, match="expert_grad_dtype='float32' was removed.*'param'.*"
                                                       "'main_grad'"):
        make_config(1, expert_grad_dtype="float32")


@pytest.mark.parametrize("R", [1, 4])
@pytest.mark.parametrize("mode", ["param", "main_grad"])
def test_every_mode_matches_dense_with_replicas(mode, R):
    """One step, skewed routing (replicas on R = 4): the mode's home gradients equal the float64 reference's,
    and the other kind stays absent."""
    p = make_problem(make_config(R, expert_grad_dtype=mode), seed=60 + R, skew=100.0)
    got = run_steps([p])
    grad_gate_up, grad_down, maxvio = summed_dense_grads([p])
    assert maxvio >= 10
    assert R == 1 or int(got[0]["slots_used"].max()) > 0
    assert_home_grads(got, "grad" if mode == "param" else "main_grad", grad_gate_up, grad_down, 32 // R)
    other = "main_grad" if mode == "param" else "grad"
    assert all(g[f"{name}.{other}"] is None for g in got for name in ("gate_up", "down"))


@pytest.mark.parametrize("R", [1, 4])
def test_main_grad_accumulates_micro_batches_until_zeroed(R):
    """Three micro-batches without zeroing: `main_grad` is the sum of the three steps' reference gradients
    (wgrad adds into it and replicas are reduced into it); the router's `.grad` accumulates as usual. After
    `zero_main_grad()` following the first step, it holds the last two steps only."""
    p = make_problem(make_config(R, expert_grad_dtype="main_grad"), seed=70 + R, skew=100.0)
    problems = micro_batches(p, 3)
    grad_gate_up, grad_down, _ = summed_dense_grads(problems)
    got = run_steps(problems)
    assert R == 1 or int(got[0]["slots_used"].max()) > 0
    assert_home_grads(got, "main_grad", grad_gate_up, grad_down, 32 // R)
    dense = [run_dense(q)[0] for q in problems]
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["router"], sum(d[rank]["grad_router"] for d in dense), **TOL)
        assert g["gate_up.grad"] is None and g["down.grad"] is None
    grad_gate_up, grad_down, _ = summed_dense_grads(problems[1:])
    assert_home_grads(run_steps(problems, zero_after=0), "main_grad", grad_gate_up, grad_down, 32 // R)


def test_attached_main_grad_is_used_and_a_wrong_one_is_refused():
    """A `main_grad` attached beforehand (e.g. a view of a grad buffer) is the one added into; one of the
    wrong dtype fails with the parameter and the rank named."""
    p = make_problem(make_config(1, expert_grad_dtype="main_grad"), seed=80)
    layer = build_layer(p, single_world())
    flat = torch.zeros(layer.experts.gate_up.numel() + layer.experts.down.numel(), dtype=torch.float64)
    layer.experts.gate_up.main_grad = flat[:layer.experts.gate_up.numel()].view_as(layer.experts.gate_up)
    layer.experts.down.main_grad = flat[layer.experts.gate_up.numel():].view_as(layer.experts.down)
    layer(p.hidden[0]).backward(p.grad_out[0])
    _, grad_gate_up, grad_down, _ = run_dense(p)
    torch.testing.assert_close(flat, torch.cat([grad_gate_up.flatten(), grad_down.flatten()]), **TOL)
    layer.experts.down.main_grad = torch.zeros_like(layer.experts.down, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"experts.down.main_grad on rank 0 must be a contiguous "
                                         r"torch.float64 tensor"):
        layer(p.hidden[0]).backward(p.grad_out[0])


def megatron_grad_buffer(weights: tuple[torch.nn.Parameter, ...]) -> tuple[torch.Tensor, list]:
    """Megatron-Core DDP's side of the protocol, by hand: every `main_grad` a view of one flat buffer, the
    `grad_added_to_main_grad` flag on each parameter, and its hook after gradient accumulation (adds `.grad`
    into `main_grad` unless the flag says the layer already did, then drops `.grad`). Returns the buffer and
    the list the hook appends each parameter to when it fires."""
    flat = torch.zeros(sum(w.numel() for w in weights), dtype=torch.float64)
    fired, start = [], 0
    for weight in weights:
        weight.main_grad = flat[start:start + weight.numel()].view_as(weight)
        weight.grad_added_to_main_grad = False
        start += weight.numel()

        def hook(param):
            fired.append(param)
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad)
            param.grad = None

        weight.register_post_accumulate_grad_hook(hook)
    return flat, fired


def test_main_grad_follows_megatrons_grad_buffer_protocol():
    """Under a Megatron-style grad buffer (`megatron_grad_buffer`) the layer adds wgrad into the buffer, sets
    `grad_added_to_main_grad` and hands autograd a placeholder, so the DDP hook fires once per parameter
    (bucket readiness) and adds nothing twice; `zero_main_grad()` zeroes the buffer in place (the
    parameters' `main_grad` stay its views) and clears the flags, so the next backward adds into the same
    buffer."""
    p = make_problem(make_config(1, expert_grad_dtype="main_grad"), seed=82)
    problems = micro_batches(p, 2)
    layer = build_layer(p, single_world())
    weights = (layer.experts.gate_up, layer.experts.down)
    flat, fired = megatron_grad_buffer(weights)
    for step, q in enumerate(problems):
        layer(q.hidden[0]).backward(q.grad_out[0])
        assert sorted(map(id, fired)) == sorted(map(id, weights)), f"step {step}: fired {len(fired)} times"
        assert all(w.grad_added_to_main_grad and w.grad is None for w in weights)
        _, grad_gate_up, grad_down, _ = run_dense(q)
        torch.testing.assert_close(flat, torch.cat([grad_gate_up.flatten(), grad_down.flatten()]), **TOL)
        layer.zero_main_grad()
        assert not flat.any() and not any(w.grad_added_to_main_grad for w in weights)
        views = [flat.data_ptr(), flat[weights[0].numel():].data_ptr()]
        assert [w.main_grad.data_ptr() for w in weights] == views
        fired.clear()


@pytest.mark.parametrize("how", ["requires_grad=False", "backward(inputs=)"])
@pytest.mark.parametrize("mode", ["param", "main_grad"])
@pytest.mark.parametrize("frozen", [("gate_up", "down"), ("down",)], ids=["both", "down"])
def test_frozen_experts_get_no_weight_gradient_while_the_input_and_router_get_theirs(monkeypatch, mode,
                                                                                     frozen, how):
    """Home-expert parameters left out of the backward (every rank alike; 2 ranks, skewed routing, so
    replicas train on the peer), by `requires_grad=False` or by a `backward(inputs=...)` without them (the
    input-gradient half of a split backward): no wgrad GEMM and no `reduce_grad` for them, no `.grad` and
    no `main_grad`; the input, the router and a trainable projection get the float64 reference's
    gradients."""
    p = make_problem(make_config(2, expert_grad_dtype=mode), seed=83, skew=100.0)
    reduced, reduce_grad = [], Buffer.reduce_grad

    def reduce_spy(self, plan, gate, up, down, *args, **kwargs):
        reduced.append((gate is not None, down is not None))
        return reduce_grad(self, plan, gate, up, down, *args, **kwargs)

    monkeypatch.setattr(Buffer, "reduce_grad", reduce_spy)

    def rank_fn(world):
        layer = build_layer(p, world)
        if how == "requires_grad=False":
            for name in frozen:
                getattr(layer.experts, name).requires_grad_(False)
        gemm, wgrads = layer._state.gemm, []
        wgrad = gemm.wgrad

        def wgrad_spy(dy, x, offs_g, out, accumulate=True):
            wgrads.append("gate_up" if x.shape[1] == p.cfg.hidden_size else "down")  # x: [rows, H or F]
            return wgrad(dy, x, offs_g, out, accumulate)

        gemm.wgrad = wgrad_spy
        x = p.hidden[world.rank].clone().requires_grad_()
        wanted = None
        if how == "backward(inputs=)":
            wanted = [x, layer.router.weight] + [getattr(layer.experts, name)
                                                 for name in ("gate_up", "down") if name not in frozen]
        layer(x).backward(p.grad_out[world.rank], inputs=wanted)
        result = dict(expert_grads(layer), x=x.grad, router=layer.router.weight.grad,
                      slots_used=int(layer.balance_stats()["slots_used"].max()), wgrads=wgrads)
        layer.destroy()
        return result

    got = run_ranks(rank_fn, 2)
    dense, grad_gate_up, grad_down, _ = run_dense(p)
    assert got[0]["slots_used"] > 0
    reference = {"gate_up": grad_gate_up, "down": grad_down}
    kind = "grad" if mode == "param" else "main_grad"
    trained = [name for name in reference if name not in frozen]
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["x"], dense[rank]["grad_x"], **TOL)
        torch.testing.assert_close(g["router"], dense[rank]["grad_router"], **TOL)
        assert sorted(g["wgrads"]) == sorted(trained), f"rank {rank}: wgrad GEMMs for {g['wgrads']}"
        for name in frozen:
            assert g[f"{name}.grad"] is None and g[f"{name}.main_grad"] is None, f"rank {rank}: {name}"
        for name in trained:
            home = slice(rank * 16, (rank + 1) * 16)
            torch.testing.assert_close(g[f"{name}.{kind}"], reference[name][home], **TOL)
    assert reduced == [("gate_up" in trained, "down" in trained)] * 2 if trained else reduced == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["param", "main_grad"])
def test_bf16_expert_gradients_in_every_mode(mode, device):
    """bf16 experts, skewed routing (2 ranks on the CPU: replicas reduced home): every expert's gradient is
    within bf16 tolerance of the float64 reference, in the parameters' dtype ("param") or in an fp32
    `main_grad` ("main_grad")."""
    R = 2 if device == "cpu" else 1
    cfg = make_config(R, hidden_size=64, ffn_hidden_size=32, dtype="bfloat16", expert_grad_dtype=mode,
                      router={"dtype": "float32", "expert_bias": True},
                      grouped_gemm="reference" if device == "cpu" else "auto")
    p = make_problem(cfg, seed=41, skew=100.0)
    bf16 = [t.bfloat16().double() for t in p.hidden + [p.gate_up_e2fh, p.down_ehf]]  # what the layer sees
    p.hidden, p.gate_up_e2fh, p.down_ehf = bf16[:-2], bf16[-2], bf16[-1]

    def rank_fn(world):
        layer = build_layer(p, world)
        x = p.hidden[world.rank].to(device, torch.bfloat16)
        layer(x).backward(p.grad_out[world.rank].to(device, torch.bfloat16))
        weights = (layer.experts.gate_up, layer.experts.down)
        grads = [w.grad if mode == "param" else w.main_grad for w in weights]
        layer.destroy()
        return grads

    got = run_ranks(rank_fn, R, device=device)
    _, grad_gate_up, grad_down, maxvio = run_dense(p)
    assert R == 1 or maxvio >= 10
    epn = cfg.num_experts // R
    for rank, grads in enumerate(got):
        home = slice(rank * epn, (rank + 1) * epn)
        for name, grad, full in zip(("gate_up", "down"), grads, (grad_gate_up, grad_down), strict=True):
            assert grad.dtype == (torch.bfloat16 if mode == "param" else torch.float32)
            error = float((grad.cpu().double() - full[home]).norm() / full.norm())  # a rank may get no route
            assert error < 1e-2, f"{name} on rank {rank}: relative error {error:.1e}"


def rounded_problem(cfg: MoEConfig, seed: int):
    """A skewed problem whose tokens and expert weights are exactly representable in `cfg`'s dtype (what the
    layer sees), so the float64 reference differs from the layer only by its arithmetic."""
    p = make_problem(cfg, seed=seed, skew=100.0)
    rounded = [t.to(cfg.torch_dtype).double() for t in p.hidden + [p.gate_up_e2fh, p.down_ehf]]
    p.hidden, p.gate_up_e2fh, p.down_ehf = rounded[:-2], rounded[-2], rounded[-1]
    return p


@pytest.mark.parametrize("R", [1, 4])
def test_param_mode_home_grads_are_the_torch_gemm_output(monkeypatch, R):
    """"param" mode on `torch._grouped_mm` (float32 on the CPU): the home gradients the Function hands
    autograd are the very tensors the wgrad GEMM returned (no copy into separately allocated gradients;
    autograd then keeps them as `.grad`, see the GPU test), and every expert's `.grad` still equals the
    float64 reference, with replicas reduced home (R = 4, skewed routing)."""
    made, handed = [], []
    grouped_mm, backward = torch._grouped_mm, MoonEPExperts.backward

    def gemm_spy(*args, **kwargs):
        made.append(grouped_mm(*args, **kwargs))
        return made[-1]

    def backward_spy(ctx, grad_out_sh):
        grads = backward(ctx, grad_out_sh)
        handed.extend(grads[4:6])
        return grads

    monkeypatch.setattr(torch, "_grouped_mm", gemm_spy)
    monkeypatch.setattr(MoonEPExperts, "backward", staticmethod(backward_spy))
    cfg = make_config(R, dtype="float32", router={"dtype": "float32", "expert_bias": True},
                      grouped_gemm="torch")
    p = rounded_problem(cfg, seed=61)

    def rank_fn(world):
        layer = build_layer(p, world)
        layer(p.hidden[world.rank].float()).backward(p.grad_out[world.rank].float())
        grads = [layer.experts.gate_up.grad, layer.experts.down.grad]
        slots_used = int(layer.balance_stats()["slots_used"].max())
        layer.destroy()
        return grads, slots_used

    got = run_ranks(rank_fn, R)
    assert len(handed) == 2 * R and all(any(grad is out for out in made) for grad in handed)
    _, grad_gate_up, grad_down, _ = run_dense(p)
    assert R == 1 or got[0][1] > 0
    epn = cfg.num_experts // R
    for rank, (grads, _) in enumerate(got):
        home = slice(rank * epn, (rank + 1) * epn)
        for grad, full in zip(grads, (grad_gate_up, grad_down), strict=True):
            assert grad.dtype == torch.float32
            torch.testing.assert_close(grad.double(), full[home], rtol=1e-4, atol=1e-5)


def home_and_mode(dy, x, out, accumulate) -> tuple[int | None, bool]:
    """A wgrad call's home part (its data pointer, None when the GEMM makes it) and `accumulate`."""
    return None if out[0] is None else out[0].data_ptr(), accumulate


def spy_wgrad(layer: MoonEPMoELayer, record=home_and_mode) -> list:
    """`record(dy, x, out, accumulate)` of each wgrad call, in order (default: `home_and_mode`)."""
    gemm, calls = layer._state.gemm, []
    wgrad = gemm.wgrad

    def spy(dy, x, offs_g, out, accumulate=True):
        calls.append(record(dy, x, out, accumulate))
        return wgrad(dy, x, offs_g, out, accumulate)

    gemm.wgrad = spy
    return calls


@pytest.mark.parametrize("R", [1, 4])
def test_param_mode_adds_later_micro_batches_into_grad(R):
    """Three micro-batches in "param" mode without zeroing: the first makes fresh home gradients; from the
    second on, the weight-gradient GEMMs add into the `.grad` that autograd would have added into, and
    autograd keeps that same memory as `.grad` (no second gradient-sized tensor, no add pass). `.grad` is the
    sum of the three steps' reference gradients (replicas reduced home, R = 4, skewed routing), and the
    post-accumulate hooks fire once per micro-batch as with autograd's own accumulation."""
    p = make_problem(make_config(R), seed=80 + R, skew=100.0)
    problems = micro_batches(p, 3)

    def rank_fn(world):
        layer = build_layer(p, world)
        calls, fired = spy_wgrad(layer), []
        weights = (layer.experts.gate_up, layer.experts.down)
        for weight in weights:
            weight.register_post_accumulate_grad_hook(lambda w: fired.append(w.grad.data_ptr()))
        ptrs = []
        for q in problems:
            layer(q.hidden[world.rank].clone().requires_grad_()).backward(q.grad_out[world.rank])
            ptrs.append([weight.grad.data_ptr() for weight in weights])
        result = dict(expert_grads(layer), calls=calls, ptrs=ptrs, fired=fired,
                      slots_used=int(layer.balance_stats()["slots_used"].max()))
        layer.destroy()
        return result

    got = run_ranks(rank_fn, R)
    grad_gate_up, grad_down, _ = summed_dense_grads(problems)
    assert R == 1 or got[0]["slots_used"] > 0
    assert_home_grads(got, "grad", grad_gate_up, grad_down, 32 // R)
    for g in got:
        first = g["ptrs"][0]
        assert all(ptrs == first for ptrs in g["ptrs"]), "autograd copied the accumulated .grad"
        down_ptr, gate_up_ptr = first[1], first[0]  # wgrad runs down first
        assert g["calls"] == [(None, False)] * 2 + [(down_ptr, True), (gate_up_ptr, True)] * 2
        assert sorted(g["fired"]) == sorted(first * 3)


@pytest.mark.parametrize("mode", ["param", "main_grad"])
@pytest.mark.parametrize("R", [1, 4])
def test_wgrad_gets_contiguous_rows_and_gradients(mode, R):
    """What the deep_gemm wgrad's kernel needs and refuses otherwise: over two micro-batches with replicas
    (R = 4, skewed) and on one rank (which gathers its rows again for gate_up's wgrad), every wgrad call's
    dy, x and given parts (`.grad`, `main_grad`, the slots) are contiguous."""
    p = make_problem(make_config(R, expert_grad_dtype=mode), seed=90 + R, skew=100.0)
    problems = micro_batches(p, 2)

    def rank_fn(world):
        layer = build_layer(p, world)
        seen = spy_wgrad(layer, lambda dy, x, out, accumulate: [t.is_contiguous() for t in (dy, x, *out)
                                                                if t is not None])
        for q in problems:
            layer(q.hidden[world.rank].clone().requires_grad_()).backward(q.grad_out[world.rank])
        used = int(layer.balance_stats()["slots_used"].max())
        layer.destroy()
        return seen, used

    got = run_ranks(rank_fn, R)
    assert R == 1 or got[0][1] > 0
    for seen, _ in got:
        assert len(seen) == 4 and all(all(flags) for flags in seen), seen


@pytest.mark.parametrize("mode", ["param", "main_grad"])
def test_replica_gradients_overwrite_their_slots_in_param_mode_and_use_an_fp32_pool_in_main_grad(mode):
    """"param": the replicas' gradients are written over their own slot weights (`grads_in_slots`), so no
    slot-gradient pool is allocated (a DeepSeek-V3 rank's would be 5.25 GiB of fp32); "main_grad": a shared
    fp32 pool. Both give the float64 reference's home gradients over two micro-batches with replicas, the
    second adding into the first's (in "param" mode the used slots are cleared before the GEMM adds)."""
    R = 4
    p = make_problem(make_config(R, expert_grad_dtype=mode), seed=90, skew=100.0)
    problems = micro_batches(p, 2)

    def rank_fn(world):
        layer = build_layer(p, world)
        for q in problems:
            layer(q.hidden[world.rank].clone().requires_grad_()).backward(q.grad_out[world.rank])
        slots = [rows.slots for rows in layer.experts.rows]
        pools = [key for key in world.globals if isinstance(key, tuple) and key[0] == "slot_grads"]
        result = dict(expert_grads(layer), pools=pools,
                      in_slots=[g is s for g, s in zip(layer.experts.slot_grads, slots, strict=True)],
                      slots_used=int(layer.balance_stats()["slots_used"].max()))
        layer.destroy()
        return result

    got = run_ranks(rank_fn, R)
    grad_gate_up, grad_down, _ = summed_dense_grads(problems)
    assert got[0]["slots_used"] > 0
    assert_home_grads(got, "grad" if mode == "param" else "main_grad", grad_gate_up, grad_down, 32 // R)
    for g in got:
        if mode == "param":
            assert g["in_slots"] == [True, True] and g["pools"] == []
        else:
            assert g["in_slots"] == [False, False] and len(g["pools"]) == 2


@pytest.mark.gpu
def test_gpu_replica_gradients_in_their_slots_over_two_micro_batches():
    """bf16 on one GPU (the threads world trains one rank per GPU): one EP rank whose slots a plan fills
    (`bench.ep_rank.as_ep_rank`: 4 home experts and 4 slots on the arena, slot j holding expert j, prefetch
    and reduce_grad stood in for by local copies), "param" mode, the Triton wgrad, two micro-batches (the
    second clears the used slots on the device, then adds). Its home gradients equal, within bf16 tolerance, a
    float64 layer's on the CPU with no slots: 8 experts (expert 4 + j a copy of expert j) routed by the same
    plan, each home gradient the sum of both copies'; and no fp32 slot-gradient pool exists."""
    from bench.ep_rank import RankPlan, as_ep_rank, planned_topk

    epn, tokens, hidden, ffn, top_k = 4, 64, 1024, 512, 2
    plan = RankPlan(ranks=2, rank=0, home_routes=(40, 30, 0, 20), slot_routes=(0, 10, 0, 28), maxvio=1.0,
                    sigma=0.1)
    gen = torch.Generator().manual_seed(92)
    home = [torch.randn(epn, *shape, generator=gen, dtype=torch.float64).div(shape[-1] ** 0.5)
            .bfloat16().double()
            for shape in ((2 * ffn, hidden), (hidden, ffn))]
    state = {"router.weight": torch.randn(2 * epn, hidden, generator=gen, dtype=torch.float64) / hidden**0.5,
             "experts.gate_up_proj": home[0].repeat(2, 1, 1), "experts.down_proj": home[1].repeat(2, 1, 1)}
    # (x, grad_out) per micro-batch; gradients 2^-6 of the weights' scale, so that a slot gradient added onto
    # its slot's weights instead of written over them would show far beyond bf16's error
    steps = [[torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).mul(scale).bfloat16().double()
              for scale in (1.0, 2.0**-6)] for _ in range(2)]

    def two_micro_batches(device: str, dtype: str, backend: str, rank: bool) -> tuple[dict, list]:
        cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=2 * epn, top_k=top_k,
                        max_tokens_per_rank=tokens, dtype=dtype, token_padding=16, grouped_gemm=backend,
                        router={"dtype": "float32" if device == "cuda" else "float64"})
        world = single_world(device)
        layer = MoonEPMoELayer(cfg, world)
        dtypes = {"router.weight": layer.router.weight.dtype}
        layer.load_state_dict({k: v.to(device, dtypes.get(k, cfg.torch_dtype)) for k, v in state.items()})
        if rank:
            as_ep_rank(layer, epn, plan)
        else:
            topk = planned_topk(plan, tokens, top_k).to(device)
            layer.router.register_forward_hook(lambda module, args, out: out._replace(topk_experts_tk=topk))
        for x, grad_out in steps:
            x = x.to(device, cfg.torch_dtype).requires_grad_()
            layer(x).backward(grad_out.to(device, cfg.torch_dtype))
        pools = [key for key in world.globals if isinstance(key, tuple) and key[0] == "slot_grads"]
        grads = {name: getattr(layer.experts, name).grad.double().cpu() for name in ("gate_up", "down")}
        if not rank:
            grads = {name: grad[:epn] + grad[epn:] for name, grad in grads.items()}
        assert not rank or layer.experts.rows[0].compute is not None, "the arena joins home and slots"
        layer.destroy()
        return grads, pools

    want, _ = two_micro_batches("cpu", "float64", "reference", rank=False)
    got, pools = two_micro_batches("cuda", "bfloat16", "triton", rank=True)
    assert pools == []
    for name in ("gate_up", "down"):
        error = float((got[name] - want[name]).norm() / want[name].norm())
        assert error < 2e-2, f"{name}: relative error {error:.1e} against float64"


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=x)", "register_hook"])
def test_param_mode_leaves_grad_to_autograd_where_it_must_see_the_step_alone(how):
    """Where autograd must not fold this micro-batch's gradient into `.grad` (`torch.autograd.grad`) or a
    hook wants it alone (`register_hook` on the weight), the GEMMs make a fresh gradient: `.grad` keeps the
    first step's values (or becomes the sum, with the hook seeing only the second step's), and what is
    returned or seen is the second step's reference gradient. A `backward(inputs=)` without the weights runs
    no weight-gradient GEMM at all and leaves `.grad` as it was."""
    p = make_problem(make_config(1), seed=85, skew=100.0)
    problems = micro_batches(p, 2)

    def run(world):
        layer = build_layer(p, world)
        weights = (layer.experts.gate_up, layer.experts.down)
        seen = []
        if how == "register_hook":
            for weight in weights:
                weight.register_hook(lambda grad: seen.append(grad.detach().double().clone()))
        layer(problems[0].hidden[0]).backward(problems[0].grad_out[0])
        seen.clear()
        calls = spy_wgrad(layer)
        x = problems[1].hidden[0].clone().requires_grad_()
        out = layer(x)
        if how == "autograd.grad":
            seen = [g.double() for g in torch.autograd.grad(out, weights, problems[1].grad_out[0])]
        else:
            out.backward(problems[1].grad_out[0], inputs=[x] if how == "backward(inputs=x)" else None)
        result = dict(expert_grads(layer), calls=calls, seen=seen)
        layer.destroy()
        return result

    (got,) = run_ranks(run, 1)
    _, first_gate_up, first_down, _ = run_dense(problems[0])
    _, second_gate_up, second_down, _ = run_dense(problems[1])
    if how == "backward(inputs=x)":  # no weight gradient wanted: no weight-gradient GEMM
        assert got["calls"] == [] and got["seen"] == []
    else:
        assert got["calls"] == [(None, False)] * 2
        assert len(got["seen"]) == 2
        torch.testing.assert_close(got["seen"][0], second_gate_up, **TOL)
        torch.testing.assert_close(got["seen"][1], second_down, **TOL)
    if how == "register_hook":
        first_gate_up, first_down = first_gate_up + second_gate_up, first_down + second_down
    torch.testing.assert_close(got["gate_up.grad"], first_gate_up, **TOL)
    torch.testing.assert_close(got["down.grad"], first_down, **TOL)


@pytest.mark.parametrize("writes_rows", [True, False], ids=["gemm-writes-rows", "gemm-own-output"])
@pytest.mark.parametrize("R", [1, 4])
def test_expert_block_reads_and_writes_the_buffer_rows_in_place(R, writes_rows):
    """Backward's dispatch hands the grouped GEMMs the Buffer's own rows (`zero_copy=True`: no `[NvS, H]`
    copy), and the GEMM before each combine (forward's down, backward's gate_up dgrad) writes its rows into
    them where its backend takes an `out` (the reference does), so combine copies nothing in; where the
    backend makes its own output, combine copies it. Either way the layer's gradients (input, router,
    experts) equal the float64 reference with replicas (R = 4, skewed routing)."""
    p = make_problem(make_config(R), seed=90 + R, skew=100.0)

    def rank_fn(world):
        layer = build_layer(p, world)
        gemm, calls = layer._state.gemm, []
        fwd, dgrad = gemm.fwd, gemm.dgrad

        def spy(op, call):
            def run(a, weights, offs_g, slots_ready=None, out=None):
                result = call(a, weights, offs_g, slots_ready, out if writes_rows else None)
                calls.append((op, a.data_ptr(), result.data_ptr()))
                return result
            return run

        gemm.fwd, gemm.dgrad = spy("fwd", fwd), spy("dgrad", dgrad)
        x = p.hidden[world.rank].clone().requires_grad_()
        layer(x).backward(p.grad_out[world.rank])
        rows_ptr = layer.buffer.hidden_nvsh_buffer_view.data_ptr()
        result = dict(expert_grads(layer), x=x.grad, router=layer.router.weight.grad.double(),
                      slots_used=int(layer.balance_stats()["slots_used"].max()),
                      calls=[(op, a == rows_ptr, out == rows_ptr) for op, a, out in calls])
        layer.destroy()
        return result

    got = run_ranks(rank_fn, R)
    dense, grad_gate_up, grad_down, _ = run_dense(p)
    assert R == 1 or got[0]["slots_used"] > 0
    for g in got:  # (op, reads the rows, writes the rows) of fwd gate_up, fwd down, dgrad down, dgrad gate_up
        assert g["calls"] == [("fwd", R == 1, False), ("fwd", False, writes_rows), ("dgrad", True, False),
                              ("dgrad", False, writes_rows)]
    assert_home_grads(got, "grad", grad_gate_up, grad_down, 32 // R)
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["x"], dense[rank]["grad_x"], **TOL)
        torch.testing.assert_close(g["router"], dense[rank]["grad_router"], **TOL)


@pytest.mark.parametrize("R", [1, 2])
def test_forward_without_autograd_uses_the_dispatched_rows_in_place(R):
    """A forward autograd does not record (no_grad, or nothing requiring grad) makes no `[NvS, H]` copy of
    the dispatched rows for a backward that will not run: the expert GEMMs read the Buffer's own rows.
    Its output is the recording forward's, bit for bit (R = 2: replicas, skewed routing)."""
    p = make_problem(make_config(R), seed=70 + R, skew=100.0)

    def rank_fn(world):
        layer = build_layer(p, world)
        dispatch, copies = layer.buffer.dispatch, []

        def spy(*args, **kwargs):
            if kwargs.get("plan") is None:  # the forward's dispatch
                copies.append(not kwargs.get("zero_copy", False))
            return dispatch(*args, **kwargs)

        layer.buffer.dispatch = spy
        x = p.hidden[world.rank].clone()
        recorded = layer(x.clone().requires_grad_())
        with torch.no_grad():
            plain = layer(x)
        layer.destroy()
        return copies, recorded.detach(), plain

    for copies, recorded, plain in run_ranks(rank_fn, R):
        # one rank gathers the rows again in backward, so neither forward copies them
        assert copies == [R > 1, False]
        assert torch.equal(recorded, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_gpu_param_mode_backward_makes_no_second_gradient(monkeypatch, tmp_path, backend):
    """bf16 on CUDA, EP = 1, expert weights much larger than the activations: during backward the memory in
    use grows by less than 1.5x the home gradients (copying the GEMM's output into separately allocated
    gradients needed 2x), with `torch._grouped_mm` `.grad` is the GEMM's own output, and the gradients equal
    the `reference` backend's (same weights, same tokens) within bf16 tolerance."""
    monkeypatch.setattr(autotune, "_DEFAULT_CACHE", None)
    monkeypatch.setenv("MOONEP_MOE_CACHE", str(tmp_path))
    cuda = torch.device("cuda")
    made_ptrs, grouped_mm = set(), torch._grouped_mm

    def spy(*args, **kwargs):  # pointers only: holding the outputs would change the peak and make autograd
        out = grouped_mm(*args, **kwargs)  # copy them into .grad
        made_ptrs.add(out.data_ptr())
        return out

    monkeypatch.setattr(torch, "_grouped_mm", spy)

    def step(backend: str) -> tuple[list[torch.Tensor], int]:
        cfg = MoEConfig(hidden_size=1024, ffn_hidden_size=512, num_experts=64, top_k=2,
                        max_tokens_per_rank=64, dtype="bfloat16", grouped_gemm=backend)
        torch.manual_seed(5)  # the same experts for both backends
        layer = MoonEPMoELayer(cfg, device=cuda)
        gen = torch.Generator(cuda).manual_seed(6)
        x = torch.randn(64, 1024, device=cuda, dtype=torch.bfloat16, generator=gen)
        grad_out = torch.randn(64, 1024, device=cuda, dtype=torch.bfloat16, generator=gen)
        layer(x).backward(grad_out)  # compiles and tunes the kernels outside the measured step
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.backward(grad_out)
        grown = torch.cuda.max_memory_allocated() - before
        return [layer.experts.gate_up.grad, layer.experts.down.grad], grown

    want, _ = step("reference")
    got, grown = step(backend)
    grad_bytes = sum(grad.nbytes for grad in got)
    assert grown < 1.5 * grad_bytes, f"backward grew memory by {grown / grad_bytes:.2f}x the home gradients"
    for grad, reference in zip(got, want, strict=True):
        assert grad.dtype == torch.bfloat16
        if backend == "torch":
            assert grad.data_ptr() in made_ptrs
        error = float((grad.double() - reference.double()).norm() / reference.double().norm())
        assert error < 1e-2, f"relative error {error:.1e} against the reference backend"


@pytest.mark.gpu
def test_gpu_param_mode_later_micro_batch_adds_into_grad():
    """bf16 on CUDA, EP = 1, the Triton wgrad: the second micro-batch's backward grows the memory in use by
    less than half the home gradients (autograd's own accumulation first needs a fresh gradient of their
    size), and `.grad` after two micro-batches equals the `reference` backend's within bf16 tolerance."""
    cuda = torch.device("cuda")

    def two_steps(backend: str) -> tuple[list[torch.Tensor], int]:
        cfg = MoEConfig(hidden_size=1024, ffn_hidden_size=512, num_experts=64, top_k=2,
                        max_tokens_per_rank=64, dtype="bfloat16", grouped_gemm=backend)
        torch.manual_seed(7)  # the same experts for both backends
        layer = MoonEPMoELayer(cfg, device=cuda)
        gen = torch.Generator(cuda).manual_seed(8)
        xs, grad_outs = ([torch.randn(64, 1024, device=cuda, dtype=torch.bfloat16, generator=gen)
                          for _ in range(2)] for _ in range(2))
        layer(xs[0]).backward(grad_outs[0])  # compiles and tunes the kernels
        layer.zero_grad(set_to_none=True)
        layer(xs[0]).backward(grad_outs[0])
        out = layer(xs[1])
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.backward(grad_outs[1])
        grown = torch.cuda.max_memory_allocated() - before
        return [layer.experts.gate_up.grad, layer.experts.down.grad], grown

    want, _ = two_steps("reference")
    got, grown = two_steps("triton")
    grad_bytes = sum(grad.nbytes for grad in got)
    assert grown < 0.5 * grad_bytes, f"backward grew memory by {grown / grad_bytes:.2f}x the home gradients"
    for grad, reference in zip(got, want, strict=True):
        error = float((grad.double() - reference.double()).norm() / reference.double().norm())
        assert error < 1e-2, f"relative error {error:.1e} against the reference backend"


def test_grouped_gemm_is_chosen_for_the_layers_gradient_dtype(monkeypatch):
    """The layer asks for its grouped GEMM with the dtype its wgrad will write (`expert_grad_dtype`), the way
    it calls wgrad (home gradients made by the GEMM in "param" mode, added into in "main_grad" mode), its
    (home, slot) groups and the rows of a home group (S * K / home experts: a balanced plan leaves nearly
    every row home), so "auto" times wgrad as the layer will really run it."""
    seen = []
    select = moe.select_grouped_gemm

    def spy(*args, problem, **kwargs):
        seen.append((problem.grad_dtype, problem.fresh_home_grads, problem.groups, problem.rows_per_group))
        return select(*args, problem=problem, **kwargs)

    monkeypatch.setattr(moe, "select_grouped_gemm", spy)
    for mode in ("param", "main_grad"):
        MoonEPMoELayer(make_config(1, dtype="bfloat16", expert_grad_dtype=mode))
    run_ranks(lambda world: MoonEPMoELayer(make_config(4, dtype="bfloat16"), world).destroy(), 4)
    S, K = 48, 2  # make_config's max_tokens_per_rank and top_k
    one_rank = [(torch.bfloat16, True, (32, 0), S * K // 32), (torch.float32, False, (32, 0), S * K // 32)]
    assert seen == one_rank + [(torch.bfloat16, True, (8, 8), S * K // 8)] * 4
