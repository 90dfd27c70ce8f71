"""DeepGEMM's sm90 k-grouped bf16 weight gradient with a stand-in host list: correct, and how fast.

    python -m bench.deep_gemm_wgrad            # an H200 with DeepGEMM: about a minute
    python -m bench.deep_gemm_wgrad --kernels  # the deep_gemm backend's wgrad on a real plan, by kernel

`deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, grouped_layout, c)` computes, per group g,
``d[g] = c[g] + a[rows_g]^T @ b[rows_g]`` (``a [rows, m]``, ``b [rows, n]``: a wgrad's ``dy`` and ``x``). On
sm90 it takes the per-group row counts twice: ``grouped_layout`` (int32 on the device, what the kernel's
scheduler walks) and ``ks``, a host list it asserts to have one entry per group, each a multiple of 128,
summing to ``rows`` (the operands' TMA extent), and whose maximum picks the tile config. A list read from the
device every step is a host sync; the question this bench answers is whether a fixed stand-in of the right
count and sum (`standin_sizes`: the rows dealt evenly in 128-row blocks) gives the same results.

1. Correctness (`CASES`): skewed 128-aligned segments with empty groups, rows past the last group holding
   garbage, fp32 and bf16 outputs, ``c`` the output itself or another tensor: the stand-in's output against
   the true list's (bit for bit) and against a float64 reference (relative Frobenius error); empty groups
   keep ``c``.
2. Speed, one EP=8 rank's home experts (`SHAPES`: DeepSeek-V3's 32 and Kimi-K2's 48 groups, 65536 routes,
   uniform 128-aligned segments), each projection, arms alternated round by round (`--repeat` rounds):
   ``torch._grouped_mm`` (bf16 out: what param mode's fresh gradients cost), the same plus an fp32 add (an
   adding fp32 wgrad on torch), the Triton wgrad adding into fp32, and DeepGEMM adding into fp32 and into
   bf16 (``c = d``). Each against its floor: the FLOPs at the run's dense bf16 rate.

3. ``--kernels`` (instead of 1 and 2): the ``deep_gemm`` backend's wgrad as the layer calls it in "param"
   mode (fresh home gradients, the slots overwritten), both projections, on one EP=8 rank's segments as the
   real planner fills them at maxvio 0 (`bench.gemm.plan_segments`), under the torch profiler: each kernel's
   device time per call (DeepGEMM's k-grouped GEMMs, the zeroing before them, the slots' Triton wgrad)
   beside the floor (the FLOPs on the used rows at the run's dense rate).

Writes `bench/results/deep-gemm-wgrad[-kernels]-<device>-<date>-<commit>.json`.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import cuda_kernels, measure_limits, spread, timings, write_record
from moonep_moe.base.sizes import BLOCK_TOKEN_PADDING as ALIGN
from moonep_moe.gemm.deep_gemm import import_deep_gemm, standin_sizes
from moonep_moe.gemm.kernels.wgrad import grouped_wgrad_triton

CASES = [  # (groups, m, n, rows per group before padding (0: empty), garbage rows past the last group)
    (8, 256, 384, [700, 0, 5, 129, 0, 2000, 1, 40], 0),
    (8, 256, 384, [0, 3000, 0, 0, 17, 128, 0, 0], 256),
    (32, 512, 1024, [2000 if g % 7 == 0 else 64 * g for g in range(32)], 128),
]
SHAPES = {"deepseek-v3": (32, 2048, 7168), "kimi-k2": (48, 2048, 7168)}  # (home groups, H', H)
ROUTES = 65536


def aligned_segments(sizes: list[int], tail: int, m: int, n: int) -> tuple[torch.Tensor, ...]:
    """``a [rows, m]``, ``b [rows, n]`` bf16 with each group's rows padded with zeros to `ALIGN`, `tail`
    garbage rows after the last group; and the padded sizes (int32, device)."""
    padded = [-(-s // ALIGN) * ALIGN for s in sizes]
    rows = sum(padded) + tail
    a = torch.zeros(rows, m, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
    start = 0
    for size, block in zip(sizes, padded, strict=True):
        a[start:start + size].normal_()
        b[start:start + size].normal_()
        start += block
    a[start:].fill_(1e4)
    b[start:].fill_(1e4)
    return a, b, torch.tensor(padded, dtype=torch.int32, device="cuda")


def correctness(dg) -> list[dict]:
    rows_out = []
    dtypes = (torch.float32, torch.bfloat16)
    for (groups, m, n, sizes, tail), dtype, alias in itertools.product(CASES, dtypes, (True, False)):
        a, b, padded = aligned_segments(sizes, tail, m, n)
        ends = padded.cumsum(0).tolist()
        c = torch.randn(groups, m, n, device="cuda").to(dtype)
        want = c.double()
        for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            want[g] += a[start:end].double().T @ b[start:end].double()
        true_ks = padded.tolist()
        true_ks[-1] += tail  # the host list must cover every row; the device's sizes leave the tail out
        outs = {}
        for host, ks in (("true", true_ks), ("standin", standin_sizes(groups, a.shape[0]))):
            d = c.clone()
            dg.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, padded, d if alias else c.clone())
            outs[host] = d
        got = outs["standin"]
        empty = [g for g, s in enumerate(sizes) if s == 0]
        rows_out.append({
            "groups": groups, "m": m, "n": n, "sizes": sizes, "tail": tail, "dtype": str(dtype),
            "c_is_d": alias,
            "standin_equals_true_ks": bool(torch.equal(outs["true"], got)),
            "rel_error": float((got.double() - want).norm() / want.norm()),
            "empty_groups_keep_c": all(torch.equal(got[g], c[g]) for g in empty),
        })
        print(rows_out[-1], flush=True)
    return rows_out


def wgrad_arms(dg, a: torch.Tensor, b: torch.Tensor, padded_g: torch.Tensor) -> dict:
    """The timed calls of one projection's wgrad (``a = dy``, ``b = x``), by arm name."""
    groups, m, n = padded_g.numel(), a.shape[1], b.shape[1]
    offs_g = padded_g.cumsum(0).int()
    d32 = torch.zeros(groups, m, n, device="cuda")
    d16 = torch.zeros(groups, m, n, device="cuda", dtype=torch.bfloat16)
    ks = standin_sizes(groups, a.shape[0])
    kgrouped = dg.k_grouped_bf16_gemm_tn_contiguous
    return {
        "torch_bf16": lambda: torch._grouped_mm(a.T, b, offs=offs_g),
        "torch_bf16_then_fp32_add": lambda: d32.add_(torch._grouped_mm(a.T, b, offs=offs_g)),
        "triton_fp32_add": lambda: grouped_wgrad_triton(a, b, offs_g, [d32], accumulate=True),
        "deep_gemm_fp32_add": lambda: kgrouped(a, b, d32, ks, padded_g, d32),
        "deep_gemm_bf16_add": lambda: kgrouped(a, b, d16, ks, padded_g, d16),
    }


