"""bench/beside_gemm.py: the gain it reports, the cases it accepts, its copy kernel, its refusal off CUDA."""

from __future__ import annotations

import pytest
import torch

from bench.beside_gemm import _copy_kernel, cases, gain, main


def test_gain_is_the_serial_time_over_the_time_side_by_side():
    assert gain(3.0, 1.0, 3.0) == pytest.approx(4 / 3)  # the copy hid entirely beside the GEMM
    assert gain(3.0, 1.0, 4.0) == pytest.approx(1.0)  # no overlap
    assert gain(5.30, 1.24, 6.73) < 1.0  # slower side by side than one after the other


def test_cases_pair_every_carveout_with_every_grid_and_refuse_impossible_ones():
    assert cases([0, 16], [8, 32], sm_count=132) == [(0, 8), (0, 32), (16, 8), (16, 32)]
    with pytest.raises(ValueError, match=r"--carveouts must be in \[0, 132\).*\[132\]"):
        cases([0, 132], [8], sm_count=132)
    assert cases([0], [0], sm_count=132) == [(0, 0)]  # grid 0: the copy engine
    with pytest.raises(ValueError, match=r"--grids must be .* 0 for the copy engine, got \[-1"):
        cases([0], [-1], sm_count=132)


@pytest.mark.interpreter
@pytest.mark.parametrize("grid", [1, 3])
def test_the_copy_kernel_copies_every_element_on_any_grid(grid):
    src = torch.randn(3 * 64 + 5, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    _copy_kernel[(grid,)](src, dst, src.numel(), BLOCK=64)
    assert torch.equal(dst, src)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_it_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a GPU"):
        main([])
