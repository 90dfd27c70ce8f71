"""FP8 weight gradients (`MoEConfig.fp8_wgrad`): the operands' cast (`fp8.cast.cast_columns`) bit for bit
against the reference (`fp8.format.quantise_columns`; interpreted on the CPU, compiled on a GPU), the
reference quantiser's error against float64, `Fp8WeightGradient`'s parts and modes on a torch stand-in of
DeepGEMM's kernel (`k_grouped_fp8_reference`) against the float64 product within the format's bound, the
host list's stand-in, the config; on an sm90 GPU with DeepGEMM, its k-grouped FP8 kernel against the
reference, and the stand-in list against the true one.

The bound (`wgrad_bound`, derived as `test_fp8.fp8_gemm_bound`): each operand value ``v`` rounds to e4m3
within ``e = max(2^-4 |v|, 2^-10 s)`` (s its column's scale over its 128-row block), so ``dW = dy^T x`` is off
by at most ``sum_rows (e_dy |x| + |dy| e_x + e_dy e_x)``, plus 2^-8 of ``sum |dy'| |x'|`` for the tensor
cores' sum of each 128-row step before DeepGEMM promotes it to fp32 and a bf16 output's rounding.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8 import HALF_STEP, SUBNORMAL_HALF_STEP, bits, spread
from test_plan_kernel import KERNEL_DEVICE

from moonep_moe.base.sizes import BLOCK_TOKEN_PADDING
from moonep_moe.config import MoEConfig
from moonep_moe.fp8.format import BLOCK, dequantise_columns, quantise_columns
from moonep_moe.gemm.deep_gemm import standin_sizes
from moonep_moe.gemm.fp8 import Fp8WeightGradient, k_grouped_fp8_reference

F64 = torch.float64
SEGMENTS = {"skewed": [384, 0, 128, 256, 0, 128], "one": [0, 0, 512, 0, 0, 0], "all empty": [0] * 6}


def ends_of(sizes: list[int], device=KERNEL_DEVICE) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0).int()


@pytest.mark.parametrize(("groups", "rows"), [(1, 128), (32, 65536 + 32 * 128), (48, 128 * 7), (8, 0),
                                              (256, 128 * 1000)])
def test_standin_sizes_have_the_count_the_sum_and_the_alignment(groups, rows):
    sizes = standin_sizes(groups, rows)
    assert len(sizes) == groups and sum(sizes) == rows
    assert all(size % BLOCK_TOKEN_PADDING == 0 and size >= 0 for size in sizes)
    assert max(sizes) - min(sizes) <= BLOCK_TOKEN_PADDING  # dealt evenly: the largest (the config's input)
    # near the mean


def test_quantise_columns_error_within_half_an_e4m3_step():
    sizes, cols = [256, 0, 128], 200
    x = spread(512, cols, seed=3)
    q, scales = quantise_columns(x.float(), sizes)
    got = torch.cat(dequantise_columns(q, scales, sizes))
    want = x[:384]
    scale = scales.double().repeat_interleave(BLOCK, 1)[:, :384].t()
    bound = torch.maximum(HALF_STEP * want.abs(), SUBNORMAL_HALF_STEP * scale)
    assert ((got - want).abs() <= bound).all()
    assert (scale * 448 >= want.abs()).all() and (scale * 224 < want.abs().amax(0, keepdim=True).clamp(
        min=2.0**-100)).all(), "each column's scale is the smallest power of two that fits its 128 rows"


@pytest.mark.oldest_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("first", "last"), [(0, 6), (0, 3), (3, 6), (2, 3), (1, 2), (5, 6)])
def test_cast_columns_matches_reference_bit_for_bit(first, last, dtype):
    """A range of segments (skewed, with empty ones) packed from row 0, rows past the last segment (NaN:
    unused capacity) never read; 77 rows past a multiple of 128, so the capacity rounds up."""
    from moonep_moe.fp8.cast import cast_columns

    sizes, cols = SEGMENTS["skewed"], 72
    rows = sum(sizes) + 77
    x = spread(rows, cols, seed=first).to(dtype)
    x[sum(sizes):] = float("nan")
    q, scales = cast_columns(x.to(KERNEL_DEVICE), ends_of(sizes), first, last)
    assert q.numel() == (sum(sizes) + 128) * cols and scales.shape == (cols, (sum(sizes) + 128) // BLOCK)
    assert scales.stride() == (1, 72), "DeepGEMM's sm90 scale layout: MN-major, 16-byte aligned"
    part, base = sizes[first:last], sum(sizes[:first])
    used = sum(part)
    want_q, want_scales = quantise_columns(torch.cat([x[base:base + used],
                                                      x.new_zeros(q.numel() // cols - used, cols)]), part)
    assert torch.equal(bits(q.cpu()[:used * cols]), bits(want_q[:used * cols]))
    assert torch.equal(scales.cpu()[:, :used // BLOCK], want_scales[:, :used // BLOCK])


@pytest.mark.oldest_triton
def test_zero_filled_groups_clears_only_groups_with_rows():
    from moonep_moe.gemm.kernels.wgrad import zero_filled_groups

    sizes = [128, 0, 256, 0]
    out = torch.full((3, 5, 7), 3.0, device=KERNEL_DEVICE)
    zero_filled_groups(out, ends_of(sizes), first_group=1)  # out holds groups 1, 2, 3
    assert (out[0] == 3).all() and (out[1] == 0).all() and (out[2] == 3).all()


def wgrad_bound(dy: torch.Tensor, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Per segment, the elementwise bound on ``|FP8 dW - exact dW|`` (module docstring), float64."""
    out, start = [], 0
    for size in sizes:
        errors, magnitudes = [], []
        for v in (dy[start:start + size], x[start:start + size]):
            scale = torch.zeros_like(v)
            if size:
                _, scales = quantise_columns(v.float(), [size])
                scale = scales.double().repeat_interleave(BLOCK, 1).t()
            errors.append(torch.maximum(HALF_STEP * v.abs(), SUBNORMAL_HALF_STEP * scale))
            magnitudes.append(v.abs())
        (e_dy, e_x), (a_dy, a_x) = errors, magnitudes
        out.append(e_dy.t() @ a_x + a_dy.t() @ e_x + e_dy.t() @ e_x
                   + 2.0**-8 * (a_dy + e_dy).t() @ (a_x + e_x))
        start += size
    return out


