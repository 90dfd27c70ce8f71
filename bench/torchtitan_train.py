"""torchtitan's DeepSeek-V3 debug model trained side by side with a copy whose MoE modules are swapped for
MoonEP's (`moonep_moe.integrations.torchtitan`): both loss curves, each step's time and its MoE modules' time.

    python -m bench.torchtitan_train            # a GPU, bf16: the registry's debugmodel, 50 steps of 8 x 2048
    python -m bench.torchtitan_train --smoke    # the CPU, fp32: the model cut to 2 layers, 50 steps of 2 x 16

Both models come from one seed (torchtitan's own init; the swapped one is a copy of the other) and see the
same batches: a fixed pool of random sequences, cycled, so the loss falls. Each step uses torchtitan's
components: its loss (`cross_entropy_loss`, a sum over tokens, divided by the tokens), its AdamW
(`default_adamw`, lr 8e-4 as its debug config), its warmup-stable-decay schedule (`LRSchedulersContainer`,
as its debug config) and its aux-loss-free balancing hook (`register_moe_load_balancing_hook`). Attention is
torchtitan's causal SDPA in both (its flex attention needs its trainer's block masks). The models are built
in bf16 on the GPU, fp32 with `--smoke`: torchtitan's experts compute in bf16 either way (`GroupedExperts`),
MoonEP's in the model's dtype; MoonEP's router weight stays fp32 (torchtitan computes its gate in fp32).

Timed per step, after `--warmup` steps: the whole step (forward, backward, optimizer step) and the time
inside the MoE modules (each module's forward, and its backward from its backward pre-hook to its backward
hook; CUDA events on the GPU, the host clock on the CPU), summed over the modules. The record
(`bench/results/torchtitan-train-<device>-...json`) holds both loss curves, the medians and spreads, the
ratio of MoonEP's MoE time to torchtitan's (`torch._grouped_mm` experts), and the loss check: every step's
losses within `--tolerance` of each other (relative).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    default_adamw,
    register_moe_load_balancing_hook,
)
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import MoE
from torchtitan.models.deepseek_v3 import model_registry
from torchtitan.tools.utils import set_default_dtype

from bench.common import (
    check,
    format_check,
    measure_limits,
    ratio,
    seconds_between,
    span,
    spread,
    stamp,
    write_record,
)
from moonep_moe.integrations.torchtitan import MoonEPTitanMoE, swap_moe_modules

GPU = dict(device="cuda", dtype="bfloat16", layers=None, batch=8, seq=2048, tolerance=0.05)
"""The full run: the registry's debugmodel (6 layers) at its debug config's batch and sequence length."""
SMOKE = dict(device="cpu", dtype="float32", layers=2, batch=2, seq=16, tolerance=0.02)
"""The CPU run (`--smoke`): 1 dense and 1 MoE layer, a few tokens; fp32, so the curves stay within 2%."""


class OneProcess:
    """torchtitan's `ParallelDims` as the balancing hook reads it, in a one-process run: no EP or TP, and no
    "loss" mesh to reduce the counts over (a real `ParallelDims` needs a process group)."""

    ep_enabled = False
    tp = 1

    def get_optional_mesh(self, dims: str | list[str]) -> None:
        return None


def debug_model(layers: int | None, device: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """DeepSeek-V3's `debugmodel` from torchtitan's registry, its first `layers` layers (None: all), with
    causal SDPA attention, built and initialised by torchtitan after `torch.manual_seed(seed)`."""
    config = model_registry("debugmodel").model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    with torch.device(device), set_default_dtype(dtype):  # as torchtitan's trainer builds in training.dtype
        model = config.build()
    model.init_weights(buffer_device=torch.device(device))
    return model


def batches(vocab: int, batch: int, seq: int, device: str, pool: int = 16, seed: int = 1
            ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Step -> `(tokens [batch, seq], labels [batch, seq])`, cycling through `pool` random sequences."""
    gen = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, vocab, (pool, seq + 1), generator=gen).to(device)

    def at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = sequences[[(step * batch + i) % pool for i in range(batch)]]
        return rows[:, :-1], rows[:, 1:]

    return at


