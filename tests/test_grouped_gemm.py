"""Every grouped-GEMM backend against a float64 dense per-group matmul; the selection rules."""

import pytest
import torch

from moonep_moe.layers.grouped_gemm import (
    ReferenceGroupedGemm,
    TorchGroupedGemm,
    select_grouped_gemm,
)

CPU = torch.device("cpu")
# Segment sizes: empty groups (first, middle, last), a 1-row group and large ones; 7 unused tail rows.
SIZES_G = [0, 1, 37, 0, 120, 1, 64, 0]
TAIL = 7
M, N, K = sum(SIZES_G) + TAIL, 32, 16
HOME = 5  # groups [0, HOME) are "home experts", the rest "prefetch slots"

CASES = [
    (ReferenceGroupedGemm(), torch.float64),
    (ReferenceGroupedGemm(), torch.float32),
    (ReferenceGroupedGemm(), torch.bfloat16),
    (TorchGroupedGemm(), torch.float32),
    (TorchGroupedGemm(), torch.bfloat16),
    (TorchGroupedGemm(), torch.float16),
]
IDS = [f"{gemm.name}-{dtype}" for gemm, dtype in CASES]
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
    torch.float16: dict(rtol=2e-3, atol=5e-3),
}


def offsets_g() -> torch.Tensor:
    return torch.tensor(SIZES_G, dtype=torch.int32).cumsum(0).int()


