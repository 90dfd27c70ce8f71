"""Shared experts overlapped with the routed ones (`MoEConfig.overlap_shared_experts`, `moe.overlapped_step`).

On CUDA the shared experts run on a side stream while the routed step runs on the current one, forward and
backward. Checked here: outputs and every gradient bit-identical with and without overlap (eager, on fresh
inputs with skewed routing, with the side stream delayed so a missing wait reads early; and in a CUDA
graph), the overlap visible in a profiler trace, and nothing changed on the CPU (one stream).

The profiler test writes its traces (`overlap-forward.json`, `overlap-backward.json`, chrome://tracing or
Perfetto) under `$MOONEP_BENCH_OUT` when set, and prints how long the two streams ran at once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from pathlib import Path

import pytest
import torch
from test_compile import taken_grads

from bench.common import captured_graph
from moonep_moe.config import MoEConfig, load_config
from moonep_moe.layers import moe
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world

DELAY = 20_000_000
"""GPU clock cycles (about 10 ms on an H200) that `torch.cuda._sleep` holds a stream back."""
GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass", re.IGNORECASE)
"""Names of cuBLAS / CUTLASS matrix-multiply kernels."""


def make_layer(overlap: bool, device: str = "cuda", shape: tuple = (1024, 512, 256, 16, 4), world=None,
               **overrides) -> MoonEPMoELayer:
    """A layer of `shape` (T, H, H', E, K) with two shared experts, drawn from seed 0 (the same weights for
    both values of `overlap`); bf16 with torch._grouped_mm on CUDA, float64 on the CPU; one rank of
    `world` (default: the one-rank world on `device`)."""
    t, h, f, e, k = shape
    cuda = device == "cuda"
    fields = dict(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=k, max_tokens_per_rank=t,
                  token_padding=16 if cuda else 8, dtype="bfloat16" if cuda else "float64",
                  grouped_gemm="torch" if cuda else "reference",
                  router={"expert_bias": True, "dtype": "float32" if cuda else "float64"},
                  shared_experts={"num_shared_experts": 2}, overlap_shared_experts=overlap,
                  ep_size=1 if world is None else world.size)
    torch.manual_seed(0)
    return MoonEPMoELayer(MoEConfig(**{**fields, **overrides}), world or single_world(device))


def skew(layer: MoonEPMoELayer, strength: float) -> None:
    """Bias the router toward experts 0..K-1 (strength 0: the router's own choice)."""
    with torch.no_grad():
        layer.router.expert_bias.zero_()
        layer.router.expert_bias[:layer.config.top_k] = strength


def step(layer: MoonEPMoELayer, x_th: torch.Tensor, grad_th: torch.Tensor, late: bool = False
         ) -> dict[str, torch.Tensor]:
    """One forward + backward: output, input gradient and every parameter's gradient (`main_grad` for the
    experts in that mode), copied, then cleared. `late`: the input and the output gradient are written
    after a delay on the current stream, so a side stream that does not wait for them reads them early."""
    if late:
        torch.cuda._sleep(DELAY)
    x_th = x_th.clone().requires_grad_()
    out_th = layer(x_th)
    if late:
        torch.cuda._sleep(DELAY)
    out_th.backward(grad_th.clone())
    return taken_grads(layer, out_th, x_th)


def delay_shared_experts(layer: MoonEPMoELayer) -> None:
    """Hold the shared experts' stream back before their forward and before their backward: a consumer that
    does not wait for that stream (the sum, the input gradient's accumulation) reads their results early."""

    def delay(*_):
        torch.cuda._sleep(DELAY)

    layer.shared_experts.register_forward_pre_hook(delay)
    layer.shared_experts.register_full_backward_pre_hook(delay)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name}: {what}"


# --- CPU: the switch, and no change on one stream --------------------------------------------------------


def test_switch_defaults_on_and_round_trips_through_the_config():
    cfg = load_config("tiny-cpu")
    assert cfg.overlap_shared_experts is True
    off = load_config("tiny-cpu", overlap_shared_experts=False)
    assert off.overlap_shared_experts is False
    assert MoEConfig.model_validate(off.model_dump()) == off
    assert MoEConfig.model_validate_json(off.model_dump_json()).overlap_shared_experts is False


