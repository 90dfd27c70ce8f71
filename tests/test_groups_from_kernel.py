"""The Triton GEMM over the groups from a given one on (the slot groups the layer computes once the replicas'
weights have arrived) against a float64 reference, on random, skewed, empty and unaligned segments.

Products of bf16 values are exact in fp32, so the kernel differs from float64 only by fp32 sums and the
output's rounding: a row taken from the wrong group, a group's weight swapped, or a row of an earlier group
written fails. Rows before the first computed group and past the last end hold a sentinel that must survive.
On CPU the kernel runs in Triton's interpreter (small tiles: several tiles per group, row blocks across group
ends, masked tails); the GPU cases use DeepSeek-V3's expert shapes. Segments padded to 128 rows (the layer's
with DeepGEMM) also run through the aligned kernel (tensor descriptors), said by ``row_alignment``.
"""

import pytest
import torch

from moonep_moe.gemm.kernels.groups_from import groups_from_gemm

SENTINEL = 7.0
SIZES_G = [3, 40, 0, 5, 0, 1, 37, 0, 18, 2]  # home groups, then slots: empty, 1-row, unaligned
ALIGNED_G = [128, 256, 0, 128, 0, 384, 128]  # segments padded to 128 rows, some empty
TAIL = 6


def offsets(sizes_g: list[int], device) -> torch.Tensor:
    return torch.tensor(sizes_g, dtype=torch.int32, device=device).cumsum(0).int()


def expected(a_mk, b_gkn, sizes_g, first, out_mn) -> torch.Tensor:
    want = out_mn.double().clone()
    ends = torch.tensor(sizes_g).cumsum(0).tolist()
    for g in range(first, len(sizes_g)):
        start = ends[g - 1] if g else 0
        want[start:ends[g]] = a_mk[start:ends[g]].double() @ b_gkn[g - first].double()
    return want


def run_case(sizes_g, first, n, k, device, transposed: bool, out_dtype=torch.bfloat16, row_alignment=1):
    rows = sum(sizes_g) + TAIL
    a_mk = torch.randn(rows, k, device=device).bfloat16()
    groups = len(sizes_g) - first
    if transposed:  # a forward: w [G, n, k] passed as its transpose
        b_gkn = torch.randn(groups, n, k, device=device).bfloat16().transpose(-2, -1)
    else:
        b_gkn = torch.randn(groups, k, n, device=device).bfloat16()
    out_mn = torch.full((rows, n), SENTINEL, device=device, dtype=out_dtype)
    want = expected(a_mk, b_gkn, sizes_g, first, out_mn)
    groups_from_gemm(a_mk, b_gkn, offsets(sizes_g, device), first, out_mn, row_alignment=row_alignment)
    tol = 2 ** -7 if out_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out_mn.double(), want, rtol=tol, atol=tol * k ** 0.5)
    return out_mn


LAYOUTS = {  # sizes, the alignment promised, n, k, and the first computed group of each case
    "masked": (SIZES_G, 1, 40, 48, {"all": 0, "from-3": 3, "middle": 6, "none": 10}),
    # the aligned kernel: each 128-row block in one group, empty groups between
    "aligned": (ALIGNED_G, 128, 48, 80, {"all": 0, "from-3": 3, "middle": 5, "none": 7}),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["all", pytest.param("from-3", marks=pytest.mark.oldest_triton), "middle",
                                  "none"])
