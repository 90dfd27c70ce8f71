"""One training step's DRAM traffic beside its FLOPs, kernel by kernel, from the GPU's counters.

    python -m bench.step_bytes                                   # DeepSeek-V3 at EP=1: ours and torch-native
    python -m bench.step_bytes --model deepseek-v3 --ep-rank-of 8 [--maxvio 20]   # one EP=8 rank
    python -m bench.step_bytes --layers ours                     # ours only
    python -m bench.step_bytes --layers ours --config grouped_gemm=deep_gemm token_padding=128   # a variant

For each layer (our DEFAULT, torch-native eager, torch-native compiled; built as `bench.layer` builds them:
the same weights, tokens and, for one EP rank, the plan's slots) the command starts itself again under
Nsight Compute (`ncu`, `NCU_ARGS`): the child builds the layer, runs `WARMUP` steps unprofiled (`auto`'s
measurement, Triton's and DeepGEMM's compiles, `torch.compile`), then profiles exactly one step between
`cudaProfilerStart` and `cudaProfilerStop`. ncu runs every kernel of that step alone, one after another,
with L2 left as the kernel before left it (`--cache-control none`) and the clocks as the GPU sets them
(`--clock-control none`), and reads per kernel its duration, the bytes read from DRAM and the bytes written
to it. Durations are of kernels run serially, without the streams' overlap: their sum is not the step's time
(`bench.layer` times that).

In ours the grouped-GEMM backend's calls are bracketed by marker kernels (`torch.cuda._sleep`, "spin_kernel",
left out of every total), so each call's kernels are attributed to their role ("fwd gate_up", "wgrad down",
...) with its FLOPs (2 x the rows up to the last group's end x the weight's columns x its inner size; padding
rows included: what the GEMM computes) and the bytes of the weights it reads (fwd, dgrad) or of the gradients
it writes (wgrad), of its groups with rows; `read_over_weights` is the DRAM bytes the call read over those
weights' bytes: it counts the rows' reads too (small beside the weights at EP=1), so 1.0 or a little more
reads each expert's weights once. The record's `limits` (`bench.common.measure_limits`, before the
children) put the bytes and FLOPs against the machine's copy bandwidth and dense rate; the kernels under ncu
run one at a time with idle gaps between them, so their clocks and rates run above a busy step's.
torch-native's kernels are listed by name and group only.

Record (`bench.common.write_record`:
`step-bytes-<model>[-ep<R>-rank[-maxvio<m>]][-<field>-<value>...]-<device>-<date>-<commit>.json`, the
`--config` fields in the name): `setup` (shapes, the routed FLOPs of a step, the weights' bytes, the ncu
command, `config`), `results`, one row per layer: `layer`, `kernels` (`[{name, group, role, ms, read_bytes,
write_bytes}]` in launch order), `groups` (per `bench.kernel_profile.kernel_group`: ms, read_gb, write_gb,
launches), `roles` (ours: per GEMM call, as above) and the totals. GPU and ncu only.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common import config_field, config_suffix, measure_limits, write_record
from bench.kernel_profile import KERNEL_GROUPS, kernel_group
from bench.layer_measure import routed_flops
from bench.layer_step import step, step_inputs, with_layer_weights
from bench.layer_tables import add_table_arguments, make_table, table_from_arguments, table_rank_plan
from bench.native_layer import compile_native, native_layer
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world

LAYERS = ("ours", "native", "compiled")
"""Our DEFAULT layer, torch-native eager, torch-native under `torch.compile`."""
WARMUP = 3
"""Unprofiled steps before the profiled one."""
MARKER = "spin_kernel"
"""The kernel `torch.cuda._sleep` launches (a part of its name): the brackets around ours' GEMM calls."""
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
NCU_ARGS = ("--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none",
            "--metrics", ",".join(METRICS), "--csv", "--page", "raw", "--print-units", "base")
GB = 1e9