class ModuleTimer:
    """The time spent inside `modules` (forward, and backward from pre-hook to hook), collected per step."""

    def __init__(self, modules: list[nn.Module], device: torch.device):
        self.device, self.spans, self.open = device, [], None
        for module in modules:
            module.register_forward_pre_hook(lambda *_: self._start())
            module.register_forward_hook(lambda *_: self._stop())
            module.register_full_backward_pre_hook(lambda *_: self._start())
            module.register_full_backward_hook(lambda *_: self._stop())

    def _start(self) -> None:
        self.open = stamp(self.device)

    def _stop(self) -> None:
        self.spans.append((self.open, stamp(self.device)))

    def take(self) -> float:
        """Seconds inside the modules since the last call (their stamps complete: synchronise first)."""
        seconds = sum(seconds_between(start, end) for start, end in self.spans)
        self.spans = []
        return seconds


def train(model: nn.Module, data: Callable, steps: int, device: torch.device) -> dict[str, list[float]]:
    """`steps` steps of torchtitan's loss, AdamW, schedule and balancing hook: each step's loss, seconds and
    seconds inside the MoE modules."""
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], OneProcess())
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                              min_lr_factor=0.0).build(optimizers=optimizers,
                                                                       training_steps=steps)
    timer = ModuleTimer([m for m in model.modules() if isinstance(m, (MoE, MoonEPTitanMoE))], device)
    out = {"losses": [], "step_s": [], "moe_s": []}
    model.train()
    for step in range(steps):
        tokens, labels = data(step)
        start = stamp(device)
        optimizers.zero_grad()
        loss = cross_entropy_loss(model(tokens), labels) / labels.numel()
        loss.backward()
        optimizers.step()
        schedulers.step()
        end = stamp(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out["losses"].append(loss.item())
        out["step_s"].append(seconds_between(start, end))
        out["moe_s"].append(timer.take())
    return out


def run(device: str, dtype: str, layers: int | None, batch: int, seq: int, steps: int, warmup: int,
        tolerance: float, out_dir: Path | None = None) -> tuple[dict, Path]:
    """Both models trained (torchtitan's first), the record written: `(record fields, its path)`."""
    torch_dtype = getattr(torch, dtype)
    original = debug_model(layers, device, torch_dtype)
    swapped = swap_moe_modules(copy.deepcopy(original), batch * seq)
    data = batches(original.config.vocab_size, batch, seq, device)
    rows = []
    for name, model in (("torchtitan", original), ("moonep", swapped)):
        result = train(model, data, steps, torch.device(device))
        rows.append({"model": name, "losses": result["losses"],
                     **{f"step_{k}": v for k, v in spread(result["step_s"][warmup:]).items()},
                     **{f"moe_{k}": v for k, v in spread(result["moe_s"][warmup:]).items()}})
    want, got = rows[0]["losses"], rows[1]["losses"]
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    checks = [check("every step's loss within tolerance of torchtitan's (relative)", worst, "<=", tolerance)]
    fields = {"setup": dict(model="deepseek_v3 debugmodel", layers=layers or len(original.layers),
                            dtype=dtype, batch=batch, seq=seq, steps=steps, warmup=warmup,
                            moe_modules=sum(isinstance(m, MoonEPTitanMoE) for m in swapped.modules())),
              "moe_ms_ratio": ratio(span(rows[1], "moe_"), span(rows[0], "moe_")),
              "step_ms_ratio": ratio(span(rows[1], "step_"), span(rows[0], "step_")), "checks": checks}
    limits = measure_limits() if device == "cuda" else {}
    path = write_record("torchtitan-train", limits, rows, out_dir, ran_on=device, **fields)
    return {**fields, "results": rows}, path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the CPU run (fp32, 2 layers, 2 x 16 tokens)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timings")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--tolerance", type=float, help="largest relative loss difference at any step")
    parser.add_argument("--out", type=Path, help="folder of the record (default bench/results)")
    args = parser.parse_args(argv)
    setup = dict(SMOKE if args.smoke else GPU)
    setup.update({k: getattr(args, k) for k in ("batch", "seq", "tolerance") if getattr(args, k) is not None})
    record, path = run(**setup, steps=args.steps, warmup=args.warmup, out_dir=args.out)
    for row in record["results"]:
        print(f"{row['model']:>10}: loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}  step "
              f"{row['step_ms']:.1f} ms ({row['step_ms_min']:.1f}-{row['step_ms_max']:.1f})  MoE "
              f"{row['moe_ms']:.1f} ms ({row['moe_ms_min']:.1f}-{row['moe_ms_max']:.1f})")
    moe = record["moe_ms_ratio"]
    print(f"MoonEP / torchtitan MoE time: {moe[0]:.2f} ({moe[1]:.2f}-{moe[2]:.2f})")
    for result in record["checks"]:
        print(format_check(result))
    print(f"record: {path}")
    return record


if __name__ == "__main__":
    main()