def reference_wgrad() -> Fp8WeightGradient:
    """`Fp8WeightGradient` on the torch stand-in of DeepGEMM's kernel, casting with the kernels (any
    device)."""
    return Fp8WeightGradient(kernel=k_grouped_fp8_reference)


@pytest.mark.parametrize("case", list(SEGMENTS))
def test_fp8_weight_gradient_parts_and_modes_within_the_format_bound(case):
    """fp32 home gradients overwritten (every group) and added into (``main_grad``), fp32 slot gradients
    overwritten: each within `wgrad_bound` of the float64 product of the bf16 operands; an empty slot keeps
    what it held (an unused slot); the home gradient of an empty segment is zero when overwritten."""
    sizes, (cols, inner) = SEGMENTS[case], (96, 80)
    dev, gen = torch.device(KERNEL_DEVICE), torch.Generator().manual_seed(len(case))
    rows = sum(sizes) + 128
    dy = torch.randn(rows, cols, generator=gen).bfloat16()
    x = torch.randn(rows, inner, generator=gen).bfloat16()
    slots = torch.full((2, cols, inner), 5.0, device=dev)  # groups 4 and 5
    home = torch.full((4, cols, inner), 9.0, device=dev)
    wgrad = reference_wgrad()
    got_home, got_slots = wgrad.wgrad(dy.to(dev), x.to(dev), ends_of(sizes), (home, slots), accumulate=False)
    assert got_home is home and got_slots is slots
    ends = ends_of(sizes, "cpu").tolist()
    exact = [dy[s:e].double().t() @ x[s:e].double() for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    bound = wgrad_bound(dy.double(), x.double(), sizes)
    for g, (want, limit) in enumerate(zip(exact, bound, strict=True)):
        got = (home[g] if g < 4 else slots[g - 4]).cpu().double()
        if sizes[g] == 0 and g >= 4:
            assert (got == 5).all(), f"group {g}: an unused slot is not written"
            continue
        assert ((got - want).abs() <= limit).all(), f"group {g}: worst error / bound " \
            f"{float(((got - want).abs() / limit.clamp(min=1e-30)).max()):.2f}"
    main_grad = torch.ones(4, cols, inner, device=dev)  # fp32 home gradients ("main_grad"): added into
    added, _ = wgrad.wgrad(dy.to(dev), x.to(dev), ends_of(sizes), (main_grad, slots), accumulate=True)
    assert added is main_grad
    for g in range(4):
        assert ((added[g].cpu().double() - 1 - exact[g]).abs() <= bound[g]).all(), f"main_grad group {g}"


@pytest.mark.parametrize("home", ["bf16", "fresh", "strided"])
def test_fp8_weight_gradient_refuses_a_gradient_it_cannot_add_into(home):
    """Only contiguous fp32 gradients: a bf16 `.grad`, a fresh one (None: made in dy's bf16) or a strided
    fp32 view is refused before any cast, naming the part."""
    dev, sizes, (cols, inner) = torch.device(KERNEL_DEVICE), [128, 128], (64, 48)
    dy = torch.randn(256, cols, device=dev).bfloat16()
    x = torch.randn(256, inner, device=dev).bfloat16()
    part = {"bf16": torch.zeros(2, cols, inner, device=dev, dtype=torch.bfloat16), "fresh": None,
            "strided": torch.zeros(2, inner, cols, device=dev).transpose(1, 2)}[home]
    with pytest.raises(ValueError, match=r"contiguous fp32 gradients .*got out\[0\]"):
        reference_wgrad().wgrad(dy, x, ends_of(sizes), (part, torch.zeros(0, cols, inner, device=dev)),
                                accumulate=home == "bf16")


def test_the_bound_fails_when_a_segment_is_misplaced():
    """`wgrad_bound` is tight enough to catch a layout error: the gradient of the rows one 128-row block off
    (what a wrong packing offset gives) is outside it."""
    sizes = [256, 256]
    gen = torch.Generator().manual_seed(7)
    dy, x = torch.randn(512, 64, generator=gen, dtype=F64), torch.randn(512, 48, generator=gen, dtype=F64)
    bound = wgrad_bound(dy, x, sizes)[0]
    shifted = dy[128:384].t() @ x[128:384]
    assert not ((shifted - dy[:256].t() @ x[:256]).abs() <= bound).all()


@pytest.mark.parametrize("wrong", [dict(expert_grad_dtype="main_grad"), dict(precision="fp8")])
def test_fp8_wgrad_config_needs_precision_fp8_and_main_grad(wrong):
    fields = dict(hidden_size=256, num_experts=8, top_k=2, max_tokens_per_rank=64, ffn_hidden_size=128)
    assert MoEConfig(**fields).fp8_wgrad is False
    assert MoEConfig(**fields, precision="fp8", expert_grad_dtype="main_grad", fp8_wgrad=True).fp8_wgrad
    with pytest.raises(ValueError, match=r"needs precision='fp8', .*expert_grad_dtype='main_grad'"):
        MoEConfig(**fields, **wrong, fp8_wgrad=True)


def test_fp8_layer_refuses_fp8_wgrad_where_the_fp8_gemm_is_triton(monkeypatch):
    from moonep_moe.gemm import registry
    from moonep_moe.gemm.torch_native import TorchGroupedGemm

    monkeypatch.setattr(registry, "fp8_unsupported_reason", lambda *_: None)
    monkeypatch.setattr(registry, "fp8_kernel", lambda device: "triton")
    with pytest.raises(ValueError, match=r"fp8_wgrad=True cannot run here \(rank 3\)"):
        registry.fp8_grouped_gemm(TorchGroupedGemm(), torch.device("cpu"), torch.bfloat16, 128, 3, True)


def test_fp8_backend_refuses_fp8_wgrad_without_deep_gemm():
    from moonep_moe.gemm.fp8 import Fp8GroupedGemm
    from moonep_moe.gemm.torch_native import TorchGroupedGemm

    with pytest.raises(ValueError, match="fp8_wgrad runs on DeepGEMM's sm90 k-grouped FP8 GEMM"):
        Fp8GroupedGemm(TorchGroupedGemm(), kernel="triton", fp8_wgrad=True)


def deep_gemm_or_skip():
    from moonep_moe.gemm.deep_gemm import fp8_unsupported_reason, import_deep_gemm

    if not torch.cuda.is_available():
        pytest.skip("DeepGEMM's FP8 k-grouped GEMM needs a CUDA GPU")
    reason = fp8_unsupported_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    return import_deep_gemm()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["skewed", "one"])