def segments() -> list[tuple[int, int]]:
    ends = offsets_g().tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def random_inputs(dtype: torch.dtype, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Fresh random tensors; rows past the last segment are NaN, which no valid output row may see."""
    tensors = [torch.randn(shape, dtype=torch.float64).to(dtype) for shape in shapes]
    for t in tensors:
        if t.shape[0] == M:
            t[M - TAIL :] = float("nan")
    return tensors


def weight_parts(w_gnk: torch.Tensor, split: bool) -> list[torch.Tensor]:
    """The weights as one tensor, or as separate (home, slots) tensors."""
    return [w_gnk[:HOME].clone(), w_gnk[HOME:].clone()] if split else [w_gnk]


@pytest.mark.parametrize("split", [False, True], ids=["one", "home+slots"])
@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_fwd_and_dgrad_match_dense(gemm, dtype, split):
    x_mk, dy_mn, w_gnk = random_inputs(dtype, (M, K), (M, N), (len(SIZES_G), N, K))
    y_mn = gemm.fwd(x_mk, weight_parts(w_gnk, split), offsets_g())
    dx_mk = gemm.dgrad(dy_mn, weight_parts(w_gnk, split), offsets_g())
    assert y_mn.shape == (M, N) and y_mn.dtype == dtype
    assert dx_mk.shape == (M, K) and dx_mk.dtype == dtype
    for g, (start, end) in enumerate(segments()):
        x, dy, w = x_mk[start:end].double(), dy_mn[start:end].double(), w_gnk[g].double()
        torch.testing.assert_close(y_mn[start:end].double(), x @ w.T, **TOL[dtype])
        torch.testing.assert_close(dx_mk[start:end].double(), dy @ w, **TOL[dtype])


@pytest.mark.parametrize("split", [False, True], ids=["one", "home+slots"])
@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_wgrad_accumulates(gemm, dtype, split):
    x_mk, dy_mn = random_inputs(dtype, (M, K), (M, N))
    grad_dtype = torch.promote_types(dtype, torch.float32)
    out_gnk = torch.zeros(len(SIZES_G), N, K, dtype=grad_dtype)
    parts = weight_parts(out_gnk, split)
    gemm.wgrad(dy_mn, x_mk, offsets_g(), parts)
    gemm.wgrad(dy_mn, x_mk, offsets_g(), parts)
    got_gnk = torch.cat(parts)
    for g, (start, end) in enumerate(segments()):
        expected_nk = 2 * dy_mn[start:end].double().T @ x_mk[start:end].double()
        torch.testing.assert_close(got_gnk[g].double(), expected_nk, **TOL[dtype])
        if start == end:
            assert not got_gnk[g].any(), "an empty group must get a zero gradient"


@pytest.mark.parametrize(("gemm", "dtype"), CASES, ids=IDS)
def test_wgrad_overwrite_replaces_whatever_was_there(gemm, dtype):
    x_mk, dy_mn = random_inputs(dtype, (M, K), (M, N))
    grad_dtype = torch.promote_types(dtype, torch.float32)
    parts = weight_parts(torch.full((len(SIZES_G), N, K), float("nan"), dtype=grad_dtype), split=True)
    gemm.wgrad(dy_mn, x_mk, offsets_g(), parts, accumulate=False)
    got_gnk = torch.cat(parts)
    for g, (start, end) in enumerate(segments()):
        expected_nk = dy_mn[start:end].double().T @ x_mk[start:end].double()
        torch.testing.assert_close(got_gnk[g].double(), expected_nk, **TOL[dtype])


@pytest.mark.parametrize("gemm", [ReferenceGroupedGemm(), TorchGroupedGemm()], ids=lambda g: g.name)
def test_group_count_mismatch_is_rejected(gemm):
    x_mk, w_gnk = torch.randn(M, K), torch.randn(len(SIZES_G) - 1, N, K)
    with pytest.raises(ValueError, match="offs_g"):
        gemm.fwd(x_mk, [w_gnk], offsets_g())


def test_select_reference_runs_anything():
    assert select_grouped_gemm("reference", CPU, torch.float64).name == "reference"
    assert select_grouped_gemm("reference", CPU, torch.bfloat16, k=3).name == "reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_select_torch_where_supported(dtype):
    assert select_grouped_gemm("torch", CPU, dtype, k=64).name == "torch"
    assert select_grouped_gemm("auto", CPU, dtype, k=64).name == "torch"


@pytest.mark.parametrize(
    ("dtype", "k", "reason"),
    [(torch.float64, 64, "supports"), (torch.bfloat16, 4, "16 bytes"), (torch.float32, 6, "16 bytes")],
)
def test_select_torch_unsupported(dtype, k, reason):
    with pytest.raises(ValueError, match=f"grouped_gemm='torch'.*{reason}"):
        select_grouped_gemm("torch", CPU, dtype, k=k)
    assert select_grouped_gemm("auto", CPU, dtype, k=k).name == "reference"


def test_select_bad_names():
    with pytest.raises(ValueError, match="grouped_gemm='deep_gemm' cannot run here: DeepGEMM runs bf16"):
        select_grouped_gemm("deep_gemm", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="grouped_gemm must be one of"):
        select_grouped_gemm("cublas", CPU, torch.bfloat16)


def _deep_gemm_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        select_grouped_gemm("deep_gemm", torch.device("cuda"), torch.bfloat16, token_padding=128)
    except ValueError:
        return False
    return True


@pytest.mark.skipif(not _deep_gemm_available(), reason="needs DeepGEMM on a Hopper GPU (run on the H200)")
@pytest.mark.parametrize("sizes_g", [[0, 128, 0, 384, 128, 0], [0] * 4 + [1024] + [0] * 3, [128] * 6])
def test_deep_gemm_matches_reference_on_128_aligned_segments(sizes_g):
    """fwd and dgrad on DeepGEMM (psum layout: the padded ends straight from the device), wgrad on torch,
    with empty, tiny and huge segments and (home, slots) weight pairs, against the reference on fresh data."""
    cuda = torch.device("cuda")
    deep = select_grouped_gemm("deep_gemm", cuda, torch.bfloat16, token_padding=128)
    ref = ReferenceGroupedGemm()
    offs_g = torch.tensor(sizes_g, dtype=torch.int32, device=cuda).cumsum(0).int()
    rows, n, k, home = int(offs_g[-1]) + 64, 256, 384, 2
    x_mk = torch.randn(rows, k, device=cuda, dtype=torch.bfloat16)
    dy_mn = torch.randn(rows, n, device=cuda, dtype=torch.bfloat16)
    w_gnk = torch.randn(len(sizes_g), n, k, device=cuda, dtype=torch.bfloat16) / k**0.5
    weights = (w_gnk[:home], w_gnk[home:])
    used = int(offs_g[-1])
    for got, want in ((deep.fwd(x_mk, weights, offs_g), ref.fwd(x_mk, weights, offs_g)),
                      (deep.dgrad(dy_mn, weights, offs_g), ref.dgrad(dy_mn, weights, offs_g))):
        error = float((got[:used].float() - want[:used].float()).norm() / want[:used].float().norm())
        assert error < 1e-2, error
