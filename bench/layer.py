"""The whole MoonEPMoELayer against a torch-native MoE layer, eager and under `torch.compile`: same shapes,
same weights, same tokens, same run, and every speed also as a share of that run's dense bf16 GEMM rate.

    python -m bench.layer                   # DeepSeek-V3 layer at EP=1: T=8192, H=7168, H'=2048, E=256, K=8
    python -m bench.layer --profile         # and each row's GPU kernels of one step, grouped
    python -m bench.layer --models all      # the whole model table, DEFAULT rows (an H200: ~2-4 min)
    python -m bench.layer --model qwen3-moe-30b-a3b   # any packaged model's shapes, all variants
    python -m bench.layer --tokens 4096 --experts 64
    python -m bench.layer --main-grad-backends auto triton torch deep_gemm --token-paddings 16 128  # the grid
    python -m bench.layer --backends --main-grad-backends --no-compile   # torch-native and the DEFAULT row
    python -m bench.layer --ep-rank-of 8    # ONE rank of an EP=8 group: S*K routes, its home groups and the
                                            # slots the group's plan fills for it (maxvio 0)
    python -m bench.layer --ep-rank-of 8 --maxvio 20   # the same rank's groups at maxvio 20
    python -m bench.layer --device cpu --models all   # a one-step smoke run of every table, tiny H, H', T
    python -m bench.layer --backends --main-grad-backends --fp8   # the fp8 row beside DEFAULT
    python -m bench.layer --backends --main-grad-backends --fp8 --ep-rank-of 8   # and for one EP=8 rank

--model NAME (alias --models): the shapes H, H', E, K and T (`max_tokens_per_rank`, 8192 for every packaged
model, which fits an H200 for each table below) come from `moonep_moe/configs/NAME.yaml` (one source of
truth, `bench.common.model_shape`); --tokens, --hidden, --ffn, --experts and --top-k override them (the
record then says so, and its name ends in `-custom`). Only the shapes are taken: both layers are the
routed experts alone with a softmax router (no shared experts, no group-limited routing), as before.
--model all runs `MODEL_TABLES`, the whole model table: DeepSeek-V3 at EP=1, one rank of EP=8
for DeepSeek-V3 (32 + 32 groups) and Kimi-K2 (48 + 48), Qwen3-MoE-30B-A3B and Mixtral-8x7B at
EP=1, each with both baselines and our DEFAULT row (variants only where --backends or
--main-grad-backends are given); one record per table. It is bounded by that: 5 tables x 3 layers, each
step <= ~75 ms timed 2 x (3 + 10) times; the time goes to the five `torch.compile` baselines (~10 s each)
and to first calls (Triton autotuning, DeepGEMM's JIT, `auto`'s GEMM measurement per shape).

--ep-rank-of R: every layer computes what one rank of an EP group of R ranks computes
(`bench.ep_rank.as_ep_rank`, `EP_RANK`: what it measures and leaves out, no peer traffic): the group's routing
at --maxvio (default 0; bench.skew, the demo's generator) planned by the real planner (balance exact), and the
rank hosting the most replicas (`ep_rank_plan`) taken with its routes per home expert and per slot, so only
the slots the plan fills are prefetched and reduced; ours runs the real rank's config (`Table.config`: the
padding a rank of E experts on R ranks resolves; `rank_config`: the grouped GEMM picked for its problem);
torch-native runs the same S*K routes over epn + B experts. (`bench.ep_group` times every rank of such a
group, with its peers' traffic.) --device cpu: one step of ours per table on tiny shapes (`CPU_SMOKE`, the
model's E and K kept), no timing (a smoke run).

Targets, checked on the DEFAULT row of every table, from its numbers (`layer_targets`, never set by hand):
`LAYER_TARGETS` at EP=1 (fwd+bwd useful rate >= 0.75 of dense, forward alone >= 0.85, peak memory <= 0.9x
the baseline's: DeepSeek-V3's), `MODEL_LAYER_TARGETS` for Qwen3-MoE (fwd+bwd >= 0.50 of dense) and Mixtral
(>= 0.85) at EP=1, each with peak <= 1.0x torch-native compiled's, `EP_RANK_TARGETS` for one EP rank
(fwd+bwd >= 0.80 of dense, peak <= 1.0x torch-native compiled's on the same routes); a peak check against
the compiled row is left out, and said so, in a run without one; each printed as a PASS / MISS line with the
median and the min-max of the runs, and recorded in `targets` with its `scope`.

--fp8 (the fp8 layer): an fp8 row right after the DEFAULT row, the DEFAULT config with `precision="fp8"`
and `token_padding=128` (`FP8_SETTINGS`: FP8 fwd and dgrad, bf16 wgrad, bf16 master weights), measured
like every row and checked against `FP8_LAYER_TARGETS` (`fp8_layer_targets`): its fwd+bwd speed >= 1.6x
the DEFAULT (bf16) row's, its fwd+bwd time <= 0.45x the baseline's (the faster torch-native bf16 layer),
its peak memory <= the DEFAULT row's, its forward without autograd on frozen weights (inference, the FP8
copies kept) >= 1.5x the DEFAULT row's; printed as PASS / MISS lines and recorded in `fp8_targets`. Where
FP8 cannot run (no sm90, no DeepGEMM) the row is skipped with the reason. Then (`FP8_VARIANTS`) the
DEFAULT config and the fp8 layer again with `PER_STEP` (4) micro-batches per optimizer step (gradient
accumulation, as FP8 training runs: each timed run is one optimizer step's micro-batches, its time given
per micro-batch; the fp8 layer casts its home weights in its first micro-batch and reuses the copies in
the others, `Fp8WeightCache`; the kept copies count in its peak), the fp8 one checked against the bf16 one
by `PER_STEP_FP8_TARGETS` (speed >= 1.4x; peak <= 1.5x at EP=1, <= 1.15x at one EP rank) under its own
scope (`fp8_scope`), then the same in `main_grad`, without and with FP8 weight gradients (`fp8_wgrad`,
which adds into the fp32 `main_grad` only); last, "tokens dispatched as FP8", the fp8 layer with
`fp8_dispatch` (its tokens quantised before dispatch, the FP8 rows kept for backward), checked like the
first fp8 row.

Every timed run starts as after an optimizer step (`optimizer_stepped`: each parameter's version moves, no
kernel runs), so an fp8 layer casts its weights in every run, as it would in training.

Layers, in the order run:
- `torch-native`: what users run today, in the torchtitan style: an fp32 softmax top-k router, a sort-based
  permute, `torch._grouped_mm` experts with autograd, an `index_add` unpermute;
- `torch-native compiled`: the same module under `torch.compile` (default mode, static shapes; the
  data-dependent `bincount` breaks the graph): what a careful user runs. Its first step compiles and is
  timed apart (`compile_s`), never counted; --no-compile skips it; a compilation error is printed and
  recorded (`compile_error`), and the eager layer is then the only baseline;
- `moonep DEFAULT`: `MoEConfig` with only the shapes given, every other setting at its default (what a
  user gets), always the first of ours;
- moonep variants: each of --backends with `expert_grad_dtype="param"` (gradients in the parameters' bf16,
  like the baseline) and each of --main-grad-backends with `main_grad` (a persistent fp32 `main_grad` that
  wgrad adds into, never zeroed here, as across micro-batches), at each --token-paddings value (default:
  the config's default, 128 for deep_gemm, else 16; at EP=1 with E=256, 128 adds ~25% rows, 16 ~3%). A
  variant whose config equals an earlier row's is not run again (`auto`, `param` is the DEFAULT).

Measured per layer, with the same inputs and output gradient (times: CUDA events, the median of --repeat
runs after --warmup; the spread is min-max over those runs):
- fwd+bwd: one training step (`optimizer_stepped`, `zero_grad(set_to_none=True)`, forward, backward; with
  `micro_batches` N, N forwards and backwards, the time over N), timed on the GPU with the host ahead
  (`bench.common.HostAhead`: the GPU held in a device-side wait until the host has queued the whole step, as
  the layers before it hold it in a model), so the host's launch latency is not charged where the layer
  has no host sync; the host's enqueue time of a step is recorded beside it, and the same step timed from
  an idle GPU (`synced_ms`: every launch's latency before the GPU reaches it charged, as records before
  this mode measured);
- fwd: the forward alone, autograd recording as in training (the first half of the step, likewise);
- the useful rate (`routed_flops`): the routed experts' FLOPs only (gate, up and down projections on the
  T x K routed rows; padding rows, the router and the permutation not counted), as TFLOP/s and as a share of
  the dense bf16 rate (`bench.common.measure_limits`, measured at the start of the same run);
- peak memory: the most memory allocated during one step beyond what was allocated before the layer was
  built (its parameters, gradients, comm buffers and activations, and the input's gradient; the inputs and
  the benchmark's own copies of the weights excluded): the caching allocator's peak plus the expert arena's
  memory, which that allocator does not see (one EP rank's home experts and slots mapped with CUDA VMM,
  `transport.arena.physical_bytes`; records up to be25018 left it out);
- ratios, ours over theirs (< 1: faster, smaller): to `torch-native`, to `torch-native compiled`, and to
  the baseline, the faster of the two in fwd+bwd time.

--profile: one step's GPU kernels (and copies, fills) of each of our rows (DEFAULT, the variants asked for,
the fp8 rows) and of `torch-native`, by total time, grouped by kernel name (`kernel_group`) into GEMMs, comm
core, router, elementwise and other, with the time beyond the GEMMs (every other group's) and each group's
share of it, and where the GPU ran nothing (idle time and the longest gaps, `timeline_profile`: a step timed
from idle charges the host's launch latency before its first kernels).

The JSON record, one per table (`bench.common.write_record`: `bench/results/<name>-<device>-<YYYYMMDD>-
<commit>.json`, `<name>` = `Table.record_name`, e.g. `layer-deepseek-v3`, `layer-kimi-k2-ep8-rank`;
rewritten after every row so an interrupted run keeps what it measured): `benchmark`, `device`, `commit`
(`$MOONEP_COMMIT` where set), `command`, `torch`, `date`, `limits` (`copy_bytes_per_s`,
`dense_bf16_flops_per_s`); `setup` (`model`, `model_config`, `overrides`, the shapes, `warmup`, `repeat`,
`flops_fwd_bwd`, `flops_fwd`, and in words what `spread` and `peak_gib` mean; for one EP rank also
`ep_rank_of`, `group_experts`, `home_experts`, `slots`, `ep_rank`); `baseline` (the layer name every
`vs_baseline` divides by); `baselines` (per torch-native layer: `ms`, `ms_min`, `ms_max`, `fwd_ms`,
`peak_gib`, as in its row); `compile_s` (the compiled layer's first step, seconds; null when not compiled)
or `compile_error`; `targets` ([{target, median, min, max, op, bound, pass, row, baseline, scope}], empty
when the DEFAULT row was not measured); `fp8_targets` (the same fields, with --fp8 where the fp8 and
bf16 rows were both measured, else empty); `profile` (with --profile: per layer `total_ms`, `groups_ms`
{group: ms}, `beyond_gemms_ms`, `kernels` [{name, group, calls, ms}], by time, `timeline` {span_ms,
busy_ms, idle_ms, gaps [{ms, after, before}]}) and `results`, one row per
layer in the order run:
- `layer`; `config`: "baseline", "default", "fp8" or "variant"; ours also `backend`, `precision`,
  `expert_grad_dtype`, `token_padding`, `dtype` (the resolved config) and `gemm` (the backend per
  primitive and weight shape);
- `ms`, `ms_min`, `ms_max`, `ms_samples`: fwd+bwd median, spread and every run, in ms; `tflops`: the useful
  rate at the median; `of_dense`: `tflops` over the dense bf16 rate;
- `fwd_ms`, `fwd_ms_min`, `fwd_ms_max`, `fwd_ms_samples`, `fwd_tflops`, `fwd_of_dense`: the same, forward;
- `infer_ms`, `infer_ms_min`, `infer_ms_max`, `infer_ms_samples`, `infer_of_dense` (rows of one micro-batch):
  the forward without autograd, the weights frozen (`inference`: as in serving, an fp8 layer's FP8 copies
  kept);
- `synced_ms`, `synced_ms_min`, `synced_ms_max`, `synced_ms_samples`: fwd+bwd timed from an idle GPU;
  `host_ms`, `host_ms_max`: the host's enqueue time of a step (median, max; per micro-batch), `host_behind`:
  the timed steps whose host took longer than the GPU was held, `hold_ms` (per micro-batch);
- `peak_gib`: peak memory as above, GiB;
- `vs_eager`, `fwd_vs_eager`, `peak_vs_eager`: fwd+bwd time, forward time and peak over `torch-native`'s;
  `vs_compiled`, ...: over `torch-native compiled`'s (absent without it); `vs_baseline`, ...: over the
  baseline's;
- `error` instead of the numbers where a variant ran out of memory.
"""

