"""bench/comm_bytes.py's FP8 prefetch column: the e4m3 bytes (half of bf16's) plus one fp32 scale per
128x128 block, beside the bf16 prefetch, and not counted in the training step."""

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


def test_table_has_the_fp8_prefetch_column_beside_bf16s():
    head = table().splitlines()[0].split(" | ")
    assert head[4:6] == ["prefetch (fwd+bwd)", "prefetch fp8 (fwd+bwd)"]
