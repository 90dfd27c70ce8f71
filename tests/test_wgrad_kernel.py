"""The Triton grouped weight gradient against an fp32 reference built from exact bf16 products.

Products of bf16 (or fp16) values are exact in fp32, so the only difference from the float64 reference is
fp32 rounding of the sums: the tolerance is far below one row's contribution, and a row or group taken from
the wrong segment fails. On CPU the kernel runs in Triton's interpreter (small shapes, 32x32 tiles so tails
and several tiles per group are covered); the GPU cases use DeepSeek-V3's expert shapes.
"""

import inspect

import pytest
import torch

from moonep_moe.gemm.kernels import wgrad
from moonep_moe.gemm.kernels.wgrad import TUNING_GROUPS, grouped_wgrad_triton, tuning_ends
from moonep_moe.gemm.reference import ReferenceGroupedGemm
from moonep_moe.gemm.torch_native import TorchGroupedGemm

# empty groups (first, middle, last), 1-row groups, unaligned and large segments
SIZES_G = [0, 1, 37, 0, 70, 1, 150, 17, 0]
TAIL = 5  # rows past the last segment: NaN, never read
N, K = 48, 40  # not multiples of the interpreter's 32-wide tiles
FP32_TOL = dict(rtol=1e-5, atol=1e-4)


