"""The pure logic of bench.layer, the modules it is made of (bench.layer_measure, bench.layer_tables,
bench.layer_targets, bench.layer_step, bench.kernel_profile) and bench/common.py: useful FLOPs, the spread of
repeated timings and the ratios and targets computed on it, the model presets and tables, the variant list,
the grouping of a step's GPU kernels by name, and the CPU smoke run."""

import re
from pathlib import Path

import pytest
import torch

from bench.common import MODELS, check, format_check, model_shape, ratio, spread, total
from bench.kernel_profile import (
    KERNEL_GROUPS,
    kernel_group,
    print_profile,
    profile_lines,
    profile_summary,
    timeline_profile,
)
from bench.layer import FP8_SETTINGS, MICRO_BATCHES, PER_STEP, main, table_variants, variant_settings
from bench.layer_measure import routed_flops
from bench.layer_step import step
from bench.layer_tables import MODEL_TABLES, make_table
from bench.layer_targets import (
    EP_RANK_TARGETS,
    FP8_LAYER_TARGETS,
    LAYER_TARGETS,
    MODEL_LAYER_TARGETS,
    PER_STEP_FP8_TARGETS,
    fp8_layer_targets,
    fp8_scope,
    layer_targets,
)
from moonep_moe.config import MoEConfig

PACKAGE = Path(__file__).resolve().parent.parent / "moonep_moe"


def test_routed_flops_count_three_projections_on_the_routed_rows():
    # DeepSeek-V3 at EP=1: 8192 tokens x 8 routes, H=7168, H'=2048; gate, up and down, 2 FLOPs per MAC
    fwd = 3 * 2 * 8192 * 8 * 7168 * 2048
    assert routed_flops(8192, 8, 7168, 2048, backward=False) == fwd == 5_772_436_045_824
    assert routed_flops(8192, 8, 7168, 2048, backward=True) == 3 * fwd  # + dgrad + wgrad
    # torch-native's 50.1 ms fwd+bwd is 345 TFLOP/s of routed work
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
    # fp32 GEMMs, and bf16 GEMMs with fp32 output (the bf16x3 router), are the routers'
    ("nvjet_sss_tf32_128x256_TNT", "router"),
    ("nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT", "router"),
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
                                              ("plan/triton.py", "comm core"),
                                              ("gemm/kernels/wgrad.py", "GEMMs"),
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
    assert summary["beyond_gemms_ms"] == pytest.approx(2.25), "every group but the GEMMs"
    assert summary["kernels"] == [
        {"name": "_grouped_wgrad_kernel", "group": "GEMMs", "calls": 2, "ms": 7.0},
        {"name": "nvjet_hsh_256x128", "group": "GEMMs", "calls": 1, "ms": 2.5},
        {"name": "_send_routes_kernel", "group": "comm core", "calls": 2, "ms": 1.0},
        {"name": "_swiglu_fwd_kernel", "group": "elementwise", "calls": 1, "ms": 1.0},
        {"name": "Memcpy DtoD (Device -> Device)", "group": "other", "calls": 1, "ms": 0.25},
    ], "one entry per name, longest total first, ties by name"
    assert profile_summary([]) == {"total_ms": 0, "groups_ms": dict.fromkeys(KERNEL_GROUPS, 0),
                                   "beyond_gemms_ms": 0, "kernels": []}


