"""Shared experts overlapped with the routed experts, measured as the time a step saves.

    python -m bench.overlap                      # DeepSeek-V3 shapes (about a minute on an H200)
    python -m bench.overlap --experts 64 256     # which routed-expert counts to run (E=64: one EP=8 rank's
                                                 # 32 home + 32 slot groups of routed work, without peers)

For each E: the DeepSeek-V3 layer (its one shared expert, T = S = 8192 tokens, bf16, EP=1) built twice from
the same seed, `overlap_shared_experts` off (serial: shared experts after the routed step) and on (the shared
experts on a side stream while the routed step runs, `moonep_moe.layers.moe.overlapped_step`); the shared
experts alone on the same tokens. Each time is the median (min-max) of `--repeat` steps with CUDA events:
fwd+bwd and forward. "Hidden" is serial minus overlapped, and its share of the shared experts' own time (1.0:
all of it hidden). The overlap is bit-identical to the serial step (tests/test_overlap.py), so only time is
measured here. The JSON record lands in bench/results (or $MOONEP_BENCH_OUT).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from bench.common import measure_limits, ratio, span, spread, timings, write_record
from moonep_moe.config import load_config
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world


def step(module: torch.nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor) -> None:
    """Forward and backward of `module` (the layer, or its shared experts) on the bench's tokens."""
    x_th.grad = None
    for param in module.parameters():
        param.grad = None
    module(x_th).backward(grad_th)


def measure(module: torch.nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor, warmup: int,
            repeat: int) -> dict:
    """fwd+bwd timings (`spread`: `ms`, `ms_min`, `ms_max`) and forward ones (`fwd_` keys)."""
    row = spread(timings(lambda: step(module, x_th, grad_th), warmup, repeat))
    with torch.no_grad():
        forward = spread(timings(lambda: module(x_th), warmup, repeat))
    row.update({f"fwd_{key}": value for key, value in forward.items()})
    return row


def run(experts: int, warmup: int, repeat: int) -> dict:
    """One table: the layer over `experts` routed experts, serial and overlapped, and its shared experts
    alone (measured inside the overlapped build, the same module)."""
    table = {"experts": experts}
    x_th = grad_th = None
    for overlap in (False, True):
        cfg = load_config("deepseek-v3", ep_size=1, num_experts=experts, overlap_shared_experts=overlap)
        torch.manual_seed(0)
        layer = MoonEPMoELayer(cfg, single_world("cuda"))
        if x_th is None:
            gen = torch.Generator(device="cuda").manual_seed(1)
            shape = (cfg.max_tokens_per_rank, cfg.hidden_size)
            x_th = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            grad_th = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        table["overlapped" if overlap else "serial"] = measure(layer, x_th, grad_th, warmup, repeat)
        if overlap:
            table["shared_alone"] = measure(layer.shared_experts, x_th, grad_th, warmup, repeat)
        layer.destroy()
        del layer
        gc.collect()
        torch.cuda.empty_cache()
    for prefix in ("", "fwd_"):
        serial, overlapped = span(table["serial"], prefix), span(table["overlapped"], prefix)
        shared = span(table["shared_alone"], prefix)
        hidden = serial[0] - overlapped[0]
        table[f"{prefix}hidden_ms"] = hidden
        table[f"{prefix}hidden_of_shared"] = hidden / shared[0]
        table[f"{prefix}overlapped_vs_serial"] = ratio(overlapped, serial)
    return table


def report(table: dict) -> None:
    """Two lines per table (fwd+bwd, forward): the three times, the time hidden and its share."""
    for prefix, what in (("", "fwd+bwd"), ("fwd_", "forward")):
        cells = []
        for name in ("serial", "overlapped", "shared_alone"):
            median, low, high = span(table[name], prefix)
            cells.append(f"{name} {median:.2f} ({low:.2f}-{high:.2f})")
        hidden, share = table[prefix + "hidden_ms"], table[prefix + "hidden_of_shared"]
        print(f"E={table['experts']:4d} {what:8s} ms: {', '.join(cells)}; hidden {hidden:.2f} ms = "
              f"{share:.2f} of the shared experts' time; overlapped / serial "
              f"{table[prefix + 'overlapped_vs_serial'][0]:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", nargs="*", type=int, default=[64, 256], help="E values (default 64 256)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10, help="timed steps (>= 5; the median of them)")
    parser.add_argument("--out", default=None, help="folder of the JSON record (default bench/results)")
    args = parser.parse_args()
    if args.repeat < 5:
        parser.error(f"--repeat must be >= 5 (a median with its spread), got {args.repeat}")
    if not torch.cuda.is_available():
        parser.error("bench.overlap needs a CUDA device: the overlap is a CUDA-stream feature")
    limits = measure_limits()
    tables = []
    for experts in args.experts:
        tables.append(run(experts, args.warmup, args.repeat))
        report(tables[-1])
    path = write_record("overlap", limits, tables, Path(args.out) if args.out else None,
                        setup={"model": "deepseek-v3", "ep_size": 1, "shared_experts": 1,
                               "tokens": load_config("deepseek-v3").max_tokens_per_rank, "dtype": "bfloat16"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
