"""bench/router.py: its error measure, its two arms' errors on the CPU, one model's row, its refusal off
CUDA."""

from __future__ import annotations

import pytest
import torch

from bench.router import bench_model, gemm_arms, main, relative_error


def test_relative_error_is_the_largest_error_over_the_largest_magnitude():
    reference = torch.tensor([[4.0, -8.0], [2.0, 1.0]], dtype=torch.float64)
    value = torch.tensor([[4.5, -8.0], [2.0, 0.0]])
    assert relative_error(value, reference) == pytest.approx(1.0 / 8.0)


def test_both_arms_compute_the_float64_product_to_fp32_accuracy():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(16, 256, generator=gen) / 16
    arms = gemm_arms(x, w, torch.randn(32, 16, generator=gen))
    assert set(arms) == {"fp32", "bf16x3"}
    for arm in arms.values():
        assert arm["error"]["logits"] < 1e-6 and arm["error"]["grad_weight"] < 1e-6
        assert arm["error"]["grad_input"] < 2**-8  # rounded to bf16
        assert arm["forward"]().shape == (32, 16)


def test_one_models_row_holds_both_arms_their_ratio_and_errors_on_the_cpu():
    row = bench_model("deepseek-v3", tokens=8, repeat=2, device=torch.device("cpu"))
    assert (row["tokens"], row["hidden"], row["experts"]) == (8, 7168, 256)
    for part in ("gemm_forward", "gemm_step", "router_step"):
        times = row[part]
        assert len(times["fp32"]["ms_samples"]) == 2 and len(times["bf16x3"]["ms_samples"]) == 2
        assert times["speedup"][0] == pytest.approx(times["fp32"]["ms"] / times["bf16x3"]["ms"])
    assert row["error"]["bf16x3"]["logits"] < 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_it_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a GPU"):
        main([])