def ncu_path() -> str | None:
    """The `ncu` on PATH, else the newest under /opt/nvidia/nsight-compute; None where there is none."""
    found = shutil.which("ncu")
    if found:
        return found
    installed = sorted(Path("/opt/nvidia/nsight-compute").glob("*/ncu"))
    return str(installed[-1]) if installed else None


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu's `--csv --page raw --print-units base` report -> `[{name, ms, read_bytes, write_bytes}]`, one
    per profiled kernel in launch order. Lines before the header (ncu's own messages) and the units row
    are skipped; numbers may carry thousands separators."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("parse_ncu_csv: no report header (a line starting with \"ID\") in ncu's output")
    rows = []
    for record in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not (record.get("ID") or "").strip().isdigit():
            continue  # the units row
        ns, read, write = (float(record[metric].replace(",", "")) for metric in METRICS)
        rows.append({"name": record["Kernel Name"], "ms": ns / 1e6, "read_bytes": read, "write_bytes": write})
    return rows


def attribute_roles(kernels: list[dict], roles: Sequence[dict]) -> list[dict]:
    """`kernels` (`parse_ncu_csv`, markers included) with each one's `role`: the role of the marker pair
    around it (`roles[i]` for the i-th pair, in call order), else None; the markers themselves dropped.
    Raises ValueError where the markers do not come in `len(roles)` pairs."""
    markers = sum(MARKER in kernel["name"] for kernel in kernels)
    if markers != 2 * len(roles):
        raise ValueError(f"attribute_roles: {markers} marker kernels for {len(roles)} GEMM calls "
                         f"(expected {2 * len(roles)})")
    out, seen, inside = [], 0, False
    for kernel in kernels:
        if MARKER in kernel["name"]:
            inside, seen = not inside, seen + 1
            continue
        out.append({**kernel, "role": roles[(seen - 1) // 2]["role"] if inside else None})
    return out


def summarise(kernels: list[dict], roles: Sequence[dict] = ()) -> dict:
    """Totals of one profiled step: `ms`, `read_gb`, `write_gb` over every kernel, per `kernel_group`
    (`groups`) and per GEMM role (`roles`: each role's calls summed, with their FLOPs, the weights' bytes
    and `read_over_weights`)."""

    def totals(rows: list[dict]) -> dict:
        return {"ms": sum(row["ms"] for row in rows), "read_gb": sum(row["read_bytes"] for row in rows) / GB,
                "write_gb": sum(row["write_bytes"] for row in rows) / GB, "launches": len(rows)}

    groups = {group: totals([row for row in kernels if kernel_group(row["name"]) == group])
              for group in KERNEL_GROUPS}
    by_role: dict[str, dict] = {}
    for call in roles:
        entry = by_role.setdefault(call["role"], {"calls": 0, "flops": 0, "weight_gb": 0.0})
        entry["calls"] += 1
        entry["flops"] += call["flops"]
        entry["weight_gb"] += call["weight_bytes"] / GB
    for role, entry in by_role.items():
        entry.update(totals([row for row in kernels if row.get("role") == role]))
        entry["read_over_weights"] = entry["read_gb"] / entry["weight_gb"] if entry["weight_gb"] else None
        entry["tflops_serial"] = entry["flops"] / (entry["ms"] / 1e3) / 1e12 if entry["ms"] else None
    return {**totals(kernels), "groups": groups, "roles": by_role}


def projection(weight_shape: Sequence[int], hidden: int, ffn: int) -> str:
    """"gate_up" for a `[2H', H]` weight matrix, "down" for `[H, H']`."""
    return "gate_up" if tuple(weight_shape) == (2 * ffn, hidden) else "down"


def bracket_gemm_calls(layer: torch.nn.Module, hidden: int, ffn: int) -> list[dict]:
    """Wrap the layer's grouped-GEMM backend so each fwd / dgrad / wgrad call launches a marker kernel
    before and after itself; returns the list each call appends to: its role, the weight's `cols` and `inner`,
    the bytes of one element of its weights (or gradients) and its `offs_g`, kept to count the rows and the
    groups once the step is done (no host read inside it: `call_sizes`)."""
    gemm, calls = layer._state.gemm, []

    def wrapped(op: str, real: Callable) -> Callable:
        def call(*args, **kwargs):
            first, second, offs_g = args[:3]
            cols, inner = (first.shape[1], second.shape[1]) if op == "wgrad" else second[0].shape[1:]
            torch.cuda._sleep(1)
            out = real(*args, **kwargs)
            torch.cuda._sleep(1)
            read = out if op == "wgrad" else second  # the gradients written, or the weights read
            calls.append({"role": f"{op} {projection((cols, inner), hidden, ffn)}", "cols": cols,
                          "inner": inner, "offs_g": offs_g, "element_size": read[0].element_size()})
            return out

        return call

    for op in ("fwd", "dgrad", "wgrad"):
        setattr(gemm, op, wrapped(op, getattr(gemm, op)))
    return calls


def call_sizes(call: dict) -> dict:
    """A bracketed call (`bracket_gemm_calls`) as recorded: `{role, flops, weight_bytes}`, its FLOPs over
    the rows up to its last group's end and the bytes of the weights (or gradients) of its groups with rows
    (a slot a plan leaves empty is never read)."""
    offs_g = call["offs_g"].long().cpu()
    rows_g = torch.diff(offs_g, prepend=offs_g.new_zeros(1))
    matrix = call["cols"] * call["inner"]
    return {"role": call["role"], "flops": 2 * int(offs_g[-1]) * matrix,
            "weight_bytes": int((rows_g > 0).sum()) * matrix * call["element_size"]}


def child(args: argparse.Namespace) -> None:
    """Under ncu: build `args.child`'s layer, `WARMUP` steps, one profiled step; its GEMM calls (ours)
    written to `args.calls` as JSON."""
    table = make_table(args.model, args.ep_rank_of, {}, args.maxvio)
    shapes, plan = table.shapes, table_rank_plan(table, "cuda")
    x_th, grad_th = step_inputs(table.tokens, table.hidden)
    if args.child == "ours":
        layer = with_layer_weights(MoonEPMoELayer(table.config(args.config), single_world("cuda")), plan)
    else:
        layer = native_layer(table.hidden, table.ffn, shapes["num_experts"], table.top_k)
        if args.child == "compiled":
            layer, _ = compile_native(layer, x_th, grad_th)
    for _ in range(WARMUP):
        step(layer, x_th, grad_th)
    calls = bracket_gemm_calls(layer, table.hidden, table.ffn) if args.child == "ours" else []
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step(layer, x_th, grad_th)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    Path(args.calls).write_text(json.dumps([call_sizes(call) for call in calls]))


def profiled(ncu: str, layer: str, args: argparse.Namespace) -> dict:
    """Run `child` for `layer` under ncu: its row (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        report, calls = Path(tmp) / "ncu.csv", Path(tmp) / "calls.json"
        command = [ncu, *NCU_ARGS, "--log-file", str(report), sys.executable, "-m", "bench.step_bytes",
                   "--child", layer, "--calls", str(calls), "--model", args.model,
                   "--maxvio", str(args.maxvio),
                   "--config", *(f"{key}={value}" for key, value in args.config.items())]
        if args.ep_rank_of is not None:
            command += ["--ep-rank-of", str(args.ep_rank_of)]
        subprocess.run(command, check=True)
        roles = json.loads(calls.read_text())
        kernels = attribute_roles(parse_ncu_csv(report.read_text()), roles)
    for kernel in kernels:
        kernel["group"] = kernel_group(kernel["name"])
    return {"layer": layer, **summarise(kernels, roles), "kernels": kernels}


def print_row(row: dict, flops: int) -> None:
    print(f"{row['layer']}: {row['launches']} kernels, {row['ms']:.2f} ms run serially, DRAM read "
          f"{row['read_gb']:.1f} GB, written "
          f"{row['write_gb']:.1f} GB; the step's routed FLOPs {flops / 1e12:.2f} T: "
          f"{flops / ((row['read_gb'] + row['write_gb']) * GB):.0f} FLOP per DRAM byte", flush=True)
    for group, entry in row["groups"].items():
        if entry["launches"]:
            print(f"  {group:12} {entry['ms']:7.2f} ms  read {entry['read_gb']:6.2f} GB  write "
                  f"{entry['write_gb']:6.2f} GB  ({entry['launches']} kernels)", flush=True)
    for role, entry in row["roles"].items():
        print(f"  {role:14} {entry['ms']:7.2f} ms  {entry['tflops_serial']:6.0f} TFLOP/s  read "
              f"{entry['read_gb']:6.2f} GB  write {entry['write_gb']:6.2f} GB  weights (or gradients) "
              f"{entry['weight_gb']:6.2f} GB: read {entry['read_over_weights']:.2f}x that", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_table_arguments(parser)
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS))
    parser.add_argument("--config", nargs="*", type=config_field, default=[], metavar="FIELD=VALUE",
                        help="MoEConfig fields of ours instead of the DEFAULT's (a value parsed as YAML)")
    parser.add_argument("--out", default=None, help="folder of the JSON record (default bench/results)")
    parser.add_argument("--child", choices=LAYERS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--calls", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.config = dict(args.config)
    if not torch.cuda.is_available():
        parser.error("bench.step_bytes reads the GPU's counters (Nsight Compute): it needs a GPU")
    if args.child:
        child(args)
        return
    ncu = ncu_path()
    if ncu is None:
        parser.error("bench.step_bytes needs Nsight Compute's ncu (on PATH or in /opt/nvidia/nsight-compute)")
    table = table_from_arguments(parser, args)
    flops = routed_flops(table.tokens, table.top_k, table.hidden, table.ffn, backward=True)
    limits = measure_limits()
    torch.cuda.empty_cache()  # the children need the GPU's memory
    rows = []
    for layer in args.layers:
        rows.append(profiled(ncu, layer, args))
        print_row(rows[-1], flops)
    weights = table.shapes["num_experts"] * 3 * table.hidden * table.ffn * 2
    setup = {**table.setup, "routed_flops": flops, "expert_weight_gb": weights / GB,
             "ncu": [os.path.basename(ncu), *NCU_ARGS], "warmup_steps": WARMUP, "config": args.config}
    name = table.record_name.replace("layer-", "step-bytes-", 1)
    name += config_suffix(args.config)
    path = write_record(name, limits, rows, Path(args.out) if args.out else None, setup=setup)
    print("record:", path)


if __name__ == "__main__":
    main()
