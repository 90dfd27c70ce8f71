"""Why torch-native's CUTLASS wgrad runs faster inside its own step than ours with the same kernel, measured:
the wgrad `torch._grouped_mm` call of one training step of each layer, captured with the operands the real
code passes, then timed DeepGEMM-style: arms alternated round by round, what runs before each call set on
purpose, the GPU's clocks, power and temperature logged beside every median.

    python -m bench.wgrad_hygiene                   # DeepSeek-V3 at EP=1 (an H200: 1-2 min, estimated)
    python -m bench.wgrad_hygiene --ep-rank-of 8    # one rank of an EP=8 group, as bench.layer's
    python -m bench.wgrad_hygiene --smoke           # CPU, tiny shapes, every code path, no timing

The layers are bench.layer's: torch-native (`native_layer`) and ours with the `torch` backend in "param" mode
(`OURS`: the home experts' gradients are `torch._grouped_mm`'s own bf16 output, as torch-native's are), with
the same weights (`with_layer_weights`), tokens and output gradient (`step_inputs`); with --ep-rank-of, ours
made one EP rank (`as_ep_rank`, its group's plan at --maxvio) and torch-native over its epn + B experts.

1. Capture: one step of each layer under `bench.grouped_mm_calls.GroupedMMRecorder` (`step_calls`): every
   `aten._grouped_mm` call with its operand tensors themselves (the same memory, strides, storage offset),
   its offs and its output's form. Each layer's first call of each wgrad role (`call_role`: "wgrad down",
   "wgrad gate_up") is timed; ours' is `TorchGroupedGemm.wgrad`'s call over the home experts (at an EP rank
   the slots' Triton wgrad is no grouped_mm call and is not timed here).
2. In its step: `--repeat` profiled steps of each layer (after one untimed), alternated (ours, native;
   native, ours; ...), the wgrad kernel's device time in each (the kernel after the call's
   `prepare_grouped_gemm_data`, matched to the recorded calls in order) and the kernels launched just before
   it: the times to explain, as `bench.layer --profile` reports them.
3. Replayed: the same call on four operand sets (`ARMS`), alternated round by round
   (`bench.common.alternated_timings`: 2 untimed rounds, then `--repeat`; CUDA events around the call
   only), under each of `CONDITIONS`, what runs untimed before each call:
   - `back_to_back`: nothing; the call before (the other arm's, or its own of the round before) just ended,
     its data in L2, the GPU hot;
   - `l2_flushed`: a --flush-mib MiB memset (`bench.common.l2_flush`, several times the L2): the operands
     read from HBM;
   - `idle_then_flushed`: a host sleep of --idle-ms (the GPU idle, its clocks and power recovering), then
     the same memset: against `l2_flushed` only the power history differs;
   - `after_preceding`: the grouped_mm call before it in its own step (that call's data in L2);
   - `after_step_gemms`: every grouped_mm call before it in its own step, in order (most of a step's GEMM
     work: the clocks and power a step leaves, the last call's data in L2).
   The arms: `ours` (the recorded call as it is), `ours_fresh` (ours' operands copied to new memory of the
   same shapes and strides: only the placement differs, `fresh_copy`), `ours_trimmed` (ours' operands cut at
   offs[-1], the rows past the last group dropped, copied in torch-native's memory order, offs copied:
   `trimmed`), `native` (torch-native's recorded call). Per condition: each arm's median and min-max
   (`spread`), every other arm over native and each arm over the next round by round (`round_ratios`), and
   the GPU's SM and memory clocks, power and temperature (`bench.common.gpu_state`) at the start and end of
   the condition's rounds.

The record's `conclusions`, per wgrad role, each a `(median, min, max)` computed from the rows above:
- `in_step`: ours / native in their steps, round by round: the difference to explain;
- `operands`, per condition: ours / native and its steps, round by round: `ours/ours_fresh` (placement:
  storage offset, alignment, which memory; hypothesis c), `ours_fresh/ours_trimmed` (the rows past the last
  group, e, and the memory order), `ours_trimmed/native` (the rest: group sizes and count, values);
- `conditions`, per arm: each condition's median over `l2_flushed`'s (`bench.common.ratio`): `back_to_back`
  and `after_preceding` tell the L2 state (a), `idle_then_flushed` the clocks and power (b),
  `after_step_gemms` both, and for ours and native `in_step`: what the step around the call adds.
What is written (d) is no arm: in param mode both calls write bf16 only.

Left out: clocks are left to the GPU (not locked), and logged; the replays read the recorded tensors as
the steps left them (ours' rows are reused later in a step: the down projection's dy then holds other
numbers of the same memory and layout); the in-step times are taken under the profiler, as bench.layer
--profile's; the slots' Triton wgrad and main_grad's fp32 add.

Writes `bench/results/wgrad-hygiene-<model>[-ep<R>-rank]-<device>-<date>-<commit>.json`: `setup`, `limits`,
`in_step` (per role: each layer's `spread`, `before_kernels`, `ratio`, `gpu_start`, `gpu_end`), `results`
(per role: each arm's call form and, per condition, `measure`'s spreads, ratios and GPU state; a condition
that cannot run has `skipped` with the reason) and `conclusions`. --smoke writes nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from bench.common import (
    MODELS,
    cuda_kernels,
    gpu_state,
    l2_flush,
    measure_limits,
    ratio,
    span,
    spread,
    write_record,
)
from bench.grouped_mm_calls import (
    call_form,
    call_role,
    format_form,
    format_gpu,
    format_ms,
    format_ratio,
    grouped_kernel_positions,
    measure,
    round_ratios,
    run_call,
    step_calls,
)
from bench.layer_step import step, step_inputs, with_layer_weights
from bench.layer_tables import make_table, table_rank_plan
from bench.native_layer import native_layer
from moonep_moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world

OURS = {"grouped_gemm": "torch", "expert_grad_dtype": "param"}
"""Our layer's settings beside the table's shapes: the torch backend (its wgrad is `torch._grouped_mm`, the
CUTLASS kernel torch-native's autograd runs) making the home gradients in bf16, as torch-native's."""

WGRAD_ROLES = ("wgrad down", "wgrad gate_up")
"""The calls timed (`bench.grouped_mm_calls.call_role`), in the order of the step's data flow."""

ARMS = ("ours", "ours_fresh", "ours_trimmed", "native")
"""The operand sets of one role's call, from ours to torch-native's; each round runs them all (rotated)."""

CONDITIONS = ("back_to_back", "l2_flushed", "idle_then_flushed", "after_preceding", "after_step_gemms")
"""What runs untimed before each call (the module docstring says what each is for)."""

REFERENCE = "l2_flushed"
"""The condition every other is divided by in `conclusions`: the call alone, its operands in HBM."""

SMOKE = {"tokens": 64, "hidden": 64, "ffn": 48}
"""--smoke: the model's E and K on these T, H and H' (H differs from H' and 2H', so `call_role` tells the
projections apart; rows of 16-byte multiples, as `torch._grouped_mm` asks)."""

PRECEDING = 3
"""Kernels named before each wgrad kernel of a profiled step (`in_step`)."""


def build_layers(table, device: torch.device) -> dict[str, nn.Module]:
    """`{"ours": ..., "native": ...}`: both layers of `table` (a `bench.layer_tables.Table`) on `device` with
    the benchmark's weights; for an EP rank ours made that rank (`as_ep_rank`, the table's plan)."""
    shapes = table.shapes
    native = native_layer(table.hidden, table.ffn, shapes["num_experts"], table.top_k, device)
    ours = MoonEPMoELayer(table.config(OURS), single_world(device))
    return {"ours": with_layer_weights(ours, table_rank_plan(table, device)), "native": native}


def capture(layers: dict[str, nn.Module], x_th: torch.Tensor, grad_th: torch.Tensor, hidden: int,
            ffn: int) -> dict[str, dict]:
    """Per layer, the grouped_mm calls of one step (`step_calls`, after one untimed step) and their roles:
    `{layer: {"calls", "roles"}}`; the layers' gradients left as the step made them."""
    captured = {}
    for name, layer in layers.items():
        step(layer, x_th, grad_th)
        calls = step_calls(layer, x_th, grad_th)
        captured[name] = {"calls": calls, "roles": [call_role(call, hidden, ffn) for call in calls]}
    return captured


def wgrad_index(captured: dict, role: str) -> int:
    """Where a layer's first call of `role` is among its step's calls (`capture`'s entry of one layer)."""
    if role not in captured["roles"]:
        raise ValueError(f"no {role} call among the step's grouped_mm calls: {captured['roles']}")
    return captured["roles"].index(role)


def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in new memory of the same shape and strides."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def laid_out_as(t_2d: torch.Tensor, like_2d: torch.Tensor) -> torch.Tensor:
    """`t`'s values in new dense memory, its two dims in `like`'s memory order (rows or columns inner)."""
    transposed = like_2d.stride(0) < like_2d.stride(1)
    if transposed:
        return t_2d.t().clone(memory_format=torch.contiguous_format).t()
    return t_2d.clone(memory_format=torch.contiguous_format)


def with_operands(call: dict, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> dict:
    """The recorded `call` on other operands and offs."""
    return {**call, "a": a, "b": b, "offs": offs, "kwargs": {**call["kwargs"], "offs": offs}}


def trimmed(call: dict, native: dict) -> dict:
    """Ours' wgrad `call` (`a [cols, rows]`, `b [rows, inner]`) cut at `offs[-1]`, the rows past the last
    group dropped, each operand copied to new memory in the memory order of `native`'s (torch-native's call of
    the same role), offs copied. Raises ValueError where the two calls' operands are not of one form."""
    a, b, offs = call["a"], call["b"], call["offs"]
    if native["a"].shape[0] != a.shape[0] or native["b"].shape[1] != b.shape[1]:
        raise ValueError(f"trimmed: ours' wgrad {list(a.shape)} x {list(b.shape)} and torch-native's "
                         f"{list(native['a'].shape)} x {list(native['b'].shape)} differ in operand order")
    end = int(offs[-1])
    return with_operands(call, laid_out_as(a[:, :end], native["a"]), laid_out_as(b[:end], native["b"]),
                         offs.clone())


def layer_of(arm: str) -> str:
    """The layer whose step an arm's call comes from: "native" for native, "ours" for the ours arms."""
    return "native" if arm == "native" else "ours"


def role_arms(captured: dict, role: str) -> tuple[dict[str, dict], dict[str, int]]:
    """One role's `ARMS` (`{arm: call}`) and where each arm's call sits in its layer's step (`layer_of`)."""
    at = {arm: wgrad_index(captured[layer_of(arm)], role) for arm in ARMS}
    ours, native = captured["ours"]["calls"][at["ours"]], captured["native"]["calls"][at["native"]]
    arms = {"ours": ours, "ours_fresh": with_operands(ours, fresh_copy(ours["a"]), fresh_copy(ours["b"]),
                                                      ours["offs"]),
            "ours_trimmed": trimmed(ours, native), "native": native}
    return arms, at


def replay_all(calls: list[dict]) -> None:
    for call in calls:
        run_call(call)


def befores(prefixes: dict[str, list[dict]], flush_mib: int, idle_ms: float,
            device: torch.device) -> dict[str, dict[str, Callable[[], object] | None] | str]:
    """Per condition (`CONDITIONS`), what runs before each arm's call (`{arm: callable or None}`; `prefixes`:
    each arm's calls before it in its step, in order), or why the condition cannot run here (off CUDA there
    is no L2 to flush)."""
    if device.type == "cuda":
        flush = l2_flush(flush_mib)

        def idle_then_flush() -> None:
            time.sleep(idle_ms / 1e3)
            flush()

        flushed: dict | str = {arm: flush for arm in prefixes}
        idle: dict | str = {arm: idle_then_flush for arm in prefixes}
    else:
        flushed = idle = f"needs a GPU: no L2 to flush on {device.type}"
    return {"back_to_back": dict.fromkeys(prefixes),
            "l2_flushed": flushed,
            "idle_then_flushed": idle,
            "after_preceding": {arm: (lambda p=prefix[-1]: run_call(p)) if prefix else None
                                for arm, prefix in prefixes.items()},
            "after_step_gemms": {arm: (lambda p=prefix: replay_all(p)) for arm, prefix in prefixes.items()}}


def steps_ratios(times: dict[str, list[float]]) -> dict[str, dict]:
    """Round by round (`round_ratios` of each arm's times, index r: round r): every arm over native, then each
    arm over the next in `ARMS` (ours to native in steps)."""
    pairs = [(arm, "native") for arm in ARMS[:-1]] + list(zip(ARMS[:-2], ARMS[1:-1], strict=True))
    return {f"{num}/{den}": round_ratios(times[num], times[den]) for num, den in pairs}


def measure_role(arms: dict[str, dict], before: dict, repeat: int, device: torch.device) -> dict:
    """One role's arms under every condition: `{condition: measure's {arm: spread}, gpu_start, gpu_end and
    "ratios" (`steps_ratios`)}` or `{condition: {"skipped": why}}`."""
    out = {}
    for condition, setup in before.items():
        if isinstance(setup, str):
            out[condition] = {"skipped": setup}
            continue
        measured = measure(arms, setup, repeat, device)
        times = {arm: measured[arm]["ms_samples"] for arm in arms}
        out[condition] = {**measured, "ratios": steps_ratios(times)}
    return out


def wgrad_kernel(kernels: list[tuple[str, float]], index: int, calls: int) -> tuple[float, list[str]] | None:
    """The `index`-th grouped GEMM kernel of a profiled step (`[(kernel, ms)]`, launch order): its ms and the
    names of the `PRECEDING` kernels before its `prepare_grouped_gemm_data`; None where the step's grouped
    GEMMs are not `calls` (the recording's count), so none can be matched."""
    positions = grouped_kernel_positions(kernels)
    if len(positions) != calls:
        return None
    at = positions[index]
    return kernels[at][1], [name[:100] for name, _ in kernels[max(0, at - 1 - PRECEDING):at - 1]]


def in_step(layers: dict[str, nn.Module], captured: dict, x_th: torch.Tensor, grad_th: torch.Tensor,
            repeat: int, device: torch.device) -> dict:
    """Each wgrad role's kernel time inside its own step: one untimed round, then `repeat` rounds of one
    profiled step per layer (ours, native; native, ours; ...). Per role `{layer: spread and before_kernels},
    "ratio": ours / native round by round, "gpu_start", "gpu_end"}`; `{"skipped": why}` off CUDA or where a
    step's kernels do not match its recorded calls."""
    if device.type != "cuda":
        return {"skipped": f"needs a GPU: no CUDA kernels to profile on {device.type}"}
    names = ("ours", "native")
    seconds = {(role, name): [] for role in WGRAD_ROLES for name in names}
    before_kernels = {}
    start = gpu_state(device)
    for r in range(1 + repeat):
        for name in names[r % 2:] + names[:r % 2]:
            kernels = cuda_kernels(lambda layer=layers[name]: step(layer, x_th, grad_th))
            for role in WGRAD_ROLES:
                found = wgrad_kernel(kernels, wgrad_index(captured[name], role), len(captured[name]["calls"]))
                if found is None:
                    return {"skipped": f"a profiled step of {name} holds other grouped GEMMs than its "
                                       f"{len(captured[name]['calls'])} recorded calls"}
                if r > 0:
                    seconds[role, name].append(found[0] / 1e3)
                before_kernels[role, name] = found[1]
    end = gpu_state(device)
    return {role: {**{name: {**spread(seconds[role, name]), "before_kernels": before_kernels[role, name]}
                      for name in names},
                   "ratio": round_ratios(seconds[role, "ours"], seconds[role, "native"]),
                   "gpu_start": start, "gpu_end": end} for role in WGRAD_ROLES}


def ratio_span(ratios: dict) -> tuple[float, float, float]:
    """A `round_ratios` as a `(median, min, max)`."""
    return ratios["median"], ratios["min"], ratios["max"]


def conclusions(rows: list[dict], steps: dict) -> dict:
    """Per role (module docstring): `in_step` ours / native, `operands` (per condition, `steps_ratios` as
    spans) and `conditions` (per arm, each condition's spread over `REFERENCE`'s, and `in_step`'s for ours and
    native); what was skipped is left out."""
    out = {}
    for row in rows:
        measured = {c: m for c, m in row["conditions"].items() if "skipped" not in m}
        stepped = steps.get(row["role"])
        role: dict = {"in_step": None if stepped is None else ratio_span(stepped["ratio"]),
                      "operands": {c: {key: ratio_span(r) for key, r in m["ratios"].items()}
                                   for c, m in measured.items()},
                      "conditions": {}}
        if REFERENCE in measured:
            for arm in ARMS:
                ref = span(measured[REFERENCE][arm])
                over = {f"{c}/{REFERENCE}": ratio(span(m[arm]), ref) for c, m in measured.items()
                        if c != REFERENCE}
                if stepped is not None and arm in stepped:
                    over[f"in_step/{REFERENCE}"] = ratio(span(stepped[arm]), ref)
                role["conditions"][arm] = over
        out[row["role"]] = role
    return out


def print_role(row: dict, stepped: dict | None) -> None:
    """One role: each arm's form and median (min-max) under each condition, the ratios over native, the GPU's
    state over each condition; with `stepped`, the in-step times."""
    print(f"\n{row['role']}")
    for arm in ARMS:
        print(f"  {arm:13} {format_form(row['arms'][arm])}")
    if stepped is not None:
        for name in ("ours", "native"):
            print(f"  in its step, {name:7} {format_ms(stepped[name])} ms after "
                  f"{' | '.join(k[:40] for k in stepped[name]['before_kernels'])}")
        print(f"  in its step, ours/native {format_ratio(stepped['ratio'])}; GPU "
              f"{format_gpu(stepped['gpu_start'], stepped['gpu_end'])}")
    for condition, measured in row["conditions"].items():
        if "skipped" in measured:
            print(f"  {condition:18} skipped: {measured['skipped']}")
            continue
        times = "  ".join(f"{arm} {format_ms(measured[arm])}" for arm in ARMS)
        ratios = "  ".join(f"{key} {format_ratio(r)}" for key, r in measured["ratios"].items())
        print(f"  {condition:18} ms: {times}\n  {'':18} {ratios}\n  {'':18} GPU "
              f"{format_gpu(measured['gpu_start'], measured['gpu_end'])}")


def run(table, args: argparse.Namespace) -> dict:
    """The whole measurement of `table` (a `bench.layer_tables.Table`; `--smoke`: on the CPU, each condition
    one timed round, no times printed): `{"name", "setup", "limits", "in_step", "results", "conclusions"}`,
    the record's name and fields for `write_record`."""
    device = torch.device("cpu" if args.smoke else "cuda")
    limits = {} if args.smoke else measure_limits()
    x_th, grad_th = step_inputs(table.tokens, table.hidden, device)
    layers = build_layers(table, device)
    try:
        captured = capture(layers, x_th, grad_th, table.hidden, table.ffn)
        steps = in_step(layers, captured, x_th, grad_th, args.repeat, device)
        for layer in layers.values():
            layer.zero_grad(set_to_none=True)  # the calls keep what they read; the gradients are not needed
        rows = []
        with torch.no_grad():
            for role in WGRAD_ROLES:
                arms, at = role_arms(captured, role)
                steps_before = {arm: captured[layer_of(arm)]["calls"][:at[arm]] for arm in ARMS}
                rows.append({"role": role, "arms": {arm: call_form(call) for arm, call in arms.items()},
                             "after": {arm: captured[layer_of(arm)]["roles"][:at[arm]] for arm in ARMS},
                             "conditions": measure_role(arms, befores(steps_before, args.flush_mib,
                                                                      args.idle_ms, device),
                                                        args.repeat, device)})
    finally:
        layers["ours"].destroy()
    stepped = {} if "skipped" in steps else steps
    if args.smoke:
        for row in rows:
            print(f"smoke {table.label}, {row['role']}: " + "; ".join(
                f"{arm} {format_form(form)}" for arm, form in row["arms"].items()))
        ran = [c for c in CONDITIONS if "skipped" not in rows[0]["conditions"][c]]
        print(f"smoke: every arm ran under {ran}; in step: {steps.get('skipped', 'ran')}; no timing on CPU")
    else:
        for row in rows:
            print_role(row, stepped.get(row["role"]))
    setup = {"model": table.model, "label": table.label, "tokens": table.tokens, "hidden": table.hidden,
             "ffn": table.ffn, "experts": table.experts, "top_k": table.top_k, "ep_rank_of": table.ep_rank_of,
             "maxvio": table.maxvio, "ours": OURS, "repeat": args.repeat, "flush_mib": args.flush_mib,
             "idle_ms": args.idle_ms, "arms": list(ARMS), "conditions": list(CONDITIONS),
             "order": "rounds rotated: round r starts with arm r mod 4 (alternated_timings)"}
    return {"name": "wgrad-hygiene" + table.record_name.removeprefix("layer"), "setup": setup,
            "limits": limits, "in_step": steps, "results": rows, "conclusions": conclusions(rows, stepped)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3", choices=MODELS)
    parser.add_argument("--ep-rank-of", type=int, default=None, metavar="R",
                        help="ONE rank of an EP group of R ranks (bench.layer's --ep-rank-of)")
    parser.add_argument("--maxvio", type=float, default=0.0, help="with --ep-rank-of: the group's skew")
    parser.add_argument("--repeat", type=int, default=10,
                        help="timed rounds per condition and profiled steps per layer (>= 5; --smoke: 1)")
    parser.add_argument("--flush-mib", type=int, default=256, help="the L2 flush's memset, MiB")
    parser.add_argument("--idle-ms", type=float, default=20.0,
                        help="idle_then_flushed's host sleep before the flush, ms")
    parser.add_argument("--smoke", action="store_true",
                        help=f"CPU, {SMOKE} with the model's E and K: every code path, no timing, no record")
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results)")
    args = parser.parse_args()
    if args.smoke:
        args.repeat = 1
    elif args.repeat < 5:
        parser.error(f"--repeat must be >= 5 (a median with a spread), got {args.repeat}")
    elif not torch.cuda.is_available():
        raise SystemExit("bench.wgrad_hygiene times CUDA kernels: it needs a GPU (--smoke runs on the CPU)")
    if args.maxvio and args.ep_rank_of is None:
        parser.error("--maxvio: it skews the group of --ep-rank-of's rank; give --ep-rank-of")
    try:
        table = make_table(args.model, args.ep_rank_of, SMOKE if args.smoke else {}, args.maxvio)
    except ValueError as error:
        parser.error(str(error))
    record = run(table, args)
    if not args.smoke:
        name = record.pop("name")
        limits, rows = record.pop("limits"), record.pop("results")
        print(f"record: {write_record(name, limits, rows, args.out, **record)}")


if __name__ == "__main__":
    main()
