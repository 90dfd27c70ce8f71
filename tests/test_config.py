"""The config contract: packaged YAMLs validate, each rule names its field, derived sizes follow DESIGN.md."""

from pathlib import Path
from typing import Annotated, get_args, get_origin

import pydantic
import pytest
import torch

from moonep_moe.apps.train import TrainSection, load_train_config
from moonep_moe.base.sizes import align_up, cdiv, next_power_of_2
from moonep_moe.config import (
    CommConfig,
    MoEConfig,
    RouterConfig,
    SharedExpertConfig,
    available_configs,
    load_config,
)
from moonep_moe.config.models import BLOCK_PADDING_ROWS
from moonep_moe.engine.communicator import CommunicatorConfig

PACKAGED = ["deepseek-v3", "kimi-k2", "mixtral-8x7b", "qwen3-moe-30b-a3b", "tiny-cpu"]
REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"

BASE = dict(hidden_size=64, ffn_hidden_size=32, num_experts=16, top_k=4, ep_size=4, max_tokens_per_rank=128)


def make(**changes) -> MoEConfig:
    return MoEConfig(**{**BASE, **changes})


# --- packaged configs ---------------------------------------------------------------------------------


def test_available_configs_lists_every_packaged_yaml():
    assert available_configs() == PACKAGED


@pytest.mark.parametrize("name", PACKAGED)
def test_packaged_config_loads_by_name(name):
    cfg = load_config(name)
    assert isinstance(cfg, MoEConfig)
    assert cfg.num_experts % cfg.ep_size == 0
    assert cfg.rows_per_rank % cfg.token_padding == 0


@pytest.mark.parametrize("name", PACKAGED)
def test_repo_root_configs_path_is_the_same_file(name):
    assert load_config(REPO_CONFIGS / f"{name}.yaml") == load_config(name)
    assert load_config(str(REPO_CONFIGS / f"{name}.yaml")) == load_config(name)


def test_published_shapes():
    ds = load_config("deepseek-v3")
    assert (ds.hidden_size, ds.ffn_hidden_size, ds.num_experts, ds.top_k) == (7168, 2048, 256, 8)
    assert (ds.router.n_group, ds.router.topk_group, ds.router.score_function) == (8, 4, "sigmoid")
    assert ds.router.routed_scaling_factor == 2.5 and ds.router.expert_bias
    assert ds.shared_experts.num_shared_experts == 1 and ds.shared_experts.ffn_hidden_size == 2048

    kimi = load_config("kimi-k2")
    assert (kimi.num_experts, kimi.top_k, kimi.router.routed_scaling_factor) == (384, 8, 2.827)

    qwen = load_config("qwen3-moe-30b-a3b")
    assert (qwen.hidden_size, qwen.ffn_hidden_size, qwen.num_experts, qwen.top_k) == (2048, 768, 128, 8)
    assert qwen.shared_experts.num_shared_experts == 0

    mix = load_config("mixtral-8x7b")
    assert (mix.hidden_size, mix.ffn_hidden_size, mix.num_experts, mix.top_k) == (4096, 14336, 8, 2)


def test_tiny_cpu_fits_the_demo():
    """The demo runs 4 thread-ranks in float32 and sweeps routing skew up to maxvio 20, which needs
    E / K - 1 >= 20 (every token on the same K experts gives maxvio E / K - 1)."""
    cfg = load_config("tiny-cpu")
    assert cfg.ep_size == 4 and cfg.torch_dtype is torch.float32
    assert cfg.num_experts / cfg.top_k - 1 >= 20


# --- load_config: names, paths, overrides ---------------------------------------------------------------


def test_unknown_name_lists_available_names():
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        load_config("no-such-model")
    for name in PACKAGED:
        assert name in str(info.value)


def test_missing_file_path():
    with pytest.raises(FileNotFoundError, match="nowhere.yaml"):
        load_config("/nowhere/nowhere.yaml")