from __future__ import annotations

import argparse
import gc
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import increment_version

from bench.common import (
    MODELS,
    check,
    cuda_kernels,
    cuda_timeline,
    format_check,
    idle_gaps,
    measure_limits,
    model_shape,
    queued_timings,
    ratio,
    span,
    spread,
    timings,
    write_record,
)
from bench.ep_rank import RankPlan, as_ep_rank, ep_rank_groups, ep_rank_plan
from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.arena import physical_bytes
from moonep_moe.transport.threads import single_world

KERNEL_GROUPS = ("GEMMs", "comm core", "router", "elementwise", "other")
"""The groups of a step profile, in the order printed."""

SPREAD = "min-max of the timed runs (ms_min, ms_max), beside their median (ms)"
PEAK = ("the most memory allocated during one fwd+bwd step minus what was allocated before the layer was "
        "built (the inputs and the benchmark's weight copies excluded)")

KERNEL_RULES = (
    # fp32 GEMMs (cuBLAS SIMT / tf32 / nvjet sss kernels) and bf16 GEMMs with fp32 output (nvjet tss: the
    # bf16x3 router's): the routers' (the experts' GEMMs are CUTLASS, DeepGEMM or Triton kernels)
    ("router", r"sgemm|tf32|nvjet_(sm\d+_)?(sss|tss)|f32f32_f32f32"),
    # cuBLAS, CUTLASS (torch._grouped_mm), DeepGEMM, the Triton wgrad, inductor's GEMM templates
    ("GEMMs", r"gemm|nvjet|cutlass|xmma|wgmma|gemv|grouped_mm|wgrad|splitkreduce|triton_tem_"),
    # rows to and from expert order: moonep_moe.comm.kernels (plan, dispatch, combine, prefetch, reduce_grad),
    # the native layer's sort, gather and index_add (and their backward)
    ("comm core", r"_routes_kernel|_plan_|_destinations_kernel|_duplicates|_mark_primaries|_pre_reduce|"
                  r"_copy_rows|_copy_experts|_clear_slots|_add_replicas|deviceradixsort|index_elementwise|"
                  r"indexselect|indexfunc|indexing_backward"),
    # scores, top-k (its sort) and the route-weight gather / scatter, the expert histogram
    ("router", r"topk|softmax|sortkv|sortkeyvalue|scatter_gather|histogram"),
    # pointwise and reductions: torch's elementwise / reduce kernels, SwiGLU, inductor's fused kernels
    ("elementwise", r"elementwise|reduce_kernel|swiglu|silu|triton_(poi|red|per)_"),
)
"""`(group, pattern)`, first match wins, on the lower-cased kernel name; no match: "other" (copies, fills,
scans, concatenations)."""


