"""The pure logic of bench/layer.py and bench/common.py: useful FLOPs, the spread of repeated timings, the
variant list, and the grouping of a step's GPU kernels by name."""

import re
from pathlib import Path

import pytest

from bench.common import spread
from bench.layer import KERNEL_GROUPS, kernel_group, profile_summary, routed_flops, variant_settings

PACKAGE = Path(__file__).resolve().parent.parent / "moonep_moe"


def test_routed_flops_count_three_projections_on_the_routed_rows():
    # DeepSeek-V3 at EP=1: 8192 tokens x 8 routes, H=7168, H'=2048; gate, up and down, 2 FLOPs per MAC
    fwd = 3 * 2 * 8192 * 8 * 7168 * 2048
    assert routed_flops(8192, 8, 7168, 2048, backward=False) == fwd == 5_772_436_045_824
    assert routed_flops(8192, 8, 7168, 2048, backward=True) == 3 * fwd  # + dgrad + wgrad
    # issue 13: torch-native's 50.1 ms fwd+bwd is 345 TFLOP/s of routed work
    assert routed_flops(8192, 8, 7168, 2048, backward=True) / 50.1e-3 / 1e12 == pytest.approx(345.6, abs=0.1)


def test_spread_is_the_median_and_min_max_in_ms():
    stats = spread([0.003, 0.001, 0.002, 0.010, 0.004])
    assert stats["ms"] == pytest.approx(3.0)
    assert (stats["ms_min"], stats["ms_max"]) == pytest.approx((1.0, 10.0))
    assert stats["ms_samples"] == pytest.approx([3.0, 1.0, 2.0, 10.0, 4.0]), "every run, in the order run"
    assert spread([0.001, 0.002, 0.004, 0.008])["ms"] == pytest.approx(3.0), "even count: mean of the middle"
    with pytest.raises(ValueError, match="at least one timing"):
        spread([])


def test_variant_settings_default_list_and_grid():
    default = variant_settings(["auto", "triton", "torch", "deep_gemm"], ["auto"], [])
    assert default == [
        {"grouped_gemm": "auto", "expert_grad_dtype": "param"},
        {"grouped_gemm": "auto", "expert_grad_dtype": "main_grad"},
        {"grouped_gemm": "triton", "expert_grad_dtype": "param"},
        {"grouped_gemm": "torch", "expert_grad_dtype": "param"},
        {"grouped_gemm": "deep_gemm", "expert_grad_dtype": "param"},
    ], "no token_padding: each backend at the config's default"
    grid = variant_settings(["torch"], ["triton"], [16, 128])
    assert grid == [
        {"grouped_gemm": "torch", "expert_grad_dtype": "param", "token_padding": 16},
        {"grouped_gemm": "triton", "expert_grad_dtype": "main_grad", "token_padding": 16},
        {"grouped_gemm": "torch", "expert_grad_dtype": "param", "token_padding": 128},
        {"grouped_gemm": "triton", "expert_grad_dtype": "main_grad", "token_padding": 128},
    ]
    assert variant_settings([], [], []) == [], "--backends --main-grad-backends: the DEFAULT row only"


KERNELS = [
    # GEMMs: cuBLAS (bf16), CUTLASS (torch._grouped_mm), DeepGEMM, the Triton wgrad, inductor templates
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN", "GEMMs"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "GEMMs"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
     "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, float> > >(...)", "GEMMs"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off",
     "GEMMs"),
    ("void deep_gemm::sm90_m_grouped_bf16_gemm_contiguous_impl<128u, 7168u>(...)", "GEMMs"),
    ("_grouped_wgrad_kernel", "GEMMs"),
    ("triton_tem_fused_mm_0", "GEMMs"),
    # fp32 GEMMs are the routers'
    ("nvjet_sss_tf32_128x256_TNT", "router"),
    ("sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x32_execute_segment_k_off_kernel", "router"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nt_align1>(...)", "router"),
    # comm core: the package's kernels, the native layer's sort / gather / index_add
    ("_send_routes_kernel", "comm core"),
    ("_gather_routes_kernel", "comm core"),
    ("_plan_kernel", "comm core"),
    ("_destinations_kernel", "comm core"),
    ("_add_replicas_kernel", "comm core"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...> >(long, ...)",
     "comm core"),
    ("void at::native::(anonymous namespace)::indexFuncLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, "
     "-2, true, at::native::(anonymous namespace)::ReduceAdd>(...)", "comm core"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int>(...)",
     "comm core"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<"
     "long, long, unsigned int>::Policy900>(...)", "comm core"),
    ("void at_cuda_detail::cub::DeviceRadixSortHistogramKernel<...>(...)", "comm core"),
    # router: scores, top-k and its sort, the route-weight gather / scatter, the histogram
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)", "router"),
    ("void at::native::mbtopk::radixFindKthValues<float, unsigned int, unsigned int, 2>(...)", "router"),
    ("void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long, at::native::GTOp<float, true>, "
     "unsigned int>(...)", "router"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(...)", "router"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, "
     "at::native::(anonymous namespace)::SoftMaxBackwardEpilogue>(...)", "router"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 4, ...>(int, ...)", "router"),
    ("void at::cuda::kernelHistogram1D<long, long, long, 1, 2, -1, "
     "(at::cuda::CUDAHistogramMemoryType)0>(...)", "router"),
    # elementwise: torch's pointwise and reduce kernels, SwiGLU, inductor's fused kernels
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", "elementwise"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
     "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}> >(int, ...)",
     "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}"
     ">, unsigned int, float, 4, 4> >(...)", "elementwise"),
    ("_swiglu_fwd_kernel", "elementwise"),
    ("_swiglu_bwd_kernel", "elementwise"),
    ("triton_poi_fused_mul_silu_0", "elementwise"),
    ("triton_red_fused_sum_1", "elementwise"),
    # other: copies, fills, scans
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("Memset (Device)", "other"),
    ("void at_cuda_detail::cub::DeviceScanKernel<...>(...)", "other"),
]