def test_deep_gemm_fp8_wgrad_matches_the_reference_with_a_standin_list(case):
    """DeepGEMM's sm90 k-grouped FP8 GEMM on `cast_columns`' operands: the stand-in host list gives the
    true list's bits, and both are within 2^-8 of the summed magnitudes of the exactly dequantised product
    (`k_grouped_fp8_reference`): the tensor cores' sum of each 128-row step before the fp32 promotion; no
    host sync after a warm-up; an empty segment keeps its accumulator."""
    dg = deep_gemm_or_skip()
    from moonep_moe.fp8.cast import cast_columns

    sizes, (cols, inner) = SEGMENTS[case], (512, 384)
    ends = ends_of(sizes, "cuda")
    rows = sum(sizes) + 128
    gen = torch.Generator().manual_seed(11)
    dy = torch.randn(rows, cols, generator=gen).bfloat16().cuda()
    x = torch.randn(rows, inner, generator=gen).bfloat16().cuda()
    a, b = cast_columns(dy, ends, 0, len(sizes)), cast_columns(x, ends, 0, len(sizes))
    sizes_g = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    start = torch.randn(len(sizes), cols, inner, generator=gen).cuda()
    outs = {}
    true = [*sizes[:-1], sizes[-1] + 128]  # the host list covers every row: the last segment takes the tail
    for name, host in (("true", true), ("standin", standin_sizes(len(sizes), rows))):
        d = start.clone()
        dg.k_grouped_fp8_gemm_nt_contiguous(a, b, d, host, sizes_g, d)
        outs[name] = d
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        d = start.clone()
        dg.k_grouped_fp8_gemm_nt_contiguous(a, b, d, standin_sizes(len(sizes), rows), sizes_g, d)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(outs["true"], outs["standin"]) and torch.equal(d, outs["standin"])
    want = start.clone()
    k_grouped_fp8_reference(a, b, want, standin_sizes(len(sizes), rows), sizes_g, want)
    magnitude = torch.zeros_like(want)
    for g, (da, db) in enumerate(zip(dequantise_columns(*a, sizes, torch.float32),
                                     dequantise_columns(*b, sizes, torch.float32), strict=True)):
        magnitude[g] = da.abs().t() @ db.abs()
        if sizes[g] == 0:
            assert torch.equal(d[g], start[g])
    assert ((d - want).abs() <= 2.0**-8 * magnitude + 2.0**-20 * want.abs()).all()