def kernel_group(name: str) -> str:
    """The step-profile group (one of `KERNEL_GROUPS`) of a GPU kernel, copy or fill, by its name."""
    lowered = name.lower()
    for group, pattern in KERNEL_RULES:
        if re.search(pattern, lowered):
            return group
    return "other"


def profile_summary(kernels: list[tuple[str, float]]) -> dict:
    """`[(name, ms)]` of one step, one entry per launch -> `{"total_ms", "groups_ms": {group: ms} (every
    group of KERNEL_GROUPS, in order), "beyond_gemms_ms" (the time beyond the GEMMs: every other group's),
    "kernels": [{"name", "group", "calls", "ms"}] (one per name, longest total first)}`."""
    calls, totals = {}, {}
    for name, ms in kernels:
        calls[name] = calls.get(name, 0) + 1
        totals[name] = totals.get(name, 0.0) + ms
    rows = [{"name": name, "group": kernel_group(name), "calls": calls[name], "ms": totals[name]}
            for name in sorted(totals, key=lambda name: (-totals[name], name))]
    groups_ms = {group: sum(row["ms"] for row in rows if row["group"] == group) for group in KERNEL_GROUPS}
    beyond_ms = sum(ms for group, ms in groups_ms.items() if group != "GEMMs")
    return {"total_ms": sum(totals.values()), "groups_ms": groups_ms, "beyond_gemms_ms": beyond_ms,
            "kernels": rows}


def routed_flops(tokens: int, top_k: int, hidden: int, ffn: int, backward: bool) -> int:
    """Useful FLOPs of the routed experts: three projections (gate, up, down; each H x H') on the T*K routed
    rows, 2 per multiply-add; with `backward`, dgrad and wgrad too (3x the forward). Padding rows, the
    router and the permutation are not counted."""
    return (3 if backward else 1) * 3 * 2 * tokens * top_k * hidden * ffn


def variant_settings(backends: list[str], main_grad_backends: list[str],
                     token_paddings: list[int]) -> list[dict]:
    """The `MoEConfig` settings of the variant rows, in the order run: per token padding (none given: the
    config's default), each backend in `backends` with `param` grads, then, where it is also in
    `main_grad_backends`, with `main_grad`; then the `main_grad_backends` not in `backends`."""
    names = list(dict.fromkeys(backends + main_grad_backends))
    runs = []
    for padding in token_paddings or [None]:
        for backend in names:
            grad_dtypes = [g for g, members in (("param", backends), ("main_grad", main_grad_backends))
                           if backend in members]
            for grad_dtype in grad_dtypes:
                settings = dict(grouped_gemm=backend, expert_grad_dtype=grad_dtype)
                if padding is not None:
                    settings["token_padding"] = padding
                runs.append(settings)
    return runs


class TorchNativeMoE(nn.Module):
    """A plain EP=1 MoE block: router -> sort by expert -> grouped GEMMs -> index_add back. On CUDA for the
    benchmarks; `device="cpu"` for tests (`torch._grouped_mm` runs bf16 there too). Weights uninitialised."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, device: torch.device | str = "cuda"):
        super().__init__()
        kwargs = dict(device=device, dtype=torch.bfloat16)
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False, device=device, dtype=torch.float32)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * ffn, hidden, **kwargs))
        self.down = nn.Parameter(torch.empty(experts, hidden, ffn, **kwargs))

    def forward(self, x_th: torch.Tensor) -> torch.Tensor:
        scores_te = self.router(x_th.float()).softmax(-1)
        weights_tk, experts_tk = scores_te.topk(self.top_k, dim=-1)
        weights_tk = weights_tk / weights_tk.sum(-1, keepdim=True)
        order_n = experts_tk.flatten().argsort(stable=True)
        token_n = order_n // self.top_k
        counts_e = torch.bincount(experts_tk.flatten(), minlength=self.gate_up.shape[0])
        offs_e = torch.cumsum(counts_e, 0).to(torch.int32)
        y_nh = native_grouped_swiglu(x_th[token_n], weights_tk.flatten()[order_n], offs_e, self.gate_up,
                                     self.down)
        return torch.zeros_like(x_th).index_add(0, token_n, y_nh)


def native_grouped_swiglu(x_nh: torch.Tensor, weight_n: torch.Tensor, offs_e: torch.Tensor,
                          gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The torch-native layer's experts on rows grouped by expert: `torch._grouped_mm` gate and up, SwiGLU
    times the route weight, `torch._grouped_mm` down (autograd through all of it).

    Args:
        x_nh: `[n, H]` rows, expert by expert. weight_n: `[n]` their route weights. offs_e: `[E]` int32 end
            offsets of the experts' rows. gate_up: `[E, 2H', H]`. down: `[E, H, H']`.
    Returns `[n, H]` in the rows' dtype."""
    gate_nf, up_nf = torch._grouped_mm(x_nh, gate_up.transpose(-2, -1), offs=offs_e).chunk(2, -1)
    h_nf = F.silu(gate_nf) * up_nf * weight_n[:, None].to(x_nh.dtype)
    return torch._grouped_mm(h_nf, down.transpose(-2, -1), offs=offs_e)


