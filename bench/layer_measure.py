"""How bench.layer measures one layer, ours or torch-native, on the GPU (`Bench`): the same tokens and
output gradient for every layer, its fwd+bwd, forward and inference times (median and spread; the host
ahead, and from an idle GPU), their useful rates (`routed_flops` over the run's dense bf16 rate), the peak
memory of one step beyond what was allocated before the layer was built (`free_memory`, the expert arena
counted), and one step's kernel profile. bench.memory counts from the same `free_memory`, bench.step_bytes
its useful FLOPs by the same `routed_flops`."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch import nn

from bench.common import cuda_timeline, queued_timings, spread, timings
from bench.kernel_profile import timeline_profile
from bench.layer_step import forwards, inference, step
from moonep_moe.transport.arena import physical_bytes


def routed_flops(tokens: int, top_k: int, hidden: int, ffn: int, backward: bool) -> int:
    """Useful FLOPs of the routed experts: three projections (gate, up, down; each H x H') on the T*K routed
    rows, 2 per multiply-add; with `backward`, dgrad and wgrad too (3x the forward). Padding rows, the
    router and the permutation are not counted."""
    return (3 if backward else 1) * 3 * 2 * tokens * top_k * hidden * ffn


def free_memory() -> int:
    """Collect garbage and return cached blocks; the bytes still allocated, the arena's included
    (`physical_bytes`: the expert weights mapped outside the caching allocator)."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() + physical_bytes("cuda")


@dataclass
class Bench:
    """What every layer is measured with: the same tokens and output gradient, the useful FLOPs
    (`routed_flops`, keys "fwd_bwd" and "fwd"), the dense bf16 rate of the run and the repetitions."""

    x_th: torch.Tensor
    grad_th: torch.Tensor
    shape: tuple[int, int, int, int]
    """(H, H', E, K)."""
    flops: dict[str, int]
    dense: float
    warmup: int
    repeat: int

    def measure(self, layer: nn.Module, before_bytes: int, micro_batches: int = 1) -> dict:
        """fwd+bwd and fwd timings (`spread`) per micro-batch (each run is one optimizer step's `step`, its
        time over `micro_batches`) with the host ahead (`queued_timings`), their useful rates (`tflops`,
        `of_dense`), with one micro-batch the forward without autograd on frozen weights (`inference`:
        `infer_ms`, ..., `infer_of_dense`), the host's enqueue time of a step (`host_ms`, ...), fwd+bwd
        timed from an idle GPU (`synced_ms`, ...: the host's launch latency at the start of each step
        charged) and `peak_gib`, the peak of one step beyond `before_bytes` (what was allocated before the
        layer was built)."""
        x_th, grad_th, n = self.x_th, self.grad_th, micro_batches
        runs = self.warmup, self.repeat
        steps, ahead = queued_timings(lambda: step(layer, x_th, grad_th, n), *runs)
        row = spread([t / n for t in steps])
        fwd = spread([t / n for t in queued_timings(lambda: forwards(layer, x_th, n), *runs)[0]])
        synced = spread([t / n for t in timings(lambda: step(layer, x_th, grad_th, n), *runs)])
        row.update({f"fwd_{key}": value for key, value in fwd.items()})
        row.update({f"synced_{key}": value for key, value in synced.items()})
        if n == 1:  # the same for any micro-batches: the weights stay as they are
            infer = spread(queued_timings(lambda: inference(layer, x_th), *runs)[0])
            row.update({f"infer_{key}": value for key, value in infer.items()})
            row["infer_of_dense"] = self.flops["fwd"] / (row["infer_ms"] / 1e3) / self.dense
        host = ahead.describe()
        row.update({key: host[key] / n for key in ("host_ms", "host_ms_max", "hold_ms")},
                   host_behind=host["host_behind"])
        for prefix, flops in (("", self.flops["fwd_bwd"]), ("fwd_", self.flops["fwd"])):
            row[f"{prefix}tflops"] = flops / (row[f"{prefix}ms"] / 1e3) / 1e12
            row[f"{prefix}of_dense"] = row[f"{prefix}tflops"] * 1e12 / self.dense
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(layer, x_th, grad_th, n)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() + physical_bytes("cuda")  # the arena is fixed during a step
        row["peak_gib"] = (peak - before_bytes) / 2**30
        return row

    def profile(self, layer: nn.Module, micro_batches: int = 1) -> dict:
        """The `timeline_profile` of one optimizer step's `step`: its kernels grouped, and where the GPU
        idled (under the profiler each launch costs the host a little more: gaps read somewhat longer)."""
        return timeline_profile(cuda_timeline(lambda: step(layer, self.x_th, self.grad_th, micro_batches)))

    def profile_inference(self, layer: nn.Module) -> dict:
        """The `timeline_profile` of one `inference` forward, after one unprofiled (an fp8 layer's FP8
        copies are then made and kept, as in serving)."""
        inference(layer, self.x_th)
        return timeline_profile(cuda_timeline(lambda: inference(layer, self.x_th)))