def test_overrides_apply_before_validation():
    cfg = load_config("tiny-cpu", ep_size=2)
    assert cfg.ep_size == 2 and cfg.experts_per_rank == 32 and cfg.prefetch_slots == 32
    with pytest.raises(pydantic.ValidationError, match="ep_size"):
        load_config("tiny-cpu", ep_size=3)


def test_nested_override_merges_into_yaml_dict():
    cfg = load_config("deepseek-v3", router={"aux_loss_coeff": 0.01})
    assert cfg.router.aux_loss_coeff == 0.01
    assert cfg.router.n_group == 8 and cfg.router.score_function == "sigmoid"


def test_unknown_override_key_is_named():
    with pytest.raises(pydantic.ValidationError, match="num_expert"):
        load_config("tiny-cpu", num_expert=8)


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(path)


@pytest.mark.parametrize("text, where", [
    ("hidden_size: 8\nrouter:\n  score_function: [softmax\n", "line 4, column 1"),
    ("hidden_size: 8\n  top_k: 2\n", "line 2, column 8"),
    ("hidden_size: 8\n\ttop_k: 2\n", "line 2, column 1"),
], ids=["unclosed-list", "bad-indent", "tab"])
def test_yaml_syntax_error_names_the_file_and_line_on_one_line(tmp_path, text, where):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="invalid YAML") as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}, {where}: invalid YAML: ") and "\n" not in str(info.value)


def test_training_and_layer_configs_are_told_apart():
    assert available_configs("train") == ["small-transformer", "tiny-transformer"]
    with pytest.raises(ValueError, match="'tiny-transformer' is a training config, not a layer config"):
        load_config("tiny-transformer")
    with pytest.raises(ValueError, match="'tiny-cpu' is a layer config, not a training config"):
        load_train_config("tiny-cpu")


def test_unknown_yaml_key_is_named(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(
        "hidden_size: 8\nffn_hidden_size: 8\nnum_experts: 4\ntop_k: 1\nmax_tokens_per_rank: 4\n"
        "router:\n  scoring_func: sigmoid\n"
    )
    with pytest.raises(pydantic.ValidationError, match="scoring_func"):
        load_config(path)


def test_config_is_frozen():
    cfg = make()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.ep_size = 2


# --- validators: one rule each, the error names the field ------------------------------------------------


SIZE_FIELDS = ["hidden_size", "ffn_hidden_size", "num_experts", "top_k", "ep_size", "max_tokens_per_rank"]


@pytest.mark.parametrize("field", [*SIZE_FIELDS, "token_padding"])
def test_sizes_must_be_positive(field):
    with pytest.raises(pydantic.ValidationError, match=field):
        make(**{field: 0})


def test_required_fields_are_named():
    with pytest.raises(pydantic.ValidationError, match="max_tokens_per_rank"):
        MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=1)


def test_num_experts_divisible_by_ep_size():
    message = r"num_experts \(E=16\) must be divisible by ep_size \(R=3\)"
    with pytest.raises(pydantic.ValidationError, match=message):
        make(ep_size=3)


def test_top_k_at_most_num_experts():
    with pytest.raises(pydantic.ValidationError, match=r"top_k \(K=17\)"):
        make(top_k=17)


def test_prefetch_slots_not_negative():
    with pytest.raises(pydantic.ValidationError, match="num_prefetch_slots"):
        make(num_prefetch_slots=-1)


def test_prefetch_slots_at_most_remote_experts():
    make(num_prefetch_slots=12)
    with pytest.raises(pydantic.ValidationError, match=r"num_prefetch_slots \(B=13\) must be <= .* = 12"):
        make(num_prefetch_slots=13)


def test_single_rank_allows_no_prefetch_slots():
    with pytest.raises(pydantic.ValidationError, match=r"num_prefetch_slots \(B=1\)"):
        make(ep_size=1, num_prefetch_slots=1)


