"""The router's GEMMs on bf16 tensor cores (`SplitLinear`, `RouterConfig.bf16x3`) against fp32 GEMMs, timed
and checked against a float64 product, on the packaged models' router shapes.

    python -m bench.router                         # DeepSeek-V3 and Kimi-K2 (T = S = 8192), about a minute
    python -m bench.router --models qwen3-moe-30b-a3b --tokens 16384

For each model (its `hidden` H, `experts` E, `max_tokens_per_rank` T as tokens unless `--tokens`), bf16 hidden
states `[T, H]`, an fp32 router weight `[E, H]` and an fp32 gradient of the logits `[T, E]`; two arms timed in
rotated turns (`bench.common.alternated_timings`, `--repeat` rounds), each as forward alone and forward plus
backward (`autograd.backward` of the logits with that gradient):
- `fp32`, the baseline: `F.linear(x.float(), w)` and its autograd backward (cuBLAS fp32 GEMMs; TF32 stays off,
  torch's default);
- `bf16x3`: `SplitLinear` (one bf16 GEMM of N = 3E forward; input gradient with K = 3E, weight gradient with
  M = 3E, fp32 accumulation and output).
Then the whole `TopKRouter` (the packaged config's scores, groups and top-k) forward plus backward with
`bf16x3` on and off, and each arm's error against a float64 product: the logits', the weight gradient's and
the input gradient's largest absolute error over the largest magnitude of the float64 result.

Left out: what the layer does around the router (bench.layer times the whole step).
The record (`bench/results/router-<device>-<date>-<commit>.json`, or $MOONEP_BENCH_OUT) holds every row.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import (
    alternated_timings,
    gpu_state,
    measure_limits,
    model_shape,
    ratio,
    span,
    spread,
    write_record,
)
from moonep_moe.config import load_config
from moonep_moe.layers.router import SplitLinear, TopKRouter


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute error of `value` against float64 `reference`, over `reference`'s largest magnitude."""
    return float((value.double() - reference).abs().max() / reference.abs().max())


def gemm_arms(x_th: torch.Tensor, w_eh: torch.Tensor, grad_te: torch.Tensor) -> dict[str, dict]:
    """Each arm's forward-only and forward-plus-backward calls and its errors against float64."""
    ref_te = x_th.double() @ w_eh.double().t()
    ref_grad_w = grad_te.double().t() @ x_th.double()
    ref_grad_x = grad_te.double() @ w_eh.double()
    linears = {"fp32": lambda x, w: F.linear(x.float(), w), "bf16x3": SplitLinear.apply}
    arms = {}
    for name, linear in linears.items():
        x = x_th.detach().requires_grad_()
        w = w_eh.detach().requires_grad_()

        def step(linear=linear, x=x, w=w):
            x.grad = w.grad = None
            torch.autograd.backward(linear(x, w), grad_te)

        with torch.no_grad():
            logits = linear(x_th, w_eh)
        step()
        arms[name] = {"forward": lambda linear=linear: linear(x_th, w_eh), "step": step,
                      "error": {"logits": relative_error(logits, ref_te),
                                "grad_weight": relative_error(w.grad, ref_grad_w),
                                "grad_input": relative_error(x.grad, ref_grad_x)}}
    return arms


def router_step(name: str, x_th: torch.Tensor, weight_eh: torch.Tensor, bf16x3: bool):
    """The packaged model's `TopKRouter` (its weight set to `weight_eh`), forward plus backward of its route
    weights' sum."""
    config = load_config(name)
    router_config = config.router.model_copy(update={"bf16x3": bf16x3})
    router = TopKRouter(router_config, x_th.shape[1], weight_eh.shape[0], config.top_k).to(x_th.device)
    with torch.no_grad():
        router.weight.copy_(weight_eh)
    x = x_th.detach().requires_grad_()

    def step():
        x.grad = router.weight.grad = None
        router(x).route_weights_tk.float().sum().backward()
    return step


def bench_model(name: str, tokens: int | None, repeat: int, device: torch.device) -> dict:
    shape = model_shape(name)
    T, H, E = tokens or shape["tokens"], shape["hidden"], shape["experts"]
    gen = torch.Generator(device=device).manual_seed(0)
    x_th = torch.randn(T, H, device=device, generator=gen).to(torch.bfloat16)
    w_eh = torch.randn(E, H, device=device, generator=gen) * H**-0.5
    grad_te = torch.randn(T, E, device=device, generator=gen) / T
    arms = gemm_arms(x_th, w_eh, grad_te)
    row = {"model": name, "tokens": T, "hidden": H, "experts": E}
    for part in ("forward", "step"):
        calls = [arms["fp32"][part], arms["bf16x3"][part]]
        fp32_s, split_s = alternated_timings(calls, repeat, device=device)
        row[f"gemm_{part}"] = {"fp32": spread(fp32_s), "bf16x3": spread(split_s)}
    steps = [router_step(name, x_th, w_eh, bf16x3) for bf16x3 in (False, True)]
    fp32_s, split_s = alternated_timings(steps, repeat, device=device)
    row["router_step"] = {"fp32": spread(fp32_s), "bf16x3": spread(split_s)}
    row["error"] = {arm: arms[arm]["error"] for arm in arms}
    row["gpu"] = gpu_state(device)
    for part in ("gemm_forward", "gemm_step", "router_step"):
        times = row[part]
        speedup = times["speedup"] = ratio(span(times["fp32"]), span(times["bf16x3"]))
        print(f"{name:18} {part:13} fp32 {times['fp32']['ms']:.3f} ms, bf16x3 {times['bf16x3']['ms']:.3f} "
              f"ms: {speedup[0]:.2f}x ({speedup[1]:.2f}-{speedup[2]:.2f})", flush=True)
    for arm, errors in row["error"].items():
        listed = ", ".join(f"{part} {error:.2e}" for part, error in errors.items())
        print(f"{name:18} {arm:6} error over float64: {listed}")
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["deepseek-v3", "kimi-k2"])
    parser.add_argument("--tokens", type=int, default=None,
                        help="T (default: the model's max_tokens_per_rank)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.router needs a GPU (the bf16x3 GEMMs are CUDA-only: torch.mm(out_dtype=))")
    device = torch.device("cuda")
    limits = measure_limits()
    rows = [bench_model(name, args.tokens, args.repeat, device) for name in args.models]
    setup = {"repeat": args.repeat, "order": "rotated turns: fp32 then bf16x3, swapped every round",
             "baseline": "fp32: F.linear(x.float(), w) and its autograd backward, TF32 off"}
    out = None if args.out is None else Path(args.out)
    print(write_record("router", limits, rows, out, setup=setup))


if __name__ == "__main__":
    main()