def layer_weights(hidden: int, ffn: int, experts: int, seed: int = 0,
                  device: torch.device | str = "cuda") -> dict[str, torch.Tensor]:
    """Both layers' weights under our checkpoint names, drawn on `device` (the GPU; "cpu" for smoke runs and
    tests) from `seed` (the same every call): `router.weight` fp32 `[E, H]`, `experts.gate_up_proj` bf16
    `[E, 2H', H]`, `experts.down_proj` bf16 `[E, H, H']`, each normal with variance 1 / fan-in."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).div_(math.sqrt(shape[-1]))

    return {"router.weight": draw(experts, hidden, dtype=torch.float32),
            "experts.gate_up_proj": draw(experts, 2 * ffn, hidden, dtype=torch.bfloat16),
            "experts.down_proj": draw(experts, hidden, ffn, dtype=torch.bfloat16)}


def native_layer(hidden: int, ffn: int, experts: int, top_k: int,
                 device: torch.device | str = "cuda") -> TorchNativeMoE:
    """The torch-native layer on `device` with `layer_weights`."""
    layer = TorchNativeMoE(hidden, ffn, experts, top_k, device)
    weights = layer_weights(hidden, ffn, experts, device=device)
    with torch.no_grad():
        layer.router.weight.copy_(weights["router.weight"])
        layer.gate_up.copy_(weights["experts.gate_up_proj"])
        layer.down.copy_(weights["experts.down_proj"])
    return layer


def with_layer_weights(layer: MoonEPMoELayer, ep_rank: RankPlan | None = None) -> MoonEPMoELayer:
    """`layer` holding `layer_weights` of its config's shapes and, with `ep_rank`, made that EP rank's
    (`as_ep_rank`): what every table measures of ours."""
    cfg = layer.config
    layer.load_state_dict(layer_weights(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts,
                                        device=layer.world.device))
    return layer if ep_rank is None else as_ep_rank(layer, ep_rank.epn, ep_rank)


def step_inputs(tokens: int, hidden: int,
                device: torch.device | str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """`(x_th, grad_th)`: the tokens `[tokens, hidden]` (requiring their gradient) and the output gradient
    every layer of a table is measured with, bf16 on `device` (the GPU; "cpu" for smoke runs), drawn from
    seed 1 (the same every call)."""
    gen = torch.Generator(device=device).manual_seed(1)
    x_th = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    return x_th, torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)


def optimizer_stepped(layer: nn.Module) -> None:
    """What an optimizer step does to the layer as far as its caches can tell: every parameter's version
    moves (no kernel runs), so an fp8 layer casts its weights again on the next call."""
    for param in layer.parameters():
        increment_version(param)


def step(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor, micro_batches: int = 1) -> None:
    """One optimizer step's work of the layer: its weights just updated (`optimizer_stepped`), fresh
    gradients, then `micro_batches` forwards and backwards (gradient accumulation)."""
    optimizer_stepped(layer)
    layer.zero_grad(set_to_none=True)
    for _ in range(micro_batches):
        x_th.grad = None
        layer(x_th).backward(grad_th)


def forwards(layer: nn.Module, x_th: torch.Tensor, micro_batches: int = 1) -> None:
    """The forward halves of `step`: its weights just updated, then `micro_batches` forwards."""
    optimizer_stepped(layer)
    for _ in range(micro_batches):
        layer(x_th)


@torch.no_grad()
def inference(layer: nn.Module, x_th: torch.Tensor) -> None:
    """One forward without autograd, the weights left as they are (frozen, as in serving): an fp8 layer
    reuses the FP8 copies it kept of them."""
    layer(x_th)


def step_kernels(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor,
                 micro_batches: int = 1) -> list[tuple[str, float]]:
    """`[(name, ms)]`: every GPU kernel, copy and fill of one `step`, one entry per launch."""
    return cuda_kernels(lambda: step(layer, x_th, grad_th, micro_batches))


def profile_lines(label: str, summary: dict) -> list[str]:
    """A `profile_summary`'s groups as printed lines: each group's ms and share of the step, and for every
    group but the GEMMs its share of the time beyond the GEMMs, which the last line totals."""
    total, beyond = summary["total_ms"], summary["beyond_gemms_ms"]
    lines = [f"{label}: one step, {total:.2f} ms of GPU kernels",
             f"  {'group':12} {'ms':>8} {'of step':>7} {'of time beyond the GEMMs':>25}"]
    for group, ms in summary["groups_ms"].items():
        share = "" if group == "GEMMs" else f"{ms / max(beyond, 1e-9):.1%}"
        lines.append(f"  {group:12} {ms:8.2f} {ms / max(total, 1e-9):7.1%} {share:>25}")
    lines.append(f"  time beyond the GEMMs: {beyond:.2f} ms, {beyond / max(total, 1e-9):.1%} of the step")
    return lines


def timeline_profile(timeline: list[tuple[str, float, float]]) -> dict:
    """The `profile_summary` of a `cuda_timeline` (bench.common), with where the GPU idled in it
    (`"timeline"`: `idle_gaps`)."""
    summary = profile_summary([(name, end - start) for name, start, end in timeline])
    return {**summary, "timeline": idle_gaps(timeline)}


def idle_line(idle: dict) -> str:
    """An `idle_gaps` as one printed line: the GPU's idle time in the span and the longest gaps."""
    gaps = "; ".join(f"{gap['ms']:.3f} ms after {gap['after'][:40]} before {gap['before'][:40]}"
                     for gap in idle["gaps"])
    return f"  GPU idle {idle['idle_ms']:.2f} of {idle['span_ms']:.2f} ms; longest gaps: {gaps}"


def print_profile(label: str, summary: dict, top: int = 15) -> None:
    """A `profile_summary` as two tables: the groups (`profile_lines`), then the `top` kernels by time; for a
    `timeline_profile`, where the GPU idled (`idle_line`)."""
    print("\n" + "\n".join(profile_lines(label, summary)))
    print(f"  {'group':12} {'ms':>8} {'calls':>5}  kernel")
    for kernel in summary["kernels"][:top]:
        print(f"  {kernel['group']:12} {kernel['ms']:8.2f} {kernel['calls']:5d}  {kernel['name'][:100]}")
    if "timeline" in summary:
        print(idle_line(summary["timeline"]))
    print(flush=True)


def add_ratios(row: dict, reference: dict, tag: str) -> None:
    """`vs_<tag>`, `fwd_vs_<tag>`, `peak_vs_<tag>`: the row's fwd+bwd time, forward time and peak over
    `reference`'s."""
    for key, measured in (("vs", "ms"), ("fwd_vs", "fwd_ms"), ("peak_vs", "peak_gib")):
        row[f"{key}_{tag}"] = row[measured] / reference[measured]


def header() -> str:
    spread_ = "median (min-max) ms"
    return (f"{'layer':46} {'fwd+bwd ' + spread_:>27} {'dense':>5} {'xeager':>6} {'xcomp':>6} | "
            f"{'fwd ' + spread_:>24} {'dense':>5} {'xeager':>6} {'xcomp':>6} | "
            f"{'peak GiB':>8} {'xeager':>6} {'xcomp':>6} | {'synced':>6} {'host':>5} | {'infer':>6}")


def format_row(row: dict) -> str:
    """One printed line: time (median and spread), share of dense and ratios to torch-native eager and
    compiled, for fwd+bwd, then fwd, then peak memory ("-": not measured), then fwd+bwd timed from an idle
    GPU, the host's enqueue time of a step and the forward without autograd on frozen weights (ms; "-": not
    measured)."""
    if "error" in row:
        return f"{row['layer']:46} {row['error']}"

    def ratio(key: str) -> str:
        return f"{row[key]:5.2f}x" if key in row else f"{'-':>6}"

    def timing(prefix: str, width: int) -> str:
        text = f"{row[prefix + 'ms']:.2f} ({row[prefix + 'ms_min']:.2f}-{row[prefix + 'ms_max']:.2f})"
        return f"{text:>{width}} {row[prefix + 'of_dense']:5.2f} {ratio(prefix + 'vs_eager')} " \
               f"{ratio(prefix + 'vs_compiled')}"

    return (f"{row['layer']:46} {timing('', 27)} | {timing('fwd_', 24)} | {row['peak_gib']:8.1f} "
            f"{ratio('peak_vs_eager')} {ratio('peak_vs_compiled')} | {row['synced_ms']:6.2f} "
            f"{row['host_ms']:5.2f} | " + (f"{row['infer_ms']:6.2f}" if "infer_ms" in row else f"{'-':>6}"))


