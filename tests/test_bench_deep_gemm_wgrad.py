"""bench.deep_gemm_wgrad's stand-in host list: what DeepGEMM's sm90 k-grouped wgrad asserts of it (one entry
per group, each a multiple of 128, summing to the operands' rows), for any group count and row total."""

import pytest

from bench.deep_gemm_wgrad import ALIGN, standin_ks


@pytest.mark.parametrize(("groups", "rows"), [(1, 128), (32, 65536 + 32 * 128), (48, 128 * 7), (8, 0),
                                              (256, 128 * 1000)])
def test_standin_ks_has_the_count_the_sum_and_the_alignment(groups, rows):
    ks = standin_ks(groups, rows)
    assert len(ks) == groups and sum(ks) == rows
    assert all(k % ALIGN == 0 and k >= 0 for k in ks)
    assert max(ks) - min(ks) <= ALIGN  # dealt evenly: the largest (the tile heuristic's input) near the mean
