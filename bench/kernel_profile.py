"""One step's GPU kernels, grouped: what `--profile` prints and records for bench.layer's rows and
bench.ep_group's ranks. Each kernel, copy or fill is named into a group (`kernel_group`: GEMMs, comm core,
router, elementwise, other), the launches of one step totalled per kernel and per group with the time
beyond the GEMMs (`profile_summary`), where the GPU idled beside them (`timeline_profile`, of a
`bench.common.cuda_timeline`), and printed (`print_profile`). Pure functions of the launches: nothing here
runs a kernel, so the grouping is tested on the CPU, and bench.step_bytes groups its bytes by the same
`kernel_group`."""

from __future__ import annotations

import re

from bench.common import idle_gaps

KERNEL_GROUPS = ("GEMMs", "comm core", "router", "elementwise", "other")
"""The groups of a step profile, in the order printed."""

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
