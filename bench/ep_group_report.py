"""bench.ep_group's report, from the tables its run records: the targets on the group's step (`TARGET_BOUNDS`,
checked by `group_targets` with the link as the NVLink model or as local copies, each printed by
`target_line`), the docs' table (`markdown`) and the plot of the slowest rank against maxvio (`plot`), with
the policies in their columns' order (`POLICIES`) and what the run leaves out (`LEFT_OUT`: in the record's
setup and under the table). Pure functions of the tables (dicts, as in the JSON record): nothing here runs
a step, so each target and the table are tested on the CPU, and a record's plot is drawn again without a
GPU."""

from __future__ import annotations

from pathlib import Path

from bench.common import check, format_check, ratio, span
from bench.link_model import NVLINK_BYTES_PER_S

POLICIES = ("exact", "cost_aware", "off")
LEFT_OUT = ("the peers' SMs (only the timed rank's kernels run), contention on real links and the NVSwitch, "
            "NVLink latency and the peers' skew in reaching each barrier (a group's step may be longer than "
            "its slowest rank's: each exchange call waits for the slowest rank of that call), the histogram "
            "all-gather's latency, the router and shared experts (the same for every policy); the link "
            "model assumes a window's two directions move at once, each at the spec rate; a prefetch's "
            "kernel holds SMs for its local copies' time, where over NVLink it would hold them for the "
            "link's (its link time beyond the home GEMM it runs beside is charged, not the SMs it would "
            "keep from that GEMM)")
SHARED_LEFT_OUT = "the router and shared experts"
"""The part of `LEFT_OUT` that `--shared-experts` runs (all but the router)."""
REDUCE_BEHIND_LEFT_OUT = (
    "with overlap_reduce_grad, each of our steps ends where the layer's backward hands the caller's stream "
    "back, reduce_grad still running behind it on the comm stream: the layers before it in a model (not run "
    "here) are assumed to cover the reduction's rest (each rank's `reduce_behind`, local) and its link "
    "time, and its kernels' SMs beside them are not charged")
TARGET_BOUNDS = {"exact skew": 1.05, "exact vs native at skew": 0.65, "exact vs native balanced": 1.00,
                 "cost_aware vs best": 1.00, "beyond expert block": 0.05}


def group_span(summary: dict, link: str) -> tuple[float, float, float]:
    """The group's step (its slowest rank) of one policy and maxvio on `link`: `(median, min, max)` ms."""
    return span(summary["slowest"][link])


def native_span(row: dict, link: str) -> tuple[float, float, float]:
    """torch-native's step (the faster of eager and compiled) at one maxvio on `link`."""
    return span(row[row["baseline"]][link])


def group_targets(table: dict, link: str) -> list[dict]:
    """The targets of one group (bench.ep_group's docstring) on its `link` timings ("nvlink" or "local"),
    each naming the group, its maxvio where one applies, and `link`; a target whose rows were not run (a
    policy, or maxvio 0 or 20) is left out."""
    fields = dict(model=table["model"], ranks=table["ranks"], link=link)
    targets, ours, native = table["maxvio_targets"], table["policies"], table.get("native")
    balanced, skewed = (targets.index(v) if v in targets else None for v in (0.0, 20.0))
    exact = ours.get("exact")
    out = []
    if exact is not None and balanced is not None and skewed is not None:
        out.append(check("exact: maxvio 20 over maxvio 0",
                         ratio(group_span(exact[skewed], link), group_span(exact[balanced], link)),
                         "<=", TARGET_BOUNDS["exact skew"], **fields))
    if exact is not None and native:
        for i, key in ((skewed, "exact vs native at skew"), (balanced, "exact vs native balanced")):
            if i is not None:
                out.append(check("exact over torch-native plain EP",
                                 ratio(group_span(exact[i], link), native_span(native[i], link)),
                                 "<=", TARGET_BOUNDS[key], maxvio=targets[i], **fields))
    if all(p in ours for p in POLICIES):
        for i, maxvio in enumerate(targets):
            better = min(("exact", "off"), key=lambda p: group_span(ours[p][i], link)[0])
            value = ratio(group_span(ours["cost_aware"][i], link), group_span(ours[better][i], link))
            same = table.get("cost_aware_plan_as", [None] * len(targets))[i]
            out.append(check("cost_aware over the better of exact and off", value, "<=",
                             TARGET_BOUNDS["cost_aware vs best"], maxvio=maxvio, better=better,
                             same_plan_as=same, **fields))
    if exact is not None:
        key = "beyond_share" if link == "nvlink" else "beyond_share_local"
        for i, maxvio in enumerate(targets):
            worst = max(exact[i]["ranks"], key=lambda r: (r[key]["median"], -r["rank"]))
            share = worst[key]
            out.append(check("exact: time beyond the expert block over the step, worst rank",
                             (share["median"], share["min"], share["max"]), "<=",
                             TARGET_BOUNDS["beyond expert block"], maxvio=maxvio, rank=worst["rank"],
                             in_waited_exchanges=worst[key.replace("beyond", "exchange")]["median"],
                             **fields))
    return out


