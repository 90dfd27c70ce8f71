"""reduce_grad behind the rest of the backward pass (`MoEConfig.overlap_reduce_grad`, `Buffer.wait_behind`).

The replicas' gradients are added into their home experts' on the comm stream while the backward pass goes
on (the layers before this one); the next routed operation on the EP group and the end of the pass wait for
it on the device. Checked: the gradients are bit-identical to reducing before the layer's backward returns,
over two micro-batches of a model of two MoE layers that share their Buffer and slot pools (skewed routing,
so replicas train on the peer); the layer reduces before returning wherever autograd would read the
gradients during the pass; on one GPU, with the comm stream held back, a GEMM of the layer before runs while
the reduction is still to come, and the results stay the same bits.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_grad_modes import micro_batches
from test_layer import build_layer, make_config, make_problem

from moonep_moe.comm.buffer import BEHIND, Buffer
from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import run_ranks, single_world


def spy_reduce(monkeypatch) -> list[bool]:
    """Every `Buffer.reduce_grad` call's `behind`, in order (all ranks)."""
    calls, reduce_grad = [], Buffer.reduce_grad

    def spy(self, *args, behind=False, **kwargs):
        calls.append(behind)
        return reduce_grad(self, *args, behind=behind, **kwargs)

    monkeypatch.setattr(Buffer, "reduce_grad", spy)
    return calls


def two_layer_steps(problems: list, overlap: bool) -> list[dict]:
    """Per rank: two MoE layers of the problems' config (sharing their Buffer and slot pools), the second on
    the first's output, one forward + backward per problem without zeroing; the expert gradients of both
    layers, the input's, and whether an operation was left behind after each backward returned."""
    cfg = problems[0].cfg.model_copy(update={"overlap_reduce_grad": overlap})
    p0 = type(problems[0])(**{**vars(problems[0]), "cfg": cfg})

    def rank_fn(world):
        layers = [build_layer(p0, world) for _ in range(2)]
        left = []
        for p in problems:
            x = p.hidden[world.rank].clone().requires_grad_()
            layers[1](layers[0](x)).backward(p.grad_out[world.rank])
            left.append(bool(world.globals.get(BEHIND)))
        grads = {f"{i}.{name}.{kind}": value.clone()
                 for i, layer in enumerate(layers) for name in ("gate_up", "down")
                 for kind, value in (("grad", getattr(layer.experts, name).grad),
                                     ("main_grad", getattr(getattr(layer.experts, name), "main_grad", None)))
                 if value is not None}
        result = dict(grads, x=x.grad, left=left,
                      slots_used=max(int(layer.balance_stats()["slots_used"].max()) for layer in layers))
        for layer in layers:
            layer.destroy()
        return result

    return run_ranks(rank_fn, cfg.ep_size)


@pytest.mark.parametrize("mode", ["param", "main_grad"])
def test_reduce_grad_behind_the_backward_pass_gives_the_same_gradients(monkeypatch, mode):
    p = make_problem(make_config(2, expert_grad_dtype=mode), seed=97, skew=100.0)
    problems = micro_batches(p, 2)
    want = two_layer_steps(problems, overlap=False)
    calls = spy_reduce(monkeypatch)
    got = two_layer_steps(problems, overlap=True)
    assert got[0]["slots_used"] > 0, "no replica: nothing to reduce"
    assert calls == [True] * 8, "every reduction (2 ranks x 2 layers x 2 micro-batches) left behind"
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["left"] == [False, False], f"rank {rank}: the end of the backward pass did not wait"
        assert g.keys() == w.keys()
        for key in w:
            if isinstance(w[key], torch.Tensor):
                assert torch.equal(g[key], w[key]), f"rank {rank}: {key} differs"


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("how", ["none", "autograd.grad", "register_hook", "post_accumulate_grad_hook",
                                 "grad of other strides"])
def test_reduce_grad_runs_before_returning_where_autograd_reads_the_gradients(monkeypatch, how):
    """Two ranks: the layer leaves reduce_grad behind only where autograd keeps the gradients unread until
    the pass ends (as handed over, or returned by `torch.autograd.grad`); with a hook on a weight, or a
    `.grad` autograd must add into (here a zero one of other strides, which the GEMMs do not add into), it
    reduces before returning. The gradients are the same either way."""
    p = make_problem(make_config(2, overlap_reduce_grad=True), seed=98, skew=100.0)
    want = run_ranks(lambda world: _plain_grads(p, world), 2)
    calls = spy_reduce(monkeypatch)

    def rank_fn(world):
        layer = build_layer(p, world)
        weights = (layer.experts.gate_up, layer.experts.down)
        if how == "register_hook":
            weights[1].register_hook(lambda grad: None)
        elif how == "post_accumulate_grad_hook":
            weights[0].register_post_accumulate_grad_hook(lambda weight: None)
        elif how == "grad of other strides":
            weights[0].grad = torch.zeros(weights[0].shape[::-1], dtype=weights[0].dtype).permute(2, 1, 0)
        x = p.hidden[world.rank].clone().requires_grad_()
        out = layer(x)
        if how == "autograd.grad":
            grads = torch.autograd.grad(out, weights, p.grad_out[world.rank])
        else:
            out.backward(p.grad_out[world.rank])
            grads = tuple(w.grad for w in weights)
        result = dict(grads=[g.clone() for g in grads], left=bool(world.globals.get(BEHIND)))
        layer.destroy()
        return result

    got = run_ranks(rank_fn, 2)
    assert calls == [how in ("none", "autograd.grad")] * 2
    for g, w in zip(got, want, strict=True):
        assert not g["left"]
        for grad, ref in zip(g["grads"], w, strict=True):
            torch.testing.assert_close(grad.double(), ref, rtol=0, atol=0)


