"""Every `torch._grouped_mm` call of one training step, ours (the DEFAULT layer) beside torch-native's, each
replayed alone: why the same products take longer in our layer.

    python -m bench.grouped_mm_calls                      # DeepSeek-V3 at EP=1, T=8192 (about 1 min)
    python -m bench.grouped_mm_calls --model qwen3-moe-30b-a3b

First, one step of each layer under the profiler: every GEMM kernel in launch order with its device time
(in the step, beside the other kernels). Then one step with `torch._grouped_mm` wrapped to keep its
arguments (the tensors themselves, so a replay reads the same memory and layouts); each call is replayed
`--repeat` times alone (CUDA events; median and min-max) with its operands' shapes, strides, alignment, the
rows it covers (`offs[-1]`, ours with the token padding) and its rate over the run's dense bf16 rate.
torch-native's backward calls `_grouped_mm` inside autograd (not through the wrapper): its two backward
products per forward call are replayed in the form autograd uses, `grad @ b^T` and `a^T @ grad`. Each of
our calls is also replayed with the weights operand copied to a fresh tensor of the same strides (rules out
the arena's placement) and, for 3-D operands, in the other memory orientation (the same values; torch picks
a CUTLASS layout per operand orientation); our 2-D wgrad (`dy^T @ x`) is also replayed as `x^T @ dy`.

The record (`bench/results/grouped-mm-calls-<model>-...json`) holds every call with its variants.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

from bench.common import measure_limits, spread, timings, write_record
from bench.layer import layer_weights, native_layer, step
from moonep_moe import MoEConfig, MoonEPMoELayer
from moonep_moe.config import load_config
from moonep_moe.transport.threads import single_world


@contextmanager
def recorded_grouped_mm(calls: list[dict]):
    """`torch._grouped_mm` wrapped: every call's `(a, b, offs)` and output appended to `calls`."""
    real = torch._grouped_mm

    def wrapper(a, b, offs=None, **kwargs):
        out = real(a, b, offs=offs, **kwargs)
        calls.append({"a": a, "b": b, "offs": offs, "kwargs": kwargs, "out_shape": tuple(out.shape)})
        return out

    torch._grouped_mm = wrapper
    try:
        yield
    finally:
        torch._grouped_mm = real


def describe(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch."),
            "align_bytes": t.data_ptr() & -t.data_ptr(), "contiguous": t.is_contiguous()}


def call_flops(call: dict) -> int:
    """2 * rows * N * K of the covered rows: fwd/dgrad `[M, K] x [G, K, N]`, wgrad `[N, M] x [M, K]`."""
    a, b, rows = call["a"], call["b"], int(call["offs"][-1])
    if a.dim() == 2 and b.dim() == 3:
        return 2 * rows * b.shape[-1] * b.shape[-2]
    return 2 * rows * a.shape[0] * b.shape[-1]


def replay(call: dict, b: torch.Tensor | None = None, warmup: int = 3, repeat: int = 10) -> dict:
    b = call["b"] if b is None else b
    return spread(timings(lambda: torch._grouped_mm(call["a"], b, offs=call["offs"], **call["kwargs"]),
                          warmup, repeat))


