"""FP8 experts (`moonep_moe.gemm.fp8`, `moonep_moe.fp8.cast`): the e4m3 formats, the
reference quantisers against float64, the Triton casts bit for bit against the reference (interpreted on the
CPU, compiled on a GPU), the weight cache's host-side logic, the config, and on an H200 the FP8 backend and
an FP8 layer against the float64 reference.

Error bounds, derived from the format (not tuned): e4m3 keeps 3 mantissa bits, so the step between
neighbours is 2^-3 of the binade's lower end and round-to-nearest is off by at most half a step, 2^-4 of |x|,
for scaled values ``|x / s| >= 2^-6`` (the smallest normal); below it the step is the subnormal 2^-9, so the
error is at most ``2^-10 s``. Scales are powers of two, so scaling itself adds no error.
"""

from __future__ import annotations

import collections

import pytest
import torch
from test_layer import build_layer, make_config, make_problem, run_dense, run_moonep
from test_plan_kernel import KERNEL_DEVICE

from moonep_moe.config import MoEConfig
from moonep_moe.fp8 import format as fp8_format
from moonep_moe.fp8.format import (
    E4M3_MAX,
    FP8_DTYPE,
    TILE,
    dequantise_blocks,
    dequantise_rows,
    pow2_scales,
    quantise_blocks,
    quantise_rows,
    to_deep_gemm_row_scales,
    transpose_blocks,
)
from moonep_moe.gemm import deep_gemm, fp8, registry
from moonep_moe.gemm.fp8 import Fp8GroupedGemm, Fp8WeightCache
from moonep_moe.gemm.reference import ReferenceGroupedGemm
from moonep_moe.gemm.registry import fp8_grouped_gemm
from moonep_moe.gemm.torch_native import TorchGroupedGemm
from moonep_moe.layers.moe import MoonEPMoELayer

F64 = torch.float64
HALF_STEP = 2.0**-4
"""e4m3's rounding error relative to |x| in the normal range: half of the 2^-3 step (3 mantissa bits)."""
SUBNORMAL_HALF_STEP = 2.0**-10
"""e4m3's rounding error below 2^-6, relative to the scale: half of the subnormal step 2^-9."""


def spread(*shape: int, seed: int = 0) -> torch.Tensor:
    """fp32-exact float64 values over 20 binades (so tiles mix normal and subnormal e4m3), random signs."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.rand(*shape, generator=gen, dtype=F64) * 20 - 10)
    return (magnitude * torch.randn(*shape, generator=gen, dtype=F64).sign()).float().double()


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# -- formats and the reference quantisers -------------------------------------------------------------------


def test_pow2_scales_are_the_smallest_power_of_two_that_fits():
    amax = torch.tensor([448.0, 449.0, 224.0, 225.0, 1.0, 3e-5, 7e4, 0.0, 2.0**-120], dtype=torch.float32)
    scales = pow2_scales(amax)
    expected = [1.0, 2.0, 0.5, 1.0, 2.0**-8, 2.0**-23, 256.0, 2.0**-108, 2.0**-108]
    assert scales.tolist() == expected
    amax = spread(10_000).abs().float()
    scales = pow2_scales(amax)
    assert (scales.view(torch.int32) & 0x7FFFFF).eq(0).all(), "powers of two"
    assert (amax / scales <= E4M3_MAX).all() and (amax / scales > E4M3_MAX / 2).all(), "smallest such"


@pytest.mark.parametrize("rows,k", [(1, 1), (37, 300), (130, 128), (5, 7 * 128 + 5)])
def test_quantise_rows_error_within_half_an_e4m3_step(rows, k):
    x = spread(rows, k)
    q, scales = quantise_rows(x)
    assert q.dtype == FP8_DTYPE and q.shape == (rows, k)
    assert scales.dtype == torch.float32 and scales.shape == (rows, -(-k // TILE))
    scale_mk = scales.double().repeat_interleave(TILE, dim=1)[:, :k]
    bound = torch.maximum(HALF_STEP * x.abs(), SUBNORMAL_HALF_STEP * scale_mk)
    assert ((dequantise_rows(q, scales) - x).abs() <= bound).all()
    tile_amax = torch.nn.functional.pad(x.abs(), (0, -k % TILE)).view(rows, -1, TILE).amax(-1)
    assert ((tile_amax / scales.double()) > E4M3_MAX / 2).all(), "each tile's amax lands in the top binade"


@pytest.mark.parametrize("g,n,k", [(1, 1, 1), (3, 200, 300), (2, 256, 128), (1, 129, 385)])
def test_quantise_blocks_error_within_half_an_e4m3_step(g, n, k):
    w = spread(g, n, k, seed=1)
    q, scales = quantise_blocks(w)
    assert q.shape == (g, n, k) and scales.shape == (g, -(-n // TILE), -(-k // TILE))
    scale_gnk = scales.double().repeat_interleave(TILE, 1).repeat_interleave(TILE, 2)[:, :n, :k]
    bound = torch.maximum(HALF_STEP * w.abs(), SUBNORMAL_HALF_STEP * scale_gnk)
    assert ((dequantise_blocks(q, scales) - w).abs() <= bound).all()
    q_t, scales_t = transpose_blocks(q, scales)
    assert q_t.is_contiguous() and torch.equal(bits(q_t), bits(q.transpose(1, 2)))
    assert scales_t.shape == (g, -(-k // TILE), -(-n // TILE)) and scales_t.stride(1) == 1
    torch.testing.assert_close(dequantise_blocks(q_t, scales_t), dequantise_blocks(q, scales).transpose(1, 2),
                               rtol=0, atol=0)


def test_quantise_is_exact_on_e4m3_values_and_rounds_midpoints_to_even():
    """Every finite e4m3 value (times a power-of-two scale) comes back exactly; every midpoint between two
    neighbours goes to the one with an even mantissa (round to nearest even)."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).double()  # 0 .. 448, every value
    mids = (values[:-1] + values[1:]) / 2
    x = torch.cat([values, -values, mids]).view(1, -1) * 2.0**-5  # one tile per 128 values; each has 448
    x = torch.nn.functional.pad(x, (0, -x.shape[1] % TILE)).view(-1, TILE)
    x[:, 0] = E4M3_MAX * 2.0**-5
    q, scales = quantise_rows(x)
    assert (scales == 2.0**-5).all()
    got = dequantise_rows(q, scales).flatten()
    flat = x.flatten()
    exact = torch.isin(flat.abs(), values * 2.0**-5)
    assert torch.equal(got[exact], flat[exact])
    even = bits(q).flatten()[~exact] & 1
    assert (even == 0).all(), "midpoints round to the even neighbour"


def test_deep_gemm_row_scale_layout():
    """Scales in another layout are copied into DeepGEMM's; scales already in it (as the casts write them)
    are handed on as they are, unless their start is not 16-byte aligned (TMA's)."""
    scales = torch.rand(7, 3)
    laid = to_deep_gemm_row_scales(scales)
    assert torch.equal(laid, scales) and laid.stride() == (1, 8)
    assert to_deep_gemm_row_scales(laid) is laid
    shifted = torch.rand(1 + 3 * 8)[1:].as_strided((7, 3), (1, 8))
    again = to_deep_gemm_row_scales(shifted)
    assert again.data_ptr() != shifted.data_ptr() and torch.equal(again, shifted) and again.stride() == (1, 8)


# -- the Triton casts, bit for bit against the reference ---------------------------------------------------


@pytest.mark.oldest_triton
@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,k", [(1, 1), (37, 300), (130, 128), (64, 7 * 128 + 5)])
def test_cast_rows_matches_reference_bit_for_bit(rows, k, dtype, num_warps):
    from moonep_moe.fp8.cast import cast_rows

    x = spread(rows, k, seed=2).to(dtype)
    offs_g = torch.tensor([0, rows, rows], dtype=torch.int32)  # an empty group, then all rows
    q, scales = cast_rows(x.to(KERNEL_DEVICE), offs_g.to(KERNEL_DEVICE), num_warps)
    want_q, want_scales = quantise_rows(x)
    assert scales.stride() == (1, fp8_format.tma_aligned_rows(rows)), "DeepGEMM's sm90 SFA layout"
    assert torch.equal(bits(q.cpu()), bits(want_q))
    assert torch.equal(scales.cpu(), want_scales)