def test_comm_config_is_the_layer_configs_comm_part():
    """`MoEConfig.comm` holds the fields the comm core needs, with the layer's values, and derives the same
    sizes; the YAML keys stay flat."""
    cfg = load_config("tiny-cpu", ep_size=2)
    comm = cfg.comm
    assert type(comm) is CommConfig and isinstance(cfg, CommConfig)
    assert comm.model_dump() == {name: getattr(cfg, name) for name in CommConfig.model_fields}
    assert (comm.token_padding, comm.ep_size) == (8, 2), "tiny-cpu's own tp, the override's R"
    for size in ("experts_per_rank", "prefetch_slots", "routes_per_rank", "rows_per_rank", "torch_dtype"):
        assert getattr(comm, size) == getattr(cfg, size), size


LAYOUT_ERRORS = [  # (E, R, K, B), the message every config names its fields in
    ((16, 3, 4, None), r"num_experts \(E=16\) must be divisible by ep_size \(R=3\)"),
    ((16, 4, 17, None), r"top_k \(K=17\) must be <= num_experts \(E=16\)"),
    ((16, 4, 4, 13), r"num_prefetch_slots \(B=13\) must be <= E - E/R = 16 - 4 = 12"),
]


@pytest.mark.parametrize(("layout", "message"), LAYOUT_ERRORS)
def test_layout_is_checked_once_for_every_config(layout, message):
    """MoEConfig, CommConfig and the communicator's config run the one layout check (`check_layout`)."""
    E, R, K, B = layout
    fields = dict(hidden_size=64, num_experts=E, top_k=K, ep_size=R, num_prefetch_slots=B,
                  max_tokens_per_rank=128)
    for model in (CommConfig, CommunicatorConfig, MoEConfig):
        extra = dict(ffn_hidden_size=32) if model is MoEConfig else {}
        with pytest.raises(pydantic.ValidationError, match=message):
            model(**fields, **extra)


def test_n_group_must_divide_num_experts():
    with pytest.raises(pydantic.ValidationError, match="n_group"):
        make(router=RouterConfig(n_group=3, topk_group=1))


def test_top_k_fits_in_selected_groups():
    make(router=RouterConfig(n_group=4, topk_group=1))  # 4 experts per group >= K = 4
    with pytest.raises(pydantic.ValidationError, match="topk_group"):
        make(top_k=5, router=RouterConfig(n_group=4, topk_group=1))


def test_topk_group_at_most_n_group():
    with pytest.raises(pydantic.ValidationError, match="topk_group"):
        RouterConfig(n_group=2, topk_group=3)


@pytest.mark.parametrize("field", ["n_group", "topk_group"])
def test_router_group_counts_positive(field):
    with pytest.raises(pydantic.ValidationError, match=field):
        RouterConfig(**{field: 0})


@pytest.mark.parametrize("field", ["expert_bias_update_rate", "aux_loss_coeff", "routed_scaling_factor"])
def test_router_rates_not_negative(field):
    with pytest.raises(pydantic.ValidationError, match=field):
        RouterConfig(**{field: -0.1})


def test_router_score_function_choices():
    with pytest.raises(pydantic.ValidationError, match="score_function"):
        RouterConfig(score_function="relu")


def test_shared_expert_sizes():
    with pytest.raises(pydantic.ValidationError, match="num_shared_experts"):
        SharedExpertConfig(num_shared_experts=-1)
    with pytest.raises(pydantic.ValidationError, match="ffn_hidden_size"):
        SharedExpertConfig(num_shared_experts=1, ffn_hidden_size=0)