def free_memory() -> int:
    """Collect garbage and return cached blocks; the bytes still allocated, the arena's included
    (`physical_bytes`: the expert weights mapped outside the caching allocator)."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() + physical_bytes("cuda")


def compile_native(layer: nn.Module, x_th: torch.Tensor, grad_th: torch.Tensor) -> tuple[nn.Module, float]:
    """`torch.compile(layer)` (default mode, static shapes) and the seconds of its first step (compiling
    forward and backward); later steps run the compiled graphs."""
    compiled = torch.compile(layer, dynamic=False)
    start = time.perf_counter()
    step(compiled, x_th, grad_th)
    torch.cuda.synchronize()
    return compiled, time.perf_counter() - start


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


def run_ours(cfg: MoEConfig, name: str, default: bool, bench: Bench, profiles: dict | None,
             ep_rank: RankPlan | None = None, micro_batches: int = 1) -> dict | None:
    """Our layer built from `cfg` with `layer_weights` (with `ep_rank`: then made that EP rank's,
    `as_ep_rank`), measured (`Bench.measure`, `micro_batches` per optimizer step), released: its
    row, None (printed) where `cfg` cannot run here, a row with `error` where it ran out of memory. With
    `profiles`, its step profile is stored there under `name`."""
    before = free_memory()
    try:
        layer = MoonEPMoELayer(cfg, single_world("cuda"))
    except ValueError as error:
        print(f"skipping {name}: {error}", flush=True)
        return None
    kind = "default" if default else "fp8" if cfg.precision == "fp8" else "variant"
    row = {"layer": name, "config": kind, "backend": cfg.grouped_gemm, "precision": cfg.precision,
           "expert_grad_dtype": cfg.expert_grad_dtype, "token_padding": cfg.token_padding, "dtype": cfg.dtype,
           "micro_batches": micro_batches, "fp8_dispatch": cfg.fp8_dispatch, "fp8_wgrad": cfg.fp8_wgrad}
    try:
        with_layer_weights(layer, ep_rank)
        gemm = layer._state.gemm  # the backend of each primitive ("auto" picks per weight shape)
        row["gemm"] = gemm.describe() if hasattr(gemm, "describe") else gemm.name
        row.update(bench.measure(layer, before, micro_batches))
        if profiles is not None:
            profiles[name] = bench.profile(layer, micro_batches)
    except torch.OutOfMemoryError as error:
        row["error"] = f"out of memory: {str(error).splitlines()[0]}"
    finally:
        layer.destroy()
        del layer
    return row


def run_all_ours(bench: Bench, table: Table, variants: list[dict], profiles: dict | None,
                 ep_rank: RankPlan | None = None) -> Iterator[dict]:
    """The DEFAULT row (`table.config({})`), then one row per variant (`variant_settings`) whose config
    can be built and differs from every earlier row's, each profiled into `profiles` when given; with
    `ep_rank`, each layer made that EP rank's (`as_ep_rank`, names prefixed "EP rank")."""
    seen = set()
    for settings in [{}] + variants:
        micro_batches = settings.get(MICRO_BATCHES, 1)
        fields = {key: value for key, value in settings.items() if key != MICRO_BATCHES}
        try:
            cfg = table.config(fields)
        except ValueError as error:
            print(f"skipping {settings}: {error}", flush=True)
            continue
        what = f"{cfg.grouped_gemm}, {cfg.expert_grad_dtype} grads, tp {cfg.token_padding}"
        if cfg.precision != "bf16":
            what = f"{cfg.precision}, {what}"
        if micro_batches > 1:
            what = f"{what}, {micro_batches} micro-batches"
        if cfg.fp8_wgrad:
            what = f"{what}, fp8 wgrad"
        if cfg.fp8_dispatch:
            what = f"{what}, fp8 dispatch"
        name = f"moonep DEFAULT ({what})" if not fields else f"moonep ({what})"
        if ep_rank is not None:
            name = f"EP rank {name}"
        if (cfg.model_dump_json(), micro_batches) in seen:
            print(f"{name:46} the same config as an earlier row, not run again", flush=True)
            continue
        seen.add((cfg.model_dump_json(), micro_batches))
        row = run_ours(cfg, name, not fields, bench, profiles, ep_rank, micro_batches)
        if row is not None:
            yield row


def run_native(bench: Bench, compile_too: bool, record: dict) -> list[dict]:
    """The baseline rows: torch-native eager, then compiled (unless not `compile_too`), each with its ratios
    to the other; `record` gets `compile_s` or `compile_error` and, where `record["profile"]` exists, the
    eager layer's step profile."""
    x_th, grad_th = bench.x_th, bench.grad_th
    before = free_memory()
    native = native_layer(*bench.shape)
    eager = {"layer": "torch-native", "config": "baseline", **bench.measure(native, before)}
    add_ratios(eager, eager, "eager")
    print(format_row(eager), flush=True)
    if "profile" in record:
        record["profile"]["torch-native"] = bench.profile(native)
    rows = [eager]
    if compile_too:
        try:
            compiled, record["compile_s"] = compile_native(native, x_th, grad_th)
            ref = {"layer": "torch-native compiled", "config": "baseline", **bench.measure(compiled, before)}
            del compiled
        except Exception as error:  # noqa: BLE001 - printed and recorded; the eager baseline remains
            record["compile_error"] = f"{type(error).__name__}: {error}"[:2000]
            print(f"torch.compile baseline failed, eager only: {record['compile_error'][:300]}", flush=True)
        else:
            add_ratios(ref, eager, "eager")
            for row in (eager, ref):
                add_ratios(row, ref, "compiled")
            print(f"{format_row(ref)}   (compiled in {record['compile_s']:.0f} s, not counted)", flush=True)
            rows.append(ref)
        torch.compiler.reset()
    return rows


EP_RANK = ("one rank of an EP group of ep_rank_of ranks (--ep-rank-of), in a one-rank world (bench.ep_rank."
           "as_ep_rank): the group's routing at maxvio (bench.skew) planned by the real planner (balance "
           "exact), the rank hosting the most replicas (ep_rank_plan) with its S*K routes per home expert "
           "and per slot as planned (the router runs, its choice replaced by the plan's, planned_topk) "
           "through the real planner, row kernels, grouped GEMMs over home_experts home + slots slot "
           "groups (slot j holds home expert j; weights joined by the arena where it applies) and combine; "
           "prefetch and reduce_grad stood in for by local copies of the same bytes, for the slots the plan "
           "fills only. Left out: all peer traffic (the "
           "histogram all-gather, rows to and from other ranks, weights and gradients over NVLink), every "
           "wait on a peer, and the duplicate rows' expansion and pre-reduction (a one-rank plan has no "
           "duplicates; with K = R = 8 about a third of a real rank's routes are); the torch-native rows run "
           "the same routed work on home_experts + slots experts")
"""What the `--ep-rank-of` rows measure and leave out (the record's `setup.ep_rank`)."""


@dataclass(frozen=True)
class Table:
    """One table of the benchmark: a model's layer at EP=1, or (`ep_rank_of` R) ONE rank of an EP group of R
    ranks over `experts` experts (`as_ep_rank`: epn = E / R home + epn slot groups, of which the slots the
    group's plan at `maxvio` fills, `ep_rank_plan`). Pure description."""

    model: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    """E of the model (of the whole EP group for `ep_rank_of`)."""
    top_k: int
    ep_rank_of: int | None = None
    overrides: tuple[tuple[str, int], ...] = ()
    """The shapes given on the command line instead of the model's, `(name, value)`."""
    maxvio: float = 0.0
    """For `ep_rank_of`: the group's routing skew whose plan gives the rank's groups."""

    @property
    def epn(self) -> int | None:
        """Home experts (and slots) of the one rank, None at EP=1."""
        return None if self.ep_rank_of is None else ep_rank_groups(self.experts, self.ep_rank_of)[0]

    @property
    def shapes(self) -> dict[str, int]:
        """The one-rank layer's `MoEConfig` shapes (its experts: E, or epn home then epn slots)."""
        experts = self.experts if self.epn is None else 2 * self.epn
        return dict(hidden_size=self.hidden, ffn_hidden_size=self.ffn, num_experts=experts, top_k=self.top_k,
                    max_tokens_per_rank=self.tokens)

    def config(self, fields: dict) -> MoEConfig:
        """The one-rank layer's config with `fields` (`shapes`, then `fields`); for one EP rank a
        `token_padding` left out is the real rank's default (`MoEConfig` over `experts` on `ep_rank_of`
        ranks: it depends on the rows per home expert), not the stand-in's over `2 * epn` experts."""
        if self.ep_rank_of is not None and "token_padding" not in fields:
            group = {**self.shapes, "num_experts": self.experts, "ep_size": self.ep_rank_of, **fields}
            fields = {**fields, "token_padding": MoEConfig(**group).token_padding}
        return MoEConfig(**self.shapes, **fields)

    @property
    def setup(self) -> dict:
        """What a record's `setup` says of the table: the model, its shapes (E of the one-rank layer), R and
        the maxvio of the rank's plan."""
        return {"model": self.model, "tokens": self.tokens, "hidden": self.hidden, "ffn": self.ffn,
                "experts": self.shapes["num_experts"], "top_k": self.top_k, "ep_rank_of": self.ep_rank_of,
                "maxvio": self.maxvio}

    @property
    def label(self) -> str:
        where = "EP=1" if self.ep_rank_of is None else f"one rank of EP={self.ep_rank_of}"
        if self.ep_rank_of is not None and self.maxvio:
            where += f" at maxvio {self.maxvio:g}"
        given = "".join(f", {name}={value}" for name, value in self.overrides)
        return f"{self.model} {where}{given}"

    @property
    def record_name(self) -> str:
        """`layer-<model>`, then `-ep<R>-rank` for one EP rank (`-maxvio<m>` where not 0) and `-custom` with
        overrides."""
        rank = "" if self.ep_rank_of is None else f"-ep{self.ep_rank_of}-rank"
        if self.ep_rank_of is not None and self.maxvio:
            rank += f"-maxvio{self.maxvio:g}"
        return f"layer-{self.model}{rank}{'-custom' if self.overrides else ''}"

    @property
    def bounds(self) -> tuple:
        """The DEFAULT row's targets: `EP_RANK_TARGETS` for one EP rank of the model's shapes, the model's
        own `MODEL_LAYER_TARGETS` at EP=1 where it has them, else `LAYER_TARGETS`."""
        if self.overrides:
            return LAYER_TARGETS
        if self.ep_rank_of is not None:
            return EP_RANK_TARGETS
        return MODEL_LAYER_TARGETS.get(self.model, LAYER_TARGETS)

    @property
    def scope(self) -> str:
        """Which targets the DEFAULT row's checks are (`bounds`)."""
        if self.overrides:
            return "custom shapes: the EP=1 layer's bounds, for comparison only"
        if self.ep_rank_of is not None:
            return f"one rank of EP={self.ep_rank_of} with a real plan's slots, whole layer"
        if self.model == "deepseek-v3":
            return "the EP=1 layer"
        if self.model in MODEL_LAYER_TARGETS:
            return f"the EP=1 layer of {self.model}"
        return "no target of its own: the EP=1 layer's bounds, to say where it stands"