def test_cast_rows_writes_only_rows_below_the_last_segment_end():
    """Rows at and past offs_g[-1] (unused capacity, here 2^77: a cast would give them the scale 2^69) are
    skipped a whole block at a time, without a host read, and do not disturb the rows below."""
    from moonep_moe.fp8 import cast as fp8_cast

    rows, used = 4 * fp8_cast.BLOCK_ROWS, 2 * fp8_cast.BLOCK_ROWS
    x = spread(rows, 256, seed=3).to(torch.bfloat16)
    x[used:] = 2.0**77
    offs_g = torch.tensor([used // 2, used], dtype=torch.int32, device=KERNEL_DEVICE)
    q, scales = fp8_cast.cast_rows(x.to(KERNEL_DEVICE), offs_g)
    want_q, want_scales = quantise_rows(x[:used])
    assert torch.equal(bits(q[:used].cpu()), bits(want_q))
    assert torch.equal(scales[:used].cpu(), want_scales)
    assert not (scales[used:] == 2.0**69).all(), "the rows past the end were cast"


@pytest.mark.oldest_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,k", [(1, 1), (37, 300), (130, 128), (64, 7 * 128 + 5)])
def test_dequantise_rows_matches_reference_bit_for_bit(rows, k, dtype):
    """The Triton dequantisation equals the torch one bit for bit, from the operands a layer gives it: views
    of packed rows as a dispatch receives them (row stride wider than K, scales strided alike), and from
    `cast_rows`' contiguous rows with MN-major scales."""
    from moonep_moe.fp8 import cast as fp8_cast
    from moonep_moe.fp8.wire import pack_rows, unpack_rows

    q, scales = quantise_rows(spread(rows, k, seed=5))
    want = dequantise_rows(q, scales, dtype)
    offs_g = torch.tensor([0, rows], dtype=torch.int32, device=KERNEL_DEVICE)
    packed = unpack_rows(pack_rows(q, scales).to(KERNEL_DEVICE), k)
    laid_out = (q.to(KERNEL_DEVICE), to_deep_gemm_row_scales(scales).to(KERNEL_DEVICE))
    for q_mk, scales_mk in (packed, laid_out):
        got = fp8_cast.dequantise_rows(q_mk, scales_mk, offs_g, dtype)
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got.cpu(), want)


def test_dequantise_rows_writes_only_rows_below_the_last_segment_end():
    from moonep_moe.fp8 import cast as fp8_cast

    rows, used = 4 * fp8_cast.BLOCK_ROWS, 2 * fp8_cast.BLOCK_ROWS
    q, scales = quantise_rows(spread(rows, 256, seed=6))
    offs_g = torch.tensor([used // 2, used], dtype=torch.int32, device=KERNEL_DEVICE)
    out = fp8_cast.dequantise_rows(q.to(KERNEL_DEVICE), scales.to(KERNEL_DEVICE), offs_g)
    assert torch.equal(out[:used].cpu(), dequantise_rows(q[:used], scales[:used], torch.bfloat16))
    want_past = dequantise_rows(q[used:], scales[used:], torch.bfloat16)
    assert not torch.equal(out[used:].cpu(), want_past), "the rows past the end were dequantised"


def test_dequantise_rows_refuses_what_it_cannot_read():
    from moonep_moe.fp8 import cast as fp8_cast

    q, scales = quantise_rows(spread(4, 256, seed=7))
    offs_g = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be torch.float8_e4m3fn rows with contiguous columns"):
        fp8_cast.dequantise_rows(q.t(), scales, offs_g)
    with pytest.raises(ValueError, match=r"scales must be float32 \[4, 2\], got torch.float32 \[4, 3\]"):
        fp8_cast.dequantise_rows(q, torch.ones(4, 3), offs_g)


@pytest.mark.oldest_triton
@pytest.mark.parametrize("num_warps", [4, 8, 16])
@pytest.mark.parametrize("g,n,k", [(1, 1, 1), (3, 200, 300), (2, 256, 128), (1, 129, 385)])
def test_cast_blocks_matches_reference_bit_for_bit(g, n, k, num_warps):
    """Both orientations and the scales, written into a group range of larger buffers (as the weight cache
    does), from a non-contiguous input, at every warp count `bench.fp8_cast` times."""
    from moonep_moe.fp8.cast import cast_blocks

    w = spread(g, k, n, seed=4).to(torch.bfloat16).transpose(1, 2)  # [g, n, k], not contiguous
    dev = KERNEL_DEVICE
    q = torch.zeros(g + 2, n, k, dtype=torch.uint8, device=dev).view(FP8_DTYPE)
    qt = torch.zeros(g + 2, k, n, dtype=torch.uint8, device=dev).view(FP8_DTYPE)
    scales = torch.zeros(g + 2, -(-n // TILE), -(-k // TILE), device=dev)
    cast_blocks(w.to(dev), scales[1:g + 1], q[1:g + 1], qt[1:g + 1], num_warps=num_warps)
    want_q, want_scales = quantise_blocks(w)
    want_qt, _ = transpose_blocks(want_q, want_scales)
    assert torch.equal(bits(q[1:g + 1].cpu()), bits(want_q))
    assert torch.equal(scales[1:g + 1].cpu(), want_scales)
    assert torch.equal(bits(qt[1:g + 1].cpu()), bits(want_qt))
    for buffer in (q, qt, scales):
        assert not buffer[0].float().any() and not buffer[-1].float().any(), "nothing outside the range"


@pytest.mark.oldest_triton
@pytest.mark.parametrize("first_group", [0, 2])
def test_cast_blocks_skips_the_groups_of_empty_segments(first_group):
    """With the GEMM's segment ends, a group whose segment is empty is not written (its blocks keep what
    they held, a sentinel here); the others are cast bit for bit. `first_group`: where the weights' group 0
    sits among the GEMM's groups (the slots after the home experts)."""
    from moonep_moe.fp8.cast import cast_blocks

    w = spread(4, 200, 300, seed=18).to(torch.bfloat16).to(KERNEL_DEVICE)
    rows = [128] * first_group + [0, 128, 0, 256]  # the GEMM's groups: those before w's, then w's four
    offs_g = torch.tensor(rows).cumsum(0).to(torch.int32).to(KERNEL_DEVICE)
    q = torch.full((4, 200, 300), 0x11, dtype=torch.uint8, device=KERNEL_DEVICE).view(FP8_DTYPE)
    qt = torch.full((4, 300, 200), 0x11, dtype=torch.uint8, device=KERNEL_DEVICE).view(FP8_DTYPE)
    scales = torch.full((4, 2, 3), 7.0, device=KERNEL_DEVICE)
    cast_blocks(w, scales, q, qt, offs_g=offs_g, first_group=first_group)
    want_q, want_scales = quantise_blocks(w.cpu())
    want_qt, _ = transpose_blocks(want_q, want_scales)
    for g, used in enumerate(r > 0 for r in rows[first_group:]):
        if used:
            assert torch.equal(bits(q[g].cpu()), bits(want_q[g]))
            assert torch.equal(bits(qt[g].cpu()), bits(want_qt[g]))
            assert torch.equal(scales[g].cpu(), want_scales[g])
        else:
            assert (bits(q[g]) == 0x11).all() and (bits(qt[g]) == 0x11).all() and (scales[g] == 7.0).all()


@pytest.mark.oldest_triton
def test_cast_blocks_writes_one_orientation_when_asked():
    from moonep_moe.fp8.cast import cast_blocks

    w = spread(2, 130, 260, seed=5).to(torch.bfloat16).to(KERNEL_DEVICE)
    scales = torch.empty(2, 2, 3, device=KERNEL_DEVICE)
    qt = torch.zeros(2, 260, 130, dtype=torch.uint8, device=KERNEL_DEVICE).view(FP8_DTYPE)
    cast_blocks(w, scales, None, qt)
    want_q, want_scales = quantise_blocks(w.cpu())
    assert torch.equal(bits(qt.cpu()), bits(transpose_blocks(want_q, want_scales)[0]))
    with pytest.raises(ValueError, match="q_out must be a contiguous"):
        cast_blocks(w, scales, qt)
    with pytest.raises(ValueError, match="needs q_out, qt_out or both"):
        cast_blocks(w, scales)


# -- the weight cache (host-side logic; the casts interpreted on the CPU) ----------------------------------


class CountingCasts:
    """Wraps `fp8_cast.cast_blocks` and records, per call, the input and which orientations were written."""

    def __init__(self, monkeypatch):
        from moonep_moe.fp8 import cast as fp8_cast

        self.calls: list[tuple[torch.Tensor, bool, bool]] = []
        real = fp8_cast.cast_blocks

        def counted(w, scales_out, q_out=None, qt_out=None, **skip):
            self.calls.append((w, q_out is not None, qt_out is not None))
            real(w, scales_out, q_out, qt_out, **skip)

        monkeypatch.setattr(fp8_cast, "cast_blocks", counted)


def test_weight_cache_casts_a_parameter_once_per_version_in_each_orientation(monkeypatch):
    """A parameter's forward and transposed copies are each cast once and kept; after an in-place change
    (its version moves) the next use casts both stale copies in one pass, and the other orientation's use
    after it casts nothing."""
    casts = CountingCasts(monkeypatch)
    home = torch.nn.Parameter(spread(2, 130, 260, seed=6).to(torch.bfloat16).to(KERNEL_DEVICE))
    cache = Fp8WeightCache()
    for _ in range(3):  # micro-batches: forward, then backward
        q, scales = cache.get((home,), transposed=False)
        qt, scales_t = cache.get((home,), transposed=True)
    assert [(q, qt) for _, q, qt in casts.calls] == [(True, False), (False, True)], "each orientation, once"
    want_q, want_scales = quantise_blocks(home.detach().cpu())
    assert torch.equal(bits(q.cpu()), bits(want_q)) and torch.equal(scales.cpu(), want_scales)
    want_qt, want_scales_t = transpose_blocks(want_q, want_scales)
    assert torch.equal(bits(qt.cpu()), bits(want_qt)) and torch.equal(scales_t.cpu(), want_scales_t)
    with torch.no_grad():
        home.mul_(-2)  # a load_state_dict or any in-place op: the version moves
    q, scales = cache.get((home,), transposed=False)
    qt, scales_t = cache.get((home,), transposed=True)
    assert [(q, qt) for _, q, qt in casts.calls[2:]] == [(True, True)], "both stale copies in one pass"
    want_q, want_scales = quantise_blocks(home.detach().cpu())
    assert torch.equal(bits(q.cpu()), bits(want_q)) and torch.equal(scales.cpu(), want_scales)
    want_qt, want_scales_t = transpose_blocks(want_q, want_scales)
    assert torch.equal(bits(qt.cpu()), bits(want_qt)) and torch.equal(scales_t.cpu(), want_scales_t)
    with torch.no_grad():
        home.add_(1)  # the transposed orientation asked for first: the same pass, the forward copy too
    qt, scales_t = cache.get((home,), transposed=True)
    q, scales = cache.get((home,), transposed=False)
    assert [(q, qt) for _, q, qt in casts.calls[3:]] == [(True, True)]
    want_q, want_scales = quantise_blocks(home.detach().cpu())
    assert torch.equal(bits(q.cpu()), bits(want_q)) and torch.equal(scales.cpu(), want_scales)
    want_qt, want_scales_t = transpose_blocks(want_q, want_scales)
    assert torch.equal(bits(qt.cpu()), bits(want_qt)) and torch.equal(scales_t.cpu(), want_scales_t)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_weight_cache_casts_again_after_every_optimizer_step(monkeypatch, fused):
    """An optimizer step makes the kept copies stale, also where it leaves the parameter's version alone
    (a fused AdamW writes the parameters without moving ``._version``): the next call casts the new values
    (checked against a fresh cast, so a stale copy fails)."""
    casts = CountingCasts(monkeypatch)
    home = torch.nn.Parameter(spread(2, 128, 256, seed=16).to(torch.bfloat16).to(KERNEL_DEVICE))
    optimizer = torch.optim.AdamW([home], lr=0.5, fused=fused, foreach=not fused)
    cache = Fp8WeightCache()
    for step in range(2):
        q, scales = cache.get((home,), transposed=False)
        want_q = quantise_blocks(home.detach().cpu())[0]
        assert torch.equal(bits(q.cpu()), bits(want_q)), f"step {step}: a stale copy"
        home.grad = spread(2, 128, 256, seed=17 + step).to(torch.bfloat16).to(KERNEL_DEVICE)
        optimizer.step()
    assert len(casts.calls) == 2, "one cast per optimizer step"


def test_weight_cache_recasts_other_parts_every_call_into_one_joined_copy(monkeypatch):
    """(home parameter, slots): the slots (rewritten by every prefetch, without a version bump) are cast on
    every call into the same joined buffer as the kept home groups, in each orientation."""
    casts = CountingCasts(monkeypatch)
    home = torch.nn.Parameter(spread(2, 128, 256, seed=7).to(torch.bfloat16).to(KERNEL_DEVICE))
    slots = spread(1, 128, 256, seed=8).to(torch.bfloat16).to(KERNEL_DEVICE)
    cache = Fp8WeightCache()
    first, _ = cache.get((home, slots), transposed=False)
    slots.copy_(spread(1, 128, 256, seed=9))
    q, scales = cache.get((home, slots), transposed=False)
    assert q.data_ptr() == first.data_ptr(), "the same joined copy"
    assert [(w is home, q, qt) for w, q, qt in casts.calls] == [
        (True, True, False), (False, True, False), (False, True, False)]
    want_q, want_scales = quantise_blocks(torch.cat([home.detach(), slots]).cpu())
    assert torch.equal(bits(q.cpu()), bits(want_q)) and torch.equal(scales.cpu(), want_scales)
    qt, _ = cache.get((home, slots), transposed=True)
    assert [(w is home, q, qt) for w, q, qt in casts.calls[3:]] == [(True, False, True), (False, False, True)]
    assert torch.equal(bits(qt.cpu()), bits(transpose_blocks(want_q, want_scales)[0]))


def test_weight_cache_casts_only_the_slots_a_call_gives_rows(monkeypatch):
    """Given the GEMM's segment ends, the slots (cast every call) are cast only where their segment has
    rows: the kept home groups and the used slot are the fresh cast's bits, an unused slot keeps what it
    held (no GEMM reads it)."""
    home = torch.nn.Parameter(spread(2, 128, 256, seed=19).to(torch.bfloat16).to(KERNEL_DEVICE))
    slots = spread(2, 128, 256, seed=20).to(torch.bfloat16).to(KERNEL_DEVICE)
    cache = Fp8WeightCache()
    first, _ = cache.get((home, slots), transposed=False)
    before = bits(first[3].clone())
    slots.copy_(spread(2, 128, 256, seed=21))
    offs_g = torch.tensor([128, 128, 256, 256], dtype=torch.int32, device=KERNEL_DEVICE)  # home 1 empty too
    q, scales = cache.get((home, slots), transposed=False, offs_g=offs_g)
    want_q, want_scales = quantise_blocks(torch.cat([home.detach(), slots]).cpu())
    assert torch.equal(bits(q[:3].cpu()), bits(want_q[:3])) and torch.equal(scales[:3].cpu(), want_scales[:3])
    assert torch.equal(bits(q[3]), before), "the unused slot is not cast"


def test_weight_cache_keeps_nothing_without_parameters(monkeypatch):
    """Weights that are no parameter (nothing says when they change) are cast on every call into fresh
    buffers, and nothing is kept."""
    casts = CountingCasts(monkeypatch)
    weights = spread(2, 128, 256, seed=12).to(torch.bfloat16).to(KERNEL_DEVICE)
    cache = Fp8WeightCache()
    first, _ = cache.get((weights,), transposed=False)
    second, scales = cache.get((weights,), transposed=False)
    assert second.data_ptr() != first.data_ptr(), "a fresh buffer (a kept copy would come back)"
    assert len(casts.calls) == 2 and not any(cache._copies.values()), "nothing kept"
    want_q, want_scales = quantise_blocks(weights.cpu())
    assert torch.equal(bits(second.cpu()), bits(want_q)) and torch.equal(scales.cpu(), want_scales)


def test_weight_cache_rebuilds_for_another_sequence(monkeypatch):
    """The same first part with other parts (e.g. slots of another shape) is another joined copy."""
    casts = CountingCasts(monkeypatch)
    home = torch.nn.Parameter(spread(1, 128, 128, seed=10).to(torch.bfloat16).to(KERNEL_DEVICE))
    slots = spread(2, 128, 128, seed=11).to(torch.bfloat16).to(KERNEL_DEVICE)
    cache = Fp8WeightCache()
    assert cache.get((home,), transposed=False)[0].shape[0] == 1
    q, _ = cache.get((home, slots), transposed=False)
    assert q.shape[0] == 3 and len(casts.calls) == 3, "home cast again into the new copy, then the slots"


def test_weight_cache_release_drops_the_copies(monkeypatch):
    """`release` drops every kept copy: the next call casts again."""
    casts = CountingCasts(monkeypatch)
    home = torch.nn.Parameter(spread(1, 128, 128, seed=13).to(torch.bfloat16).to(KERNEL_DEVICE))
    cache = Fp8WeightCache()
    cache.get((home,), transposed=True)
    cache.release()
    assert not any(cache._copies.values())
    cache.get((home,), transposed=True)
    assert len(casts.calls) == 2


def test_gradient_accumulation_casts_the_home_experts_once_per_optimizer_step(monkeypatch):
    """Gradient accumulation in an fp8 layer (the Triton FP8 GEMM; interpreted on the CPU), with nothing
    around it: the first micro-batch casts both home weights in both orientations, the others reuse them,
    and the gradients are the bits of casting on every call; after an optimizer step the next micro-batches
    use the new weights, both orientations cast in one pass after the step and an in-place change (the same
    bits as a fresh cast). A `fixed_expert_weights` block gives the same bits
    and frees the copies at its end. Two experts of one 128x128 block per projection half (more, each a
    128-row segment, only multiply the interpreted GEMMs and casts)."""
    from moonep_moe import fixed_expert_weights
    from moonep_moe.transport.threads import single_world

    cfg = MoEConfig(**{**BASE, "num_experts": 2, "hidden_size": 128}, token_padding=128)
    layer = MoonEPMoELayer(cfg, single_world(KERNEL_DEVICE))
    gemm = layer._state.gemm = Fp8GroupedGemm(layer._state.gemm, kernel="triton")
    casts = CountingCasts(monkeypatch)
    home = (layer.experts.gate_up, layer.experts.down)
    gen = torch.Generator().manual_seed(15)
    xs = [torch.randn(48, cfg.hidden_size, generator=gen).to(torch.bfloat16).to(KERNEL_DEVICE)
          for _ in range(2)]

    def accumulate(fresh: bool) -> list[torch.Tensor]:
        """The step's micro-batches; `fresh`: every call casts (the copies dropped before each)."""
        casts.calls.clear()
        layer.zero_grad(set_to_none=True)
        for x in xs:
            if fresh:
                gemm.weights.release()
            layer(x).float().square().sum().backward()
        return [weight.grad.clone() for weight in home]

    def home_casts() -> int:
        return sum(any(w is weight for weight in home) for w, _, _ in casts.calls)

    optimizer = torch.optim.SGD(home, lr=1e-2)
    for step in range(2):
        fresh = accumulate(fresh=True)
        assert home_casts() == 4 * len(xs)
        kept = accumulate(fresh=False)  # the copies the last micro-batch above made are current
        assert home_casts() == 0, f"step {step}: no cast while the weights stay"
        for got, want in zip(kept, fresh, strict=True):
            assert torch.equal(got, want)
        optimizer.step()
    with torch.no_grad():  # a change every block scale shows (this small a step may leave the scales)
        for weight in home:
            weight.mul_(2)
    kept = accumulate(fresh=False)
    assert home_casts() == 2, "gate_up and down, forward and transposed in one pass, once after the step"
    assert all(q and qt for w, q, qt in casts.calls if any(w is weight for weight in home))
    for got, want in zip(kept, accumulate(fresh=True), strict=True):  # the one-pass casts' bits
        assert torch.equal(got, want)
    with fixed_expert_weights(layer):
        fixed = accumulate(fresh=False)
        assert home_casts() == 0 and any(gemm.weights._copies.values())
    assert not any(gemm.weights._copies.values()), "the block's end frees the copies"
    for got, want in zip(fixed, kept, strict=True):
        assert torch.equal(got, want)


def test_fixed_expert_weights_blocks_nest_and_leave_bf16_layers_alone(monkeypatch):
    """An inner block's end keeps the copies (the outer block still promises); the outer one frees them. A
    model's bf16 layers are left alone; an exception inside still ends the block."""
    from moonep_moe import fixed_expert_weights
    from moonep_moe.transport.threads import single_world

    CountingCasts(monkeypatch)
    cfg = MoEConfig(**BASE, token_padding=128)
    fp8_layer, bf16_layer = (MoonEPMoELayer(cfg, single_world(KERNEL_DEVICE)) for _ in range(2))
    model = torch.nn.ModuleList([fp8_layer, bf16_layer])
    fp8_layer._state.gemm = Fp8GroupedGemm(fp8_layer._state.gemm, kernel="triton")
    cache = fp8_layer._state.gemm.weights
    with fixed_expert_weights(model):
        with fixed_expert_weights(fp8_layer):
            cache.get((fp8_layer.experts.down,), transposed=True)
            assert cache.fixed == 2
        assert cache.fixed == 1 and any(cache._copies.values()), "the outer block still keeps them"
    assert cache.fixed == 0 and not any(cache._copies.values())
    assert not hasattr(bf16_layer._state.gemm, "weights")
    with pytest.raises(RuntimeError, match="inside"), fixed_expert_weights(model):
        assert cache.fixed == 1
        raise RuntimeError("inside")
    assert cache.fixed == 0


# -- config and construction --------------------------------------------------------------------------------

BASE = dict(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, max_tokens_per_rank=64,
            dtype="bfloat16")


def test_precision_defaults_to_bf16_and_fp8_pads_to_128():
    assert MoEConfig(**BASE).precision == "bf16"
    assert MoEConfig(**BASE, precision="fp8").token_padding == 128
    assert MoEConfig(**BASE, precision="fp8", token_padding=256).token_padding == 256


@pytest.mark.parametrize("changes,named", [(dict(dtype="float32"), "dtype='float32'"),
                                           (dict(token_padding=16), "token_padding=16")])
def test_precision_fp8_refuses_other_dtypes_and_paddings(changes, named):
    message = f"precision='fp8' needs dtype='bfloat16' and token_padding .*{named}"
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**BASE, "precision": "fp8", **changes})
    with pytest.raises(ValueError, match="precision"):
        MoEConfig(**BASE, precision="fp16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_fp8_layer_refused_at_construction_without_cuda():
    with pytest.raises(ValueError, match=r"precision='fp8' cannot run here \(rank 0\): FP8 experts run bf16 "
                                         r"weights and activations on CUDA, got torch.bfloat16 on cpu"):
        MoonEPMoELayer(MoEConfig(**BASE, precision="fp8", grouped_gemm="torch"))


# -- on the H200: the FP8 backend and an FP8 layer ----------------------------------------------------------


def _fp8_available() -> bool:
    if not torch.cuda.is_available():
        return False
    return registry.fp8_unsupported_reason(torch.device("cuda"), torch.bfloat16, 128) is None


needs_fp8 = pytest.mark.skipif(not _fp8_available(),
                               reason="needs a GPU with FP8 tensor cores and Triton (run on the H200)")


def _kernel_reason(kernel: str) -> str | None:
    """Why `Fp8GroupedGemm(kernel=kernel)` cannot run on `KERNEL_DEVICE` here, or None. Without CUDA the
    Triton kernel runs in Triton's interpreter."""
    if not torch.cuda.is_available():
        return None if kernel == "triton" else "DeepGEMM needs a CUDA device (run on the H200)"
    if not _fp8_available():
        return registry.fp8_unsupported_reason(torch.device("cuda"), torch.bfloat16, 128)
    if kernel == "deep_gemm" and registry.fp8_kernel(torch.device("cuda")) != "deep_gemm":
        return "DeepGEMM's FP8 GEMMs need DeepGEMM on an sm90 GPU (run on the H200)"
    return None


@pytest.fixture(params=fp8.FP8_KERNELS)
def fp8_kernel(request) -> str:
    """Each FP8 GEMM kernel, skipped with its reason where it cannot run."""
    reason = _kernel_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    return request.param


def fp8_gemm_bound(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_w: torch.Tensor,
                   a_times_w) -> torch.Tensor:
    """Elementwise bound on ``|fp8 GEMM - exact|`` for one product ``a_times_w(a, w)`` (float64): with
    ``e_a = max(2^-4 |a|, 2^-10 s_a)`` per element (likewise ``e_w``), the quantised product's error is at
    most ``e_a |w| + |a| e_w + e_a e_w`` summed over the inner dimension; 2^-8 of ``|a| |w|`` (in that sum) is
    added for the bf16 output (2^-9) and the tensor cores' accumulation before DeepGEMM's per-128 fp32
    promotion (2^-9)."""
    e_a = torch.maximum(HALF_STEP * a.abs(), SUBNORMAL_HALF_STEP * scale_a)
    e_w = torch.maximum(HALF_STEP * w.abs(), SUBNORMAL_HALF_STEP * scale_w)
    big_a, big_w = a.abs() + e_a, w.abs() + e_w
    return (a_times_w(e_a, w.abs()) + a_times_w(a.abs(), e_w) + a_times_w(e_a, e_w)
            + 2.0**-8 * a_times_w(big_a, big_w))


HUGE = 16384 if torch.cuda.is_available() else 1024
"""Rows of the "huge" case's one segment. Interpreted on the CPU, 1024 (as long as "skewed"'s first segment):
with the 128 unused rows, 18 row blocks of the Triton FP8 GEMM, two full swizzle bands and a partial one,
between empty groups (2048 ran the same blocks twice as often, at twice the time)."""
SEGMENTS = {"uniform": [256] * 4, "skewed": [1024, 128, 0, 128], "empty groups": [0, 128, 0, 0],
            "all empty": [0] * 4, "huge": [0, HUGE, 0, 0]}


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=[pytest.mark.oldest_triton] if case == "empty groups" else [])
    for case in SEGMENTS])
def test_fp8_backend_matches_float64_within_the_format_bound(case, fp8_kernel):
    """fwd and dgrad of `Fp8GroupedGemm` on each kernel (the Triton one interpreted on the CPU) against the
    float64 product of the same bf16 data, per element, within `fp8_gemm_bound`; weights as (home
    parameter, slots) pairs; NaN rows past the last segment end (unused capacity) must not leak; on CUDA,
    after a warm-up, no host sync."""
    dev = torch.device(KERNEL_DEVICE)
    gemm = Fp8GroupedGemm(TorchGroupedGemm(), kernel=fp8_kernel)
    offs_g = torch.tensor(SEGMENTS[case], dtype=torch.int32, device=dev).cumsum(0).int()
    used, (n, k) = int(offs_g[-1]), (384, 256)
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(used + 128, k, generator=gen).bfloat16().to(dev)
    dy = torch.randn(used + 128, n, generator=gen).bfloat16().to(dev)
    x[used:], dy[used:] = float("nan"), float("nan")
    w = (torch.randn(4, n, k, generator=gen) / k**0.5).bfloat16().to(dev)
    weights = (torch.nn.Parameter(w[:3].clone()), w[3:].clone())
    got_y, got_dx = gemm.fwd(x, weights, offs_g), gemm.dgrad(dy, weights, offs_g)  # compiles (JIT, Triton)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got_y, got_dx = gemm.fwd(x, weights, offs_g), gemm.dgrad(dy, weights, offs_g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    ref = ReferenceGroupedGemm()
    w64, x64, dy64 = (w.double(), (x[:used].double(),), (dy[:used].double(),))
    _, w_scales = quantise_blocks(w)
    scale_w = w_scales.double().repeat_interleave(TILE, 1).repeat_interleave(TILE, 2)[:, :n, :k]
    _, x_scales = quantise_rows(x[:used])
    _, dy_scales = quantise_rows(dy[:used])
    for got, a, scale_a, op in ((got_y, x64[0], x_scales, "fwd"), (got_dx, dy64[0], dy_scales, "dgrad")):
        scale_a = scale_a.double().repeat_interleave(TILE, 1)[:, :a.shape[1]]
        exact = getattr(ref, op)(a, (w64,), offs_g)
        bound = fp8_gemm_bound(a, w64, scale_a, scale_w,
                               lambda p, q, o=op: getattr(ref, o)(p, (q,), offs_g))
        error = (got[:used].double() - exact).abs()
        assert (error <= bound).all(), f"{op}: worst error / bound {float((error / bound).max()):.2f}"
        assert not got[:used].isnan().any()


@pytest.mark.oldest_triton
def test_triton_fp8_gemm_leaves_rows_past_unaligned_segment_ends_alone():
    """The psum layout as DeepGEMM takes it: segment g covers rows ``[align(offs[g-1], 128), offs[g])``, so
    an end need not be aligned; the rows between such an end and the next segment's start, and those past
    the last end, are neither read (NaN there would leak into a product) nor written. Each segment equals
    the float64 product of its dequantised operands up to the accumulation's rounding (the products of e4m3
    values are exact; Hopper's tensor cores sum each 128-element step with reduced precision before it is
    promoted to fp32: 2^-9 of the product of magnitudes, as in `fp8_gemm_bound`)."""
    from moonep_moe.gemm.kernels.fp8_gemm import grouped_fp8_gemm

    dev, (n, k) = KERNEL_DEVICE, (200, 300)
    ends = [100, 128, 356, 484]  # rows [0, 100), empty, [128, 356), [384, 484)
    starts = [0, 128, 128, 384]
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(640, k, generator=gen)
    gaps = torch.ones(640, dtype=torch.bool)
    for start, end in zip(starts, ends, strict=True):
        gaps[start:end] = False
    x[gaps] = float("nan")
    w = torch.randn(4, n, k, generator=gen)
    q_x, scales_x = quantise_rows(x)
    q_w, scales_w = quantise_blocks(w)
    out = torch.full((640, n), 7.0, device=dev)
    offs_g = torch.tensor(ends, dtype=torch.int32, device=dev)
    grouped_fp8_gemm((q_x.to(dev), to_deep_gemm_row_scales(scales_x).to(dev)),
                     (q_w.to(dev), scales_w.to(dev)), out, offs_g)
    x64, w64 = dequantise_rows(q_x, scales_x), dequantise_blocks(q_w, scales_w)
    for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
        exact = x64[start:end] @ w64[g].T
        bound = 2.0**-9 * (x64[start:end].abs() @ w64[g].abs().T)
        assert ((out[start:end].cpu().double() - exact).abs() <= bound).all(), g
    assert (out[gaps] == 7.0).all(), "rows outside every segment were written"


@pytest.mark.gpu
@needs_fp8
def test_triton_fp8_gemm_gives_deep_gemms_bits():
    """On the same FP8 operands the Triton kernel sums each 128-element step on the tensor cores and scales
    it into fp32 as DeepGEMM does, so its bf16 output is DeepGEMM's bit for bit (measured on the H200 at
    every launch shape swept); skewed and empty segments, both orientations' scale layouts."""
    if _kernel_reason("deep_gemm") is not None:
        pytest.skip(_kernel_reason("deep_gemm"))
    from moonep_moe.fp8.cast import cast_rows
    from moonep_moe.gemm.kernels.fp8_gemm import grouped_fp8_gemm

    gen = torch.Generator(device="cuda").manual_seed(22)
    offs_g = torch.tensor([512, 512, 640, 1664], dtype=torch.int32, device="cuda")
    for n, k, transposed in ((768, 512, False), (512, 768, True)):
        x = torch.randn(1792, k, device="cuda", generator=gen).bfloat16()
        w = torch.randn(4, k, n, device="cuda", generator=gen) if transposed else torch.randn(
            4, n, k, device="cuda", generator=gen)
        q_w, scales_w = quantise_blocks(w.bfloat16())
        if transposed:  # dgrad's operand: the K-major copy with its scales as a transposed view
            q_w, scales_w = transpose_blocks(q_w, scales_w)
        a = cast_rows(x, offs_g)
        outs = [torch.zeros(1792, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        grouped_fp8_gemm(a, (q_w, scales_w), outs[0], offs_g)
        fp8.import_deep_gemm().m_grouped_fp8_gemm_nt_contiguous(
            a, (q_w, scales_w), outs[1], offs_g, disable_ue8m0_cast=True, use_psum_layout=True)
        assert torch.equal(outs[0][:1664], outs[1][:1664]), (n, k, transposed)


def test_triton_fp8_gemm_names_what_is_wrong():
    from moonep_moe.gemm.kernels.fp8_gemm import grouped_fp8_gemm

    q_a, s_a = quantise_rows(torch.randn(128, 256))
    q_w, s_w = quantise_blocks(torch.randn(2, 64, 256))
    out, offs = torch.empty(128, 64), torch.tensor([0, 128], dtype=torch.int32)
    cases = [(((q_a.float(), s_a), (q_w, s_w), out, offs), "a and w must be torch.float8_e4m3fn"),
             (((q_a[:, :128], s_a[:, :1]), (q_w, s_w), out, offs), "must share k"),
             (((q_a, s_a[:, :1]), (q_w, s_w), out, offs), r"scales must be \[rows, 2\]"),
             (((q_a, s_a), (q_w, s_w), out[:, :32], offs), r"out must be \[128, 64\]"),
             (((q_a, s_a), (q_w, s_w), out, offs.long()), r"offs_g must be int32 \[2\]")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            grouped_fp8_gemm(*args)
    with pytest.raises(ValueError, match="BLOCK_M must divide 128"):
        grouped_fp8_gemm((q_a, s_a), (q_w, s_w), out, offs, {"BLOCK_M": 96, "BLOCK_N": 64, "num_warps": 4,
                                                              "num_stages": 1})


@pytest.mark.gpu
@needs_fp8
def test_fp8_backend_recasts_after_an_optimizer_step():
    cuda = torch.device("cuda")
    gemm = fp8_grouped_gemm(TorchGroupedGemm(), cuda, torch.bfloat16, 128)
    offs_g = torch.tensor([128, 256], dtype=torch.int32, device=cuda)
    x = torch.randn(256, 256, device=cuda).bfloat16()
    home = torch.nn.Parameter((torch.randn(2, 256, 256, device=cuda) / 16).bfloat16())
    before = gemm.fwd(x, (home,), offs_g)
    home.grad = 2 * home.detach()
    torch.optim.SGD([home], lr=1.0).step()  # home - 2 home = -home, exactly
    # negation commutes with the power-of-two quantisation and the GEMM: a stale FP8 copy would give +before
    torch.testing.assert_close(gemm.fwd(x, (home,), offs_g), -before, rtol=0, atol=0)


@pytest.mark.gpu
@needs_fp8
def test_kept_fp8_copies_on_deep_gemm_give_the_gradients_of_fresh_casts():
    """The real fp8 layer (DeepGEMM, compiled casts), skewed routing: three micro-batches accumulated with
    the home weights' FP8 copies kept (cast by the first) give the bits of casting on every call, inside a
    `fixed_expert_weights` block too, which frees its copies, and after an in-place change, which casts
    both kept orientations in one pass."""
    from moonep_moe import fixed_expert_weights
    from moonep_moe.transport.threads import single_world

    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=256, num_experts=8, top_k=2, max_tokens_per_rank=256,
                    dtype="bfloat16", precision="fp8", router={"dtype": "float32", "expert_bias": True})
    layer = MoonEPMoELayer(cfg, single_world("cuda"))
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(0, 4, 8))  # skewed: the high-bias experts are hot
    gen = torch.Generator(device="cuda").manual_seed(16)
    xs = [torch.randn(256, 256, device="cuda", generator=gen).bfloat16() for _ in range(3)]
    home = (layer.experts.gate_up, layer.experts.down)

    def accumulate(fresh: bool) -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        for x in xs:
            if fresh:
                layer._state.gemm.weights.release()
            layer(x).float().square().sum().backward()
        return [weight.grad.clone() for weight in home]

    plain = accumulate(fresh=True)
    kept = accumulate(fresh=False)
    with fixed_expert_weights(layer):
        fixed = accumulate(fresh=False)
    assert not any(layer._state.gemm.weights._copies.values())
    for got, want in zip(kept, plain, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(fixed, plain, strict=True):
        assert torch.equal(got, want)
    accumulate(fresh=False)  # both orientations kept again
    with torch.no_grad():  # a new version: the first use casts both kept orientations in one pass
        for weight in home:
            weight.mul_(2)
    recast = accumulate(fresh=False)
    for got, want in zip(recast, accumulate(fresh=True), strict=True):
        assert torch.equal(got, want)


def skip_without_the_arena(device: torch.device) -> None:
    """Skip, with the reason, where `transport.arena` cannot map 2 MiB regions (no `cuda.bindings`)."""
    from moonep_moe.transport.arena import expert_arena_reason

    reason = expert_arena_reason(device, [2**21])
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@needs_fp8
def test_kept_copies_put_the_slots_in_one_scratch_per_stream(monkeypatch):
    """Where the arena maps them (CUDA; the kept groups a multiple of 2 MiB), a kept FP8 copy holds its home
    groups in memory of its own and its slots' groups (cast on every call) in scratch that every copy used on
    the same stream shares: two layers in both orientations cost their home groups and one scratch (not one
    per layer and orientation), every call gives the fresh cast's bits (a layer's slots cast again after the
    other layer overwrote the scratch; the home groups once), a copy used on another stream maps a scratch of
    its own, and `release` frees it all."""
    import gc

    from moonep_moe.transport.arena import physical_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    skip_without_the_arena(device)
    casts = CountingCasts(monkeypatch)
    mib, shape = 2**20, (2, 1024, 1024)  # two groups: 2 MiB of e4m3

    def layer(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        home = torch.nn.Parameter(spread(*shape, seed=seed).to(torch.bfloat16).to(device))
        return home, spread(*shape, seed=seed + 1).to(torch.bfloat16).to(device)

    def checked(cache: Fp8WeightCache, weights: tuple[torch.Tensor, ...], transposed: bool) -> None:
        q, scales = cache.get(weights, transposed)
        want_q, want_scales = quantise_blocks(torch.cat([w.detach() for w in weights]).cpu())
        if transposed:
            want_q, want_scales = transpose_blocks(want_q, want_scales)
        assert torch.equal(bits(q.cpu()), bits(want_q)) and torch.equal(scales.cpu(), want_scales)

    layers = [layer(30), layer(32)]
    gc.collect()
    before = physical_bytes(device)
    cache = Fp8WeightCache()
    for transposed in (False, True):
        for _ in range(2):  # micro-batches
            for home, slots in layers:
                slots.mul_(-1)  # a new prefetch (no version a cache could read)
                checked(cache, (home, slots), transposed)
    assert all(copy.kept is not None for copies in cache._copies.values() for copy in copies.values())
    homes = [w for w, *_ in casts.calls if any(w is home for home, _ in layers)]
    assert len(homes) == 4, "each home part once per orientation"
    assert len(casts.calls) == 4 + 8, "and the slots on every call"
    assert physical_bytes(device) - before == (4 * 2 + 2) * mib, "4 home parts, 1 scratch"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        checked(cache, layers[0], transposed=False)
    torch.cuda.current_stream(device).wait_stream(side)
    assert physical_bytes(device) - before == (4 * 2 + 2 + 2) * mib, "a scratch for the other stream"
    checked(cache, layers[1], transposed=False)  # back on the first stream: its own scratch still maps
    cache.release()
    gc.collect()
    assert physical_bytes(device) == before


@pytest.mark.gpu
@needs_fp8
def test_fp8_layer_ranks_on_their_own_streams_compute_the_same_bits_with_the_scratch(monkeypatch):
    """Two thread-ranks of fp8 layers on one GPU, each on its own stream (forward: one autograd thread per
    device), with shapes the arena maps (H = H' = 1024: each rank's kept groups a multiple of 2 MiB) and
    skewed routing (replicas in the slots): the outputs with the slots' FP8 copies in scratch per stream are
    the bits of one allocation per copy, so ranks running at once never share a scratch."""
    skip_without_the_arena(torch.device("cuda", torch.cuda.current_device()))
    mapped = []
    kept_rows = fp8._kept_rows

    def recorded(*args):
        rows = kept_rows(*args)
        mapped.append(rows is not None)
        return rows

    runs = {}
    for arena in (False, True):
        monkeypatch.setattr(fp8, "_kept_rows", recorded if arena else lambda *args: None)
        cfg = make_config(2, hidden_size=1024, ffn_hidden_size=1024, num_experts=8, max_tokens_per_rank=256,
                          token_padding=128, dtype="bfloat16", grouped_gemm="torch", precision="fp8",
                          router={"dtype": "float32", "expert_bias": True})
        runs[arena] = run_moonep(make_problem(cfg, seed=45, skew=2.0), "cuda", backward=False)
    assert mapped and all(mapped), "every kept copy in the arena"
    assert any(bool((res["experts_to_copy"] >= 0).any()) for res in runs[True]), "skewed: replicas"
    for rank, (plain, scratch) in enumerate(zip(runs[False], runs[True], strict=True)):
        assert torch.equal(scratch["out"], plain["out"]), f"out on rank {rank}"


def test_fp8_layer_tracks_the_float64_reference_like_the_bf16_layer(fp8_kernel, monkeypatch):
    """One EP=1 layer step in fp8 (on each FP8 GEMM kernel) and in bf16 against the float64 dense reference
    (bf16-rounded inputs): the fp8 layer's output, input gradient and expert weight gradients within 2^-3
    relative (norm-wise) error. Each FP8 GEMM's product terms carry at most 2 * 2^-4 = 2^-3 relative error
    (two operands rounded to e4m3) in the worst case, and rounding errors of random signs add in norm far
    below that, so one GEMM's worth of worst case is a ceiling for the chain (expected: a few 2^-5); the
    bf16 layer's errors are printed beside for the record. Without CUDA the layer runs the Triton FP8 GEMM
    and casts in Triton's interpreter (`fp8_layer_here`)."""
    fp8_layer_here(monkeypatch, fp8_kernel)
    errors = {}
    for precision in ("fp8", "bf16"):
        cfg = make_config(1, hidden_size=256, ffn_hidden_size=128, num_experts=8, max_tokens_per_rank=256,
                          token_padding=128, dtype="bfloat16", grouped_gemm="torch", precision=precision,
                          router={"dtype": "float32", "expert_bias": True})
        p = make_problem(cfg, seed=41, skew=2.0)
        rounded = [t.bfloat16().double() for t in p.hidden + [p.gate_up_e2fh, p.down_ehf]]
        p.hidden, p.gate_up_e2fh, p.down_ehf = rounded[:-2], rounded[-2], rounded[-1]
        (got,), (want, grad_gate_up, grad_down, _) = run_moonep(p, KERNEL_DEVICE), run_dense(p)
        want = {**want[0], "grad_gate_up": grad_gate_up, "grad_down": grad_down}
        errors[precision] = {name: float((got[name] - want[name]).norm() / want[name].norm())
                             for name in ("out", "grad_x", "grad_gate_up", "grad_down")}
    print(errors)
    assert all(error < 2.0**-3 for error in errors["fp8"].values()), errors


def fp8_layer_here(monkeypatch, kernel: str) -> None:
    """Layers built from here on with `precision="fp8"` run FP8 GEMM `kernel`; without CUDA, the Triton one
    interpreted (the construction check, which wants CUDA, stood in for)."""
    monkeypatch.setattr(registry, "fp8_kernel", lambda device: kernel)
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(registry, "fp8_unsupported_reason", lambda *_: None)


ONE_GPU_BACKWARD = pytest.mark.skipif(torch.cuda.is_available(), reason="thread-ranks on one GPU run forward "
                                      "only (PyTorch's one autograd thread per device); R=1 covers the GPU")


@pytest.mark.parametrize("R", [1, pytest.param(2, marks=ONE_GPU_BACKWARD)])
def test_swiglu_hands_the_fp8_gemms_their_rows_cast_to_the_same_bytes(R, fp8_kernel, monkeypatch):
    """An fp8 layer step under skewed routing (maxvio 1; at R=2 one replica): SwiGLU giving the down GEMM and
    gate_up's dgrad their rows as FP8, cast in its own pass (inside its fused kernels on CUDA; the reference
    cast on the CPU), gives the outputs, input and route gradients and weight gradients of those GEMMs
    casting the bf16 rows themselves, bit for bit; those two GEMMs get ``(q, scales)`` (F = 256: whole
    1x128 tiles) where the backend casts the rows it multiplies (`casts_rows`), bf16 rows where not (and
    so does gate_up's forward on one rank, its tokens dispatched as FP8: `dispatches_fp8`)."""
    fp8_layer_here(monkeypatch, fp8_kernel)
    cfg = make_config(R, hidden_size=256, ffn_hidden_size=256, num_experts=4, max_tokens_per_rank=128,
                      token_padding=128, dtype="bfloat16", grouped_gemm="torch", precision="fp8",
                      router={"dtype": "float32", "expert_bias": True})
    p = make_problem(cfg, seed=43, skew=20.0)
    real_gemm, given = Fp8GroupedGemm._gemm, collections.defaultdict(list)

    def spy(self, a, *args):
        given[id(self)].append(isinstance(a, tuple))  # per rank (each builds its backend; on CUDA its
        # backward runs on autograd's device thread, so not per thread)
        return real_gemm(self, a, *args)

    monkeypatch.setattr(Fp8GroupedGemm, "_gemm", spy)
    runs = {}
    for casts_rows in (True, False):
        monkeypatch.setattr(Fp8GroupedGemm, "casts_rows", casts_rows)
        given.clear()
        runs[casts_rows] = run_moonep(p, KERNEL_DEVICE)
        # each rank: gate_up fwd (FP8 rows dispatched on one rank: `dispatches_fp8`), down fwd, down dgrad,
        # gate_up dgrad
        assert list(given.values()) == [[R == 1 and casts_rows, casts_rows, False, casts_rows]] * R, given
    for fused, plain in zip(runs[True], runs[False], strict=True):
        for name in ("out", "grad_x", "grad_router", "grad_gate_up", "grad_down"):
            assert torch.equal(fused[name], plain[name]), name


@pytest.mark.parametrize("R", [1, pytest.param(2, marks=ONE_GPU_BACKWARD)])
def test_fp8_dispatch_changes_only_gate_ups_weight_gradient(R, fp8_kernel, monkeypatch):
    """`fp8_dispatch`: the tokens quantised once and dispatched as FP8 rows with their scales. The output and
    the input, router and down gradients are the bits of the fp8 layer without it (the same rows, quantised
    the same way; R ranks, skewed routing, duplicates at R=2); gate_up's weight gradient, made from the
    dequantised rows instead of the bf16 ones, stays within the fp8 layer's 2^-3 of the float64 reference
    (see `test_fp8_layer_tracks_the_float64_reference_like_the_bf16_layer`). Four experts: each one a step
    reaches is a 128-row segment of interpreted FP8 GEMMs and casts on the CPU, and at R=2 two per rank
    still give replicas (checked)."""
    fp8_layer_here(monkeypatch, fp8_kernel)
    runs = {}
    for dispatch in (False, True):
        cfg = make_config(R, hidden_size=256, ffn_hidden_size=128, num_experts=4, max_tokens_per_rank=64,
                          token_padding=128, dtype="bfloat16", grouped_gemm="torch", precision="fp8",
                          fp8_dispatch=dispatch, router={"dtype": "float32", "expert_bias": True})
        p = make_problem(cfg, seed=43, skew=2.0)
        rounded = [t.bfloat16().double() for t in p.hidden + [p.gate_up_e2fh, p.down_ehf]]
        p.hidden, p.gate_up_e2fh, p.down_ehf = rounded[:-2], rounded[-2], rounded[-1]
        runs[dispatch] = run_moonep(p, KERNEL_DEVICE)
    if R > 1:
        assert any(bool((res["experts_to_copy"] >= 0).any()) for res in runs[True]), "skewed: replicas"
    for rank, (plain, fp8_rows) in enumerate(zip(runs[False], runs[True], strict=True)):
        for name in ("out", "grad_x", "grad_router", "grad_down"):
            assert torch.equal(fp8_rows[name], plain[name]), f"{name} on rank {rank}"
    _, want, _, _ = run_dense(p)  # every expert's; a rank's own may be all zero (the skew sends no route)
    got = torch.cat([fp8_rows["grad_gate_up"] for fp8_rows in runs[True]])
    error = float((got - want).norm() / want.norm())
    assert error < 2.0**-3, f"grad_gate_up: relative error {error}"


@pytest.mark.parametrize("R", [1, 2])
def test_fp8_inference_dispatches_fp8_rows_read_in_place_with_the_same_bits(R, fp8_kernel, monkeypatch):
    """An fp8 layer's forward without autograd (inference) dispatches its tokens as FP8 rows with their
    scales, and gate_up's GEMM reads them in place (views of the Buffer's rows): its output is the bits of
    the same forward dispatching bf16 rows that the GEMM casts (R ranks, skewed routing; at R=2 duplicates
    and a replica). A forward that autograd records dispatches bf16 rows where backward reads them (R=2),
    FP8 rows on one rank, whose backward gathers the bf16 rows again."""
    from moonep_moe.comm.buffer import Buffer
    from moonep_moe.layers.function import ExpertsState
    from moonep_moe.transport.threads import run_ranks

    fp8_layer_here(monkeypatch, fp8_kernel)
    cfg = make_config(R, hidden_size=256, ffn_hidden_size=128, num_experts=4, max_tokens_per_rank=64,
                      token_padding=128, dtype="bfloat16", grouped_gemm="torch", precision="fp8",
                      router={"dtype": "float32", "expert_bias": True})
    p = make_problem(cfg, seed=45, skew=2.0)
    real_dispatch, real_fwd, calls = Buffer.dispatch, Fp8GroupedGemm.fwd, collections.defaultdict(list)

    def dispatch(self, hidden_sh, *args, **kwargs):
        fp8_in = kwargs.get("scales") is not None
        result = real_dispatch(self, hidden_sh, *args, **kwargs)
        calls["dispatch"].append((fp8_in, kwargs.get("zero_copy", False), hidden_sh.dtype))
        if fp8_in and kwargs.get("zero_copy"):  # the rows the GEMM reads are the Buffer's own bytes
            q_nvsh, _ = result[0]
            calls["in_place"].append(q_nvsh.data_ptr() == self.hidden_nvsh_buffer_view.data_ptr())
        return result

    def fwd(self, x, *args, **kwargs):
        calls[("fwd", id(self))].append(isinstance(x, tuple))  # per rank's backend (ranks interleave)
        return real_fwd(self, x, *args, **kwargs)

    monkeypatch.setattr(Buffer, "dispatch", dispatch)
    monkeypatch.setattr(Fp8GroupedGemm, "fwd", fwd)

    def forward(world, grad: bool):
        layer = build_layer(p, world)
        with torch.set_grad_enabled(grad):
            out = layer(p.hidden[world.rank].to(KERNEL_DEVICE, torch.bfloat16))
        plan = layer._state.last_plan
        layer.destroy()
        return out.detach().cpu(), plan.experts_to_copy.cpu()

    runs = {}
    for fp8_rows in (True, False):
        if not fp8_rows:  # the reference: bf16 rows dispatched, cast by the GEMM
            monkeypatch.setattr(ExpertsState, "dispatches_fp8", lambda self, records: False)
        calls.clear()
        runs[fp8_rows] = run_ranks(lambda world: forward(world, False), R, device=KERNEL_DEVICE)
        assert calls["dispatch"] == [(fp8_rows, True, FP8_DTYPE if fp8_rows else torch.bfloat16)] * R
        assert calls["in_place"] == [True] * R * fp8_rows
        # each rank: gate_up's forward given the dispatched FP8 rows, down's the rows SwiGLU cast
        assert [calls[key] for key in calls if key[0] == "fwd"] == [[fp8_rows, True]] * R
    if R > 1:
        assert any(bool((copied >= 0).any()) for _, copied in runs[True]), "skewed: replicas"
    for rank, ((fp8_out, _), (bf16_out, _)) in enumerate(zip(runs[True], runs[False], strict=True)):
        assert torch.equal(fp8_out, bf16_out), f"out on rank {rank}"
    monkeypatch.undo()
    fp8_layer_here(monkeypatch, fp8_kernel)
    monkeypatch.setattr(Buffer, "dispatch", dispatch)
    calls.clear()
    run_ranks(lambda world: forward(world, True), R, device=KERNEL_DEVICE)
    assert [fp8_in for fp8_in, _, _ in calls["dispatch"]] == [R == 1] * R, "recorded: FP8 on one rank"


def test_fp8_training_on_one_rank_dispatches_fp8_rows_with_the_same_bits(fp8_kernel, monkeypatch):
    """One rank without slots (EP=1) trains an fp8 layer dispatching FP8 rows read in place (its backward
    gathers the bf16 rows again for gate_up's weight gradient): the output and every gradient are the bits of
    the same step dispatching bf16 rows that the GEMM casts, under skewed routing."""
    from moonep_moe.comm.buffer import Buffer
    from moonep_moe.layers.function import ExpertsState

    fp8_layer_here(monkeypatch, fp8_kernel)
    cfg = make_config(1, hidden_size=256, ffn_hidden_size=128, num_experts=4, max_tokens_per_rank=64,
                      token_padding=128, dtype="bfloat16", grouped_gemm="torch", precision="fp8",
                      router={"dtype": "float32", "expert_bias": True})
    p = make_problem(cfg, seed=46, skew=2.0)
    real_dispatch, fp8_dispatches = Buffer.dispatch, []

    def dispatch(self, hidden_sh, *args, **kwargs):
        if kwargs.get("plan") is None:  # forward's (backward's carry a plan)
            fp8_dispatches.append((kwargs.get("scales") is not None, kwargs.get("zero_copy", False)))
        return real_dispatch(self, hidden_sh, *args, **kwargs)

    monkeypatch.setattr(Buffer, "dispatch", dispatch)
    fp8_rows = run_moonep(p, KERNEL_DEVICE)
    assert fp8_dispatches == [(True, True)], "FP8 rows, read in place"
    monkeypatch.setattr(ExpertsState, "dispatches_fp8", lambda self, records: False)
    bf16_rows = run_moonep(p, KERNEL_DEVICE)
    assert fp8_dispatches[1:] == [(False, True)]
    for name in ("out", "grad_x", "grad_router", "grad_gate_up", "grad_down"):
        assert torch.equal(fp8_rows[0][name], bf16_rows[0][name]), name


@pytest.mark.parametrize("dispatch", [False, True])
def test_fp8_dispatch_keeps_fp8_rows_for_backward_instead_of_a_bf16_copy(dispatch, fp8_kernel, monkeypatch):
    """What the routed experts of one rank save for backward: with `fp8_dispatch` the dispatched rows as e4m3
    `[NvS, H]` (half the bytes) and no bf16 `[NvS, H]` tensor; without it neither (the tokens, which its
    backward dispatches again: `ExpertsState.regathers_rows`)."""
    from moonep_moe.transport.threads import single_world

    fp8_layer_here(monkeypatch, fp8_kernel)
    # no other saved [NvS, H]-shaped tensor (ab is [NvS, 2F]); two experts: what is saved does not depend on
    # how many there are, and each is a 128-row segment of interpreted FP8 GEMMs and casts
    shapes = {**BASE, "ffn_hidden_size": 384, "num_experts": 2}
    layer = MoonEPMoELayer(MoEConfig(**shapes, precision="fp8", fp8_dispatch=dispatch),
                           single_world(KERNEL_DEVICE))
    rows, hidden = layer.config.rows_per_rank, layer.config.hidden_size
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    x = torch.randn(48, hidden, generator=torch.Generator().manual_seed(44)).bfloat16().to(KERNEL_DEVICE)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x.requires_grad_())
    out.float().sum().backward()
    assert ((FP8_DTYPE, (rows, hidden)) in saved) == dispatch
    assert (torch.bfloat16, (rows, hidden)) not in saved
    assert x.grad is not None and layer.experts.gate_up.grad is not None


def test_training_on_the_triton_fp8_gemm_warns_once(monkeypatch, caplog):
    """Where DeepGEMM cannot run, fp8 training runs on the Triton FP8 GEMM at about half its rate, slower
    than bf16: the first fp8 layer of a process says so (WARNING on the `moonep_moe` logger), later ones do
    not; the DeepGEMM path says nothing."""
    monkeypatch.setattr(registry, "fp8_unsupported_reason", lambda *_: None)
    registry._warn_triton_training.cache_clear()
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger="moonep_moe"):
        for kernel in ("triton", "triton", "deep_gemm"):
            monkeypatch.setattr(registry, "fp8_kernel", lambda device, k=kernel: k)
            monkeypatch.setattr(registry, "Fp8GroupedGemm", lambda wgrad, k, fp8_wgrad: k)
            assert fp8_grouped_gemm(TorchGroupedGemm(), cpu, torch.bfloat16, 128) == kernel
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "trains on the Triton FP8 GEMM" in caplog.records[0].getMessage()
    registry._warn_triton_training.cache_clear()


def test_fp8_dispatch_needs_precision_fp8():
    with pytest.raises(ValueError, match="fp8_dispatch=True needs precision='fp8', got precision='bf16'"):
        MoEConfig(**BASE, fp8_dispatch=True)
    assert not MoEConfig(**BASE, precision="fp8").fp8_dispatch


@pytest.mark.parametrize("k", [128, 300])
def test_reference_row_cast_takes_zero_rows(k):
    """A step with no routed rows (every segment empty) casts `[0, K]`: `[0, K]` e4m3 and `[0, ceil(K/128)]`
    scales, no error (the H200 run's all-empty case raised in a reshape)."""
    q, scales = quantise_rows(torch.zeros(0, k))
    assert q.shape == (0, k) and q.dtype == FP8_DTYPE and scales.shape == (0, -(-k // 128))


@pytest.mark.gpu
@needs_fp8
def test_fp8_training_tracks_the_bf16_loss_curve():
    """A student MoonEP layer (the teacher's router, its own experts) regressed onto a fixed
    random teacher layer for 60 AdamW steps (fresh tokens every step, the same in every run; skew from the
    router's expert bias), in bf16, in fp8 and in fp8 with FP8 weight gradients (`fp8_wgrad`, which adds
    into `main_grad`: the optimizer steps from it, as Megatron's do): each fp8
    run's loss stays within 10% of the bf16 run's at
    every step after the first 10 (e4m3 perturbs each GEMM by a few 2^-5, which moves the trajectory but not
    the descent; a sanity bound on the curve, not derived from the format), and both fall below 0.75 of the
    start (bf16 on the CPU: 0.0127 -> 0.0066). The curves are printed."""
    from moonep_moe.transport.threads import single_world

    shapes = dict(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, max_tokens_per_rank=512,
                  dtype="bfloat16", router={"dtype": "float32", "expert_bias": True})
    torch.manual_seed(1)  # the layers draw their init seeds from torch's CPU generator
    teacher = MoonEPMoELayer(MoEConfig(**shapes), single_world("cuda"))
    with torch.no_grad():
        teacher.router.expert_bias.copy_(torch.linspace(0, 0.5, 8))
    curves = {}
    runs = [("bf16", {}), ("fp8", dict(precision="fp8"))]
    if deep_gemm.fp8_unsupported_reason(torch.device("cuda")) is None:  # FP8 weight gradients run on DeepGEMM
        runs.append(("fp8, fp8 wgrad", dict(precision="fp8", fp8_wgrad=True, expert_grad_dtype="main_grad")))
    for name, extra in runs:
        torch.manual_seed(2)  # the same student in every run
        student = MoonEPMoELayer(MoEConfig(**shapes, **extra), single_world("cuda"))
        student.router.load_state_dict(teacher.router.state_dict())
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
        gen = torch.Generator(device="cuda").manual_seed(3)
        losses = []
        for _ in range(60):
            x = torch.randn(512, 256, device="cuda", generator=gen).bfloat16()
            with torch.no_grad():
                target = teacher(x).float()
            loss = (student(x).float() - target).square().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p in student.parameters():
                if hasattr(p, "main_grad"):
                    p.grad = p.main_grad.to(p.dtype)
            optimizer.step()
            if student.config.expert_grad_dtype == "main_grad":
                student.zero_main_grad()
            losses.append(float(loss.detach()))
        curves[name] = losses
    print({name: [round(v, 5) for v in losses[::10] + losses[-1:]] for name, losses in curves.items()})
    bf16 = torch.tensor(curves["bf16"])
    for name in curves:
        losses = torch.tensor(curves[name])
        assert losses[-1] < 0.75 * losses[0], (name, curves[name])
        if name != "bf16":
            gap = ((losses[10:] - bf16[10:]).abs() / bf16[10:]).max()
            assert gap < 0.1, (name, float(gap))