@pytest.mark.gpu
def test_fp8_weight_gradient_on_deep_gemm_matches_its_reference_stand_in():
    """`Fp8WeightGradient` on DeepGEMM against the same class on `k_grouped_fp8_reference`, fp32 home and
    slot gradients overwritten, within the tensor cores' 2^-8."""
    deep_gemm_or_skip()
    sizes, (cols, inner) = SEGMENTS["skewed"], (256, 384)
    gen = torch.Generator().manual_seed(13)
    rows = sum(sizes) + 128
    dy = torch.randn(rows, cols, generator=gen).bfloat16().cuda()
    x = torch.randn(rows, inner, generator=gen).bfloat16().cuda()
    def parts():
        return torch.full((4, cols, inner), 9.0, device="cuda"), torch.zeros(2, cols, inner, device="cuda")

    got = Fp8WeightGradient().wgrad(dy, x, ends_of(sizes, "cuda"), parts(), False)
    want = reference_wgrad().wgrad(dy, x, ends_of(sizes, "cuda"), parts(), False)
    bound = wgrad_bound(dy.cpu().double(), x.cpu().double(), sizes)
    for part_got, part_want, first in zip(got, want, (0, 4), strict=True):
        for g in range(part_got.shape[0]):
            error = (part_got[g].double() - part_want[g].double()).abs().cpu()
            assert (error <= bound[first + g] + 2.0**-8 * part_want[g].double().abs().cpu()).all()