@pytest.mark.parametrize("gate", [False, True])
def test_cpu_output_and_gradients_are_the_same_either_way(gate):
    layers = {overlap: make_layer(overlap, "cpu", (64, 16, 8, 8, 2),
                                  shared_experts={"num_shared_experts": 2, "gate": gate})
              for overlap in (False, True)}
    gen = torch.Generator().manual_seed(1)
    for strength in (0.0, 20.0):
        x_th, grad_th = (torch.randn(64, 16, generator=gen, dtype=torch.float64) for _ in range(2))
        results = {}
        for overlap, layer in layers.items():
            skew(layer, strength)
            results[overlap] = step(layer, x_th, grad_th)
        assert_equal(results[True], results[False], f"differs with overlap on the CPU (skew {strength})")


class NoStream:
    """Stands in for a CUDA stream on the CPU: waits are no-ops (one stream orders everything)."""

    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def streams_as_no_ops(monkeypatch):
    """`overlapped_step`'s stream calls as no-ops, so its autograd graph (what runs first, what feeds what)
    runs on the CPU."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: NoStream())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: NoStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)


@pytest.mark.parametrize("gate", [False, True])
def test_overlapped_step_adds_the_input_gradient_in_the_serial_order(gate, streams_as_no_ops):
    """The overlapped step builds its autograd graph in another order (shared experts first), so autograd
    adds the input gradient's terms (router, routed experts, shared experts' gate_up and gate) in another
    order; the step sums the shared experts' terms first, so the result is still bit-identical (fp32, where
    a reordered sum of three terms shows). The streams themselves are the GPU tests' part."""
    shared = {"num_shared_experts": 2, "gate": gate}
    layer = make_layer(False, "cpu", (128, 64, 32, 8, 2), dtype="float32", grouped_gemm="torch",
                       shared_experts=shared, router={"expert_bias": True, "aux_loss_coeff": 0.01})
    gen = torch.Generator().manual_seed(3)
    tokens_th, grad_th = (torch.randn(128, 64, generator=gen) for _ in range(2))
    skew(layer, 3.0)

    def serial(x_th):
        return layer(x_th)

    def overlapped(x_th):
        routing = layer.router(x_th, None)
        return moe.overlapped_step(layer, x_th, routing), routing.aux_loss

    results = {}
    for name, forward in (("serial", serial), ("overlapped", overlapped)):
        x_th = tokens_th.clone().requires_grad_()
        out_th, aux_loss = forward(x_th)
        ((out_th * grad_th).sum() + aux_loss).backward()
        results[name] = {"out": out_th.detach(), "grad_x": x_th.grad}
        results[name] |= {n: p.grad for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
    assert_equal(results["overlapped"], results["serial"], f"differs in the overlapped step (gate={gate})")


# --- GPU: bit-identical, CUDA graph, profiler trace --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("grad_dtype", ["param", "main_grad"])
def test_overlap_is_bit_identical_to_the_serial_layer(gate, grad_dtype):
    """Three steps of fresh tokens, routing from uniform to heavily skewed: the overlapped layer's output,
    input gradient and every parameter gradient equal the serial layer's bit for bit. The input and the
    output gradient land late on the current stream, and the shared experts' stream is held back in
    forward and backward, so every missing wait between the two streams shows."""
    shared = {"num_shared_experts": 2, "gate": gate}
    layers = {overlap: make_layer(overlap, shared_experts=shared, expert_grad_dtype=grad_dtype)
              for overlap in (False, True)}
    for layer in layers.values():
        delay_shared_experts(layer)
    gen = torch.Generator(device="cuda").manual_seed(1)
    t, h = layers[True].config.max_tokens_per_rank, layers[True].config.hidden_size
    for strength in (0.0, 20.0, 3.0):
        x_th, grad_th = (torch.randn(t, h, generator=gen, device="cuda", dtype=torch.bfloat16)
                         for _ in range(2))
        for layer in layers.values():
            skew(layer, strength)
        serial = step(layers[False], x_th, grad_th, late=True)
        overlapped = step(layers[True], x_th, grad_th, late=True)
        again = step(layers[False], x_th, grad_th, late=True)
        assert_equal(again, serial, f"the serial layer itself is not deterministic (skew {strength}): "
                                    "the comparison below cannot tell")
        assert_equal(overlapped, serial, f"differs with overlap (skew {strength})")


@pytest.mark.gpu
def test_cuda_graph_of_the_overlapped_step_replays_like_the_serial_one():
    """Forward + backward of each layer captured once (the side stream forks from and joins the capturing
    stream); replays on new tokens and new routing: the overlapped graph's output and gradients equal the
    serial graph's bit for bit, and match an eager serial step (test_cuda_graph's bf16 tolerance)."""
    layers = {overlap: make_layer(overlap) for overlap in (False, True)}
    eager_layer = make_layer(False)
    t, h = eager_layer.config.max_tokens_per_rank, eager_layer.config.hidden_size
    static_x = {overlap: torch.zeros(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for overlap in layers}
    static_grad = torch.zeros(t, h, device="cuda", dtype=torch.bfloat16)
    graphs, outputs = {}, {}
    for overlap, layer in layers.items():
        def graph_step(layer=layer, x_th=static_x[overlap], overlap=overlap):
            layer.zero_grad(set_to_none=True)
            x_th.grad = None
            outputs[overlap] = layer(x_th)
            outputs[overlap].backward(static_grad)

        graphs[overlap] = captured_graph(graph_step)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for strength in (0.0, 20.0, 3.0):
        x_th, grad_th = (torch.randn(t, h, generator=gen, device="cuda", dtype=torch.bfloat16)
                         for _ in range(2))
        replayed = {}
        for overlap, layer in layers.items():
            with torch.no_grad():
                static_x[overlap].copy_(x_th)
                static_grad.copy_(grad_th)
            skew(layer, strength)
            graphs[overlap].replay()
            replayed[overlap] = {"out": outputs[overlap].detach().clone(),
                                 "grad_x": static_x[overlap].grad.clone()}
            replayed[overlap] |= {name: p.grad.clone() for name, p in layer.named_parameters()}
        assert_equal(replayed[True], replayed[False], f"graph replay differs with overlap (skew {strength})")
        skew(eager_layer, strength)
        for name, want in step(eager_layer, x_th, grad_th).items():
            torch.testing.assert_close(replayed[True][name], want, rtol=2e-2, atol=2e-3,
                                       msg=lambda m, n=name, s=strength: f"{n} (skew {s}): {m}")


def kernels_and_launchers(trace: dict) -> list[dict]:
    """The GPU kernels of a chrome trace (`torch.profiler`'s export), each as `name`, `stream`, `start`,
    `end` (us) and `launchers`: the names of the CPU ops on the launching thread whose span holds the
    kernel's launch call (joined through the launch's `correlation` id)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    cpu_ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    kernels = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        launch = launches.get(e["args"].get("correlation"))
        launchers = set() if launch is None else {
            op["name"] for op in cpu_ops
            if op["tid"] == launch["tid"] and op["ts"] <= launch["ts"]
            and launch["ts"] + launch["dur"] <= op["ts"] + op["dur"]}
        kernels.append(dict(name=e["name"], stream=e["args"]["stream"], start=e["ts"], end=e["ts"] + e["dur"],
                            launchers=launchers))
    return kernels


def busy_us(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `(start, end)` intervals, as sorted disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Microseconds during which both unions of intervals are busy."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in busy_us(a) for s2, e2 in busy_us(b))


HOST_AHEAD_CYCLES = 100_000_000
"""About 50 ms of a spinning kernel on an H200: longer than the host takes to queue one layer step."""


def profile_overlap(layer: MoonEPMoELayer, out_dir: Path, tag: str = "") -> dict[str, dict]:
    """One step of `layer` (after two warm-up steps) profiled in two traces, `overlap-{phase}{tag}.json`
    under `out_dir`; per phase (forward, backward): `pairs`, the (shared-expert GEMM, routed-step kernel)
    pairs that ran at the same time on different streams (routed: launched inside `MoonEPExperts`' forward
    or its backward), `routed` (how many routed-step kernels the trace holds), `routed_streams`, `side_ms`
    (the other streams' busy time), `overlap_ms` (how much of it under the routed step) and `trace`."""
    t, h = layer.config.max_tokens_per_rank, layer.config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(layer.world.rank)
    x_th = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad_th = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    for _ in range(2):  # kernels built, pools and workspaces allocated
        layer(x_th).backward(grad_th)
    torch.cuda.synchronize()
    out_dir.mkdir(parents=True, exist_ok=True)
    out_th, phases = None, {}
    for phase, routed_op in (("forward", "MoonEPExperts"), ("backward", "MoonEPExpertsBackward")):
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            # the GPU busy while the host queues the step, as in a real model where the host runs ahead: else
            # the side stream's GEMMs may finish before the host has launched the routed step's first kernel
            torch.cuda._sleep(HOST_AHEAD_CYCLES)
            if phase == "forward":
                out_th = layer(x_th)
            else:
                out_th.backward(grad_th)
            torch.cuda.synchronize()
        path = out_dir / f"overlap-{phase}{tag}.json"
        prof.export_chrome_trace(str(path))
        kernels = kernels_and_launchers(json.loads(path.read_text()))
        routed = [k for k in kernels if any(routed_op in name for name in k["launchers"])]
        routed_streams = {k["stream"] for k in routed}
        shared = [k for k in kernels if GEMM_KERNEL.search(k["name"]) and k["stream"] not in routed_streams]
        side_us = [(k["start"], k["end"]) for k in kernels if k["stream"] not in routed_streams]
        routed_us = [(k["start"], k["end"]) for k in routed]
        phases[phase] = dict(
            pairs=[(s["name"], r["name"]) for s in shared for r in routed
                   if max(s["start"], r["start"]) < min(s["end"], r["end"])],
            routed=len(routed), routed_streams=sorted(routed_streams), trace=str(path),
            side_ms=sum(e - s for s, e in busy_us(side_us)) / 1e3,
            overlap_ms=overlap_us(side_us, routed_us) / 1e3)
    return phases


def assert_overlapped(phases: dict[str, dict], who: str) -> None:
    for phase, seen in phases.items():
        print(f"{who} {phase}: side stream busy {seen['side_ms']:.3f} ms, of which "
              f"{seen['overlap_ms']:.3f} ms under the routed step; trace {seen['trace']}")
        assert seen["routed"], f"{who} {phase}: no kernel launched inside the routed step in {seen['trace']}"
        assert seen["pairs"], (f"{who} {phase}: no shared-expert GEMM on a stream other than the routed "
                               f"step's ({seen['routed_streams']}) overlaps a routed-step kernel in "
                               f"{seen['trace']}")


TRACE_SHAPE = (8192, 4096, 2048, 16, 8)
"""(T, H, H', E, K): shared and routed experts that both take milliseconds."""


@pytest.mark.gpu
def test_profiler_trace_shows_the_shared_experts_overlapping_the_routed_step(tmp_path):
    """One step of a layer whose shared experts and routed experts both take milliseconds, profiled in two
    traces (forward, backward): a shared-expert GEMM kernel runs while a kernel of the routed step (launched
    inside `MoonEPExperts`' forward, or its backward) runs on another stream."""
    layer = make_layer(True, shape=TRACE_SHAPE)
    out_dir = Path(os.environ.get("MOONEP_BENCH_OUT") or tmp_path)
    assert_overlapped(profile_overlap(layer, out_dir), "one rank")


def overlap_trace_job(world, out_dir: str) -> dict:
    """One rank of a symmetric group whose processes share the GPU: its overlapped layer (R ranks, B = epn
    slots) profiled as in `profile_overlap`, its traces tagged with the rank."""
    layer = make_layer(True, shape=TRACE_SHAPE, world=world)
    try:
        return profile_overlap(layer, Path(out_dir), f"-rank{world.rank}-of{world.size}")
    finally:
        layer.destroy()


@pytest.mark.gpu
def test_profiler_trace_shows_the_overlap_in_processes_sharing_the_gpu(tmp_path):
    """Two processes, each a rank of one symmetric world on the same GPU
    (dispatch, prefetch and combine crossing ranks through peer memory): in each process's trace a
    shared-expert GEMM runs while a routed-step kernel runs on another stream, forward and backward."""
    from test_symmetric import spawn_symmetric

    out_dir = Path(os.environ.get("MOONEP_BENCH_OUT") or tmp_path)
    results = spawn_symmetric(functools.partial(overlap_trace_job, out_dir=str(out_dir)), 2, tmp_path)
    for rank, phases in enumerate(results):
        assert_overlapped(phases, f"rank {rank} of 2")