@pytest.mark.parametrize(("name", "group"), KERNELS, ids=[name[:40] for name, _ in KERNELS])
def test_kernel_group_by_name(name, group):
    assert kernel_group(name) == group


def kernel_names(path: Path) -> list[str]:
    """The Triton kernels a package file defines (`def _..._kernel(` after `@triton.jit`)."""
    return re.findall(r"^def (_\w+_kernel)\(", path.read_text(), flags=re.MULTILINE)


@pytest.mark.parametrize(("files", "group"), [("comm/kernels/*.py", "comm core"),
                                              ("layers/kernels/wgrad.py", "GEMMs"),
                                              ("layers/kernels/swiglu.py", "elementwise")])
def test_every_package_kernel_has_its_group(files, group):
    names = [name for path in sorted(PACKAGE.glob(files)) for name in kernel_names(path)]
    assert names, f"no kernels found in moonep_moe/{files}"
    assert {name: kernel_group(name) for name in names} == {name: group for name in names}


def test_profile_summary_sums_calls_and_groups():
    launches = [("_grouped_wgrad_kernel", 4.0), ("nvjet_hsh_256x128", 2.5), ("_send_routes_kernel", 0.5),
                ("_grouped_wgrad_kernel", 3.0), ("Memcpy DtoD (Device -> Device)", 0.25),
                ("_send_routes_kernel", 0.5), ("_swiglu_fwd_kernel", 1.0)]
    summary = profile_summary(launches)
    assert summary["total_ms"] == pytest.approx(11.75)
    assert list(summary["groups_ms"]) == list(KERNEL_GROUPS), "every group, in the printed order"
    assert summary["groups_ms"] == pytest.approx({"GEMMs": 9.5, "comm core": 1.0, "router": 0.0,
                                                  "elementwise": 1.0, "other": 0.25})
    assert summary["kernels"] == [
        {"name": "_grouped_wgrad_kernel", "group": "GEMMs", "calls": 2, "ms": 7.0},
        {"name": "nvjet_hsh_256x128", "group": "GEMMs", "calls": 1, "ms": 2.5},
        {"name": "_send_routes_kernel", "group": "comm core", "calls": 2, "ms": 1.0},
        {"name": "_swiglu_fwd_kernel", "group": "elementwise", "calls": 1, "ms": 1.0},
        {"name": "Memcpy DtoD (Device -> Device)", "group": "other", "calls": 1, "ms": 0.25},
    ], "one entry per name, longest total first, ties by name"
    assert profile_summary([]) == {"total_ms": 0, "groups_ms": dict.fromkeys(KERNEL_GROUPS, 0),
                                   "kernels": []}


def test_ep_rank_groups_are_a_ranks_home_experts_and_as_many_slots():
    from bench.layer import ep_rank_groups

    assert ep_rank_groups(256, 8) == (32, 32), "DeepSeek-V3 at EP=8: 32 home + 32 slot groups"
    assert ep_rank_groups(384, 8) == (48, 48), "Kimi-K2 at EP=8"
    for experts, ranks in ((256, 1), (256, 3)):
        with pytest.raises(ValueError, match=f"--ep-rank-of {ranks}"):
            ep_rank_groups(experts, ranks)


def test_ep_rank_layer_equals_a_layer_whose_slot_experts_copy_the_home_ones():
    """`as_ep_rank`: epn home + epn slot groups of one rank, the slots holding experts 0..epn-1 (the
    prefetch stand-in), equal a plain layer over 2*epn experts whose experts epn+j copy experts j; the home
    gradients are the sums of both copies' (the reduce_grad stand-in), the rest identical."""
    import torch

    from bench.layer import RankOfEPBuffer, as_ep_rank
    from moonep_moe.comm.world import single_world
    from moonep_moe.config import MoEConfig
    from moonep_moe.layers.moe import MoonEPMoELayer

    epn, tokens, hidden = 4, 48, 16
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=8, num_experts=2 * epn, top_k=3,
                    max_tokens_per_rank=tokens, dtype="float64", token_padding=4,
                    router={"dtype": "float64"})
    torch.manual_seed(0)
    rank = as_ep_rank(MoonEPMoELayer(cfg, single_world("cpu")), epn)
    plain = MoonEPMoELayer(cfg, single_world("cpu"))
    with torch.no_grad():
        plain.router.weight.copy_(rank.router.weight)
        plain.experts.gate_up.copy_(rank.experts.gate_up.repeat(2, 1, 1))
        plain.experts.down.copy_(rank.experts.down.repeat(2, 1, 1))
    assert isinstance(rank._state.buffer, RankOfEPBuffer)
    assert rank.experts.gate_up.shape[0] == epn and rank.experts.num_slots == epn
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    grad = torch.randn(tokens, hidden, dtype=torch.float64)
    outs = []
    for layer in (rank, plain):
        x_th = x.clone().requires_grad_()
        out = layer(x_th)
        out.backward(grad)
        outs.append((out, x_th.grad, layer.router.weight.grad))
    for mine, ref in zip(*outs, strict=True):
        torch.testing.assert_close(mine, ref)
    for name in ("gate_up", "down"):
        ref = getattr(plain.experts, name).grad
        torch.testing.assert_close(getattr(rank.experts, name).grad, ref[:epn] + ref[epn:])
    assert int(rank._state.last_plan.cu_seqlens[-1]) >= tokens * 3, "every route in the rank's groups"