def offsets_g(sizes_g: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor(sizes_g, dtype=torch.int32, device=device).cumsum(0).int()


def segments(sizes_g: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(sizes_g).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def random_rows(sizes_g: list[int], n: int, k: int, dtype: torch.dtype, device="cpu", tail: int = TAIL):
    rows = sum(sizes_g) + tail
    dy_mn = torch.randn(rows, n, device=device).to(dtype)
    x_mk = torch.randn(rows, k, device=device).to(dtype)
    dy_mn[rows - tail:], x_mk[rows - tail:] = float("nan"), float("nan")
    return dy_mn, x_mk


def expected_gnk(dy_mn: torch.Tensor, x_mk: torch.Tensor, sizes_g: list[int]) -> torch.Tensor:
    """float64 ``dy[s:e]^T x[s:e]`` per group (zeros for empty groups)."""
    return torch.stack([dy_mn[s:e].double().T @ x_mk[s:e].double() for s, e in segments(sizes_g)])


def split(out_gnk: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    """Separate tensors (clones) holding groups [0, c0), [c0, c1), ...: home gradients, slots, ..."""
    return [part.clone() for part in out_gnk.tensor_split(cuts)]


@pytest.mark.interpreter
@pytest.mark.parametrize(("cuts", "dtype"), [
    ([], torch.bfloat16), ([5], torch.bfloat16), ([0], torch.bfloat16), ([9], torch.bfloat16),
    ([2, 5, 6], torch.bfloat16), pytest.param([5], torch.float16, marks=pytest.mark.oldest_triton),
], ids=["one", "home+slots", "no-home", "no-slots", "four-parts", "home+slots-fp16"])
def test_overwrite_writes_every_group(cuts, dtype):
    dy_mn, x_mk = random_rows(SIZES_G, N, K, dtype)
    parts = split(torch.full((len(SIZES_G), N, K), float("nan")), cuts)
    grouped_wgrad_triton(dy_mn, x_mk, offsets_g(SIZES_G), parts, accumulate=False)
    got_gnk = torch.cat(parts)
    torch.testing.assert_close(got_gnk.double(), expected_gnk(dy_mn, x_mk, SIZES_G), **FP32_TOL)
    for g, (start, end) in enumerate(segments(SIZES_G)):
        if start == end:
            assert not got_gnk[g].any(), f"empty group {g} must be overwritten with zeros"


@pytest.mark.interpreter
@pytest.mark.oldest_triton
@pytest.mark.parametrize(("parts_of", "first_group"), [((5, 4), 0), ((4,), 5)],
                         ids=["home+slots", "slots-only"])
def test_overwrite_stores_nothing_into_unused_slots(parts_of, first_group):
    """From `slot_groups_from` on, an empty group is an unused slot: its gradient keeps what it held (NaN
    here: not one store), while the slots with rows are written and an empty home group gets zeros."""
    dy_mn, x_mk = random_rows(SIZES_G, N, K, torch.bfloat16)
    parts = [torch.full((groups, N, K), float("nan")) for groups in parts_of]
    grouped_wgrad_triton(dy_mn, x_mk, offsets_g(SIZES_G), parts, accumulate=False, first_group=first_group,
                         slot_groups_from=5)
    got_gnk, want_gnk = torch.cat(parts), expected_gnk(dy_mn, x_mk, SIZES_G)[first_group:]
    for i, (start, end) in enumerate(segments(SIZES_G)[first_group:]):
        if start == end and first_group + i >= 5:
            assert got_gnk[i].isnan().all(), f"unused slot group {first_group + i} must not be written"
        else:
            torch.testing.assert_close(got_gnk[i].double(), want_gnk[i], **FP32_TOL)


@pytest.mark.interpreter
@pytest.mark.parametrize("cuts", [[], [5]], ids=["one", "home+slots"])
def test_accumulate_adds_and_leaves_empty_groups_alone(cuts):
    dy_mn, x_mk = random_rows(SIZES_G, N, K, torch.bfloat16)
    before_gnk = torch.randn(len(SIZES_G), N, K)
    parts = split(before_gnk, cuts)
    grouped_wgrad_triton(dy_mn, x_mk, offsets_g(SIZES_G), parts, accumulate=True)
    torch.testing.assert_close(torch.cat(parts).double(),
                               before_gnk.double() + expected_gnk(dy_mn, x_mk, SIZES_G), **FP32_TOL)


@pytest.mark.interpreter
@pytest.mark.oldest_triton
def test_parts_of_different_dtypes():
    """Home gradients in the parameters' dtype (bf16), slot gradients in fp32, in one launch."""
    dy_mn, x_mk = random_rows(SIZES_G, N, K, torch.bfloat16)
    home, slots = torch.zeros(5, N, K, dtype=torch.bfloat16), torch.zeros(4, N, K)
    grouped_wgrad_triton(dy_mn, x_mk, offsets_g(SIZES_G), (home, slots), accumulate=False)
    want_gnk = expected_gnk(dy_mn, x_mk, SIZES_G)
    torch.testing.assert_close(slots.double(), want_gnk[5:], **FP32_TOL)
    # rounded once from fp32 (within one bf16 step: the interpreter truncates, the GPU rounds to nearest)
    torch.testing.assert_close(home.double(), want_gnk[:5], rtol=2**-7, atol=1e-4)


@pytest.mark.interpreter
def test_matches_reference_backend_on_skewed_routing():
    """All rows in one group but a few, fresh data: the reference backend (fp32) agrees."""
    sizes_g = [3, 0, 0, 250, 0, 1]
    dy_mn, x_mk = random_rows(sizes_g, 32, 64, torch.bfloat16)
    got, want = torch.zeros(len(sizes_g), 32, 64), torch.zeros(len(sizes_g), 32, 64)
    grouped_wgrad_triton(dy_mn, x_mk, offsets_g(sizes_g), [got[:2], got[2:]], accumulate=False)
    ReferenceGroupedGemm().wgrad(dy_mn, x_mk, offsets_g(sizes_g), [want], accumulate=False)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.interpreter
@pytest.mark.oldest_triton
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
def test_first_group_computes_only_the_later_groups(accumulate):
    """The slot groups alone (`first_group` = the home groups' count), as `TorchGroupedGemm` runs them when
    `torch._grouped_mm` made the home gradients: the earlier groups' rows are never read (NaN here)."""
    home = 5
    dy_mn, x_mk = random_rows(SIZES_G, N, K, torch.bfloat16)
    home_end = sum(SIZES_G[:home])
    dy_mn[:home_end], x_mk[:home_end] = float("nan"), float("nan")
    start = torch.randn(len(SIZES_G) - home, N, K)
    slots = start.clone()
    grouped_wgrad_triton(dy_mn, x_mk, offsets_g(SIZES_G), [slots], accumulate=accumulate, first_group=home)
    want = expected_gnk(dy_mn, x_mk, SIZES_G)[home:] + (start.double() if accumulate else 0)
    torch.testing.assert_close(slots.double(), want, **FP32_TOL)


@pytest.mark.parametrize(
    ("change", "match"),
    [(dict(dtype=torch.float32), "bfloat16 or float16"), (dict(out_dtype=torch.float64), "every out part"),
     (dict(groups=3), "offs_g"), (dict(transpose_out=True), "contiguous")],
)
def test_bad_arguments_are_rejected(change, match):
    dtype, out_dtype = change.get("dtype", torch.bfloat16), change.get("out_dtype", torch.float32)
    dy_mn, x_mk = torch.zeros(8, N, dtype=dtype), torch.zeros(8, K, dtype=dtype)
    out = torch.zeros(change.get("groups", 2), N, K, dtype=out_dtype)
    if change.get("transpose_out"):
        out = torch.zeros(2, K, N).transpose(1, 2)
    with pytest.raises(ValueError, match=match):
        grouped_wgrad_triton(dy_mn, x_mk, offsets_g([3, 5]), [out], accumulate=False)


@pytest.mark.parametrize("rows", [73_728, 1000, 127])
def test_tuning_ends_deal_the_rows_evenly_in_groups_of_16(rows):
    ends = tuning_ends(rows, "cpu")
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    assert ends.dtype == torch.int32 and ends.numel() == TUNING_GROUPS
    assert bool((sizes == sizes[0]).all()) and int(sizes[0]) % 16 == 0
    assert rows - 16 * TUNING_GROUPS < int(ends[-1]) <= rows


def test_the_first_call_of_a_shape_tunes_on_even_groups_of_every_row_not_on_its_own(monkeypatch):
    """The autotuner times the configs on the launch it first sees: that is the tuning launch (every row of dy
    in even groups, into scratch outputs), not the call's, whose groups may be empty (an unused slot pool)."""
    launches = []
    monkeypatch.setattr(wgrad, "INTERPRETED", False)  # the interpreter skips tuning: one config
    monkeypatch.setattr(wgrad, "_TUNED", set())
    signature = inspect.signature(wgrad._launch)
    monkeypatch.setattr(wgrad, "_launch", lambda *args, **kwargs: launches.append(
        signature.bind(*args, **kwargs).arguments))
    sizes_g = [300, 200, 0, 0, 0]  # the slot groups (from 2 on) all empty
    dy_mn, x_mk = random_rows(sizes_g, N, K, torch.bfloat16)
    home, slots = torch.zeros(2, N, K), torch.zeros(3, N, K, dtype=torch.bfloat16)
    for _ in range(2):
        grouped_wgrad_triton(dy_mn, x_mk, offsets_g(sizes_g), [slots], accumulate=False, first_group=2,
                             slot_groups_from=2)
    tune, call, again = launches
    assert torch.equal(tune["offs_g"], tuning_ends(dy_mn.shape[0], "cpu"))
    assert tune["out0"] is not slots and tune["out0"].dtype == tune["out1"].dtype == torch.bfloat16
    assert [tune[k] for k in ("groups", "groups0", "first_group", "accumulate", "zeroed_groups")] == [
        TUNING_GROUPS, TUNING_GROUPS - 1, 0, False, TUNING_GROUPS]  # every group, overwriting
    assert call["out0"] is slots and call["first_group"] == 2 and again["out0"] is slots  # tuned once
    launches.clear()
    grouped_wgrad_triton(dy_mn, x_mk, offsets_g(sizes_g), [home, slots], accumulate=True)
    assert len(launches) == 2 and launches[0]["out0"].dtype == torch.float32  # fp32 outputs: a key of its own


DSV3_H, DSV3_F = 7168, 2048


@pytest.mark.gpu
@pytest.mark.parametrize("sizes_g", [[256] * 6, [0, 1, 2048, 0, 129, 7], [0] * 6], ids=["uniform", "skewed",
                                                                                      "empty"])
@pytest.mark.parametrize(("n", "k"), [(2 * DSV3_F, DSV3_H), (DSV3_H, DSV3_F)], ids=["gate_up", "down"])
def test_gpu_dsv3_shapes_match_fp32_reference_and_torch(sizes_g, n, k):
    cuda = torch.device("cuda")
    dy_mn, x_mk = random_rows(sizes_g, n, k, torch.bfloat16, device=cuda, tail=64)
    offs_g = offsets_g(sizes_g, cuda)
    got = torch.full((len(sizes_g), n, k), float("nan"), device=cuda)
    grouped_wgrad_triton(dy_mn, x_mk, offs_g, [got[:4], got[4:]], accumulate=False)
    for g, (start, end) in enumerate(segments(sizes_g)):
        want_nk = dy_mn[start:end].double().T @ x_mk[start:end].double()
        torch.testing.assert_close(got[g].double(), want_nk, rtol=1e-5, atol=1e-3)
    rows = sum(sizes_g)
    dy_mn[rows:], x_mk[rows:] = 0, 0  # torch._grouped_mm is given no NaN tail to compare against
    torch_gnk = torch.zeros_like(got)
    TorchGroupedGemm().wgrad(dy_mn, x_mk, offs_g, [torch_gnk], accumulate=False)
    torch.testing.assert_close(got, torch_gnk, rtol=1e-2, atol=1e-1)  # torch rounds each product to bf16


@pytest.mark.gpu
def test_gpu_accumulate_first_call_autotunes_without_adding_twice():
    """The first call of a new shape autotunes; in accumulate mode the timing runs must not add into the
    gradients (pre/post hooks restore them): the result is the initial value plus one product."""
    cuda = torch.device("cuda")
    sizes_g, n, k = [128, 0, 77, 300], 384, 640  # a shape no other test autotunes
    dy_mn, x_mk = random_rows(sizes_g, n, k, torch.bfloat16, device=cuda)
    before = torch.randn(len(sizes_g), n, k, device=cuda)
    home, slots = before[:1].clone(), before[1:].to(torch.bfloat16)
    grouped_wgrad_triton(dy_mn, x_mk, offsets_g(sizes_g, cuda), [home, slots], accumulate=True)
    want = before.double() + expected_gnk(dy_mn, x_mk, sizes_g)
    torch.testing.assert_close(home.double(), want[:1], rtol=1e-5, atol=1e-3)
    want_slots = (before[1:].to(torch.bfloat16).double() + want[1:] - before[1:].double()).to(torch.bfloat16)
    torch.testing.assert_close(slots, want_slots, rtol=2e-2, atol=2e-2)