def other_orientation(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions' memory order swapped."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def native_backward_calls(call: dict) -> list[dict]:
    """torch-native's backward products of one forward call `a [M, K] @ b [G, K, N]`: dgrad `grad [M, N] @
    b^T` and wgrad `a^T [K, M] @ grad [M, N]` (-> `[G, K, N]`)."""
    a, b, offs = call["a"], call["b"], call["offs"]
    grad = torch.randn(call["out_shape"], device=a.device, dtype=a.dtype)
    return [{"a": grad, "b": b.transpose(-2, -1), "offs": offs, "kwargs": {}, "out_shape": tuple(a.shape),
             "form": "native dgrad"},
            {"a": a.t(), "b": grad, "offs": offs, "kwargs": {}, "out_shape": (offs.numel(), *b.shape[1:]),
             "form": "native wgrad"}]


def variants(call: dict) -> dict[str, dict]:
    """Changed replays of one of our calls: `{name: call}`."""
    a, b = call["a"], call["b"]
    out = {"b_fresh_copy": {**call, "b": b.clone(memory_format=torch.preserve_format)}}
    if b.dim() == 3:
        out["b_other_orientation"] = {**call, "b": other_orientation(b)}
    else:  # wgrad dy^T @ x as x^T @ dy
        out["swapped_operands"] = {**call, "a": b.t(), "b": a.t()}
    return out


def gemm_kernels(layer, x_th: torch.Tensor, grad_th: torch.Tensor) -> list[tuple[str, float]]:
    """`[(kernel, ms)]` of one step's GEMM kernels (names with gemm, cutlass, sm90 or xmma), in order."""
    from bench.layer import step_kernels

    return [(name, ms) for name, ms in step_kernels(layer, x_th, grad_th)
            if any(word in name.lower() for word in ("gemm", "cutlass", "sm90", "xmma"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    limits = measure_limits()
    dense = limits["dense_bf16_flops_per_s"]
    base = load_config(args.model)
    t, h, f, e, k = (base.max_tokens_per_rank, base.hidden_size, base.ffn_hidden_size, base.num_experts,
                     base.top_k)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x_th = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad_th = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows, profiles = [], {}
    for name in ("torch-native", "ours DEFAULT"):
        if name == "torch-native":
            layer = native_layer(h, f, e, k)
        else:
            layer = MoonEPMoELayer(MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=k,
                                             max_tokens_per_rank=t), single_world("cuda"))
            layer.load_state_dict(layer_weights(h, f, e))
        for _ in range(2):
            step(layer, x_th, grad_th)
        kernels = gemm_kernels(layer, x_th, grad_th)
        print(f"{name}: {len(kernels)} GEMM kernels in one step, {sum(ms for _, ms in kernels):.2f} ms:")
        for kernel, ms in kernels:
            print(f"    {ms:7.3f} ms  {kernel[:120]}")
        profiles[name] = [{"kernel": kernel, "ms": ms} for kernel, ms in kernels]
        calls: list[dict] = []
        with recorded_grouped_mm(calls):
            step(layer, x_th, grad_th)
        torch.cuda.synchronize()
        if name == "torch-native":
            calls = [c for call in calls
                     for c in ({**call, "form": "native fwd"}, *native_backward_calls(call))]
        for i, call in enumerate(calls):
            row = {"layer": name, "call": i, "form": call.get("form", "ours"), "a": describe(call["a"]),
                   "b": describe(call["b"]), "offs_last": int(call["offs"][-1]),
                   "groups": call["offs"].numel(),
                   "out": list(call["out_shape"]), "flops": call_flops(call),
                   **replay(call, repeat=args.repeat)}
            row["of_dense"] = row["flops"] / (row["ms"] / 1e3) / dense
            if name != "torch-native":
                for variant, changed in variants(call).items():
                    row[variant] = {key: value for key, value in replay(changed, repeat=args.repeat).items()
                                    if key != "ms_samples"}
                    row[variant]["a"], row[variant]["b"] = describe(changed["a"]), describe(changed["b"])
                    del changed
            rows.append(row)
            extra = "".join(f"  {v} {row[v]['ms']:.3f} ms" for v in ("b_fresh_copy", "b_other_orientation",
                                                                     "swapped_operands") if v in row)
            print(f"{name:13} #{i} {row['form']:12} a{row['a']['shape']}{row['a']['stride']} "
                  f"b{row['b']['shape']}{row['b']['stride']} rows {row['offs_last']:6} G {row['groups']:4}: "
                  f"{row['ms']:.3f} ms ({row['ms_min']:.3f}-{row['ms_max']:.3f}) {row['of_dense']:.2f} dense"
                  f"{extra}", flush=True)
        if hasattr(layer, "destroy"):
            layer.destroy()
        del layer, calls
        torch.cuda.empty_cache()
    for name in ("torch-native", "ours DEFAULT"):
        ms = sum(row["ms"] for row in rows if row["layer"] == name)
        print(f"{name}: the grouped_mm calls of one step add up to {ms:.2f} ms")
    path = write_record(f"grouped-mm-calls-{args.model}", limits, rows, args.out,
                        profiles=profiles, setup={"model": args.model, "tokens": t, "hidden": h, "ffn": f,
                                                  "experts": e, "top_k": k, "repeat": args.repeat})
    print(path)


if __name__ == "__main__":
    main()