def test_timeline_profile_groups_the_launches_and_says_where_the_gpu_idled(capsys):
    """A step's timeline (launches on two streams, overlapping) -> the kernels' summary of their durations
    and the idle time no launch covers, its longest gap named by the kernels around it; printed as a line."""
    timeline = [("_plan_kernel", 1.0, 1.5), ("_grouped_wgrad_kernel", 3.0, 9.0),
                ("_send_routes_kernel", 4.0, 5.0), ("_swiglu_fwd_kernel", 9.25, 9.75)]
    profile = timeline_profile(timeline)
    assert profile["total_ms"] == 8.0 and profile["groups_ms"]["GEMMs"] == 6.0
    idle = profile["timeline"]
    assert (idle["span_ms"], idle["busy_ms"], idle["idle_ms"]) == (8.75, 7.0, 1.75)
    assert idle["gaps"][0] == {"ms": 1.5, "after": "_plan_kernel", "before": "_grouped_wgrad_kernel"}
    print_profile("ours", profile)
    assert "GPU idle 1.75 of 8.75 ms; longest gaps: 1.500 ms after _plan_kernel before _grouped_wgrad" \
        in capsys.readouterr().out


def test_profile_lines_say_where_the_time_beyond_the_gemms_goes():
    summary = profile_summary([("_grouped_wgrad_kernel", 6.0), ("_send_routes_kernel", 1.0),
                               ("_swiglu_fwd_kernel", 0.5), ("Memcpy DtoD (Device -> Device)", 0.5),
                               ("void at::native::sbtopk::gatherTopK<float>", 2.0)])
    lines = profile_lines("ours", summary)
    assert lines[0] == "ours: one step, 10.00 ms of GPU kernels"
    by_group = {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert list(by_group) == ["GEMMs", "comm", "router", "elementwise", "other"], "every group, in order"
    assert by_group["GEMMs"] == ["6.00", "60.0%"], "no share of the time beyond the GEMMs for the GEMMs"
    assert by_group["comm"] == ["core", "1.00", "10.0%", "25.0%"]
    assert by_group["router"] == ["2.00", "20.0%", "50.0%"]
    assert by_group["elementwise"] == ["0.50", "5.0%", "12.5%"]
    assert by_group["other"] == ["0.50", "5.0%", "12.5%"]
    assert lines[-1] == "  time beyond the GEMMs: 4.00 ms, 40.0% of the step"


def test_ep_rank_layer_runs_the_real_ranks_padding_and_grouped_gemm_problem(monkeypatch):
    """One EP rank's stand-in (a one-rank layer over 2 * epn experts) runs what the real rank's config gives:
    `Table.config` resolves a `token_padding` left out from the group's config (Kimi-K2 at S=2048: 341 rows a
    home expert, 128; the stand-in's own config, 2 * epn experts, would see 170 and say 16), a given one
    wins, and `as_ep_rank` with a plan takes the grouped GEMM picked for the rank's problem: epn home groups
    of S * K / epn rows and epn slots, not 2 * epn groups of half that."""
    import torch

    import moonep_moe.layers.moe as moe
    from bench.ep_rank import RankPlan, as_ep_rank
    from moonep_moe.config import MoEConfig
    from moonep_moe.layers.moe import MoonEPMoELayer
    from moonep_moe.transport.threads import single_world

    kimi = make_table("kimi-k2", 8, {"tokens": 2048})
    assert MoEConfig(**kimi.shapes).token_padding == 16 and kimi.config({}).token_padding == 128
    assert kimi.config({"token_padding": 16}).token_padding == 16
    assert make_table("kimi-k2", None, {}).config({}).token_padding == 16, "EP=1: 170 rows an expert"
    seen = []
    select = moe.select_grouped_gemm
    monkeypatch.setattr(moe, "select_grouped_gemm", lambda *args, problem, **kwargs:
                        seen.append((problem.rows_per_group, problem.groups)) or
                        select(*args, problem=problem, **kwargs))
    epn, tokens, top_k = 4, 12, 2
    plan = RankPlan(ranks=2, rank=0, home_routes=(5, 6, 0, 4), slot_routes=(0, 3, 0, 6), maxvio=1.0,
                    sigma=0.1)
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=2 * epn, top_k=top_k,
                    max_tokens_per_rank=tokens, dtype="float64", token_padding=4, router={"dtype": "float64"})
    torch.manual_seed(0)
    as_ep_rank(MoonEPMoELayer(cfg, single_world("cpu")), epn, plan)
    assert seen == [(tokens * top_k // (2 * epn), (2 * epn, 0)), (tokens * top_k // epn, (epn, epn))]


def test_ratio_of_spans_is_the_medians_ratio_with_every_pairing_of_runs():
    assert ratio((6.0, 4.0, 8.0), (2.0, 1.0, 4.0)) == pytest.approx((3.0, 1.0, 8.0)), "min/max .. max/min"
    assert ratio(10.0, (5.0, 4.0, 8.0)) == pytest.approx((2.0, 1.25, 2.5)), "a number is measured once"
    assert ratio((5.0, 4.0, 8.0), 2.0) == pytest.approx((2.5, 2.0, 4.0))
    assert ratio(3.0, 2.0) == pytest.approx((1.5, 1.5, 1.5))
    assert total((1.0, 0.5, 2.0), (2.0, 1.5, 3.0), (3.0, 3.0, 3.0)) == pytest.approx((6.0, 5.0, 8.0))


def test_check_passes_on_the_median_and_keeps_the_spread():
    low = check("fwd of dense", (0.80, 0.70, 0.90), ">=", 0.85, row="ours")
    assert low == {"target": "fwd of dense", "median": 0.80, "min": 0.70, "max": 0.90, "op": ">=",
                   "bound": 0.85, "pass": False, "row": "ours"}, "a max above the bound does not pass"
    assert check("fwd of dense", (0.85, 0.80, 0.90), ">=", 0.85)["pass"], "the bound itself passes"
    assert check("peak", 0.95, "<=", 0.9) == check("peak", (0.95, 0.95, 0.95), "<=", 0.9), "measured once"
    assert not check("peak", 0.95, "<=", 0.9)["pass"]
    assert check("peak", 0.89, "<=", 0.9)["pass"]
    assert format_check(low) == "MISS  fwd of dense: 0.800 (0.700-0.900), target >= 0.85"
    assert format_check(check("peak", 0.5, "<=", 0.9)) == "PASS  peak: 0.500 (0.500-0.500), target <= 0.9"
    with pytest.raises(ValueError, match="op must be one of"):
        check("peak", 0.5, "<", 0.9)


def test_model_shapes_come_from_the_packaged_configs():
    # the models' shapes: DeepSeek-V3 (7168, 2048, 256, 8), Qwen3-MoE-30B-A3B (2048, 768, 128, 8),
    # Mixtral-8x7B (4096, 14336, 8, 2), Kimi-K2 (DeepSeek-V3's experts, 384 of them); 8192 tokens, EP=8
    expected = {"deepseek-v3": (7168, 2048, 256, 8), "kimi-k2": (7168, 2048, 384, 8),
                "qwen3-moe-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
    assert set(MODELS) == set(expected)
    for model, (hidden, ffn, experts, top_k) in expected.items():
        assert model_shape(model) == {"hidden": hidden, "ffn": ffn, "experts": experts, "top_k": top_k,
                                      "tokens": 8192, "ep_size": 8}, model


def test_model_tables_are_the_whole_table():
    tables = [make_table(model, ep_rank_of, {}) for model, ep_rank_of in MODEL_TABLES]
    shapes = [(t.label, t.shapes["num_experts"], t.shapes["top_k"], t.hidden, t.ffn, t.tokens)
              for t in tables]
    assert shapes == [("deepseek-v3 EP=1", 256, 8, 7168, 2048, 8192),
                      ("deepseek-v3 one rank of EP=8", 64, 8, 7168, 2048, 8192),  # 32 home + 32 slots
                      ("kimi-k2 one rank of EP=8", 96, 8, 7168, 2048, 8192),  # 48 home + 48 slots
                      ("qwen3-moe-30b-a3b EP=1", 128, 8, 2048, 768, 8192),
                      ("mixtral-8x7b EP=1", 8, 2, 4096, 14336, 8192)]
    assert [t.epn for t in tables] == [None, 32, 48, None, None]
    assert [t.record_name for t in tables] == ["layer-deepseek-v3", "layer-deepseek-v3-ep8-rank",
                                               "layer-kimi-k2-ep8-rank", "layer-qwen3-moe-30b-a3b",
                                               "layer-mixtral-8x7b"], "one record per table, never the same"
    assert [t.scope.split(":")[0] for t in tables] == [
        "the EP=1 layer", "one rank of EP=8 with a real plan's slots, whole layer",
        "one rank of EP=8 with a real plan's slots, whole layer", "the EP=1 layer of qwen3-moe-30b-a3b",
        "the EP=1 layer of mixtral-8x7b"]
    assert [t.bounds for t in tables] == [LAYER_TARGETS, EP_RANK_TARGETS, EP_RANK_TARGETS,
                                          MODEL_LAYER_TARGETS["qwen3-moe-30b-a3b"],
                                          MODEL_LAYER_TARGETS["mixtral-8x7b"]]
    assert make_table("mixtral-8x7b", None, {"tokens": 64}).bounds == LAYER_TARGETS  # custom shapes


def test_make_table_overrides_and_errors():
    table = make_table("deepseek-v3", None, {"tokens": 4096, "experts": 64})
    assert (table.tokens, table.experts, table.hidden) == (4096, 64, 7168), "the rest stays the model's"
    assert table.overrides == (("tokens", 4096), ("experts", 64))
    assert table.label == "deepseek-v3 EP=1, tokens=4096, experts=64"
    assert table.record_name == "layer-deepseek-v3-custom"
    assert table.scope.startswith("custom shapes")
    skewed = make_table("deepseek-v3", 8, {}, 20.0)
    assert (skewed.maxvio, skewed.label) == (20.0, "deepseek-v3 one rank of EP=8 at maxvio 20")
    assert skewed.record_name == "layer-deepseek-v3-ep8-rank-maxvio20", "not the maxvio 0 record's name"
    assert make_table("deepseek-v3", None, {}, 20.0).maxvio == 0.0, "no EP rank, no group to skew"
    with pytest.raises(ValueError, match="--ep-rank-of 3"):
        make_table("deepseek-v3", 3, {})
    with pytest.raises(ValueError, match="overrides must be among"):
        make_table("deepseek-v3", None, {"layers": 3})


def test_layer_targets_from_the_default_row():
    """DeepSeek-V3 at EP=1 against 0.65 of dense for the step, 0.75 for the forward and 0.9x the compiled
    layer's peak: a step of 30 (28-33) ms at the dense rate that makes it exactly 0.65 (the bound passes);
    the forward in 11 (9-12) ms, 0.59 of dense (a miss); 40 GiB against the compiled layer's 44 (0.909x, a
    miss, though 0.8x the eager baseline's 50)."""
    flops = {"fwd_bwd": routed_flops(8192, 8, 7168, 2048, backward=True),
             "fwd": routed_flops(8192, 8, 7168, 2048, backward=False)}
    dense = flops["fwd_bwd"] / 0.65 / 30e-3  # so that 30 ms is exactly 0.65 of dense
    row = {"layer": "moonep DEFAULT", "ms": 30.0, "ms_min": 28.0, "ms_max": 33.0, "fwd_ms": 11.0,
           "fwd_ms_min": 9.0, "fwd_ms_max": 12.0, "peak_gib": 40.0}
    eager = {"layer": "torch-native", "peak_gib": 50.0}
    compiled = {"layer": "torch-native compiled", "peak_gib": 44.0}
    targets = {t["target"]: t for t in layer_targets(row, eager, flops, dense, "the EP=1 layer",
                                                     compiled=compiled)}
    assert [(name, t["op"], t["bound"]) for name, t in targets.items()] == list(LAYER_TARGETS) == [
        ("fwd+bwd of dense", ">=", 0.65), ("fwd of dense", ">=", 0.75), ("peak vs compiled", "<=", 0.9)]
    step = targets["fwd+bwd of dense"]
    assert (step["median"], step["min"], step["max"]) == pytest.approx((0.65, 0.65 * 30 / 33, 0.65 * 30 / 28))
    assert step["pass"], "the bound itself passes"
    fwd = targets["fwd of dense"]
    fwd_rate = flops["fwd"] / dense / 11e-3
    assert fwd["median"] == pytest.approx(fwd_rate) and fwd["min"] == pytest.approx(fwd_rate * 11 / 12)
    assert fwd_rate < 0.75 and not fwd["pass"]
    peak = targets["peak vs compiled"]
    assert (peak["median"], peak["min"], peak["max"]) == pytest.approx((40 / 44,) * 3)
    assert not peak["pass"], "0.909 > 0.9: over the compiled layer's peak, not the eager baseline's (0.8)"
    assert [(t["row"], t["baseline"], t["scope"]) for t in targets.values()] == [
        ("moonep DEFAULT", "torch-native", "the EP=1 layer")] * 2 + [
        ("moonep DEFAULT", "torch-native compiled", "the EP=1 layer")]


def test_ep_rank_targets_check_the_peak_against_the_compiled_layer_only_where_it_ran(capsys):
    """One EP rank: 0.80 of dense, and the peak over torch-native compiled's (not the faster baseline's)."""
    flops = {"fwd_bwd": routed_flops(8192, 8, 7168, 2048, backward=True),
             "fwd": routed_flops(8192, 8, 7168, 2048, backward=False)}
    dense = flops["fwd_bwd"] / 0.8 / 25e-3  # 25 ms is exactly 0.80 of dense
    row = {"layer": "EP rank DEFAULT", "ms": 25.0, "ms_min": 24.0, "ms_max": 27.0, "fwd_ms": 9.0,
           "fwd_ms_min": 8.0, "fwd_ms_max": 10.0, "peak_gib": 12.0}
    eager, compiled = {"layer": "torch-native", "peak_gib": 13.0}, {"layer": "torch-native compiled",
                                                                    "peak_gib": 11.0}
    targets = layer_targets(row, eager, flops, dense, "one rank", EP_RANK_TARGETS, compiled)
    assert [(t["target"], t["baseline"], t["pass"]) for t in targets] == [
        ("fwd+bwd of dense", "torch-native", True), ("peak vs compiled", "torch-native compiled", False)]
    assert targets[1]["median"] == pytest.approx(12 / 11)
    alone = layer_targets(row, eager, flops, dense, "one rank", EP_RANK_TARGETS)
    assert [t["target"] for t in alone] == ["fwd+bwd of dense"]
    assert "'peak vs compiled' not checked: no torch-native compiled row" in capsys.readouterr().out


def test_table_variants_default_to_none_for_several_tables():
    one = variant_settings(["auto", "triton", "torch", "deep_gemm"], ["auto"], [])
    assert table_variants(None, None, [], tables=1) == one
    assert table_variants(None, None, [16], tables=5) == [], "--model all: baselines and DEFAULT rows"
    assert table_variants(["torch"], None, [], 5) == [{"grouped_gemm": "torch", "expert_grad_dtype": "param"}]
    assert table_variants([], ["auto"], [], 1) == [{"grouped_gemm": "auto", "expert_grad_dtype": "main_grad"}]


def test_fp8_rows_come_right_after_default_with_precision_fp8_and_padding_128():
    """The fp8 row, then the DEFAULT config and the fp8 one with `PER_STEP` micro-batches per optimizer step
    (`MICRO_BATCHES`, not a config field), the latter also in main_grad, without and with FP8 weight
    gradients, then the fp8 one with its tokens dispatched as FP8."""
    one = variant_settings(["auto", "triton", "torch", "deep_gemm"], ["auto"], [])
    per_step = {**FP8_SETTINGS, MICRO_BATCHES: PER_STEP}
    main_grad = {**per_step, "expert_grad_dtype": "main_grad"}
    fp8_rows = [FP8_SETTINGS, {MICRO_BATCHES: PER_STEP}, per_step, main_grad,
                {**main_grad, "fp8_wgrad": True}, {**FP8_SETTINGS, "fp8_dispatch": True}]
    assert table_variants(None, None, [], tables=1, fp8=True) == [*fp8_rows, *one]
    assert table_variants([], [], [], tables=1, fp8=True) == fp8_rows, "--backends --main-grad-backends"
    assert table_variants(None, None, [], tables=5, fp8=True) == fp8_rows
    cfg = MoEConfig(**make_table("deepseek-v3", None, {}).shapes, **FP8_SETTINGS)
    default = MoEConfig(**make_table("deepseek-v3", None, {}).shapes)
    assert (cfg.precision, cfg.token_padding, cfg.grouped_gemm) == ("fp8", 128, default.grouped_gemm)
    assert cfg.model_copy(update={"precision": "bf16", "token_padding": default.token_padding}) == default, \
        "the DEFAULT config but for precision and padding"


def test_per_step_rows_run_their_config_with_micro_batches(monkeypatch):
    """`run_all_ours` strips `MICRO_BATCHES` from the config and runs that row with it: the DEFAULT config
    so is a DEFAULT row (the fp8 per-step row's bf16 reference), named for its micro-batches, and neither
    is taken for a repeat of the one-micro-batch row of its config."""
    import bench.layer as layer_bench

    calls = []
    monkeypatch.setattr(layer_bench, "run_ours", lambda cfg, name, default, bench, profiles, epn, micro:
                        calls.append((cfg, name, default, micro)) or {"layer": name})
    table = make_table("deepseek-v3", None, {})
    variants = [FP8_SETTINGS, {MICRO_BATCHES: PER_STEP}, {**FP8_SETTINGS, MICRO_BATCHES: PER_STEP}]
    assert len(list(layer_bench.run_all_ours(None, table, variants, None))) == 4
    (default_cfg, _, first, one), (fp8_cfg, _, fp8_default, fp8_one) = calls[:2]
    (bf16_cfg, bf16_name, bf16_default, four), (fp8_step_cfg, fp8_name, fp8_step_default, fp8_four) = \
        calls[2:]
    assert (one, fp8_one, four, fp8_four) == (1, 1, PER_STEP, PER_STEP)
    calls.clear()
    list(layer_bench.run_all_ours(None, table, layer_bench.FP8_VARIANTS, None))
    names = [name for _, name, _, _ in calls]
    assert len(calls) == 1 + len(layer_bench.FP8_VARIANTS) and len(set(names)) == len(names), \
        f"every fp8 row runs under a name of its own (profiles are keyed by it): {names}"
    assert sum("fp8 wgrad" in name for name in names) == 1
    assert (first, fp8_default, bf16_default, fp8_step_default) == (True, False, True, False)
    assert bf16_cfg == default_cfg and fp8_step_cfg == fp8_cfg and fp8_cfg.precision == "fp8"
    assert bf16_name.startswith("moonep DEFAULT") and fp8_name.endswith(f"{PER_STEP} micro-batches)")
    plain = {MICRO_BATCHES: 1, "fp8_dispatch": False, "fp8_wgrad": False, "expert_grad_dtype": "param"}
    assert fp8_scope({**plain, MICRO_BATCHES: PER_STEP}) == \
        f"the fp8 layer, {PER_STEP} micro-batches per optimizer step"
    assert fp8_scope(plain) == "the fp8 layer"
    assert fp8_scope({**plain, "fp8_dispatch": True}) == "the fp8 layer, tokens dispatched as FP8"
    assert fp8_scope({**plain, "fp8_wgrad": True, "expert_grad_dtype": "main_grad"}) == \
        "the fp8 layer, FP8 weight gradients, expert_grad_dtype main_grad"


def test_profile_covers_every_row_of_ours(monkeypatch):
    """With --profile every row of ours is profiled (DEFAULT, variants, fp8 rows), each into the same dict;
    without it none is."""
    import bench.layer as layer_bench

    calls = []
    monkeypatch.setattr(layer_bench, "run_ours", lambda cfg, name, default, bench, profiles, epn, micro:
                        calls.append(profiles) or {"layer": name})
    table = make_table("deepseek-v3", None, {})
    for profiles in ({}, None):
        calls.clear()
        rows = list(layer_bench.run_all_ours(None, table, [FP8_SETTINGS, {**FP8_SETTINGS, MICRO_BATCHES: 4}],
                                             profiles))
        assert len(rows) == len(calls) == 3
        assert all(seen is profiles for seen in calls)


def test_run_ours_profiles_the_step_and_of_one_micro_batch_the_inference_forward(monkeypatch):
    """`run_ours` with `profiles`: each row's step profile under its name and, for a row of one micro-batch
    (the rows whose inference forward is timed), its inference forward's under "<name>, inference";
    a row of several micro-batches gets no inference profile."""
    import bench.layer as layer_bench
    from moonep_moe.transport.threads import single_world

    monkeypatch.setattr(layer_bench, "single_world", lambda device: single_world("cpu"))

    class Measured:
        def measure(self, layer, before, micro_batches):
            return {"ms": 1.0}

        def profile(self, layer, micro_batches):
            return {"what": "step", "micro_batches": micro_batches}

        def profile_inference(self, layer):
            return {"what": "inference"}

    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2, max_tokens_per_rank=8,
                    dtype="float32")
    for micro_batches, names in ((1, ["one", "one, inference"]), (4, ["four"])):
        profiles = {}
        row = layer_bench.run_ours(cfg, names[0], True, Measured(), profiles, None, micro_batches)
        assert row["ms"] == 1.0 and list(profiles) == names, profiles
        assert profiles[names[0]] == {"what": "step", "micro_batches": micro_batches}


def test_step_accumulates_micro_batches_after_a_simulated_optimizer_step():
    """`step`: every parameter's version moves first (as after an optimizer step), the gradients are fresh,
    then N micro-batches accumulate: the gradients are N times one micro-batch's."""
    layer = torch.nn.Linear(4, 3)
    x, grad = torch.randn(5, 4, requires_grad=True), torch.randn(5, 3)
    step(layer, x, grad)
    one = layer.weight.grad.clone()
    versions = [p._version for p in layer.parameters()]
    step(layer, x, grad, micro_batches=3)
    assert [p._version for p in layer.parameters()] == [v + 1 for v in versions]
    torch.testing.assert_close(layer.weight.grad, 3 * one)


def test_fp8_layer_targets_against_our_bf16_row_and_torch_native():
    """The fp8 row at 18 (17-20) ms against DEFAULT's 30 (28-33) ms is 1.67x (1.4-1.94x) its speed; against
    the torch-native baseline's 50 (48-52) ms, 0.36x; its peak 42 GiB over DEFAULT's 40 is 1.05x (a miss);
    its inference forward, 8 (7-9) ms against DEFAULT's 10 (9-11), 1.25x (a miss)."""
    fp8 = {"layer": "moonep fp8", "ms": 18.0, "ms_min": 17.0, "ms_max": 20.0, "peak_gib": 42.0,
           "infer_ms": 8.0, "infer_ms_min": 7.0, "infer_ms_max": 9.0}
    default = {"layer": "moonep DEFAULT", "ms": 30.0, "ms_min": 28.0, "ms_max": 33.0, "peak_gib": 40.0,
               "infer_ms": 10.0, "infer_ms_min": 9.0, "infer_ms_max": 11.0}
    baseline = {"layer": "torch-native compiled", "ms": 50.0, "ms_min": 48.0, "ms_max": 52.0, "peak_gib": 6.0}
    targets = {t["target"]: t for t in fp8_layer_targets(fp8, default, baseline, "the fp8 layer")}
    assert [(t["target"], t["op"], t["bound"]) for t in targets.values()] == list(FP8_LAYER_TARGETS)
    assert [(op, bound) for _, op, bound in FP8_LAYER_TARGETS] == [(">=", 1.6), ("<=", 0.45), ("<=", 1.0),
                                                                   (">=", 1.5)]
    speed = targets["fp8 speed vs our bf16"]
    assert (speed["median"], speed["min"], speed["max"]) == pytest.approx((30 / 18, 28 / 20, 33 / 17))
    assert speed["pass"]
    native = targets["fp8 time vs torch-native bf16"]
    assert (native["median"], native["min"], native["max"]) == pytest.approx((18 / 50, 17 / 52, 20 / 48))
    assert native["pass"]
    peak = targets["fp8 peak vs our bf16"]
    assert peak["median"] == pytest.approx(1.05) and not peak["pass"]
    infer = targets["fp8 inference forward vs our bf16"]
    assert (infer["median"], infer["min"], infer["max"]) == pytest.approx((10 / 8, 9 / 9, 11 / 7))
    assert not infer["pass"]
    per_step = fp8_layer_targets({**fp8, "infer_ms": None}, default, baseline, "4 micro-batches",
                                 PER_STEP_FP8_TARGETS["ep1"])
    assert [t["target"] for t in per_step] == ["fp8 speed vs our bf16", "fp8 peak vs our bf16"], \
        "a per-step row has no inference timing and none is checked"
    assert {(t["row"], t["bf16_row"], t["baseline"], t["scope"]) for t in targets.values()} == {
        ("moonep fp8", "moonep DEFAULT", "torch-native compiled", "the fp8 layer")}
    slow = fp8_layer_targets({**fp8, "ms": 19.0}, default, baseline, "the fp8 layer")[0]
    assert not slow["pass"], "30 / 19 = 1.58 < 1.6"


def test_cpu_smoke_runs_every_model_table(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench.layer", "--device", "cpu", "--models", "all", "--tokens", "32"])
    main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cpu smoke")]
    assert [line.split(":")[0] for line in lines] == [
        "cpu smoke, deepseek-v3 EP=1, tokens=32, hidden=64, ffn=32",
        "cpu smoke, deepseek-v3 one rank of EP=8, tokens=32, hidden=64, ffn=32",
        "cpu smoke, kimi-k2 one rank of EP=8, tokens=32, hidden=64, ffn=32",
        "cpu smoke, qwen3-moe-30b-a3b EP=1, tokens=32, hidden=64, ffn=32",
        "cpu smoke, mixtral-8x7b EP=1, tokens=32, hidden=64, ffn=32"]
    assert re.search(r"256 routes; home \d+ of 32 groups, \d+ padded rows, slots \d+ of 32 groups", lines[1])
    assert re.search(r"256 routes; home \d+ of 48 groups, \d+ padded rows, slots \d+ of 48 groups", lines[2])
    assert re.search(r"256 routes; experts \d+ of 128 groups", lines[3])
    assert re.search(r"64 routes; experts \d+ of 8 groups", lines[4]), "Mixtral's K=2 and E=8"


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "all", "--ep-rank-of", "8"], "--model all runs its own EP ranks"),
    (["--model", "kimi-k2", "--ep-rank-of", "5"], "--ep-rank-of 5"),
    (["--repeat", "4"], "--repeat must be >= 5"),
    (["--maxvio", "5"], "--maxvio: it skews the group of --ep-rank-of's rank"),
])
def test_bad_command_lines_fail_before_any_work(monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["bench.layer", "--device", "cpu", *argv])
    with pytest.raises(SystemExit):
        main()
    assert message in capsys.readouterr().err
