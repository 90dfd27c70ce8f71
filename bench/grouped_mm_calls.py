"""Every `torch._grouped_mm` call of one training step, ours (the DEFAULT layer) beside torch-native's, as the
step makes them (autograd's backward calls included), each pair timed alike: does a call take longer in our
layer for its form (operands, strides, rows), or for what runs around it?

    python -m bench.grouped_mm_calls                      # DeepSeek-V3 at EP=1, T=8192 (about 1-2 min)
    python -m bench.grouped_mm_calls --model qwen3-moe-30b-a3b
    python -m bench.grouped_mm_calls --repeat 30 --idle-ms 1   # more rounds, a 1 ms GPU wait before flushes

1. Profile: `--profile-steps` steps (default 5) of each layer under the profiler, every GEMM kernel in launch
   order with its device time in the step, beside the other kernels. The grouped ones (the kernel launched
   right after each `prepare_grouped_gemm_data`) are matched in order to the recorded calls: each call's
   "profile ms", the median over the steps with its min-max (one step's times move by several ms with the
   clocks the work before it leaves; `profiled_call_ms`).
2. Recording: one more step of each layer under `GroupedMMRecorder`, a `TorchDispatchMode` that sees every
   `aten._grouped_mm` call, the forward's and autograd's backward's alike, and keeps its operand tensors
   themselves (a replay reads the same memory in the same layout), its other arguments and its output's
   shape, strides and dtype. Each call gets a role, fwd / dgrad / wgrad x gate_up / down, from its operands'
   dims (`call_role`); ours' and torch-native's calls of one role are paired (`match_roles`).
3. Each pair timed in turns (`bench.common.alternated_timings`: ours, native; native, ours; ... for
   `--repeat` rounds after 2 untimed), CUDA events around the call only, twice:
   - alone: each call after an untimed L2 flush (a 256 MiB memset, `--flush-mib`) and, with `--idle-ms`,
     a GPU-side wait before it: only the call's form decides its time;
   - in step context: each call right after the grouped_mm call that precedes it in its own step (untimed,
     no flush), e.g. native's wgrad after the dgrad that read the same `grad`, when autograd orders them so.
     Only that one call is replayed before it, not the other kernels of the step between the two; a step's
     first call has none of its own (it follows the other arm's call).
   Per arm the median and min-max; per pair ours / native of each round, and their median and min-max;
   `bench.common.gpu_state` (SM and memory clocks, power, temperature) at the start and end of each of the
   two measurements, stored beside its medians.
4. Every call also replayed back to back (`--repeat` runs after 3, no flush: the form of this bench's earlier
   records), with variants: the 3-D operand copied to a fresh tensor of the same strides (placement) and in
   its other memory orientation (torch picks a CUTLASS layout per operand orientation), a 2-D x 2-D wgrad
   `dy^T @ x` as `x^T @ dy`.

Printed: a table per role (ours and native: alone ms, in-step-context ms, profile ms, the call's form:
shapes, strides, rows covered of the rows given, groups), then every call's back-to-back replay. The record
(`bench/results/grouped-mm-calls-<model>-...json`) holds one row per role (`results`: both arms' forms and
both measurements), every call's replay (`calls`), the profiles, the setup and the limits measured in the
run (the dense bf16 rate gives each replay's `of_dense`); torch-native is the baseline of every ratio.

Left out: the replays read the recorded tensors as they are after the step (a buffer of ours that the step
reused afterwards holds other numbers than when the call ran: same memory and layout, other values); the
step context is one preceding call, not the kernels between; clocks are left to the GPU (not locked), and
logged instead; one step of T tokens at EP=1, routed by a random router (no skew).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import (
    alternated_timings,
    gpu_state,
    l2_flush,
    measure_limits,
    median_spread,
    spread,
    timings,
    write_record,
)
from bench.layer_step import step, step_inputs, step_kernels, with_layer_weights
from bench.native_layer import native_layer
from moonep_moe import MoEConfig, MoonEPMoELayer
from moonep_moe.config import dtype_name, load_config
from moonep_moe.transport.threads import single_world

ARMS = ("ours", "native")
"""The two layers, in the order each round of a pair starts with (then rotated)."""
LAYER_NAMES = {"ours": "ours DEFAULT", "native": "torch-native"}

ROLES = ("fwd gate_up", "fwd down", "dgrad down", "wgrad down", "dgrad gate_up", "wgrad gate_up")
"""The grouped GEMMs of one step of either layer, in the step's data-flow order (autograd may run a
projection's wgrad before or after its dgrad)."""