def target_line(target: dict) -> str:
    """`format_check` and where: the group and its maxvio."""
    where = f"{target['model']} R={target['ranks']}"
    if "maxvio" in target:
        where += f", maxvio {target['maxvio']:g}"
    return f"{format_check(target)} [{where}]"


MD_HEADER = ("| group | maxvio (reached) | exact | cost_aware | off | torch-native | exact / torch-native |",
             "|---|---|---|---|---|---|---|")


def markdown(tables: list[dict], record_name: str, device: str, left_out: str = LEFT_OUT,
             shared: bool = False) -> str:
    """The docs' section: per group and maxvio the slowest rank's step (NVLink model, ms median) under each
    policy and torch-native's, and exact over torch-native; `left_out`: the record's."""
    experts = "routed and shared experts" if shared else "routed experts"
    intro = (f"`python -m bench.ep_group` on {device} (`bench/results/{record_name}`): one training step of "
             f"the {experts} (forward + backward, the router's choice given), every rank of the group "
             "timed alone, one after another, with its peers' traffic replayed (`bench/rank_replay.py`), the "
             f"link modelled at {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s a direction (NVLink's spec figure). The "
             "group's step is its slowest rank's, in ms (median). torch-native: plain EP with bench.layer's "
             "`torch._grouped_mm` experts on the `off` plan's hottest rank, the faster of eager and "
             "compiled.")
    lines = ["### An EP group's step under routing skew, rank by rank on one GPU", "", intro, "", *MD_HEADER]
    for table in tables:
        native, exact = table.get("native"), table["policies"].get("exact")
        for i, target in enumerate(table["maxvio_targets"]):
            runs = [table["policies"].get(p) for p in POLICIES]
            cells = [f"{group_span(r[i], 'nvlink')[0]:.2f}" if r else "-" for r in runs]
            theirs = native_span(native[i], "nvlink")[0] if native else None
            cells.append(f"{theirs:.2f}" if theirs else "-")
            cells.append(f"{group_span(exact[i], 'nvlink')[0] / theirs:.2f}" if exact and theirs else "-")
            reached = table["routing"][i]["maxvio"]
            lines.append(f"| {table['model']} R={table['ranks']} | {target:g} ({reached:.2f}) | "
                         f"{' | '.join(cells)} |")
    lines += ["", f"Left out: {left_out}.", ""]
    return "\n".join(lines)


COLORS = {"exact": "tab:blue", "cost_aware": "tab:green", "off": "tab:red", "torch-native": "tab:gray"}


def plot(tables: list[dict], path: Path) -> None:
    """The slowest rank's step against the reached maxvio (NVLink model solid, link as local copies dotted)
    per policy and torch-native, one panel per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(5.2 * len(tables), 4.2), squeeze=False)
    for ax, table in zip(axes[0], tables, strict=True):
        skews = [r["maxvio"] for r in table["routing"]]
        series = {p: [(group_span(s, "nvlink")[0], group_span(s, "local")[0]) for s in runs]
                  for p, runs in table["policies"].items()}
        if table.get("native"):
            series["torch-native"] = [(native_span(r, "nvlink")[0], native_span(r, "local")[0])
                                      for r in table["native"]]
        for name, points in series.items():
            ax.plot(skews, [p[0] for p in points], "-o", color=COLORS[name], label=name)
            ax.plot(skews, [p[1] for p in points], ":", color=COLORS[name], alpha=0.6)
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlabel("routing skew: maxvio of the group's experts")
        ax.set_ylabel("slowest rank's fwd+bwd step (ms)")
        ax.set_title(f"{table['model']}, R={table['ranks']}, E={table['experts']}, S={table['tokens']}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, title="solid: NVLink model; dotted: local copies", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