def speed(dg, limits: dict, repeat: int) -> list[dict]:
    rows_out = []
    for (model, (groups, ffn, hidden)), proj in itertools.product(SHAPES.items(), ("gate_up", "down")):
        m, n = (2 * ffn, hidden) if proj == "gate_up" else (hidden, ffn)  # dy's and x's columns
        per_group = -(-ROUTES // groups // ALIGN) * ALIGN
        a, b, padded = aligned_segments([per_group] * groups, 0, m, n)
        arms = wgrad_arms(dg, a, b, padded)
        seconds = {arm: [] for arm in arms}
        for fn in arms.values():
            timings(fn, warmup=2, repeat=1)  # compile, autotune
        for _ in range(repeat):  # arms alternated: each round times every arm once
            for arm, fn in arms.items():
                seconds[arm] += timings(fn, warmup=0, repeat=1)
        floor_ms = 2 * a.shape[0] * m * n / limits["dense_bf16_flops_per_s"] * 1e3
        row = {"model": model, "projection": proj, "groups": groups, "rows": a.shape[0], "m": m, "n": n,
               "floor_ms": floor_ms}
        for arm, secs in seconds.items():
            row[arm] = spread(secs)
            row[arm]["vs_floor"] = row[arm]["ms"] / floor_ms
        rows_out.append(row)
        print(f"{model:12} {proj:8} floor {floor_ms:.2f} ms  " + "  ".join(
            f"{arm} {row[arm]['ms']:.2f} ({row[arm]['vs_floor']:.2f}x)" for arm in arms), flush=True)
    return rows_out


def kernels(limits: dict, repeat: int) -> list[dict]:
    """Device time per kernel of the deep_gemm backend's "param"-mode wgrad (both projections), per shape."""
    from bench.gemm import expert_shape, plan_segments
    from moonep_moe.gemm.deep_gemm import DeepGemmGroupedGemm

    deep, rows_out = DeepGemmGroupedGemm(), []
    for model in SHAPES:
        hidden, ffn, epn = expert_shape(model)
        offs_g, plan = plan_segments(model, 0.0)
        offs_g = offs_g.cuda()
        rows = int(offs_g[-1])
        x, dab, g, hw = (torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
                         for cols in (hidden, 2 * ffn, hidden, ffn))
        slots = [torch.zeros(epn, cols, inner, device="cuda", dtype=torch.bfloat16)
                 for cols, inner in ((2 * ffn, hidden), (hidden, ffn))]

        pairs = ((dab, x, slots[0]), (g, hw, slots[1]))  # (dy, x, slot gradients) of gate_up, of down

        def call(pairs=pairs, offs_g=offs_g):
            for dy, inputs, slot_grads in pairs:
                deep.wgrad(dy, inputs, offs_g, (None, slot_grads), accumulate=False)

        timings(call, warmup=3, repeat=1)
        per_kernel: dict[str, float] = {}
        for name, ms in cuda_kernels(lambda call=call: [call() for _ in range(repeat)]):
            per_kernel[name] = per_kernel.get(name, 0.0) + ms / repeat
        floor_ms = 2 * ROUTES * 3 * ffn * hidden / limits["dense_bf16_flops_per_s"] * 1e3
        row = {"model": model, "rows": rows, "floor_ms": floor_ms, "plan": plan,
               "kernels_ms": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])),
               "total_ms": sum(per_kernel.values())}
        rows_out.append(row)
        listed = ", ".join(f"{name[:60]} {ms:.2f}" for name, ms in row["kernels_ms"].items() if ms >= 0.01)
        print(f"{model:12} floor {floor_ms:.2f} ms, kernels {row['total_ms']:.2f} ms "
              f"({row['total_ms'] / floor_ms:.2f}x): {listed}", flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="rounds of the alternated arms (>= 5)")
    parser.add_argument("--kernels", action="store_true",
                        help="only the deep_gemm backend's wgrad on a real plan's segments, kernel by kernel")
    args = parser.parse_args()
    if args.repeat < 5:
        parser.error(f"--repeat must be >= 5 (the median of at least five), got {args.repeat}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("bench.deep_gemm_wgrad measures DeepGEMM's sm90 kernel: it needs a Hopper GPU")
    dg = import_deep_gemm()
    torch.manual_seed(0)
    limits = measure_limits()
    if args.kernels:
        path = write_record("deep-gemm-wgrad-kernels", limits, kernels(limits, args.repeat),
                            setup={"align": ALIGN, "maxvio": 0.0, "repeat": args.repeat, "mode": "param"})
        print(f"record: {path}")
        return
    checks = correctness(dg)
    rows = speed(dg, limits, args.repeat)
    path = write_record("deep-gemm-wgrad", limits, rows, correctness=checks,
                        setup={"align": ALIGN, "routes": ROUTES, "repeat": args.repeat,
                               "ks": "standin_sizes"})
    print(f"record: {path}")


if __name__ == "__main__":
    main()