@pytest.mark.parametrize("transposed", [False, True], ids=["dgrad", "fwd"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_groups_from_matches_the_reference_and_leaves_earlier_rows(layout, transposed, case):
    """Either kernel (the masked one on unaligned segments, the aligned one on 128-row segments): rows past
    the last end (the tail) and before the first computed group untouched."""
    sizes_g, alignment, n, k, firsts = LAYOUTS[layout]
    first = firsts[case]
    torch.manual_seed(first)
    out = run_case(sizes_g, first, n=n, k=k, device="cpu", transposed=transposed, row_alignment=alignment)
    start = sum(sizes_g[:first])
    assert bool((out[:start] == SENTINEL).all()) and bool((out[-TAIL:] == SENTINEL).all())


@pytest.mark.interpreter
@pytest.mark.oldest_triton
def test_groups_from_writes_fp32():
    torch.manual_seed(1)
    run_case(SIZES_G, 4, n=33, k=20, device="cpu", transposed=True, out_dtype=torch.float32)


@pytest.mark.interpreter
@pytest.mark.oldest_triton
def test_aligned_groups_from_writes_fp32():
    torch.manual_seed(2)
    run_case(ALIGNED_G, 2, n=36, k=40, device="cpu", transposed=False, out_dtype=torch.float32,
             row_alignment=256)


@pytest.mark.interpreter
def test_aligned_groups_from_takes_the_pointer_kernel_where_descriptors_cannot_go(monkeypatch):
    """A weight tensor contiguous in neither layout (a slice of columns) goes to the masked pointer kernel,
    whatever the alignment, and still matches the reference."""
    torch.manual_seed(3)
    rows, n, k = sum(ALIGNED_G), 32, 48
    a_mk = torch.randn(rows, k).bfloat16()
    b_gkn = torch.randn(len(ALIGNED_G), k, 2 * n).bfloat16()[:, :, :n]
    out_mn = torch.full((rows, n), SENTINEL, dtype=torch.bfloat16)
    assert_masked_kernel_matches(monkeypatch, a_mk, b_gkn, out_mn, "weights no descriptor can describe")


@pytest.mark.interpreter
@pytest.mark.parametrize("operand", ["a", "out"])
def test_aligned_groups_from_takes_the_pointer_kernel_off_a_16_byte_boundary(operand, monkeypatch):
    """An operand whose base address is not on a 16-byte boundary (a view starting one element in) cannot be
    a tensor descriptor's: the masked kernel computes it, and the result still matches the reference."""
    torch.manual_seed(4)
    rows, n, k = sum(ALIGNED_G), 32, 48
    wide = torch.randn(rows, k + 8).bfloat16()  # rows of 112 bytes, a 16-byte multiple
    a_mk = wide[:, 1:k + 1] if operand == "a" else wide[:, :k].contiguous()
    b_gkn = torch.randn(len(ALIGNED_G), k, n).bfloat16()
    base = torch.full((rows, n + 8), SENTINEL, dtype=torch.bfloat16)
    out_mn = base[:, 1:n + 1] if operand == "out" else base[:, :n].contiguous()
    assert_masked_kernel_matches(monkeypatch, a_mk, b_gkn, out_mn, "an operand off a 16-byte boundary")


def assert_masked_kernel_matches(monkeypatch, a_mk, b_gkn, out_mn, what: str) -> None:
    """`groups_from_gemm` with 128-row alignment promised on `ALIGNED_G`, the aligned kernel made to fail
    (`what` it must not take): the masked kernel runs and matches the reference."""
    from moonep_moe.gemm.kernels import groups_from

    def refuse(*args, **kwargs):
        raise AssertionError(f"the aligned kernel took {what}")

    monkeypatch.setattr(groups_from, "_groups_from_aligned_kernel", refuse)
    want = expected(a_mk, b_gkn, ALIGNED_G, 0, out_mn)
    groups_from_gemm(a_mk, b_gkn, offsets(ALIGNED_G, "cpu"), 0, out_mn, row_alignment=128)
    k = a_mk.shape[1]
    torch.testing.assert_close(out_mn.double(), want, rtol=2 ** -7, atol=2 ** -7 * k ** 0.5)


def test_groups_from_refuses_a_weight_count_that_does_not_match():
    with pytest.raises(ValueError, match="G - first"):
        rows = torch.zeros(4, 8, dtype=torch.bfloat16)
        groups_from_gemm(rows, torch.zeros(3, 8, 8, dtype=torch.bfloat16),
                         torch.tensor([1, 2, 3, 4], dtype=torch.int32), 2, rows.clone())


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [0.0, 3.0], ids=["uniform", "skewed"])
@pytest.mark.parametrize(("n", "k", "transposed"), [(4096, 7168, True), (7168, 2048, False)],
                         ids=["gate_up-fwd", "down-dgrad"])
def test_groups_from_on_deepseek_shapes(skew, n, k, transposed):
    """32 home groups and 8 slots of one EP=8 rank (65536 routes), sizes uniform or skewed, some empty."""
    torch.manual_seed(0)
    weights = torch.rand(40, dtype=torch.float64) ** (1 + skew)
    sizes = (weights / weights.sum() * 65536).long()
    sizes[[33, 36]] = 0
    out = run_case(sizes.tolist(), 32, n, k, "cuda", transposed)
    assert bool((out[:int(sizes[:32].sum())] == SENTINEL).all())


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k", "transposed"), [(4096, 7168, True), (7168, 2048, False)],
                         ids=["gate_up-fwd", "down-dgrad"])
def test_aligned_groups_from_on_deepseek_shapes(n, k, transposed):
    """The layer's DeepGEMM layout (segments padded to 128 rows): 32 home groups and 8 skewed slots, some
    empty, through the aligned kernel."""
    torch.manual_seed(1)
    weights = torch.rand(40, dtype=torch.float64) ** 4
    sizes = ((weights / weights.sum() * 65536).long() + 127) // 128 * 128
    sizes[[33, 36]] = 0
    out = run_case(sizes.tolist(), 32, n, k, "cuda", transposed, row_alignment=128)
    assert bool((out[:int(sizes[:32].sum())] == SENTINEL).all())