SHAPE_ARGS = ("tokens", "hidden", "ffn", "experts", "top_k")
"""The command line's shape options, each overriding the model's value where given."""

MODEL_TABLES = (("deepseek-v3", None), ("deepseek-v3", 8), ("kimi-k2", 8), ("qwen3-moe-30b-a3b", None),
                ("mixtral-8x7b", None))
"""`--model all`: the whole model table, `(model, ep_rank_of)`: DeepSeek-V3 at EP=1, one rank of
EP=8 for DeepSeek-V3 and Kimi-K2, Qwen3-MoE-30B-A3B and Mixtral-8x7B at EP=1."""

CPU_SMOKE = {"tokens": 64, "hidden": 64, "ffn": 32}
"""`--device cpu`: the model's E and K (and R), on these tiny T, H and H' unless given."""


def make_table(model: str, ep_rank_of: int | None, overrides: dict[str, int], maxvio: float = 0.0) -> Table:
    """The `Table` of a packaged model config (`bench.common.model_shape`), with `overrides` (SHAPE_ARGS
    keys) in place of its shapes; `maxvio` for an EP rank's plan. Raises ValueError naming --ep-rank-of
    where R does not divide E."""
    unknown = set(overrides) - set(SHAPE_ARGS)
    if unknown:
        raise ValueError(f"make_table: overrides must be among {SHAPE_ARGS}, got {sorted(unknown)}")
    shape = {key: model_shape(model)[key] for key in SHAPE_ARGS}
    table = Table(model, **{**shape, **overrides}, ep_rank_of=ep_rank_of,
                  overrides=tuple((key, overrides[key]) for key in SHAPE_ARGS if key in overrides),
                  maxvio=maxvio if ep_rank_of is not None else 0.0)
    if ep_rank_of is not None:
        ep_rank_groups(table.experts, ep_rank_of)  # raises, naming --ep-rank-of, before any kernel runs
    return table


def add_table_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --ep-rank-of and --maxvio, as a bench that measures one packaged model's `Table` takes them
    (`table_from_arguments`)."""
    parser.add_argument("--model", default="deepseek-v3", help="a packaged model config (bench.layer's)")
    parser.add_argument("--ep-rank-of", type=int, default=None, metavar="R",
                        help="one rank of EP=R (bench.layer's --ep-rank-of)")
    parser.add_argument("--maxvio", type=float, default=0.0,
                        help="with --ep-rank-of: the group's routing skew")


def table_from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Table:
    """`make_table` of `add_table_arguments`' values (the model's own shapes); what it refuses is the
    parser's error (exit 2, the message naming the argument)."""
    try:
        return make_table(args.model, args.ep_rank_of, {}, args.maxvio)
    except ValueError as error:
        parser.error(str(error))


LAYER_TARGETS = (  # (what, op, bound): the EP=1 layer, on the DEFAULT row
    ("fwd+bwd of dense", ">=", 0.75),
    ("fwd of dense", ">=", 0.85),
    ("peak vs baseline", "<=", 0.9),
)
EP_RANK_TARGETS = (  # (what, op, bound): one EP rank with a real plan's slots, on the DEFAULT row
    ("fwd+bwd of dense", ">=", 0.80),
    ("peak vs compiled", "<=", 1.0),
)
MODEL_LAYER_TARGETS = {  # model: (what, op, bound), its EP=1 layer's own, on the DEFAULT row
    "qwen3-moe-30b-a3b": (("fwd+bwd of dense", ">=", 0.50), ("peak vs compiled", "<=", 1.0)),
    "mixtral-8x7b": (("fwd+bwd of dense", ">=", 0.85), ("peak vs compiled", "<=", 1.0)),
}


def layer_targets(row: dict, baseline: dict, flops: dict[str, int], dense: float, scope: str,
                  bounds: tuple = LAYER_TARGETS, compiled: dict | None = None) -> list[dict]:
    """`bounds` (`LAYER_TARGETS`, or `EP_RANK_TARGETS` for one EP rank) checked on one row: its useful rate
    over `dense` (fwd+bwd `flops["fwd_bwd"]` and fwd `flops["fwd"]` over the median time, the spread from
    the min-max), its peak over the `baseline` row's (the faster torch-native) or over the `compiled` row's
    (torch-native compiled: that check is left out, and said so, where the run compiled none); peaks are
    measured once. Each entry names the row, the row compared with and `scope`."""
    rates = {"fwd+bwd of dense": ratio(flops["fwd_bwd"] / dense * 1e3, span(row)),
             "fwd of dense": ratio(flops["fwd"] / dense * 1e3, span(row, "fwd_"))}
    peaks_of = {"peak vs baseline": baseline, "peak vs compiled": compiled}
    targets = []
    for what, op, bound in bounds:
        if what in rates:
            value, other = rates[what], baseline
        elif (other := peaks_of[what]) is not None:
            value = ratio(row["peak_gib"], other["peak_gib"])
        else:
            print(f"target {what!r} not checked: no torch-native compiled row in this run", flush=True)
            continue
        targets.append(check(what, value, op, bound, row=row["layer"], baseline=other["layer"], scope=scope))
    return targets


