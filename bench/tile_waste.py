"""How many rows a grouped GEMM computes when it tiles M, against the routed rows it is given: the ceiling
tile quantisation puts on an EP=1 layer's useful GEMM rate (why the layer misses 0.75 of dense).

    python -m bench.tile_waste          # every packaged model at EP=1, uniform routing (CPU, a few seconds)

Each of `--draws` draws routes S tokens (the config's `max_tokens_per_rank`) to K of E experts uniformly at
random (the near-uniform routing `bench.layer`'s random inputs give), pads every expert's rows to the
token padding (16, the default; 128, DeepGEMM's) and rounds each padded segment up to whole M tiles: a
grouped GEMM computes every row of a tile it starts. `useful` is the routed rows (S K) over the rows
computed; a GEMM running its tiles at a fraction f of the dense rate delivers at most f x useful of it in
routed FLOPs. `torch._grouped_mm` on sm90 uses 128-row tiles (128 x 256 x 64, CUTLASS) when the mean rows
per group and N both exceed 128, else 64-row ones (PyTorch 2.11's GroupMM.cu); DeepGEMM's m-grouped
kernels start each segment at a 128-row block. The record goes to `bench/results/tile-waste-cpu-...json`.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import MODELS, model_shape, write_record

PADDINGS = (16, 128)
TILES = (64, 128)


def computed_rows(counts_e: torch.Tensor, padding: int, tile: int) -> int:
    """Rows a grouped GEMM over segments of `counts_e` rows computes: each segment padded to `padding`, then
    rounded up to whole `tile`-row blocks (empty segments compute nothing)."""
    padded_e = (counts_e + padding - 1) // padding * padding
    return int(((padded_e + tile - 1) // tile * tile).sum())


def draw_counts(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Routes per expert when every token picks `top_k` distinct experts uniformly at random."""
    topk_sk = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    return torch.bincount(topk_sk.flatten(), minlength=experts)


def model_rows(model: str, draws: int, gen: torch.Generator) -> list[dict]:
    shape = model_shape(model)
    tokens, experts, top_k = shape["tokens"], shape["experts"], shape["top_k"]
    counts = [draw_counts(tokens, experts, top_k, gen) for _ in range(draws)]
    rows = []
    for padding in PADDINGS:
        for tile in TILES:
            useful = sorted(tokens * top_k / computed_rows(c, padding, tile) for c in counts)
            rows.append({"model": model, "tokens": tokens, "experts": experts, "top_k": top_k,
                         "mean_rows_per_expert": tokens * top_k / experts, "padding": padding, "tile": tile,
                         "useful": useful[len(useful) // 2], "useful_min": useful[0],
                         "useful_max": useful[-1], "useful_samples": useful})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--draws", type=int, default=10)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [row for model in args.models for row in model_rows(model, args.draws, gen)]
    for row in rows:
        print(f"{row['model']:18} S={row['tokens']} E={row['experts']:3} K={row['top_k']} "
              f"({row['mean_rows_per_expert']:6.0f} rows/expert)  padding {row['padding']:3}  "
              f"tile {row['tile']:3}  useful {row['useful']:.3f} "
              f"({row['useful_min']:.3f}-{row['useful_max']:.3f})")
    path = write_record("tile-waste", {}, rows, ran_on="cpu", setup=vars(args))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