def _plain_grads(p, world) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's expert gradients without overlap_reduce_grad (one forward + backward)."""
    cfg = p.cfg.model_copy(update={"overlap_reduce_grad": False})
    layer = build_layer(type(p)(**{**vars(p), "cfg": cfg}), world)
    x = p.hidden[world.rank].clone().requires_grad_()
    layer(x).backward(p.grad_out[world.rank])
    grads = (layer.experts.gate_up.grad.clone(), layer.experts.down.grad.clone())
    layer.destroy()
    return grads


DELAY_CYCLES = 200_000_000  # ~0.1 s at an H100's or H200's clock: far longer than the host takes to queue
# the rest of the backward pass


@pytest.mark.gpu
def test_gpu_reduce_grad_runs_behind_the_layer_before_with_the_same_bits(monkeypatch):
    """One GPU: two EP-rank layers (`bench.ep_rank.as_ep_rank`, a plan filling two slots; their reduce_grad
    stands in local copies on the comm stream) on one world, so they share the slot pools, with a dense
    projection between them. Each reduction left behind first holds the comm stream (`torch.cuda._sleep`, only
    there: the combines on that stream are not held), so the second layer's reduction is still running when
    the projection's backward runs: the projection's weight gradient is done on the device before that
    reduction ends (CUDA events, after a step reducing before returning, so the host's first launches are
    not timed), and the gradients of both layers, the projection's and the input's are bit-identical to that
    step's (the first layer writes its slot gradients, in the shared pool, only after the reduction read
    them). The profiler trace of that backward (`reduce-behind.json`) is written under `$MOONEP_BENCH_OUT`
    when set."""
    from bench.ep_rank import RankPlan, as_ep_rank

    epn, tokens, hidden, ffn, top_k = 4, 2048, 2048, 1024, 4
    routes = tokens * top_k
    plan = RankPlan(ranks=2, rank=0, home_routes=(routes // 4, routes // 4, 0, routes // 8),
                    slot_routes=(0, routes // 4, 0, routes // 8), maxvio=1.0, sigma=0.1)
    reduced, run_behind = [], Buffer._run_behind

    def timed_run_behind(self, op, held):
        def held_back():  # on the comm stream (`Buffer._launch`), after the caller's queued work
            torch.cuda._sleep(DELAY_CYCLES)
            op()

        run_behind(self, held_back, held)
        reduced.append(torch.cuda.Event(enable_timing=True))
        reduced[-1].record(self._comm_stream())

    monkeypatch.setattr(Buffer, "_run_behind", timed_run_behind)

    def step(overlap: bool, trace: Path | None = None) -> tuple[list[torch.Tensor], float, float]:
        cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=2 * epn, top_k=top_k,
                        max_tokens_per_rank=tokens, dtype="bfloat16", grouped_gemm="torch",
                        overlap_reduce_grad=overlap)
        world = single_world("cuda")
        torch.manual_seed(0)
        layers = [as_ep_rank(MoonEPMoELayer(cfg, world), epn, plan) for _ in range(2)]
        between = torch.nn.Linear(hidden, hidden, bias=False, device="cuda", dtype=torch.bfloat16)
        between_done = torch.cuda.Event(enable_timing=True)
        between.weight.register_hook(lambda grad: between_done.record())  # after its weight-gradient GEMM
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = layers[1](between(layers[0](x)))
        reduced.clear()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out.backward(grad)
            torch.cuda.synchronize()
        if trace is not None:
            prof.export_chrome_trace(str(trace))
        assert not world.globals.get(BEHIND)
        result = [x.grad, between.weight.grad] + [getattr(layer.experts, name).grad
                                                  for layer in layers for name in ("gate_up", "down")]
        for layer in layers:
            layer.destroy()
        return result, start.elapsed_time(between_done), start.elapsed_time(reduced[0]) if reduced else 0.0

    out_dir = os.environ.get("MOONEP_BENCH_OUT")
    trace = None
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        trace = Path(out_dir) / "reduce-behind.json"
    want, _, _ = step(False)
    got, between_ms, reduce_ms = step(True, trace)
    assert len(reduced) == 2, "both layers' reductions left behind"
    assert between_ms < reduce_ms, (f"the projection's backward ({between_ms:.2f} ms) waited for the second "
                                    f"layer's reduction ({reduce_ms:.2f} ms)")
    names = ["x", "between"] + [f"layer{i}.{name}" for i in range(2) for name in ("gate_up", "down")]
    for name, g, w in zip(names, got, want, strict=True):
        assert torch.isfinite(w).all(), name
        assert torch.equal(g, w), f"{name} differs with reduce_grad behind the backward pass"