WARMUP_ROUNDS = 2
"""Untimed rounds of each pair before the `--repeat` timed ones."""


class GroupedMMRecorder(TorchDispatchMode):
    """While active, appends to `calls` every `aten._grouped_mm` call (any overload), autograd's backward
    calls included (the mode goes with the step into autograd's engine): `{"func": the overload, "a", "b":
    the operand tensors themselves, "offs", "kwargs": the arguments after the operands that were given and
    not None (offs, bias, out_dtype), "out": {"shape", "stride", "dtype"}}`. The operands are kept, not
    copied, so `run_call` reads the same memory in the same layout (and keeps it alive)."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket == torch.ops.aten._grouped_mm:
            names = [arg.name for arg in func._schema.arguments]
            given = {**dict(zip(names, args, strict=False)), **kwargs}
            a, b = given.pop(names[0]), given.pop(names[1])
            self.calls.append({"func": func, "a": a, "b": b, "offs": given.get("offs"),
                               "kwargs": {name: value for name, value in given.items() if value is not None},
                               "out": {"shape": list(out.shape), "stride": list(out.stride()),
                                       "dtype": dtype_name(out.dtype)}})
        return out


def step_calls(layer, x_th: torch.Tensor, grad_th: torch.Tensor) -> list[dict]:
    """The `GroupedMMRecorder` calls of one `bench.layer_step.step` of `layer`, in call order (its gradients
    left as the step made them)."""
    recorder = GroupedMMRecorder()
    with recorder:
        step(layer, x_th, grad_th)
    return recorder.calls


def run_call(call: dict) -> torch.Tensor:
    """The recorded call made again: the same overload on the same tensors and arguments."""
    return call["func"](call["a"], call["b"], **call["kwargs"])


def call_role(call: dict, hidden: int, ffn: int) -> str:
    """A call's place in the step (one of `ROLES`), from its operands' dims alone; the layers' weights are
    gate_up `[E, 2H', H]` and down `[E, H, H']`. A 2-D x 3-D call `[M, K] x [G, K, N]` is a forward
    (gate_up: K, N = H, 2H'; down: H', H) or a dgrad (down: H, H'; gate_up: 2H', H); a 2-D x 2-D call with
    offs `[K, M] x [M, N]` (-> `[G, K, N]`) is a wgrad, of down where {K, N} = {H, H'} and of gate_up where
    {K, N} = {H, 2H'}, in either operand order. Any other form is "other". Raises where H = H' or H = 2H':
    there a forward and a dgrad have the same dims."""
    if hidden in (ffn, 2 * ffn):
        raise ValueError(f"call_role: H={hidden}, H'={ffn}: with H = H' or H = 2H' a forward and a dgrad "
                         f"have the same operand dims")
    a, b = call["a"], call["b"]
    if a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[1]:
        return {(hidden, 2 * ffn): "fwd gate_up", (ffn, hidden): "fwd down", (hidden, ffn): "dgrad down",
                (2 * ffn, hidden): "dgrad gate_up"}.get(tuple(b.shape[1:]), "other")
    if a.dim() == 2 and b.dim() == 2 and call["offs"] is not None and a.shape[1] == b.shape[0]:
        dims = frozenset((a.shape[0], b.shape[1]))
        return {frozenset((hidden, ffn)): "wgrad down",
                frozenset((hidden, 2 * ffn)): "wgrad gate_up"}.get(dims, "other")
    return "other"


def match_roles(ours: list[str], native: list[str]) -> list[tuple[str, int | None, int | None]]:
    """`(role, index of ours' call, index of native's call)`: for each of `ROLES` in order, the n-th call of
    that role in `ours` (each layer's calls' roles, in call order) beside the n-th in `native` (None where
    one layer has fewer); then the calls of any other role, each alone."""
    pairs = []
    for role in ROLES:
        mine = [i for i, r in enumerate(ours) if r == role]
        theirs = [j for j, r in enumerate(native) if r == role]
        pairs += [(role, i, j) for i, j in itertools.zip_longest(mine, theirs)]
    pairs += [(r, i, None) for i, r in enumerate(ours) if r not in ROLES]
    pairs += [(r, None, j) for j, r in enumerate(native) if r not in ROLES]
    return pairs


def round_ratios(num_s: list[float], den_s: list[float]) -> dict[str, float | list[float]]:
    """`num / den` of each round of two arms timed in turns (index r: round r): `median`, `min`, `max` and
    `rounds` (each, in order). Pairing by round cancels a drift that both arms saw alike."""
    if len(num_s) != len(den_s) or not num_s:
        raise ValueError(f"round_ratios: needs equal, non-empty lists, got {len(num_s)} and {len(den_s)}")
    ratios = [n / d for n, d in zip(num_s, den_s, strict=True)]
    return {**median_spread(ratios), "rounds": ratios}


def profiled_call_ms(steps: list[list[tuple[str, float]]], num_calls: int) -> dict[str, list[float]] | None:
    """Each grouped GEMM's device ms over several profiled steps (each `[(kernel, ms)]` in launch order):
    `ms`, `ms_min`, `ms_max` per call (the median and min-max over the steps) and `step_ms`, each step's
    grouped GEMMs summed. None where a step does not hold `num_calls` grouped GEMMs (no call matches)."""
    per_step = [grouped_kernel_ms(kernels) for kernels in steps]
    if not per_step or any(len(ms) != num_calls for ms in per_step):
        return None
    by_call = list(zip(*per_step, strict=True))
    return {"ms": [statistics.median(ms) for ms in by_call], "ms_min": [min(ms) for ms in by_call],
            "ms_max": [max(ms) for ms in by_call], "step_ms": [sum(ms) for ms in per_step]}


def grouped_kernel_ms(kernels: list[tuple[str, float]]) -> list[float]:
    """The device ms of each grouped GEMM of a step's `[(kernel, ms)]` (launch order)
    (`grouped_kernel_positions`)."""
    return [kernels[i][1] for i in grouped_kernel_positions(kernels)]


def grouped_kernel_positions(kernels: list[tuple[str, float]]) -> list[int]:
    """Where each grouped GEMM is in a step's `[(kernel, ms)]` (by start): the first CUTLASS kernel after
    each `prepare_grouped_gemm_data` (`torch._grouped_mm` on CUDA launches that one, then its CUTLASS
    kernel; a kernel of another stream, e.g. backward's combine beside the weight gradient, may start
    between the two)."""
    positions = []
    for i, (name, _) in enumerate(kernels):
        if PREPARE in name:
            at = next((j for j in range(i + 1, len(kernels))
                       if "cutlass" in kernels[j][0] and PREPARE not in kernels[j][0]), None)
            if at is not None:
                positions.append(at)
    return positions


PREPARE = "prepare_grouped_gemm_data"
"""The setup kernel `torch._grouped_mm` launches before its CUTLASS kernel."""


def describe(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": dtype_name(t.dtype),
            "align_bytes": t.data_ptr() & -t.data_ptr(), "contiguous": t.is_contiguous()}


def call_flops(call: dict) -> int:
    """2 * rows * N * K of the rows covered (`offs[-1]`): fwd/dgrad `[M, K] x [G, K, N]`, wgrad
    `[K, M] x [M, N]`; without offs every row of a batched `[G, M, K] x [G, K, N]`."""
    a, b, offs = call["a"], call["b"], call["offs"]
    if offs is None:
        return 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
    rows = int(offs[-1])
    if a.dim() == 2 and b.dim() == 3:
        return 2 * rows * b.shape[-1] * b.shape[-2]
    return 2 * rows * a.shape[0] * b.shape[-1]


def call_form(call: dict) -> dict:
    """What a recorded call is: its overload, operands, rows covered (`offs_last`) of the rows given
    (`rows`), groups, the other arguments, its output and its FLOPs."""
    a, b, offs = call["a"], call["b"], call["offs"]
    rows = a.shape[-1] if a.dim() == 2 and b.dim() == 2 else a.shape[-2]
    others = {name: describe(value) if isinstance(value, torch.Tensor) else str(value)
              for name, value in call["kwargs"].items() if name != "offs"}
    return {"op": str(call["func"]), "a": describe(a), "b": describe(b),
            "offs_last": None if offs is None else int(offs[-1]), "rows": rows,
            "groups": None if offs is None else offs.numel(), "kwargs": others, "out": call["out"],
            "flops": call_flops(call)}


def format_form(form: dict) -> str:
    def operand(d: dict) -> str:
        return f"{d['shape']}/{d['stride']}"

    rows = "" if form["offs_last"] is None else (f", rows {form['offs_last']} of {form['rows']}, "
                                                  f"G {form['groups']}")
    others = "".join(f", {name}={value}" for name, value in form["kwargs"].items())
    return (f"{operand(form['a'])} x {operand(form['b'])} -> {operand(form['out'])} {form['out']['dtype']}"
            f"{rows}{others}")


def measure(calls: dict[str, dict], before: dict, repeat: int, device: torch.device) -> dict:
    """The arms' calls (`{arm: call}`, one or two) timed in turns with `before` (`{arm: untimed callable or
    None}`): `{arm: spread}`, `ratio` (ours / native per round, `round_ratios`) where both arms ran, and the
    GPU's state before and after (`gpu_start`, `gpu_end`)."""
    arms = list(calls)
    start = gpu_state(device)
    seconds = alternated_timings([lambda call=calls[arm]: run_call(call) for arm in arms], repeat,
                                 WARMUP_ROUNDS, [before[arm] for arm in arms], device)
    out: dict = {arm: spread(secs) for arm, secs in zip(arms, seconds, strict=True)}
    if len(arms) == 2:
        out["ratio"] = round_ratios(*seconds)
    out["gpu_start"], out["gpu_end"] = start, gpu_state(device)
    return out


def replay(call: dict, repeat: int = 10) -> dict:
    """One call back to back, `repeat` runs after 3 (`timings`): its `spread`."""
    return spread(timings(lambda: run_call(call), 3, repeat))


def other_orientation(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions' memory order swapped."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def variants(call: dict) -> dict[str, dict]:
    """Changed replays of one call: `{name: call}`."""
    a, b = call["a"], call["b"]
    out = {"b_fresh_copy": {**call, "b": b.clone(memory_format=torch.preserve_format)}}
    if b.dim() == 3:
        out["b_other_orientation"] = {**call, "b": other_orientation(b)}
    elif a.dim() == 2:  # wgrad dy^T @ x as x^T @ dy
        out["swapped_operands"] = {**call, "a": b.t(), "b": a.t()}
    return out


def replay_calls(name: str, recorded: dict, repeat: int, dense: float) -> list[dict]:
    """Every call of one layer's step (`record_step`) replayed back to back (`replay`) and in its `variants`,
    printed: one record row per call, with its form, role and rate over the dense bf16 rate (`dense`)."""
    rows = []
    for i, (call, role) in enumerate(zip(recorded["calls"], recorded["roles"], strict=True)):
        row = {"layer": name, "call": i, "role": role, **call_form(call), **replay(call, repeat)}
        row["of_dense"] = row["flops"] / (row["ms"] / 1e3) / dense
        for variant, changed in variants(call).items():
            timed = replay(changed, repeat)
            row[variant] = {key: value for key, value in timed.items() if key != "ms_samples"}
            row[variant]["a"], row[variant]["b"] = describe(changed["a"]), describe(changed["b"])
            del changed
        rows.append(row)
        extra = "".join(f"  {v} {row[v]['ms']:.3f} ms" for v in ("b_fresh_copy", "b_other_orientation",
                                                                 "swapped_operands") if v in row)
        print(f"{name:13} #{i} {role:13} {format_ms(row)} {row['of_dense']:.2f} dense  {format_form(row)}"
              f"{extra}", flush=True)
    return rows


def gemm_kernels(layer, x_th: torch.Tensor, grad_th: torch.Tensor) -> list[tuple[str, float]]:
    """`[(kernel, ms)]` of one step's GEMM kernels (names with gemm, cutlass, sm90 or xmma), in order."""
    return [(name, ms) for name, ms in step_kernels(layer, x_th, grad_th)
            if any(word in name.lower() for word in ("gemm", "cutlass", "sm90", "xmma"))]


def record_step(name: str, layer, x_th: torch.Tensor, grad_th: torch.Tensor, hidden: int, ffn: int,
                profile_steps: int) -> dict:
    """One layer, warmed up: the GEMM kernels of `profile_steps` profiled steps (the first printed) and the
    grouped_mm calls of one more step (`GroupedMMRecorder`), each with its role and, where every profiled
    step's grouped kernels match the calls one for one, its profile ms (median, min-max over the steps:
    `profiled_call_ms`). `{"calls", "roles", "profile_ms", "profile_ms_min", "profile_ms_max",
    "profile_step_ms", "kernels", "note"}`."""
    for _ in range(2):
        step(layer, x_th, grad_th)
    profiled = [gemm_kernels(layer, x_th, grad_th) for _ in range(profile_steps)]
    kernels = profiled[0]
    print(f"{name}: {len(kernels)} GEMM kernels in one step, {sum(ms for _, ms in kernels):.2f} ms:")
    for kernel, ms in kernels:
        print(f"    {ms:7.3f} ms  {kernel[:120]}")
    calls = step_calls(layer, x_th, grad_th)
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)  # the calls keep what they read; the gradients are not needed
    in_step, note = profiled_call_ms(profiled, len(calls)), None
    if in_step is None:
        counts = sorted({len(grouped_kernel_ms(step_kernels)) for step_kernels in profiled})
        note = (f"the profiled steps hold {counts} grouped GEMM kernels, the recording {len(calls)} calls: "
                f"no profile ms per call")
        print(f"{name}: {note}")
        in_step = {"ms": [None] * len(calls), "ms_min": [None] * len(calls), "ms_max": [None] * len(calls),
                   "step_ms": []}
    return {"calls": calls, "roles": [call_role(call, hidden, ffn) for call in calls],
            "profile_ms": in_step["ms"], "profile_ms_min": in_step["ms_min"],
            "profile_ms_max": in_step["ms_max"], "profile_step_ms": in_step["step_ms"],
            "kernels": [{"kernel": kernel, "ms": ms} for kernel, ms in kernels], "note": note}


def format_ms(d: dict | None) -> str:
    return "-" if d is None else f"{d['ms']:7.3f} ({d['ms_min']:.3f}-{d['ms_max']:.3f})"


def format_ratio(d: dict | None) -> str:
    return "-" if d is None else f"{d['median']:7.3f} ({d['min']:.3f}-{d['max']:.3f})"


def format_gpu(start: dict, end: dict) -> str:
    return ", ".join(f"{start.get(key, '?')}->{end.get(key, '?')} {unit}" for key, unit in
                     (("clocks.sm", "MHz SM"), ("clocks.mem", "MHz mem"), ("power.draw", "W"),
                      ("temperature.gpu", "C")))


def print_role(row: dict) -> None:
    """One role's table: per arm alone and in-step-context ms, profile ms and the call's form; ours / native;
    the GPU's state over each measurement."""
    print(f"\n{row['role']}\n  {'':12} {'alone, L2 flushed ms':26} {'in step context ms':26} {'after':18} "
          f"{'profile ms (min-max)':>22}  call")
    for arm in ARMS:
        if arm not in row:
            continue
        info = row[arm]
        profile = ("-" if info["profile_ms"] is None else
                   f"{info['profile_ms']:.3f} ({info['profile_ms_min']:.3f}-{info['profile_ms_max']:.3f})")
        print(f"  {arm:12} {format_ms(row['alone'].get(arm)):26} {format_ms(row['context'].get(arm)):26} "
              f"{info['after'] or '-':18} {profile:>22}  #{info['call']} {format_form(info['form'])}")
    if all(arm in row for arm in ARMS):
        profiles = [row[arm]["profile_ms"] for arm in ARMS]
        profile = "-" if None in profiles else f"{profiles[0] / profiles[1]:.3f}"
        timed = " ".join(f"{format_ratio(row[what].get('ratio')):26}" for what in ("alone", "context"))
        print(f"  {'ours/native':12} {timed} {'':18} {profile:>22}  (timed: median of rounds; profile: of "
              f"the medians)")
    for what in ("alone", "context"):
        print(f"  GPU over {what}: {format_gpu(row[what]['gpu_start'], row[what]['gpu_end'])}")


def make_layer(arm: str, t: int, h: int, f: int, e: int, k: int):
    if arm == "native":
        return native_layer(h, f, e, k)
    return with_layer_weights(MoonEPMoELayer(MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e,
                                                       top_k=k, max_tokens_per_rank=t), single_world("cuda")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--repeat", type=int, default=10,
                        help="timed rounds of each pair (and back-to-back runs of each call)")
    parser.add_argument("--flush-mib", type=int, default=256, help="the L2 flush's memset (0: none)")
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="a GPU-side wait before each flush (torch.cuda._sleep), default none")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="profiled steps per layer (each call's profile ms: their median, min-max)")
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results)")
    args = parser.parse_args()
    if args.repeat < 3:
        parser.error(f"--repeat must be >= 3, got {args.repeat}")
    if args.profile_steps < 1:
        parser.error(f"--profile-steps must be >= 1, got {args.profile_steps}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.grouped_mm_calls times CUDA kernels: it needs a GPU")
    device = torch.device("cuda")
    limits = measure_limits()
    dense = limits["dense_bf16_flops_per_s"]
    base = load_config(args.model)
    t, h, f, e, k = (base.max_tokens_per_rank, base.hidden_size, base.ffn_hidden_size, base.num_experts,
                     base.top_k)
    x_th, grad_th = step_inputs(t, h)
    layers, steps = {}, {}
    for arm in ("native", "ours"):  # ours' weights live in its Buffer: it is destroyed after the replays
        layers[arm] = make_layer(arm, t, h, f, e, k)
        steps[arm] = record_step(LAYER_NAMES[arm], layers[arm], x_th, grad_th, h, f, args.profile_steps)
        print(f"{LAYER_NAMES[arm]}: {len(steps[arm]['calls'])} grouped_mm calls recorded: "
              f"{', '.join(steps[arm]['roles'])}", flush=True)
    rows, calls_out = [], []
    with torch.no_grad():
        flush = l2_flush(args.flush_mib, args.idle_ms)
        for role, *indices in match_roles(steps["ours"]["roles"], steps["native"]["roles"]):
            index = {arm: i for arm, i in zip(ARMS, indices, strict=True) if i is not None}
            calls = {arm: steps[arm]["calls"][i] for arm, i in index.items()}
            before = {arm: (lambda prev=steps[arm]["calls"][i - 1]: run_call(prev)) if i > 0 else None
                      for arm, i in index.items()}
            row = {"role": role}
            for arm, i in index.items():
                row[arm] = {"call": i, "after": f"#{i - 1} {steps[arm]['roles'][i - 1]}" if i > 0 else None,
                            **{key: steps[arm][key][i] for key in ("profile_ms", "profile_ms_min",
                                                                      "profile_ms_max")},
                            "form": call_form(calls[arm])}
            row["alone"] = measure(calls, {arm: flush for arm in calls}, args.repeat, device)
            row["context"] = measure(calls, before, args.repeat, device)
            rows.append(row)
            print_role(row)
        print("\nEach call back to back (no flush), with variants:")
        for arm in ARMS:
            calls_out += replay_calls(LAYER_NAMES[arm], steps[arm], args.repeat, dense)
    for arm in ARMS:
        alone = sum(row["alone"][arm]["ms"] for row in rows if arm in row)
        back = sum(out["ms"] for out in calls_out if out["layer"] == LAYER_NAMES[arm])
        sums = steps[arm]["profile_step_ms"]
        in_step = "-" if not sums else (f"{statistics.median(sums):.2f} ({min(sums):.2f}-{max(sums):.2f}) ms "
                                        f"in {len(sums)} profiled steps")
        print(f"{LAYER_NAMES[arm]}: the grouped_mm calls of one step add up to {alone:.2f} ms alone (L2 "
              f"flushed), {back:.2f} ms back to back, {in_step}")
    if hasattr(layers["ours"], "destroy"):
        layers["ours"].destroy()
    path = write_record(
        f"grouped-mm-calls-{args.model}", limits, rows, args.out, calls=calls_out,
        baseline="torch-native (bench.native_layer.TorchNativeMoE, the same weights and tokens): every ratio "
                 "is ours / native",
        profiles={LAYER_NAMES[arm]: steps[arm]["kernels"] for arm in ARMS},
        notes={LAYER_NAMES[arm]: steps[arm]["note"] for arm in ARMS if steps[arm]["note"]},
        setup={"model": args.model, "tokens": t, "hidden": h, "ffn": f, "experts": e, "top_k": k,
               "repeat": args.repeat, "warmup_rounds": WARMUP_ROUNDS, "flush_mib": args.flush_mib,
               "idle_ms": args.idle_ms, "profile_steps": args.profile_steps,
               "order": "rounds rotated: ours first in even rounds, native in odd"})
    print(path)


if __name__ == "__main__":
    main()
