"""bench/tile_waste.py's count of the rows a tiled grouped GEMM computes, on segments worked by hand."""

import torch

from bench.tile_waste import computed_rows, draw_counts


def test_segments_pad_then_round_up_to_whole_tiles_and_empty_ones_compute_nothing():
    counts_e = torch.tensor([0, 1, 16, 17, 128, 129])
    # padded to 16: 0, 16, 16, 32, 128, 144; in 64-row tiles: 0, 64, 64, 64, 128, 192
    assert computed_rows(counts_e, padding=16, tile=64) == 512
    # in 128-row tiles: 0, 128, 128, 128, 128, 256
    assert computed_rows(counts_e, padding=16, tile=128) == 768
    assert computed_rows(counts_e, padding=1, tile=1) == int(counts_e.sum())


def test_every_token_routes_to_k_distinct_experts():
    counts_e = draw_counts(tokens=100, experts=16, top_k=4, gen=torch.Generator().manual_seed(0))
    assert counts_e.shape == (16,) and int(counts_e.sum()) == 400 and int(counts_e.max()) <= 100