FP8_SETTINGS = {"precision": "fp8", "token_padding": 128}
"""--fp8: the fp8 row's config, the DEFAULT config with these settings."""
MICRO_BATCHES = "micro_batches"
"""A row setting that is not a config field: the micro-batches per optimizer step each timed run makes
(gradient accumulation; `step`), its time reported per micro-batch."""
PER_STEP = 4
"""--fp8's micro-batches per optimizer step for its per-step rows (as FP8 training runs accumulate)."""
FP8_MAIN_GRAD = {**FP8_SETTINGS, "expert_grad_dtype": "main_grad", MICRO_BATCHES: PER_STEP}
FP8_VARIANTS = [FP8_SETTINGS, {MICRO_BATCHES: PER_STEP}, {**FP8_SETTINGS, MICRO_BATCHES: PER_STEP},
                FP8_MAIN_GRAD, {**FP8_MAIN_GRAD, "fp8_wgrad": True}, {**FP8_SETTINGS, "fp8_dispatch": True}]
"""--fp8's rows: the fp8 layer; our bf16 DEFAULT and the fp8 layer with `PER_STEP` micro-batches per
optimizer step (the fp8 layer's weight casts paid once per step: `Fp8WeightCache`), in the default gradient
mode and in `main_grad`, there without and with FP8 weight gradients (`MoEConfig.fp8_wgrad`, which adds into
the fp32 `main_grad`); the fp8 layer dispatching its tokens as FP8 (`MoEConfig.fp8_dispatch`)."""

FP8_LAYER_TARGETS = (  # (what, op, bound): on the fp8 row of one micro-batch per optimizer step
    ("fp8 speed vs our bf16", ">=", 1.6),
    ("fp8 time vs torch-native bf16", "<=", 0.45),
    ("fp8 peak vs our bf16", "<=", 1.0),
    ("fp8 inference forward vs our bf16", ">=", 1.5),
)
PER_STEP_FP8_TARGETS = {  # (what, op, bound) on the fp8 row of `PER_STEP` micro-batches, by the table's scope
    "ep1": (("fp8 speed vs our bf16", ">=", 1.4), ("fp8 peak vs our bf16", "<=", 1.5)),
    "ep_rank": (("fp8 speed vs our bf16", ">=", 1.4), ("fp8 peak vs our bf16", "<=", 1.15)),
}
"""At EP=1 the weights are most of the memory, so both FP8 copies may add up to half again; at one EP rank
they may add 15%."""


def fp8_scope(row: dict) -> str:
    """The scope an fp8 row's `fp8_layer_targets` are recorded under: the fp8 layer, and how the row
    differs from the plain fp8 layer."""
    per_step = row[MICRO_BATCHES]
    return ("the fp8 layer" + f", {per_step} micro-batches per optimizer step" * (per_step > 1)
            + ", FP8 weight gradients" * row["fp8_wgrad"]
            + f", expert_grad_dtype {row['expert_grad_dtype']}" * (row["expert_grad_dtype"] != "param")
            + ", tokens dispatched as FP8" * row["fp8_dispatch"])


def fp8_layer_targets(fp8: dict, default: dict, baseline: dict, scope: str,
                      bounds: tuple = FP8_LAYER_TARGETS) -> list[dict]:
    """`bounds` (`FP8_LAYER_TARGETS`, or a `PER_STEP_FP8_TARGETS` entry) checked on the fp8 row: the bf16
    row's (`default`, the same micro-batches) fwd+bwd time over its own (its speed relative to ours in
    bf16), its fwd+bwd time over the `baseline` row's (the faster torch-native), its peak over the bf16
    row's, the bf16 row's `inference` forward over its own (frozen weights: the FP8 copies kept). Each entry
    names the rows compared and `scope`."""
    values = {"fp8 speed vs our bf16": lambda: ratio(span(default), span(fp8)),
              "fp8 time vs torch-native bf16": lambda: ratio(span(fp8), span(baseline)),
              "fp8 peak vs our bf16": lambda: ratio(fp8["peak_gib"], default["peak_gib"]),
              "fp8 inference forward vs our bf16": lambda: ratio(span(default, "infer_"),
                                                                 span(fp8, "infer_"))}
    return [check(what, values[what](), op, bound, row=fp8["layer"], baseline=baseline["layer"],
                  bf16_row=default["layer"], scope=scope) for what, op, bound in bounds]


def table_rank_plan(table: Table, device: torch.device | str) -> RankPlan | None:
    """The EP rank of an `ep_rank_of` table (`ep_rank_plan` at its maxvio, routed on `device`), else None."""
    if table.ep_rank_of is None:
        return None
    return ep_rank_plan(table.experts, table.ep_rank_of, table.tokens, table.top_k, table.maxvio, device)


def smoke(table: Table) -> None:
    """`--device cpu`: one training step of ours (the DEFAULT config; for an EP rank, made one by
    `as_ep_rank` with its plan) on the CPU, printing the routes per compute group; no timing (CPU numbers
    mean nothing)."""
    epn = table.epn
    layer = MoonEPMoELayer(table.config({}), single_world("cpu"))
    if epn is not None:
        as_ep_rank(layer, epn, table_rank_plan(table, "cpu"))
    cfg = layer.config
    x_th = torch.randn(cfg.max_tokens_per_rank, cfg.hidden_size, dtype=cfg.torch_dtype, requires_grad=True)
    step(layer, x_th, torch.randn_like(x_th))
    ends = layer._state.last_plan.cu_seqlens
    rows = torch.diff(ends, prepend=ends.new_zeros(1))
    parts = {"experts": rows} if epn is None else {"home": rows[:epn], "slots": rows[epn:]}
    used = ", ".join(f"{what} {int((part > 0).sum())} of {len(part)} groups, {int(part.sum())} padded rows"
                     for what, part in parts.items())
    print(f"cpu smoke, {table.label}: one fwd+bwd step ran, {cfg.max_tokens_per_rank * cfg.top_k} routes; "
          f"{used}; gemm {layer._state.gemm.name}; no timing on CPU", flush=True)
    layer.destroy()