@pytest.mark.parametrize("field, value", [("dtype", "int8"), ("grouped_gemm", "cutlass"), ("world", "mpi")])
def test_literal_fields_are_named(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        make(**{field: value})


def test_deep_gemm_needs_bfloat16():
    make(grouped_gemm="deep_gemm", dtype="bfloat16")
    with pytest.raises(pydantic.ValidationError, match="dtype"):
        make(grouped_gemm="deep_gemm", dtype="float32")


# --- values YAML and Python would take silently: duplicate keys, non-finite floats, bools for ints -------


@pytest.mark.parametrize("text, key, lines", [
    ("hidden_size: 8\ntop_k: 2\nnum_experts: 4\ntop_k: 1\n", "top_k", (2, 4)),
    ("hidden_size: 8\nrouter:\n  n_group: 2\n  dtype: float32\n  n_group: 4\n", "n_group", (3, 5)),
], ids=["top-level", "nested"])
def test_duplicate_yaml_key_names_the_key_and_both_lines(tmp_path, text, key, lines):
    """YAML lets the last of two equal keys win without a word; the loader refuses them instead."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line {lines[1]}, column ") and "\n" not in message
    assert f"duplicate key {key!r} (first on line {lines[0]})" in message


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    """A key given beside a `<<` merge overrides the merged one, as YAML means: not a duplicate."""
    path = tmp_path / "merge.yaml"
    path.write_text("hidden_size: 8\nffn_hidden_size: 8\nnum_experts: 4\ntop_k: 1\nmax_tokens_per_rank: 4\n"
                    "router:\n  <<: {n_group: 2, score_function: sigmoid}\n  n_group: 1\n")
    router = load_config(path).router
    assert (router.n_group, router.score_function) == (1, "sigmoid")


CONFIG_MODELS = {  # every config model, with the fields that make it valid
    RouterConfig: {}, SharedExpertConfig: {}, TrainSection: {}, MoEConfig: BASE,
    CommConfig: {k: v for k, v in BASE.items() if k != "ffn_hidden_size"},
    CommunicatorConfig: {k: v for k, v in BASE.items() if k != "ffn_hidden_size"},
}


def fields_of_type(kind: type) -> list[tuple[type, str]]:
    """`(model, field)` for every field of every config model that takes `kind` (alone, optional, or
    annotated with constraints)."""
    def types(annotation) -> set:
        if get_origin(annotation) is Annotated:
            return types(get_args(annotation)[0])
        args = get_args(annotation) if get_origin(annotation) is not None else ()
        return set().union(*map(types, args)) if args else {annotation}

    return [(model, name) for model in CONFIG_MODELS for name, info in model.model_fields.items()
            if kind in types(info.annotation)]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("model, field", fields_of_type(float), ids=lambda x: getattr(x, "__name__", x))
def test_float_fields_refuse_non_finite_values(model, field, value):
    with pytest.raises(pydantic.ValidationError, match=rf"{field}\n  Input should be a finite number"):
        model(**{**CONFIG_MODELS[model], field: value})


def test_non_finite_yaml_float_names_the_field(tmp_path):
    path = tmp_path / "inf.yaml"
    path.write_text("hidden_size: 8\nffn_hidden_size: 8\nnum_experts: 4\ntop_k: 1\nmax_tokens_per_rank: 4\n"
                    "router:\n  aux_loss_coeff: .inf\n")
    with pytest.raises(pydantic.ValidationError, match=r"router.aux_loss_coeff\n  Input should be a finite"):
        load_config(path)


@pytest.mark.parametrize("model, field", fields_of_type(int), ids=lambda x: getattr(x, "__name__", x))
def test_int_fields_refuse_bools(model, field):
    """`True` is an int to Python and to pydantic's lax mode: `ep_size: true` would be 1."""
    assert model(**CONFIG_MODELS[model])  # ints as YAML and Python give them
    with pytest.raises(pydantic.ValidationError, match=rf"{field}\n  Input should be a valid integer"):
        model(**{**CONFIG_MODELS[model], field: True})


def test_yaml_bool_for_an_int_names_the_field(tmp_path):
    path = tmp_path / "bool.yaml"
    path.write_text("hidden_size: 8\nffn_hidden_size: 8\nnum_experts: 4\ntop_k: 1\nmax_tokens_per_rank: 4\n"
                    "ep_size: true\n")
    with pytest.raises(pydantic.ValidationError, match=r"ep_size\n  Input should be a valid integer"):
        load_config(path)


# --- derived properties ---------------------------------------------------------------------------------


def test_experts_per_rank():
    assert make(ep_size=4).experts_per_rank == 4
    assert make(ep_size=1).experts_per_rank == 16


def test_prefetch_slots_default():
    assert make(ep_size=1).prefetch_slots == 0
    assert make(ep_size=4).prefetch_slots == 4
    assert make(ep_size=4, num_prefetch_slots=2).prefetch_slots == 2


def test_routes_per_rank():
    assert make().routes_per_rank == 128 * 4


def test_rows_per_rank_balanced():
    """B >= epn: S*K routes at most, plus < tp padding rows for each of the epn + B segments."""
    cfg = make(token_padding=8)  # S*K = 512, epn = B = 4
    assert cfg.rows_per_rank == align_up(512 + 7 * 8, 8) == 568
    cfg = make(token_padding=128, num_prefetch_slots=6)
    assert cfg.rows_per_rank == align_up(512 + 127 * 10, 128) == 1792


def test_rows_per_rank_best_effort():
    """B < epn: a rank may receive every route of the group, R*S*K."""
    cfg = make(token_padding=8, num_prefetch_slots=2)  # R*S*K = 2048, epn + B = 6
    assert cfg.rows_per_rank == align_up(4 * 512 + 7 * 6, 8) == 2096


def test_rows_per_rank_single_rank():
    cfg = make(ep_size=1, token_padding=8)  # B = 0 < epn = 16, but R*S*K = S*K
    assert cfg.rows_per_rank == align_up(512 + 7 * 16, 8) == 624


def test_torch_dtypes():
    assert make(dtype="bfloat16").torch_dtype is torch.bfloat16
    assert make(dtype="float64").torch_dtype is torch.float64
    assert RouterConfig().torch_dtype is torch.float32


def test_align_up():
    assert [align_up(x, 8) for x in (0, 1, 8, 9)] == [0, 8, 8, 16]


def test_next_power_of_2():
    assert [next_power_of_2(v) for v in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == [1, 1, 2, 4, 4, 8,
                                                                                       1024, 1024, 2048]


def test_host_launch_maths_equal_tritons():
    """`cdiv` and `next_power_of_2`, the launch maths the kernels' wrappers do on the host without a Triton
    call, give Triton's values (`next_power_of_2` of 0 is 1, where Triton's is 0: a block of 0 elements
    cannot launch)."""
    triton = pytest.importorskip("triton")
    for n in range(1, 3000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128, 4096):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert (cdiv(0, 7), next_power_of_2(0), next_power_of_2(2**40 + 1)) == (0, 1, 2**41)


def test_token_padding_defaults_to_128_where_blocks_are_needed_or_cheap_else_16():
    """DeepGEMM's M-block where it is the backend or with fp8; with "auto", 128 from `BLOCK_PADDING_ROWS`
    rows per home expert (S * K / epn) on, so DeepGEMM is a candidate where padding adds little, 16 below; an
    explicit value always wins (packaged production configs leave it out, so they get the default)."""
    assert make().token_padding == 16
    assert make(grouped_gemm="deep_gemm").token_padding == 128
    assert make(token_padding=8, grouped_gemm="deep_gemm").token_padding == 8
    rows = dict(num_experts=64, top_k=8, ep_size=8)  # epn = 8 home experts
    at = BLOCK_PADDING_ROWS  # tokens whose S * K / epn (K = epn = 8) is exactly BLOCK_PADDING_ROWS
    assert make(**rows, max_tokens_per_rank=at).token_padding == 128
    assert make(**rows, max_tokens_per_rank=at - 1).token_padding == 16
    assert make(**rows, max_tokens_per_rank=at, grouped_gemm="torch").token_padding == 16
    assert make(**rows, max_tokens_per_rank=at, token_padding=16).token_padding == 16
    for name in ("deepseek-v3", "kimi-k2", "mixtral-8x7b"):  # one EP=8 rank: 2048, 1365, 16384 rows an expert
        assert load_config(name).token_padding == 128
    assert load_config("deepseek-v3", ep_size=1).token_padding == 128  # 256 rows an expert
    assert load_config("qwen3-moe-30b-a3b", ep_size=1).token_padding == 128  # 512 rows an expert
    assert load_config("kimi-k2", ep_size=1).token_padding == 16  # 170 rows an expert
