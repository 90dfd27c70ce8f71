"""bench/comm_bytes.py's FP8 columns: the dispatch of e4m3 rows with one fp32 scale per 128 columns and the
prefetch of e4m3 experts with one per 128x128 block (half of bf16's bytes, plus the scales), each beside its
bf16 column, and not counted in the training step."""

from bench.comm_bytes import OPS, Shape, bytes_per_rank, table
from moonep_moe.config import load_config


def test_fp8_prefetch_moves_half_the_bytes_of_bf16_plus_the_block_scales():
    cfg = load_config("deepseek-v3")
    s = Shape.of(cfg, cfg.experts_per_rank)
    static = bytes_per_rank(s)["static"]
    peers, slots = s.R - 1, s.B
    blocks = 3 * (7168 // 128) * (2048 // 128)  # gate, up, down of one expert
    expert_bf16, expert_fp8 = 3 * 7168 * 2048 * 2, 3 * 7168 * 2048 + 4 * blocks
    assert static["prefetch"] == (peers * slots * (expert_bf16 + 8),) * 2
    assert static["prefetch fp8"] == (peers * slots * (expert_fp8 + 8),) * 2
    assert 0.5 < static["prefetch fp8"][0] / static["prefetch"][0] < 0.501, "half, + scales"
    assert "prefetch fp8" not in OPS, "the training step sums the bf16 operations"


def test_fp8_dispatch_moves_half_the_row_bytes_of_bf16_plus_the_row_scales():
    cfg = load_config("deepseek-v3")
    s = Shape.of(cfg, cfg.experts_per_rank)
    static = bytes_per_rank(s)["static"]
    peers, routes = s.R - 1, s.S * s.K
    row_fp8 = 7168 + 4 * (7168 // 128)  # e4m3 bytes and 56 fp32 scales: 7392, a multiple of 16
    weights_and_dups = 2 * routes * (4 + 8)
    row_bf16 = 7168 * 2
    assert static["dispatch"] == (peers * (s.S * (row_bf16 + 8) + weights_and_dups),
                                  peers * s.S * (row_bf16 + 8))
    assert static["dispatch fp8"] == (peers * (s.S * (row_fp8 + 8) + weights_and_dups),
                                      peers * s.S * (row_fp8 + 8))
    assert 0.51 < static["dispatch fp8"][1] / static["dispatch"][1] < 0.52, "half, + 3.1% scales"
    assert "dispatch fp8" not in OPS, "the training step sums the bf16 operations"


def test_table_has_the_fp8_columns_beside_bf16s():
    head = table().splitlines()[0].split(" | ")
    assert head[2:4] == ["dispatch (fwd+bwd)", "dispatch fp8 (fwd+bwd)"]
    assert head[5:7] == ["prefetch (fwd+bwd)", "prefetch fp8 (fwd+bwd)"]


def test_reduce_grad_moves_the_slot_gradients_in_their_dtype():
    """`param` gradients (the default) are written over the slot weights in the weights' dtype, so
    reduce_grad moves as many bytes as a forward prefetch; `main_grad`'s fp32 pool twice as many (bf16)."""
    for mode, factor in (("param", 1), ("main_grad", 2)):
        cfg = load_config("deepseek-v3", expert_grad_dtype=mode)
        static = bytes_per_rank(Shape.of(cfg, cfg.experts_per_rank))["static"]
        peers, slots, expert = 7, 32, 3 * 7168 * 2048
        assert static["reduce_grad"] == (0.0, peers * slots * (expert * 2 * factor + 8)), mode
