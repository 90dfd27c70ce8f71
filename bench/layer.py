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
`LAYER_TARGETS` at EP=1 (fwd+bwd useful rate >= 0.65 of dense, forward alone >= 0.75, peak memory <= 0.9x
torch-native compiled's: DeepSeek-V3's), `MODEL_LAYER_TARGETS` for Qwen3-MoE (fwd+bwd >= 0.50 of dense)
and Mixtral (>= 0.85) at EP=1, each with peak <= 1.0x torch-native compiled's, `EP_RANK_TARGETS` for one
EP rank (fwd+bwd >= 0.80 of dense, peak <= 1.0x torch-native compiled's on the same routes); a peak check
against the compiled row is left out, and said so, in a run without one; each printed as a PASS / MISS line
with the median and the min-max of the runs, and recorded in `targets` with its `scope`.

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
the fp8 rows; of one micro-batch also its inference forward, as "<row>, inference") and of `torch-native`,
by total time, grouped by kernel name (`kernel_group`) into GEMMs, comm core, router, elementwise and other,
with the time beyond the GEMMs (every other group's) and each group's share of it, and where the GPU ran
nothing (idle time and the longest gaps, `timeline_profile`: a step timed from idle charges the host's
launch latency before its first kernels).

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

Where the parts live: the tables (`Table`, `MODEL_TABLES`, `CPU_SMOKE`, `EP_RANK`) in bench.layer_tables;
the targets in bench.layer_targets; the torch-native layer in bench.native_layer; the weights, inputs and
step every layer runs (`optimizer_stepped`) in bench.layer_step; the measure of one layer (`Bench`,
`routed_flops`) in bench.layer_measure; --profile's grouping (`kernel_group`, `timeline_profile`) in
bench.kernel_profile. Here: the rows of ours (`variant_settings`, `FP8_SETTINGS`, `FP8_VARIANTS`), the run
of each table and its record.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.common import MODELS, measure_limits, write_record
from bench.ep_rank import RankPlan, as_ep_rank
from bench.kernel_profile import print_profile
from bench.layer_measure import Bench, free_memory, routed_flops
from bench.layer_step import step, step_inputs, with_layer_weights
from bench.layer_tables import (
    CPU_SMOKE,
    EP_RANK,
    MODEL_TABLES,
    SHAPE_ARGS,
    Table,
    make_table,
    table_rank_plan,
)
from bench.layer_targets import (
    FP8_LAYER_TARGETS,
    PER_STEP_FP8_TARGETS,
    fp8_layer_targets,
    fp8_scope,
    layer_targets,
    print_targets,
)
from bench.native_layer import compile_native, native_layer
from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world

SPREAD = "min-max of the timed runs (ms_min, ms_max), beside their median (ms)"
PEAK = ("the most memory allocated during one fwd+bwd step minus what was allocated before the layer was "
        "built (the inputs and the benchmark's weight copies excluded)")


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


def run_ours(cfg: MoEConfig, name: str, default: bool, bench: Bench, profiles: dict | None,
             ep_rank: RankPlan | None = None, micro_batches: int = 1) -> dict | None:
    """Our layer built from `cfg` with `layer_weights` (with `ep_rank`: then made that EP rank's,
    `as_ep_rank`), measured (`Bench.measure`, `micro_batches` per optimizer step), released: its
    row, None (printed) where `cfg` cannot run here, a row with `error` where it ran out of memory. With
    `profiles`, its step profile is stored there under `name` (and of one micro-batch its inference
    forward's under "`name`, inference")."""
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
            if micro_batches == 1:  # the rows whose inference forward is timed (`infer_ms`)
                profiles[f"{name}, inference"] = bench.profile_inference(layer)
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
