"""bench.layer's targets, checked on the numbers of its rows, never set by hand: the DEFAULT row's
(`LAYER_TARGETS` for the EP=1 layer, `MODEL_LAYER_TARGETS` for the models with their own, `EP_RANK_TARGETS`
for one EP rank; `layer_targets`), the fp8 rows' against our bf16 rows and torch-native
(`FP8_LAYER_TARGETS`, `PER_STEP_FP8_TARGETS`; `fp8_layer_targets`, each under its `fp8_scope`), and their
PASS / MISS lines (`print_targets`). Pure: rows in, `bench.common.check` entries out, so each bound and
what it compares is tested on the CPU."""

from __future__ import annotations

from bench.common import check, format_check, ratio, span

LAYER_TARGETS = (  # (what, op, bound): the EP=1 layer, on the DEFAULT row
    ("fwd+bwd of dense", ">=", 0.65),
    ("fwd of dense", ">=", 0.75),
    ("peak vs compiled", "<=", 0.9),
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
    per_step = row["micro_batches"]
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