def run_table(table: Table, variants: list[dict], args: argparse.Namespace,
              limits: dict[str, float]) -> tuple[list[dict], Path]:
    """Every layer of one table measured on the GPU (baselines, DEFAULT, `variants`), its record written
    after every row; the DEFAULT row's `layer_targets` printed and recorded. Returns the targets and the
    record's path."""
    t, h, f, k = table.tokens, table.hidden, table.ffn, table.top_k
    shapes, epn = table.shapes, table.epn
    rank_plan = table_rank_plan(table, "cuda")
    e = shapes["num_experts"]
    x_th, grad_th = step_inputs(t, h)
    bench = Bench(x_th=x_th, grad_th=grad_th,
                  shape=(h, f, e, k), dense=limits["dense_bf16_flops_per_s"], warmup=args.warmup,
                  repeat=args.repeat, flops={"fwd_bwd": routed_flops(t, k, h, f, backward=True),
                                             "fwd": routed_flops(t, k, h, f, backward=False)})
    record = {"setup": {"model": table.model, "model_config": f"moonep_moe/configs/{table.model}.yaml",
                        "overrides": dict(table.overrides), "tokens": t, "hidden": h, "ffn": f, "experts": e,
                        "top_k": k, "warmup": args.warmup, "repeat": args.repeat,
                        "flops_fwd_bwd": bench.flops["fwd_bwd"], "flops_fwd": bench.flops["fwd"],
                        "spread": SPREAD, "peak_gib": PEAK},
              "baseline": None, "baselines": {}, "compile_s": None, "targets": [], "fp8_targets": []}
    if epn is not None:
        record["setup"].update(ep_rank_of=table.ep_rank_of, group_experts=table.experts, home_experts=epn,
                               slots=epn, ep_rank=EP_RANK, maxvio=table.maxvio,
                               ep_rank_plan=rank_plan.describe())
    if args.profile:
        record["profile"] = {}
    rows = []

    def save() -> Path:
        return write_record(table.record_name, limits, rows, Path(args.out) if args.out else None,
                            ran_on=args.device, **record)

    print(f"\n{table.label}: {t} tokens, H={h}, H'={f}, E={e}, K={k}: {bench.flops['fwd_bwd'] / 1e12:.2f} "
          f"TFLOP of routed work fwd+bwd; dense bf16 {bench.dense / 1e12:.0f} TFLOP/s. Times: median "
          f"(min-max) of {args.repeat} runs; dense: useful rate / dense rate; x: ours / torch-native eager, "
          "compiled", flush=True)
    print(header(), flush=True)
    rows += run_native(bench, not args.no_compile, record)
    baseline = min(rows, key=lambda row: row["ms"])
    record["baseline"] = baseline["layer"]
    record["baselines"] = {row["layer"]: {key: row[key] for key in ("ms", "ms_min", "ms_max", "fwd_ms",
                                                                    "peak_gib")} for row in rows}
    refs = {"eager": rows[0], "compiled": rows[1] if len(rows) > 1 else None, "baseline": baseline}
    for row in rows:
        add_ratios(row, baseline, "baseline")
    save()

    bf16 = {}  # micro-batches per optimizer step -> the DEFAULT config's row measured so
    for row in run_all_ours(bench, table, variants, record.get("profile"), rank_plan):
        if "error" not in row:
            for tag, ref in refs.items():
                if ref is not None:
                    add_ratios(row, ref, tag)
            per_step = row["micro_batches"]
            if row["config"] == "default":
                if per_step == 1:
                    record["targets"] = layer_targets(row, baseline, bench.flops, bench.dense, table.scope,
                                                      table.bounds, refs["compiled"])
                bf16[per_step] = row
            if row["config"] == "fp8" and per_step in bf16:
                bounds = (FP8_LAYER_TARGETS if per_step == 1
                          else PER_STEP_FP8_TARGETS["ep1" if epn is None else "ep_rank"])
                record["fp8_targets"] += fp8_layer_targets(row, bf16[per_step], baseline, fp8_scope(row),
                                                           bounds)
        rows.append(row)
        print(format_row(row), flush=True)
        save()
    for label, summary in record.get("profile", {}).items():
        print_profile(label, summary)
    print_targets(table.label, record["targets"], args.repeat)
    if record["fp8_targets"]:
        print_targets(table.label, record["fp8_targets"], args.repeat, "fp8 row against DEFAULT")
    return record["targets"] + record["fp8_targets"], save()


def print_targets(label: str, targets: list[dict], repeat: int, rows: str = "DEFAULT row") -> None:
    """The pass/miss lines of one table's targets on `rows` (none: those rows were not measured), grouped
    by scope."""
    if not targets:
        print(f"{label}: no {rows} measured, so no targets checked", flush=True)
        return
    for scope in dict.fromkeys(target["scope"] for target in targets):
        print(f"{label}, {rows}, {scope} (median (min-max) of {repeat} runs):", flush=True)
        for target in targets:
            if target["scope"] == scope:
                print(f"  {format_check(target)}", flush=True)


DEFAULT_VARIANTS = {"backends": ["auto", "triton", "torch", "deep_gemm"], "main_grad_backends": ["auto"]}
"""--backends' and --main-grad-backends' defaults for one table."""


def table_variants(backends: list[str] | None, main_grad: list[str] | None, token_paddings: list[int],
                   tables: int, fp8: bool = False) -> list[dict]:
    """`variant_settings` of --backends and --main-grad-backends (`main_grad`), after `FP8_SETTINGS` with
    `fp8` (--fp8: the fp8 row right after DEFAULT); a list not given (None) is `DEFAULT_VARIANTS`' for one
    table and empty for several (--model all: the baselines and the DEFAULT row of every table)."""
    defaults = DEFAULT_VARIANTS if tables == 1 else dict.fromkeys(DEFAULT_VARIANTS, [])
    fp8_rows = FP8_VARIANTS if fp8 else []
    return fp8_rows + variant_settings(defaults["backends"] if backends is None else backends,
                                       defaults["main_grad_backends"] if main_grad is None else main_grad,
                                       token_paddings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--models", default="deepseek-v3", choices=[*MODELS, "all"],
                        help="the layer's shapes from moonep_moe/configs/<model>.yaml; all: the whole "
                             "whole table (MODEL_TABLES)")
    parser.add_argument("--tokens", type=int, default=None, help="S (default: the model's)")
    parser.add_argument("--hidden", type=int, default=None, help="H (default: the model's)")
    parser.add_argument("--ffn", type=int, default=None, help="H' (default: the model's)")
    parser.add_argument("--experts", type=int, default=None, help="E (default: the model's)")
    parser.add_argument("--top-k", type=int, default=None, help="K (default: the model's)")
    parser.add_argument("--backends", nargs="*", default=None,
                        help="grouped_gemm values run with expert_grad_dtype='param' (default "
                             f"{DEFAULT_VARIANTS['backends']}; none with --model all)")
    parser.add_argument("--main-grad-backends", nargs="*", default=None,
                        help="grouped_gemm values run with expert_grad_dtype='main_grad' (default ['auto']; "
                             "none with --model all)")
    parser.add_argument("--token-paddings", nargs="*", type=int, default=[],
                        help="MoEConfig.token_padding values for every variant (default: the config's)")
    parser.add_argument("--fp8", action="store_true",
                        help="also the fp8 row (precision='fp8', token_padding=128) after DEFAULT, with "
                             "its targets against it (FP8_LAYER_TARGETS)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per layer (the median of them)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--profile", action="store_true",
                        help="also one step's GPU kernels of each of our rows and of torch-native, grouped")
    parser.add_argument("--ep-rank-of", type=int, default=None, metavar="R",
                        help="measure ONE rank of an EP group of R ranks over the model's experts instead "
                             "(S=--tokens, epn home groups and the slots the group's plan fills; no peer "
                             "traffic: see EP_RANK)")
    parser.add_argument("--maxvio", type=float, default=None,
                        help="with --ep-rank-of (or --model all's EP tables): the group's routing skew whose "
                             "plan gives the rank its slots (default 0)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help=f"cpu: a smoke run of ours (one step, no timing) on {CPU_SMOKE} unless given")
    parser.add_argument("--out", default=None, help="folder of the JSON records (default bench/results)")
    args = parser.parse_args()
    if args.repeat < 5:
        parser.error(f"--repeat must be >= 5 (a median with a spread), got {args.repeat}")
    if args.model == "all" and args.ep_rank_of is not None:
        parser.error("--ep-rank-of: --model all runs its own EP ranks (MODEL_TABLES); give one --model")
    if args.maxvio is not None and args.model != "all" and args.ep_rank_of is None:
        parser.error("--maxvio: it skews the group of --ep-rank-of's rank; give --ep-rank-of")
    given = {key: getattr(args, key) for key in SHAPE_ARGS if getattr(args, key) is not None}
    if args.device == "cpu":
        given = {**CPU_SMOKE, **given}
    pairs = MODEL_TABLES if args.model == "all" else ((args.model, args.ep_rank_of),)
    try:
        tables = [make_table(model, ep_rank_of, given, args.maxvio or 0.0) for model, ep_rank_of in pairs]
    except ValueError as error:
        parser.error(str(error))
    if args.device == "cpu":
        for table in tables:
            smoke(table)
        return
    variants = table_variants(args.backends, args.main_grad_backends, args.token_paddings, len(tables),
                              args.fp8)
    limits = measure_limits()
    done = [(table, *run_table(table, variants, args, limits)) for table in tables]
    if len(done) > 1:
        print("\nthe model table, every DEFAULT row (records: bench/results or --out):")
        for table, targets, path in done:
            print_targets(table.label, targets, args.repeat)
            print(f"  record: {path}")
    else:
        print("results:", done[0][2])


if __name__ == "__main__":
    main()
