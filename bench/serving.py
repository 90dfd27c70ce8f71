"""Serving benchmark: time per MoE step as the token count per rank falls from S to 1, against full capacity.

R EP ranks run as threads on one device (the threads world), each with `s` tokens per step, for s = 1, 2,
4, ... up to S. For every s it times, on rank 0 between two barriers (so the time covers the whole group):

- `comm_s`: `MoECommunicator.dispatch` + `combine` (the expert output is the dispatched rows themselves);
- `layer_s`: the whole layer forward as an engine runs it: router GEMM + top-k, dispatch, slot prefetch
  (`ExpertLayout`), grouped-GEMM SwiGLU experts, combine;
- `*_padded_s`: the same step padded to S tokens (routes -1) through one full-capacity Buffer, the way
  integrations that pad every step to S run it.

The baseline is the full step (s = S), measured in the same run. Forward only: multi-rank autograd backward
cannot run in the threads world on one GPU. On one device the R ranks time-slice it, so absolute times are
those of the whole group on one chip; the ratios to the baseline are what this measures.

    python -m bench.serving                        # small CPU default
    python -m bench.serving --device cuda --ranks 8 --hidden 7168 --ffn 2048 --experts 256 --top-k 8 \
        --tokens 1024 --dtype bfloat16            # DeepSeek-V3's MoE layer at EP=8 on one GPU

Writes `bench/results/serving-<device>-<date>-<commit>.json` (device, commit, command, shape, baseline, rows).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from bench.common import write_record
from moonep_moe.comm.world import run_ranks
from moonep_moe.communicator import MoECommunicator
from moonep_moe.layers.grouped_gemm import select_grouped_gemm
from moonep_moe.layers.swiglu import swiglu_weighted
from moonep_moe.weights.layout import ExpertLayout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--ranks", type=int, default=4, help="R thread-ranks (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="H (default 256)")
    parser.add_argument("--ffn", type=int, default=128, help="I, expert FFN size (default 128)")
    parser.add_argument("--experts", type=int, default=32, help="E (default 32)")
    parser.add_argument("--top-k", type=int, default=4, help="K (default 4)")
    parser.add_argument("--tokens", type=int, default=256, help="S, token capacity per rank (default 256)")
    parser.add_argument("--slots", type=int, default=None, help="B slots per rank (default E/R)")
    parser.add_argument("--token-padding", type=int, default=128, help="tp (default 128)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results)")
    return parser.parse_args(argv)


def token_counts(capacity: int) -> list[int]:
    """1, 2, 4, ... below `capacity`, then `capacity` itself (the baseline)."""
    return [1 << i for i in range(capacity.bit_length()) if 1 << i < capacity] + [capacity]


def rank_bench(world, args: argparse.Namespace) -> dict:
    """One rank's part: build the communicators and this rank's experts, then time every token count."""
    dtype, device = getattr(torch, args.dtype), world.device
    H, F, E, K, S = args.hidden, args.ffn, args.experts, args.top_k, args.tokens
    shape = dict(hidden_size=H, num_experts=E, top_k=K, max_tokens_per_rank=S, num_prefetch_slots=args.slots,
                 token_padding=args.token_padding, dtype=args.dtype)
    pooled = MoECommunicator(world=world, **shape)
    padded = MoECommunicator(world=world, variable_tokens=False, **shape)
    gen = torch.Generator(device).manual_seed(world.rank)

    def expert_weights(expert: int):  # random weights, made on the device one home expert at a time
        scale = H ** -0.5
        return tuple(torch.randn(n, k, generator=gen, device=device, dtype=dtype) * scale
                     for n, k in ((F, H), (F, H), (H, F)))

    layout = ExpertLayout.from_experts(world, expert_weights, E, num_slots=pooled.num_slots, name="bench",
                                       dtype=dtype)
    gemm = select_grouped_gemm("auto", device, dtype, k=math.gcd(H, F))
    w_router_he = torch.randn(H, E, generator=gen, device=device, dtype=torch.float32)

    def route(hidden_th: torch.Tensor, num_real: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax top-k of a router GEMM; tokens past `num_real` are padding (routes -1, weight 0)."""
        scores_tk, topk_tk = torch.topk(hidden_th.float() @ w_router_he, K, dim=-1)
        weights_tk = torch.softmax(scores_tk, dim=-1)
        real_t1 = (torch.arange(hidden_th.shape[0], device=device) < num_real)[:, None]
        return torch.where(real_t1, topk_tk, -1).int(), weights_tk * real_t1

    def comm_step(comm: MoECommunicator, hidden_th: torch.Tensor, topk_tk, weights_tk) -> torch.Tensor:
        out, handle = comm.dispatch(hidden_th, topk_tk, weights_tk)
        return comm.combine(out.tokens_nvsh, handle)

    def layer_step(comm: MoECommunicator, hidden_th: torch.Tensor, num_real: int) -> torch.Tensor:
        topk_tk, weights_tk = route(hidden_th, num_real)
        out, handle = comm.dispatch(hidden_th, topk_tk, weights_tk)
        comm.prefetch_weights(handle, layout)
        ab_nv2f = gemm.fwd(out.tokens_nvsh, (layout.gate_up.home.local, layout.gate_up.slots.local),
                           out.offsets_g)
        hw_nvf = swiglu_weighted(ab_nv2f, out.weights_nvs)
        y_nvsh = gemm.fwd(hw_nvf, (layout.down.home.local, layout.down.slots.local), out.offsets_g)
        return comm.combine(y_nvsh, handle)

    def timed(fn, *fn_args) -> float:
        for _ in range(args.warmup):
            fn(*fn_args)
        world.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn(*fn_args)
        world.barrier()
        return (time.perf_counter() - start) / args.iters

    rows = []
    with torch.no_grad():
        for s in token_counts(S):
            hidden_sh = torch.randn(S, H, generator=gen, device=device, dtype=dtype)
            topk_sk, weights_sk = route(hidden_sh, s)
            row = dict(tokens=s, capacity=pooled.capacity_for(s))
            row["comm_s"] = timed(comm_step, pooled, hidden_sh[:s], topk_sk[:s], weights_sk[:s])
            row["layer_s"] = timed(layer_step, pooled, hidden_sh[:s], s)
            row["comm_padded_s"] = timed(comm_step, padded, hidden_sh, topk_sk, weights_sk)
            row["layer_padded_s"] = timed(layer_step, padded, hidden_sh, s)
            rows.append(row)
    pool = pooled.stats()
    pooled.destroy()
    padded.destroy()
    return dict(rows=rows, pool=pool)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    device = torch.device(args.device)
    result = run_ranks(lambda world: rank_bench(world, args), args.ranks, device)[0]
    rows = result["rows"]
    baseline = rows[-1]
    for row in rows:
        for key in ("comm_s", "layer_s"):
            row[key.replace("_s", "_vs_full")] = row[key] / baseline[key]
    out = write_record(
        "serving", {}, rows, args.out, world=f"threads, {args.ranks} ranks on one {device.type} device",
        shape=dict(H=args.hidden, I=args.ffn, E=args.experts, K=args.top_k, S=args.tokens, B=args.slots,
                   token_padding=args.token_padding, dtype=args.dtype),
        warmup=args.warmup, iters=args.iters,
        baseline=dict(tokens=baseline["tokens"], comm_s=baseline["comm_s"], layer_s=baseline["layer_s"]),
        pool=result["pool"])
    print(f"{'tokens':>6} {'cap':>5} {'comm ms':>9} {'padded':>9} {'layer ms':>9} {'padded':>9} "
          f"{'layer/full':>10}")
    for row in rows:
        print(f"{row['tokens']:>6} {row['capacity']:>5} {row['comm_s'] * 1e3:>9.2f} "
              f"{row['comm_padded_s'] * 1e3:>9.2f} {row['layer_s'] * 1e3:>9.2f} "
              f"{row['layer_padded_s'] * 1e3:>9.2f} {row['layer_vs_full']:>10.2f}")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
